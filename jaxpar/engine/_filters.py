"""Temperature, top-k and top-p over vocab-sharded logits, without gathering the vocabulary.

A sorted ``[B, V]`` is what top-k and top-p are defined on, and sorting a vocab-parallel
row gathers it (``2 x B x V`` per step under tp). Neither filter needs the sort: each
keeps the tokens at or above a threshold value (the k-th largest scaled logit; the
smallest one whose mass above it is below ``top_p``), and the draw is then the argmax
of the kept tokens' ``scaled + Gumbel noise``, one local argmax per vocab shard and a
``[B, shards]`` exchange. The thresholds come from:

* **candidates**: each shard's :data:`CANDIDATES` largest scaled logits, merged
  (:meth:`~jaxpar.engine._vocab.VocabSplit.top_k`, an exchange of ``[B, shards, C]``):
  they are the row's ``C`` largest, so the k-th largest is among them when ``k <= C``,
  and so is the top-p cutoff when those ``C`` tokens' mass reaches ``top_p``. The mass
  is normalised by the full-vocabulary sum of the top-k tokens' ``exp``, a per-row
  scalar reduction (``[B]`` across the shards);
* **a radix select** otherwise (``k > C``, or a nucleus wider than ``C`` tokens): 32
  rounds, one bit of the threshold's sortable key each, counting (or summing the mass
  of) the tokens above a trial key: a ``[B]`` reduction per round. It runs (a
  ``lax.cond``) only in steps where some row needs it.

The threshold is exact either way, so the kept set, and with the same Gumbel noise per
global vocab id (partitionable threefry over ``[V]``: the same bits whatever the
sharding) the drawn token, are those of the sort-based definition on one device. Only
float summation order differs (the top-p masses), as any sharded reduction does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxpar.engine._vocab import VocabSplit

if TYPE_CHECKING:
    from jaxpar.engine._sampling_params import RowSampling

#: Candidates per row each vocab shard contributes to the top-k / top-p thresholds.
CANDIDATES = 64
#: Rounds of a radix select: one per bit of a float32 key.
RADIX_ROUNDS = 32


def sortable_key(x: jax.Array) -> jax.Array:
    """uint32 keys ordered as the float32 values ``x`` (``-0.0`` as ``+0.0``)."""
    x = jnp.where(x == 0, jnp.float32(0), x.astype(jnp.float32))
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    i = jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)
    return jax.lax.bitcast_convert_type(i, jnp.uint32) ^ jnp.uint32(0x80000000)


def _radix(predicate, key_BV: jax.Array) -> jax.Array:
    """The largest uint32 ``t`` per row with ``predicate(t)`` true (monotone: true up to
    some key, false above), bit by bit from the top; 0 if none."""
    # Zeros derived from the keys: inside a shard_map they vary as the keys do.
    zero_B = key_BV[:, 0] & jnp.uint32(0)

    def body(i, t_B):
        trial_B = t_B | (jnp.uint32(1) << (RADIX_ROUNDS - 1 - i).astype(jnp.uint32))
        return jnp.where(predicate(trial_B), trial_B, t_B)

    return jax.lax.fori_loop(0, RADIX_ROUNDS, body, zero_B)


def kth_largest_key(key_BV: jax.Array, k_B: jax.Array) -> jax.Array:
    """The key of each row's ``k_B``-th largest value (``[B]`` counts per round)."""
    return _radix(lambda t_B: jnp.sum(key_BV >= t_B[:, None], -1) >= k_B, key_BV)


def nucleus_key(key_BV: jax.Array, mass_BV: jax.Array, target_B: jax.Array) -> jax.Array:
    """The smallest key whose mass strictly above it is below ``target_B`` (the top-p
    cutoff: every token at or above it is kept; ``[B]`` sums per round)."""

    def above(t_B):
        return jnp.sum(jnp.where(key_BV > t_B[:, None], mass_BV, 0.0), -1) >= target_B

    return _radix(above, key_BV) + jnp.uint32(1)


def kept(scaled_BV: jax.Array, rows: RowSampling, split: VocabSplit) -> jax.Array:
    """Which tokens top-k and top-p keep, per row, of the tempered logits (bool [B, V])."""
    b, vocab = scaled_BV.shape
    c = min(CANDIDATES, vocab)
    top_BC, _ = split.top_k(scaled_BV, c)
    key_BV = sortable_key(scaled_BV)
    k_B = jnp.where(rows.top_k_B > 0, jnp.minimum(rows.top_k_B, vocab), vocab)
    # top-k: the k-th largest key (none: keep all, key 0).
    kth_B = sortable_key(jnp.take_along_axis(top_BC, jnp.minimum(k_B, c)[:, None] - 1, -1)[:, 0])
    kth_B = jnp.where(k_B < vocab, kth_B, jnp.uint32(0))
    kth_B = jax.lax.cond(
        jnp.any((k_B > c) & (k_B < vocab)),
        lambda: jnp.where(k_B > c, kth_largest_key(key_BV, k_B), kth_B),
        lambda: kth_B,
    )
    in_k_BV = key_BV >= kth_B[:, None]
    # top-p: the masses of the top-k tokens, normalised over the whole vocabulary.
    max_B1 = top_BC[:, :1]
    mass_BV = jnp.where(in_k_BV, jnp.exp(scaled_BV - max_B1), 0.0)
    total_B = jnp.sum(mass_BV, -1)
    top_p_B = rows.top_p_B
    mass_BC = jnp.where(sortable_key(top_BC) >= kth_B[:, None], jnp.exp(top_BC - max_B1), 0.0)
    probs_BC = mass_BC / total_B[:, None]
    before_BC = jnp.cumsum(probs_BC, -1) - probs_BC
    cutoff_B = jnp.min(jnp.where(before_BC < top_p_B[:, None], top_BC, jnp.inf), -1)
    cut_B = sortable_key(cutoff_B)
    # The nucleus ends among the candidates when their mass reaches top_p.
    wide_B = (top_p_B < 1.0) & (k_B > c) & (jnp.sum(probs_BC, -1) < top_p_B)
    cut_B = jax.lax.cond(
        jnp.any(wide_B),
        lambda: jnp.where(wide_B, nucleus_key(key_BV, mass_BV, top_p_B * total_B), cut_B),
        lambda: cut_B,
    )
    cut_B = jnp.where(top_p_B < 1.0, cut_B, jnp.uint32(0))
    return in_k_BV & (key_BV >= cut_B[:, None])
