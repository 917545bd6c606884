"""The server's pieces in-process: incremental detokenisation, and engine failures.

No JAX here: a byte tokenizer (one token per UTF-8 byte) splits multi-byte characters
across tokens, and a stand-in batcher fails the way a real one reports a failed step.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
from fastapi.testclient import TestClient

from jaxpar.engine import BatcherStats, Request, RequestStream, Sampling
from jaxpar.errors import QueueFullError
from jaxpar.server import ServedModel, Service, TextStream, create_app

TEXT = "héllo wörld ✓ 日本"


def _bytes_decode(ids) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_never_splits_a_character():
    stream = TextStream(_bytes_decode)
    deltas = [stream.feed(b) for b in TEXT.encode()]
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d) == len(TEXT)  # each character once it is whole
    assert "".join(deltas) + stream.finish() == TEXT


def test_text_stream_flushes_an_incomplete_character_at_the_end():
    stream = TextStream(_bytes_decode)
    out = "".join(stream.feed(b) for b in "ab✓".encode()[:-1])
    assert out == "ab" and stream.finish() == "\ufffd"


@pytest.mark.parametrize("stop", ["wö", "✓", "lo w", "日本"])
def test_text_stream_stops_before_a_stop_string(stop):
    stream = TextStream(_bytes_decode, stop=["never", stop], skip={0})
    out = ""
    for b in [0, *TEXT.encode()]:  # 0: a stop token, which adds no text
        out += stream.feed(b)
        assert stop not in out
        if stream.stopped:
            break
    out += stream.finish()
    assert stream.stopped and out == TEXT[: TEXT.index(stop)]


def test_text_stream_holds_back_only_what_could_start_a_stop_string():
    stream = TextStream(_bytes_decode, stop=["xyz"])
    assert "".join(stream.feed(b) for b in b"abcxy") == "abc"
    assert stream.feed(ord("q")) == "xyq" and not stream.stopped


@dataclasses.dataclass
class _Engine:
    max_seq_len: int = 64


class FailingBatcher:
    """Takes requests, then fails every one as a failed decode step does."""

    def __init__(self):
        self.engine = _Engine()
        self.max_prompt_len = self.max_seq_len = 64
        self.slots, self.active, self.queued = 1, 0, 0
        self.stats = BatcherStats()
        self.failure = None
        self.warmed = threading.Event()

    def start(self):
        return self

    def warmup(self):
        self.warmed.set()

    def close(self, *, drain=False, timeout=None):
        pass

    def submit(self, prompt, *, max_tokens, sampling=None, seed=0, stop_tokens=()):
        if self.failure is not None:
            raise QueueFullError(f"the batcher stopped after an error: {self.failure!r}")
        request = Request(prompt=tuple(prompt), max_tokens=max_tokens, sampling=sampling)
        stream = RequestStream(0, request)
        stream.emit(65)
        self.failure = RuntimeError("decode step failed")
        stream.finish("error", self.failure)
        return stream


@pytest.fixture
def failing():
    batcher = FailingBatcher()
    model = ServedModel(name="m", sampling=Sampling())
    app = create_app(Service(batcher, model), warmup=batcher.warmup)
    with TestClient(app) as http:
        assert batcher.warmed.wait(10)
        yield http


def _ready(http: TestClient) -> None:
    for _ in range(100):
        if http.get("/health").status_code == 200:
            return
        threading.Event().wait(0.05)
    raise AssertionError("not ready")


def test_a_failed_step_is_a_500_then_503s(failing):
    _ready(failing)
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 4}
    first = failing.post("/v1/completions", json=body)
    assert first.status_code == 500
    assert "decode step failed" in first.json()["error"]["message"]
    again = failing.post("/v1/completions", json=body)
    assert again.status_code == 503 and "Retry-After" in again.headers
    assert failing.get("/health").status_code == 503


def test_a_failed_step_ends_a_stream_with_an_error_event(failing):
    _ready(failing)
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 4, "stream": True}
    with failing.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "decode step failed" in json.loads(events[-2])["error"]["message"]


def test_503_with_retry_after_until_warmed_up():
    batcher, gate = FailingBatcher(), threading.Event()
    app = create_app(Service(batcher, ServedModel(name="m")), warmup=lambda: gate.wait(10))
    with TestClient(app) as http:
        health = http.get("/health")
        assert health.status_code == 503 and "warming up" in health.json()["status"]
        early = http.post("/v1/completions", json={"model": "m", "prompt": [1], "max_tokens": 1})
        assert early.status_code == 503 and int(early.headers["Retry-After"]) >= 1
        gate.set()
        _ready(http)


def test_a_body_that_is_not_an_object_is_a_400():
    app = create_app(Service(FailingBatcher(), ServedModel(name="m")))
    with TestClient(app) as http:
        response = http.post("/v1/completions", json=[1, 2])
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
