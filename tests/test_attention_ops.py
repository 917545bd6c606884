"""Attention ops: the XLA path against a per-head reference, and the Pallas kernels (interpret
mode on CPU) against the XLA path, single device and sharded.

cuDNN cannot run on CPU: its selection is tested here, and the arguments the cuDNN paths pass,
through XLA stand-ins of the same APIs; never cuDNN's own output.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxpar.errors import ConfigError
from jaxpar.models import _attention_kernels as kern
from jaxpar.models import _attention_ops as ops
from jaxpar.models._attention_ops import attention_impls, decode_attention, prefill_attention
from jaxpar.spec import Dims, ParallelConfig, logical_shard_map, make_mesh, sharding_context
from tests._tiers import sweep

# Version-sensitive (scripts/test.sh runs jax_compat tests on both JAX releases).
pytestmark = pytest.mark.jax_compat

B, N, K, H = 2, 4, 2, 16
T_SPLASH = 128  # splash computes kv in blocks of 128 lanes: the smallest prompt it takes
S_DECODE = 32  # two splits of 16 keys for the GPU decode kernel
RNG = np.random.default_rng(0)


def _normal(*shape, dtype=jnp.float32):
    return jnp.asarray(RNG.normal(size=shape), dtype)


def _dims(n_kv_heads=K):
    return Dims(
        vocab_size=32,
        d_model=N * H,
        n_layers=2,
        n_heads=N,
        n_kv_heads=n_kv_heads,
        head_dim=H,
        d_ff=64,
    )


def _naive_prefill(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, lengths_B, window):
    """Per row, per head loops in numpy float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q_BTNH, k_BSKH, v_BSKH))
    b, t, n, h = q.shape
    group = n // k.shape[2]
    out = np.zeros_like(q)
    for bi in range(b):
        for ni in range(n):
            for ti in range(t):
                i = int(q_pos_BT[bi, ti])
                keys = [
                    j
                    for j in range(k.shape[1])
                    if j <= i and j < lengths_B[bi] and (window is None or j > i - window)
                ]
                if not keys:
                    continue
                s = np.array([q[bi, ti, ni] @ k[bi, j, ni // group] for j in keys]) / math.sqrt(h)
                p = np.exp(s - s.max())
                out[bi, ti, ni] = (p / p.sum()) @ v[bi, keys, ni // group]
    return out


def _valid(q_pos_BT, lengths_B):
    return np.asarray(q_pos_BT < lengths_B[:, None])[:, :, None, None]


@pytest.mark.parametrize("window", [None, 3])
def test_xla_prefill_matches_per_head_reference(window):
    t, s = 6, 10  # a chunk of queries at positions 4..9 over keys 0..9
    q_BTNH, k_BSKH, v_BSKH = _normal(B, t, N, H), _normal(B, s, K, H), _normal(B, s, K, H)
    q_pos_BT = jnp.asarray(np.stack([np.arange(4, 10), np.arange(4, 10)]), jnp.int32)
    lengths_B = jnp.array([10, 7], jnp.int32)
    out = prefill_attention(
        q_BTNH, k_BSKH, v_BSKH, q_pos_BT=q_pos_BT, lengths_B=lengths_B, window=window, impl="xla"
    )
    ref = _naive_prefill(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, lengths_B, window)
    valid = _valid(q_pos_BT, lengths_B)
    np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, ref, 0), atol=1e-5)
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("window", [None, 5])
def test_xla_decode_matches_per_head_reference(window):
    s = 12
    q_BNH, k_BKSH, v_BKSH = _normal(B, N, H), _normal(B, K, s, H), _normal(B, K, s, H)
    lengths_B = jnp.array([12, 4], jnp.int32)
    out = decode_attention(q_BNH, k_BKSH, v_BKSH, lengths_B=lengths_B, window=window, impl="xla")
    ref = _naive_prefill(
        q_BNH[:, None],
        k_BKSH.transpose(0, 2, 1, 3),
        v_BKSH.transpose(0, 2, 1, 3),
        np.asarray(lengths_B - 1)[:, None],
        lengths_B,
        window,
    )[:, 0]
    np.testing.assert_allclose(out, ref, atol=1e-5)


# --- Kernels in interpret mode against XLA, under shardings --------------------------------

STRATEGIES = {
    "single": ParallelConfig(),
    "tp2": ParallelConfig(tp=2),
    "dp2-tp2": ParallelConfig(dp=2, tp=2),
}


def _run(config, phase, fn, *args, n_kv_heads=K):
    """``fn(*args)`` jitted inside a sharding context on ``config``'s mesh; also its jaxpr."""
    mesh = make_mesh(config, jax.devices()[: config.size])

    def body(*xs):
        with sharding_context(mesh, phase, config, _dims(n_kv_heads)):
            return fn(*xs)

    traced = jax.jit(body).trace(*args)  # one trace for both the jaxpr and the run
    return traced.lower().compile()(*args), str(traced.jaxpr)


def _check_kernel_ran(jaxpr, config):
    assert "pallas_call" in jaxpr, "the kernel path fell back to XLA"
    assert ("shard_map" in jaxpr) == (config.size > 1)


def _prefill_case(window, n_kv_heads=K):
    q_BTNH = _normal(B, T_SPLASH, N, H)
    k_BSKH, v_BSKH = _normal(B, T_SPLASH, n_kv_heads, H), _normal(B, T_SPLASH, n_kv_heads, H)
    q_pos_BT = jnp.broadcast_to(jnp.arange(T_SPLASH, dtype=jnp.int32), (B, T_SPLASH))
    lengths_B = jnp.array([T_SPLASH, 77], jnp.int32)
    return q_BTNH, k_BSKH, v_BSKH, q_pos_BT, lengths_B


def _compare_prefill(config, window, n_kv_heads=K):
    q, k, v, q_pos_BT, lengths_B = _prefill_case(window, n_kv_heads)

    def both(q, k, v):
        kw = dict(q_pos_BT=q_pos_BT, lengths_B=lengths_B, window=window)
        return (
            prefill_attention(q, k, v, impl="pallas_tpu", interpret=True, **kw),
            prefill_attention(q, k, v, impl="xla", **kw),
        )

    (out, ref), jaxpr = _run(config, "prefill", both, q, k, v, n_kv_heads=n_kv_heads)
    _check_kernel_ran(jaxpr, config)
    assert out.dtype == ref.dtype == q.dtype, (out.dtype, ref.dtype)
    valid = _valid(q_pos_BT, lengths_B)
    diff = float(np.max(np.abs(np.where(valid, out - ref, 0))))
    assert diff < 1e-5, diff
    # Padding rows are zeroed by the kernel path (never NaN).
    assert not np.asarray(out)[~np.broadcast_to(valid, out.shape)].any()


@pytest.mark.parametrize("name", sweep([*STRATEGIES, "sp2"], "sp2".__eq__))
def test_splash_prefill_matches_xla(name):
    # sp2: queries split over sp (each shard picks its offset's mask), K/V gathered.
    config = STRATEGIES.get(name) or ParallelConfig(sp=2)
    _compare_prefill(config, window=None if name in ("single", "sp2") else 9)


@pytest.mark.sweep
def test_splash_prefill_kv_heads_replicated_over_tp():
    # K=2 < tp=4: every tp device holds both kv heads; each slices the one its q head reads.
    _compare_prefill(ParallelConfig(tp=4), window=None, n_kv_heads=2)


@pytest.mark.parametrize("name", sweep(["single", "tp2", "sp2"], "sp2".__eq__))
def test_cudnn_call_arguments_through_jax_xla_implementation(name, monkeypatch):
    """The cuDNN path's masking arguments (is_causal + lengths + window on whole sequences,
    an explicit mask on sp shards), run through JAX's XLA implementation of the same
    ``dot_product_attention`` API. cuDNN itself cannot run on CPU: this checks our wiring and
    argument semantics, not the cuDNN kernel."""
    original = jax.nn.dot_product_attention

    calls = []

    def as_xla(*args, implementation=None, **kwargs):
        calls.append(implementation)
        return original(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", as_xla)
    config = STRATEGIES.get(name) or ParallelConfig(sp=2)
    q, k, v, q_pos_BT, lengths_B = (
        x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in _prefill_case(None)
    )

    def both(q, k, v):
        kw = dict(q_pos_BT=q_pos_BT, lengths_B=lengths_B, window=None if name == "tp2" else 9)
        return (
            prefill_attention(q, k, v, impl="cudnn", **kw),
            prefill_attention(q, k, v, impl="xla", **kw),
        )

    (out, ref), jaxpr = _run(config, "prefill", both, q, k, v)
    assert calls == ["cudnn"], calls  # traced once, through the cuDNN path's call
    assert ("shard_map" in jaxpr) == (config.size > 1)
    valid = _valid(q_pos_BT, lengths_B)
    diff = np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32))
    assert float(np.max(np.where(valid, diff, 0))) < 2e-2
    assert not np.asarray(out, np.float32)[~np.broadcast_to(valid, out.shape)].any()


def _decode_case(n_kv_heads=K, dtype=jnp.float32):
    q_BNH = _normal(B, N, H, dtype=dtype)
    k_BKSH, v_BKSH = (_normal(B, n_kv_heads, S_DECODE, H, dtype=dtype) for _ in range(2))
    return q_BNH, k_BKSH, v_BKSH, jnp.array([S_DECODE, 11], jnp.int32)


def _compare_decode(config, window, n_kv_heads=K, dtype=jnp.float32, atol=1e-5):
    q, k, v, lengths_B = _decode_case(n_kv_heads, dtype)

    def both(q, k, v):
        kw = dict(lengths_B=lengths_B, window=window)
        return (
            decode_attention(q, k, v, impl="pallas_gpu", interpret=True, **kw),
            decode_attention(q, k, v, impl="xla", **kw),
        )

    (out, ref), jaxpr = _run(config, "decode", both, q, k, v, n_kv_heads=n_kv_heads)
    _check_kernel_ran(jaxpr, config)
    # The kernel's result keeps q's dtype (an f32 result turned the residual stream f32).
    assert out.dtype == ref.dtype == jnp.dtype(dtype), (out.dtype, ref.dtype)
    diff = float(np.max(np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32))))
    assert diff < atol, diff


@pytest.mark.parametrize("name", sweep(STRATEGIES, "dp2-tp2".__eq__))
def test_gpu_decode_kernel_matches_xla(name):
    _compare_decode(STRATEGIES[name], window=None if name == "tp2" else 6)


@pytest.mark.sweep
def test_gpu_decode_kernel_kv_heads_replicated_over_tp():
    # Each tp device runs every kv head but gives the ones it does not need length 0.
    _compare_decode(ParallelConfig(tp=4), window=None, n_kv_heads=2)


@pytest.mark.sweep
def test_gpu_decode_kernel_bf16():
    _compare_decode(ParallelConfig(), window=None, dtype=jnp.bfloat16, atol=2e-2)


def _cudnn_wrapper_as_xla(calls: list):
    """JAX's cuDNN wrapper (head-major "BNTH" inputs, padding by sequence lengths, a
    boolean mask) re-expressed through ``jax.nn.dot_product_attention``'s XLA path."""

    def wrapper(query, key, value, bias=None, mask=None, q_seqlen=None, kv_seqlen=None, **kw):
        from jax._src.cudnn.fused_attention_stablehlo import MaskType

        calls.append((kw["qkv_layout"], kw["mask_type"]))
        assert kw["qkv_layout"] == "BNTH" and kw["mask_type"] == MaskType.PADDING and bias is None
        out_BTNH = jax.nn.dot_product_attention(
            query.transpose(0, 2, 1, 3),
            key.transpose(0, 2, 1, 3),
            value.transpose(0, 2, 1, 3),
            mask=mask,
            scale=kw["scale"],
            query_seq_lengths=q_seqlen,
            key_value_seq_lengths=kv_seqlen,
            implementation="xla",
        )
        return out_BTNH.transpose(0, 2, 1, 3)

    return wrapper


@pytest.mark.parametrize(
    ("name", "window", "n_kv_heads"),
    sweep(
        [("single", None, K), ("tp2", 6, K), ("dp2-tp2", None, K), ("tp4", 6, 2)],
        lambda case: case[0] == "tp4",
    ),
)
def test_cudnn_decode_call_arguments_through_jax_xla_implementation(
    name, window, n_kv_heads, monkeypatch
):
    """The cuDNN decode path's wiring (head-major cache read in place, lengths, window
    mask, kv heads replicated over tp) through an XLA stand-in for JAX's cuDNN wrapper.
    cuDNN itself cannot run on CPU."""
    from jax._src.cudnn import fused_attention_stablehlo

    calls: list = []
    monkeypatch.setattr(
        fused_attention_stablehlo, "dot_product_attention", _cudnn_wrapper_as_xla(calls)
    )
    config = {"tp4": ParallelConfig(tp=4)}.get(name) or STRATEGIES[name]
    q, k, v, lengths_B = _decode_case(n_kv_heads, jnp.bfloat16)

    def both(q, k, v):
        kw = dict(lengths_B=lengths_B, window=window)
        return decode_attention(q, k, v, impl="cudnn", **kw), decode_attention(
            q, k, v, impl="xla", **kw
        )

    (out, ref), jaxpr = _run(config, "decode", both, q, k, v, n_kv_heads=n_kv_heads)
    assert len(calls) == 1, calls
    assert ("shard_map" in jaxpr) == (config.size > 1)
    assert out.dtype == ref.dtype == jnp.bfloat16
    diff = np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32))
    assert float(np.max(diff)) < 2e-2


def _in_pp_stages(config, phase, op, args):
    """``op(*args)`` as the pipeline engine runs a stage: inside a ``shard_map`` with ``pp``
    manual, the sharding context's mesh being the abstract mesh. Stage 1 gets ``-args``.
    Returns (stacked results, jaxpr text)."""
    mesh = make_mesh(config, jax.devices()[: config.size])
    staged = tuple(jnp.stack([x, -x]) for x in args)

    def stage(*xs):
        with sharding_context(jax.sharding.get_abstract_mesh(), phase, config, _dims()):
            return jax.tree.map(lambda y: y[None], op(*(x[0] for x in xs)))

    run = jax.shard_map(
        stage,
        mesh=mesh,
        in_specs=(PartitionSpec("pp"),) * len(args),
        out_specs=PartitionSpec("pp"),
        axis_names={"pp"},
    )
    traced = jax.jit(run).trace(*staged)
    return traced.lower().compile()(*staged), str(traced.jaxpr)


@pytest.mark.sweep
def test_gpu_decode_kernel_inside_pp_manual_shard_map():
    q, k, v, lengths_B = _decode_case()

    def op(q, k, v):
        kw = dict(lengths_B=lengths_B, window=None)
        return (
            decode_attention(q, k, v, impl="pallas_gpu", interpret=True, **kw),
            decode_attention(q, k, v, impl="xla", **kw),
        )

    (out, ref), jaxpr = _in_pp_stages(ParallelConfig(pp=2, tp=2), "decode", op, (q, k, v))
    assert jaxpr.count("shard_map") >= 2 and "pallas_call" in jaxpr
    assert float(np.max(np.abs(np.asarray(out) - np.asarray(ref)))) < 1e-5


def test_splash_prefill_sp2_tp2_window_inside_pp_manual_shard_map():
    # All 8 devices: pp manual outside; sp (query offsets by lax.switch) and tp inside.
    q, k, v, q_pos_BT, lengths_B = _prefill_case(window=9)

    def op(q, k, v):
        kw = dict(q_pos_BT=q_pos_BT, lengths_B=lengths_B, window=9)
        return (
            prefill_attention(q, k, v, impl="pallas_tpu", interpret=True, **kw),
            prefill_attention(q, k, v, impl="xla", **kw),
        )

    config = ParallelConfig(pp=2, sp=2, tp=2)
    (out, ref), jaxpr = _in_pp_stages(config, "prefill", op, (q, k, v))
    assert jaxpr.count("shard_map") >= 2 and "pallas_call" in jaxpr
    valid = _valid(q_pos_BT, lengths_B)[None]
    assert float(np.max(np.abs(np.where(valid, np.asarray(out) - np.asarray(ref), 0)))) < 1e-5


def test_logical_shard_map_outside_context_is_the_function():
    def fn(x):
        return x + 1

    assert logical_shard_map(fn, (("batch",),), ("batch",), "attention") is fn


# --- Selection, fallbacks, errors ------------------------------------------------------------


def test_auto_selection_by_backend_and_dtype():
    assert attention_impls("gpu", jnp.bfloat16) == ("cudnn", "cudnn")
    assert attention_impls("gpu", jnp.float16) == ("cudnn", "cudnn")
    assert attention_impls("gpu", jnp.float32) == ("xla", "xla")
    assert attention_impls("tpu", jnp.bfloat16) == ("pallas_tpu", "xla")
    assert attention_impls("tpu", jnp.float32) == ("xla", "xla")
    assert attention_impls("cpu", jnp.bfloat16) == ("xla", "xla")
    assert attention_impls("cpu", jnp.float32) == ("xla", "xla")


def test_auto_on_cpu_runs_xla():
    q, k, v, q_pos_BT, lengths_B = _prefill_case(None)
    kw = dict(q_pos_BT=q_pos_BT, lengths_B=lengths_B, window=None)
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: prefill_attention(q, k, v, **kw))(q, k, v))
    assert "pallas_call" not in jaxpr and "dot_general" in jaxpr


def test_kernels_fall_back_to_xla_where_they_cannot_run():
    # Decode: a 24-long cache has no split of >= 16 keys. Splash: 40 keys fit no kv block.
    # cuDNN: f32 is not taken.
    assert kern.decode_blocks(24) is None and kern.decode_blocks(32) == (2, 16)
    assert kern.splash_blocks(40, 40) is None and kern.splash_blocks(64, 128) == (64, 128)
    q_BNH, k_BKSH, v_BKSH = _normal(B, N, H), _normal(B, K, 24, H), _normal(B, K, 24, H)
    lengths_B = jnp.array([24, 5], jnp.int32)

    def decode(q, k, v):
        return decode_attention(q, k, v, lengths_B=lengths_B, window=None, impl="pallas_gpu")

    assert "pallas_call" not in str(jax.make_jaxpr(decode)(q_BNH, k_BKSH, v_BKSH))
    q, k, v = _normal(B, 40, N, H), _normal(B, 40, K, H), _normal(B, 40, K, H)
    q_pos_BT = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (B, 40))
    for impl in ("pallas_tpu", "cudnn"):

        def prefill(q, k, v, impl=impl):
            return prefill_attention(
                q, k, v, q_pos_BT=q_pos_BT, lengths_B=lengths_B, window=None, impl=impl
            )

        jaxpr = str(jax.make_jaxpr(prefill)(q, k, v))
        assert "pallas_call" not in jaxpr and "cudnn" not in jaxpr


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_unknown_impl_names_the_legal_ones(phase):
    if phase == "prefill":
        q, k, v, q_pos_BT, lengths_B = _prefill_case(None)
        call = lambda: prefill_attention(  # noqa: E731
            q, k, v, q_pos_BT=q_pos_BT, lengths_B=lengths_B, window=None, impl="flash"
        )
        legal = "auto, xla, cudnn, pallas_tpu"
    else:
        q, k, v, lengths_B = _decode_case()
        call = lambda: decode_attention(  # noqa: E731
            q, k, v, lengths_B=lengths_B, window=None, impl="flash"
        )
        legal = "auto, xla, cudnn, pallas_gpu, pallas_tpu"
    with pytest.raises(ConfigError, match=legal):
        call()


def test_execution_options_accept_exactly_the_ops_impls():
    """ExecutionOptions validates the attention choices against the ops' own lists."""
    from jaxpar.models import ExecutionOptions
    from jaxpar.models._options import CHOICES
    from jaxpar.models._paged_attention import PAGED_DECODE_IMPLS

    assert CHOICES["prefill_attention"] == ops.PREFILL_IMPLS
    assert CHOICES["decode_attention"] == ops.DECODE_IMPLS
    assert CHOICES["paged_attention"] == PAGED_DECODE_IMPLS
    with pytest.raises(ConfigError, match="decode_attention='flash' .*legal: 'auto', 'xla'"):
        ExecutionOptions(decode_attention="flash")
