"""``jaxpar serve``'s warm-up and shutdown, as processes: ``--warmup lazy`` answers a
request (200, not 503) while the rest of its programs still compile in the background;
SIGTERM stops a server at any time: during warm-up (exit 0 at once), and with a stream in
flight (it ends with its final chunk and ``[DONE]``, within ``--shutdown-timeout``).

The servers compile afresh (no persistent cache: a cache warmed by other tests would
finish the background compiles before the request is sent).
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests._serve_util import CHECKPOINT, MODEL, ServerProcess

pytestmark = pytest.mark.server

NO_CACHE = {"JAX_COMPILATION_CACHE_DIR": None}
SHUTDOWN_TIMEOUT_S = 0.5


def _server(tmp_path, mode: str) -> ServerProcess:
    return ServerProcess(
        ["--hf", str(CHECKPOINT), "--warmup", mode, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)],
        cpu_devices=1,
        log_dir=tmp_path,
        global_args=("--no-compile-cache",),
        log_level="info",
        env=NO_CACHE,
    )


def _wait_exit(server: ServerProcess, timeout: float) -> tuple[int, float]:
    start = time.monotonic()
    try:
        code = server.proc.wait(timeout)
    except Exception:
        server.proc.kill()
        raise
    return code, time.monotonic() - start


def test_lazy_warmup_serves_while_compiling_and_sigterm_ends_streams(tmp_path):
    server = _server(tmp_path, "lazy")
    try:
        server.wait_ready()
        warmup = server.health()["warmup"]
        assert warmup["compiled"] < warmup["buckets"], warmup  # still compiling
        # 12 tokens: a prefill bucket (16) the lazy warm-up had not waited for.
        body = {"model": MODEL, "prompt": [1] + [80] * 11, "max_tokens": 4, "ignore_eos": True}
        early = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert early.status_code == 200, early.text
        assert early.json()["usage"]["completion_tokens"] == 4
        assert "warm-up 1/" in server.log() and "serving after" in server.log()

        # A long stream in flight at SIGTERM: drained for --shutdown-timeout, then ended.
        body |= {"max_tokens": 200, "stream": True, "return_token_ids": True}
        chunks, done = [], False
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    break
            server.proc.send_signal(signal.SIGTERM)
            for line in lines:
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                done = done or line == "data: [DONE]"
        code, took = _wait_exit(server, 30)
    finally:
        server.stop()
    assert all("choices" in c for c in chunks), chunks[-2:]
    tokens = sum(len(c["choices"][0].get("token_ids", [])) for c in chunks)
    finish = chunks[-1]["choices"][0]["finish_reason"]
    assert done, server.log()
    assert finish in ("length", "shutdown"), chunks[-1]
    assert (finish == "length") == (tokens == 200)
    assert code == 0, server.log()
    assert took < SHUTDOWN_TIMEOUT_S + 10, f"exit took {took:.1f} s"
    assert "Traceback" not in server.log()


def test_sigterm_during_warmup_exits_0_at_once(tmp_path):
    server = _server(tmp_path, "full")
    try:
        deadline = time.monotonic() + 300
        while "warm-up 1/" not in server.log():  # compiling its programs, /health 503
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
        server.proc.send_signal(signal.SIGTERM)
        code, took = _wait_exit(server, 30)
    finally:
        server.stop()
    assert code == 0, server.log()
    assert took < 10, f"exit took {took:.1f} s"
