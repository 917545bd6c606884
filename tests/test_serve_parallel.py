"""``jaxpar serve`` sharded: dp2·tp2, and disaggregated (prefill sp=4 on devices 4-7, decode
tp=4 on devices 0-3), on 8 simulated CPU devices.

Each server gets 64 concurrent requests of mixed prompt and output lengths (some streamed):
every one must come back, once, with exactly the tokens of its own offline single-device
``generate`` run.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys

import httpx
import openai
import pytest

from tests._serve_util import MODEL, REFERENCE_TOKENS, ROOT, Offline, ServerProcess

pytestmark = pytest.mark.server

MAX_SEQ_LEN = 32  # buckets 8, 16 and 32: few prefill programs to warm up
STRATEGIES = {
    "dp2-tp2": ["--dp", "2", "--tp", "2"],
    "prefill-sp4-decode-tp4": ["--tp", "4", "--prefill", "sp=4"],
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both servers, started together so that their warmups overlap."""
    log_dir = tmp_path_factory.mktemp("serve")
    common = ["--hf", "tests/fixtures/llama_chat", "--max-seq-len", str(MAX_SEQ_LEN)]
    # 16 rows for 64 requests (they queue and refill); few programs to warm up.
    common += ["--max-num-seqs", "16"]
    started = {}
    try:
        for name, flags in STRATEGIES.items():
            started[name] = ServerProcess([*common, *flags], cpu_devices=8, log_dir=log_dir)
        yield started
    finally:
        codes = {name: proc.stop() for name, proc in started.items()}
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(scope="module")
def offline():
    return Offline().warm()


@pytest.fixture(params=list(STRATEGIES))
def ready(request, servers, offline):
    return servers[request.param].wait_ready()


def test_greedy_completions_equal_offline_generate(ready, offline):
    client = openai.OpenAI(base_url=f"{ready.url}/v1", api_key="unused", max_retries=0)
    for text in ["hello world", "how are you ? i am fine , thanks", "what is your name ?"]:
        out = client.completions.create(
            model=MODEL, prompt=text, max_tokens=16, extra_body={"return_token_ids": True}
        )
        expected = offline.greedy(offline.encode(text), 16)
        assert out.choices[0].model_extra["token_ids"] == expected, text
        assert out.choices[0].text == offline.text(expected)


def _requests(n: int) -> list[dict]:
    rng = random.Random(13)
    out = []
    for i in range(n):
        prompt = [1] + [rng.randrange(7, 256) for _ in range(rng.randrange(0, 20))]
        fits = MAX_SEQ_LEN + 1 - len(prompt)
        out.append(
            {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": rng.randrange(1, min(REFERENCE_TOKENS, fits) + 1),
                "ignore_eos": i % 3 != 0,  # a third stop at EOS, if they meet one
                "stream": i % 4 == 0,
                "return_token_ids": True,
            }
        )
    return out


async def _send(http: httpx.AsyncClient, body: dict) -> tuple[list[int], str, list[int]]:
    """(token ids, finish reason, prompt ids as the server saw them)."""
    if not body["stream"]:
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["token_ids"], choice["finish_reason"], choice["prompt_token_ids"]
    tokens, finish = [], None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                tokens += choice.get("token_ids", [])
                finish = choice["finish_reason"] or finish
    return tokens, finish, body["prompt"]


async def _send_all(url: str, bodies: list[dict]) -> list:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        return await asyncio.gather(*(_send(http, body) for body in bodies))


def test_64_concurrent_mixed_requests_each_equal_their_offline_run(ready, offline):
    bodies = _requests(64)
    before = ready.wait_idle()["stats"]
    results = asyncio.run(_send_all(ready.url, bodies))
    for body, (tokens, finish, prompt) in zip(bodies, results, strict=True):
        assert prompt == body["prompt"]  # no answer went to another request
        expected = offline.greedy(body["prompt"], body["max_tokens"], eos=not body["ignore_eos"])
        assert tokens == expected, body
        stopped = not body["ignore_eos"] and expected[-1] in offline.eos
        assert finish == ("stop" if stopped else "length"), (body, finish)
    after = ready.wait_idle()["stats"]
    assert after["finished"] - before["finished"] == 64
    assert after["submitted"] - before["submitted"] == 64
    if "--prefill" in ready.command:  # prefill ran on the other devices, then moved over
        assert after["transfers"] > before["transfers"]
        assert after["transfer_bytes"] > before["transfer_bytes"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tp", "4", "--prefill", "sp=8"], "needs 12 devices but 8 are available"),
        (
            [
                "--pp",
                "2",
                "--tp",
                "2",
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2}',
            ],
            "speculative decoding does not compose with pipeline stages",
        ),
        (["--pp", "2", "--tp", "2", "--prefill", "tp=4"], "runs unpipelined groups"),
    ],
)
def test_serve_refuses_a_bad_layout_before_loading(flags, message):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "jaxpar.cli", "--cpu-devices", "8", "serve"]
    command += ["--hf", "tests/fixtures/llama_chat", *flags]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and message in run.stdout, run.stdout + run.stderr
