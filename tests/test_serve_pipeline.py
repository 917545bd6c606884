"""``jaxpar serve --pp 2``: pipelined continuous batching, each answer equal to one device.

Two servers, started together so their warm-ups overlap: pp2·tp2 on 4 simulated CPU
devices and pp2·dp2·tp2 on 8. Each gets 16 concurrent requests (greedy and seeded,
streamed and not; some sharing a prompt prefix, some longer than a prefill chunk) over a
pool of a few pages per row, so rows are preempted and recomputed; every answer must
equal offline ``generate`` on one device, token for token. ``/metrics`` reports the
bubble fraction the pipelined steps paid, and the preemptions.
"""

from __future__ import annotations

import asyncio
import random
import re

import httpx
import pytest

from tests._serve_util import MODEL, REFERENCE_TOKENS, Offline, ServerProcess, send_all

pytestmark = [pytest.mark.server, pytest.mark.slow]

MAX_SEQ_LEN = 32
REQUESTS = 16
#: 8 rows, pages of 4 tokens, 40 tokens of pool per batch shard (10 pages, one the scratch
#: page): far less than 8 rows of up to 32 tokens, so rows are preempted. Prefill at most 8
#: tokens between steps: longer prompts prefill in chunks that continue their context. One
#: prompt per batch shard per prefill: few programs to warm up.
COMMON = [
    "--hf",
    "tests/fixtures/llama_chat",
    "--max-seq-len",
    str(MAX_SEQ_LEN),
    "--max-num-seqs",
    "8",
    "--page-size",
    "4",
    "--max-prefill-tokens",
    "8",
]
STRATEGIES = {
    "pp2-tp2": (4, ["--pp", "2", "--tp", "2", "--kv-cache-tokens", "40", "--prefill-batch", "1"]),
    "pp2-dp2-tp2": (
        8,
        ["--pp", "2", "--dp", "2", "--tp", "2", "--kv-cache-tokens", "80", "--prefill-batch", "2"],
    ),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("pipeline")
    procs = {}
    try:
        for name, (devices, flags) in STRATEGIES.items():
            procs[name] = ServerProcess([*COMMON, *flags], cpu_devices=devices, log_dir=log_dir)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def offline():
    return Offline().warm()


def _requests() -> list[dict]:
    rng = random.Random(39)
    shared = [1] + [rng.randrange(7, 256) for _ in range(8)]  # two pages of a common prefix
    out = []
    for i in range(REQUESTS):
        if i % 4 == 1:
            prompt = shared + [rng.randrange(7, 256) for _ in range(rng.randrange(1, 4))]
        elif i % 4 == 2:  # longer than a prefill chunk
            prompt = [1] + [rng.randrange(7, 256) for _ in range(rng.randrange(12, 20))]
        else:
            prompt = [1] + [rng.randrange(7, 256) for _ in range(rng.randrange(0, 8))]
        fits = MAX_SEQ_LEN + 1 - len(prompt)
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": rng.randrange(4, min(REFERENCE_TOKENS, fits) + 1),
            "ignore_eos": True,
            "stream": i % 3 == 0,
            "return_token_ids": True,
            "temperature": 0.0,
        }
        if i % 2:  # seeded sampling
            body |= {"temperature": 0.9, "top_k": 40, "seed": 300 + i}
        out.append(body)
    return out


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^jaxpar:{name}(?:_total)?{{[^}}]*}} (\S+)$", text, flags=re.M)
    assert match, f"no jaxpar:{name} in /metrics"
    return float(match.group(1))


def check_answers(url: str, offline: Offline) -> None:
    """:func:`_requests` sent at once: each answer equals one device's."""
    bodies = _requests()
    answers = asyncio.run(send_all(url, bodies))
    for body, (status, tokens, error) in zip(bodies, answers, strict=True):
        assert status == 200, error
        assert tokens == offline.expected(body), body


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_concurrent_requests_equal_one_device_with_preemption(servers, offline, strategy):
    server = servers[strategy].wait_ready()
    check_answers(server.url, offline)
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert _metric(metrics, "num_preemptions") > 0  # the tiny pool took rows back
    assert _metric(metrics, "prefix_cache_hits") > 0  # the shared prefix's pages
    bubble = _metric(metrics, "pipeline_bubble_fraction")
    iterations = _metric(metrics, "pipeline_stage_iterations")
    idle = _metric(metrics, "pipeline_idle_stage_iterations")
    assert iterations > 0 and bubble == pytest.approx(idle / iterations)
    # At least the fill and drain of every step: (P - 1) / (G + P - 1) with at most the
    # default G = 2 P = 4 groups.
    assert 1 / 5 <= bubble < 1
