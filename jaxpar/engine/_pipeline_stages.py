"""Pipeline stages: which layers each ``pp`` device holds, and how a stage's work runs.

The ``pp`` mesh axis holds ``P`` stages of ``Lp = L / P`` contiguous layers. Stacked layer
parameters ``[L, ...]`` (and the KV cache ``[L, B, S, K, H]``) are placed with ``layers``
over ``pp`` in contiguous blocks, so viewing them as ``[P, Lp, ...]`` is a local reshape.
:meth:`Stages.map` runs a per-stage function on each device's own ``[1, Lp, ...]`` block
(``shard_map`` with ``pp`` manual, every other axis automatic), so the stage-agnostic model
code and its ``constrain`` calls run unchanged and TP, EP, DP and SP keep working inside a
stage. An array kept layer-major (:class:`Blocks`: the stacked layer parameters, the
decode step's KV cache) reaches each stage as its ``[Lp, ...]`` block with no reshape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.engine._layouts import stage_sharding
from jaxpar.models import Decoder
from jaxpar.spec import (
    ModelDims,
    Module,
    ParallelConfig,
    Phase,
    active_phase,
    active_platform,
    sharding_context,
)


@flax.struct.dataclass
class Blocks:
    """Arrays ``[L, ...]`` (any pytree of them) passed to :meth:`Stages.map` layer-major:
    the leading dim split over ``pp`` in contiguous blocks, as the stacked cache is laid
    out, so each stage sees its own ``[Lp, ...]`` block as it is.

    Why not a stage-major ``[P, Lp, ...]`` view: that is a reshape, and an array carried
    through a loop on both sides of a reshape with a size-1 dim (a quantized cache's
    scales ``[..., 1]``, one kv head per device) got a layout of its own inside from
    XLA:CPU, which then copied it whole in and out every step. A stage function returns
    the blocks it changed wrapped again, so they come back layer-major too.
    """

    tree: Any


def _is_blocks(x: Any) -> bool:
    return isinstance(x, Blocks)


@dataclasses.dataclass(frozen=True)
class Stages:
    """The pipeline stages of one engine, and the shardings of stage-major arrays."""

    mesh: Mesh
    config: ParallelConfig
    dims: ModelDims

    @property
    def count(self) -> int:
        """P, the number of stages (the ``pp`` degree)."""
        return self.config.pp

    def sharding(self, axes: tuple[str | None, ...], module: Module, phase: Phase) -> NamedSharding:
        """``P("pp", *spec)``: a leading stage dim on ``pp``, then ``axes`` as the tables say."""
        return stage_sharding(self.mesh, self.config, self.dims, axes, module, phase)

    def constrain(
        self, x: jax.Array, axes: tuple[str | None, ...], module: Module, phase: Phase
    ) -> jax.Array:
        """Constrains a stage-major array ``[P, *axes]``."""
        return jax.lax.with_sharding_constraint(x, self.sharding(axes, module, phase))

    def split_layers(self, model: Decoder) -> tuple[nnx.GraphDef, Blocks]:
        """The layer graphdef and the stacked layer state, layer-major (:class:`Blocks`).

        Each stage reads its own ``[Lp, ...]`` block of the ``[L, ...]`` parameters as they
        are stored, with no ``[P, Lp, ...]`` reshape in the step. (The whole-kernel copies
        pipelined steps made on TPU were a layout choice, not this reshape: see
        :mod:`jaxpar.engine._param_formats`.)
        """
        graphdef, state = nnx.split(model.layers)
        return graphdef, Blocks(state)

    def map(self, fn: Callable) -> Callable:
        """``fn(stage, *args)`` run by each ``pp`` device on its own stage of ``args``.

        ``args`` are stage-major (leading dim ``P`` on ``pp``); ``fn`` sees one stage's
        slice and its index, and returns per-stage results that come back stage-major.
        :class:`Blocks` args and results are layer-major instead: ``fn`` sees (and returns,
        wrapped) a stage's ``[Lp, ...]`` block itself.
        Inside, ``pp`` is a manual axis (``shard_map``) and the others stay automatic, so
        the model's ``constrain`` calls work as usual and XLA cannot make any op of the
        stage communicate across stages (with ``vmap(spmd_axis_name="pp")`` it gathered
        MoE router top-k inputs over ``pp``: XLA partitions ``TopK`` only replicated).
        """
        phase, platform = active_phase(), active_platform()

        def unstage(x: Any) -> Any:
            return x.tree if _is_blocks(x) else x[0]

        def restage(x: Any) -> Any:
            return x if _is_blocks(x) else x[None]

        def body(*args):
            local = jax.tree.map(unstage, args, is_leaf=_is_blocks)
            # Constraints inside must name the mesh as shard_map sees it (pp manual); the
            # abstract mesh has no devices, so the platform comes from the outer context.
            inner = jax.sharding.get_abstract_mesh()
            with sharding_context(inner, phase, self.config, self.dims, platform=platform):
                out = fn(jax.lax.axis_index("pp"), *local)
            return jax.tree.map(restage, out, is_leaf=_is_blocks)

        def run(*args):
            staged = PartitionSpec("pp")
            return jax.shard_map(
                body,
                mesh=self.mesh,
                in_specs=(staged,) * len(args),
                out_specs=staged,
                axis_names={"pp"},
            )(*args)

        return run


def stage_layer(state_Lp: nnx.State, j: jax.Array) -> nnx.State:
    """Layer ``j`` of a stage's ``[Lp, ...]`` state (a slice; the weights stay in place)."""
    return jax.tree.map(lambda x: x[j], state_Lp)
