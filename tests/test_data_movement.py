"""No step copies a weight or a layer's cache (the accelerator-speed criterion, read on CPU).

On a GPU a ``lax.scan`` over stacked weights copied every layer's weights out of the stack
before each matmul (38% of a decode step), and a cache stored against the attention's read
order was transposed twice per step. Both show in the compiled HLO on any backend: these
tests compile prefill and decode on CPU and count the bytes of pure data movement (copy,
transpose, slice, dynamic-slice, and fusions made only of them, casts allowed) whose size,
or whose whole operand's, is that of a weight shard or of one layer's decode cache shard
(K or V, ``[B, K, S, H]`` per device), against the parameter + cache bytes per device. A
few strategies also run in bfloat16, where a copy can carry a cast (bf16 in, f32 out).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from jaxpar import ParallelConfig
from jaxpar.engine import AbstractEngine, PagePool, SlotSteps
from jaxpar.inspect._movement import data_movement
from jaxpar.inspect._report import compile_step
from jaxpar.models import ExecutionOptions, ModelRun, preset
from jaxpar.spec import make_mesh
from tests._movement import moved_fraction, paged_moved_fraction
from tests._prompts import MAX_BATCH, MAX_SEQ_LEN
from tests._tiers import sweep

BUDGET = 0.05  # of parameter + cache bytes per device
PROMPT_LEN = 24  # 8 x 24 rows: no activation of the prompt has a weight's size by chance
# 4 layers, 8 query heads over 2 kv heads: under tp=2 each device holds one kv head, and
# at batch 1 one row -- the size-1 cache dims that once made XLA copy the cache.
CONFIG = preset("tiny-gqa")
# One row (XLA:CPU's "rows" form of the quantized matmuls): XLA:CPU splits some reductions
# with few outputs into a reduce-window over their materialised product (seen for 32
# outputs of 64 values, not for 64 outputs or for 128 values: tiny-gqa's fused K/V kernel
# has 2 x 2 x 8 outputs of 64), which would count as a dequantized kernel; a real kernel has
# thousands of outputs per device. Head dim 32 keeps every kernel at 64 outputs or more
# per device under tp=2.
WIDE_HEADS = dataclasses.replace(CONFIG, head_dim=32)


@functools.cache
def _engine(
    layer_loop: str,
    parallel: ParallelConfig,
    batch: int,
    dtype: str = "float32",
    quantize: str | None = None,
    model=CONFIG,
) -> AbstractEngine:
    """Only shapes and shardings are read: the engine's layouts and steps, nothing placed
    (the compiled programs are a real engine's, parameters aside)."""
    config = ModelRun(
        dataclasses.replace(model, dtype=dtype, param_dtype=dtype),
        ExecutionOptions(layer_loop=layer_loop, quantize=quantize),
    )
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.size])
    return AbstractEngine.build(
        config, parallel, max_batch=batch, max_seq_len=MAX_SEQ_LEN, mesh=mesh
    )


def _moved_fraction(
    layer_loop: str,
    parallel: ParallelConfig,
    phase: str,
    batch: int = MAX_BATCH,
    dtype: str = "float32",
    quantize: str | None = None,
    model=CONFIG,
) -> float:
    eng = _engine(layer_loop, parallel, batch, dtype, quantize, model)
    compiled = compile_step(eng, phase, prompt_len=PROMPT_LEN)
    return moved_fraction(compiled, eng, batch, MAX_SEQ_LEN)


STRATEGIES = [
    (ParallelConfig(), MAX_BATCH),
    (ParallelConfig(), 1),  # one row: the latency case
    (ParallelConfig(tp=2), MAX_BATCH),  # one kv head per device
    (ParallelConfig(dp=2, tp=2), MAX_BATCH),
]


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize(
    ("parallel", "batch"),
    sweep(STRATEGIES, lambda case: case == (ParallelConfig(dp=2, tp=2), MAX_BATCH)),
    ids=lambda x: str(x),
)
def test_unrolled_steps_copy_no_weight_or_layer_cache(parallel, batch, phase):
    fraction = _moved_fraction("unrolled", parallel, phase, batch)
    assert fraction <= BUDGET, f"{fraction:.1%} of parameter + cache bytes moved per step"


# bf16 weights and cache: a cast fused into a copy (a bf16 cache transposed into f32)
# writes other bytes than the buffer's and must still count. A few strategies only.
BF16_CASES = [
    (ParallelConfig(), "decode"),
    (ParallelConfig(), "prefill"),
    (ParallelConfig(tp=2), "decode"),  # one kv head per device
]


# The fast tier's bf16 check is the paged step's (below).
@pytest.mark.parametrize(
    ("parallel", "phase"), sweep(BF16_CASES, lambda case: False), ids=lambda x: str(x)
)
def test_bf16_unrolled_steps_copy_no_weight_or_layer_cache(parallel, phase):
    fraction = _moved_fraction("unrolled", parallel, phase, MAX_BATCH, "bfloat16")
    assert fraction <= BUDGET, f"{fraction:.1%} of parameter + cache bytes moved per step"


# Quantized weights (int8/fp8 per output channel, int4 per group; bf16 compute): decode
# reads the quantized kernels, dequantized only as the dot's operand with the scales
# applied to its output (MAX_BATCH rows), or as the operand of row reductions over the
# out-major kernel (one row: XLA:CPU's "rows" form). A dequantized weight (cast and
# scaled) would count as a copy, as would a kernel re-laid for either form.
QUANTIZED_CASES = [
    (parallel, batch, quantize)
    for parallel in (ParallelConfig(), ParallelConfig(tp=2))
    for batch in (MAX_BATCH, 1)
    for quantize in ("int8", "fp8", "int4")
]
# The fast tier's point: int8 over tp, MAX_BATCH rows (the other formats, the one-row form
# and one device are the full tier's).
FAST_QUANTIZED = {(ParallelConfig(tp=2), MAX_BATCH, "int8")}


@pytest.mark.parametrize(
    ("parallel", "batch", "quantize"),
    sweep(QUANTIZED_CASES, FAST_QUANTIZED.__contains__),
    ids=lambda x: str(x),
)
def test_quantized_decode_copies_no_weight_or_layer_cache(parallel, batch, quantize):
    model = WIDE_HEADS if batch == 1 else CONFIG
    fraction = _moved_fraction("unrolled", parallel, "decode", batch, "bfloat16", quantize, model)
    assert fraction <= BUDGET, f"{fraction:.1%} of quantized parameter + cache bytes moved"


def test_a_dequantized_weight_is_counted():
    """Scaling the weight before the matmul writes a dequantized copy of it every step
    (counted); scaling the matmul's output reads the int8 bytes (nothing counted on CPU,
    where the cast alone is XLA:CPU widening the dot's operand)."""
    w = jax.ShapeDtypeStruct((256, 128), jnp.int8)
    scale = jax.ShapeDtypeStruct((1, 128), jnp.float32)
    x = jax.ShapeDtypeStruct((4, 256), jnp.float32)
    before = jax.jit(lambda w, s, x: x @ (w.astype(jnp.float32) * s)).lower(w, scale, x)
    after = jax.jit(lambda w, s, x: (x @ w.astype(jnp.float32)) * s).lower(w, scale, x)
    weight = (w.size, w.size)  # (elements, bytes) of the int8 weight
    moved = data_movement(before.compile(), [weight])
    assert [m.nbytes for m in moved] == [4 * w.size], before.compile().as_text()
    assert data_movement(after.compile(), [weight]) == []


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
def test_a_dequantized_cache_is_counted_for_int8_and_fp8(dtype):
    """A decode-like step that writes its token into the quantized cache, then dequantizes
    the whole cache (``values * scale``) before attending: a dequantized copy per step.
    XLA:CPU updates an fp8 cache in f16 (fp8 -> f16 -> update -> fp8) and the dequantize
    reads that f16 buffer, whose bytes are not the stored cache's: it used to pass for fp8
    (only the fp8 copy, 16 KB, counted) while int8 counted. Both count the dequantize.

    The same experiment on the engine (tests/test_kv_quant.py's bf16 tiny-gqa, cache
    length 40, ``split_scale`` patched to return ``dequantize_kv(k)``): under tp=2, 40.2% of
    parameter + cache bytes moved per step for int8 and for fp8; on one device 0% for both,
    where XLA:CPU fuses the scale multiply into the attention's products and no
    dequantized cache is written (nothing to count)."""
    cache = jax.ShapeDtypeStruct((8, 2, 64, 16), dtype)  # [B, K, S, H]
    scale = jax.ShapeDtypeStruct((8, 2, 64, 1), jnp.float32)
    q = jax.ShapeDtypeStruct((8, 2, 16), jnp.float32)
    new = jax.ShapeDtypeStruct((8, 2, 16), dtype)
    pos = jax.ShapeDtypeStruct((), jnp.int32)

    def step(c, s, q, n, p):
        c = c.at[:, :, p].set(n)
        dequantized = (c.astype(jnp.float32) * s).astype(jnp.bfloat16)
        return c, jnp.einsum("BKH,BKSH->BKS", q, dequantized.astype(jnp.float32))

    compiled = jax.jit(step, donate_argnums=0).lower(cache, scale, q, new, pos).compile()
    stored = (cache.size, cache.size * jnp.dtype(dtype).itemsize)
    f32_bytes = 4 * cache.size
    assert f32_bytes in [m.nbytes for m in data_movement(compiled, [stored])], compiled.as_text()


_SCALES_HLO = """HloModule scales, entry_computation_layout={(f32[8,1,64,1]{3,2,1,0})->()}

ENTRY %main (scales: f32[8,1,64,1], x: f32[8,32], w: f32[32,64]) -> () {
  %scales = f32[8,1,64,1]{3,2,1,0} parameter(0)
  %x = f32[8,32]{1,0} parameter(1)
  %w = f32[32,64]{1,0} parameter(2)
  %act = f32[8,64]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %act_t = f32[8,64]{0,1} copy(%act)
  %flat = f32[8,64]{1,0} bitcast(%scales)
  %scales_t = f32[8,64]{0,1} copy(%flat)
  ROOT %out = () tuple()
}
"""


def test_a_copied_activation_of_a_buffers_size_is_not_counted():
    """Classified by what is moved, not by its size: a computed activation ``[8, 64]`` f32
    has the element count and bytes of a tp=2 shard of the KV scales ``[8, 1, 64, 1]``
    (tests/test_kv_quant.py's decode step at cache length 64); its relayout is not
    counted, the same relayout of the given scales is."""
    found = [m.name for m in data_movement(_SCALES_HLO, [(512, 2048)])]
    assert found == ["scales_t"]


def test_the_check_sees_the_scan_copies():
    """The stacked scan form (kept for compile time) slices each layer's weights and cache
    out of the stack every step: the same measurement must see it over the budget."""
    fraction = _moved_fraction("scan", ParallelConfig(tp=2), "decode")
    assert fraction > 2 * BUDGET, fraction  # 21% on this model (tp=2), measured


# One of each kind of op the checker must tell apart, on a bf16 cache [2, 4, 8, 16] and a
# bf16 weight [64, 16] (2048 bytes each).
_HLO = """HloModule movement_kinds, entry_computation_layout={(bf16[2,4,8,16]{3,2,1,0})->()}

%cast_transpose_body (p.0: bf16[2,4,8,16]) -> f32[2,8,4,16] {
  %p.0 = bf16[2,4,8,16]{3,2,1,0} parameter(0)
  %t.0 = bf16[2,8,4,16]{3,2,1,0} transpose(%p.0), dimensions={0,2,1,3}
  ROOT %c.0 = f32[2,8,4,16]{3,2,1,0} convert(%t.0)
}

%cast_body (p.1: bf16[64,16]) -> f32[64,16] {
  %p.1 = bf16[64,16]{1,0} parameter(0)
  ROOT %c.1 = f32[64,16]{1,0} convert(%p.1)
}

%scaled_body (p.2: bf16[2,4,8,16]) -> f32[2,8,4,16] {
  %p.2 = bf16[2,4,8,16]{3,2,1,0} parameter(0)
  %t.2 = bf16[2,8,4,16]{3,2,1,0} transpose(%p.2), dimensions={0,2,1,3}
  %c.2 = f32[2,8,4,16]{3,2,1,0} convert(%t.2)
  %two = f32[] constant(2)
  %b.2 = f32[2,8,4,16]{3,2,1,0} broadcast(%two), dimensions={}
  ROOT %m.2 = f32[2,8,4,16]{3,2,1,0} multiply(%c.2, %b.2)
}

ENTRY %main (cache: bf16[2,4,8,16], weight: bf16[64,16], i: s32[]) -> () {
  %cache = bf16[2,4,8,16]{3,2,1,0} parameter(0)
  %weight = bf16[64,16]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %cast_transpose = f32[2,8,4,16]{3,2,1,0} fusion(%cache), kind=kLoop, calls=%cast_transpose_body
  %transpose = bf16[2,8,4,16]{3,2,1,0} transpose(%cache), dimensions={0,2,1,3}
  %cast = f32[64,16]{1,0} fusion(%weight), kind=kLoop, calls=%cast_body
  %scaled = f32[2,8,4,16]{3,2,1,0} fusion(%cache), kind=kLoop, calls=%scaled_body
  %row = bf16[1,16]{1,0} dynamic-slice(%weight, %i, %i), dynamic_slice_sizes={1,16}
  ROOT %out = () tuple()
}
"""


def test_a_cast_fused_into_a_move_counts_at_its_operands_size():
    """A bf16 buffer transposed into f32 counts (its output is 4096 bytes, not the 2048 of
    the buffer); a plain transpose still counts; a cast alone (XLA:CPU widening a matmul
    operand), a move fused with arithmetic and a row sliced from a weight do not."""
    found = {m.name: m for m in data_movement(_HLO, [2048])}
    assert sorted(found) == ["cast_transpose", "transpose"]
    assert (found["cast_transpose"].nbytes, found["transpose"].nbytes) == (4096, 2048)
    # At 4096 bytes: the f32 output counts, the cast alone (f32[64, 16]) still does not.
    assert [m.name for m in data_movement(_HLO, [4096])] == ["cast_transpose"]


def test_buffers_with_element_counts_leave_same_sized_activations_out():
    """Given as (elements, bytes), a buffer counts only moves of as many elements: the
    cache (1024 bf16 elements, 2048 bytes) and its f32 transpose count; a copy of 512 f32
    activations, 2048 bytes by chance, does not (it did, given bytes alone)."""
    hlo = _HLO.replace(
        "  %cache = bf16[2,4,8,16]{3,2,1,0} parameter(0)\n",
        "  %cache = bf16[2,4,8,16]{3,2,1,0} parameter(0)\n"
        "  %act = f32[8,64]{1,0} parameter(3)\n"
        "  %act_copy = f32[8,64]{0,1} copy(%act)\n",
    )
    assert "act_copy" in {m.name for m in data_movement(hlo, [2048])}
    found = sorted(m.name for m in data_movement(hlo, [(1024, 2048)]))
    assert found == ["cast_transpose", "transpose"]


def test_a_compiled_cast_transpose_of_a_bf16_cache_is_counted():
    cache = jax.ShapeDtypeStruct((4, 2, 64, 8), jnp.bfloat16)  # [B, K, S, H]
    compiled = jax.jit(lambda x: x.astype(jnp.float32).transpose(0, 2, 1, 3)).lower(cache).compile()
    bf16_bytes = cache.size * 2
    moved = data_movement(compiled, [bf16_bytes])
    assert [m.nbytes for m in moved] == [2 * bf16_bytes], compiled.as_text()


# --- the serving step over the paged cache --------------------------------------------------

# Six rows, not eight: the per-row sampler's random bits for 8 rows, u32 [8, 256], have
# the element count and bytes of a tp-less K/V kernel (2048 f32), and its threefry loop
# copies them: an activation that would count as a weight copy by size alone.
PAGED_ROWS = 6
PAGED_CASES = [
    (ParallelConfig(), PAGED_ROWS, "float32"),
    (ParallelConfig(), 1, "float32"),
    (ParallelConfig(tp=2), PAGED_ROWS, "float32"),
    (ParallelConfig(dp=2, tp=2), PAGED_ROWS, "float32"),
    (ParallelConfig(tp=4), PAGED_ROWS, "float32"),  # 2 kv heads, each on its 2 devices
    (ParallelConfig(dp=2, tp=2), PAGED_ROWS, "bfloat16"),
]


@pytest.mark.parametrize(
    ("parallel", "batch", "dtype"),
    # The fast tier's point: dp and tp with a bf16 pool (a cast fused into a move counts).
    sweep(PAGED_CASES, lambda case: case == (ParallelConfig(dp=2, tp=2), PAGED_ROWS, "bfloat16")),
    ids=lambda x: str(x),
)
def test_paged_serving_step_copies_no_weight_or_page_pool(parallel, batch, dtype):
    """The step writes each row's token into its page in place and gathers only the
    rows' pages: no copy of the pool (or of a weight) per step."""
    eng = _engine("unrolled", parallel, batch, dtype)
    pool = PagePool(
        page_size=8, pages_per_shard=33, shards=parallel.dp, rows=batch, max_seq_len=MAX_SEQ_LEN
    )
    slots = SlotSteps(eng.steps, eng.run, pool)
    width = pool.pages_per_row
    compiled = slots.compile_step(eng.params, width)
    fraction = paged_moved_fraction(compiled, eng, slots)
    assert fraction <= BUDGET, f"{fraction:.1%} of parameter + pool bytes moved per step"
