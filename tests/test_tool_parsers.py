"""Tool-call and reasoning parsers, and the grammars that enforce tool calls (no JAX).

* Each ``--tool-call-parser`` reads hand-written outputs in its model family's format
  (content around the calls, several calls, nested and escaped JSON) into the calls
  written there, whole and fed in random splits (hypothesis): the same calls come out.
* Each ``--reasoning-parser`` splits reasoning from the answer, in any split.
* The grammars, run by llguidance over the byte-level test tokenizer: a call to an
  offered function with valid arguments passes, in each format; an argument outside its
  schema or a function not offered (not the named one) is refused; ``auto`` lets text
  through until the call marker and constrains the call after it; with a reasoning
  parser the reasoning comes first, unconstrained.
* ``jaxpar serve`` lists the parsers, refuses unknown ones, and refuses a parser whose
  markers the checkpoint's tokenizer does not have.
"""

from __future__ import annotations

import json

import llguidance
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from jaxpar.cli import _parser
from jaxpar.cli._serve import REASONING_PARSERS, TOOL_CALL_PARSERS
from jaxpar.engine import Constraint
from jaxpar.errors import ConfigError
from jaxpar.server._reasoning import REASONING
from jaxpar.server._tool_parsers import FORMATS, PARSER_NAMES, format_of_template
from jaxpar.server._tools import (
    ChatOutput,
    Spelling,
    ToolPlan,
    ToolSettings,
    ToolSpec,
    reasoned_lark,
    tool_lark,
    tool_settings,
)
from tests._serve_util import ROOT

WEATHER = {"city": "Paris", "units": {"temp": "C", "list": [1, {"x": '}]\\"{'}]}}
TIME = {"tz": "UTC"}

#: Per format: a recorded-style output, its content and its calls (name, arguments).
OUTPUTS = {
    "hermes": (
        "Let me look.\n<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": WEATHER})
        + "\n</tool_call>\n<tool_call>\n"
        + '{"arguments": {"tz": "UTC"}, "name": "get_time"}'  # the other key order
        + "\n</tool_call>",
        "Let me look.",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    "llama3_json": (
        "<|python_tag|>"
        + json.dumps({"name": "get_weather", "parameters": WEATHER})
        + "; "
        + json.dumps({"name": "get_time", "parameters": TIME}),
        "",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    "mistral": (
        "Sure. [TOOL_CALLS]["
        + json.dumps({"name": "get_weather", "arguments": WEATHER})
        + ", "
        + json.dumps({"name": "get_time", "arguments": TIME})
        + "]",
        "Sure.",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    "deepseek_v3": (
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        "```json\n" + json.dumps(WEATHER) + "\n```<｜tool▁call▁end｜>"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
        + json.dumps(TIME)
        + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Checking.",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    "openai": (
        "<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + json.dumps(WEATHER),
        "",
        [("get_weather", WEATHER)],
    ),
}
#: Outputs of the newer Mistral form, and answers with no call at all.
MORE = [
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}', "", [("get_time", TIME)]),
    ("llama3_json", 'The answer is {"a": 1}.', 'The answer is {"a": 1}.', []),
    ("hermes", "No tools needed < here.", "No tools needed < here.", []),
    (
        "openai",
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4",
        "4",
        [],
    ),
]
CASES = [(name, *OUTPUTS[name]) for name in OUTPUTS] + MORE


def _read(settings_: ToolSettings, plan: ToolPlan, pieces: list[str]) -> ChatOutput:
    output = ChatOutput(settings_, plan)
    for piece in pieces:
        output.feed(piece)
    output.finish()
    return output


def _calls(output: ChatOutput) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in output.calls]


def _split(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *cuts})
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


AUTO = ToolPlan((), "auto")


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_each_parser_reads_its_format_in_any_split(parser, text, content, calls, data):
    setting = ToolSettings(parser=parser, auto=True)
    whole = _read(setting, AUTO, [text])
    assert (_calls(whole), whole.message()["content"] or "") == (calls, content)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    pieces = _split(text, cuts)
    split = _read(setting, AUTO, pieces)
    assert _calls(split) == calls
    assert (split.content, split.reasoning) == (whole.content, whole.reasoning)
    # Streamed: the deltas hand out each call's index, id, type and name once, first,
    # then its arguments' fragments, which join into the same JSON.
    output, got = ChatOutput(setting, AUTO), {}
    for piece in [*pieces, None]:
        events = output.feed(piece) if piece is not None else output.finish()
        for delta in output.deltas(events):
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] not in got and call["type"] == "function"
                    got[call["index"]] = [call["function"]["name"], ""]
                got[call["index"]][1] += call["function"]["arguments"]
    assert [(n, json.loads(a)) for n, a in got.values()] == calls


THINK_CASES = [
    ("qwen3", "<think>\nThe user greets. </thin </think>\n\nHello!", "\nThe user greets. </thin ", "Hello!"),
    ("qwen3", "Hello, no thinking.", "", "Hello, no thinking."),
    ("deepseek_r1", "Hmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.\n", "4"),
    ("deepseek_r1", "<think>cut off before the end", "cut off before the end", ""),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), THINK_CASES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_each_reasoning_parser_splits_reasoning_from_the_answer(
    parser, text, reasoning, content, data
):
    pieces = _split(text, data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    output = _read(ToolSettings(reasoning=parser), None, pieces)
    message = output.message()
    assert (message["reasoning_content"] or "", message["content"]) == (reasoning, content)


def test_reasoning_then_a_call():
    """The reasoning parser reads first; the answer after it goes to the tool parser."""
    text = "<think>call it</think>\n" + OUTPUTS["hermes"][0]
    setting = ToolSettings(parser="hermes", auto=True, reasoning="qwen3")
    output = _read(setting, AUTO, list(text))
    assert output.reasoning == "call it" and _calls(output) == OUTPUTS["hermes"][2]
    single = _read(setting, ToolPlan((), "auto", parallel=False), [text])
    assert _calls(single) == OUTPUTS["hermes"][2][:1]  # parallel_tool_calls: false


# --- grammars -----------------------------------------------------------------------------

TOKENIZER = Tokenizer.from_file(str(ROOT / "tests" / "fixtures" / "llama_bytes" / "tokenizer.json"))
SPECIALS = {t.content: i for i, t in TOKENIZER.get_added_tokens_decoder().items() if t.special}
LL_TOKENIZER = llguidance.LLTokenizer(TOKENIZER.to_str(), n_vocab=256, eos_token=[2, 5])
SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "get_time": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
}
TOOLS = tuple(ToolSpec(name, None, schema) for name, schema in SCHEMAS.items())
GOOD, BAD = {"city": "Tokyo", "days": 3}, {"city": "Rome", "days": 3}


def _accepts(lark: str, text: str) -> bool:
    """Whether the grammar takes every token of ``text`` and may end there."""
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    assert not llguidance.LLMatcher.validate_grammar(grammar, LL_TOKENIZER)
    matcher = llguidance.LLMatcher(LL_TOKENIZER, grammar, log_level=0)
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()


def _written(fmt: str, calls: list[tuple[str, dict]]) -> str:
    """``calls`` as the format writes them (the grammar's own spelling)."""
    f = FORMATS[fmt]
    return (
        f.open + f.sep.join(f.call(n)[0] + json.dumps(a) + f.call(n)[1] for n, a in calls) + f.close
    )


def _lark(fmt: str, choice: str, named=None, parallel=True, reasoning=None) -> str:
    setting = ToolSettings(parser=fmt, auto=True, reasoning=reasoning)
    return tool_lark(ToolPlan(TOOLS, choice, named, parallel), setting, Spelling(SPECIALS))


@pytest.mark.parametrize("fmt", [*PARSER_NAMES, "json"])
def test_required_and_named_grammars_take_only_valid_calls_to_offered_functions(fmt):
    required = _lark(fmt, "required")
    assert _accepts(required, _written(fmt, [("get_weather", GOOD), ("get_time", TIME)]))
    assert not _accepts(required, _written(fmt, [("get_weather", BAD)]))
    assert not _accepts(required, _written(fmt, [("get_date", TIME)]))
    assert not _accepts(required, "I would rather not.")
    single = _lark(fmt, "required", parallel=False)
    assert _accepts(single, _written(fmt, [("get_time", TIME)]))
    assert not _accepts(single, _written(fmt, [("get_time", TIME), ("get_time", TIME)]))
    named = _lark(fmt, "named", "get_weather")
    if fmt == "json":  # no model format: the arguments alone
        assert _accepts(named, json.dumps(GOOD)) and not _accepts(named, json.dumps(BAD))
    else:
        assert _accepts(named, _written(fmt, [("get_weather", GOOD)]))
        assert not _accepts(named, _written(fmt, [("get_time", TIME)]))


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "deepseek_v3"])
def test_auto_lets_text_through_and_constrains_the_call_after_its_marker(fmt):
    auto = _lark(fmt, "auto")
    assert _accepts(auto, "No call needed: 4.")
    assert _accepts(auto, "Looking. " + _written(fmt, [("get_weather", GOOD)]))
    assert not _accepts(auto, "Looking. " + _written(fmt, [("get_weather", BAD)]))
    assert not _accepts(auto, "Looking. " + _written(fmt, [("get_date", TIME)]))


def test_auto_where_calls_are_the_whole_answer_constrains_them_once_begun():
    """Llama 3's JSON: text that does not open a call, or calls; harmony (after its
    analysis): a final message, or a call."""
    auto = _lark("llama3_json", "auto")
    call = _written("llama3_json", [("get_weather", GOOD)])
    assert _accepts(auto, "No call needed: 4.") and _accepts(auto, "<b>fine</b>")
    assert _accepts(auto, call) and _accepts(auto, "<|python_tag|>" + call)
    assert _accepts(auto, _written("llama3_json", [("get_weather", GOOD), ("get_time", TIME)]))
    assert not _accepts(auto, _written("llama3_json", [("get_weather", BAD)]))
    assert not _accepts(auto, _written("llama3_json", [("get_date", TIME)]))
    assert not _accepts(auto, '{"looks": "like a call"}')
    assert not _accepts(_lark("llama3_json", "auto", parallel=False), call + "; " + call)
    harmony = _lark("openai", "auto")
    analysis = "<|channel|>analysis<|message|>Maybe a call.<|end|><|start|>assistant"
    final = "<|channel|>final<|message|>No call needed: 4."
    assert _accepts(harmony, final) and _accepts(harmony, analysis + final)
    assert _accepts(harmony, analysis + _written("openai", [("get_weather", GOOD)]))
    assert not _accepts(harmony, analysis + _written("openai", [("get_weather", BAD)]))
    assert not _accepts(harmony, _written("openai", [("get_date", TIME)]))
    assert not _accepts(harmony, "No channel at all.")
    assert _lark("hermes", "none") is None


def test_a_constraint_applies_to_the_answer_after_the_reasoning():
    call = _written("hermes", [("get_weather", GOOD)])
    lark = _lark("hermes", "required", reasoning="qwen3")
    assert _accepts(lark, "<think>maybe <tool_call> no</think>\n\n" + call)
    assert _accepts(lark, call)  # qwen3: thinking may be off
    assert not _accepts(lark, "<think>x</think>" + _written("hermes", [("get_weather", BAD)]))
    r1 = _lark("hermes", "required", reasoning="deepseek_r1")
    assert _accepts(r1, "Let me see.</think>" + call)
    harmony = _lark("openai", "named", "get_time", reasoning="openai")
    analysis = "<|channel|>analysis<|message|>Need the time.<|end|><|start|>assistant"
    assert _accepts(harmony, analysis + _written("openai", [("get_time", TIME)]))
    schema = Constraint.json_schema(SCHEMAS["get_weather"])
    answer = reasoned_lark(schema, ToolSettings(reasoning="qwen3"), Spelling(SPECIALS), "x")
    assert _accepts(answer, '<think>json now</think>\n{"city":"Paris","days":7}')
    assert not _accepts(answer, '<think>json now</think>\n{"city":"Paris","days":8}')


# --- the flags ---------------------------------------------------------------------------


def test_serve_lists_the_parsers_and_refuses_unknown_ones(capsys):
    assert set(TOOL_CALL_PARSERS) == set(PARSER_NAMES)
    assert set(REASONING_PARSERS) == set(REASONING)
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert all(name in usage for name in TOOL_CALL_PARSERS + REASONING_PARSERS)
    with pytest.raises(SystemExit) as refused:
        _parser().parse_args(["serve", "--hf", "x", "--tool-call-parser", "nope"])
    assert refused.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err


def test_a_parser_must_match_the_model():
    checks = dict(auto=False, reasoning=None, template=None, tokenizer=TOKENIZER)
    for parser in ("mistral", "deepseek_v3", "openai"):  # their markers are special tokens
        with pytest.raises(ConfigError, match="parser does not match the model"):
            tool_settings(parser=parser, **checks)
    with pytest.raises(ConfigError, match="--reasoning-parser openai"):
        tool_settings(parser=None, **checks | {"reasoning": "openai"})
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice"):
        tool_settings(parser=None, **checks | {"auto": True})
    template = (ROOT / "tests" / "fixtures" / "llama_tools" / "tokenizer_config.json").read_text()
    assert format_of_template(json.loads(template)["chat_template"]) == "hermes"
    inferred = tool_settings(parser=None, **checks | {"auto": True, "template": template})
    assert inferred == ToolSettings(parser="hermes", auto=True)
