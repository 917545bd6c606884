"""``AbstractEngine``: a strategy's layouts and step functions, from shapes alone.

The one place that turns (model config, execution options, parallel config, shapes) into
what the engine compiles: validation against the spec tables, the layer form (stacked when
pipelined), the padded vocabulary, the mesh, the options' "auto" values resolved for the
mesh's devices, every sharding (:class:`Layouts`) and the steps
(:class:`Steps`). :class:`~jaxpar.engine.InferenceEngine` builds one and places real
parameters in its shardings; ``jaxpar explain``, ``jaxpar.inspect`` and the benchmarks
lower its steps over abstract parameters, so nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxpar.engine._layouts import Layouts
from jaxpar.engine._moe_probe import mesh_compiles_ragged
from jaxpar.engine._param_formats import decode_param_formats, stores_in_step_layouts
from jaxpar.engine._placement import param_shardings
from jaxpar.engine._serving_programs import SERVING_PROGRAMS, ServingPrograms
from jaxpar.engine._steps import Steps
from jaxpar.engine._vocab import padded_run
from jaxpar.errors import ConfigError
from jaxpar.models import ExecutionOptions, KVCache, ModelConfig, ModelRun, abstract_model
from jaxpar.spec import (
    ParallelConfig,
    Phase,
    Plan,
    canonical_mesh,
    default_mesh,
    validate,
)


def layer_loop_for(options: ExecutionOptions | ModelRun, parallel: ParallelConfig) -> str:
    """The layer storage an engine runs: stacked (``"scan"``) when ``pp > 1``.

    Pipeline stages split the stacked ``[L, ...]`` layer parameters and cache over ``pp``
    (one contiguous block of layers per stage). Without pipelining the options' own form is
    kept.
    """
    return "scan" if parallel.pp > 1 else options.layer_loop


def run_form(
    model: ModelConfig | ModelRun,
    parallel: ParallelConfig,
    options: ExecutionOptions | None = None,
) -> ModelRun:
    """The model as an engine runs it, before the ``"auto"`` options are resolved: in its
    :func:`layer_loop_for` form, the vocabulary padded to a multiple of ``tp`` (see
    ``_vocab``), each KV head repeated :func:`~jaxpar.spec.kv_head_replicas` times when
    ``tp`` is a multiple of the KV heads (one head per device). The config itself is the
    one given."""
    run = ModelRun.of(model, options)
    loop = layer_loop_for(run, parallel)
    if loop != run.layer_loop:
        run = run.with_options(layer_loop=loop)
    return padded_run(run, parallel.tp).with_kv_heads_for(parallel)


def mesh_platform_of(mesh: Mesh) -> str:
    """The platform of the mesh's devices: what its programs run on, whatever JAX's
    default backend is (a CPU host may drive, or lower for, accelerators)."""
    return mesh.devices.flat[0].platform


@dataclasses.dataclass(frozen=True)
class AbstractEngine:
    """An engine's layouts and steps over abstract parameters (``ShapeDtypeStruct``).

    Attributes:
        model_config: the model as given (the checkpoint's; never rewritten).
        run: the model as it runs (:class:`~jaxpar.models.ModelRun`): the config with the
            resolved options (stacked layers if pipelined, no ``"auto"`` left) and the
            padded vocabulary.
        vocab_size: the true vocabulary (ids from it up are never chosen).
        parallel_config, mesh, plan: the strategy, its mesh, its validated plan.
        graphdef: the model's graph.
        layouts: every sharding of every step (:class:`Layouts`).
        steps: the step functions (:class:`Steps`).
        params: abstract parameters in their shardings.
        max_batch, max_seq_len: the shapes it compiles for.
    """

    model_config: ModelConfig
    run: ModelRun
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

    @property
    def options(self) -> ExecutionOptions:
        """The resolved execution options (what "auto" became on this mesh)."""
        return self.run.options

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
        options: ExecutionOptions | None = None,
    ) -> AbstractEngine:
        """Validates the strategy (nothing is built for an illegal one), then lays it out.

        Args:
            model_config: the model (the checkpoint's config), or a run of it: a run form
                (:func:`run_form`, as :class:`~jaxpar.engine.InferenceEngine` hands down)
                is taken as it is.
            parallel_config: degrees of dp, pp, sp, ep, tp (default: one device).
            max_batch: sequences per step.
            max_seq_len: KV cache length per sequence.
            mesh: default ``default_mesh(parallel_config)`` (the first devices it needs).
            platform: lower for this platform (``"cuda"``, ``"tpu"``) instead of the mesh
                devices' own: kernels are chosen for it, and :meth:`lower` emits its
                StableHLO (which only that platform's compiler can compile). For TPU, a
                mesh over a compile-only topology compiles with no such option.
            options: how it runs (default ``ExecutionOptions()``); ``"auto"`` values are
                resolved here, once, for ``platform`` or else the mesh's devices.
        """
        parallel = parallel_config or ParallelConfig()
        run = run_form(model_config, parallel, options)
        model_config = run.config
        devices = mesh.devices.size if mesh is not None else parallel.size
        plan = validate(run, parallel, n_devices=devices, batch=max_batch, max_seq_len=max_seq_len)
        mesh = canonical_mesh(mesh) if mesh is not None else default_mesh(parallel)
        if parallel.pp > 1 and run.moe_capacity_factor is not None:
            raise ConfigError(
                f"moe_capacity_factor={run.moe_capacity_factor} with pp={parallel.pp}: the "
                "pipeline schedule does not carry the MoE drop counts out, and drops are never "
                "left uncounted; use dropless (moe_capacity_factor=None) or pp=1"
            )
        target = platform or mesh_platform_of(mesh)
        ragged = model_config.is_moe and mesh_compiles_ragged(mesh, platform)
        resolved = run.options.resolve(model_config, target, ragged_compiles=ragged)
        run = dataclasses.replace(run, options=resolved)
        graphdef, state = nnx.split(abstract_model(run))
        shardings = param_shardings(state, mesh, parallel, run)
        params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
        )
        layouts = Layouts.build(mesh, parallel, run, shardings)
        steps = Steps(
            graphdef,
            layouts,
            mesh,
            parallel,
            run,
            max_seq_len,
            vocab_size=model_config.vocab_size,
            platform=platform,
        )
        if stores_in_step_layouts(target, parallel.pp):
            steps.param_formats = decode_param_formats(steps, params, max_batch)
            params = jax.tree.map(
                lambda x, f: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=f),
                params,
                steps.param_formats,
            )
        return cls(
            model_config,
            run,
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

    @functools.cached_property
    def serving(self) -> ServingPrograms:
        """The serving programs (:mod:`jaxpar.engine._serving_programs`): what ``jaxpar
        serve`` compiles, over a page pool of ``max_batch x max_seq_len`` tokens."""
        return ServingPrograms(self.steps, self.params, self.max_batch)

    def lower(
        self,
        phase: Phase | str,
        *,
        prompt_len: int,
        params: Any = None,
        rows: int | None = None,
        context_len: int | None = None,
    ) -> Any:
        """The ``jax.stages.Lowered`` program ``phase``.

        ``"prefill"`` (prompts of ``prompt_len``) and ``"decode"`` are the offline steps
        over a contiguous cache (``generate`` when pipelined); the serving programs
        (:data:`~jaxpar.engine._serving_programs.SERVING_PROGRAMS`: ``"serve_decode"``,
        the paged step ``jaxpar serve`` and unpipelined ``generate`` run, sampling
        included; ``"serve_prefill"``, ``"serve_prefill_context"`` (after
        ``context_len`` cached tokens), ``"first_tokens"`` and ``"insert"``) are what
        the server compiles, over ``rows`` rows (default ``max_batch``).

        Inputs are ``ShapeDtypeStruct`` in the step's own shardings; ``params`` (default:
        the abstract ones) may be placed arrays.
        """
        if isinstance(phase, str) and phase in SERVING_PROGRAMS:
            return self.serving.lower(
                phase, prompt_len=prompt_len, rows=rows, context_len=context_len, params=params
            )
        lay, batch = self.layouts, self.max_batch
        params = self.params if params is None else params
        if Phase.coerce(phase) is Phase.PREFILL:
            tokens = jax.ShapeDtypeStruct((batch, prompt_len), np.int32, sharding=lay.tokens_BT)
            lengths = jax.ShapeDtypeStruct((batch,), np.int32, sharding=lay.lengths_prefill_B)
            return self.steps.lower_prefill(params, tokens, lengths)
        cache = KVCache.abstract(self.run, batch, self.max_seq_len)
        cache = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache, lay.cache
        )
        tokens = jax.ShapeDtypeStruct((batch,), np.int32, sharding=lay.tokens_B)
        return self.steps.lower_decode(params, cache, tokens)
