"""Incremental detokenisation with stop strings: token ids in, text deltas out.

Decoding each token on its own is wrong for byte-level and SentencePiece tokenizers: a
multi-byte character can span tokens (a lone piece decodes to U+FFFD), and a token's
leading space depends on the token before it. So each step decodes a short window of ids
twice, with and without the newest, and hands out only the difference, once it no longer
ends in an incomplete character (as vLLM and text-generation-inference do).

Stop strings: the end of the text that could still grow into a stop string is held back;
when one appears, the text ends just before it and :attr:`TextStream.stopped` turns true.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

_INCOMPLETE = "\ufffd"  # what a tokenizer decodes a partial UTF-8 sequence to


class TextStream:
    """The text of one request's new tokens, as it grows.

    Args:
        decode: token ids -> text (special tokens skipped).
        stop: strings that end the text (not included in it).
        skip: token ids that add no text (the request's stop tokens).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Iterable[str] = (), skip=()):
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._skip = frozenset(skip)
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] is the window already turned into text
        self._read = 0
        self._text = ""
        self._sent = 0  # characters of _text handed out
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything handed out so far."""
        return self._text[: self._sent]

    def feed(self, token: int) -> str:
        """Adds a token; the text that is now final (may be empty)."""
        if self.stopped:
            return ""
        if token not in self._skip:
            self._ids.append(token)
            self._text += self._advance(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once no token follows (incomplete characters included)."""
        if not self.stopped:
            self._text += self._advance(final=True)
        return self._release(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if not final and (len(after) <= len(before) or after.endswith(_INCOMPLETE)):
            return ""  # wait for the rest of a character
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _release(self, *, final: bool) -> str:
        if self._stop:
            start = max(0, self._sent - self._hold)
            hits = [i for s in self._stop if (i := self._text.find(s, start)) >= 0]
            if hits:
                self._text = self._text[: min(hits)]
                self.stopped = final = True
        end = len(self._text) if final else max(self._sent, len(self._text) - self._held())
        out = self._text[self._sent : end]
        self._sent = end
        return out

    def _held(self) -> int:
        """Characters at the end of the text that could begin a stop string."""
        tail = self._text[len(self._text) - self._hold :] if self._hold else ""
        for n in range(len(tail), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self._stop):
                return n
        return 0
