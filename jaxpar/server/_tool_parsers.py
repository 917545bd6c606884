"""Tool-call formats: how each model family writes a call, read back as it streams.

One class per format, named as vLLM's ``--tool-call-parser`` names them:

* ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>``, one block per call, text around them is the answer's content;
* ``llama3_json`` (Llama 3.1-3.3): the answer is the call, ``{"name": ..., "parameters":
  {...}}`` (after an optional ``<|python_tag|>``); several are joined by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` per call;
* ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name
  \\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``;
* ``openai`` (GPT-OSS, the harmony format as text): messages ``<|channel|>CHANNEL[
  to=functions.NAME]...<|message|>BODY<|end|>``; a message to ``functions.NAME`` is a
  call (its body the arguments), ``analysis`` is reasoning, ``final`` the content;
* ``json``: no model format, for a server started without a parser: a named function's
  arguments object alone, or for ``required`` a JSON list ``[{"name": ..., "parameters":
  {...}}]`` (what vLLM constrains such requests to).

Each parser takes the answer's text in any pieces and hands out :class:`Event` s (content,
a call's start with its name, fragments of its arguments); fed in any split, it gives the
same calls. Each format also spells a call for the grammar that constrains it
(:meth:`ToolFormat.call`): the fixed text around the arguments, whose JSON schema the
grammar engine enforces (:mod:`jaxpar.server._tools`).
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from jaxpar.server._call_json import CallObject
from jaxpar.server._stream_text import Event, JsonValue, content, cut, reasoning


class ToolParser:
    """The base of a format's incremental parser: ``feed`` text, then ``finish``."""

    def __init__(self) -> None:
        self.calls = 0  # calls started so far (the next call's index)

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def _close(self, call: CallObject, events: list[Event]) -> list[Event]:
        """Counts a call once it had a name (a failed one gave content instead)."""
        if call.named and not call.failed:
            self.calls = max(self.calls, call.index + 1)
        return events


class _Blocks(ToolParser):
    """Calls as JSON objects between an opening and a closing marker; text outside them
    is content (Hermes)."""

    OPEN: ClassVar[str]
    CLOSE: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._call: CallObject | None = None

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        events = self._run(final=True)
        if self._call is not None:
            events += self._close(self._call, self._call.finish())
            self._call = None
        return events

    def _run(self, *, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._call is None:
                before, marker, self._buf = cut(self._buf, (self.OPEN,), final=final)
                events += content(before)
                if marker is None:
                    return events
                self._call = CallObject(self.calls)
                continue
            before, marker, after = cut(self._buf, (self.CLOSE,), final=final)
            found, _ = self._call.feed(before)
            events += found
            if marker is None:
                self._buf = after
                return events
            events += self._close(self._call, self._call.finish())
            self._call, self._buf = None, after


class HermesParser(_Blocks):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Llama3JsonParser(ToolParser):
    """The answer is content, unless it starts with ``{`` or ``<|python_tag|>``: then it
    is calls, JSON objects joined by ``;``."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._mode: str | None = None  # None: undecided, "content", "calls"
        self._buf = ""
        self._call: CallObject | None = None

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        events = self._run(final=True)
        if self._call is not None:
            events += self._close(self._call, self._call.finish())
        if self._mode != "calls":
            events += content(self._buf)
        self._buf = ""
        return events

    def _run(self, *, final: bool) -> list[Event]:
        if self._mode is None:
            head = self._buf.lstrip()
            if head.startswith(self.TAG) or head.startswith("{"):
                self._mode = "calls"
                self._buf = head.removeprefix(self.TAG)
            elif head and not self.TAG.startswith(head) or final:
                self._mode = "content"
            else:
                return []
        if self._mode == "content":
            out, self._buf = self._buf, ""
            return content(out)
        events: list[Event] = []
        while self._buf:
            if self._call is None:
                self._buf = self._buf.lstrip().lstrip(";").lstrip()
                if not self._buf:
                    break
                self._call = CallObject(self.calls)
            found, self._buf = self._call.feed(self._buf)
            events += found
            if not self._call.done:
                break
            events += self._close(self._call, [])
            self._call = None
        return events


class _States(ToolParser):
    """A parser run as states: ``_<mode>(events, final)`` reads what it can from the
    buffer and returns whether to go on (in the mode it leaves)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self._mode = mode
        self._buf = ""

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def _run(self, *, final: bool) -> list[Event]:
        events: list[Event] = []
        while getattr(self, f"_{self._mode}")(events, final):
            pass
        return events

    def _args_from(self, events: list[Event], value: JsonValue) -> bool:
        """Fragments of the current call's arguments (a JSON value) from the buffer;
        True once the value ended (the call is counted)."""
        n = value.feed(self._buf)
        fragment, self._buf = self._buf[:n], self._buf[n:]
        if not self._sent:
            fragment = fragment.lstrip()
        if fragment:
            self._sent = True
            events.append(Event("args", fragment, index=self.calls))
        if value.done:
            self.calls += 1
        return value.done


class MistralParser(_States):
    """Content up to ``[TOOL_CALLS]``, then a JSON list of call objects, or ``name[ARGS]``
    and the arguments' JSON (repeated per call)."""

    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self) -> None:
        super().__init__("content")  # then "after_tag", "list", "name", "args"
        self._call: CallObject | None = None
        self._called = ""  # the name of a call written name[ARGS]{...}
        self._value = JsonValue()
        self._sent = False

    def finish(self) -> list[Event]:
        events = self._run(final=True)
        if self._call is not None:
            events += self._close(self._call, self._call.finish())
        elif self._mode == "args" and self._sent:
            self.calls += 1
        return events

    def _content(self, events: list[Event], final: bool) -> bool:
        before, marker, self._buf = cut(self._buf, (self.TAG,), final=final)
        events += content(before)
        if marker is not None:
            self._mode = "after_tag"
        return marker is not None

    def _after_tag(self, events: list[Event], final: bool) -> bool:
        self._buf = self._buf.lstrip()
        if not self._buf:
            return False
        if self._buf.startswith("["):
            self._buf, self._mode = self._buf[1:], "list"
        else:
            self._mode, self._called = "name", ""
        return True

    def _list(self, events: list[Event], final: bool) -> bool:
        if self._call is None:
            self._buf = self._buf.lstrip().lstrip(",").lstrip()
            if self._buf.startswith("]"):
                self._buf, self._mode = self._buf[1:], "content"
                return True
            if not self._buf:
                return False
            self._call = CallObject(self.calls)
        found, self._buf = self._call.feed(self._buf)
        events += found
        if not self._call.done:
            return False
        events += self._close(self._call, [])
        self._call = None
        return True

    def _name(self, events: list[Event], final: bool) -> bool:
        before, marker, self._buf = cut(self._buf, (self.ARGS,), final=final)
        self._called += before
        if marker is None:
            return False
        events.append(Event("call", index=self.calls, name=self._called.strip()))
        self._mode, self._value, self._sent = "args", JsonValue(), False
        return True

    def _args(self, events: list[Event], final: bool) -> bool:
        if not self._args_from(events, self._value):
            return False
        self._mode = "content"
        return True


class DeepSeekV3Parser(_States):
    """Content up to ``<｜tool▁calls▁begin｜>``; then per call ``<｜tool▁call▁begin｜>TYPE
    <｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>``."""

    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    FENCE = "```json"

    def __init__(self) -> None:
        super().__init__("content")  # then "calls", "head", "fence", "args", "tail"
        self._value = JsonValue()
        self._sent = False

    def finish(self) -> list[Event]:
        events = self._run(final=True)
        if self._mode in ("fence", "args"):
            self.calls += 1  # a call the text ended inside keeps what it had
        return events

    def _content(self, events: list[Event], final: bool) -> bool:
        before, marker, self._buf = cut(self._buf, (self.CALLS_BEGIN,), final=final)
        events += content(before)
        if marker is not None:
            self._mode = "calls"
        return marker is not None

    def _calls(self, events: list[Event], final: bool) -> bool:
        _, marker, self._buf = cut(self._buf, (self.CALL_BEGIN, self.CALLS_END), final=final)
        if marker is not None:
            self._mode = "content" if marker == self.CALLS_END else "head"
        return marker is not None

    def _head(self, events: list[Event], final: bool) -> bool:  # TYPE<｜tool▁sep｜>NAME\n
        _, sep, after = self._buf.partition(self.SEP)
        if not sep or "\n" not in after:
            return False
        name, _, self._buf = after.partition("\n")
        events.append(Event("call", index=self.calls, name=name.strip()))
        self._mode, self._sent = "fence", False
        return True

    def _fence(self, events: list[Event], final: bool) -> bool:
        head = self._buf.lstrip()
        if len(head) < len(self.FENCE) and self.FENCE.startswith(head) and not final:
            return False
        self._buf, self._mode, self._value = head.removeprefix(self.FENCE), "args", JsonValue()
        return True

    def _args(self, events: list[Event], final: bool) -> bool:
        if not self._args_from(events, self._value):
            return False
        self._mode = "tail"
        return True

    def _tail(self, events: list[Event], final: bool) -> bool:
        _, marker, self._buf = cut(self._buf, (self.CALL_END,), final=final)
        if marker is not None:
            self._mode = "calls"
        return marker is not None


class HarmonyParser(ToolParser):
    """GPT-OSS's harmony messages as text (special tokens spelled out).

    A message is ``[<|start|>ROLE]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]
    <|message|>BODY`` ended by ``<|end|>``, ``<|call|>``, ``<|return|>``, the next
    ``<|start|>`` or the end of the text. ``analysis`` bodies are reasoning, bodies sent
    ``to=functions.NAME`` are calls, every other body is content.
    """

    START, MESSAGE = "<|start|>", "<|message|>"
    ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
    _CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
    _RECIPIENT = re.compile(r"\bto=([^\s<]+)")

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._header: str | None = ""  # None: inside a body
        self._kind = "content"  # the body's: "content", "reasoning" or "call"
        self._sent = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        events = self._run(final=True)
        if self._header is None and self._kind == "call":
            self.calls += 1
        elif self._header and self._header.strip() and self.MESSAGE not in self._header:
            # text with no message header (no harmony at all): content
            events += content(self._header.replace(self.START, ""))
        self._header = ""
        return events

    def _run(self, *, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._header is not None:
                self._header += self._buf
                self._buf = ""
                if self.MESSAGE not in self._header:
                    return events
                head, _, self._buf = self._header.partition(self.MESSAGE)
                self._header = None
                self._open(head, events)
            before, marker, self._buf = cut(self._buf, self.ENDS, final=final)
            if self._kind == "call" and not self._sent:
                before = before.lstrip()
            if before:
                self._sent = True
                if self._kind == "call":
                    events.append(Event("args", before, index=self.calls))
                else:
                    events += (reasoning if self._kind == "reasoning" else content)(before)
            if marker is None:
                return events
            if self._kind == "call":
                self.calls += 1
            self._header = self.START if marker == self.START else ""
            if not self._buf:
                return events

    def _open(self, head: str, events: list[Event]) -> None:
        channel = self._CHANNEL.search(head)
        recipient = self._RECIPIENT.search(head)
        self._sent = False
        if recipient is not None and recipient.group(1).startswith("functions."):
            self._kind = "call"
            name = recipient.group(1).removeprefix("functions.")
            events.append(Event("call", index=self.calls, name=name))
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"


class JsonListParser(ToolParser):
    """``json`` under ``required``: a JSON list of ``{"name": ..., "parameters": ...}``."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._open = False
        self._call: CallObject | None = None

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._buf:
            if not self._open:
                head = self._buf.lstrip()
                if not head:
                    break
                if not head.startswith("["):
                    events += content(head)
                    self._buf = ""
                    break
                self._buf, self._open = head[1:], True
            if self._call is None:
                self._buf = self._buf.lstrip().lstrip(",").lstrip()
                if not self._buf or self._buf.startswith("]"):
                    self._buf = ""
                    break
                self._call = CallObject(self.calls)
            found, self._buf = self._call.feed(self._buf)
            events += found
            if not self._call.done:
                break
            events += self._close(self._call, [])
            self._call = None
        return events

    def finish(self) -> list[Event]:
        if self._call is not None:
            return self._close(self._call, self._call.finish())
        return []


class NamedArgumentsParser(ToolParser):
    """``json`` under a named function: the whole answer is that function's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        events = []
        if self.calls == 0:
            text = text.lstrip()
            if not text:
                return []
            self.calls = 1
            events.append(Event("call", index=0, name=self._name))
        return events + [Event("args", text, index=0)]

    def finish(self) -> list[Event]:
        return []


# --- how each format writes a call, for the grammar -------------------------------------------


class ToolFormat:
    """How one format writes calls, as grammar pieces.

    ``trigger``: the text that starts calls when the model chooses (``auto``), or None
    when calls must be the whole answer (Llama 3's JSON). ``open``/``close``: text around
    all of the calls; ``sep``: between two calls; :meth:`call`: the text before and after
    one call's arguments.
    """

    name: ClassVar[str]
    parser: ClassVar[type[ToolParser]]
    trigger: ClassVar[str | None]
    open: ClassVar[str] = ""
    close: ClassVar[str] = ""
    sep: ClassVar[str] = ""
    #: Tokens this format's models have as special tokens (checked at start-up).
    markers: ClassVar[tuple[str, ...]] = ()

    def call(self, name: str) -> tuple[str, str]:
        raise NotImplementedError

    def new_parser(self) -> ToolParser:
        return self.parser()


def _json_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


class Hermes(ToolFormat):
    name, parser, trigger, sep = "hermes", HermesParser, "<tool_call>", "\n"

    def call(self, name: str) -> tuple[str, str]:
        return f'<tool_call>\n{{"name": {_json_str(name)}, "arguments": ', "}\n</tool_call>"


class Llama3Json(ToolFormat):
    name, parser, trigger, sep = "llama3_json", Llama3JsonParser, None, "; "

    def call(self, name: str) -> tuple[str, str]:
        return f'{{"name": {_json_str(name)}, "parameters": ', "}"


class Mistral(ToolFormat):
    name, parser, trigger = "mistral", MistralParser, "[TOOL_CALLS]"
    open, close, sep = "[TOOL_CALLS][", "]", ", "
    markers = ("[TOOL_CALLS]",)

    def call(self, name: str) -> tuple[str, str]:
        return f'{{"name": {_json_str(name)}, "arguments": ', "}"


class DeepSeekV3(ToolFormat):
    name, parser = "deepseek_v3", DeepSeekV3Parser
    trigger = DeepSeekV3Parser.CALLS_BEGIN
    open, close = DeepSeekV3Parser.CALLS_BEGIN, DeepSeekV3Parser.CALLS_END
    markers = (DeepSeekV3Parser.CALLS_BEGIN, DeepSeekV3Parser.CALL_BEGIN, DeepSeekV3Parser.SEP)

    def call(self, name: str) -> tuple[str, str]:
        p = DeepSeekV3Parser
        return f"{p.CALL_BEGIN}function{p.SEP}{name}\n```json\n", f"\n```{p.CALL_END}"


class Harmony(ToolFormat):
    name, parser, trigger = "openai", HarmonyParser, "<|channel|>commentary to=functions."
    markers = ("<|channel|>", "<|message|>", "<|call|>")

    def call(self, name: str) -> tuple[str, str]:
        return (
            f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
            "<|call|>",
        )


class JsonFallback(ToolFormat):
    """No model format (no parser configured): vLLM's forms for ``required`` and named."""

    name, parser, trigger = "json", JsonListParser, None
    open, close, sep = "[", "]", ", "

    def call(self, name: str) -> tuple[str, str]:
        return f'{{"name": {_json_str(name)}, "parameters": ', "}"


#: The formats by ``--tool-call-parser`` name.
FORMATS: dict[str, ToolFormat] = {
    f.name: f() for f in (Hermes, Llama3Json, Mistral, DeepSeekV3, Harmony, JsonFallback)
}
#: The names ``--tool-call-parser`` takes (``json`` is the fallback, not a choice).
PARSER_NAMES = tuple(name for name in FORMATS if name != "json")


def format_of_template(template: str | None) -> str | None:
    """The tool-call format a chat template writes calls in (None: none recognised)."""
    if not template:
        return None
    checks = (
        ("<|channel|>", "openai"),
        (DeepSeekV3Parser.CALLS_BEGIN, "deepseek_v3"),
        ("[TOOL_CALLS]", "mistral"),
        ("<tool_call>", "hermes"),
        ("<|python_tag|>", "llama3_json"),
    )
    for marker, name in checks:
        if marker in template:
            return name
    return None
