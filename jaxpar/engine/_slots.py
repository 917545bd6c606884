"""Decode slots for continuous batching: the device state and its two programs.

A serving engine keeps ``B`` decode slots in the decode layout: one KV cache of ``B`` rows
plus, per slot, the token it feeds next, whether it is active, how many tokens it has
drawn and its sampling parameters (:class:`Slots`). Two compiled programs change it:

* ``insert``: takes prefill K/V of a few requests (``[P, T, K, H]`` per layer, in the
  prefill layout of this engine's strategy), draws each request's first token and writes
  its rows into the chosen slots: a scatter into the donated cache, so only the new rows
  move, never the whole cache. One compile per prompt-length bucket.
* ``step``: one decode step over every slot, each with its own length, sampling row and
  step; inactive slots write nothing anyone reads and keep length 0. One compile.

Sampling parameters are arrays (:class:`RowSampling`), so no request ever recompiles.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.engine._placement import put_global
from jaxpar.engine._sampling import RowSampling, Sampling, select_rows
from jaxpar.engine._steps import Steps
from jaxpar.engine._vocab import mask_padded
from jaxpar.errors import ConfigError
from jaxpar.models import KVCache, ModelConfig
from jaxpar.spec import Phase

DECODE = Phase.DECODE


@flax.struct.dataclass
class Slots:
    """The decode slots' device state (every field has ``B`` rows)."""

    cache: KVCache
    tokens_B: jax.Array  # int32: the token each slot appends next
    active_B: jax.Array  # bool
    step_B: jax.Array  # int32: tokens drawn so far (the sampling key's step)
    sampling: RowSampling


@flax.struct.dataclass
class Inserted:
    """New requests' prefill results, ready for :meth:`SlotSteps.insert` (device arrays)."""

    k: Any  # per-layer [P, T, K, H] tuple, or stacked [L, P, T, K, H]
    v: Any
    lengths_P: jax.Array
    logits_PV: jax.Array

    @property
    def nbytes(self) -> int:
        """Bytes of what moves between prefill and decode devices."""
        leaves = jax.tree.leaves((self.k, self.v, self.lengths_P, self.logits_PV))
        return sum(x.size * x.dtype.itemsize for x in leaves)


class SlotSteps:
    """Compiles and runs ``insert`` and ``step`` over ``steps``' decode layout.

    Args:
        steps: the engine's step functions (graph, layouts, mesh, strategy).
        model_config: the model as the engine runs it.
        slots: ``B``, the number of decode slots (the engine's ``max_batch``).
    """

    def __init__(self, steps: Steps, model_config: ModelConfig, slots: int):
        if steps.config.pp > 1:
            raise ConfigError(
                f"continuous batching runs unpipelined strategies; {steps.config} has "
                f"pp={steps.config.pp}: serve with pp=1 (use dp, sp, ep or tp instead)"
            )
        self.steps = steps
        self.model_config = model_config
        self.n_slots = slots
        lay = steps.layouts
        row = lay.tokens_B
        key_row = NamedSharding(row.mesh, PartitionSpec(*row.spec, None))
        self.layout = Slots(
            cache=lay.cache,
            tokens_B=row,
            active_B=row,
            step_B=row,
            sampling=RowSampling(row, row, row, key_row),
        )

    # --- state ---------------------------------------------------------------------------

    def empty(self) -> Slots:
        """Every slot free, in the decode layout."""
        b, cfg = self.n_slots, self.model_config
        cache = jax.jit(
            lambda: KVCache.empty(cfg, b, self.steps.max_seq_len), out_shardings=self.layout.cache
        )()
        zeros = np.zeros(b, np.int32)
        host = Slots(
            cache=None,
            tokens_B=zeros,
            active_B=np.zeros(b, bool),
            step_B=zeros,
            sampling=RowSampling.rows([Sampling()] * b, [0] * b),
        )
        placed = jax.tree.map(put_global, host, self.layout.replace(cache=None))
        return placed.replace(cache=cache)

    # --- traced bodies -------------------------------------------------------------------

    def _insert(self, slots: Slots, new: Inserted, slot_P, sampling_P: RowSampling):
        """Writes new rows ``slot_P`` (``>= B``: a padding row, dropped)."""
        with self.steps._context(DECODE):
            logits_PV = mask_padded(new.logits_PV, self.steps.vocab_size)
            first_P = select_rows(logits_PV, sampling_P, jnp.zeros_like(slot_P))
            cache = _write_rows(slots.cache, new, slot_P)

            def put(x_B, x_P):
                return x_B.at[slot_P].set(x_P.astype(x_B.dtype), mode="drop")

            slots = Slots(
                cache=cache.replace(lengths_B=put(cache.lengths_B, new.lengths_P)),
                tokens_B=put(slots.tokens_B, first_P),
                active_B=put(slots.active_B, jnp.ones_like(slot_P, bool)),
                step_B=put(slots.step_B, jnp.ones_like(slot_P)),
                sampling=jax.tree.map(put, slots.sampling, sampling_P),
            )
            return slots, first_P

    def _step(self, params, slots: Slots, release_B):
        """One decode step over every slot; returns the tokens (``-1`` for inactive slots)."""
        with self.steps._context(DECODE):
            active_B = slots.active_B & ~release_B
            cache = slots.cache
            # A free slot appends at position 0 (never read: an insert rewrites the row).
            cache = cache.replace(lengths_B=jnp.where(active_B, cache.lengths_B, 0))
            logits_BV, cache = self.steps._model(params).decode(slots.tokens_B, cache)
            logits_BV = mask_padded(logits_BV, self.steps.vocab_size)
            next_B = select_rows(logits_BV, slots.sampling, slots.step_B)
            slots = Slots(
                cache=cache.replace(lengths_B=jnp.where(active_B, cache.lengths_B, 0)),
                tokens_B=jnp.where(active_B, next_B, 0),
                active_B=active_B,
                step_B=slots.step_B + active_B.astype(jnp.int32),
                sampling=slots.sampling,
            )
            return slots, jnp.where(active_B, next_B, -1)

    # --- compiled entry points -----------------------------------------------------------

    def insert(self, slots: Slots, new: Inserted, slot_P: np.ndarray, sampling_P: RowSampling):
        """Donates ``slots``; returns the new slots and the first tokens ``[P]``."""
        lay = self.steps.layouts
        inserted = Inserted(
            lay.kv_prefill, lay.kv_prefill, lay.lengths_prefill_B, lay.logits_prefill
        )
        rep = lay.replicated
        slot_P = put_global(np.asarray(slot_P, np.int32), rep)
        sampling_P = jax.tree.map(put_global, sampling_P, RowSampling(rep, rep, rep, rep))
        compiled = self.steps._compile(
            "insert",
            (jax.tree.map(jnp.shape, new.k),),
            self._insert,
            (self.layout, inserted, rep, RowSampling(rep, rep, rep, rep)),
            (self.layout, rep),
            (slots, new, slot_P, sampling_P),
            donate_argnums=(0,),
        )
        return compiled(slots, new, slot_P, sampling_P)

    def step(self, params, slots: Slots, release_B: np.ndarray):
        """Donates ``slots``; ``release_B`` frees slots before the step (finished requests)."""
        release = put_global(np.asarray(release_B, bool), self.layout.active_B)
        compiled = self.steps._compile(
            "slot_step",
            (),
            self._step,
            (self.steps.layouts.params, self.layout, self.layout.active_B),
            (self.layout, self.steps.layouts.replicated),
            (params, slots, release),
            donate_argnums=(1,),
        )
        return compiled(params, slots, release)


def _write_rows(cache: KVCache, new: Inserted, slot_P: jax.Array) -> KVCache:
    """Writes prefill K/V ``[P, T, K, H]`` into cache rows ``slot_P``, positions ``[0, T)``."""
    if cache.stacked:  # [L, B, S, K, H] <- [L, P, T, K, H]
        t = new.k.shape[2]

        def put_stacked(cache_LBSKH, new_LPTKH):
            new_LPTKH = new_LPTKH.astype(cache_LBSKH.dtype)
            return cache_LBSKH.at[:, slot_P, :t].set(new_LPTKH, mode="drop")

        return cache.replace(k=put_stacked(cache.k, new.k), v=put_stacked(cache.v, new.v))

    def put(cache_BKSH, new_PTKH):  # [B, K, S, H] <- [P, T, K, H]
        t = new_PTKH.shape[1]
        new_PKTH = new_PTKH.transpose(0, 2, 1, 3).astype(cache_BKSH.dtype)
        return cache_BKSH.at[slot_P, :, :t].set(new_PKTH, mode="drop")

    return cache.replace(k=tuple(map(put, cache.k, new.k)), v=tuple(map(put, cache.v, new.v)))
