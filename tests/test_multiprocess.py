"""Multi-process runs: 2 processes x 4 simulated CPU devices on 127.0.0.1, gloo collectives.

Each process is ``tests/_mp_worker.py`` in its own environment, joined through
``jaxpar.engine._distributed.initialize``. The tokens of both processes must equal each
other and the 1-process, 8-device run (computed here: pytest already has 8 CPU devices);
a process whose peer dies must end with a clear error within 60 s instead of hanging.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jax
import pytest

from jaxpar.engine import _distributed
from jaxpar.engine._distributed import (
    PEER_LOST_EXIT_STATUS,
    DistributedError,
    PeerLostError,
    peer_failures,
)
from tests import _mp_worker as worker

WORKER = Path(worker.__file__)
ROOT = WORKER.parent.parent
N_PROCESSES = 2
LOCAL_DEVICES = 4
RUN_TIMEOUT_S = 420  # hard limit per launch: start-up, compiles on 2 shared cores, generate
DETECTION_LIMIT_S = 60  # a dead peer must be noticed within this (the bound)

pytestmark = [pytest.mark.server, pytest.mark.slow]


@dataclass
class Finished:
    """One worker after it ended: status, output, and when the test saw it end."""

    process_id: int
    returncode: int
    stdout: str
    stderr: str
    ended_at: float  # time.time() of the exit, as seen by polling

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def stamp(self, event: str) -> float:
        """The ``t=`` of the worker's ``EVENT ... t=<time.time()>`` log line."""
        match = re.search(rf"^{event}\b.* t=([0-9.]+)$", self.stdout, re.MULTILINE)
        assert match, f"process {self.process_id} never logged {event}:\n{self.tail()}"
        return float(match.group(1))

    def tail(self, chars: int = 3000) -> str:
        return f"exit status {self.returncode}\n--- stdout\n{self.stdout[-chars:]}\n--- stderr\n{self.stderr[-chars:]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env() -> dict[str, str]:
    """The pytest environment with CPU-only JAX and 4 devices per process."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={LOCAL_DEVICES}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"  # log lines reach the files before an abort
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


@contextlib.contextmanager
def _launch(
    mode: str, tmp_path: Path, env: dict[str, str] | None = None, port: int | None = None
) -> Iterator[list[subprocess.Popen]]:
    """Starts the workers (output to files, so full pipes never block them); always kills
    them. ``env``: variables added to :func:`_worker_env`'s; ``port``: the coordinator's
    (a free one if not given)."""
    port, env = port or _free_port(), _worker_env() | (env or {})
    procs: list[subprocess.Popen] = []
    files = []
    try:
        for pid in range(N_PROCESSES):
            out = open(tmp_path / f"{mode}-{pid}.out", "w+")  # noqa: SIM115 - closed below
            err = open(tmp_path / f"{mode}-{pid}.err", "w+")  # noqa: SIM115
            files += [out, err]
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), mode, str(pid), str(N_PROCESSES), str(port)],
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                )
            )
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait(timeout=30)
        for f in files:
            f.close()


def _wait_all(
    procs: list[subprocess.Popen], tmp_path: Path, mode: str, timeout_s: float
) -> list[Finished]:
    """Polls until every worker has ended (recording when), or fails after ``timeout_s``."""
    return _wait_modes({mode: procs}, tmp_path, timeout_s)[mode]


def _wait_modes(
    launched: dict[str, list[subprocess.Popen]], tmp_path: Path, timeout_s: float
) -> dict[str, list[Finished]]:
    """:func:`_wait_all` for several launches running at once, polled together (so that
    each worker's end is seen as it happens)."""
    deadline = time.monotonic() + timeout_s
    ended: dict[tuple[str, int], float] = {}
    workers = [
        (mode, pid, proc) for mode, procs in launched.items() for pid, proc in enumerate(procs)
    ]
    while len(ended) < len(workers):
        for mode, pid, proc in workers:
            if (mode, pid) not in ended and proc.poll() is not None:
                ended[mode, pid] = time.time()
        if time.monotonic() > deadline:
            running = [(mode, pid) for mode, pid, _ in workers if (mode, pid) not in ended]
            pytest.fail(
                f"processes {running} still running after {timeout_s} s:\n"
                + "\n".join(_read(tmp_path, mode, pid) for mode, pid in running)
            )
        time.sleep(0.1)
    return {
        mode: [
            Finished(pid, proc.returncode, *_outputs(tmp_path, mode, pid), ended[mode, pid])
            for pid, proc in enumerate(procs)
        ]
        for mode, procs in launched.items()
    }


def _outputs(tmp_path: Path, mode: str, pid: int) -> tuple[str, str]:
    return (
        (tmp_path / f"{mode}-{pid}.out").read_text(),
        (tmp_path / f"{mode}-{pid}.err").read_text(),
    )


def _read(tmp_path: Path, mode: str, pid: int) -> str:
    out, err = _outputs(tmp_path, mode, pid)
    return f"--- process {pid} stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"


def _result(finished: Finished) -> dict[str, list[list[int]]]:
    import json

    lines = [line for line in finished.stdout.splitlines() if line.startswith("RESULT ")]
    assert finished.returncode == 0 and len(lines) == 1, finished.tail()
    return json.loads(lines[0].removeprefix("RESULT "))


def test_two_processes_match_one_process(tmp_path):
    """Both processes get the tokens of the 1-process, 8-device run, streamed or not."""
    start = time.monotonic()
    with _launch("generate", tmp_path) as procs:
        finished = _wait_all(procs, tmp_path, "generate", RUN_TIMEOUT_S)
    print(f"2-process generate: {time.monotonic() - start:.1f} s")
    results = [_result(f) for f in finished]
    assert results[0] == results[1]

    assert jax.device_count() == 8 and jax.process_count() == 1
    for key, (name, strategy) in worker.STRATEGIES.items():
        reference = worker.tokens_for(name, strategy)
        assert results[0][key] == reference, key
        if key == worker.STREAMED:
            assert results[0][key + "+streamed"] == reference


def test_every_process_loads_its_programs_from_the_compile_cache(tmp_path):
    """Two starts on an empty compile cache. JAX writes entries from process 0 only, and
    on CPU a program's key differs per process, so process 1 used to compile everything at
    every start; it now keeps its own entries in ``<dir>/process-1``: the first start
    compiles on both processes, the second loads every program on both."""
    cache = tmp_path / "xla"
    starts = []
    for start in range(2):
        with _launch("compile-cache", tmp_path, {"JAXPAR_TEST_CACHE": str(cache)}) as procs:
            finished = _wait_all(procs, tmp_path, "compile-cache", RUN_TIMEOUT_S)
        lines = [
            next((x for x in f.stdout.splitlines() if x.startswith("CACHE ")), f.tail())
            for f in finished
        ]
        starts.append([line.split()[1:] for line in lines])
        print(f"start {start}: (directory, hits, misses) per process: {starts[-1]}")
    (cold0, cold1), (warm0, warm1) = starts
    assert [cold0[0], cold1[0]] == [str(cache), str(cache / "process-1")]
    assert int(cold0[2]) > 0 and int(cold1[2]) == int(cold0[2])  # each wrote its programs
    assert int(cold0[1]) == int(cold1[1]) == 0
    for warm in (warm0, warm1):
        assert (int(warm[1]), int(warm[2])) == (int(cold0[2]), 0), starts  # all loaded


DEAD_PEER_MODES = ("dead-during", "dead-before")


@pytest.fixture(scope="module")
def dead_peers(tmp_path_factory) -> dict[str, list[Finished]]:
    """Both dead-peer runs, launched together: each spends most of its time waiting for
    the survivor to give up (a collective's or the coordination service's timeout), which
    the other's work fills. Each has its own coordinator port and processes."""
    tmp_path = tmp_path_factory.mktemp("dead-peers")
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in DEAD_PEER_MODES]
        for s in sockets:  # held open together: two different free ports
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in sockets]
        for s in sockets:
            s.close()
        launched = {
            mode: stack.enter_context(_launch(mode, tmp_path, port=port))
            for mode, port in zip(DEAD_PEER_MODES, ports, strict=True)
        }
        return _wait_modes(launched, tmp_path, RUN_TIMEOUT_S)


@pytest.mark.parametrize("mode", DEAD_PEER_MODES)
def test_dead_peer_ends_the_survivor(dead_peers, mode):
    """Process 1 exits abruptly; process 0 must fail with a clear error within 60 s.

    ``dead-during``: the peer dies after a first generate; the survivor's next collective
    fails after the CPU collective timeout and becomes ``PeerLostError`` (its own exit
    status). ``dead-before``: the peer dies before any collective; the survivor is stuck
    setting up gloo and either that times out (``PeerLostError``) or the coordination
    service declares the peer dead (JAX aborts the survivor with its own message).
    """
    survivor, dead = dead_peers[mode]
    assert dead.returncode == worker.DEATH_EXIT_STATUS, dead.tail()
    detection_s = survivor.ended_at - dead.stamp("DYING")
    print(
        f"{mode}: survivor ended {detection_s:.1f} s after the peer died, status {survivor.returncode}"
    )

    assert "UNEXPECTED" not in survivor.stdout, survivor.tail()
    assert survivor.returncode != 0, survivor.tail()
    assert detection_s < DETECTION_LIMIT_S, survivor.tail()
    ours = survivor.returncode == PEER_LOST_EXIT_STATUS and re.search(
        r"PeerLostError: process 0 of 2 lost contact with a peer process", survivor.stderr
    )
    jaxs = re.search(
        r"another task died.*stopped sending heartbeats\):\s*1\b", survivor.stderr, re.DOTALL
    )
    if mode == "dead-during":
        assert ours, survivor.tail()  # the collective timeout comes well before the heartbeat
    else:
        assert ours or jaxs, survivor.tail()


def test_peer_failures_converts_only_lost_peers(monkeypatch):
    """In-process check of the translation (no second process needed)."""
    monkeypatch.setattr(_distributed, "_peer_lost", False)  # restored: no exit at pytest's end
    lost = jax.errors.JaxRuntimeError(
        "UNKNOWN: Gloo all-reduce failed: Connection closed by peer [10.0.0.2]:4242"
    )
    with pytest.raises(jax.errors.JaxRuntimeError), peer_failures():  # one process: unchanged
        raise lost
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with (
        pytest.raises(
            PeerLostError, match=r"lost contact.*Connection closed by peer \[10\.0\.0\.2\]"
        ),
        peer_failures(),
    ):
        raise lost
    assert _distributed._peer_lost
    other = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")
    with pytest.raises(jax.errors.JaxRuntimeError, match="out of memory"), peer_failures():
        raise other


def test_unreachable_coordinator_is_a_distributed_error():
    """A worker whose coordinator never answers raises instead of being aborted by JAX."""
    env = _worker_env()
    cmd = [sys.executable, str(WORKER), "no-coordinator", "1", "2", str(_free_port())]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "could not reach the coordinator at 127.0.0.1:" in done.stdout


def test_initialize_after_backends_started_is_refused():
    """This pytest process has used JAX already: joining a job now must be refused."""
    with pytest.raises(DistributedError, match="before any other JAX call"):
        _distributed.initialize("127.0.0.1:1", 2, 1)
