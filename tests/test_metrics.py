"""``GET /metrics``: Prometheus metrics read from the live batcher.

In-process, a stand-in batcher with known values checks the names, labels and format (and
that two apps in one process keep their own registries), and one whose tokens arrive at
set times the histogram of each request's longest wait between two tokens. Then a real
``jaxpar serve`` (2 slots) is scraped idle, while streamed requests run and queue, and
after them: the gauges follow the batcher, and the token and request counters add up
exactly; a prompt sent twice moves the prefix cache's counters as its usage says.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from jaxpar.engine import BatcherStats, Request, RequestStream
from jaxpar.server import ServedModel, Service, create_app
from tests._serve_util import MODEL, Offline, ServerProcess

RUNNING = "jaxpar:num_requests_running"
WAITING = "jaxpar:num_requests_waiting"
USAGE = "jaxpar:kv_cache_usage_perc"
PREEMPTIONS = "jaxpar:num_preemptions_total"
PROMPT_TOKENS = "jaxpar:prompt_tokens_total"
GENERATION_TOKENS = "jaxpar:generation_tokens_total"
SUCCESS_LENGTH = "jaxpar:request_success_total{finished_reason=length}"
SUCCESS_STOP = "jaxpar:request_success_total{finished_reason=stop}"
QUERIES = "jaxpar:prefix_cache_queries_total"
HITS = "jaxpar:prefix_cache_hits_total"
CACHED = "jaxpar:prompt_tokens_cached_total"
GAP = "jaxpar:request_max_inter_token_latency_seconds"

SLOTS = 2


def _parse(text: str, model: str) -> dict[str, float]:
    """Sample name (with its labels other than ``model_name``) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == model, sample
            extra = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            out[sample.name + (f"{{{extra}}}" if extra else "")] = sample.value
    return out


def _gap(values: dict[str, float]) -> tuple[dict[str, float], float, float]:
    """The token-gap histogram's samples: (count per ``le`` bound, count, sum)."""
    head = GAP + "_bucket{le="
    buckets = {k.removeprefix(head)[:-1]: v for k, v in values.items() if k.startswith(head)}
    return buckets, values[GAP + "_count"], values[GAP + "_sum"]


def _check_response(response) -> str:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    return response.text


# --- in-process, a stand-in batcher ------------------------------------------------------


@dataclasses.dataclass
class _Batcher:
    """What /metrics reads of a batcher, with set values; its requests draw a token more
    than they have gaps in ``gaps_s`` (one list per request, in order), each token
    arriving that many seconds after the one before."""

    slots: int = 1
    active: int = 0
    queued: int = 0
    kv_cache_usage: float = 0.0
    stats: BatcherStats = dataclasses.field(default_factory=BatcherStats)
    failure: None = None
    max_prompt_len: int = 64
    max_seq_len: int = 64
    gaps_s: list[list[float]] = dataclasses.field(default_factory=list)

    def start(self):
        return self

    def close(self, *, drain=False, timeout=None):
        pass

    def submit(self, prompt, *, max_tokens, sampling=None, seed=0, stop_tokens=()):
        gaps = self.gaps_s.pop(0)
        stream = RequestStream(0, Request(prompt=tuple(prompt), max_tokens=len(gaps) + 1))
        for token in range(len(gaps) + 1):
            stream.emit(token)
        stream.token_times[:] = itertools.accumulate([100.0, *gaps])
        return stream


def test_metrics_read_the_batcher_at_each_scrape():
    one = _Batcher(active=3, queued=5, kv_cache_usage=0.375)
    other = _Batcher(active=1)
    apps = [create_app(Service(b, ServedModel(name=n))) for b, n in [(one, "a"), (other, "b")]]
    with TestClient(apps[0]) as http, TestClient(apps[1]) as http_other:
        text = _check_response(http.get("/metrics"))  # 200 while warming up too
        assert "# TYPE jaxpar:num_requests_running gauge" in text
        assert "# TYPE jaxpar:num_preemptions_total counter" in text
        assert "# TYPE jaxpar:request_max_inter_token_latency_seconds histogram" in text
        values = _parse(text, "a")
        assert {k: v for k, v in values.items() if not k.startswith(GAP)} == {
            RUNNING: 3,
            WAITING: 5,
            USAGE: 0.375,
            PREEMPTIONS: 0,
            QUERIES: 0,
            HITS: 0,
            CACHED: 0,
            PROMPT_TOKENS: 0,
            GENERATION_TOKENS: 0,
            SUCCESS_STOP: 0,
            SUCCESS_LENGTH: 0,
        }
        buckets, count, total = _gap(values)
        assert (set(buckets.values()), count, total) == ({0}, 0, 0)
        assert (min(buckets, key=float), max(buckets, key=float)) == ("0.001", "+Inf")
        assert "60.0" in buckets
        one.active, one.queued, one.kv_cache_usage = 0, 0, 0.0
        one.stats.preemptions = 4
        one.stats.prefix_queries, one.stats.prefix_hits = 96, 64
        one.stats.prompt_tokens_cached = 48
        values = _parse(http.get("/metrics").text, "a")
        assert (values[RUNNING], values[WAITING], values[USAGE]) == (0, 0, 0)
        assert values[PREEMPTIONS] == 4
        assert (values[QUERIES], values[HITS], values[CACHED]) == (96, 64, 48)
        assert _parse(_check_response(http_other.get("/metrics")), "b")[RUNNING] == 1


def _wait_ready(http: TestClient) -> None:
    for _ in range(100):
        if http.get("/health").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("not ready")


def test_each_request_observes_its_longest_token_gap():
    """One observation per request with at least two tokens: its longest gap."""
    batcher = _Batcher(gaps_s=[[], [0.002, 0.0005], [0.25, 3.0, 0.01]])
    with TestClient(create_app(Service(batcher, ServedModel(name="a")))) as http:
        _wait_ready(http)
        for gaps in list(batcher.gaps_s):
            body = {"model": "a", "prompt": [1, 2], "max_tokens": len(gaps) + 1}
            assert http.post("/v1/completions", json=body).status_code == 200
        buckets, count, total = _gap(_parse(http.get("/metrics").text, "a"))
    assert (count, total) == (2, pytest.approx(3.002))
    assert (buckets["0.001"], buckets["0.0025"], buckets["2.5"]) == (0, 1, 1)
    assert (buckets["5.0"], buckets["60.0"], buckets["+Inf"]) == (2, 2, 2)


# --- a real server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ready(tmp_path_factory):
    args = ["--hf", "tests/fixtures/llama_chat", "--max-seq-len", "64", "--slots", str(SLOTS)]
    proc = ServerProcess(args, cpu_devices=1, log_dir=tmp_path_factory.mktemp("serve"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _scrape(server: ServerProcess) -> dict[str, float]:
    return _parse(_check_response(httpx.get(f"{server.url}/metrics", timeout=10)), MODEL)


def _idle(server: ServerProcess, timeout: float = 30) -> dict[str, float]:
    """The metrics once no request runs or waits (a slot is freed just after its last
    token is sent)."""
    deadline = time.monotonic() + timeout
    while True:
        values = _scrape(server)
        if not values[RUNNING] and not values[WAITING]:
            return values
        assert time.monotonic() < deadline, f"server still busy: {values}"
        time.sleep(0.05)


async def _stream_while_scraping(url: str, prompts: list[list[int]], max_tokens: int):
    """Streams ``prompts`` at once and scrapes /metrics until they are done; the token
    counts of the streams and every scrape."""
    scrapes: list[dict[str, float]] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:

        async def stream(prompt: list[int]) -> int:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
            body |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            usage = None
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"usage"' in line:
                        usage = json.loads(line[6:])["usage"]
            return usage["completion_tokens"]

        async def scrape(streams: asyncio.Future) -> None:
            while not streams.done():
                scrapes.append(_parse(_check_response(await http.get("/metrics")), MODEL))
                await asyncio.sleep(0.005)

        streams = asyncio.gather(*(stream(p) for p in prompts))
        await asyncio.gather(streams, scrape(streams))
        return streams.result(), scrapes


def test_metrics_follow_the_running_server(ready):
    before = _idle(ready)
    assert (before[RUNNING], before[WAITING], before[USAGE]) == (0, 0, 0)
    assert before[PREEMPTIONS] == 0
    # 6 requests of 60 tokens on 2 slots: 2 run while the others wait, three times over.
    prompts = [[1, 60 + i, 61 + i] for i in range(6)]
    started = time.monotonic()
    counts, scrapes = asyncio.run(_stream_while_scraping(ready.url, prompts, 60))
    took = time.monotonic() - started
    assert counts == [60] * len(prompts)
    assert len(scrapes) >= 3, (took, scrapes)
    busy = [s for s in scrapes if s[RUNNING]]
    assert busy, f"no scrape saw a running request in {took:.2f} s: {scrapes}"
    assert any(s[USAGE] > 0 for s in busy), busy
    for s in scrapes:
        assert 0 <= s[RUNNING] <= SLOTS and 0 <= s[WAITING] <= len(prompts), s
        assert 0 <= s[USAGE] <= 1, s
    assert max(s[RUNNING] for s in scrapes) == SLOTS, scrapes  # every slot was taken
    assert any(s[WAITING] for s in scrapes), f"no scrape saw a queued request: {scrapes}"
    after = _idle(ready)
    assert (after[RUNNING], after[WAITING], after[USAGE]) == (0, 0, 0)
    # Counters: exactly the streams' usage, and every request finished by max_tokens.
    assert after[PROMPT_TOKENS] - before[PROMPT_TOKENS] == sum(map(len, prompts))
    assert after[GENERATION_TOKENS] - before[GENERATION_TOKENS] == sum(counts)
    assert after[SUCCESS_LENGTH] - before[SUCCESS_LENGTH] == len(prompts)
    assert after[SUCCESS_STOP] == before[SUCCESS_STOP]
    assert after[PREEMPTIONS] == 0
    # Each request's longest wait between two of its tokens, once per request.
    gaps_before, gaps_after = _gap(before), _gap(after)
    assert gaps_after[1] - gaps_before[1] == len(prompts)
    assert 0 < gaps_after[2] - gaps_before[2] < 60 * len(prompts)
    assert after[HITS] <= after[QUERIES] and after[CACHED] <= after[PROMPT_TOKENS]


def test_prefix_cache_counters_follow_a_repeated_prompt(ready):
    """A prompt sent twice: the second reuses what the first cached. The cached-tokens
    counter moves by what the two usages say; every one of them was looked up and found."""
    before = _idle(ready)
    prompt = [1] + [240 - i for i in range(39)]  # 40 tokens no other test starts with
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    cached = []
    for _ in range(2):
        response = httpx.post(f"{ready.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    after = _idle(ready)
    assert cached[0] == 0 and 0 < cached[1] < len(prompt)
    assert after[CACHED] - before[CACHED] == sum(cached)
    hits, queries = after[HITS] - before[HITS], after[QUERIES] - before[QUERIES]
    assert sum(cached) <= hits <= queries <= 2 * len(prompt)
    assert _gap(after)[1] - _gap(before)[1] == 2


# --- many sequences in a small paged cache -------------------------------------------------

#: 1024 tokens of KV cache: as contiguous slots of max_seq_len 64 that is 16 sequences.
PAGED_ARGS = ["--kv-cache-tokens", "1024", "--max-num-seqs", "48", "--page-size", "8"]


@pytest.fixture(scope="module")
def paged(tmp_path_factory):
    args = ["--hf", "tests/fixtures/llama_chat", "--max-seq-len", "64", *PAGED_ARGS]
    proc = ServerProcess(args, cpu_devices=1, log_dir=tmp_path_factory.mktemp("paged"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_a_small_paged_cache_decodes_many_short_requests_together(paged):
    """48 short requests (14 tokens: two pages each) fit 1024 tokens of cache together,
    three times what contiguous slots of 64 tokens would hold; their answers equal offline."""
    assert "KV cache: 128 pages x 8 tokens = 1024 tokens" in paged.log()
    prompts = [[1, 20 + i, 80 + i] for i in range(48)]
    counts, scrapes = asyncio.run(_stream_while_scraping(paged.url, prompts, 12))
    assert counts == [12] * len(prompts)
    assert max(s[RUNNING] for s in scrapes) >= 32, [s[RUNNING] for s in scrapes]
    assert max(s[USAGE] for s in scrapes) <= 1
    assert _idle(paged)[USAGE] == 0
    offline = Offline()
    with httpx.Client(base_url=paged.url, timeout=60) as http:
        for prompt in prompts[::6]:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True}
            body["return_token_ids"] = True
            got = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
            assert got == offline.greedy(prompt, 12, eos=False)
