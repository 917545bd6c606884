"""Pieces the incremental output parsers share: what a parser hands out, and text scanning
that works on any split of its input.

A parser is fed the answer's text in whatever pieces the detokeniser hands out (a
character at a time, or a whole answer at once) and must give the same result either way.
Two tools make that so: :func:`cut` finds a marker or holds back the end of the text that
could still become one, and :class:`JsonValue` follows a JSON value character by character
to find where it ends (strings and escapes included).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Event:
    """One piece of parsed output.

    ``kind``: ``"content"`` (answer text), ``"reasoning"`` (reasoning text), ``"call"`` (a
    tool call starts: ``index`` and ``name``) or ``"args"`` (a fragment of call ``index``'s
    arguments, JSON text).
    """

    kind: str
    text: str = ""
    index: int = 0
    name: str = ""


def content(text: str) -> list[Event]:
    return [Event("content", text)] if text else []


def reasoning(text: str) -> list[Event]:
    return [Event("reasoning", text)] if text else []


def partial_suffix(text: str, marker: str) -> int:
    """Characters at the end of ``text`` that begin ``marker`` (0: none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def cut(text: str, markers: tuple[str, ...], *, final: bool) -> tuple[str, str | None, str]:
    """``(before, marker, after)`` at the first of ``markers`` in ``text``.

    Without one: ``(safe, None, held)``, where ``held`` is the end of ``text`` that could
    still grow into a marker (nothing held when ``final``).
    """
    hits = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    if hits:
        i, marker = min(hits)
        return text[:i], marker, text[i + len(marker) :]
    held = 0 if final else max(partial_suffix(text, m) for m in markers)
    return text[: len(text) - held], None, text[len(text) - held :]


class JsonValue:
    """Follows one JSON value as its characters come: :attr:`done` once it has ended.

    Objects, arrays and strings end at their closing character; a bare number, ``true``,
    ``false`` or ``null`` ends at the first character that cannot continue it (which is
    not part of it). Leading whitespace is skipped.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.started = False
        self.done = False
        self._string = False
        self._escape = False
        self._bare = False

    def feed(self, text: str) -> int:
        """Reads from ``text`` until the value ends; the characters that belong to it."""
        for i, ch in enumerate(text):
            if self.done or self._ends_before(ch):
                return i
        return len(text)

    def _ends_before(self, ch: str) -> bool:
        """Takes ``ch``; True when the value ended before it (a bare value's end)."""
        if not self.started:
            self.started = not ch.isspace()
            if not self.started:
                return False
        if self._string:
            self._in_string(ch)
        elif self._bare:
            self.done = ch in ",}] \t\r\n"
            return self.done
        elif ch == '"':
            self._string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.done = self.depth <= 0
        elif self.depth == 0:
            self._bare = True
        return False

    def _in_string(self, ch: str) -> None:
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._string = False
            self.done = self.depth == 0
