"""Presence, frequency and repetition penalties: per-row token counts and how they bend logits.

OpenAI's ``presence_penalty`` and ``frequency_penalty`` look at the tokens a request has
generated; the repetition penalty of HF and vLLM (CTRL's) at its prompt's tokens too. A
decode row keeps both as ``[B, V]`` arrays on the device (:class:`Seen`, part of the
decode slots' state): ``counts_BV``, how often each token was generated, and
``prompt_BV``, whether it is in the prompt. The insert builds a new row's from its
context (:class:`History`: the prompt, then the tokens a preempted request drew before)
plus its first token, and each decode step adds the token it drew. The parameters are
per-row arrays (:class:`~jaxpar.engine._sampling_params.RowSampling`), so nothing recompiles;
a step in which no row is penalised skips the ``[B, V]`` arithmetic (``lax.cond``).

As vLLM applies them (before temperature, top-k and top-p, to greedy rows too):
repetition first (a positive logit divided by the penalty, a negative one multiplied),
then ``frequency * count`` and ``presence * (count > 0)`` subtracted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from jaxpar.engine._sampling_params import RowSampling


@flax.struct.dataclass
class Seen:
    """Per row: how often each token was generated, and whether it is in the prompt."""

    counts_BV: jax.Array  # int32
    prompt_BV: jax.Array  # bool

    @classmethod
    def zeros(cls, rows: int, vocab: int) -> Seen:
        """Nothing seen (traced or not)."""
        return cls(jnp.zeros((rows, vocab), jnp.int32), jnp.zeros((rows, vocab), bool))

    def add(self, tokens_B: jax.Array, where_B: jax.Array) -> Seen:
        """One more generated token per row where ``where_B`` (traced)."""

        # A scatter per row (vmapped: the rows are a batch dimension of the scatter), so
        # the partitioner keeps it on the devices holding the row: a scatter into the
        # batch-split counts at replicated [row, token] indices is all-reduced whole.
        def one(counts_V, token, where):
            return counts_V.at[token].add(where.astype(jnp.int32))

        return Seen(jax.vmap(one)(self.counts_BV, tokens_B, where_B), self.prompt_BV)


@flax.struct.dataclass
class History:
    """Each row's context as token ids, for building its :class:`Seen` on the device.

    ``ids_PC``: the prompt, then the tokens the request drew before (a preempted request
    resumed), then padding; ``C`` is fixed per engine (its ``max_seq_len``), so no
    context length compiles anything. ``prompt_P``: prompt tokens; ``length_P``: ids in
    use. Rows without a penalty are left empty (only penalised rows need their counts).
    """

    ids_PC: jax.Array
    prompt_P: jax.Array
    length_P: jax.Array

    @classmethod
    def rows(
        cls,
        contexts: Sequence[tuple[Sequence[int], Sequence[int]]],
        penalized: Sequence[bool],
        rows: int,
        width: int,
    ) -> History:
        """Host arrays: ``contexts[i]`` is row i's (prompt, tokens drawn before); rows
        past them (padding) and rows not ``penalized`` are empty."""
        ids_PC = np.zeros((rows, width), np.int32)
        prompt_P = np.zeros(rows, np.int32)
        length_P = np.zeros(rows, np.int32)
        for i, ((prompt, drawn), wanted) in enumerate(zip(contexts, penalized, strict=True)):
            if not wanted:
                continue
            ids = [*prompt, *drawn][:width]
            ids_PC[i, : len(ids)] = ids
            prompt_P[i], length_P[i] = min(len(prompt), width), len(ids)
        return cls(ids_PC, prompt_P, length_P)

    @classmethod
    def empty(cls, rows: int, width: int) -> History:
        """No row penalised (host arrays)."""
        return cls(np.zeros((rows, width), np.int32), *(np.zeros(rows, np.int32),) * 2)

    def fit(self, width: int) -> History:
        """The same host arrays ``width`` ids wide (no row's context is longer)."""
        ids_PC = np.zeros((self.ids_PC.shape[0], width), np.int32)
        keep = min(width, self.ids_PC.shape[1])
        ids_PC[:, :keep] = self.ids_PC[:, :keep]
        return History(ids_PC, self.prompt_P, np.minimum(self.length_P, width))

    def seen(self, vocab: int) -> Seen:
        """The rows' :class:`Seen` over a ``vocab``-wide vocabulary (traced)."""
        p, c = self.ids_PC.shape
        pos_PC = jnp.arange(c)[None, :]
        used_PC = pos_PC < self.length_P[:, None]
        prompt_PC = pos_PC < self.prompt_P[:, None]
        rows_PC = jnp.broadcast_to(jnp.arange(p)[:, None], (p, c))
        zeros = jnp.zeros((p, vocab), jnp.int32)
        drawn = (used_PC & ~prompt_PC).astype(jnp.int32)
        counts_PV = zeros.at[rows_PC, self.ids_PC].add(drawn)
        prompt_PV = zeros.at[rows_PC, self.ids_PC].add(prompt_PC.astype(jnp.int32)) > 0
        return Seen(counts_PV, prompt_PV)


def penalized(rows: RowSampling) -> jax.Array:
    """Which rows have a penalty on (bool [B]; traced)."""
    return (rows.presence_B != 0) | (rows.frequency_B != 0) | (rows.repetition_B != 1)


def penalize(logits_BV: jax.Array, seen: Seen, rows: RowSampling) -> jax.Array:
    """``logits_BV`` (float32) with each row's penalties applied; rows without one (and
    every row, when none has one: the arithmetic is skipped) keep their logits exactly."""
    on_B = penalized(rows)

    def apply(logits_BV: jax.Array) -> jax.Array:
        counts_BV = seen.counts_BV.astype(jnp.float32)
        repeated_BV = seen.prompt_BV | (seen.counts_BV > 0)
        r_B1 = rows.repetition_B[:, None]
        repeated = jnp.where(logits_BV > 0, logits_BV / r_B1, logits_BV * r_B1)
        out_BV = jnp.where(repeated_BV, repeated, logits_BV)
        out_BV = out_BV - rows.frequency_B[:, None] * counts_BV
        out_BV = out_BV - rows.presence_B[:, None] * (seen.counts_BV > 0)
        return jnp.where(on_B[:, None], out_BV, logits_BV)

    return jax.lax.cond(jnp.any(on_B), apply, lambda x: x, logits_BV)
