"""The server's pieces in-process: incremental detokenisation, engine failures, the
prompt tokens ``usage`` says came from the prefix cache, and logprobs, echo and penalties
as OpenAI spells them.

No JAX here: a byte tokenizer (one token per UTF-8 byte) splits multi-byte characters
across tokens, a stand-in batcher fails the way a real one reports a failed step, and
another answers at once with a stand-in prefix cache (the official ``openai`` client
reads its usage).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import types

import openai
import pytest
from fastapi.testclient import TestClient

from jaxpar.engine import (
    Admission,
    BatcherStats,
    Request,
    RequestStream,
    Sampling,
    TokenLogprob,
)
from jaxpar.errors import QueueFullError
from jaxpar.server import ServedModel, Service, TextStream, create_app
from jaxpar.server._logprobs import merge

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
        self.admission = Admission(vocab_size=1 << 16, max_seq_len=64)
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

    def lockstep_stats(self):  # one process
        return None

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


# --- usage.prompt_tokens_details: the prefix cache's share of the prompt ----------------


class _ByteTokenizer:
    """One token per UTF-8 byte."""

    def encode(self, text: str, add_special_tokens: bool = True) -> types.SimpleNamespace:
        return types.SimpleNamespace(ids=list(text.encode()))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return _bytes_decode(ids)


def _render_chat(messages: list[dict]) -> str:
    return "".join(f"<{m['role']}>{m['content']}" for m in messages)


class CachingBatcher(FailingBatcher):
    """Answers each request at once (``max_tokens`` tokens). Its stand-in prefix cache
    holds every prompt submitted before, in pages of :attr:`PAGE` tokens: a prompt's
    cached tokens are the whole pages it shares with one of them, short of its last token
    (which prefill must compute for the first token's logits)."""

    PAGE = 2

    def __init__(self):
        super().__init__()
        self.seen: list[list[int]] = []

    def cached(self, prompt: list[int]) -> int:
        shared = max((_common_prefix(prompt, seen) for seen in self.seen), default=0)
        shared = min(shared, len(prompt) - 1)
        return shared - shared % self.PAGE

    def submit(self, prompt, *, max_tokens, sampling=None, seed=0, stop_tokens=()):
        request = Request(prompt=tuple(prompt), max_tokens=max_tokens, sampling=sampling)
        stream = RequestStream(len(self.seen), request)
        stream.cached_tokens = self.cached(prompt)
        self.seen.append(list(prompt))
        for i in range(max_tokens):
            stream.emit(ord("a") + i % 26)  # the last one finishes it ("length")
        return stream


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture
def caching():
    """(the stand-in batcher, an ``openai`` client of its app, the app's test client)."""
    batcher = CachingBatcher()
    model = ServedModel(name="m", tokenizer=_ByteTokenizer(), render_chat=_render_chat)
    with TestClient(create_app(Service(batcher, model))) as http:
        _ready(http)
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
        )
        yield batcher, client, http


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(caching):
    _, client, http = caching
    first = client.completions.create(model="m", prompt="hello world!", max_tokens=3)
    assert (first.usage.prompt_tokens, _cached(first.usage)) == (12, 0)
    again = client.completions.create(model="m", prompt="hello world!", max_tokens=3)
    assert (again.usage.prompt_tokens, _cached(again.usage)) == (12, 10)  # 11 -> whole pages
    body = {"model": "m", "prompt": "hello there", "max_tokens": 2}
    usage = http.post("/v1/completions", json=body).json()["usage"]
    assert usage == {  # "hello " is 3 pages of 2
        "prompt_tokens": 11,
        "completion_tokens": 2,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 6},
    }
    messages = [{"role": "user", "content": "how are you?"}]  # 18 tokens rendered
    chats = [client.chat.completions.create(model="m", messages=messages) for _ in range(2)]
    assert [(c.usage.prompt_tokens, _cached(c.usage)) for c in chats] == [(18, 0), (18, 16)]


def test_cached_tokens_count_each_prompt_once_as_its_first_choice_saw_it(caching):
    """As ``prompt_tokens`` does: ``n`` choices share their prompt, counted once (the first
    choice's), and a list of prompts adds up."""
    _, client, _ = caching
    out = client.completions.create(model="m", prompt=["abcdef", "abcxyz"], n=2, max_tokens=1)
    # In the batcher, in order: abcdef (nothing cached), abcdef again (4 of 6 cached),
    # abcxyz (2: "ab" of "abc"), abcxyz again (4). The first choices count: 0 and 2.
    assert (out.usage.prompt_tokens, _cached(out.usage)) == (12, 0 + 2)
    assert out.usage.completion_tokens == 4


def test_the_streamed_usage_chunk_reports_cached_tokens(caching):
    _, client, _ = caching
    for _ in range(2):
        chunks = list(
            client.completions.create(
                model="m",
                prompt=["abcdef", "abcdef"],
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    assert not chunks[-1].choices
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, _cached(usage), usage.completion_tokens) == (12, 8, 6)
    assert all(c.usage is None for c in chunks[:-1])
    messages = [{"role": "user", "content": "abcdef"}]
    for _ in range(2):
        chunks = list(
            client.chat.completions.create(
                model="m", messages=messages, stream=True, stream_options={"include_usage": True}
            )
        )
    assert (chunks[-1].usage.prompt_tokens, _cached(chunks[-1].usage)) == (12, 10)


# --- logprobs, echo and penalties: the OpenAI spelling of what the engine returns -------


def _lp(token: int, i: int, top: int) -> TokenLogprob:
    """A stand-in logprob: token ``token`` at -(i + 1) / 2, its alternatives below it."""
    chosen = -(i + 1) / 2
    alternatives = [(token, chosen)] + [(ord("A") + k, chosen - 1 - k) for k in range(top)]
    return TokenLogprob(token, chosen, tuple(alternatives[:top]))


class LogprobBatcher(CachingBatcher):
    """Answers at once with the letters a, b, c, ... and stand-in logprobs when asked;
    keeps what it was asked for (:attr:`requests`)."""

    def __init__(self):
        super().__init__()
        self.requests: list[dict] = []

    def submit(self, prompt, *, max_tokens, sampling=None, seed=0, stop_tokens=(), **kw):
        self.requests.append(dict(prompt=list(prompt), sampling=sampling, **kw))
        top = kw.get("logprobs")
        request = Request(prompt=tuple(prompt), max_tokens=max_tokens, logprobs=top)
        stream = RequestStream(len(self.requests), request)
        for i in range(max_tokens):
            token = ord("a") + i % 26
            stream.emit(token, None if top is None else _lp(token, i, top))
        return stream


def _score(prompts, top):
    return [[None, *(_lp(t, i, top) for i, t in enumerate(p[1:]))] for p in prompts]


@pytest.fixture
def scoring():
    """(the stand-in batcher, the app's test client): a byte tokenizer, prompts scored by
    :func:`_score`."""
    batcher = LogprobBatcher()
    model = ServedModel(name="m", tokenizer=_ByteTokenizer(), render_chat=_render_chat)
    with TestClient(create_app(Service(batcher, model, scorer=_score))) as http:
        _ready(http)
        yield batcher, http


def _events(http: TestClient, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    return [json.loads(line) for line in lines]


def test_completion_logprobs_in_openai_form(scoring):
    batcher, http = scoring
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, "logprobs": 2}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == "abc"
    assert choice["logprobs"] == {
        "tokens": ["a", "b", "c"],
        "token_logprobs": [-0.5, -1.0, -1.5],
        # The 2 most likely, and the chosen token always (here it is the most likely).
        "top_logprobs": [{"a": -0.5, "A": -1.5}, {"b": -1.0, "A": -2.0}, {"c": -1.5, "A": -2.5}],
        "text_offset": [0, 1, 2],
    }
    assert batcher.requests[-1]["logprobs"] == 2
    streamed = _events(http, body | {"stream": True})
    parts = [c["choices"][0]["logprobs"] for c in streamed if c["choices"][0]["text"]]
    assert merge(parts) == choice["logprobs"]
    plain = http.post("/v1/completions", json=body | {"logprobs": None}).json()["choices"][0]
    assert plain["logprobs"] is None and "logprobs" not in batcher.requests[-1]


def test_chat_logprobs_in_openai_form(scoring):
    _, http = scoring
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    choice = http.post(
        "/v1/chat/completions", json=body | {"logprobs": True, "top_logprobs": 1}
    ).json()["choices"][0]
    assert choice["logprobs"] == {
        "content": [
            {
                "token": "a",
                "logprob": -0.5,
                "bytes": [97],
                "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}],
            },
            {
                "token": "b",
                "logprob": -1.0,
                "bytes": [98],
                "top_logprobs": [{"token": "b", "logprob": -1.0, "bytes": [98]}],
            },
        ]
    }
    asked = body | {"logprobs": True, "top_logprobs": 1, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=asked) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    parts = [c["choices"][0]["logprobs"] for c in map(json.loads, lines)]
    assert merge([p for p in parts if p]) == choice["logprobs"]
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert plain["logprobs"] is None


def test_echo_returns_the_prompt_and_its_log_likelihoods(scoring):
    """``max_tokens`` 0 with ``echo``: the prompt alone (what lm-eval's loglikelihood reads),
    nothing queued; with ``max_tokens`` > 0 the completion follows it, offsets running on."""
    batcher, http = scoring
    body = {"model": "m", "prompt": "xyz", "max_tokens": 0, "echo": True, "logprobs": 1}
    out = http.post("/v1/completions", json=body).json()
    choice = out["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("xyz", "length")
    assert choice["logprobs"] == {
        "tokens": ["x", "y", "z"],
        "token_logprobs": [None, -0.5, -1.0],
        "top_logprobs": [None, {"y": -0.5}, {"z": -1.0}],
        "text_offset": [0, 1, 2],
    }
    assert out["usage"]["completion_tokens"] == 0 and not batcher.requests
    whole = http.post("/v1/completions", json=body | {"max_tokens": 2}).json()["choices"][0]
    assert whole["text"] == "xyzab"
    assert whole["logprobs"]["tokens"] == ["x", "y", "z", "a", "b"]
    assert whole["logprobs"]["token_logprobs"] == [None, -0.5, -1.0, -0.5, -1.0]
    assert whole["logprobs"]["text_offset"] == [0, 1, 2, 3, 4]
    streamed = _events(http, body | {"max_tokens": 2, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in streamed) == "xyzab"
    parts = [c["choices"][0]["logprobs"] for c in streamed if c["choices"][0]["logprobs"]]
    assert merge(parts) == whole["logprobs"]
    # Without logprobs, the text alone; token ids are echoed as their text.
    ids = {"model": "m", "prompt": [104, 105], "max_tokens": 1, "echo": True}
    echoed = http.post("/v1/completions", json=ids).json()["choices"][0]
    assert (echoed["text"], echoed["logprobs"]) == ("hia", None)


def test_penalties_reach_the_sampler(scoring):
    batcher, http = scoring
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}
    penalties = {"presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.2}
    for extra in [{}, {"temperature": 0.7}]:
        assert http.post("/v1/completions", json=body | penalties | extra).status_code == 200
        sampling = batcher.requests[-1]["sampling"]
        assert (
            sampling.presence_penalty,
            sampling.frequency_penalty,
            sampling.repetition_penalty,
        ) == (0.5, -0.25, 1.2)
        assert sampling.temperature == extra.get("temperature", 0.0)


@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": 2}, "logprobs"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ],
)
def test_out_of_range_logprobs_and_penalties_are_400s(scoring, path, extra, param):
    batcher, http = scoring
    if path == "/v1/completions":
        body = {"model": "m", "prompt": "hi"} | extra
    else:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | extra
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert not batcher.requests
