"""Memory per device: parameters, KV cache, step inputs, and an activation estimate.

Parameters and the cache are counted exactly, from the shapes the engine builds (its run form:
stacked layers when pipelined, the vocabulary padded for ``tp``) and the shardings the spec
layer gives them (:func:`jaxpar.spec.param_partition_spec` for weights, the decode layout for
the cache). They are what ``compiled.memory_analysis()`` calls argument bytes. Activations
are an estimate (XLA's buffer assignment decides the real peak): the residual stream, the
prompt K/V a prefill returns, and the largest intermediate of a layer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxpar.engine import KV_PAGE_SIZE, cache_fraction, run_form
from jaxpar.models import (
    RING_K_TILE,
    RING_Q_TILE,
    KVCache,
    ModelConfig,
    ModelRun,
    abstract_model,
    element_bytes,
    sp_prefill_attention,
)
from jaxpar.spec import Module, ParallelConfig, Phase, mesh_axes, param_partition_spec
from jaxpar.spec import partition_spec as logical_spec

INT32 = 4


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device (the busiest device: every shard here is the largest one)."""

    params: int
    kv_cache: int
    prompt_kv: int  # the K/V a prefill step returns before the handoff writes the cache
    prefill_inputs: int  # token ids [B, T] and lengths [B]
    decode_inputs: int  # token ids [B]
    activations: int  # estimate of the larger of the two steps' activation peaks
    #: Each step's own activation estimate (``activations`` is their max); 0 when unknown.
    prefill_activations: int = 0
    decode_activations: int = 0

    @property
    def inputs(self) -> int:
        return self.prefill_inputs + self.decode_inputs

    @property
    def prefill_total(self) -> int:
        """A device that only prefills (disaggregated): weights, prompt K/V, activations."""
        return self.params + self.prompt_kv + self.prefill_inputs + self.activations

    @property
    def decode_total(self) -> int:
        """A device that only decodes (disaggregated): weights, the KV cache, activations."""
        return self.params + self.kv_cache + self.decode_inputs + self.activations

    @property
    def prefill_step(self) -> int:
        """What one compiled prefill step needs (``memory_analysis()``: arguments + outputs
        + temporaries): the weights, its inputs, the prompt K/V it returns, its activations."""
        return self.params + self.prefill_inputs + self.prompt_kv + self.prefill_activations

    @property
    def decode_step(self) -> int:
        """What one compiled decode step needs: the weights, the cache it updates in place,
        its inputs and its activations."""
        return self.params + self.kv_cache + self.decode_inputs + self.decode_activations

    @property
    def total(self) -> int:
        return self.params + self.kv_cache + self.prompt_kv + self.inputs + self.activations

    def to_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def _local(shape: Sequence[int], spec: Any, config: ParallelConfig) -> int:
    out = 1
    for i, size in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        out *= -(-size // math.prod(config.degree(a) for a in axes))
    return out


@functools.cache
def _param_leaves(config: ModelConfig) -> tuple[tuple[tuple[int, ...], float, tuple], ...]:
    """(shape, bytes per element, logical names) of every parameter of ``config`` (cached
    per form); quantized kernels (``config.quantize``) at their stored size."""
    state = nnx.state(abstract_model(config))
    specs = jax.tree.leaves(
        nnx.get_partition_spec(state), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    values = jax.tree.leaves(state)
    return tuple(
        (tuple(v.shape), element_bytes(v.dtype), tuple(s))
        for v, s in zip(values, specs, strict=True)
    )


def param_bytes(model: ModelConfig, config: ParallelConfig) -> int:
    """Parameter bytes on one device under ``config`` (placed once, the same in both phases)."""
    run = run_form(model, config)
    return int(
        sum(
            _local(shape, param_partition_spec(names, config, dims=run), config) * size
            for shape, size, names in _param_leaves(run)
        )
    )


def _is_names(x: Any) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


@functools.cache
def _cache_leaves(run: Any, batch: int, max_seq_len: int) -> tuple[tuple[tuple, int, tuple], ...]:
    """(shape, bytes per element, logical names) of every array of the decode KV cache
    (cached: the planner asks for the same form and sizes under many strategies)."""
    shapes = jax.tree.leaves(KVCache.abstract(run, batch, max_seq_len))
    names = jax.tree.leaves(KVCache.logical_axes(run), is_leaf=_is_names)
    return tuple(
        (tuple(s.shape), np.dtype(s.dtype).itemsize, n) for s, n in zip(shapes, names, strict=True)
    )


def cache_bytes(model: ModelConfig, config: ParallelConfig, batch: int, max_seq_len: int) -> int:
    """Decode KV cache bytes (K, V and lengths) on one device, in the decode layout."""
    run = run_form(model, config)
    return sum(
        _local(shape, logical_spec(n, Module.ATTENTION, Phase.DECODE, config, dims=run), config)
        * size
        for shape, size, n in _cache_leaves(run, batch, max_seq_len)
    )


def _split(axes: Sequence[str], config: ParallelConfig) -> int:
    return math.prod(config.degree(a) for a in axes)


def input_bytes(
    model: ModelConfig, config: ParallelConfig, phase: Phase, batch: int, t: int
) -> int:
    """Per device: token ids and lengths of a prefill step (``[B, T]``, ``[B]``), the token
    ids ``[B]`` of a decode step (its lengths live in the cache)."""
    split = _split(mesh_axes(Module.ATTENTION, phase, config, dims=model)["batch"], config)
    return INT32 * (batch // split) * (t + 1 if phase is Phase.PREFILL else 1)


def activation_bytes(
    model: ModelConfig,
    config: ParallelConfig,
    phase: Phase,
    batch: int,
    tokens: int,
    context: int,
    *,
    fused_attention: bool = False,
) -> int:
    """Estimate of one step's activation peak on one device.

    Two copies of the residual stream ``[B_l, T_l, D]`` plus the largest intermediate of a
    layer: the gated FFN hidden ``[B_l, T_l, F_l]`` (x2), the attention scores
    ``[B_l, N_l, T_l, S]`` in f32 (not with ``fused_attention``: a fused kernel, splash or
    cuDNN, holds a block of them at a time; not under ring attention, :func:`ring_bytes`,
    which holds a tile of them, its f32 accumulators and two K/V blocks), or the MoE
    exchange blocks: ``P x C`` rows
    sent and as many received, and their expert hidden ``[P x C, F_l]`` (x2), for a
    device's ``n`` tokens and its ``P`` expert peers. A pipelined prefill counts these for
    one microbatch, plus the stage buffers its schedule holds.
    """
    itemsize = np.dtype(model.dtype).itemsize
    att = mesh_axes(Module.ATTENTION, phase, config, dims=model)
    b_l = -(-batch // _split(att["batch"], config))
    t_l = -(-tokens // _split(att["seq"], config))
    stages = 0
    if phase is Phase.PREFILL and config.pp > 1:
        stages = _stage_buffers(model, config, b_l * t_l)
        b_l = -(-b_l // config.microbatches)
    n_l = -(-model.n_heads // _split(att["heads"], config))
    stream = 2 * b_l * t_l * model.d_model * itemsize
    scores = 0 if fused_attention else b_l * n_l * t_l * context * 4
    if ring_prefill(model, config, phase, tokens, context):
        scores = ring_bytes(model, config, b_l, t_l)
    if model.n_experts:
        moe = mesh_axes(Module.MOE, phase, config, dims=model)
        n = -(-batch // _split(moe["batch"], config)) * -(-tokens // _split(moe["seq"], config))
        peers = _split(moe["experts"], config)
        rows = peers * model.expert_capacity(n, peers)
        f_l = -(-model.d_ff // _split(moe["mlp"], config))
        hidden = rows * (2 * model.d_model + 2 * f_l) * itemsize
    else:
        f_l = -(-model.d_ff // _split(mesh_axes(Module.FFN, phase, config)["mlp"], config))
        hidden = 2 * b_l * t_l * f_l * itemsize
    return stages + stream + max(scores, hidden)


def ring_prefill(
    model: ModelConfig, config: ParallelConfig, phase: Phase, tokens: int, context: int
) -> bool:
    """Whether a step runs ring attention (:func:`jaxpar.models.sp_prefill_attention` for
    the run's options: a prefill of ``tokens`` with no cached context before them, under
    sp and no pipeline, not MLA)."""
    if phase is not Phase.PREFILL or config.pp > 1 or context != tokens or model.is_mla:
        return False
    options = ModelRun.of(model).options
    sp = _split(mesh_axes(Module.ATTENTION, phase, config, dims=model)["seq"], config)
    choice = sp_prefill_attention(options.sp_attention, sp, tokens, options.ring_min_tokens)
    return choice == "ring"


def ring_bytes(model: ModelConfig, config: ParallelConfig, b_l: int, t_l: int) -> int:
    """What ring attention holds beside the residual stream, per device and layer: one
    f32 score tile ``[B_l, N_l, Q_TILE, K_TILE]`` (:mod:`jaxpar.models._ring_attention`),
    the f32 output, running max and sum of the local queries ``[B_l, N_l, T_l, H + 2]``,
    and two K/V blocks ``[B_l, T_l, K_l, H]`` (the one attended, the one arriving)."""
    att = mesh_axes(Module.ATTENTION, Phase.PREFILL, config, dims=model)
    n_l = -(-model.n_heads // _split(att["heads"], config))
    kv_l = -(-model.n_kv_heads // _split(att["kv_heads"], config))
    h, itemsize = model.head_dim, np.dtype(model.dtype).itemsize
    tile = b_l * n_l * min(t_l, RING_Q_TILE) * min(t_l // 2, RING_K_TILE) * 4
    accumulators = b_l * n_l * t_l * (h + 2) * 4
    blocks = 2 * 2 * b_l * t_l * kv_l * h * itemsize
    return tile + accumulators + blocks


def _stage_buffers(model: ModelConfig, config: ParallelConfig, tokens: int) -> int:
    """What a pipelined prefill holds beside one microbatch's layer, for a device's
    ``tokens`` (all its microbatches): every stage embeds the whole batch, and with one
    microbatch XLA also keeps two f32 copies of the batch's residual stream across the
    schedule's iterations. Measured compile-only on v5e at Llama-3-70B widths (pp=2,
    tp=8, 16 x 256 tokens, 4 and 8 layers): temporaries of 0.49-0.50 GiB with one
    microbatch, 0.10 with 2 and 0.08 with 8 (0.18 estimated for all before, as
    unpipelined)."""
    embeddings = tokens * model.d_model * np.dtype(model.dtype).itemsize
    if config.microbatches > 1:
        return embeddings
    return embeddings + 2 * tokens * model.d_model * 4


def prefill_kernel(run: ModelRun, platform: str) -> str:
    """The prefill attention ``run``'s options resolve to on ``platform``."""
    if run.prefill_attention != "auto":
        return run.prefill_attention
    return run.options.resolve(run.config, platform, ragged_compiles=True).prefill_attention


def memory(
    model: ModelConfig,
    config: ParallelConfig,
    *,
    batch: int,
    prompt_len: int,
    max_seq_len: int,
    prefill_batch: int | None = None,
    release_windows: bool = False,
    platform: str | None = None,
) -> Memory:
    """Per-device memory of a strategy decoding ``batch`` sequences, prefilling
    ``prefill_batch`` prompts at a time (default: all ``batch`` at once).

    ``release_windows``: served over pages (continuous batching, ``pp == 1``), where a
    sliding-window layer's sequence holds only the pages its window spans
    (:func:`~jaxpar.engine.cache_fraction` of the full cache, in pages of the server's
    default size); otherwise every layer holds ``max_seq_len`` tokens.

    ``platform`` (``"tpu"``, ``"cuda"``, ``"cpu"``): the prefill attention the options
    resolve to there; a fused kernel never holds the whole score matrix. None: counted as
    XLA's (the scores materialised)."""
    run = run_form(model, config)
    rows = batch if prefill_batch is None else prefill_batch
    fraction = 1.0
    if release_windows and config.pp == 1:
        fraction = cache_fraction(model, max_seq_len, KV_PAGE_SIZE)
    # Prefill returns the prompt's K/V in the compute dtype; a quantized cache stores them
    # narrow only at the handoff.
    float_kv = ModelRun.of(model).with_options(kv_cache_dtype=None)
    prompt_kv = cache_bytes(float_kv, config, rows, prompt_len) if prompt_len else 0
    fused = platform is not None and prefill_kernel(run, platform) != "xla"
    prefill_acts = activation_bytes(
        run, config, Phase.PREFILL, rows, prompt_len, prompt_len, fused_attention=fused
    )
    decode_acts = activation_bytes(run, config, Phase.DECODE, batch, 1, max_seq_len)
    return Memory(
        params=param_bytes(model, config),
        kv_cache=math.ceil(cache_bytes(model, config, batch, max_seq_len) * fraction),
        prompt_kv=prompt_kv,
        prefill_inputs=input_bytes(run, config, Phase.PREFILL, rows, prompt_len),
        decode_inputs=input_bytes(run, config, Phase.DECODE, batch, 1),
        activations=max(prefill_acts, decode_acts),
        prefill_activations=prefill_acts,
        decode_activations=decode_acts,
    )
