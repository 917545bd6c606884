"""Readiness (``GET /health``) and liveness (``GET /live``) for a fleet.

The heartbeat first, on a clock the test moves: a loop that waits for work is never
stalled, one that has work counts from its last beat. Then a real batcher (the tiny test
model, one decode row) behind the app, in process: while it warms up it is alive and not
ready; ready once warmed up; idle for longer than the stall limit it stays alive; when its
decode step is made to hang with a request running, both probes fail once the limit has
passed, and recover when the step returns; when it loses a process both fail at once,
naming it.
"""

from __future__ import annotations

import threading
import time
import types

import jax
import pytest
from fastapi.testclient import TestClient

from jaxpar import InferenceEngine, ParallelConfig
from jaxpar.engine import ContinuousBatcher, Pulse
from jaxpar.errors import PeerLostError
from jaxpar.models import init_params, preset
from jaxpar.server import ServedModel, Service, create_app
from jaxpar.server._health import stalled_s
from jaxpar.spec import make_mesh

STALL_S = 0.5
WAIT_S = 60  # bounds every poll below (a busy 2-core machine)


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pulse_counts_a_stall_only_while_the_loop_has_work():
    clock = _Clock()
    pulse = Pulse(clock)
    clock.now += 50
    assert pulse.stalled_s() == 0  # not started
    pulse.beat()
    clock.now += 3
    assert pulse.stalled_s() == 3  # busy since its beat
    with pulse.waiting():
        clock.now += 1000
        assert pulse.stalled_s() == 0  # waiting for requests is not a stall
    assert pulse.stalled_s() == 0  # woken: it beat
    clock.now += 2.5
    assert pulse.stalled_s() == 2.5


def test_a_compile_is_not_a_stall():
    """A step waiting for a program compiled on first use is not stuck: no stall while any
    program compiles, and one counts from the compile's end."""
    clock = _Clock()
    steps = types.SimpleNamespace(compiling=False, compiled_at=0.0)
    engine = types.SimpleNamespace(steps=steps)
    batcher = types.SimpleNamespace(pulse=Pulse(clock), engine=engine, prefill_engine=engine)
    batcher.pulse.beat()
    steps.compiling = True
    clock.now += 120  # a long compile
    assert stalled_s(batcher) == 0
    steps.compiling, steps.compiled_at = False, clock.now
    clock.now += 2
    assert stalled_s(batcher) == 2  # since the compile ended, not since the beat


def _poll(http: TestClient, path: str, status: int) -> dict:
    deadline = time.monotonic() + WAIT_S
    while True:
        response = http.get(path)
        if response.status_code == status:
            return response.json()
        assert time.monotonic() < deadline, (path, response.status_code, response.text)
        time.sleep(0.02)


@pytest.fixture(scope="module")
def batcher():
    config = preset("tiny-gqa")
    parallel = ParallelConfig()
    engine = InferenceEngine(
        config,
        init_params(config),
        parallel,
        mesh=make_mesh(parallel, jax.devices()[:1]),
        max_batch=1,
        max_seq_len=32,
    )
    return ContinuousBatcher(engine, prefill_batch=1)


def test_probes_of_a_warming_idle_stuck_and_lost_server(batcher):
    gate, hang, hung, release = (threading.Event() for _ in range(4))
    decode = batcher.core.decode

    def decode_that_hangs(pending):
        if hang.is_set():
            hung.set()
            release.wait(WAIT_S)  # the step never returns until the test releases it
        return decode(pending)

    batcher.core.decode = decode_that_hangs

    def warmup():
        gate.wait(WAIT_S)
        batcher.warmup([4])

    app = create_app(Service(batcher, ServedModel(name="m")), warmup=warmup, stall_timeout=STALL_S)
    with TestClient(app) as http:
        # Warming up: alive, not ready.
        assert http.get("/live").status_code == 200
        assert "warming up" in http.get("/health").json()["status"]
        gate.set()
        _poll(http, "/health", 200)
        # Idle for longer than the stall limit: still alive and ready.
        time.sleep(2 * STALL_S)  # the one wait here: longer than the limit, doing nothing
        assert http.get("/live").json()["stalled_s"] == 0
        assert http.get("/health").status_code == 200
        # A request runs and its decode step hangs: both probes fail past the limit.
        stream = batcher.submit([1, 2, 3], max_tokens=8)
        next(iter(stream))  # prefilled: it decodes now
        hang.set()
        assert hung.wait(WAIT_S)
        dead = _poll(http, "/live", 503)
        assert "without finishing a step" in dead["status"]
        assert "decode loop" in _poll(http, "/health", 503)["status"]
        # The step returns: the loop comes round and the server is alive and ready again.
        hang.clear()
        release.set()
        assert stream.result(timeout=WAIT_S) and stream.finish_reason == "length"
        _poll(http, "/live", 200)
        _poll(http, "/health", 200)
        # A lost process: both fail at once, naming it.
        batcher.fail(PeerLostError("process 1 of 2 stopped sending heartbeats"))
        for path in ("/live", "/health"):
            response = http.get(path)
            assert response.status_code == 503
            assert "process 1 of 2" in response.json()["status"]
