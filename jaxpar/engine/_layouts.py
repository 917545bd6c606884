"""Every sharding a step takes or returns, per phase: the one place a layout is decided.

The spec layer maps logical axes to ``PartitionSpec``s (per module and phase); this module
names the arrays the steps pass around and gives each its logical axes. With ``pp > 1``
what comes out of the last pipeline stage (logits, sampled tokens) is stage-major: a
leading ``[P]`` dim on ``pp``, meaningful at ``P - 1`` (see :mod:`jaxpar.engine._pipeline`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.models import PREFILL_KV_AXES, STACKED_KV_AXES, KVCache, PagedKVCache
from jaxpar.spec import ModelDims, Module, ParallelConfig, Phase, partition_spec

PREFILL, DECODE = Phase.PREFILL, Phase.DECODE
ATTENTION, EMBEDDING, LM_HEAD = Module.ATTENTION, Module.EMBEDDING, Module.LM_HEAD


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str | None) for a in x)


@dataclasses.dataclass(frozen=True)
class Layouts:
    """Every sharding the steps use, computed once from the spec layer.

    ``[P]`` marks the leading stage dim that pipelined engines (``pp > 1``) add; without
    pipelining those arrays have the shape after it.
    """

    params: Any  # one NamedSharding per parameter, both phases
    replicated: NamedSharding
    # prefill
    tokens_BT: NamedSharding
    lengths_prefill_B: NamedSharding
    kv_prefill: Any  # per-layer [B, T, K, H] (a tuple), or stacked [L, B, T, K, H]
    logits_prefill: NamedSharding  # [P,] B, V: last position
    logits_prefill_all: NamedSharding  # [P,] B, T, V: every position
    # decode
    cache: KVCache  # of NamedSharding
    paged: PagedKVCache  # of NamedSharding: the serving slots' page pool, tables, lengths
    tokens_B: NamedSharding  # tokens the caller passes in
    logits: NamedSharding  # [P,] B, V
    next_tokens: NamedSharding  # [P,] B: sampled, chained from step to step
    out_tokens: NamedSharding  # [P,] B, N: a decode loop's tokens

    @classmethod
    def build(cls, mesh: Mesh, config: ParallelConfig, dims: ModelDims, params: Any) -> Layouts:
        def at(axes, module, phase):
            return NamedSharding(mesh, partition_spec(axes, module, phase, config, dims=dims))

        def tree_at(tree, module, phase):
            return jax.tree.map(lambda axes: at(axes, module, phase), tree, is_leaf=_is_axes)

        # What leaves the last stage: stage-major when pipelined.
        out = at if config.pp == 1 else functools.partial(stage_sharding, mesh, config, dims)
        stacked = dims.layer_loop == "scan"
        kv_prefill = STACKED_KV_AXES if stacked else (PREFILL_KV_AXES,) * dims.n_layers
        return cls(
            params=params,
            replicated=NamedSharding(mesh, PartitionSpec()),
            tokens_BT=at(("batch", "seq"), EMBEDDING, PREFILL),
            lengths_prefill_B=at(("batch",), ATTENTION, PREFILL),
            kv_prefill=tree_at(kv_prefill, ATTENTION, PREFILL),
            logits_prefill=out(("batch", "vocab"), LM_HEAD, PREFILL),
            logits_prefill_all=out(("batch", "seq", "vocab"), LM_HEAD, PREFILL),
            cache=tree_at(KVCache.logical_axes(dims), ATTENTION, DECODE),
            paged=tree_at(PagedKVCache.logical_axes(dims), ATTENTION, DECODE),
            tokens_B=at(("batch",), EMBEDDING, DECODE),
            logits=out(("batch", "vocab"), LM_HEAD, DECODE),
            next_tokens=out(("batch",), EMBEDDING, DECODE),
            # Unpipelined, the loop's tokens come back replicated.
            out_tokens=(
                NamedSharding(mesh, PartitionSpec())
                if config.pp == 1
                else out(("batch", None), EMBEDDING, DECODE)
            ),
        )


def stage_sharding(
    mesh: Mesh,
    config: ParallelConfig,
    dims: ModelDims,
    axes: tuple[str | None, ...],
    module: Module,
    phase: Phase,
) -> NamedSharding:
    """``P("pp", *spec)``: a leading stage dim on ``pp``, then ``axes`` as the tables say."""
    spec = partition_spec(axes, module, phase, config, dims=dims)
    return NamedSharding(mesh, PartitionSpec("pp", *spec))
