"""Vocabulary padding: a vocabulary that tp does not divide is padded to a multiple of tp.

As in Megatron and vLLM, the token table and an untied LM head get zero rows (columns) up to
the padded size, so the vocab-parallel split is exact; tokens never look the padded rows up,
their logits are masked to ``-inf`` before any token is chosen, and logits handed to callers
are cut back to the true vocabulary. Logits of real tokens are unchanged (the padded rows
only add zeros), so a padded sharded run equals the unpadded single-device run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxpar.models import ModelConfig, ModelRun

VOCAB = "vocab"


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The smallest multiple of ``tp`` that is >= ``vocab_size``."""
    return -(-vocab_size // tp) * tp


def padded_run(model: ModelConfig | ModelRun, tp: int) -> ModelRun:
    """``model`` as a run whose vocabulary is padded for ``tp`` (``padded_vocab`` None when
    tp divides it); the config itself keeps the true vocabulary."""
    run = ModelRun.of(model)
    padded = padded_vocab_size(run.config.vocab_size, tp)
    padded_vocab = None if padded == run.config.vocab_size else padded
    return (
        run
        if run.padded_vocab == padded_vocab
        else dataclasses.replace(run, padded_vocab=padded_vocab)
    )


def pad_vocab_params(params: Any, axes: Any, padded: int) -> Any:
    """Every parameter with a ``vocab`` dimension zero-padded along it to ``padded``.

    Args:
        params: the parameter pytree (host or device arrays), true vocabulary.
        axes: its logical axis names, a pytree of tuples like ``params``.
        padded: the padded vocabulary size.
    """

    def pad(value: Any, names: tuple[str | None, ...]) -> Any:
        if VOCAB not in names or np.shape(value)[names.index(VOCAB)] == padded:
            return value
        dim = names.index(VOCAB)
        widths = [(0, 0)] * len(names)
        widths[dim] = (0, padded - np.shape(value)[dim])
        if isinstance(value, jax.Array):
            return jnp.pad(value, widths)
        return np.pad(np.asarray(value), widths)

    return jax.tree.map(pad, params, axes, is_leaf=lambda x: isinstance(x, tuple))


def unsplit_vocab(spec: PartitionSpec, axes: tuple[str | None, ...]) -> PartitionSpec:
    """``spec`` with the ``vocab`` dimension unsplit (to load an unpadded table whole)."""
    if VOCAB not in axes:
        return spec
    entries = list(spec) + [None] * (len(axes) - len(spec))
    entries[axes.index(VOCAB)] = None
    return PartitionSpec(*entries)


def mask_padded(logits_xV: jax.Array, vocab_size: int) -> jax.Array:
    """``-inf`` at the padded ids ``>= vocab_size`` (traced; keeps the vocab sharding)."""
    if logits_xV.shape[-1] == vocab_size:
        return logits_xV
    ids = jax.lax.broadcasted_iota(jnp.int32, logits_xV.shape, logits_xV.ndim - 1)
    return jnp.where(ids < vocab_size, logits_xV, -jnp.inf)


def true_vocab(logits_xV: jax.Array, vocab_size: int) -> jax.Array:
    """Logits as callers see them: the padded ids cut off."""
    return logits_xV if logits_xV.shape[-1] == vocab_size else logits_xV[..., :vocab_size]


@dataclasses.dataclass(frozen=True)
class VocabSplit:
    """How ``[B, V]`` logits are split over the vocabulary: ``shards`` contiguous blocks of
    ``V / shards`` ids (the vocab-parallel LM head's), laid out as ``layout`` (the logits'
    sharding; None on one device).

    A sampler reduces over V by first reducing each block where it lies
    (:meth:`top_k`): the partitioner then moves ``[B, shards, k]`` candidates, not the
    ``[B, V]`` logits a sort over the whole vocabulary gathers.
    """

    shards: int = 1
    layout: Any = None

    @classmethod
    def of(cls, logits: Any) -> VocabSplit:
        """The split of logits laid out as ``logits`` (a ``NamedSharding`` of ``[B, V]``)."""
        spec = tuple(logits.spec) + (None,) * (2 - len(logits.spec))
        entry = spec[-1]
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        shards = int(np.prod([logits.mesh.shape[a] for a in axes], dtype=int))
        return cls(shards, logits) if shards > 1 else cls()

    def constrain(self, x_BV: jax.Array) -> jax.Array:
        """``x_BV`` kept in the logits' layout (a ``cond`` or an operand laid out otherwise,
        like a replicated mask, would otherwise let the partitioner gather it)."""
        if self.shards == 1 or self.layout is None:
            return x_BV
        return jax.lax.with_sharding_constraint(x_BV, self.layout)

    def top_k(self, x_BV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """The ``k`` largest values per row, largest first, and their ids (int32; traced).

        Each shard's own ``k`` largest first (a ``shard_map``: local), then the largest of
        those: the exchange is ``[B, shards x k]`` values and ids.
        """
        b, v = x_BV.shape
        if self.shards == 1 or self.layout is None or v % self.shards:
            vals_Bk, ids_Bk = jax.lax.top_k(x_BV, min(k, v))
            return vals_Bk, ids_Bk.astype(jnp.int32)
        per = v // self.shards
        local = min(k, per)
        spec = PartitionSpec(*(tuple(self.layout.spec) + (None,) * (2 - len(self.layout.spec))))
        vocab_axes = spec[1] if isinstance(spec[1], tuple) else (spec[1],)

        def shard_top_k(x_bv):
            vals_bk, ids_bk = jax.lax.top_k(x_bv, local)
            shard = jax.lax.axis_index(vocab_axes)  # this block's place in the vocabulary
            ids_bk = ids_bk.astype(jnp.int32) + shard.astype(jnp.int32) * per
            # The one exchange: every shard's candidates, [b, shards x k] values and ids.
            vals_bN, ids_bN = (
                jax.lax.all_gather(x, vocab_axes, axis=1, tiled=True) for x in (vals_bk, ids_bk)
            )
            vals_bk, pos_bk = jax.lax.top_k(vals_bN, min(k, vals_bN.shape[-1]))
            return vals_bk, jnp.take_along_axis(ids_bN, pos_bk, axis=-1)

        rows = PartitionSpec(spec[0], None)
        return jax.shard_map(
            shard_top_k,
            mesh=self.layout.mesh,
            in_specs=spec,
            out_specs=(rows, rows),
            check_vma=False,  # gathered over the vocab axes: the same on each of them
        )(x_BV)
