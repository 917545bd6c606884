"""One tool call written as a JSON object, ``{"name": ..., "arguments": {...}}``, parsed as
its text comes.

Most tool-call formats wrap such an object in markers of their own (Hermes'
``<tool_call>``, Mistral's ``[TOOL_CALLS][...]``, Llama 3's bare JSON, whose key is
``parameters``). :class:`CallObject` hands out the call's name as soon as it is whole, then
the arguments' JSON text in fragments as they come, and knows where the object ends. An
object written in another order (arguments first) is read whole once it ends.
"""

from __future__ import annotations

import json
import re

from jaxpar.server._stream_text import Event, JsonValue

#: ``{"name": "NAME", "arguments": `` (or ``"parameters"``) at the start of an object.
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
#: What the start of an object can say, once whole, that rules out :data:`_HEAD`.
_FIRST_KEY = re.compile(r'\s*\{\s*"((?:[^"\\]|\\.)*)"')
_NAME_VALUE = re.compile(r'\s*\{\s*"name"\s*:\s*([^\s])')
_SECOND_KEY = re.compile(r'\s*\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*([^\s])\s*("(?:[^"\\]|\\.)*")?')
ARGUMENT_KEYS = ("arguments", "parameters")


class CallObject:
    """One call object's text in, :class:`Event` s out (``index``: the call's number)."""

    def __init__(self, index: int):
        self.index = index
        self.named = False  # the name was handed out
        self.done = False  # the object ended (the rest of the text is not its)
        self.failed = False  # it did not parse: its text is plain content
        self._head = ""  # text before the arguments, while they have not started
        self._args = JsonValue()
        self._args_out = False  # a fragment of the arguments was handed out
        self._whole: JsonValue | None = None  # reading a whole object (another key order)
        self._text = ""  # everything fed (for the whole-object path and failures)

    def feed(self, text: str) -> tuple[list[Event], str]:
        """Events from ``text``, and the text after the object's end (not its)."""
        if self.done:
            return [], text
        if self._whole is not None:
            return self._feed_whole(text)
        if not self.named:
            self._head += text
            self._text += text
            match = _HEAD.match(self._head)
            if match is None:
                if _other_form(self._head):
                    self._whole = JsonValue()
                    self._text = ""
                    return self._feed_whole(self._head)
                return [], ""
            self.named = True
            name = json.loads(f'"{match.group(1)}"')
            events = [Event("call", index=self.index, name=name)]
            rest = self._head[match.end() :]
            more, after = self._feed_args(rest)
            return events + more, after
        self._text += text
        return self._feed_args(text)

    def _feed_args(self, text: str) -> tuple[list[Event], str]:
        if self._args.done:  # the arguments ended: read up to the object's "}"
            end = text.find("}")
            if end < 0:
                return [], ""
            self.done = True
            return [], text[end + 1 :]
        n = self._args.feed(text)
        fragment = text[:n]
        if not self._args.started:
            return [], ""
        if not self._args_out:
            fragment = fragment.lstrip()
            self._args_out = True
        events = [Event("args", fragment, index=self.index)] if fragment else []
        if self._args.done:
            more, after = self._feed_args(text[n:])
            return events + more, after
        return events, ""

    def _feed_whole(self, text: str) -> tuple[list[Event], str]:
        n = self._whole.feed(text)
        self._text += text[:n]
        if not self._whole.done:
            return [], ""
        self.done = True
        return self._whole_events(), text[n:]

    def _whole_events(self) -> list[Event]:
        try:
            call = json.loads(self._text)
        except ValueError:
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            self.failed = True
            return [Event("content", self._text)] if self._text else []
        key = next((k for k in ARGUMENT_KEYS if k in call), None)
        arguments = call.get(key, {}) if key else {}
        self.named = True
        return [
            Event("call", index=self.index, name=call["name"]),
            Event("args", json.dumps(arguments, ensure_ascii=False), index=self.index),
        ]

    def finish(self) -> list[Event]:
        """Events of an object the text ended inside (a cut-off call keeps what it had)."""
        if self.done:
            return []
        self.done = True
        if self._whole is not None or not self.named:
            if not self._text.strip():
                return []
            return self._whole_events()
        return []

    @property
    def text(self) -> str:
        """Everything fed that belongs to the object so far."""
        return self._text


def _other_form(head: str) -> bool:
    """Whether the start of an object already rules out ``{"name": "...", "arguments": ``
    (another key order, or not an object at all)."""
    stripped = head.lstrip()
    if stripped and not stripped.startswith("{"):
        return True
    first = _FIRST_KEY.match(head)
    if first is not None and first.group(1) != "name":
        return True
    value = _NAME_VALUE.match(head)
    if value is not None and value.group(1) != '"':
        return True
    second = _SECOND_KEY.match(head)
    if second is None:
        return False
    if second.group(1) != ",":
        return True
    key = second.group(2)
    return key is not None and key.strip('"') not in ARGUMENT_KEYS
