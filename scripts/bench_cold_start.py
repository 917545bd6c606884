"""Times a cold start of ``jaxpar serve``: process start to GET /health 200, and to the
first completed response (a request sent as soon as /health is 200), with an empty
persistent compile cache.

    .venv/bin/python scripts/make_llama1b_checkpoint.py /tmp/llama1b
    .venv/bin/python scripts/bench_cold_start.py /tmp/llama1b --warmup lazy

One CPU device (``--cpu-devices 1``), a fresh temporary compile cache; the server's log
goes to ``--log``, and it is stopped (SIGTERM) after the first response.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--warmup", choices=("full", "lazy"), default="lazy")
    parser.add_argument("--log", default="/tmp/cold_start.log")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    port, cache = _port(), tempfile.mkdtemp(prefix="jaxpar-cold-cache-")
    command = [sys.executable, "-m", "jaxpar.cli", "--cpu-devices", "1", "--compile-cache"]
    command += [cache, "serve", "--hf", args.checkpoint, "--port", str(port)]
    command += ["--warmup", args.warmup]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    with open(args.log, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None or time.monotonic() - start > args.timeout:
                raise SystemExit(f"server gone or too slow; see {args.log}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        health = time.monotonic() - start
        body = {"model": Path(args.checkpoint).name, "prompt": "t1 t2 t3 t4 t5", "max_tokens": 8}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=args.timeout)
        first = time.monotonic() - start
        print(
            f"warmup {args.warmup}: /health 200 after {health:.1f} s, first response "
            f"({response.status_code}, {response.json()['usage']['completion_tokens']} tokens) "
            f"after {first:.1f} s"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
