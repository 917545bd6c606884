"""GPT-OSS through ``openai-harmony`` (no JAX): prompts rendered by harmony, answers parsed
from their tokens by harmony's ``StreamableParser``.

harmony checks its vocabulary file's hash, and the tests have no network: the file is
``tests/fixtures/harmony/o200k_base.tiktoken.xz`` (``scripts/make_harmony_vocab.py``),
unpacked for ``TIKTOKEN_ENCODINGS_BASE``. The served model's ``tokenizers`` tokenizer is
GPT-OSS's, built here from the same ranks (byte-level BPE, the o200k pattern, harmony's
special tokens at their ids); it encodes as harmony does (checked). The tiny GPT-OSS
checkpoint of the other tests has a 128-token vocabulary and no tokenizer, so it cannot
write harmony's tokens: answers here are hand-written harmony, encoded by harmony.

Checked: the parser reads reasoning, a call and the answer from token ids fed in random
splits (the same events come out); text that is not harmony stays content; the prompt
harmony renders holds the history (reasoning effort, instructions, the tools' namespace,
a call and its result) as harmony parses it back; through the app with the ``openai``
client, a call and the reasoning come back whole and streamed, a named and an ``auto``
choice hand the batcher a grammar that takes the scripted call (and not one with an
argument outside the schema), and ``/v1/responses`` renders through harmony too.
"""

from __future__ import annotations

import base64
import json
import lzma
import os
import random
import threading

import llguidance
import openai
import pytest
from fastapi.testclient import TestClient
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from jaxpar.engine import Sampling
from jaxpar.errors import ConfigError
from jaxpar.server import ServedModel, Service, create_app, tool_settings, uses_harmony
from jaxpar.server._harmony import HarmonyTokenParser, encoding, render_chat
from tests import test_tools_app as tools_app
from tests._serve_util import ROOT

VOCAB = ROOT / "tests" / "fixtures" / "harmony" / "o200k_base.tiktoken.xz"
N_VOCAB = 201088  # GPT-OSS's embedding rows
#: o200k's pre-tokenizer pattern (tiktoken's ``o200k_base``).
PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "the time now"}},
]
ASK = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
ARGS = {"city": "Paris", "days": 2}
CALL = (
    "<|channel|>analysis<|message|>The user wants the weather; call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    f"<|message|>{json.dumps(ARGS)}<|call|>"
)
ANSWER = (
    "<|channel|>analysis<|message|>It is sunny: say so.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Sunny in Paris, 21 C.<|return|>"
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[bytes, int]:
    """o200k's ranks; harmony reads the same file (``TIKTOKEN_ENCODINGS_BASE``)."""
    folder = tmp_path_factory.mktemp("harmony")
    (folder / "o200k_base.tiktoken").write_bytes(lzma.decompress(VOCAB.read_bytes()))
    before = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    encoding()
    out = {}
    for line in (folder / "o200k_base.tiktoken").read_bytes().splitlines():
        token, rank = line.split()
        out[base64.b64decode(token)] = int(rank)
    yield out
    if before is None:
        os.environ.pop("TIKTOKEN_ENCODINGS_BASE")
    else:
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = before


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet (each byte as a printable character)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in kept}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return chars


@pytest.fixture(scope="module")
def tokenizer(ranks) -> Tokenizer:
    """GPT-OSS's tokenizer from the ranks: each token's merges are its splits into two
    tokens, in the order of the rank it makes (as transformers converts tiktoken)."""
    chars = _byte_chars()

    def spell(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        pairs = sorted((ranks[a], ranks[b], a, b) for a, b in splits if a in ranks and b in ranks)
        merges += [(rank, a, b) for _, _, a, b in pairs]
    merges.sort(key=lambda m: m[0])
    vocab = {spell(t): r for t, r in ranks.items()}
    specials = {
        s: encoding().encode(s, allowed_special="all")[0] for s in encoding().special_tokens_set
    }
    specials = {s: i for s, i in specials.items() if i < N_VOCAB}  # the embedding's rows
    bpe = models.BPE(
        vocab | specials, [(spell(a), spell(b)) for _, a, b in merges], ignore_merges=True
    )
    out = Tokenizer(bpe)
    out.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    out.decoder = decoders.ByteLevel()
    out.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in sorted(specials, key=specials.get)]
    )
    return out


def _ids(text: str) -> list[int]:
    return list(encoding().encode(text, allowed_special="all"))


def _parse(ids: list[int], rng: random.Random | None = None) -> list[tuple]:
    """The parser's events over ``ids`` (in random pieces with ``rng``), neighbours of one
    kind joined: (kind, index, name, text)."""
    parser = HarmonyTokenParser()
    events = []
    cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(0, len(ids) - 1))) if rng else []
    for start, end in zip([0, *cuts], [*cuts, len(ids)], strict=True):
        events += parser.feed_tokens(ids[start:end])
    events += parser.finish()
    out: list[tuple] = []
    for e in events:
        if out and e.kind != "call" and out[-1][:2] == (e.kind, e.index):
            out[-1] = (*out[-1][:3], out[-1][3] + e.text)
        else:
            out.append((e.kind, e.index, e.name, e.text))
    return out


def test_the_parser_reads_channels_from_tokens_in_any_split(ranks):
    call, answer = _ids(CALL), _ids(ANSWER)
    expected_call = [
        ("reasoning", 0, "", "The user wants the weather; call get_weather."),
        ("call", 0, "get_weather", ""),
        ("args", 0, "", json.dumps(ARGS)),
    ]
    expected_answer = [
        ("reasoning", 0, "", "It is sunny: say so."),
        ("content", 0, "", "Sunny in Paris, 21 C."),
    ]
    rng = random.Random(0)
    for _ in range(8):
        assert _parse(call, rng) == expected_call
        assert _parse(answer, rng) == expected_answer
    assert _parse(call[:-1]) == expected_call  # the stop token <|call|> not handed out
    not_harmony = "plain words, no channel"
    assert _parse(_ids(not_harmony)) == [("content", 0, "", not_harmony)]


def test_harmony_renders_the_history_as_it_parses_it_back(ranks):
    call_id = "call_1"
    history = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need the weather.",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ARGS},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"},
    ]
    prompt = render_chat(history, TOOLS, "high")
    tail = _ids("<|start|>assistant")
    assert prompt[-len(tail) :] == tail  # the assistant's turn is next
    messages = encoding().parse_messages_from_completion_tokens(prompt[: -len(tail)], None)
    system, developer, user, *turn = messages
    assert "Reasoning: high" in system.content[0].text
    instructions, tools = developer.content[0].text.split("# Tools")
    assert "Be brief." in instructions
    assert "namespace functions" in tools and "// the time now" in tools
    assert tools.index("type get_weather") < tools.index("type get_time")
    assert user.content[0].text == ASK[0]["content"]
    sent = [(m.author.role.value, m.channel, m.recipient, m.content[0].text) for m in turn]
    assert sent[-2:] == [
        ("assistant", "commentary", "functions.get_weather", json.dumps(ARGS)),
        ("tool", "commentary", "assistant", "sunny, 21 C"),
    ]
    assert turn[-1].author.name == "functions.get_weather"
    with pytest.raises(ConfigError, match=r"messages\.1\.tool_call_id"):
        render_chat([*ASK, {"role": "tool", "tool_call_id": "nope", "content": "x"}], TOOLS)


def test_a_gpt_oss_checkpoint_with_harmony_s_tokenizer_is_served_through_harmony(
    ranks, tokenizer, tmp_path
):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    assert uses_harmony(tmp_path, tokenizer)
    tiny = ROOT / "tests" / "fixtures" / "hf" / "gpt_oss"  # no tokenizer: its template's way
    assert not uses_harmony(tiny, None)
    assert not uses_harmony(ROOT / "tests" / "fixtures" / "llama_tools", tokenizer)
    checks = dict(auto=True, template=None, tokenizer=tokenizer, harmony=True)
    settings = tool_settings(parser=None, reasoning=None, **checks)
    assert (settings.parser, settings.harmony) == ("openai", True)
    for flags in ({"parser": "hermes", "reasoning": None}, {"parser": None, "reasoning": "qwen3"}):
        with pytest.raises(ConfigError, match="GPT-OSS checkpoint"):
            tool_settings(**flags, **checks)


# --- through the app -------------------------------------------------------------------------


class ScriptedBatcher(tools_app.ScriptedBatcher):
    """Answers every request with :attr:`script`'s harmony tokens; keeps what it was
    asked (:attr:`requests`)."""

    def __init__(self):
        super().__init__(CALL, vocab_size=N_VOCAB, max_seq_len=4096)

    def tokens(self) -> list[int]:
        return _ids(self.script)


@pytest.fixture(scope="module")
def served(tokenizer):
    """(the stand-in batcher, an ``openai`` client): GPT-OSS through harmony, ``auto`` on,
    the ``openai`` reasoning parser."""
    settings = tool_settings(
        parser=None, auto=True, reasoning="openai", template=None, tokenizer=tokenizer, harmony=True
    )
    stops = tuple(encoding().stop_tokens_for_assistant_actions())
    model = ServedModel(
        name="gpt-oss",
        tokenizer=tokenizer,
        stop_token_ids=stops,
        sampling=Sampling(),
        tools=settings,
    )
    batcher = ScriptedBatcher()
    with TestClient(create_app(Service(batcher, model))) as http:
        for _ in range(200):
            if http.get("/health").status_code == 200:
                break
            threading.Event().wait(0.02)
        yield (
            batcher,
            openai.OpenAI(
                base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
            ),
        )


def test_a_call_and_the_reasoning_come_back_whole_and_streamed(served, tokenizer):
    batcher, client = served
    reply = client.chat.completions.create(model="gpt-oss", messages=ASK, tools=TOOLS)
    assert batcher.requests[-1]["prompt"] == render_chat(ASK, TOOLS)  # harmony's prompt
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (
        choice.message.model_extra["reasoning_content"]
        == "The user wants the weather; call get_weather."
    )
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGS)
    assert not choice.message.content
    stream = client.chat.completions.create(model="gpt-oss", messages=ASK, tools=TOOLS, stream=True)
    reasoning, name, arguments, finish = "", None, "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for piece in delta.tool_calls or []:
            name = piece.function.name or name
            arguments += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, name, json.loads(arguments), finish) == (
        choice.message.model_extra["reasoning_content"], "get_weather", ARGS, "tool_calls"
    )  # fmt: skip


def test_named_and_auto_choices_are_grammars_that_take_valid_calls(served, tokenizer):
    """The batcher gets a grammar (harmony's tokens, special ones as tokens) that takes
    the scripted call and refuses it with an argument outside the schema; ``auto``
    takes a final answer too, ``named`` does not."""
    batcher, client = served
    ll = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=N_VOCAB, eos_token=[200002])
    named = {"type": "function", "function": {"name": "get_weather"}}
    rome = CALL.replace('"Paris"', '"Rome"')
    for choice, answer_ok in ((named, False), ("auto", True)):
        client.chat.completions.create(
            model="gpt-oss", messages=ASK, tools=TOOLS, tool_choice=choice
        )
        lark = batcher.requests[-1]["grammar"].constraint.spec
        for script, ok in ((CALL, True), (rome, False), (ANSWER, answer_ok)):
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
            matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
            assert all(matcher.consume_token(t) for t in _ids(script)) == ok, (choice, script)


def test_responses_render_through_harmony_whole_and_streamed(served):
    batcher, client = served
    batcher.script = ANSWER
    asked = dict(
        model="gpt-oss", input=ASK[0]["content"], instructions="Be brief.",
        reasoning={"effort": "low"},
    )  # fmt: skip
    try:
        response = client.responses.create(**asked)
        events = list(client.responses.create(**asked, stream=True))
    finally:
        batcher.script = CALL
    system = [{"role": "system", "content": "Be brief."}]
    assert batcher.requests[-1]["prompt"] == render_chat(system + ASK, None, "low")
    kinds = [(item.type, "".join(c.text for c in item.content)) for item in response.output]
    assert kinds == [("reasoning", "It is sunny: say so."), ("message", "Sunny in Paris, 21 C.")]
    deltas = {"response.reasoning_text.delta": "", "response.output_text.delta": ""}
    for event in events:
        if event.type in deltas:
            deltas[event.type] += event.delta
    assert list(deltas.values()) == [text for _, text in kinds]


def test_a_history_harmony_cannot_render_is_a_400_naming_the_message(served):
    batcher, client = served
    before = len(batcher.requests)
    orphan = [*ASK, {"role": "tool", "tool_call_id": "nope", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="gpt-oss", messages=orphan, tools=TOOLS)
    assert refused.value.body["param"] == "messages.1.tool_call_id"
    assert len(batcher.requests) == before
