"""The Pallas paged-decode kernels (GPU Triton and TPU, interpret mode on CPU) against the
XLA paged path and a float64 reference, single device and sharded; their selection and
fallbacks; and their lowering for TPU (compile-only v5e) and CUDA.

Pages are handed out in a shuffled order, per batch shard (block tables hold page ids
local to the shard, page 0 is each shard's scratch page), and one row is free (length 1,
table of zeros), as the engine keeps them: a kernel that read a row's pages in the wrong
order, another row's page, another shard's page or the wrong kv head changes the output.

Tolerances: f32 comparisons are 1e-5 (measured: under 1e-6). The TPU kernel converts K and
V to bf16 in VMEM whatever the pool's dtype, so the pools here hold bf16-representable
values: that conversion is then exact and the f32 comparison stays tight for both kernels.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.models import (
    ExecutionOptions,
    ModelRun,
    PagedKVCache,
    init_model,
    interpret_kernels,
    preset,
)
from jaxpar.models import _attention_kernels as kern
from jaxpar.models._paged import PAGE_AXES, TABLE_AXES, PagedLayer
from jaxpar.models._paged_attention import (
    DECODE_Q_AXES,
    PAGED_DECODE_IMPLS,
    paged_attention_impl,
    paged_decode_attention,
    paged_xla,
)
from jaxpar.spec import Dims, ParallelConfig, make_mesh, partition_spec, sharding_context
from jaxpar.spec._constrain import _jax_version
from tests._tiers import sweep

ROOT = Path(__file__).resolve().parent.parent
# Rows, query heads, kv heads, head_dim (the TPU kernel takes multiples of 128), positions
# per page, pages per row: the GPU kernel then runs 4 splits of 2-page compute blocks.
B, N, K, H, Z, PAGES = 4, 4, 2, 128, 8, 8
KERNELS = ("pallas_gpu", "pallas_tpu")
STRATEGIES = {
    "single": (ParallelConfig(), K),
    "tp2": (ParallelConfig(tp=2), K),
    "dp2-tp2": (ParallelConfig(dp=2, tp=2), K),
    # Dims holding 2 kv heads < tp=4 whole (a model that keeps its checkpoint's heads; the
    # engine holds one per device instead, rule kv-head-replicas): the kernels' path for a
    # shard whose one query head reads one of the kv heads it holds.
    "tp4-kv-replicated": (ParallelConfig(tp=4), 2),
}


@dataclasses.dataclass
class Case:
    """One decode step's inputs over a paged pool, and the global page ids of each row."""

    q_BNH: jax.Array
    k_KAZH: jax.Array
    v_KAZH: jax.Array
    tables_BN: jax.Array  # local to each batch shard
    lengths_B: jax.Array
    global_tables_BN: np.ndarray

    @property
    def args(self) -> tuple[jax.Array, ...]:
        return self.q_BNH, self.k_KAZH, self.v_KAZH, self.tables_BN, self.lengths_B


def _dims(n_kv_heads: int = K, head_dim: int = H) -> Dims:
    return Dims(
        vocab_size=32,
        d_model=N * head_dim,
        n_layers=2,
        n_heads=N,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        d_ff=64,
    )


def _case(
    config: ParallelConfig,
    *,
    n_kv_heads: int = K,
    head_dim: int = H,
    page_size: int = Z,
    dtype=jnp.float32,
    pool_dtype=None,
    seed: int = 0,
) -> Case:
    """Shuffled pages per batch shard (the strategies here split the batch over dp only),
    one full row, one free row (length 1 on the scratch page), lengths otherwise random."""
    rng = np.random.default_rng(seed)
    shards, rows = config.dp, B // config.dp
    per_shard = rows * PAGES + 3  # the scratch page, the rows' pages, two never handed out
    tables = np.zeros((B, PAGES), np.int32)
    for s in range(shards):
        ids = rng.permutation(np.arange(1, per_shard))[: rows * PAGES]
        tables[s * rows : (s + 1) * rows] = ids.reshape(rows, PAGES)
    lengths = rng.integers(2, PAGES * page_size, size=B).astype(np.int32)
    lengths[0] = PAGES * page_size
    lengths[-1], tables[-1] = 1, 0
    shard_B = np.arange(B) // rows
    pool_shape = (n_kv_heads, shards * per_shard, page_size, head_dim)

    def pool() -> jax.Array:  # bf16-representable values (see the module docstring)
        x = jnp.asarray(rng.normal(size=pool_shape), jnp.bfloat16)
        return x.astype(pool_dtype or dtype)

    return Case(
        q_BNH=jnp.asarray(rng.normal(size=(B, N, head_dim)), dtype),
        k_KAZH=pool(),
        v_KAZH=pool(),
        tables_BN=jnp.asarray(tables),
        lengths_B=jnp.asarray(lengths),
        global_tables_BN=tables + (shard_B * per_shard)[:, None],
    )


def _reference(case: Case, window: int | None = None) -> np.ndarray:
    """Per row and head, in numpy float64, from the rows' global page ids."""
    q, k, v = (np.asarray(x, np.float64) for x in (case.q_BNH, case.k_KAZH, case.v_KAZH))
    group = q.shape[1] // k.shape[0]
    out = np.zeros_like(q)
    for b, length in enumerate(np.asarray(case.lengths_B)):
        first = 0 if window is None else max(0, length - window)
        pages = case.global_tables_BN[b]
        for n in range(q.shape[1]):
            keys = k[n // group, pages].reshape(-1, q.shape[2])[first:length]
            values = v[n // group, pages].reshape(-1, q.shape[2])[first:length]
            s = keys @ q[b, n] / math.sqrt(q.shape[2])
            p = np.exp(s - s.max())
            out[b, n] = (p / p.sum()) @ values
    return out


def _run(config: ParallelConfig, fn, case: Case, n_kv_heads: int = K, head_dim: int = H):
    """``fn(*case.args)`` jitted in a decode sharding context on ``config``'s mesh; and its
    jaxpr."""
    mesh = make_mesh(config, jax.devices()[: config.size])

    def body(*args):
        with sharding_context(mesh, "decode", config, _dims(n_kv_heads, head_dim)):
            return fn(*args)

    traced = jax.jit(body).trace(*case.args)
    return traced.lower().compile()(*case.args), str(traced.jaxpr)


def _attend(impl: str, window: int | None = None, interpret: bool | None = True):
    def attend(q_BNH, k_KAZH, v_KAZH, tables_BN, lengths_B):
        kv = PagedLayer(k_KAZH, v_KAZH, tables_BN)
        return paged_decode_attention(
            q_BNH, kv, lengths_B=lengths_B, window=window, impl=impl, interpret=interpret
        )

    return attend


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# --- Kernels in interpret mode against XLA and the reference ------------------------------


def _compare(config, impl, *, n_kv_heads=K, dtype=jnp.float32, atol=1e-5):
    case = _case(config, n_kv_heads=n_kv_heads, dtype=dtype)

    def both(*args):
        return _attend(impl)(*args), _attend("xla")(*args)

    (out, ref), jaxpr = _run(config, both, case, n_kv_heads)
    assert jaxpr.count("pallas_call") == 1, "the kernel path fell back to XLA"
    assert ("shard_map" in jaxpr) == (config.size > 1)
    # The kernel's result keeps q's dtype (an f32 result turned the residual stream f32).
    assert out.dtype == ref.dtype == jnp.dtype(dtype), (out.dtype, ref.dtype)
    assert _max_diff(out, ref) < atol
    assert _max_diff(out, _reference(case)) < atol


# The fast tier's strategies: rows and heads split together; kv heads held whole under tp
# (each kernel runs one of them in the fast tier, the other in the full one).
FAST = ("dp2-tp2", "tp4-kv-replicated")


@pytest.mark.jax_compat
@pytest.mark.parametrize(
    ("impl", "name"),
    sweep(
        [(impl, name) for impl in KERNELS for name in STRATEGIES],
        lambda case: case in {("pallas_tpu", FAST[0]), ("pallas_gpu", FAST[1])},
    ),
)
def test_paged_kernel_matches_xla(impl, name):
    config, n_kv_heads = STRATEGIES[name]
    _compare(config, impl, n_kv_heads=n_kv_heads)


@pytest.mark.jax_compat
@pytest.mark.parametrize("impl", sweep(KERNELS, "pallas_tpu".__eq__))
def test_paged_kernel_bf16(impl):
    # bf16 activations round differently in a fused kernel than in XLA's einsums (measured:
    # under 6e-3 for values of order 1).
    _compare(ParallelConfig(dp=2, tp=2), impl, dtype=jnp.bfloat16, atol=2e-2)


@pytest.mark.jax_compat
@pytest.mark.parametrize(
    ("impl", "blocks"),
    sweep(
        [
            ("pallas_gpu", dict(blocks=(8, 1))),  # a split per page: most splits skipped
            ("pallas_gpu", dict(blocks=(1, 8))),  # one split, one block
            ("pallas_tpu", dict(pages_per_block=1)),  # the DMA chain over blocks and rows
            ("pallas_tpu", dict(pages_per_block=2)),
        ],
        lambda case: case[1] in (dict(blocks=(1, 8)), dict(pages_per_block=1)),
    ),
)
def test_paged_kernel_block_sizes(impl, blocks, monkeypatch):
    """The kernels' other tilings of a row's pages than the ones chosen for these shapes
    (splits and compute blocks on GPU, DMA'd compute blocks on TPU), single device. The TPU
    rows are split over two calls, as a batch whose block tables overflow SMEM is."""
    monkeypatch.setattr(kern, "PAGED_TPU_TABLE_ENTRIES", 2 * PAGES)
    case = _case(ParallelConfig())
    body = kern.paged_decode_pallas_gpu if impl == "pallas_gpu" else kern.paged_decode_pallas_tpu
    heads_N = jnp.arange(N, dtype=jnp.int32)

    def attend(*args):
        return body(*args, heads_N, group=N // K, interpret=True, **blocks)

    traced = jax.jit(attend).trace(*case.args)
    calls = len(re.findall(r"name=paged_attention\s", str(traced.jaxpr)))
    assert calls == (2 if impl == "pallas_tpu" else 1)
    out = traced.lower().compile()(*case.args)
    ref = paged_xla(*case.args, heads_N, group=N // K, window=None)
    assert _max_diff(out, ref) < 1e-5


# --- The model's decode over a paged cache, kernels chosen by the config -----------------


def _model_steps(config, *, platform: str | None = None, steps: int = 2):
    """Logits of ``steps`` decode steps of a 2-layer model over a random paged cache (one
    device, inside a sharding context for ``platform``), and the Pallas calls of a step."""
    case = _case(ParallelConfig(), dtype=config.dtype)
    model = init_model(config, seed=1)
    graphdef, state = nnx.split(model)
    cache = PagedKVCache(
        k=(case.k_KAZH, -case.k_KAZH),
        v=(case.v_KAZH, case.v_KAZH),
        block_tables_BN=case.tables_BN,
        lengths_B=jnp.minimum(case.lengths_B, PAGES * Z - steps),
    )
    parallel = ParallelConfig()
    mesh = make_mesh(parallel, jax.devices()[:1])

    @jax.jit
    def step(state, cache, tokens_B):
        with sharding_context(mesh, "decode", parallel, config, platform=platform):
            return nnx.merge(graphdef, state).decode(tokens_B, cache)

    tokens_B, logits = jnp.arange(B, dtype=jnp.int32), []
    # Calls of JAX's jitted kernel function (both are named paged_attention); the jaxpr
    # text prints its body once however often it is called.
    jaxpr = str(step.trace(state, cache, tokens_B).jaxpr)
    kernels = len(re.findall(r"name=paged_attention\s", jaxpr))
    for _ in range(steps):
        out, cache = step(state, cache, tokens_B)
        logits.append(np.asarray(out, np.float32))
        tokens_B = jnp.argmax(out, axis=-1).astype(jnp.int32)
    return np.stack(logits), kernels


@pytest.mark.jax_compat
def test_model_decode_over_pages_with_kernels():
    """The run's ``decode_attention`` reaches the paged kernels, one per layer:
    "pallas_gpu" named (f32), and "auto" for TPU in bf16; each against the same model on
    XLA."""
    base = dataclasses.replace(preset("tiny-gqa"), n_layers=2, head_dim=H, n_heads=N, n_kv_heads=K)
    f32 = dataclasses.replace(base, dtype="float32", param_dtype="float32")
    reference, kernels = _model_steps(ModelRun(f32, ExecutionOptions(decode_attention="xla")))
    assert kernels == 0
    with interpret_kernels():
        got, kernels = _model_steps(ModelRun(f32, ExecutionOptions(decode_attention="pallas_gpu")))
    assert kernels == 2
    np.testing.assert_allclose(got, reference, atol=1e-4, rtol=0)

    bf16 = dataclasses.replace(base, dtype="bfloat16", param_dtype="bfloat16")
    xla = ModelRun(bf16, ExecutionOptions(decode_attention="xla"))
    reference, kernels = _model_steps(xla, platform="tpu")
    assert kernels == 0
    with interpret_kernels():
        got, kernels = _model_steps(bf16, platform="tpu")  # "auto"
    assert kernels == 2
    assert float(np.max(np.abs(got - reference))) < 0.03 * float(np.max(np.abs(reference)))
    np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(reference, -1))


# --- Selection and fallbacks ----------------------------------------------------------------


def test_auto_selection_by_backend_and_dtype():
    assert paged_attention_impl("gpu", jnp.bfloat16) == "pallas_gpu"
    assert paged_attention_impl("cuda", jnp.float16) == "pallas_gpu"
    assert paged_attention_impl("gpu", jnp.float32) == "xla"
    assert paged_attention_impl("tpu", jnp.bfloat16) == "pallas_tpu"
    assert paged_attention_impl("tpu", jnp.float16) == "xla"  # Mosaic takes no f16
    assert paged_attention_impl("tpu", jnp.float32) == "xla"
    assert paged_attention_impl("cpu", jnp.bfloat16) == "xla"


def _traced(impl: str, case: Case, *, platform: str = "cpu", window=None) -> str:
    config = ParallelConfig()
    mesh = make_mesh(config, jax.devices()[:1])

    def attend(*args):
        with sharding_context(mesh, "decode", config, _dims(), platform=platform):
            return _attend(impl, window, interpret=False)(*args)

    return str(jax.make_jaxpr(attend)(*case.args))


@pytest.mark.parametrize(
    ("platform", "impl", "dtype", "kernel"),
    [
        ("cuda", "auto", jnp.bfloat16, True),
        ("cuda", "pallas_gpu", jnp.float32, True),
        ("cuda", "auto", jnp.float32, False),
        ("cuda", "cudnn", jnp.bfloat16, False),  # JAX's cuDNN wrapper takes no page tables
        ("tpu", "auto", jnp.bfloat16, True),
        ("tpu", "auto", jnp.float16, False),
        ("cpu", "auto", jnp.bfloat16, False),
        ("cpu", "xla", jnp.float32, False),
    ],
)
def test_impl_resolves_for_the_platform(platform, impl, dtype, kernel):
    jaxpr = _traced(impl, _case(ParallelConfig(), dtype=dtype), platform=platform)
    assert ("pallas_call" in jaxpr) == kernel


def test_block_choices_and_limits():
    # GPU: power-of-two pages and head_dim (Triton tiles), compute blocks of >= 16 keys.
    assert kern.paged_gpu_blocks(PAGES, Z, H) == (4, 2)
    assert kern.paged_gpu_blocks(16, 16, 128) == (16, 1)
    assert kern.paged_gpu_blocks(4, 4, 64) == (1, 4)
    assert kern.paged_gpu_blocks(64, 16, 128) == (16, 4)
    assert kern.paged_gpu_blocks(3, 4, 128) is None  # 12 keys: no block of 16
    assert kern.paged_gpu_blocks(8, 5, 128) is None
    assert kern.paged_gpu_blocks(8, 8, 96) is None
    assert kern.paged_gpu_blocks(8, 8, 8) is None
    assert [kern.paged_gpu_block_h(g) for g in (1, 16, 17, 48, 128)] == [16, 16, 32, 64, 64]
    # TPU: head_dim on the lanes, bf16 or f32, whole pages per block up to 512 keys.
    assert kern.paged_tpu_block(PAGES, Z, H, jnp.float32) == 8
    assert kern.paged_tpu_block(64, 16, 256, jnp.bfloat16) == 32
    assert kern.paged_tpu_block(6, 128, 128, jnp.bfloat16) == 3
    assert kern.paged_tpu_block(3, 1024, 128, jnp.bfloat16) == 1
    assert kern.paged_tpu_block(8, 16, 64, jnp.bfloat16) is None
    assert kern.paged_tpu_block(8, 16, 128, jnp.float16) is None
    assert kern.paged_tpu_block(kern.PAGED_TPU_TABLE_ENTRIES + 1, 16, 128, jnp.bfloat16) is None


@pytest.mark.parametrize(
    ("impl", "case_kw", "window"),
    [
        ("pallas_gpu", {}, 5),  # sliding window: neither kernel masks one
        ("pallas_tpu", {}, 5),
        ("pallas_gpu", dict(page_size=6), None),  # not a power of two
        ("pallas_tpu", dict(head_dim=64), None),  # not a multiple of 128 lanes
        ("pallas_gpu", dict(pool_dtype=jnp.bfloat16), None),  # a cast would copy the pool
    ],
)
def test_kernels_fall_back_to_xla(impl, case_kw, window):
    case = _case(ParallelConfig(), **case_kw)
    assert "pallas_call" not in _traced(impl, case, window=window)
    out = jax.jit(_attend(impl, window))(*case.args)
    # A bf16 pool: XLA attends in q's dtype after the gather (f32 here, exact).
    assert _max_diff(out, _reference(case, window)) < 1e-5


def test_unknown_impl_names_the_legal_ones():
    assert PAGED_DECODE_IMPLS == ("auto", "xla", "cudnn", "pallas_gpu", "pallas_tpu")
    with pytest.raises(ConfigError, match="auto, xla, cudnn, pallas_gpu, pallas_tpu"):
        _attend("flash")(*_case(ParallelConfig()).args)


# --- Lowering for accelerators --------------------------------------------------------------


@pytest.fixture(scope="module")
def v5e() -> list:
    from jaxpar.inspect import tpu_devices
    from tests._accelerator_cases import bench

    path, _ = bench.libtpu()  # the venv's accel/tpu
    if path is None:
        pytest.fail("no libtpu under <venv>/accel/tpu: run scripts/test.sh, which installs it")
    return tpu_devices("v5e:2x4", library_path=path)


@pytest.mark.jax_compat
@pytest.mark.usefixtures("accelerator_compiles")
@pytest.mark.parametrize("name", ["single", "dp2-tp2", "tp4-kv-replicated"])
@pytest.mark.accel
def test_bf16_paged_decode_compiles_for_tpu_v5e_without_copying_the_pool(v5e, name):
    """ "auto" on a TPU mesh: the Pallas paged kernel, compiled by Mosaic for v5e; no copy
    of the pool (or of one kv head's pages, with kv heads replicated) in the program."""
    from jaxpar.inspect._movement import data_movement

    config, n_kv_heads = STRATEGIES[name]
    mesh = make_mesh(config, v5e[: config.size])
    dims = _dims(n_kv_heads)
    pool_shape = (n_kv_heads, config.dp * (B // config.dp * PAGES + 3), Z, H)

    def arg(shape, dtype, axes):
        spec = partition_spec(axes, "attention", "decode", config, dims=dims)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

    pool = arg(pool_shape, jnp.bfloat16, PAGE_AXES)
    args = (
        arg((B, N, H), jnp.bfloat16, DECODE_Q_AXES),
        pool,
        pool,
        arg((B, PAGES), jnp.int32, TABLE_AXES),
        arg((B,), jnp.int32, ("batch",)),
    )

    def attend(*args):
        with sharding_context(mesh, "decode", config, dims):
            return _attend("auto", interpret=None)(*args)

    compiled = jax.jit(attend).trace(*args).lower().compile()
    text = compiled.as_text()
    calls = [line for line in text.splitlines() if "tpu_custom_call" in line]
    assert len(calls) == 1 and "paged_attention" in calls[0], calls
    local = math.prod(pool.sharding.shard_shape(pool_shape)) * 2  # bytes per device
    assert data_movement(compiled, {local, local // n_kv_heads}) == []


@pytest.mark.jax_compat
@pytest.mark.usefixtures("accelerator_compiles")
@pytest.mark.accel
def test_tpu_block_tables_beyond_smem_are_split_over_calls(v5e):
    """256 rows of 1024 pages: a 1 MiB table overflows SMEM in one call (measured), so the
    rows go in two calls that each compile for v5e."""
    rows, pages = 256, 1024
    sharding = jax.sharding.SingleDeviceSharding(v5e[0])

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    pool = arg((K, 64, 16, H), jnp.bfloat16)
    args = (arg((rows, N, H), jnp.bfloat16), pool, pool, arg((rows, pages), jnp.int32))
    args += (arg((rows,), jnp.int32),)
    compiled = jax.jit(_attend("pallas_tpu", interpret=False)).trace(*args).lower().compile()
    calls = [line for line in compiled.as_text().splitlines() if "tpu_custom_call" in line]
    assert len(calls) == 2 and all("paged_attention" in c for c in calls), calls


@pytest.mark.jax_compat
@pytest.mark.accel
def test_bf16_paged_decode_lowers_for_cuda_with_the_triton_kernel():
    """ "auto" for cuda, lowered in a subprocess with the CUDA plugin (see
    tests/_cuda_lowering.py): one Pallas Triton call per shard's program, partitioning
    passes, and XLA:CPU stops at the GPU custom call."""
    plugin = Path(sys.prefix) / "accel" / "cuda"
    if not (plugin / "jax_plugins").is_dir():
        pytest.fail(f"no CUDA plugin under {plugin}: run scripts/test.sh, which installs it")
    env = dict(os.environ, PYTHONPATH=f"{plugin}{os.pathsep}{ROOT}")
    proc = subprocess.run(
        [sys.executable, "-m", "tests._cuda_lowering", "paged"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    assert set(results) == {"", "tp=2", "dp=2,tp=2", "tp=4"}
    for strategy, result in results.items():
        if _jax_version() >= (0, 12):
            # JAX 0.12 asks the GPU for its kind while lowering a Pallas Triton kernel: with
            # none attached, it cannot be lowered here (it can on 0.10).
            assert "No supported GPU devices found" in result["lower_error"], result
            continue
        assert result["lower_error"] is None, (strategy, result["lower_error"])
        assert result["calls"]["triton"] == 1 and result["calls"]["cudnn"] == 0, result
        assert "custom_partitioner" not in result["compile_error"], result["compile_error"]
        assert result["stopped_at_gpu_call"], result["compile_error"]
