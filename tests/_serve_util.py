"""Helpers for the server tests: a ``jaxpar serve`` subprocess, and offline references.

:class:`ServerProcess` runs this checkout's ``python -m jaxpar.cli serve`` on a free port
of 127.0.0.1 (its log in a file, so a full pipe never blocks it), waits for ``/health``
to say 200, and ends the process when the test is done: SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jax

from jaxpar.engine import Sampling, engine_from_hf
from jaxpar.engine._text import chat_template, generation_defaults, load_tokenizer
from jaxpar.spec import ParallelConfig, make_mesh

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "tests" / "fixtures" / "llama_chat"
MODEL = "llama_chat"  # the served name: the checkpoint directory's
MAX_SEQ_LEN = 64
READY_TIMEOUT_S = 300  # start-up + warmup on a busy 2-core machine
#: Offline references are this long (greedy: a shorter run is a prefix of it).
REFERENCE_TOKENS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``jaxpar [--cpu-devices N] serve --hf CHECKPOINT ... --port P`` in a subprocess."""

    def __init__(
        self,
        serve_args: list[str],
        *,
        cpu_devices: int,
        log_dir: Path,
        global_args: tuple[str, ...] = (),
        log_level: str = "warning",
        env: dict[str, str | None] | None = None,
    ):
        """``env``: variables to set for the server (None: unset)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"serve-{self.port}.log"
        extra_env = env
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)  # --cpu-devices sets the device count
        for name, value in (extra_env or {}).items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        command = [sys.executable, "-m", "jaxpar.cli", "--cpu-devices", str(cpu_devices)]
        command += [*global_args, "serve", *serve_args, "--port", str(self.port)]
        command += ["--log-level", log_level]
        self.command = command
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self._ready = False

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> ServerProcess:
        """Blocks until ``GET /health`` is 200 (the server is warmed up)."""
        deadline = time.monotonic() + timeout
        while not self._ready:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")
            with contextlib.suppress(httpx.TransportError):
                self._ready = httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            time.sleep(0.25)
        return self

    def health(self) -> dict:
        response = httpx.get(f"{self.url}/health", timeout=10)
        assert response.status_code == 200, response.text
        return response.json()

    def wait_idle(self, timeout: float = 30) -> dict:
        """``/health`` once nothing is queued or running."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.health()
            if not status["active"] and not status["queued"]:
                return status
            assert time.monotonic() < deadline, f"server still busy: {status}"
            time.sleep(0.05)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def process_pair(serve_args: list[str], log_dir: Path, log_level: str = "warning"):
    """``jaxpar serve`` as processes 0 and 1 of one job (jax.distributed on 127.0.0.1),
    4 simulated CPU devices each: process 0 serves HTTP, process 1 replays."""
    coordinator = f"127.0.0.1:{free_port()}"
    return [
        ServerProcess(
            serve_args,
            cpu_devices=4,
            log_dir=log_dir,
            global_args=("--coordinator", coordinator, "--num-processes", "2")
            + ("--process-id", str(i)),
            log_level=log_level,
        )
        for i in range(2)
    ]


class Offline:
    """``InferenceEngine.generate`` on one device with the served checkpoint."""

    def __init__(self):
        parallel = ParallelConfig()
        mesh = make_mesh(parallel, jax.devices()[:1])
        self.engine = engine_from_hf(
            CHECKPOINT, parallel, max_batch=1, max_seq_len=MAX_SEQ_LEN, mesh=mesh
        )
        self.tokenizer = load_tokenizer(CHECKPOINT)
        self.defaults = generation_defaults(CHECKPOINT)
        self.template = chat_template(CHECKPOINT, self.tokenizer, self.defaults)
        self.eos = self.defaults.eos_token_ids
        self._greedy = functools.cache(self._greedy_run)

    def warm(self) -> Offline:
        """Compiles ``generate`` for the prompt buckets (while a server warms up)."""
        for length in (1, 9, 17):  # buckets 8, 16, 32
            self.greedy([1] * length, 1)
        return self

    def _greedy_run(self, prompt: tuple[int, ...]) -> list[int]:
        return self.engine.generate([list(prompt)], REFERENCE_TOKENS, stop_tokens=()).tokens[0]

    def expected(self, body: dict) -> list[int]:
        """What one device answers a completions ``body`` (greedy, or seeded sampling with
        its temperature and top-k), token for token, ignoring EOS."""
        if body["temperature"] == 0.0:
            return self.greedy(body["prompt"], body["max_tokens"], eos=False)
        sampling = Sampling(temperature=body["temperature"], top_k=body["top_k"])
        out = self.engine.generate(
            [body["prompt"]],
            body["max_tokens"],
            sampling=sampling,
            seed=body["seed"],
            stop_tokens=(),
        )
        return out.tokens[0]

    def greedy(self, prompt: list[int], n: int, *, eos: bool = True) -> list[int]:
        """The first ``n`` greedy tokens (ending at the first EOS when ``eos``)."""
        assert n <= REFERENCE_TOKENS
        tokens = self._greedy(tuple(prompt))[:n]
        if eos:
            ends = [i for i, t in enumerate(tokens) if t in self.eos]
            tokens = tokens[: ends[0] + 1] if ends else tokens
        return tokens

    def sampled(self, prompt: list[int], n: int, sampling: Sampling, seed: int) -> list[int]:
        out = self.engine.generate([prompt], n, sampling=sampling, seed=seed, stop_tokens=self.eos)
        return out.tokens[0]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.template.render(messages)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t not in self.eos])


async def send_completion(http: httpx.AsyncClient, body: dict) -> tuple[int, list[int], str]:
    """(status, token ids, error text) of one completions request, streamed or not; a
    stream's error event counts as 503 when it names a lost process, else 500."""
    if not body["stream"]:
        response = await http.post("/v1/completions", json=body)
        if response.status_code != 200:
            return response.status_code, [], response.text
        return 200, response.json()["choices"][0]["token_ids"], ""
    tokens, error = [], ""
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return response.status_code, [], (await response.aread()).decode()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    error = json.dumps(event)
                    continue
                tokens += event["choices"][0].get("token_ids", [])
    status = 200 if not error else 503 if "process_lost" in error else 500
    return status, tokens, error


async def send_all(url: str, bodies: list[dict]) -> list:
    """:func:`send_completion` of every body at once, one connection each."""
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        return await asyncio.gather(*(send_completion(http, body) for body in bodies))


def sigterm_in_flight(url: str, proc: subprocess.Popen, body: dict) -> httpx.Response:
    """Posts a completion, SIGTERMs ``proc`` while it runs, and returns its response."""

    async def in_flight() -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            task = asyncio.create_task(http.post("/v1/completions", json=body))
            await asyncio.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            return await task

    return asyncio.run(in_flight())
