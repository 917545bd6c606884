"""The MoE's ragged path on CPU: sort/unsort, group sizes, grouped matmul, and the exchange.

XLA:CPU compiles no ``ragged-all-to-all``, so the exchange test runs jaxpar's ragged
dispatch and combine with the primitive replaced by an emulation written here from its
documented semantics (``jax.lax.ragged_all_to_all``'s docstring), and checks both against a
reference exchange written with ``jax.lax.all_to_all`` on per-pair padded buffers: the same
token rows must arrive at the same places and come back to the same assignments. Where the
backend compiles the real primitive the same check runs on it. The emulation is itself
checked against a numpy transcription of the docstring's pseudocode (random sizes and
offsets) and honours every size argument: receive sizes that disagree with the senders' fail.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.engine._moe_probe import ragged_all_to_all_compiles
from jaxpar.models import _moe_exchange as xchg
from jaxpar.models import _moe_route as route

# Version-sensitive (scripts/test.sh runs jax_compat tests on both JAX releases).
pytestmark = pytest.mark.jax_compat

E, K, P, N, D = 8, 2, 4, 12, 16  # experts, top_k, expert peers, tokens per device, width


def _experts(seed: int, n: int = N) -> np.ndarray:
    """Distinct top-k experts per token, skewed so some peers get more rows than others."""
    rng = np.random.default_rng(seed)
    p = np.array([8, 4, 2, 1, 1, 1, 1, 2], float)
    return np.stack([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(n)])


def test_sort_by_expert_and_back() -> None:
    experts_nk = _experts(0)
    x_nD = np.random.default_rng(1).normal(size=(N, D)).astype(np.float32)
    cap = route.dropless_capacity(N, K, E, P)
    plan = route.send_plan(jnp.asarray(experts_nk), E, P, cap)
    sent = np.asarray(route.sorted_rows(jnp.asarray(x_nD), plan))
    rank, token = np.asarray(plan.rank_A), np.asarray(plan.token_A)
    np.testing.assert_array_equal(sent[rank], x_nD[token])  # unsort: every assignment's row
    np.testing.assert_array_equal(token, np.repeat(np.arange(N), K))
    expert_A = experts_nk.reshape(-1)
    sorted_experts = np.empty_like(expert_A)
    sorted_experts[rank] = expert_A
    assert (np.diff(sorted_experts) >= 0).all()  # sorted by expert
    for e in range(E):  # token order within an expert
        assert (np.diff(token[expert_A == e][np.argsort(rank[expert_A == e])]) > 0).all()
    # Group sizes: rows per (peer, local expert) are the routed counts.
    np.testing.assert_array_equal(
        np.asarray(plan.counts_PE).reshape(-1), np.bincount(expert_A, minlength=E)
    )
    assert int(plan.dropped) == 0
    sizes = np.asarray(plan.sizes_P)
    np.testing.assert_array_equal(np.asarray(plan.offsets_P), np.cumsum(sizes) - sizes)


def test_capacity_keeps_the_earliest_assignments_per_peer() -> None:
    experts_nk = _experts(2)
    cap = 3
    plan = route.send_plan(jnp.asarray(experts_nk), E, P, cap)
    kept = np.asarray(plan.kept_A)
    dest = experts_nk.reshape(-1) // (E // P)
    for p in range(P):  # the first `cap` assignments bound for p, in token order, are kept
        mine = np.flatnonzero(dest == p)
        np.testing.assert_array_equal(kept[mine], np.arange(mine.size) < cap)
    assert int(plan.dropped) == sum(max(0, (dest == p).sum() - cap) for p in range(P)) > 0
    slots = np.asarray(plan.slot_A)[kept]
    assert len(set(slots)) == slots.size and (slots // cap == dest[kept]).all()


def test_receive_plan_groups_rows_by_local_expert() -> None:
    counts_PE = jnp.array([[2, 0], [1, 3], [0, 0], [1, 1]], jnp.int32)  # 4 sources, 2 experts
    cap = 4
    plan = route.receive_plan(counts_PE, cap)
    np.testing.assert_array_equal(np.asarray(plan.group_sizes_E), [4, 4])
    # Row ids s * C + c: source 0 rows 0-1 (expert 0); source 1 row 4 (0), rows 5-7 (1); ...
    np.testing.assert_array_equal(np.asarray(plan.order_R)[:8], [0, 1, 4, 12, 5, 6, 7, 13])


def test_grouped_matmul_equals_a_loop_over_experts() -> None:
    rng = np.random.default_rng(3)
    e_l, f, sizes = 3, 8, np.array([4, 0, 5])
    rows = 12  # 9 grouped rows, 3 padding rows
    x = rng.normal(size=(rows, D)).astype(np.float32)
    gate, up = (rng.normal(size=(e_l, D, f)).astype(np.float32) for _ in range(2))
    down = rng.normal(size=(e_l, f, D)).astype(np.float32)
    got = np.asarray(
        route.grouped_swiglu(*map(jnp.asarray, (x, sizes.astype(np.int32), gate, up, down)))
    )
    want = np.zeros((rows, D), np.float64)
    start = 0
    for e, size in enumerate(sizes):
        xs = x[start : start + size].astype(np.float64)
        g = xs @ gate[e]
        want[start : start + size] = (g / (1 + np.exp(-g)) * (xs @ up[e])) @ down[e]
        start += size
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)  # padding rows stay 0
    # The CPU formulation (batched matmuls, rows masked per group) computes the same.
    masked = route.masked_swiglu(*map(jnp.asarray, (x, sizes.astype(np.int32), gate, up, down)))
    np.testing.assert_allclose(np.asarray(masked), want, rtol=1e-4, atol=1e-4)


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """``ragged_all_to_all`` from its docstring, on ``all_to_all`` and ``all_gather``.

    With ``m`` slices per peer, this device's slot ``i`` receives from peer ``i // m``
    that peer's slice ``me * m + i % m``: ``recv_sizes[i]`` rows (this device's size)
    from the sender's ``operand`` at its ``input_offsets``, written at the sender's
    ``output_offsets``; every other row keeps ``output``'s value. The primitive requires
    ``recv_sizes[i]`` to equal the sender's ``send_sizes``; where they differ, the rows this
    device expects are poisoned (NaN), so a caller passing inconsistent sizes fails."""
    n = input_offsets.shape[0]

    def received(a):  # slot i: the sender's entry for this device
        return jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True)

    in_offsets, sent_sizes, out_offsets = map(received, (input_offsets, send_sizes, output_offsets))
    ops = jax.lax.all_gather(operand, axis_name)  # [peers, rows, ...]
    per_peer = n // ops.shape[0]
    r = jnp.arange(output.shape[0]).reshape(-1, *[1] * (output.ndim - 1))
    poison = jnp.full_like(output, _poison(output.dtype))
    result = output
    for i in range(n):
        start, size = out_offsets[i], recv_sizes[i]
        rows = ops[i // per_peer][jnp.clip(in_offsets[i] + r[:, 0] - start, 0, ops.shape[1] - 1)]
        rows = jnp.where(sent_sizes[i] == size, rows.astype(output.dtype), poison)
        result = jnp.where((r >= start) & (r < start + size), rows, result)
    return result


def _poison(dtype) -> float | int:
    return np.nan if jnp.issubdtype(dtype, jnp.inexact) else np.iinfo(dtype).min


def _reference_ragged(operand, output, in_offsets, send_sizes, out_offsets, recv_sizes):
    """The docstring's pseudocode in numpy, every device at once (arrays ``[peers, ...]``):
    receiver r's slot ``s * m + k`` is sender s's slice ``r * m + k``."""
    peers, n = in_offsets.shape
    m = n // peers
    result = output.copy()
    for r in range(peers):
        for i in range(n):
            s, j = i // m, r * m + i % m
            assert recv_sizes[r, i] == send_sizes[s, j]  # the primitive's requirement
            start, size = out_offsets[s, j], recv_sizes[r, i]
            src = in_offsets[s, j]
            result[r, start : start + size] = operand[s, src : src + size]
    return result


def _ragged_args(seed: int, per_peer: int, rows: int = 8, out_rows: int = 32):
    """Random consistent arguments for 4 peers (``[peers, ...]`` each): slice sizes 0-3 at
    random input offsets, each receiver's slices at random disjoint places in shuffled
    order with random gaps."""
    rng = np.random.default_rng(seed)
    n = P * per_peer
    send = rng.integers(0, 4, (P, n))
    in_off = rng.integers(0, rows - send + 1)
    out_off, recv = np.zeros((P, n), int), np.zeros((P, n), int)
    for r in range(P):
        slots = [(s, r * per_peer + k) for s in range(P) for k in range(per_peer)]
        gaps = rng.multinomial(
            out_rows - sum(send[s, j] for s, j in slots), [1 / (n + 1)] * (n + 1)
        )
        at = 0
        for (s, j), gap in zip([slots[i] for i in rng.permutation(n)], gaps, strict=False):
            out_off[s, j] = at + gap
            at += gap + send[s, j]
        for i, (s, j) in enumerate(slots):
            recv[r, i] = send[s, j]
    operand = rng.normal(size=(P, rows, 3)).astype(np.float32)
    output = rng.normal(size=(P, out_rows, 3)).astype(np.float32)
    return operand, output, *(a.astype(np.int32) for a in (in_off, send, out_off, recv))


@functools.cache
def _emulation_program():
    mesh = jax.make_mesh((P,), ("x",), devices=jax.devices()[:P])
    spec = PartitionSpec("x")

    def body(*args):
        return emulated_ragged_all_to_all(*(a[0] for a in args), axis_name="x")[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))
    return fn, NamedSharding(mesh, spec)


def _emulated(*args) -> np.ndarray:
    """The emulation on 4 devices, device d given ``a[d]`` of each argument."""
    fn, sharding = _emulation_program()
    return np.asarray(fn(*(jax.device_put(jnp.asarray(a), sharding) for a in args)))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), per_peer=st.sampled_from([1, 2]))
def test_emulated_ragged_all_to_all_follows_the_documented_semantics(seed, per_peer) -> None:
    args = _ragged_args(seed, per_peer)
    np.testing.assert_array_equal(_emulated(*args), _reference_ragged(*args))


def test_emulated_ragged_all_to_all_matches_the_docstring_example() -> None:
    """The docstring's two-device example (axis index 0 and 1), on 4 devices: peers 2 and 3
    send and receive nothing."""
    operand = np.array([[1, 2, 2], [3, 4, 0], [0, 0, 0], [0, 0, 0]], np.float32)[..., None]
    ints = functools.partial(np.array, dtype=np.int32)
    pad = [[0] * 4] * 2
    args = (
        operand,
        np.zeros((P, 4, 1), np.float32),
        ints([[0, 1, 0, 0], [0, 1, 0, 0], *pad]),  # input_offsets
        ints([[1, 2, 0, 0], [1, 1, 0, 0], *pad]),  # send_sizes
        ints([[0, 0, 0, 0], [1, 2, 0, 0], *pad]),  # output_offsets
        ints([[1, 1, 0, 0], [2, 1, 0, 0], *pad]),  # recv_sizes
    )
    got = _emulated(*args)[..., 0]
    np.testing.assert_array_equal(got[:2], [[1, 3, 0, 0], [2, 2, 4, 0]])
    np.testing.assert_array_equal(got[2:], 0)


@pytest.mark.parametrize("change", ["zero", "one less", "one more"])
def test_emulation_fails_receive_sizes_that_disagree_with_the_senders(change) -> None:
    """Receive sizes are honoured, not implied by the senders': zero receives nothing, a
    size that disagrees with the sender's poisons the rows expected."""
    operand, output, in_off, send, out_off, recv = _ragged_args(5, 1)
    want = _reference_ragged(operand, output, in_off, send, out_off, recv)
    r, i = np.argwhere(recv == recv.max())[0]  # a slice with rows (recv.max() > 0)
    bad = recv.copy()
    if change == "zero":
        bad[:] = 0
    else:
        bad[r, i] += -1 if change == "one less" else 1
    got = _emulated(operand, output, in_off, send, out_off, bad)
    if change == "zero":
        np.testing.assert_array_equal(got, output)  # nothing written
    else:
        assert np.isnan(got[r]).any()
    assert not np.array_equal(got, want)


def _exchange(path: str, x_PnD, experts_Pnk):
    """Dispatch and combine over a 4-device ``ep`` mesh: (received rows, returned per
    assignment), with the expert computation replaced by a row-identifying map."""
    mesh = jax.make_mesh((P,), ("ep",), devices=jax.devices()[:P])
    cap = route.dropless_capacity(N, K, E, P)
    axes = ("ep",)

    def body(x_nD, experts_nk):
        x_nD, experts_nk = x_nD[0], experts_nk[0]
        plan = route.send_plan(experts_nk, E, P, cap)
        counts_PE, offsets_P = xchg.exchange_counts(plan, axes)
        if path == "ragged":
            sent = route.sorted_rows(x_nD, plan)
            rows = xchg.ragged_dispatch(sent, plan, counts_PE, cap, axes)
        else:
            rows = xchg.padded_dispatch(route.pack_rows(x_nD, plan, P * cap), P, axes)
        y = 3.0 * rows + 1.0  # distinct per row; padding rows become 1, never read back
        if path == "ragged":
            back = xchg.ragged_combine(y, plan, counts_PE, offsets_P, sent.shape[0], axes)
            per_assignment = back[plan.rank_A]
        else:
            per_assignment = xchg.padded_combine(y, P, axes)[plan.slot_A]
        valid = jnp.arange(cap)[None, :] < jnp.sum(counts_PE, axis=1)[:, None]
        return rows[None], per_assignment[None], valid.reshape(1, -1)

    spec = PartitionSpec("ep")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec,) * 3))
    args = [jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec)) for a in (x_PnD, experts_Pnk)]
    return tuple(np.asarray(a) for a in fn(*args))


def _check_same_tokens(ragged, padded, x_PnD, experts_Pnk) -> None:
    rows_r, back_r, valid = ragged
    rows_p, back_p, valid_p = padded
    np.testing.assert_array_equal(valid, valid_p)
    assert valid.sum() == P * N * K  # every routed row arrived once
    np.testing.assert_array_equal(rows_r[valid], rows_p[valid])  # same rows, same places
    # Every assignment got its own token's row back through the map.
    want = 3.0 * np.repeat(x_PnD, K, axis=1) + 1.0
    np.testing.assert_allclose(back_r, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(back_p, want, rtol=1e-6, atol=1e-6)


@functools.cache
def _inputs():
    x = np.random.default_rng(4).normal(size=(P, N, D)).astype(np.float32)
    experts = np.stack([_experts(10 + p) for p in range(P)]).astype(np.int32)
    return x, experts


def test_ragged_exchange_matches_padded_all_to_all_reference(monkeypatch) -> None:
    x, experts = _inputs()
    padded = _exchange("padded", x, experts)
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    _check_same_tokens(_exchange("ragged", x, experts), padded, x, experts)


def test_real_ragged_all_to_all_where_the_backend_has_it() -> None:
    platform = jax.devices()[0].platform
    if not ragged_all_to_all_compiles(platform):
        pytest.skip(f"XLA:{platform} compiles no ragged-all-to-all (the padded path runs)")
    x, experts = _inputs()
    _check_same_tokens(_exchange("ragged", x, experts), _exchange("padded", x, experts), x, experts)


@pytest.mark.parametrize("strategy", ["", "ep=4,tp=2"])
def test_ragged_moe_layer_equals_the_per_token_reference(monkeypatch, strategy) -> None:
    """The whole layer on the ragged path (emulated primitive), one device and sharded."""
    from jaxpar.spec import ParallelConfig
    from tests.test_models_moe import _inputs as moe_inputs
    from tests.test_models_moe import _moe, _reference, _run, _sharded

    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    moe, w = _moe(None, moe_dispatch="ragged")
    x = moe_inputs()
    if strategy:
        got, dropped = _sharded(moe, x, ParallelConfig.parse(strategy), "prefill")
    else:
        got, dropped = _run(moe, x)
    want, _ = _reference(x.reshape(-1, x.shape[-1]), w, top_k=2, capacity=None)
    assert dropped == 0
    np.testing.assert_allclose(got.reshape(want.shape), want, atol=1e-5, rtol=1e-5)
