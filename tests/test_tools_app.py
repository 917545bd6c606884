"""Tool calls and reasoning through the app, in-process (no JAX): a stand-in batcher
answers each request with a scripted text, spelled by the byte-level test tokenizer, and
the official ``openai`` client reads it.

Checked here: every bad tool request is a 400 naming its field, with nothing queued; a
scripted Qwen-style answer (reasoning, then two calls) comes back as
``reasoning_content`` and ``tool_calls`` with ``finish_reason`` "tool_calls", and its
stream's deltas add up to the same message; ``required`` hands the batcher a grammar and
``none`` does not; a multi-turn history (a call, its result) reaches the chat template.
"""

from __future__ import annotations

import json
import threading
import types

import openai
import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer

from jaxpar.engine import Admission, BatcherStats, Request, RequestStream, Sampling
from jaxpar.engine._text import chat_template, generation_defaults
from jaxpar.server import ServedModel, Service, create_app
from jaxpar.server._responses import ResponseStore
from jaxpar.server._tools import ToolSettings
from tests._serve_util import ROOT

FIXTURE = ROOT / "tests" / "fixtures" / "llama_tools"
TOKENIZER = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
EOS = (2, 5)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "the time now"}},
]
ASK = [{"role": "user", "content": "Weather in Paris and the time?"}]
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
ANSWER = "<think>Two tools.</think>\n\n" + "\n".join(
    f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in CALLS
)


class ScriptedBatcher:
    """Answers every request at once with :attr:`script` (then EOS); keeps what it was
    asked (:attr:`requests`)."""

    def __init__(self, script: str = ANSWER, *, vocab_size: int = 256, max_seq_len: int = 1024):
        self.engine = types.SimpleNamespace(
            max_seq_len=max_seq_len, steps=types.SimpleNamespace(vocab_size=vocab_size)
        )
        self.max_prompt_len = self.max_seq_len = max_seq_len
        self.admission = Admission(vocab_size=vocab_size, max_seq_len=max_seq_len)
        self.slots, self.active, self.queued = 1, 0, 0
        self.stats = BatcherStats()
        self.failure = None
        self.requests: list[dict] = []
        self.script = script

    def tokens(self) -> list[int]:
        """The answer's token ids: :attr:`script` in the fixture's tokenizer, then EOS."""
        return TOKENIZER.encode(self.script, add_special_tokens=False).ids + [EOS[0]]

    def start(self):
        return self

    def close(self, *, drain=False, timeout=None):
        pass

    def lockstep_stats(self):
        return None

    def submit(self, prompt, *, max_tokens, sampling=None, seed=0, stop_tokens=(), **kw):
        self.requests.append(dict(prompt=list(prompt), **kw))
        stream = RequestStream(len(self.requests), Request(prompt=tuple(prompt), max_tokens=999))
        for token in self.tokens():
            stream.emit(token)
        stream.finish("stop")
        return stream


def _app(settings: ToolSettings):
    template = chat_template(FIXTURE, TOKENIZER, generation_defaults(FIXTURE))
    model = ServedModel(
        name="m",
        tokenizer=TOKENIZER,
        render_chat=template.render,
        stop_token_ids=EOS,
        sampling=Sampling(),
        tools=settings,
    )
    batcher = ScriptedBatcher()
    return batcher, create_app(Service(batcher, model))


@pytest.fixture(scope="module")
def served():
    """(the stand-in batcher, an ``openai`` client, the test client): hermes calls,
    ``auto`` on, qwen3 reasoning."""
    batcher, app = _app(ToolSettings(parser="hermes", auto=True, reasoning="qwen3"))
    with TestClient(app) as http:
        for _ in range(200):
            if http.get("/health").status_code == 200:
                break
            threading.Event().wait(0.02)
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
        )
        yield batcher, client, http


BAD = [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"guided_grammar": "start: \"a\""}, "guided_grammar"),  # after reasoning: refused
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_a_bad_tool_request_is_a_400_naming_the_field_before_anything_queues(served, fields, param):
    batcher, _, http = served
    before = len(batcher.requests)
    response = http.post("/v1/chat/completions", json={"model": "m", "messages": ASK} | fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert len(batcher.requests) == before


def test_auto_and_tools_on_completions_are_refused_where_not_served():
    batcher, app = _app(ToolSettings(parser="hermes"))  # no --enable-auto-tool-choice
    with TestClient(app) as http:
        body = {"model": "m", "messages": ASK, "tools": TOOLS}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in response.json()["error"]["message"]
        completion = {"model": "m", "prompt": "hi", "tools": TOOLS}
        refused = http.post("/v1/completions", json=completion)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    assert not batcher.requests


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def test_reasoning_and_calls_come_back_whole_and_streamed(served):
    batcher, client, _ = served
    reply = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "Two tools."
    assert choice.message.content is None and _calls(choice.message.tool_calls) == CALLS
    assert len({c.id for c in choice.message.tool_calls}) == 2
    assert "grammar" in batcher.requests[-1]  # auto: the calls are constrained once begun
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, stream=True))
    reasoning, calls, finish = "", {}, []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        assert not delta.content
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call starts: its id, type and name, once
                assert call.index not in calls and call.type == "function"
                calls[call.index] = [call.function.name, call.function.arguments or ""]
            else:
                calls[call.index][1] += call.function.arguments
        finish.append(chunk.choices[0].finish_reason)
    assert reasoning == "Two tools."
    assert [(n, json.loads(a)) for n, a in calls.values()] == CALLS
    assert finish[-1] == "tool_calls" and not any(finish[:-1])


def test_required_is_a_grammar_none_is_not_and_text_stays_content(served):
    batcher, client, _ = served
    batcher.script = "<think>no</think>Plain answer."
    try:
        reply = client.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, tool_choice="none"
        )
        assert "grammar" not in batcher.requests[-1]
        message = reply.choices[0].message
        assert (message.content, message.tool_calls) == ("Plain answer.", None)
        assert reply.choices[0].finish_reason == "stop"
        client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required")
        grammar = batcher.requests[-1]["grammar"]
        assert grammar.constraint.kind == "grammar" and "get_time" in grammar.constraint.spec
    finally:
        batcher.script = ANSWER


def test_a_multi_turn_history_reaches_the_template(served):
    batcher, client, _ = served
    first = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    client.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="none")
    prompt = TOKENIZER.decode(batcher.requests[-1]["prompt"], skip_special_tokens=False)
    assert "<tools>get_weather;get_time;</tools>" in prompt
    written = json.dumps({"name": "get_weather", "arguments": dict(CALLS)["get_weather"]})
    assert f"<tool_call>\n{written}\n</tool_call>" in prompt  # arguments as an object
    assert "<tool_response>sunny, 21 C</tool_response>" in prompt


# --- /v1/responses -------------------------------------------------------------------------

FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]


def _items(response) -> list[tuple]:
    """(type, what it says) per output item."""
    out = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content)))
        elif item.type == "function_call":
            out.append(("function_call", item.name, json.loads(item.arguments)))
        else:
            out.append(("message", "".join(c.text for c in item.content)))
    return out


def test_responses_carry_reasoning_and_calls_and_continue_a_conversation(served):
    batcher, client, _ = served
    first = client.responses.create(
        model="m", input="Weather in Paris and the time?", tools=FLAT_TOOLS,
        instructions="Be brief.",
    )  # fmt: skip
    assert first.status == "completed" and first.object == "response"
    assert _items(first) == [
        ("reasoning", "Two tools."),
        *(("function_call", name, args) for name, args in CALLS),
    ]
    assert first.usage.input_tokens == len(batcher.requests[-1]["prompt"])
    outputs = [
        {"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}
        for item in first.output
        if item.type == "function_call"
    ]
    batcher.script = "It is sunny."
    try:
        second = client.responses.create(
            model="m", input=outputs, tools=FLAT_TOOLS, previous_response_id=first.id
        )
    finally:
        batcher.script = ANSWER
    assert second.output_text == "It is sunny." and second.previous_response_id == first.id
    prompt = TOKENIZER.decode(batcher.requests[-1]["prompt"], skip_special_tokens=False)
    assert prompt.count("<tool_response>sunny</tool_response>") == 2
    assert "Weather in Paris and the time?" in prompt and '"name": "get_time"' in prompt
    assert "Be brief." not in prompt  # instructions are not carried to the next turn
    assert client.responses.retrieve(second.id).id == second.id


def test_responses_stream_the_same_items(served):
    _, client, _ = served
    whole = client.responses.create(model="m", input="Weather?", tools=FLAT_TOOLS)
    events = list(
        client.responses.create(model="m", input="Weather?", tools=FLAT_TOOLS, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.id) for i in done] == [(i.type, i.id) for i in events[-1].response.output]
    assert _items(events[-1].response) == _items(whole)
    arguments = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            arguments[e.item_id] = arguments.get(e.item_id, "") + e.delta
    calls = [i for i in done if i.type == "function_call"]
    assert [arguments[c.id] for c in calls] == [c.arguments for c in calls]


def test_a_response_id_not_kept_is_a_400_and_the_store_is_bounded(served):
    batcher, client, http = served
    before = len(batcher.requests)
    body = {"model": "m", "input": "hi", "previous_response_id": "resp_nope"}
    refused = http.post("/v1/responses", json=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "previous_response_id"
    unstored = client.responses.create(model="m", input="hi", store=False)
    again = http.post("/v1/responses", json=body | {"previous_response_id": unstored.id})
    assert again.status_code == 400 and len(batcher.requests) == before + 1
    store = ResponseStore(size=2)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
    assert store.get("r0") is None and store.history("r2") == [{"role": "user", "content": "2"}]
