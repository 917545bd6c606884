"""The jit-compiled step functions, each with explicit per-phase shardings.

* ``prefill``: whole prompts in the prefill layout (tokens may be split over ``sp``);
* ``handoff``: pads the prefill K/V to ``max_seq_len`` and reshards it once into the decode
  layout, and picks each sequence's first new token;
* ``decode``: one token per sequence, cache donated and updated in place;
* ``decode_loop``: many decode steps inside one ``lax.while_loop``, so the host does not
  dispatch every token.

Model code only names logical axes; the ``sharding_context`` around each traced body turns
them into this phase's ``PartitionSpec``s.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.engine._placement import put_global, to_host
from jaxpar.engine._sampling import Sampling, select
from jaxpar.engine._vocab import mask_padded
from jaxpar.models._cache import PREFILL_KV_AXES, STACKED_KV_AXES, KVCache
from jaxpar.models._config import ModelConfig
from jaxpar.spec import ModelDims, Module, ParallelConfig, Phase, partition_spec, sharding_context

PREFILL, DECODE = Phase.PREFILL, Phase.DECODE


@dataclasses.dataclass(frozen=True)
class Layouts:
    """Every sharding the steps use, computed once from the spec layer."""

    params: Any
    tokens_BT: NamedSharding  # prefill
    lengths_prefill_B: NamedSharding
    logits_prefill_BV: NamedSharding
    kv_prefill: Any  # per-layer [B, T, K, H] (a tuple), or stacked [L, B, T, K, H]
    cache: KVCache  # of NamedSharding, decode layout
    tokens_B: NamedSharding  # decode
    logits_BV: NamedSharding  # decode
    replicated: NamedSharding

    @classmethod
    def build(cls, mesh: Mesh, config: ParallelConfig, dims: ModelConfig, params: Any) -> Layouts:
        def at(axes, module, phase):
            return NamedSharding(mesh, partition_spec(axes, module, phase, config, dims=dims))

        def tree_at(tree, module, phase):
            return jax.tree.map(
                lambda axes: at(axes, module, phase),
                tree,
                is_leaf=lambda x: (
                    isinstance(x, tuple) and all(isinstance(a, str | None) for a in x)
                ),
            )

        stacked = dims.layer_loop == "scan"
        kv_prefill = STACKED_KV_AXES if stacked else (PREFILL_KV_AXES,) * dims.n_layers
        return cls(
            params=params,
            tokens_BT=at(("batch", "seq"), Module.EMBEDDING, PREFILL),
            lengths_prefill_B=at(("batch",), Module.ATTENTION, PREFILL),
            logits_prefill_BV=at(("batch", "vocab"), Module.LM_HEAD, PREFILL),
            kv_prefill=tree_at(kv_prefill, Module.ATTENTION, PREFILL),
            cache=tree_at(KVCache.logical_axes(dims), Module.ATTENTION, DECODE),
            tokens_B=at(("batch",), Module.EMBEDDING, DECODE),
            logits_BV=at(("batch", "vocab"), Module.LM_HEAD, DECODE),
            replicated=NamedSharding(mesh, PartitionSpec()),
        )


class Steps:
    """Builds, compiles (ahead of time, timed) and caches the step functions."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        layouts: Layouts,
        mesh: Mesh,
        config: ParallelConfig,
        dims: ModelDims,
        max_seq_len: int,
        *,
        vocab_size: int | None = None,
    ):
        """``dims`` may have a padded vocabulary; ``vocab_size`` is the true one (default:
        ``dims.vocab_size``): ids from it up are never chosen."""
        self.graphdef = graphdef
        self.vocab_size = dims.vocab_size if vocab_size is None else vocab_size
        self.layouts = layouts
        self.mesh = mesh
        self.config = config
        self.dims = dims
        self.max_seq_len = max_seq_len
        self.compile_seconds: dict[str, float] = {}
        self._compiled: dict[tuple, Any] = {}

    # --- traced bodies -------------------------------------------------------------------

    def _model(self, params):
        return nnx.merge(self.graphdef, params)

    def _prefill(self, params, tokens_BT, lengths_B, all_logits=False):
        with sharding_context(self.mesh, PREFILL, self.config, self.dims):
            return self._model(params).prefill(tokens_BT, lengths_B, all_logits=all_logits)

    def _handoff(self, k, v, lengths_B, logits_BV, key, sampling):
        with sharding_context(self.mesh, DECODE, self.config, self.dims):
            cache = KVCache.from_prefill(k, v, lengths_B, self.max_seq_len)
            first_B = self._select(logits_BV, jax.random.fold_in(key, 0), sampling)
        return cache, first_B

    def _decode(self, params, cache, tokens_B):
        with sharding_context(self.mesh, DECODE, self.config, self.dims):
            return self._model(params).decode(tokens_B, cache)

    def _decode_select(self, params, cache, tokens_B, key, step, sampling):
        logits_BV, cache = self._decode(params, cache, tokens_B)
        with sharding_context(self.mesh, DECODE, self.config, self.dims):
            return self._select(logits_BV, jax.random.fold_in(key, step), sampling), cache

    def _select(self, logits_BV, key, sampling):
        """:func:`select` over the true vocabulary (padded ids masked)."""
        return select(mask_padded(logits_BV, self.vocab_size), key, sampling)

    def _decode_loop(self, params, cache, first_B, done_B, key, stop_S, n_new, sampling):
        # n_new is a traced scalar: the output has room for the most tokens any prompt can
        # get (max_seq_len), so one program serves every max_new_tokens.
        batch = first_B.shape[0]
        out_BN = jnp.full((batch, self.max_seq_len), -1, jnp.int32).at[:, 0].set(first_B)
        done_B = done_B | jnp.isin(first_B, stop_S)

        def cond(carry):
            i, _, _, done_B, _ = carry
            return (i < n_new) & ~jnp.all(done_B)

        def body(carry):
            i, tokens_B, cache, done_B, out_BN = carry
            next_B, cache = self._decode_select(params, cache, tokens_B, key, i, sampling)
            out_BN = out_BN.at[:, i].set(jnp.where(done_B, -1, next_B))
            done_B = done_B | jnp.isin(next_B, stop_S)
            return i + 1, next_B, cache, done_B, out_BN

        init = (jnp.int32(1), first_B, cache, done_B, out_BN)
        _, _, cache, _, out_BN = jax.lax.while_loop(cond, body, init)
        return out_BN, cache

    # --- compiled entry points -----------------------------------------------------------

    def _aot(self, name: str, key: tuple, jitted, args):
        """Compiles ``jitted`` for ``args`` once per ``(name, *key)``, timing the compile."""
        cache_key = (name, *key)
        if cache_key not in self._compiled:
            start = time.perf_counter()
            self._compiled[cache_key] = jitted.lower(*args).compile()
            self.compile_seconds[name] = time.perf_counter() - start
        return self._compiled[cache_key]

    def _compile(self, name: str, key: tuple, fn, in_shardings, out_shardings, args, **jit_kw):
        jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, **jit_kw)
        return self._aot(name, key, jitted, args)

    def lower_prefill(self, params, tokens_BT, lengths_B, *, all_logits: bool = False):
        """The ``jax.stages.Lowered`` prefill for these shapes (for inspection)."""
        return self._jit_prefill(all_logits).lower(params, tokens_BT, lengths_B)

    def _jit_prefill(self, all_logits: bool):
        lay = self.layouts
        logits = (
            NamedSharding(self.mesh, _logits_BTV_spec(self))
            if all_logits
            else lay.logits_prefill_BV
        )
        return jax.jit(
            lambda p, t, n: self._prefill(p, t, n, all_logits),
            in_shardings=(lay.params, lay.tokens_BT, lay.lengths_prefill_B),
            out_shardings=(logits, lay.kv_prefill, lay.kv_prefill),
        )

    def prefill(self, params, tokens_BT, lengths_B, *, all_logits: bool = False):
        args = (params, tokens_BT, lengths_B)
        return self._aot(
            "prefill", (tokens_BT.shape, all_logits), self._jit_prefill(all_logits), args
        )(*args)

    def handoff(self, k, v, lengths_B, logits_BV, key, sampling: Sampling):
        lay = self.layouts
        compiled = self._compile(
            "handoff",
            (jax.tree.map(jnp.shape, k), sampling),
            lambda k, v, n, lg, key: self._handoff(k, v, n, lg, key, sampling),
            (
                lay.kv_prefill,
                lay.kv_prefill,
                lay.lengths_prefill_B,
                lay.logits_prefill_BV,
                lay.replicated,
            ),
            (lay.cache, lay.tokens_B),
            (k, v, lengths_B, logits_BV, key),
        )
        return compiled(k, v, lengths_B, logits_BV, key)

    def jit_decode(self):
        lay = self.layouts
        return jax.jit(
            self._decode,
            in_shardings=(lay.params, lay.cache, lay.tokens_B),
            out_shardings=(lay.logits_BV, lay.cache),
            donate_argnums=(1,),
        )

    def decode(self, params, cache, tokens_B):
        args = (params, cache, tokens_B)
        return self._aot("decode", (), self.jit_decode(), args)(*args)

    def decode_select(self, params, cache, tokens_B, key, step, sampling: Sampling):
        lay = self.layouts
        compiled = self._compile(
            "decode_step",
            (sampling,),
            lambda p, c, t, k, s: self._decode_select(p, c, t, k, s, sampling),
            (lay.params, lay.cache, lay.tokens_B, lay.replicated, lay.replicated),
            (lay.tokens_B, lay.cache),
            (params, cache, tokens_B, key, step),
            donate_argnums=(1,),
        )
        return compiled(params, cache, tokens_B, key, step)

    def decode_loop(self, params, cache, first_B, done_B, key, stop_S, n_new, sampling):
        """Up to ``n_new`` tokens per row (``[B, max_seq_len]``, -1 past the end).

        ``n_new`` is a runtime argument: one compile per sampling mode and stop-list size.
        """
        lay = self.layouts
        n_new = put_global(np.asarray(n_new, np.int32), lay.replicated)
        compiled = self._compile(
            "decode_loop",
            (sampling, stop_S.shape),
            lambda p, c, f, d, k, s, n: self._decode_loop(p, c, f, d, k, s, n, sampling),
            (
                lay.params,
                lay.cache,
                lay.tokens_B,
                lay.tokens_B,
                lay.replicated,
                lay.replicated,
                lay.replicated,
            ),
            (lay.replicated, lay.cache),
            (params, cache, first_B, done_B, key, stop_S, n_new),
            donate_argnums=(1,),
        )
        return compiled(params, cache, first_B, done_B, key, stop_S, n_new)

    # --- results as callers see them -----------------------------------------------------

    def to_batch(self, x: jax.Array) -> jax.Array:
        """A step's result as callers see it (pipelined steps drop their stage dim here)."""
        return x

    def host_batch(self, x: jax.Array) -> np.ndarray:
        """A step's result on the host, on every process."""
        return to_host(x)


def _logits_BTV_spec(steps: Steps) -> PartitionSpec:
    return partition_spec(
        ("batch", "seq", "vocab"), Module.LM_HEAD, PREFILL, steps.config, dims=steps.dims
    )
