"""Tool calling and reasoning on ``/v1/chat/completions``: the request checked, the grammar
that enforces it, and the parser that reads the answer back.

A request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` become a
:class:`ToolPlan` before anything is queued; every mistake is a 400 naming its field (a
tool that is not a function, a name given twice, a parameters schema the grammar engine
cannot compile, a named function not offered, ``tool_choice`` without tools, ``auto`` on a
server started without ``--enable-auto-tool-choice``).

What the grammar engine (llguidance, :mod:`jaxpar.engine._grammar`) enforces:

* ``required``: the answer is one call or more (one when ``parallel_tool_calls`` is
  false) to the offered functions, each with arguments valid for its schema, written in
  the server's format (``--tool-call-parser``; without one, vLLM's JSON forms);
* a named function: the same, with that function only;
* ``auto``: free text, until the format's call marker (``<tool_call>``, ``[TOOL_CALLS]``,
  ``<｜tool▁calls▁begin｜>``); from there on the call must be to an offered function with
  valid arguments. Where calls are the whole answer: for ``llama3_json`` text that does
  not open a call (no ``{`` or ``<|python_tag|>`` first), or calls; for ``openai``
  (harmony), after the analysis, a ``final`` message or a call;
* ``none``: nothing (the tools are still shown to the model, as OpenAI does).

With a reasoning parser the grammar lets the reasoning come first, unconstrained, and
applies the constraint (a call, or a ``response_format``) to the answer after it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import secrets
import string
from collections.abc import Sequence
from typing import Any

from jaxpar.engine import Constraint
from jaxpar.server._errors import bad_request
from jaxpar.server._harmony import HarmonyTokenParser
from jaxpar.server._harmony import encoding as harmony_encoding
from jaxpar.server._reasoning import REASONING, ReasoningFormat
from jaxpar.server._stream_text import Event
from jaxpar.server._tool_parsers import (
    FORMATS,
    PARSER_NAMES,
    Llama3JsonParser,
    NamedArgumentsParser,
    ToolFormat,
    format_of_template,
)

#: JSON layout inside a call: no free whitespace (a model cannot pad forever), and the
#: separators ``json.dumps`` and the chat templates' ``tojson`` write.
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: A function with no ``parameters`` takes an empty object.
NO_PARAMETERS = {"type": "object", "properties": {}}
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """One offered function: its name, description and parameters schema."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_template_tool(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's form)."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclasses.dataclass(frozen=True)
class ToolSettings:
    """The server's tool and reasoning flags.

    ``parser``: the tool-call format (``--tool-call-parser``, or the one the chat
    template implies; None: vLLM's JSON forms, and no ``auto``). ``auto``:
    ``--enable-auto-tool-choice``. ``reasoning``: ``--reasoning-parser`` (None: none).
    ``harmony``: GPT-OSS, whose prompts ``openai-harmony`` renders and whose answers it
    parses from their tokens (:mod:`jaxpar.server._harmony`).
    """

    parser: str | None = None
    auto: bool = False
    reasoning: str | None = None
    harmony: bool = False

    @property
    def format(self) -> ToolFormat:
        return FORMATS[self.parser or "json"]

    @property
    def reasoning_format(self) -> ReasoningFormat | None:
        return REASONING[self.reasoning] if self.reasoning else None

    @property
    def reasoning_grammar(self) -> ReasoningFormat | None:
        """The reasoning a grammar lets come first: the parser's, or GPT-OSS's analysis
        (which a harmony model writes whether or not it is handed out)."""
        return REASONING["openai"] if self.harmony else self.reasoning_format


def tool_settings(
    *,
    parser: str | None,
    auto: bool,
    reasoning: str | None,
    template: str | None,
    tokenizer,
    harmony: bool = False,
) -> ToolSettings:
    """The server's :class:`ToolSettings` from its flags, checked against the checkpoint.

    Without ``parser``, the format the chat template writes calls in (if it is one of
    ours). A format or reasoning parser whose markers are special tokens of its model
    family (``mistral``, ``deepseek_v3``, ``openai``) needs them in the tokenizer.
    ``harmony`` (a GPT-OSS checkpoint, :func:`~._harmony.uses_harmony`): the format is
    ``openai``, and harmony's encoding is loaded now.

    Raises:
        ConfigError: an unknown name, ``auto`` without a format, a parser whose markers
            this tokenizer lacks, or (``harmony``) a parser of another format, or no
            harmony encoding.
    """
    from jaxpar.errors import ConfigError

    if parser is not None and parser not in FORMATS:
        raise ConfigError(
            f"--tool-call-parser {parser!r}: unknown; one of {', '.join(PARSER_NAMES)}"
        )
    if reasoning is not None and reasoning not in REASONING:
        raise ConfigError(
            f"--reasoning-parser {reasoning!r}: unknown; one of {', '.join(REASONING)}"
        )
    if harmony:
        _check_harmony(parser, reasoning)
    chosen = parser or ("openai" if harmony else format_of_template(template))
    if auto and chosen is None:
        raise ConfigError(
            "--enable-auto-tool-choice: the chat template writes no tool-call format this "
            f"server knows; give --tool-call-parser ({', '.join(PARSER_NAMES)})"
        )
    needs = {f"--tool-call-parser {parser}": FORMATS[parser].markers} if parser else {}
    if reasoning == "openai":
        needs[f"--reasoning-parser {reasoning}"] = FORMATS["openai"].markers
    for flag, markers in needs.items():
        missing = [m for m in markers if tokenizer is None or tokenizer.token_to_id(m) is None]
        if missing:
            raise ConfigError(
                f"{flag}: this checkpoint's tokenizer has no token {missing[0]!r}, which "
                "that format writes; the parser does not match the model"
            )
    return ToolSettings(parser=chosen, auto=auto, reasoning=reasoning, harmony=harmony)


def _check_harmony(parser: str | None, reasoning: str | None) -> None:
    """A GPT-OSS server's parsers are harmony's, and its encoding loads."""
    from jaxpar.errors import ConfigError

    for flag, name in (("--tool-call-parser", parser), ("--reasoning-parser", reasoning)):
        if name not in (None, "openai"):
            raise ConfigError(
                f"{flag} {name!r}: this is a GPT-OSS checkpoint, which writes the harmony "
                "format; leave the flag out or give 'openai'"
            )
    harmony_encoding()


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """A request's tools as checked: ``choice`` is ``"none"``, ``"auto"``,
    ``"required"`` or ``"named"`` (then ``named`` is the function)."""

    tools: tuple[ToolSpec, ...]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def calls(self) -> bool:
        """Whether the answer is read for calls."""
        return self.choice != "none"

    @property
    def allowed(self) -> tuple[ToolSpec, ...]:
        return tuple(t for t in self.tools if self.named in (None, t.name))


def check_tools(body, settings: ToolSettings, compile_schema) -> ToolPlan | None:
    """The request's :class:`ToolPlan` (None: it offers no tools).

    ``compile_schema``: a :class:`Constraint` -> compiled (raises GrammarError when
    invalid).

    Raises:
        APIError: 400 naming the field at fault.
    """
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise bad_request(
                "tool_choice: given without tools; offer tools, or leave tool_choice out",
                "tool_choice",
            )
        return None
    specs: list[ToolSpec] = []
    for i, tool in enumerate(body.tools):
        specs.append(_check_tool(f"tools.{i}", tool, specs, compile_schema))
    choice, named = _check_choice(choice, specs)
    if choice == "auto" and not settings.auto:
        raise bad_request(
            'tool_choice: "auto" (the default with tools) needs a server started with '
            '--enable-auto-tool-choice and a --tool-call-parser; ask for "required", '
            'a named function, or "none"',
            "tool_choice",
        )
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return ToolPlan(tuple(specs), choice, named, parallel)


def _check_tool(param: str, tool, specs: list[ToolSpec], compile_schema) -> ToolSpec:
    from jaxpar.errors import GrammarError

    if tool.type != "function":
        raise bad_request(
            f"{param}.type: {tool.type!r}; the only tool type is 'function'", f"{param}.type"
        )
    name = tool.function.name
    if not _NAME.match(name):
        raise bad_request(
            f"{param}.function.name: {name!r}; a name is 1-64 letters, digits, '_', '.' or '-'",
            f"{param}.function.name",
        )
    if any(s.name == name for s in specs):
        raise bad_request(
            f"{param}.function.name: {name!r} is offered twice", f"{param}.function.name"
        )
    parameters = tool.function.parameters
    if parameters is None:
        parameters = NO_PARAMETERS
    try:
        compile_schema(Constraint.json_schema(_with_layout(parameters)))
    except GrammarError as e:
        where = f"{param}.function.parameters"
        raise bad_request(f"{where}: {e}", where) from e
    return ToolSpec(name, tool.function.description, parameters)


def _check_choice(choice, specs: list[ToolSpec]) -> tuple[str, str | None]:
    """``(mode, named function)`` of a request's ``tool_choice`` (default ``auto``)."""
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        return choice, None
    if choice.type != "function":
        raise bad_request(
            f"tool_choice.type: {choice.type!r}; name a function as "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice.type",
        )
    named = choice.function.name
    if named not in {s.name for s in specs}:
        offered = ", ".join(repr(s.name) for s in specs)
        raise bad_request(
            f"tool_choice.function.name: {named!r} is not among the tools offered ({offered})",
            "tool_choice.function.name",
        )
    return "named", named


def _with_layout(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with :data:`CALL_JSON` as its layout (unless it sets its own)."""
    out = copy.deepcopy(schema) if isinstance(schema, dict) else schema
    if isinstance(out, dict) and "x-guidance" not in out:
        out["x-guidance"] = CALL_JSON
    return out


# --- grammars ---------------------------------------------------------------------------------


class Spelling:
    """Fixed text for a Lark grammar: a special token as itself (``<[id]>``; text can
    never spell one), everything else as a quoted string."""

    def __init__(self, specials: dict[str, int]):
        self.specials = specials
        pieces = sorted(specials, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, pieces)) + ")") if pieces else None

    def special(self, text: str) -> bool:
        return text in self.specials

    def __call__(self, text: str) -> str:
        parts = self._split.split(text) if self._split else [text]
        spelled = [
            f"<[{self.specials[p]}]>" if p in self.specials else json.dumps(p, ensure_ascii=False)
            for p in parts
            if p
        ]
        return " ".join(spelled) if spelled else '""'


def _call_rules(fmt: ToolFormat, tools: tuple[ToolSpec, ...], lit, skip: str = "") -> list[str]:
    """``call: call_0 | call_1 ...``, each a call of one function; ``skip``: text at the
    start of every call already matched (the ``auto`` trigger)."""
    rules, names = [], []
    for i, tool in enumerate(tools):
        before, after = fmt.call(tool.name)
        schema = json.dumps(_with_layout(tool.parameters), ensure_ascii=False)
        head = before[len(skip) :] if skip and before.startswith(skip) else before
        spelled = f"{lit(head)} " if head else ""
        tail = f" {lit(after)}" if after else ""
        rules.append(f"call_{i}: {spelled}%json {schema}{tail}")
        names.append(f"call_{i}")
    rules.append(f"call: {' | '.join(names)}")
    return rules


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The text around a list of calls."""

    open: str
    sep: str
    close: str

    @classmethod
    def of(cls, fmt: ToolFormat) -> _Layout:
        return cls(fmt.open, fmt.sep, fmt.close)


def _calls(fmt: ToolFormat | _Layout, parallel: bool, lit) -> str:
    """One call, or calls joined by the format's separator, inside its open/close."""
    body = (
        f"call ({lit(fmt.sep)} call)*" if parallel and fmt.sep else "call+" if parallel else "call"
    )
    parts = [lit(fmt.open) if fmt.open else "", body, lit(fmt.close) if fmt.close else ""]
    return " ".join(p for p in parts if p)


def tool_lark(plan: ToolPlan, settings: ToolSettings, lit: Spelling) -> str | None:
    """The Lark grammar enforcing ``plan`` in the server's format (None: unconstrained)."""
    fmt = settings.format
    if not plan.calls:
        return None
    head, rules = _reasoning_prefix(settings, lit)
    if plan.choice in ("required", "named"):
        if fmt.name == "json" and plan.choice == "named":
            (tool,) = plan.allowed
            answer = f"%json {json.dumps(_with_layout(tool.parameters), ensure_ascii=False)}"
            return _grammar(head, answer, rules)
        rules += _call_rules(fmt, plan.allowed, lit)
        return _grammar(head, _calls(fmt, plan.parallel and plan.choice != "named", lit), rules)
    if fmt.name in _WHOLE_ANSWER_AUTO:  # auto, a format whose calls are a whole answer
        return _grammar(head, *_WHOLE_ANSWER_AUTO[fmt.name](plan, fmt, lit, rules))
    trigger = fmt.trigger  # auto
    if trigger is None or not _one_piece(trigger, lit):
        return None
    rules.append("TAIL: /(.|\\n)*/")
    if lit.special(trigger):
        rules.append(f"trig: TAIL {lit(trigger)}")
    else:
        rules.append(f"trig[lazy]: TAIL {lit(trigger)}")
    if fmt.open:  # the trigger opens the list of calls
        rest = fmt.open[len(trigger) :]
        inner = dataclasses.replace(_Layout.of(fmt), open=rest)
        block = f"trig {_calls(inner, plan.parallel, lit)}"
        rules += _call_rules(fmt, plan.allowed, lit)
    else:  # the trigger starts each call
        block = "trig call"
        rules += _call_rules(fmt, plan.allowed, lit, skip=trigger)
    rules.append(f"block: {block}")
    answer = "block* TAIL" if plan.parallel else "(TAIL | block)"
    return _grammar(head, answer, rules)


def _llama3_auto(plan: ToolPlan, fmt: ToolFormat, lit: Spelling, rules: list[str]):
    """``auto`` for Llama 3's JSON: the answer is text that does not open a call (a
    ``{`` or ``<|python_tag|>`` first), or calls (the tag optional), each to an offered
    function with valid arguments."""
    tag = Llama3JsonParser.TAG
    if lit.special(tag):  # text cannot spell the tag
        text = r"/[ \t\n]*([^{ \t\n](.|\n)*)?/"
    else:  # nor may it start spelling it
        text = r"/[ \t\n]*(([^{< \t\n]|<[^|])(.|\n)*)?/"
    rules += [f"TEXT: {text}", *_call_rules(fmt, plan.allowed, lit)]
    return f"(TEXT | {lit(tag)}? {_calls(fmt, plan.parallel, lit)})", rules


def _harmony_auto(plan: ToolPlan, fmt: ToolFormat, lit: Spelling, rules: list[str]):
    """``auto`` for harmony (after the analysis messages): a ``final`` message of free
    text, or a call (``<|call|>`` ends the turn: one call)."""
    final = f"{lit('<|channel|>')} {lit('final')} {lit('<|message|>')} FINAL_TEXT"
    rules += ["FINAL_TEXT: /(.|\n)*/", *_call_rules(fmt, plan.allowed, lit)]
    return f"({final} | call)", rules


#: ``auto`` for the formats whose calls are the whole answer rather than marked in text.
_WHOLE_ANSWER_AUTO = {"llama3_json": _llama3_auto, "openai": _harmony_auto}


def _one_piece(trigger: str, lit: Spelling) -> bool:
    """A trigger that is one special token, or text with none in it."""
    return lit.special(trigger) or not any(s in trigger for s in lit.specials)


def _reasoning_prefix(settings: ToolSettings, lit: Spelling) -> tuple[str, list[str]]:
    """The reasoning before a call: harmony's calls follow its analysis, whichever the
    reasoning parser (its parser reads every channel)."""
    harmony = settings.format.name == "openai"
    reasoning = REASONING["openai"] if harmony else settings.reasoning_grammar
    if reasoning is None:
        return "", []
    expr, rules = reasoning.prefix(lit)
    return expr, list(rules)


def _grammar(head: str, answer: str, rules: list[str]) -> str:
    start = f"start: {head} {answer}".replace("  ", " ")
    return "\n".join(["%llguidance {}", start, *rules]) + "\n"


def reasoned_lark(
    constraint: Constraint, settings: ToolSettings, lit: Spelling, param: str
) -> str | None:
    """A ``response_format`` or ``guided_*`` constraint applied to the answer after the
    reasoning (None: no reasoning parser, the constraint applies as it is).

    Raises:
        APIError: 400 for ``guided_grammar`` (a grammar of the user's cannot be nested).
    """
    reasoning = settings.reasoning_grammar
    if reasoning is None:
        return None
    head, rules = reasoning.prefix(lit)
    answer_head = lit("<|channel|>final<|message|>") + " " if reasoning.name == "openai" else ""
    if constraint.kind == "json_schema":
        schema = json.loads(constraint.spec)
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema["x-guidance"] = {"whitespace_flexible": False}
        answer = f"%json {json.dumps(schema, ensure_ascii=False)}"
    elif constraint.kind == "regex":
        pattern = constraint.spec.replace("/", "\\/")
        answer, rules = "ANSWER", [*rules, f"ANSWER: /{pattern}/"]
    elif constraint.kind == "choice":
        answer = "(" + " | ".join(lit(c) for c in json.loads(constraint.spec)) + ")"
    else:
        raise bad_request(
            f"{param}: a grammar cannot follow a --reasoning-parser's reasoning; use "
            "response_format, guided_json, guided_regex or guided_choice",
            param,
        )
    return _grammar(head, answer_head + answer, list(rules))


# --- reading the answer -------------------------------------------------------------------------


def call_id(parser: str | None) -> str:
    """A new tool call's id: Mistral's templates take 9 letters and digits; others
    OpenAI's ``call_...``."""
    if parser == "mistral":
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


class ChatOutput:
    """One choice's text in, its reasoning, content and tool calls out, as it streams."""

    def __init__(self, settings: ToolSettings, plan: ToolPlan | None):
        self.settings = settings
        fmt = settings.format if plan is not None and plan.calls else None
        reasoning = settings.reasoning_format
        if fmt is not None and fmt.name == "json" and plan.choice == "named":
            tools = NamedArgumentsParser(plan.named)
        else:
            tools = fmt.new_parser() if fmt is not None else None
        harmony = "openai" in (getattr(fmt, "name", None), getattr(reasoning, "name", None))
        # GPT-OSS through openai-harmony: its parser reads every channel, from the tokens
        self._tokens = HarmonyTokenParser() if settings.harmony else None
        if self._tokens is not None:
            self._reasoning = self._tools = None
        elif harmony:  # one parser reads every channel (harmony as text)
            self._reasoning, self._tools = None, (tools or REASONING["openai"].new_parser())
        else:
            self._reasoning = reasoning.new_parser() if reasoning is not None else None
            self._tools = tools
        self._calls_on = fmt is not None
        self._single = plan is not None and (not plan.parallel or plan.choice == "named")
        self.content = ""
        self.reasoning = ""
        self._space = ""  # whitespace-only content held back
        self.calls: list[dict[str, Any]] = []

    @property
    def active(self) -> bool:
        """Whether anything is parsed (else the text is the content as it is)."""
        return self._reasoning is not None or self._tools is not None or bool(self._tokens)

    def feed(self, text: str, ids: Sequence[int] = ()) -> list[Event]:
        """The events of the answer's next piece: its ``text`` (special tokens spelled
        out), and its token ids (which harmony's parser reads instead)."""
        return self._run(text, final=False, ids=ids)

    def finish(self) -> list[Event]:
        return self._run("", final=True)

    def _run(self, text: str, *, final: bool, ids: Sequence[int] = ()) -> list[Event]:
        if self._tokens is not None:
            out = self._tokens.feed_tokens(list(ids))
            if final:
                out += self._tokens.finish()
        else:
            out = self._text_events(text, final=final)
        kept = self._keep(out)
        if final and self._space and not self.calls:  # trailing whitespace of plain text
            kept += self._keep([Event("content", self._space)], hold=False)
        return kept

    def _text_events(self, text: str, *, final: bool) -> list[Event]:
        """The events of the text parsers (reasoning first, its content to the tools')."""
        if self._reasoning is not None:
            events = self._reasoning.feed(text) if text else []
            if final:
                events += self._reasoning.finish()
        else:
            events = [Event("content", text)] if text else []
        out: list[Event] = []
        for event in events:
            if event.kind == "content" and self._tools is not None:
                out += self._tools.feed(event.text)
            else:
                out.append(event)
        if final and self._tools is not None:
            out += self._tools.finish()
        return out

    def _keep(self, events: list[Event], *, hold: bool = True) -> list[Event]:
        """Records the events that stay (:meth:`_admit`)."""
        kept = []
        for event in events:
            event = self._admit(event, hold)
            if event is not None:
                self._record(event)
                kept.append(event)
        return kept

    def _admit(self, event: Event, hold: bool) -> Event | None:
        """``event`` as handed out, or None: calls past the first when only one is
        allowed, calls when the request takes none, harmony's analysis when no reasoning
        parser was asked for. Content's trailing whitespace is held until text follows
        it (so none is handed out between or after calls, however the text was split)."""
        if event.kind == "content" and hold:
            text = self._space + event.text
            kept = text.rstrip()
            self._space = text[len(kept) :]
            return Event("content", kept) if kept else None
        if event.kind in ("call", "args"):
            return event if self._calls_on and not (self._single and event.index > 0) else None
        if event.kind == "reasoning" and self.settings.reasoning is None:
            return None
        return event

    def _record(self, event: Event) -> None:
        if event.kind == "content":
            self.content += event.text
        elif event.kind == "reasoning":
            self.reasoning += event.text
        elif event.kind == "call":
            function = {"name": event.name, "arguments": ""}
            self.calls.append(
                {"id": call_id(self.settings.parser), "type": "function", "function": function}
            )
        elif event.kind == "args" and event.index < len(self.calls):
            self.calls[event.index]["function"]["arguments"] += event.text

    def deltas(self, events: list[Event]) -> list[dict[str, Any]]:
        """The chat ``delta`` objects of ``events`` (consecutive text of one kind
        joined)."""
        out: list[dict[str, Any]] = []
        for event in events:
            if event.kind in ("content", "reasoning"):
                key = "content" if event.kind == "content" else "reasoning_content"
                if out and set(out[-1]) == {key}:
                    out[-1][key] += event.text
                else:
                    out.append({key: event.text})
            elif event.kind == "call" and event.index < len(self.calls):
                call = self.calls[event.index]
                start = {
                    "index": event.index,
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": event.name, "arguments": ""},
                }
                out.append({"tool_calls": [start]})
            elif event.kind == "args":
                fragment = {"index": event.index, "function": {"arguments": event.text}}
                out.append({"tool_calls": [fragment]})
        return out

    def message(self) -> dict[str, Any]:
        """The whole message, once :meth:`finish` ran."""
        text = self.content.strip() if self.calls else self.content
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if self.settings.reasoning is not None:
            message["reasoning_content"] = self.reasoning or None
        if self.calls:
            message["tool_calls"] = self.calls
        elif message["content"] is None:
            message["content"] = ""
        return message
