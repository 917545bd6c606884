"""Decode slots for continuous batching: the device state and its two programs.

A serving engine keeps ``B`` decode slots in the decode layout: one KV cache of ``B`` rows
plus, per slot, the token it feeds next, whether it is active, how many tokens it has
drawn and its sampling parameters (:class:`Slots`). Two compiled programs change it:

* ``insert``: takes prefill K/V of a few requests (``[P, T, K, H]`` per layer, in the
  prefill layout of this engine's strategy) and their first tokens, and writes their rows
  into the chosen slots: a scatter into the donated cache, so only the new rows move,
  never the whole cache. One compile per (rows, prompt-length) bucket.
* ``step``: one decode step over every slot, each with its own length, sampling row and
  step; inactive slots write nothing anyone reads and keep length 0. One compile.

:class:`FirstTokens` draws each request's first token from its prefill logits, on the
prefill devices (one compile per row count), so it reaches the client before the insert.
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
from jaxpar.models import KVCache, ModelConfig, count_dropped, total_dropped
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
    lengths_P: jax.Array  # prompt lengths
    first_P: jax.Array  # each request's first new token (drawn after prefill)

    @property
    def nbytes(self) -> int:
        """Bytes of what moves between prefill and decode devices."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


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
        self._idle_sampling = RowSampling.rows([Sampling()] * slots, [0] * slots)
        self._keep_all: jax.Array | None = None  # release nothing (placed on first use)
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
        return jax.jit(self._empty, out_shardings=self.layout)()

    def abstract(self) -> Slots:
        """:meth:`empty`'s shapes and shardings, allocating nothing."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            jax.eval_shape(self._empty),
            self.layout,
        )

    def _empty(self) -> Slots:
        b = self.n_slots
        return Slots(
            cache=KVCache.empty(self.model_config, b, self.steps.max_seq_len),
            tokens_B=jnp.zeros(b, jnp.int32),
            active_B=jnp.zeros(b, bool),
            step_B=jnp.zeros(b, jnp.int32),
            sampling=jax.tree.map(jnp.asarray, self._idle_sampling),
        )

    # --- traced bodies -------------------------------------------------------------------

    def _insert(self, slots: Slots, new: Inserted, slot_P, sampling_P: RowSampling):
        """Writes new rows ``slot_P`` (``>= B``: a padding row, dropped)."""
        with self.steps._context(DECODE):
            cache = _write_rows(slots.cache, new, slot_P)

            def put(x_B, x_P):
                return x_B.at[slot_P].set(x_P.astype(x_B.dtype), mode="drop")

            slots = Slots(
                cache=cache.replace(lengths_B=put(cache.lengths_B, new.lengths_P)),
                tokens_B=put(slots.tokens_B, new.first_P),
                active_B=put(slots.active_B, jnp.ones_like(slot_P, bool)),
                step_B=put(slots.step_B, jnp.ones_like(slot_P)),
                sampling=jax.tree.map(put, slots.sampling, sampling_P),
            )
            return slots

    def _step(self, params, slots: Slots, release_B):
        """One decode step over every slot; returns the tokens (``-1`` for inactive slots)
        and, for a capacity-limited MoE, the step's dropped expert assignments."""
        with self.steps._context(DECODE), count_dropped() as drops:
            active_B = slots.active_B & ~release_B
            cache = slots.cache
            # A free slot appends at position 0 (never read: an insert rewrites the row); so
            # does a full one, whose request has finished (the host stops requests before
            # max_seq_len, and learns it one step late).
            active_B = active_B & (cache.lengths_B < cache.max_seq_len)
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
            out = (slots, jnp.where(active_B, next_B, -1))
            return (*out, total_dropped(drops)) if self.steps.counts_drops else out

    # --- compiled entry points -----------------------------------------------------------

    def _insert_program(self, slots, new: Inserted, slot_P, sampling_P):
        lay, rep = self.steps.layouts, self.steps.layouts.replicated
        rows = RowSampling(rep, rep, rep, rep)
        inserted = Inserted(lay.kv_prefill, lay.kv_prefill, lay.lengths_prefill_B, rep)
        return self.steps._compile(
            "insert",
            (jax.tree.map(jnp.shape, new.k),),
            self._insert,
            (self.layout, inserted, rep, rows),
            self.layout,
            (slots, new, slot_P, sampling_P),
            donate_argnums=(0,),
        )

    def insert(self, slots: Slots, new: Inserted, slot_P: np.ndarray, sampling_P: RowSampling):
        """Writes ``new`` into slots ``slot_P`` (donates ``slots``; ``>= B``: not written)."""
        rep = self.steps.layouts.replicated
        slot_P = put_global(np.asarray(slot_P, np.int32), rep)
        sampling_P = jax.tree.map(lambda x: put_global(x, rep), sampling_P)
        return self._insert_program(slots, new, slot_P, sampling_P)(slots, new, slot_P, sampling_P)

    def compile_insert(self, new: Inserted) -> None:
        """Compiles ``insert`` for prefill results shaped like ``new`` (``ShapeDtypeStruct``
        trees are enough) ahead of its first call."""
        rows = new.lengths_P.shape[0]
        rep = self.steps.layouts.replicated

        def spec(x, sharding=rep):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        lay = self.steps.layouts
        new = Inserted(
            k=jax.tree.map(spec, new.k, lay.kv_prefill),
            v=jax.tree.map(spec, new.v, lay.kv_prefill),
            lengths_P=spec(new.lengths_P, lay.lengths_prefill_B),
            first_P=spec(new.first_P),
        )
        host = RowSampling.rows([Sampling()] * rows, [0] * rows)
        self._insert_program(
            self.abstract(), new, spec(np.zeros(rows, np.int32)), jax.tree.map(spec, host)
        )

    def _step_program(self, params, slots, release):
        return self.steps._compile(
            "slot_step",
            (),
            self._step,
            (self.steps.layouts.params, self.layout, self.layout.active_B),
            self.steps._with_drops((self.layout, self.steps.layouts.replicated)),
            (params, slots, release),
            donate_argnums=(1,),
        )

    def step(self, params, slots: Slots, release_B: np.ndarray):
        """Donates ``slots``; ``release_B`` frees slots before the step (finished requests).

        Returns the new slots, the tokens ``[B]`` and the step's dropped MoE assignments
        (an int32 scalar; None unless the model has a capacity factor)."""
        if release_B.any():
            release = put_global(np.asarray(release_B, bool), self.layout.active_B)
        else:  # most steps free nothing: no host-to-device copy for them
            if self._keep_all is None:
                self._keep_all = put_global(np.zeros(self.n_slots, bool), self.layout.active_B)
            release = self._keep_all
        out = self._step_program(params, slots, release)(params, slots, release)
        return out if self.steps.counts_drops else (*out, None)

    def compile_step(self, params) -> None:
        """Compiles ``step`` ahead of its first call."""
        release = jax.ShapeDtypeStruct((self.n_slots,), bool, sharding=self.layout.active_B)
        self._step_program(params, self.abstract(), release)


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


class FirstTokens:
    """Draws prefilled requests' first tokens where the prefill ran (``steps``' devices).

    ``logits [P, V]`` (the engine's padded vocabulary; padded ids never drawn) and one
    sampling row per request, at step 0: as ``generate`` draws its first token.
    """

    def __init__(self, steps: Steps):
        self.steps = steps

    def _draw(self, logits_PV, sampling_P):
        with self.steps._context(Phase.PREFILL):
            logits_PV = mask_padded(logits_PV, self.steps.vocab_size)
            return select_rows(logits_PV, sampling_P, jnp.zeros(logits_PV.shape[0], jnp.int32))

    def _program(self, logits_PV, sampling_P):
        lay = self.steps.layouts
        rep = lay.replicated
        return self.steps._compile(
            "first_tokens",
            (logits_PV.shape,),
            self._draw,
            (lay.logits_prefill, RowSampling(rep, rep, rep, rep)),
            rep,
            (logits_PV, sampling_P),
        )

    def __call__(self, logits_PV: jax.Array, sampling_P: RowSampling) -> jax.Array:
        rep = self.steps.layouts.replicated
        sampling_P = jax.tree.map(lambda x: put_global(x, rep), sampling_P)
        return self._program(logits_PV, sampling_P)(logits_PV, sampling_P)

    def compile(self, logits_PV: jax.ShapeDtypeStruct) -> None:
        """Compiles the draw for ``logits_PV``'s shape ahead of its first call."""
        rep = self.steps.layouts.replicated
        rows = logits_PV.shape[0]
        host = RowSampling.rows([Sampling()] * rows, [0] * rows)
        logits = jax.ShapeDtypeStruct(
            logits_PV.shape, logits_PV.dtype, sharding=self.steps.layouts.logits_prefill
        )
        specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), host)
        self._program(logits, specs)
