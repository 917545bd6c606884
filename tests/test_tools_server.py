"""Tool calling against a ``jaxpar serve`` process, with the official ``openai`` client.

The model is ``tests/fixtures/llama_tools``: the untrained byte-level Llama with a chat
template that writes Hermes-style calls (served with ``--enable-auto-tool-choice``, its
format inferred from the template). Whatever call comes back is the grammar's doing, so
each is checked to name an offered function and to carry arguments that parse and
validate against its schema (``jsonschema``): a named function, greedy and sampled,
streamed and not; ``required`` with two tools; a multi-turn exchange (a call, its result,
an answer); the serving page's example; and ``/v1/responses`` with function tools and
``previous_response_id``.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import jsonschema
import openai
import pytest

from tests._serve_util import ROOT, ServerProcess

CHECKPOINT = ROOT / "tests" / "fixtures" / "llama_tools"
MODEL = "llama_tools"
SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "get_time": {
        "type": "object",
        "properties": {"tz": {"type": "string", "maxLength": 4}, "utc": {"type": "boolean"}},
        "required": ["tz", "utc"],
        "additionalProperties": False,
    },
}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
ASK = [{"role": "user", "content": "Weather in Lima?"}]

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--hf", str(CHECKPOINT), "--max-seq-len", "256", "--slots", "2"]
    args += ["--no-prefix-caching", "--enable-auto-tool-choice"]
    proc = ServerProcess(args, cpu_devices=1, log_dir=tmp_path_factory.mktemp("tools"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _valid(name: str, arguments: str) -> dict:
    """The call's arguments, parsed and validated against its function's schema."""
    assert name in SCHEMAS, name
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def _streamed(chunks) -> tuple[list[tuple[str, str]], str | None]:
    """A stream's calls (name, arguments) from their deltas, and its finish reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in chunks:
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.id is not None:
                calls[call.index] = [call.function.name, call.function.arguments or ""]
            else:
                calls[call.index][1] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return [tuple(c) for c in calls.values()], finish


SAMPLINGS = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_a_named_function_returns_valid_arguments(client, sampling):
    named = {"type": "function", "function": {"name": "get_time"}}
    asked = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=120)
    reply = client.chat.completions.create(**asked, **sampling)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    _valid("get_time", call.function.arguments)
    assert call.function.name == "get_time"
    calls, finish = _streamed(client.chat.completions.create(**asked, **sampling, stream=True))
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0][0] == "get_time" and _valid(*calls[0])
    if not sampling.get("temperature"):  # greedy: the stream says what the whole reply did
        assert calls[0][1] == call.function.arguments


def test_required_with_two_tools_calls_one_of_them(client):
    for seed in (1, 2):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
        )
        (call,) = reply.choices[0].message.tool_calls
        _valid(call.function.name, call.function.arguments)
        assert reply.choices[0].finish_reason == "tool_calls"


def test_a_multi_turn_exchange(client):
    messages = list(ASK)
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=120
    )
    message = first.choices[0].message
    assert message.tool_calls
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        _valid(call.function.name, call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=6
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")
    # The history (the call and its result) is in the prompt the template rendered.
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 60


def test_the_serving_page_example_runs(server, tmp_path):
    page = (ROOT / "scripts" / "docs" / "pages" / "serving.md").read_text()
    block = re.search(r"^```python tools\n(.*?)^```", page, flags=re.M | re.S)
    assert block, "serving.md lost its tool-calling example"
    script = tmp_path / "tools_example.py"
    script.write_text(block.group(1).replace("8000", str(server.port)))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    first, second = run.stdout.splitlines()
    reason, name, args = first.split(" ", 2)
    assert (reason, name) == ("tool_calls", "get_weather")
    assert set(ast.literal_eval(args)) == {"city", "days"}  # the dict the example printed
    assert second in ("stop", "length", "tool_calls")


def test_responses_with_function_tools_and_previous_response_id(client):
    flat = [{"type": "function", **tool["function"]} for tool in TOOLS]
    first = client.responses.create(
        model=MODEL,
        input="Weather in Lima?",
        tools=flat,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=120,
    )
    assert first.status == "completed"
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and _valid(call.name, call.arguments)
    answer = client.responses.create(
        model=MODEL,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        previous_response_id=first.id,
        max_output_tokens=6,
    )
    assert answer.previous_response_id == first.id and answer.usage.output_tokens <= 6
    if answer.status == "incomplete":  # the untrained model did not end it by itself
        assert answer.incomplete_details.reason == "max_output_tokens"
    assert all(item.type == "message" for item in answer.output)
    # The conversation so far (the call and its output) is in the prompt.
    assert answer.usage.input_tokens > first.usage.input_tokens + 60
