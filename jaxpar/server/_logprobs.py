"""OpenAI's ``logprobs`` objects from the engine's :class:`~jaxpar.engine.TokenLogprob` entries.

Completions spell them as parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs``:
one ``{token: logprob}`` dict per position, the chosen token always in it, and
``text_offset`` into the choice's text); chat as ``content``, one object per token
(``token``, ``logprob``, ``bytes``, ``top_logprobs``: a list). A token's text is what it
adds to the text before it (:class:`TokenPieces`), so the pieces put together are the
choice's text and the offsets index it; an alternative is named by decoding it alone.
Prompt positions (``echo``) start with the first token, which has no logprob (null).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxpar.engine import TokenLogprob

#: Tokens of context a piece is decoded in (enough for a character's bytes and a space).
WINDOW = 6


class TokenPieces:
    """Each token's text as decoding it adds to the tokens before it (an empty piece for
    a token that adds nothing, e.g. a special one, or part of a character)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self._ids: list[int] = []

    def feed(self, token: int) -> str:
        before = self._decode(self._ids)
        self._ids.append(token)
        after = self._decode(self._ids)
        self._ids = self._ids[-WINDOW:]
        return after[len(before) :] if after.startswith(before) else ""


class ChoiceLogprobs:
    """One choice's logprobs in OpenAI's form, appended to as its tokens arrive.

    Args:
        name: a token id -> its text alone (what an alternative is called).
        decode: token ids -> text (as the choice's text is decoded).
        top: the alternatives asked for per position.
        chat: chat's form (else completions').
    """

    def __init__(self, name: Callable[[int], str], decode, top: int, *, chat: bool):
        self._name, self._decode, self._top, self._chat = name, decode, top, chat
        self._pieces = TokenPieces(decode)
        self.offset = 0  # characters of the choice's text before the next token

    def restart(self, offset: int) -> None:
        """The next tokens start a new text at ``offset`` of the choice's (the completion
        after an echoed prompt)."""
        self._pieces = TokenPieces(self._decode)
        self.offset = offset

    def add(self, tokens: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict:
        """The object for ``tokens`` (their ``entries``: None for a first prompt token)."""
        items = [self._item(t, e) for t, e in zip(tokens, entries, strict=True)]
        if self._chat:
            return {"content": [item for item, _ in items]}
        return {
            "tokens": [item["token"] for item, _ in items],
            "token_logprobs": [item["logprob"] for item, _ in items],
            "top_logprobs": [item["top_logprobs"] for item, _ in items],
            "text_offset": [offset for _, offset in items],
        }

    def _item(self, token: int, entry: TokenLogprob | None) -> tuple[dict[str, Any], int]:
        piece = self._pieces.feed(token)
        offset = self.offset
        self.offset += len(piece)
        shown = piece or self._name(token)
        if entry is None:
            return {"token": shown, "logprob": None, "top_logprobs": None}, offset
        top = entry.top[: self._top]
        if self._chat:
            alternatives = [_chat_entry(self._name(i), lp) for i, lp in top]
            item = _chat_entry(shown, entry.logprob) | {"top_logprobs": alternatives}
            return item, offset
        alternatives = {self._name(i): lp for i, lp in top}
        alternatives.setdefault(self._name(token), entry.logprob)  # the chosen one, always
        return {"token": shown, "logprob": entry.logprob, "top_logprobs": alternatives}, offset


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def merge(parts: Sequence[dict]) -> dict:
    """Objects of consecutive tokens as one (their lists joined)."""
    out: dict[str, list] = {}
    for part in parts:
        for key, values in part.items():
            out.setdefault(key, []).extend(values)
    return out
