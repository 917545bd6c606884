"""The compiled step functions of a pipelined engine (``pp > 1``), mirroring ``Steps``.

Same entry points and caching as :class:`~jaxpar.engine._steps.Steps` (``prefill``,
``handoff``, ``decode``, ``decode_select``, ``decode_loop``, ``jit_decode``,
``lower_prefill``, ``compile_seconds``); the bodies run the schedules of
:mod:`jaxpar.engine._pipeline`. What comes out of the last stage stays stage-major
(``[P, ...]`` on ``pp``, meaningful at ``P - 1``): tokens chained from step to step reach
stage 0 by a collective-permute (``roll``) at the start of the next program, and
:meth:`PipelineSteps.to_batch` / :meth:`PipelineSteps.host_batch` read the last stage's row
on the host for callers, so no program moves data across stages any other way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.engine import _pipeline as pipeline
from jaxpar.engine._pipeline_stages import Stages
from jaxpar.engine._placement import put_global, to_host
from jaxpar.engine._sampling import Sampling, select
from jaxpar.engine._steps import Layouts, Steps
from jaxpar.engine._vocab import mask_padded
from jaxpar.models._cache import KVCache
from jaxpar.spec import ModelDims, Module, ParallelConfig, Phase, sharding_context

PREFILL, DECODE = Phase.PREFILL, Phase.DECODE
EMBEDDING, LM_HEAD = Module.EMBEDDING, Module.LM_HEAD


@dataclasses.dataclass(frozen=True)
class PipelineLayouts(Layouts):
    """:class:`Layouts` plus the stage-major shardings (leading dim on ``pp``)."""

    logits_prefill_PBV: NamedSharding
    logits_prefill_PBTV: NamedSharding
    tokens_PB: NamedSharding
    logits_PBV: NamedSharding
    out_PBN: NamedSharding

    @classmethod
    def build(cls, mesh: Mesh, config: ParallelConfig, dims: ModelDims, params) -> PipelineLayouts:
        base = Layouts.build(mesh, config, dims, params)
        at = Stages(mesh, config, dims).sharding
        return cls(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(Layouts)},
            logits_prefill_PBV=at(("batch", "vocab"), LM_HEAD, PREFILL),
            logits_prefill_PBTV=at(("batch", "seq", "vocab"), LM_HEAD, PREFILL),
            tokens_PB=at(("batch",), EMBEDDING, DECODE),
            logits_PBV=at(("batch", "vocab"), LM_HEAD, DECODE),
            out_PBN=at(("batch", None), EMBEDDING, DECODE),
        )


def group_sampler(
    key: jax.Array, sampling: Sampling, groups: int, vocab: int
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """``(logits [Bg, V], g) -> tokens [Bg]`` for group ``g``, as unpipelined ``select`` draws.

    Random draws depend on a row's place in the whole batch (partitionable threefry over
    ``[B, V]``), so a sampled group is placed into a ``[B, V]`` array before drawing: the
    tokens then equal the unpipelined ones for the same seed. Greedy needs no such care.
    """

    def sample(logits_BgV: jax.Array, g: jax.Array) -> jax.Array:
        if sampling.greedy or groups == 1:
            return select(logits_BgV, key, sampling)
        bg = logits_BgV.shape[0]
        full_BgGV = jnp.zeros((bg, groups, vocab), logits_BgV.dtype).at[:, g].set(logits_BgV)
        tokens_BgG = select(full_BgGV.reshape(bg * groups, vocab), key, sampling)
        return tokens_BgG.reshape(bg, groups)[:, g]

    return sample


class PipelineSteps(Steps):
    """Builds, compiles and caches the pipelined step functions."""

    layouts: PipelineLayouts

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stages = Stages(self.mesh, self.config, self.dims)

    # --- traced bodies -------------------------------------------------------------------

    def _prefill(self, params, tokens_BT, lengths_B, all_logits=False):
        with sharding_context(self.mesh, PREFILL, self.config, self.dims):
            return pipeline.prefill(
                self._model(params),
                tokens_BT,
                lengths_B,
                self.stages,
                microbatches=self.config.microbatches,
                all_logits=all_logits,
            )

    def _handoff(self, k, v, lengths_B, logits_PBV, key, sampling):
        with sharding_context(self.mesh, DECODE, self.config, self.dims):
            cache = KVCache.from_prefill(k, v, lengths_B, self.max_seq_len)
            # Every stage samples its own row of logits; stage P-1's row is the real one.
            key = jax.random.fold_in(key, 0)
            first_PB = self.stages.map(lambda _, lg: self._select(lg, key, sampling))(logits_PBV)
        return cache, first_PB

    def _step(self, params, cache, tokens_PB, emit, emitted, emitted_axes):
        """One pipelined decode step; row 0 of ``tokens_PB`` holds the tokens to append."""
        with sharding_context(self.mesh, DECODE, self.config, self.dims):
            return pipeline.decode(
                self._model(params),
                cache,
                tokens_PB,
                self.stages,
                groups=self.config.decode_groups,
                emit=emit,
                emitted=emitted,
                emitted_axes=emitted_axes,
            )

    def _group_rows(self, batch: int) -> int:
        return batch // self.config.decode_groups

    def _decode(self, params, cache, tokens_B):
        """Public step: tokens ``[B]`` replicated over ``pp``; logits ``[P, B, V]`` out."""
        p, b = self.stages.count, tokens_B.shape[0]
        with sharding_context(self.mesh, DECODE, self.config, self.dims):
            tokens_PB = self.stages.constrain(
                jnp.broadcast_to(tokens_B, (p, b)), ("batch",), EMBEDDING, DECODE
            )
        emitted = jax.ShapeDtypeStruct((self._group_rows(b), self.dims.vocab_size), jnp.float32)
        return self._step(params, cache, tokens_PB, lambda lg, g: lg, emitted, ("batch", "vocab"))

    def _decode_select(self, params, cache, tokens_PB, key, step, sampling):
        """Chained step: ``tokens_PB`` as the last stage left them (row P-1)."""
        b = tokens_PB.shape[1]
        sample = group_sampler(
            jax.random.fold_in(key, step), sampling, self.config.decode_groups, self.dims.vocab_size
        )

        def emit(logits_BgV, g):
            return sample(mask_padded(logits_BgV, self.vocab_size), g)

        emitted = jax.ShapeDtypeStruct((self._group_rows(b),), jnp.int32)
        # The roll is the one collective-permute that brings them to stage 0.
        return self._step(params, cache, jnp.roll(tokens_PB, 1, axis=0), emit, emitted, ("batch",))

    def _decode_loop(self, params, cache, first_PB, done_B, key, stop_S, n_new, sampling):
        p, b = first_PB.shape
        last_P1 = (jnp.arange(p) == p - 1)[:, None]
        out_PBN = jnp.full((p, b, self.max_seq_len), -1, jnp.int32).at[:, :, 0].set(first_PB)
        done_PB = done_B[None] | jnp.isin(first_PB, stop_S)

        def cond(carry):
            i, _, _, done_PB, _ = carry
            # Only the last stage's row is real. Reducing it is the loop's one scalar
            # all-reduce (the unpipelined loop reduces over the batch axes the same way).
            return (i < n_new) & ~jnp.all(done_PB | ~last_P1)

        def body(carry):
            i, tokens_PB, cache, done_PB, out_PBN = carry
            next_PB, cache = self._decode_select(params, cache, tokens_PB, key, i, sampling)
            out_PBN = out_PBN.at[:, :, i].set(jnp.where(done_PB, -1, next_PB))
            done_PB = done_PB | jnp.isin(next_PB, stop_S)
            return i + 1, next_PB, cache, done_PB, out_PBN

        init = (jnp.int32(1), first_PB, cache, done_PB, out_PBN)
        _, _, cache, _, out_PBN = jax.lax.while_loop(cond, body, init)
        return out_PBN, cache

    # --- compiled entry points -----------------------------------------------------------

    def _jit_prefill(self, all_logits: bool):
        lay = self.layouts
        logits = lay.logits_prefill_PBTV if all_logits else lay.logits_prefill_PBV
        return jax.jit(
            lambda p, t, n: self._prefill(p, t, n, all_logits),
            in_shardings=(lay.params, lay.tokens_BT, lay.lengths_prefill_B),
            out_shardings=(logits, lay.kv_prefill, lay.kv_prefill),
        )

    def handoff(self, k, v, lengths_B, logits_PBV, key, sampling: Sampling):
        lay = self.layouts
        compiled = self._compile(
            "handoff",
            (k.shape, sampling),
            lambda k, v, n, lg, key: self._handoff(k, v, n, lg, key, sampling),
            (
                lay.kv_prefill,
                lay.kv_prefill,
                lay.lengths_prefill_B,
                lay.logits_prefill_PBV,
                lay.replicated,
            ),
            (lay.cache, lay.tokens_PB),
            (k, v, lengths_B, logits_PBV, key),
        )
        return compiled(k, v, lengths_B, logits_PBV, key)

    def jit_decode(self):
        lay = self.layouts
        return jax.jit(
            self._decode,
            in_shardings=(lay.params, lay.cache, lay.tokens_B),
            out_shardings=(lay.logits_PBV, lay.cache),
            donate_argnums=(1,),
        )

    def decode_select(self, params, cache, tokens_PB, key, step, sampling: Sampling):
        lay = self.layouts
        compiled = self._compile(
            "decode_step",
            (sampling,),
            lambda p, c, t, k, s: self._decode_select(p, c, t, k, s, sampling),
            (lay.params, lay.cache, lay.tokens_PB, lay.replicated, lay.replicated),
            (lay.tokens_PB, lay.cache),
            (params, cache, tokens_PB, key, step),
            donate_argnums=(1,),
        )
        return compiled(params, cache, tokens_PB, key, step)

    def decode_loop(self, params, cache, first_PB, done_B, key, stop_S, n_new, sampling):
        lay = self.layouts
        n_new = put_global(np.asarray(n_new, np.int32), lay.replicated)  # runtime: one compile
        compiled = self._compile(
            "decode_loop",
            (sampling, stop_S.shape),
            lambda p, c, f, d, k, s, n: self._decode_loop(p, c, f, d, k, s, n, sampling),
            (
                lay.params,
                lay.cache,
                lay.tokens_PB,
                lay.tokens_B,
                lay.replicated,
                lay.replicated,
                lay.replicated,
            ),
            (lay.out_PBN, lay.cache),
            (params, cache, first_PB, done_B, key, stop_S, n_new),
            donate_argnums=(1,),
        )
        return compiled(params, cache, first_PB, done_B, key, stop_S, n_new)

    # --- results as callers see them -----------------------------------------------------

    def host_batch(self, x_P: jax.Array) -> np.ndarray:
        """The last stage's row of a stage-major result, read to the host.

        Only the shards held by last-stage devices are transferred (each distinct one once);
        a result spread over other processes is gathered whole first.
        """
        last = self.stages.count - 1
        if not x_P.is_fully_addressable:
            return to_host(x_P)[last]
        out = np.empty(x_P.shape[1:], x_P.dtype)
        seen = set()
        for shard in x_P.addressable_shards:
            rows = range(*shard.index[0].indices(x_P.shape[0]))
            where = tuple((s.start, s.stop) for s in shard.index[1:])
            if last in rows and where not in seen:
                seen.add(where)
                out[shard.index[1:]] = np.asarray(shard.data)[rows.index(last)]
        return out

    def to_batch(self, x_P: jax.Array) -> jax.Array:
        """The last stage's row as an array laid out like the unpipelined result."""
        target = NamedSharding(self.mesh, PartitionSpec(*x_P.sharding.spec[1:]))
        return put_global(self.host_batch(x_P), target)
