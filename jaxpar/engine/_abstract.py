"""``AbstractEngine``: a strategy's layouts and step functions, from shapes alone.

The one place that turns (model config, parallel config, shapes) into what the engine
compiles: validation against the spec tables, the layer form (stacked when pipelined), the
padded vocabulary, the mesh, every sharding (:class:`Layouts`) and the steps
(:class:`Steps`). :class:`~jaxpar.engine.InferenceEngine` builds one and places real
parameters in its shardings; ``jaxpar explain``, ``jaxpar.inspect`` and the benchmarks
lower its steps over abstract parameters, so nothing is allocated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxpar.engine._layouts import Layouts
from jaxpar.engine._moe_probe import resolve_moe_dispatch
from jaxpar.engine._placement import param_shardings
from jaxpar.engine._steps import Steps
from jaxpar.engine._vocab import padded_config
from jaxpar.errors import ConfigError
from jaxpar.models import KVCache, ModelConfig, abstract_model
from jaxpar.spec import ParallelConfig, Phase, Plan, canonical_mesh, default_mesh, validate


def layer_loop_for(model_config: ModelConfig, parallel: ParallelConfig) -> str:
    """The layer storage an engine runs: stacked (``"scan"``) when ``pp > 1``.

    Pipeline stages split the stacked ``[L, ...]`` layer parameters and cache over ``pp``
    (one contiguous block of layers per stage). Without pipelining the model's own form is
    kept.
    """
    return "scan" if parallel.pp > 1 else model_config.layer_loop


def run_form(model_config: ModelConfig, parallel: ParallelConfig) -> ModelConfig:
    """The model an engine runs: in its :func:`layer_loop_for` form, the vocabulary padded
    to a multiple of ``tp`` (see ``_vocab``)."""
    loop = layer_loop_for(model_config, parallel)
    if loop != model_config.layer_loop:
        model_config = dataclasses.replace(model_config, layer_loop=loop)
    return padded_config(model_config, parallel.tp)


@dataclasses.dataclass(frozen=True)
class AbstractEngine:
    """An engine's layouts and steps over abstract parameters (``ShapeDtypeStruct``).

    Attributes:
        model_config: the model as it runs (stacked layers if pipelined, padded vocabulary).
        vocab_size: the true vocabulary (ids from it up are never chosen).
        parallel_config, mesh, plan: the strategy, its mesh, its validated plan.
        graphdef: the model's graph.
        layouts: every sharding of every step (:class:`Layouts`).
        steps: the step functions (:class:`Steps`).
        params: abstract parameters in their shardings.
        max_batch, max_seq_len: the shapes it compiles for.
    """

    model_config: ModelConfig
    vocab_size: int
    parallel_config: ParallelConfig
    mesh: Mesh
    plan: Plan
    graphdef: nnx.GraphDef
    layouts: Layouts
    steps: Steps
    params: Any
    max_batch: int
    max_seq_len: int

    @classmethod
    def build(
        cls,
        model_config: ModelConfig,
        parallel_config: ParallelConfig | None = None,
        *,
        max_batch: int,
        max_seq_len: int,
        mesh: Mesh | None = None,
        platform: str | None = None,
    ) -> AbstractEngine:
        """Validates the strategy (nothing is built for an illegal one), then lays it out.

        Args:
            model_config: the model (any layer form, true vocabulary).
            parallel_config: degrees of dp, pp, sp, ep, tp (default: one device).
            max_batch: sequences per step.
            max_seq_len: KV cache length per sequence.
            mesh: default ``default_mesh(parallel_config)`` (the first devices it needs).
            platform: lower for this platform (``"cuda"``, ``"tpu"``) instead of the mesh
                devices' own: kernels are chosen for it, and :meth:`lower` emits its
                StableHLO (which only that platform's compiler can compile). For TPU, a
                mesh over a compile-only topology compiles with no such option.
        """
        parallel = parallel_config or ParallelConfig()
        config = run_form(model_config, parallel)
        devices = mesh.devices.size if mesh is not None else parallel.size
        plan = validate(
            config, parallel, n_devices=devices, batch=max_batch, max_seq_len=max_seq_len
        )
        mesh = canonical_mesh(mesh) if mesh is not None else default_mesh(parallel)
        if parallel.pp > 1 and config.moe_capacity_factor is not None:
            raise ConfigError(
                f"moe_capacity_factor={config.moe_capacity_factor} with pp={parallel.pp}: the "
                "pipeline schedule does not carry the MoE drop counts out, and drops are never "
                "left uncounted; use dropless (moe_capacity_factor=None) or pp=1"
            )
        kv = getattr(config, "kv_cache_dtype", None)
        if parallel.pp > 1 and kv is not None:  # the pipeline's stage caches are float
            raise ConfigError(
                f"kv_cache_dtype={kv!r} runs unpipelined strategies; {parallel} has "
                f"pp={parallel.pp}: use pp=1 (dp, sp, ep or tp), or kv_cache_dtype=None"
            )
        config = resolve_moe_dispatch(config, mesh, platform)
        graphdef, state = nnx.split(abstract_model(config))
        shardings = param_shardings(state, mesh, parallel, config)
        params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
        )
        layouts = Layouts.build(mesh, parallel, config, shardings)
        steps = Steps(
            graphdef,
            layouts,
            mesh,
            parallel,
            config,
            max_seq_len,
            vocab_size=model_config.vocab_size,
            platform=platform,
        )
        return cls(
            config,
            model_config.vocab_size,
            parallel,
            mesh,
            plan,
            graphdef,
            layouts,
            steps,
            params,
            max_batch,
            max_seq_len,
        )

    def lower(self, phase: Phase | str, *, prompt_len: int, params: Any = None) -> Any:
        """The ``jax.stages.Lowered`` prefill (prompts of ``prompt_len``) or decode step.

        Inputs are ``ShapeDtypeStruct`` in the step's own shardings; ``params`` (default:
        the abstract ones) may be placed arrays.
        """
        lay, batch = self.layouts, self.max_batch
        params = self.params if params is None else params
        if Phase.coerce(phase) is Phase.PREFILL:
            tokens = jax.ShapeDtypeStruct((batch, prompt_len), np.int32, sharding=lay.tokens_BT)
            lengths = jax.ShapeDtypeStruct((batch,), np.int32, sharding=lay.lengths_prefill_B)
            return self.steps.lower_prefill(params, tokens, lengths)
        cache = KVCache.abstract(self.model_config, batch, self.max_seq_len)
        cache = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache, lay.cache
        )
        tokens = jax.ShapeDtypeStruct((batch,), np.int32, sharding=lay.tokens_B)
        return self.steps.lower_decode(params, cache, tokens)
