"""Data movement of a compiled step against an engine's own buffers (shared by
tests/test_data_movement.py on CPU and tests/test_accelerator_compile.py on TPU)."""

from __future__ import annotations

import math
import re

import jax

from jaxpar.engine import AbstractEngine
from jaxpar.inspect._movement import data_movement
from jaxpar.models import KVCache


def shard_buffer(x: jax.ShapeDtypeStruct) -> tuple[int, int]:
    """(element count, bytes) of one device's shard."""
    elements = math.prod(x.sharding.shard_shape(x.shape))
    return elements, elements * x.dtype.itemsize


def moved_fraction(
    compiled, engine: AbstractEngine, batch: int, max_seq_len: int, *, hbm_only: bool = False
) -> float:
    """Bytes per step of copies of a weight or of a layer's cache, over parameter + cache
    bytes per device.

    Buffers are (element count, bytes), and only moves of what the step was given count
    (:mod:`jaxpar.inspect._movement`): an activation of a weight's bytes or element count
    by chance is no copy of it. The cache is decode's, [B, K, S, H] per layer in its layout
    (one layer of it when stacked). ``hbm_only``: leave out moves into a TPU core's VMEM
    (memory space ``S(1)``): XLA:TPU slices a layer's weight into VMEM for the matmul that
    reads it, which reads those bytes once, as the matmul would from HBM.
    """
    cache = KVCache.abstract(engine.run, batch, max_seq_len)
    caches = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        for x, s in zip(
            jax.tree.leaves((cache.k, cache.v)),
            jax.tree.leaves((engine.layouts.cache.k, engine.layouts.cache.v)),
            strict=True,
        )
    ]
    return _fraction(compiled, engine, caches, hbm_only=hbm_only)


def paged_moved_fraction(compiled, engine: AbstractEngine, slots) -> float:
    """:func:`moved_fraction` of a serving step over the paged cache of ``slots`` (a
    ``SlotSteps``): copies of a weight or of a layer's page pool, over parameter + pool
    bytes per device."""
    pool = slots.abstract()
    return _fraction(compiled, engine, jax.tree.leaves((pool.k, pool.v)))


def _fraction(
    compiled, engine: AbstractEngine, caches: list[jax.ShapeDtypeStruct], *, hbm_only=False
) -> float:
    """Copies of a weight or of one layer of ``caches`` (per-layer arrays, or stacked
    ``[L, ...]`` ones), over parameter + cache bytes per device."""
    params = jax.tree.leaves(engine.params)
    # Every matrix, a quantized kernel's scales included: an activation of a buffer's size
    # by chance is no match (data_movement counts only moves of the step's own inputs).
    kernels = [p for p in params if p.ndim >= 2]
    layer_sizes = set(map(shard_buffer, caches))
    if engine.options.layer_loop == "scan":  # one layer of the stacked [L, ...] cache
        layers = engine.model_config.n_layers
        layer_sizes = {(e // layers, b // layers) for e, b in layer_sizes}
    weights = set(map(shard_buffer, kernels))
    moves = data_movement(compiled, weights | layer_sizes)
    if hbm_only:
        moves = [m for m in moves if m.name not in _into_vmem(compiled.as_text())]
    moved = sum(m.total_bytes for m in moves)
    total = sum(shard_buffer(x)[1] for x in (*params, *caches))
    return moved / total


def _into_vmem(hlo: str) -> set[str]:
    """Names of the instructions whose result lies in memory space 1 (a TPU core's VMEM)."""
    found = re.finditer(r"^\s*%([\w.-]+) = [^ ]*\{[^}]*S\(1\)\}", hlo, re.MULTILINE)
    return {m.group(1) for m in found}
