"""What drafts tokens for speculative decoding: the proposer interface, and n-gram lookup
behind it.

A :class:`Proposer` is asked each speculative step for up to ``k`` tokens per row
(:class:`Ask`: the row, its request, its context and how many of its tokens the target's
pages hold) and answers with a :class:`Proposal`: the drafted tokens per row and, for a
proposer that samples them, the distribution ``q`` each was drawn from (rejection
sampling accepts draft ``d`` with ``min(1, p(d) / q(d))``; without ``q`` a draft is a
point mass). After the verification it hears how many tokens each row's pages now hold
(:meth:`Proposer.verified`), so a proposer with a cache of its own rolls it back.
:class:`NgramProposer` (prompt lookup) is stateless;
:class:`~jaxpar.engine._spec_draft.DraftModelProposer` runs a draft checkpoint;
:class:`~jaxpar.engine._spec_heads.HeadProposer` (EAGLE-3 heads, MTP layers) drafts from
the target's hidden states. A new method is one more class behind the same three methods
and a line in :func:`~jaxpar.engine._spec_step.make_proposer`.

Structured output: :class:`GrammarWalk` advances a request's grammar along its drafts
(and rolls it back after): each drafted position is checked against, and verified under,
the grammar's mask at that point, so a constrained request drafts too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

from jaxpar.engine._grammar import WORD_BITS, Matcher, mask_words
from jaxpar.engine._speculative import SpeculativeConfig, ngram_propose


@dataclasses.dataclass(frozen=True)
class Ask:
    """One row's request for drafts.

    Attributes:
        row: the decode row.
        stream: its request's :class:`~jaxpar.engine._requests.RequestStream`.
        context: the tokens at positions ``0 .. length`` (prompt and output; the last is
            the one the row feeds next).
        length: tokens the target's pages hold for it.
        k: the most tokens to draft.
        admission: identifies this stay of the request in the row (a preempted request
            comes back as a new admission).
    """

    row: int
    stream: Any
    context: list[int]
    length: int
    k: int
    admission: int


@dataclasses.dataclass
class Proposal:
    """Drafted tokens per row, and (a sampling proposer) each one's draft distribution
    ``q`` (``float32 [len(drafts), V]`` per row; None: point masses)."""

    drafts: dict[int, list[int]]
    q: dict[int, np.ndarray] | None = None


class Proposer(Protocol):
    """Drafts tokens for the rows a speculative step asks about."""

    def propose(self, asks: list[Ask], cache: Any) -> Proposal:
        """Drafts for ``asks`` (``cache``: the target's :class:`CacheManager`, whose pages
        for ``length + k + 1`` tokens each row already holds)."""

    def verified(self, row: int, length: int) -> None:
        """Row ``row``'s pages now hold ``length`` tokens (drafts past them rejected)."""

    def reset(self) -> None:
        """Forget every row (a fresh cache)."""


class NgramProposer:
    """Prompt lookup (:func:`~jaxpar.engine._speculative.ngram_propose`), truncated where a
    request's grammar would not allow a drafted token."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, asks: list[Ask], cache: Any) -> Proposal:
        c = self.config
        drafts = {}
        for ask in asks:
            d = ngram_propose(ask.context, ask.k, c.prompt_lookup_min, c.prompt_lookup_max)
            drafts[ask.row] = d if ask.k else []
        return Proposal(drafts)

    def verified(self, row: int, length: int) -> None:
        pass

    def reset(self) -> None:
        pass


class GrammarWalk:
    """A request's grammar advanced along drafted tokens, and rolled back by
    :meth:`close`: the mask at each position (:meth:`mask`), whether a token is allowed
    there, and past it (:meth:`advance`)."""

    def __init__(self, matcher: Matcher, vocab_size: int):
        self.matcher, self.consumed = matcher, 0
        self.words = mask_words(vocab_size)
        self.stopped = matcher.done

    def mask(self) -> np.ndarray:
        """``int32 [words]``: the tokens allowed next (every one once the grammar stopped:
        the request ends at the token before, whatever follows)."""
        row_W = np.full(self.words, -1, np.int32)
        if not self.stopped:
            self.matcher.fill(row_W)
        return row_W

    @staticmethod
    def allows(mask_W: np.ndarray, token: int) -> bool:
        return bool((int(mask_W[token // WORD_BITS]) >> (token % WORD_BITS)) & 1)

    def advance(self, token: int) -> None:
        """Past ``token`` (allowed by the last :meth:`mask`)."""
        if self.stopped:
            return
        if not self.matcher.consume(token):  # allowed by the mask: never here
            raise AssertionError(f"grammar refused token {token} its mask allowed")
        self.consumed += 1
        self.stopped = self.matcher.done

    def close(self) -> None:
        """Back to where the request's grammar was."""
        if self.consumed:
            self.matcher.rollback(self.consumed)
        self.consumed = 0


def constrain(matcher: Matcher, drafts: list[int], vocab_size: int, t: int):
    """``drafts`` cut at the first token the grammar does not allow there (or after the
    one that ends it), and the grammar's mask at each of the ``t`` verified positions
    (``int32 [t, words]``; every bit set past the drafts). The matcher is left as it was."""
    walk = GrammarWalk(matcher, vocab_size)
    masks_TW = np.full((t, walk.words), -1, np.int32)
    kept = []
    try:
        for j in range(t):
            masks_TW[j] = walk.mask()
            if j == len(drafts) or walk.stopped:
                break
            if not walk.allows(masks_TW[j], drafts[j]):
                break
            walk.advance(drafts[j])
            kept.append(drafts[j])
    finally:
        walk.close()
    return kept, masks_TW
