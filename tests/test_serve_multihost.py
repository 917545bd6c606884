"""``jaxpar serve`` across processes: 2 processes x 4 simulated CPU devices (jax.distributed
on 127.0.0.1), one model over all 8 devices (dp2·sp2·tp2).

Process 0 serves HTTP and schedules; process 1 replays its commands. 32 concurrent
requests, greedy and seeded, streamed and not, must each equal the same request to a
1-process x 8-device server with the same strategy, and offline ``generate`` on one
device; so must issue 34's burst (16 at once, 6-token prompts, 12 tokens, twice in a
row), greedy and seeded. Disaggregated across the processes (decode tp=4 on process 0, prefill sp=4 on process 1:
each prefilled batch's K/V move once, device to device), requests mixing greedy, seeded,
logprobs and penalties each equal the 1-process server's, and each
request moves as many bytes as its pages hold. Then the failures: SIGTERM to process 0
drains and stops both processes (exit 0); SIGKILL to process 1 of the disaggregated pair
(its prefill group) mid-stream gets every client that needs it (and the liveness and
readiness probes) a 503 naming process 1, and process 0 exits non-zero, within 60 s.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from jaxpar.engine import PEER_LOST_EXIT_STATUS
from tests._serve_util import (
    CHECKPOINT,
    MODEL,
    REFERENCE_TOKENS,
    Offline,
    ServerProcess,
    process_pair,
    send_all,
    send_completion,
    sigterm_in_flight,
)

pytestmark = [pytest.mark.server, pytest.mark.slow]

MAX_SEQ_LEN = 32
STRATEGY = ["--dp", "2", "--sp", "2", "--tp", "2"]
#: Few programs to warm up on 2 cores: prompts up to 32 tokens, prefill 2 rows at a time.
FLAGS = [
    "--hf",
    "tests/fixtures/llama_chat",
    "--max-seq-len",
    str(MAX_SEQ_LEN),
    "--max-num-seqs",
    "16",
    "--prefill-batch",
    "2",
    *STRATEGY,
]
DETECTION_LIMIT_S = 60  # the bound for answering and exiting after a lost process


#: Disaggregated across the processes: decode tp=4 on process 0's devices, prefill sp=4 on
#: process 1's (another KV-head replica count: the checkpoint's heads cross), 4 prompts at
#: a time (sp=4's smallest batch).
SPLIT_FLAGS = [*FLAGS[: FLAGS.index("--prefill-batch")], "--tp", "4", "--prefill", "sp=4"]


class Pair:
    """``jaxpar --coordinator ... serve`` as processes 0 and 1, 4 CPU devices each."""

    def __init__(self, log_dir, flags=FLAGS):
        self.procs = process_pair(flags, log_dir, log_level="info")

    @property
    def leader(self) -> ServerProcess:
        return self.procs[0]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.proc.poll() is None:
                proc.proc.kill()
                proc.proc.wait(10)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A 2-process pair for the equality and drain tests, a disaggregated pair (prefill on
    process 1, decode on process 0) for its equality and kill tests, and the 1-process
    reference server: started together so that their warm-ups overlap."""
    log_dir = tmp_path_factory.mktemp("multihost")
    pairs = []
    single = None
    try:
        pairs = [Pair(log_dir), Pair(log_dir, SPLIT_FLAGS)]
        single = ServerProcess(FLAGS, cpu_devices=8, log_dir=log_dir)
        yield {"pair": pairs[0], "split": pairs[1], "single": single}
    finally:
        for pair in pairs:
            pair.kill()
        if single is not None:
            single.stop()


@pytest.fixture(scope="module")
def offline():
    return Offline().warm()


def _requests(n: int) -> list[dict]:
    rng = random.Random(29)
    out = []
    for i in range(n):
        prompt = [1] + [rng.randrange(7, 256) for _ in range(rng.randrange(0, 20))]
        fits = MAX_SEQ_LEN + 1 - len(prompt)
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": rng.randrange(1, min(REFERENCE_TOKENS, fits) + 1),
            "ignore_eos": True,
            "stream": i % 4 == 0,
            "return_token_ids": True,
        }
        if i % 2:  # seeded sampling
            body |= {"temperature": 0.9, "top_k": 40, "seed": 100 + i}
        else:
            body |= {"temperature": 0.0}
        out.append(body)
    return out


def test_32_requests_across_two_processes_equal_one_process_and_offline(servers, offline):
    pair, single = servers["pair"], servers["single"]
    leader = pair.leader.wait_ready()
    single.wait_ready()
    bodies = _requests(32)
    across = asyncio.run(send_all(leader.url, bodies))
    alone = asyncio.run(send_all(single.url, bodies))
    for body, (status, tokens, error), (_, reference, _) in zip(bodies, across, alone, strict=True):
        assert status == 200, error
        assert tokens == reference, body  # 2 processes x 4 devices = 1 process x 8
        assert tokens == offline.expected(body), body  # = offline, one device
    # Prompt log-likelihoods (echo, max_tokens 0: lm-eval's loglikelihood) score on every
    # process too.
    echo = {"model": MODEL, "prompt": [1, 40, 41, 42], "max_tokens": 0, "echo": True}
    echo["logprobs"] = 2
    scored = [
        httpx.post(f"{s.url}/v1/completions", json=echo, timeout=120) for s in (leader, single)
    ]
    assert all(r.status_code == 200 for r in scored), [r.text for r in scored]
    pair_lp, single_lp = (r.json()["choices"][0]["logprobs"]["token_logprobs"] for r in scored)
    assert pair_lp[0] is None and len(pair_lp) == 4
    assert pair_lp[1:] == pytest.approx(single_lp[1:], abs=1e-5)
    health = leader.health()
    assert health["stats"]["finished"] == 32
    lockstep = health["lockstep"]  # the commands went to process 1, batched per wait
    assert lockstep["processes"] == 2
    assert 0 < lockstep["messages"] <= lockstep["commands"]


#: The workload of issue 34 (item 5): 16 concurrent requests with 6-token prompts, 12
#: tokens each, ignoring EOS, sent twice in a row; greedy, then seeded sampling.
BURST = 16


def _burst(*, sampled: bool) -> list[dict]:
    rng = random.Random(34)
    bodies = []
    for i in range(BURST):
        body = {
            "model": MODEL,
            "prompt": [1] + [rng.randrange(7, 256) for _ in range(5)],
            "max_tokens": 12,
            "ignore_eos": True,
            "stream": False,
            "return_token_ids": True,
            "temperature": 0.0,
        }
        if sampled:
            body |= {"temperature": 0.8, "top_p": 0.9, "seed": 1000 + i}
        bodies.append(body)
    return bodies


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_16_concurrent_requests_twice_equal_one_process(servers, offline, sampled):
    """The first requests after warm-up, all at once: every one 200, twice in a row, and
    equal to the 1-process server's (greedy: and to offline generate on one device)."""
    pair, single = servers["pair"], servers["single"]
    leader = pair.leader.wait_ready()
    single.wait_ready()
    bodies = _burst(sampled=sampled)
    alone = asyncio.run(send_all(single.url, bodies))
    for attempt in range(2):
        start = time.monotonic()
        across = asyncio.run(send_all(leader.url, bodies))
        print(
            f"burst {attempt} ({'seeded' if sampled else 'greedy'}): {time.monotonic() - start:.1f} s"
        )
        for body, (status, tokens, error), (_, reference, _) in zip(
            bodies, across, alone, strict=True
        ):
            assert status == 200, error
            assert len(tokens) == 12 and tokens == reference, body
            if not sampled:
                assert tokens == offline.greedy(body["prompt"], 12, eos=False), body
    print("lockstep:", leader.health()["lockstep"])


#: Logprobs and penalties mixed with plain greedy and seeded requests, streamed and not.
#: (Structured output needs a byte-level tokenizer, which this checkpoint has not:
#: tests/test_structured.py serves another.)
MIXED = [
    {"prompt": [1, 40, 41, 42], "max_tokens": 10, "temperature": 0.0, "logprobs": 2},
    {"prompt": [1, 9, 8, 7, 6, 5], "max_tokens": 12, "temperature": 0.9, "seed": 7}
    | {"presence_penalty": 0.8, "frequency_penalty": 0.6, "repetition_penalty": 1.7},
    {"prompt": [1, 77, 78], "max_tokens": 16, "temperature": 1.0, "seed": 3, "stream": True}
    | {"frequency_penalty": 1.2, "logprobs": 1},
    {"prompt": [1, 5, 6, 7, 8, 9, 10, 11, 12, 13], "max_tokens": 6, "temperature": 0.0},
    {"prompt": [1, 30, 31], "max_tokens": 14, "temperature": 0.0, "stream": True}
    | {"repetition_penalty": 1.3},
    {"prompt": [1] + list(range(50, 70)), "max_tokens": 8, "temperature": 0.7, "seed": 11}
    | {"logprobs": 1, "top_k": 40},
]


PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def _mixed_bodies() -> list[dict]:
    common = {"model": MODEL, "return_token_ids": True, "stream": False, "ignore_eos": True}
    return [common | body for body in MIXED]


async def _send_full(http: httpx.AsyncClient, body: dict) -> dict:
    """The choice of one request (a stream's chunks joined), or its error."""
    if not body["stream"]:
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]
    ids, text, logprobs = [], "", []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                ids += choice.get("token_ids", [])
                text += choice.get("text", "")
                logprobs += (choice.get("logprobs") or {}).get("token_logprobs", [])
    return {"token_ids": ids, "text": text, "logprobs": {"token_logprobs": logprobs}}


def _transferred(server: ServerProcess) -> tuple[int, int]:
    stats = server.wait_idle()["stats"]
    return stats["transfers"], stats["transfer_bytes"]


def test_disaggregated_across_processes_equals_one_process(servers, offline):
    """Prefill on process 1, decode on process 0: greedy, seeded, logprobs and
    penalties, streamed and not, each equal the 1-process server's answer (greedy: and offline
    generate); each request's K/V crossed once, as many bytes as its pages hold."""
    split, single = servers["split"].leader.wait_ready(), servers["single"].wait_ready()
    bodies = _mixed_bodies()
    across, alone = asyncio.run(_both(split.url, single.url, bodies))
    for body, got, want in zip(bodies, across, alone, strict=True):
        assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"], body
        plain = not any(k in body for k in PENALTIES)
        if plain and body["temperature"] == 0.0:
            assert got["token_ids"] == offline.greedy(body["prompt"], body["max_tokens"], eos=False)
        if "logprobs" in body:
            got_lp, want_lp = got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"]
            assert got_lp == pytest.approx(want_lp, abs=1e-5), body
    # Bytes per request, against the pages' size: one request at a time, each prefilled
    # alone (1 row) in the bucket of its prompt.
    before = _transferred(split)
    for prompt in ([1, 2, 3, 4, 5], [1] + list(range(20, 32))):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
        assert httpx.post(f"{split.url}/v1/completions", json=body, timeout=120).status_code == 200
        after = _transferred(split)
        assert after[0] == before[0] + 1  # moved once
        assert after[1] - before[1] == _page_bytes(len(prompt)), prompt
        before = after


async def _both(split_url: str, single_url: str, bodies: list[dict]) -> tuple[list, list]:
    limits = httpx.Limits(max_connections=2 * len(bodies))
    async with (
        httpx.AsyncClient(base_url=split_url, timeout=300, limits=limits) as a,
        httpx.AsyncClient(base_url=single_url, timeout=300, limits=limits) as b,
    ):
        across = asyncio.gather(*(_send_full(a, body) for body in bodies))
        alone = asyncio.gather(*(_send_full(b, body) for body in bodies))
        return await across, await alone


def _page_bytes(prompt_len: int) -> int:
    """What the K/V pages of one prompt hold, as they cross (the checkpoint's KV heads in
    f32, the prompt bucket's tokens) plus its length and first token:
    :func:`jaxpar.cli._groups.handoff`'s figure for one row."""
    from jaxpar.cli._groups import device_groups, handoff
    from jaxpar.engine import prompt_bucket
    from jaxpar.models import config_from_hf
    from jaxpar.spec import ParallelConfig

    config = config_from_hf(
        json.loads((CHECKPOINT / "config.json").read_text()), source=str(CHECKPOINT)
    )
    groups = device_groups(ParallelConfig(tp=4), "sp=4")
    bucket = prompt_bucket(prompt_len, 4, MAX_SEQ_LEN)
    return handoff(config, groups, batch=1, prompt_len=bucket)["transfer"]["bytes_per_batch"]


def test_sigterm_to_process_0_drains_and_stops_both(servers):
    pair = servers["pair"]
    leader = pair.leader.wait_ready()
    body = {"model": MODEL, "prompt": [1, 20, 30], "max_tokens": 20, "ignore_eos": True}

    response = sigterm_in_flight(leader.url, leader.proc, body)
    assert response.status_code == 200, response.text  # drained: it finished
    assert len(response.json()["choices"][0]["text"]) > 0
    for proc in pair.procs:
        assert proc.proc.wait(DETECTION_LIMIT_S) == 0, proc.log()
    assert "process 0 stopped serving" in pair.procs[1].log()


def test_killing_process_1_gets_503_naming_it_and_process_0_exits(servers):
    """On the disaggregated pair, where process 1 holds the prefill group: requests already
    decoding (on process 0's devices) may still finish, but those sent after the kill need
    a prefill there and get 503 naming it."""
    pair = servers["split"]
    leader = pair.leader.wait_ready()
    bodies = [
        {"model": MODEL, "prompt": [1, 5 + i], "max_tokens": 30, "ignore_eos": True}
        | {"stream": i % 2 == 0, "return_token_ids": True, "temperature": 0.0}
        for i in range(6)
    ]

    async def kill_mid_stream() -> list:
        async with httpx.AsyncClient(base_url=leader.url, timeout=120) as http:
            tasks = [asyncio.create_task(send_completion(http, b)) for b in bodies[:4]]
            await asyncio.sleep(0.5)
            pair.procs[1].proc.kill()
            tasks += [asyncio.create_task(send_completion(http, b)) for b in bodies[4:]]
            return await asyncio.gather(*tasks)

    started = time.monotonic()
    results = asyncio.run(kill_mid_stream())
    killed_at = started + 0.5
    answered_s = time.monotonic() - killed_at
    late = [r for r in results if r[0] == 503]
    assert late, results  # requests that needed process 1 after it died were not answered 200
    for status, _, error in results:
        if status != 200:
            assert status == 503 and "process 1 of 2" in error, (status, error)
    response = httpx.post(
        f"{leader.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
    )
    assert response.status_code == 503 and "process 1 of 2" in response.text, response.text
    for probe in ("/live", "/health"):  # liveness and readiness both fail, naming it
        answer = httpx.get(f"{leader.url}{probe}", timeout=10)
        assert answer.status_code == 503 and "process 1 of 2" in answer.text, (probe, answer)
    assert time.monotonic() - killed_at < 10  # within 10 s of the loss (LWS restarts the group)
    returncode = leader.proc.wait(DETECTION_LIMIT_S)
    exited_s = time.monotonic() - killed_at
    print(f"after SIGKILL to process 1: answered in {answered_s:.1f} s, exited in {exited_s:.1f} s")
    assert exited_s < DETECTION_LIMIT_S
    assert returncode == PEER_LOST_EXIT_STATUS, leader.log()
    assert "process 1 of 2 stopped answering" in leader.log()
