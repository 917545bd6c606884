"""Prefill over cached context (chunks of a chunked prefill, prefix hits) on its kernel
paths: the TPU ragged paged-attention path against the XLA path, single device and sharded;
the model's chunked prefill over pages with it; the selection by platform and dtype; and
the compile for TPU v5e of a 512-token chunk after 32k cached tokens of Llama-3-8B.

JAX's TPU interpreter cannot run the ragged kernel (it reshapes a VMEM ref, which the
interpreter of jax 0.10 and 0.12 does not model), so interpret mode runs the kernel's
contract in XLA over the very pages, lengths and offsets the kernel is handed
(``_ragged_reference``): these CPU tests check that layout; the kernel itself is checked
by compiling it for TPU.

Rows start at different context lengths (one at 0), the buffer's page size (16 here) does
not divide context plus chunk, and one strategy holds kv heads replicated over tp.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.errors import ConfigError
from jaxpar.models import (
    ExecutionOptions,
    ModelRun,
    init_model,
    interpret_kernels,
    preset,
    read_pages,
    write_prompts,
)
from jaxpar.models import _attention_kernels as kern
from jaxpar.models._attention_ops import context_prefill_attention
from jaxpar.models._context_attention import context_attention_impl, prefill_over_context
from jaxpar.spec import Dims, ParallelConfig, make_mesh, sharding_context

# Rows, new tokens, cached positions, query heads, kv heads, head_dim (TPU: multiples of 128).
B, T, C, N, K, H = 4, 12, 40, 4, 2, 128
PAGE = 16  # the kernel buffer's page size here: (C + T) = 52 is no multiple of it
START = (0, 13, 37, 40)
LENGTHS = (12, 5, 9, 1)
STRATEGIES = {
    "single": (ParallelConfig(), K),
    "dp2-tp2": (ParallelConfig(dp=2, tp=2), K),
    "sp2": (ParallelConfig(sp=2), K),
    "tp4-kv-replicated": (ParallelConfig(tp=4), K),  # 2 kv heads held whole by 4 shards
}


@pytest.fixture
def pages(monkeypatch):
    monkeypatch.setattr(kern, "RAGGED_PAGE_SIZE", PAGE)
    monkeypatch.setattr(kern, "RAGGED_BLOCK_KEYS", 2 * PAGE)


def _dims(n_kv_heads: int = K) -> Dims:
    return Dims(
        vocab_size=32,
        d_model=N * H,
        n_layers=2,
        n_heads=N,
        n_kv_heads=n_kv_heads,
        head_dim=H,
        d_ff=64,
    )


def _inputs(seed: int = 0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)

    def x(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    return (x(B, T, N, H), x(B, T, K, H), x(B, T, K, H), x(B, C, K, H), x(B, C, K, H))


def _attend(impl, *, window=None, softcap=None, scale=None):
    def attend(q, k, v, k_ctx, v_ctx):
        return prefill_over_context(
            q,
            k,
            v,
            k_ctx,
            v_ctx,
            start_B=jnp.asarray(START, jnp.int32),
            lengths_B=jnp.asarray(LENGTHS, jnp.int32),
            window=window,
            impl=impl,
            interpret=True,
            scale=scale,
            softcap=softcap,
        )

    return attend


def _real_rows(out_BTNH) -> np.ndarray:
    valid = np.arange(T)[None, :] < np.asarray(LENGTHS)[:, None]
    return np.where(valid[:, :, None, None], np.asarray(out_BTNH, np.float64), 0.0)


def _counting(monkeypatch) -> list:
    calls = []
    body = kern.context_prefill_ragged_tpu

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return body(*args, **kwargs)

    monkeypatch.setattr(kern, "context_prefill_ragged_tpu", counted)
    return calls


@pytest.mark.jax_compat
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_ragged_context_matches_xla(name, pages, monkeypatch):
    config, n_kv_heads = STRATEGIES[name]
    calls = _counting(monkeypatch)
    mesh = make_mesh(config, jax.devices()[: config.size])

    def both(*args):
        with sharding_context(mesh, "prefill", config, _dims(n_kv_heads)):
            return _attend("pallas_tpu")(*args), _attend("xla")(*args)

    out, ref = jax.jit(both)(*_inputs())
    assert len(calls) == 1, "the kernel path fell back to XLA"
    # Each shard's queries: a quarter of the heads under tp4, half the rows under dp2, half
    # the new tokens under sp2.
    assert calls[0][1] == T // config.sp and calls[0][2] == N // config.tp, calls
    assert out.dtype == ref.dtype == jnp.float32
    assert np.max(np.abs(_real_rows(out) - _real_rows(ref))) < 1e-5
    padding = np.arange(T)[None, :] >= np.asarray(LENGTHS)[:, None]
    assert np.all(np.asarray(out)[padding] == 0)  # padding queries: zeros, never NaN


@pytest.mark.jax_compat
@pytest.mark.parametrize(
    "options", [dict(window=7), dict(softcap=30.0, scale=0.1), dict(window=20, scale=0.05)]
)
def test_ragged_context_window_softcap_scale(options, pages, monkeypatch):
    """The kernel's own window, soft cap and score scale against XLA's, single device."""
    calls = _counting(monkeypatch)
    args = _inputs(seed=1)
    out = jax.jit(_attend("pallas_tpu", **options))(*args)
    ref = jax.jit(_attend("xla", **options))(*args)
    assert len(calls) == 1
    assert np.max(np.abs(_real_rows(out) - _real_rows(ref))) < 1e-5


def test_selection_by_platform_dtype_and_features():
    mesh = make_mesh(ParallelConfig(), jax.devices()[:1])
    bf16, f32 = jnp.bfloat16, jnp.float32

    def auto(platform, dtype, **kw):
        with sharding_context(mesh, "prefill", ParallelConfig(), _dims(), platform=platform):
            return context_attention_impl("auto", dtype, **kw)

    assert auto("tpu", bf16) == "pallas_tpu"
    assert auto("tpu", bf16, softcap=30.0) == "pallas_tpu"  # the kernel caps scores itself
    assert auto("tpu", bf16, sinks=jnp.zeros(N)) == "xla"
    assert auto("gpu", bf16) == "cudnn"
    assert auto("gpu", bf16, softcap=30.0) == "xla"
    assert auto("tpu", f32) == auto("gpu", f32) == auto("cpu", bf16) == "xla"
    assert context_attention_impl("cudnn", f32) == "xla"
    with pytest.raises(ConfigError, match="auto, xla, cudnn, pallas_tpu"):
        context_attention_impl("flash", bf16)


def test_kernel_falls_back_where_it_cannot_run(monkeypatch):
    """head_dim 64 (the TPU kernel takes lanes of 128) and a traced window run XLA."""
    calls = _counting(monkeypatch)
    rng = np.random.default_rng(2)
    q, k, v, kc, vc = (
        jnp.asarray(rng.normal(size=s), jnp.float32)
        for s in [(B, T, N, 64), (B, T, K, 64), (B, T, K, 64), (B, C, K, 64), (B, C, K, 64)]
    )
    _attend("pallas_tpu")(q, k, v, kc, vc)
    jax.jit(lambda w, *a: _attend("pallas_tpu", window=w)(*a))(jnp.int32(8), *_inputs())
    assert calls == []


# --- The model's chunked prefill over pages -------------------------------------------------


def _chunked_logits(config, tokens_BT, split: int):
    """Logits of the second chunk of ``tokens_BT`` (all positions), the first chunk's K/V
    written to a paged pool on shuffled pages and read back as the context, as the engine
    does; and the number of kernel-path calls traced."""
    model = init_model(config, seed=3)
    return jax.jit(lambda tokens: _chunked(model, config, tokens, split))(tokens_BT)


def _chunked(model, config, tokens_BT, split: int):
    b, t = tokens_BT.shape
    first = jnp.full((b,), split, jnp.int32)
    _, k, v = model.prefill(tokens_BT[:, :split], first, all_logits=True)
    z, n_pages = 8, -(-split // 8)
    pool_k = tuple(jnp.zeros((K, 1 + b * n_pages, z, H), config.dtype) for _ in k)
    pool_v = tuple(jnp.zeros_like(p) for p in pool_k)
    ids_PN = jnp.asarray(np.random.default_rng(4).permutation(b * n_pages) + 1)
    ids_PN = ids_PN.reshape(b, n_pages).astype(jnp.int32)
    ctx_k = read_pages(write_prompts(pool_k, k, ids_PN), ids_PN)
    ctx_v = read_pages(write_prompts(pool_v, v, ids_PN), ids_PN)
    rest = jnp.full((b,), t - split, jnp.int32)
    logits, _, _ = model.prefill(
        tokens_BT[:, split:], rest, all_logits=True, context=(ctx_k, ctx_v, first)
    )
    whole, _, _ = model.prefill(tokens_BT, jnp.full((b,), t, jnp.int32), all_logits=True)
    return logits, whole[:, split:]


@pytest.mark.jax_compat
def test_model_chunked_prefill_over_pages_with_kernel(pages, monkeypatch):
    """A 2-layer model (f32): a 20-token chunk after 13 cached tokens read back from pages,
    through the kernel path (one call per layer) equals the XLA path and the whole
    prompt's prefill at those positions."""
    base = dataclasses.replace(preset("tiny-gqa"), n_layers=2, head_dim=H, n_heads=N, n_kv_heads=K)
    f32 = dataclasses.replace(base, dtype="float32", param_dtype="float32")
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, f32.vocab_size, (2, 33)), jnp.int32)
    calls = _counting(monkeypatch)
    xla, whole = _chunked_logits(
        ModelRun(f32, ExecutionOptions(prefill_attention="xla")), tokens, 13
    )
    assert calls == []
    with interpret_kernels():
        got, _ = _chunked_logits(
            ModelRun(f32, ExecutionOptions(prefill_attention="pallas_tpu")), tokens, 13
        )
    assert len(calls) == f32.n_layers
    assert np.max(np.abs(np.asarray(got) - np.asarray(xla))) < 1e-4
    assert np.max(np.abs(np.asarray(got) - np.asarray(whole))) < 1e-4


# --- Compile-only TPU v5e: a 512-token chunk after 32k cached tokens of Llama-3-8B -----------


@pytest.fixture(scope="module")
def v5e() -> list:
    from jaxpar.inspect import tpu_devices
    from tests._accelerator_cases import bench

    path, _ = bench.libtpu()
    if path is None:
        pytest.fail("no libtpu under <venv>/accel/tpu: run scripts/test.sh, which installs it")
    return tpu_devices("v5e:2x4", library_path=path)


@pytest.mark.jax_compat
@pytest.mark.usefixtures("accelerator_compiles")
@pytest.mark.accel
def test_chunk_after_32k_context_compiles_for_v5e_under_1_gib(v5e):
    """One attention layer of Llama-3-8B (32 heads, 8 kv heads, bf16) on one v5e chip, in
    a sharding context whose platform is the TPU's: "auto" picks the ragged kernel, one
    Mosaic call, with temporaries under 1 GiB (the XLA path's f32 scores alone are 2 GiB)."""
    n, k, h, t, c = 32, 8, 128, 512, 32768
    config = ParallelConfig()
    mesh = make_mesh(config, v5e[:1])
    dims = Dims(
        vocab_size=128, d_model=n * h, n_layers=1, n_heads=n, n_kv_heads=k, head_dim=h, d_ff=128
    )
    sharding = jax.sharding.SingleDeviceSharding(v5e[0])

    def arg(*shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    args = (arg(1, t, n, h), arg(1, t, k, h), arg(1, t, k, h), arg(1, c, k, h), arg(1, c, k, h))
    args += (arg(1, dtype=jnp.int32), arg(1, dtype=jnp.int32))

    def attend(q, k_new, v_new, k_ctx, v_ctx, start, lengths):
        with sharding_context(mesh, "prefill", config, dims, platform="tpu"):
            return prefill_over_context(
                q, k_new, v_new, k_ctx, v_ctx, start_B=start, lengths_B=lengths, window=None
            )

    compiled = jax.jit(attend).trace(*args).lower().compile()
    calls = [line for line in compiled.as_text().splitlines() if "tpu_custom_call" in line]
    assert len(calls) == 1 and "ragged_paged_attention" in calls[0], calls
    # The XLA path's f32 scores alone are 32 * 512 * 33280 * 4 bytes, 2.03 GiB (its
    # compile, 15 s, is left to ``python -m tests._context_memory``, which prints both).
    assert compiled.memory_analysis().temp_size_in_bytes < 2**30


def test_xla_reference_is_unchanged_by_the_wrapper():
    """impl="xla" is exactly the XLA path (bit for bit)."""
    args = _inputs(seed=6)
    start, lengths = jnp.asarray(START, jnp.int32), jnp.asarray(LENGTHS, jnp.int32)
    ref = context_prefill_attention(*args, start_B=start, lengths_B=lengths, window=None)
    got = _attend("xla")(*args)
    assert np.array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.jax_compat
@pytest.mark.usefixtures("accelerator_compiles")
@pytest.mark.parametrize(
    ("strategy", "n_kv_heads"), [(ParallelConfig(tp=8), 4), (ParallelConfig(sp=2, tp=4), 8)]
)
@pytest.mark.accel
def test_chunk_over_context_compiles_sharded_for_v5e(v5e, strategy, n_kv_heads):
    """Sharded on a v5e:2x4 mesh: 4 kv heads held whole by 8 tp shards (each slices out its
    one), and queries split over sp with heads over tp: one Mosaic call per program."""
    from jaxpar.models._attention_ops import KV_SCORE_AXES, Q_AXES
    from jaxpar.spec import partition_spec

    n, h, t, c = 32, 128, 512, 8192
    mesh = make_mesh(strategy, v5e[: strategy.size])
    dims = Dims(
        vocab_size=128,
        d_model=n * h,
        n_layers=1,
        n_heads=n,
        n_kv_heads=n_kv_heads,
        head_dim=h,
        d_ff=128,
    )

    def arg(shape, axes, dtype=jnp.bfloat16):
        spec = partition_spec(axes, "attention", "prefill", strategy, dims=dims)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

    kv_new, kv_ctx = (
        arg((1, t, n_kv_heads, h), KV_SCORE_AXES),
        arg((1, c, n_kv_heads, h), KV_SCORE_AXES),
    )
    rows = arg((1,), ("batch",), jnp.int32)
    args = (arg((1, t, n, h), Q_AXES), kv_new, kv_new, kv_ctx, kv_ctx, rows, rows)

    def attend(q, k_new, v_new, k_ctx, v_ctx, start, lengths):
        with sharding_context(mesh, "prefill", strategy, dims):
            return prefill_over_context(
                q, k_new, v_new, k_ctx, v_ctx, start_B=start, lengths_B=lengths, window=None
            )

    compiled = jax.jit(attend).trace(*args).lower().compile()
    calls = [line for line in compiled.as_text().splitlines() if "tpu_custom_call" in line]
    assert len(calls) == 1 and "ragged_paged_attention" in calls[0], calls
