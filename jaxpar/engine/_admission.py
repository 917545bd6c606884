"""What a request may ask, decided in one place: its prompt's token ids and length, how many
tokens it may draw, and its sampling over the checkpoint's defaults.

The engine (``generate``), the continuous batcher (``submit``), ``jaxpar run`` and the
server all ask an :class:`Admission`, so they agree: a request fits when its prompt plus
all but its last new token fit the cache (the last token is returned, never fed back),
an exact fit included; and sampling fields given on the command line or over HTTP merge
with the checkpoint's defaults by one rule (:func:`merge_sampling`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxpar.engine._sampling import Sampling
from jaxpar.errors import CacheOverflowError, ShapeError


@dataclasses.dataclass(frozen=True)
class Admission:
    """The limits a request is checked against.

    Attributes:
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        max_seq_len: the longest request: ``len(prompt) + max_tokens - 1`` at most.
        max_prompt_len: the longest prompt (default ``max_seq_len``; a disaggregated
            prefill engine may hold fewer).
    """

    vocab_size: int
    max_seq_len: int
    max_prompt_len: int | None = None

    @property
    def prompt_limit(self) -> int:
        return self.max_seq_len if self.max_prompt_len is None else self.max_prompt_len

    def token_ids(self, prompt: Sequence[int], name: str = "prompt") -> np.ndarray:
        """``prompt`` as a 1-D integer array of ids in the vocabulary.

        Raises:
            ShapeError: not 1-D, empty, not integers, or an id outside the vocabulary.
        """
        ids = np.asarray(prompt)
        if ids.ndim != 1:
            raise ShapeError(f"{name} must be a 1-D sequence of token ids, got shape {ids.shape}")
        if ids.size == 0:
            raise ShapeError(f"{name} is empty; every prompt needs at least one token")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ShapeError(f"{name} has dtype {ids.dtype}; token ids must be integers")
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise ShapeError(
                f"{name} has token id(s) {bad[:5].tolist()} outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        return ids

    def room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of ``prompt_len`` tokens may draw."""
        return self.max_seq_len + 1 - prompt_len

    def check(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        name: str = "prompt",
        tokens_name: str = "max_tokens",
    ) -> np.ndarray:
        """The prompt's ids, once it and ``max_tokens`` fit.

        Raises:
            ShapeError: bad ids, or ``max_tokens`` not an int >= 1.
            CacheOverflowError: the prompt, or the prompt with its new tokens, does not
                fit; the message says how many new tokens would.
        """
        ids = self.token_ids(prompt, name)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ShapeError(f"{tokens_name} must be an int >= 1, got {max_tokens!r}")
        if ids.size > self.prompt_limit:
            raise CacheOverflowError(
                f"{name} of {ids.size} tokens exceeds max_seq_len={self.prompt_limit}"
            )
        if max_tokens > self.room(ids.size):
            raise CacheOverflowError(
                f"{name} ({ids.size} tokens) + {tokens_name}={max_tokens} exceeds "
                f"max_seq_len={self.max_seq_len} + 1; lower {tokens_name} to at most "
                f"{self.room(ids.size)} or raise max_seq_len"
            )
        return ids


def merge_sampling(
    base: Sampling,
    *,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    **penalties: float,
) -> Sampling:
    """A request's sampling: the fields it gives over ``base`` (the checkpoint's defaults).

    One rule for the command line and the server: a field left out keeps the default;
    ``temperature=0`` is greedy (top-k and top-p have nothing to cut); ``top_k`` or
    ``top_p`` given without a temperature samples, at the default temperature or 1.0 when
    the default is greedy; ``top_k <= 0`` switches top-k off. Penalties not given keep
    the defaults'.
    """
    kept = {
        name: getattr(base, name)
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")
    }
    kept |= {name: value for name, value in penalties.items() if value is not None}
    if temperature is None and top_k is None and top_p is None:
        return dataclasses.replace(base, **kept)
    if temperature is None:  # top_k / top_p alone: sample
        temperature = base.temperature or 1.0
    if temperature == 0:
        return Sampling(**kept)
    top_k = base.top_k if top_k is None else (top_k if top_k > 0 else None)
    top_p = base.top_p if top_p is None else top_p
    return Sampling(temperature=temperature, top_k=top_k, top_p=top_p, **kept)
