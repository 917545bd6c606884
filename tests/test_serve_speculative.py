"""``jaxpar serve --speculative-config`` (n-gram) with the official ``openai`` client.

One server on one device speculating on every step that has a draft (``adaptive``
false): greedy completions, streamed and whole, equal offline ``generate`` token for
token, and ``/metrics`` counts the drafts under vLLM's names.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests._serve_util import MODEL, Offline, ServerProcess
from tests.test_serve import _readme_serve_args

pytestmark = pytest.mark.server

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "adaptive": False}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = [*_readme_serve_args(), "--slots", "2", "--speculative-config", json.dumps(SPEC)]
    proc = ServerProcess(args, cpu_devices=1, log_dir=tmp_path_factory.mktemp("serve"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def offline():
    return Offline().warm()


def _metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))


def test_streamed_and_whole_completions_equal_offline_greedy(server, offline):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    prompt = [1, 20, 21, 22, 20, 21, 22, 20, 21]  # a repeating prompt: n-grams recur
    expected = offline.greedy(prompt, 20, eos=False)
    extra = {"ignore_eos": True, "return_token_ids": True}
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, extra_body=extra)
    assert whole.choices[0].model_extra["token_ids"] == expected
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=20, stream=True, extra_body=extra
        )
    )
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert [t for p in pieces for t in (p.model_extra.get("token_ids") or [])] == expected
    assert "".join(p.text for p in pieces) == offline.text(expected)
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert _metric(metrics, "vllm:spec_decode_num_drafts_total") > 0
    drafted = _metric(metrics, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _metric(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 <= accepted <= drafted and drafted > 0
    per_pos = _metric(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == accepted
    # The cost model is off: every verification drafted the configured K.
    by_k = re.findall(r'^jaxpar:spec_decode_steps_by_k_total\{[^}]*k="(\d+)"[^}]*\} (\S+)$',
                      metrics, re.M)  # fmt: skip
    steps = {int(k): float(v) for k, v in by_k}
    assert steps[SPEC["num_speculative_tokens"]] > 0
    assert sum(v for k, v in steps.items() if 0 < k < SPEC["num_speculative_tokens"]) == 0
