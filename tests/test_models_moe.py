"""MoE routing, per-device dispatch, capacity and drop counts against naive references.

The references are per-token loops in float64 numpy, written from the definition: softmax
router, top-k renormalised, SwiGLU experts; with a capacity, a device keeps the first
``capacity`` assignments (token order, then choice order) bound for each expert peer.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.models import (
    ExecutionOptions,
    ModelRun,
    MoE,
    count_dropped,
    init_model,
    preset,
    total_dropped,
)
from jaxpar.spec import ParallelConfig, make_mesh, sharding_context

# Version-sensitive (scripts/test.sh runs jax_compat tests on both JAX releases).
pytestmark = pytest.mark.jax_compat

G, T, D = 4, 8, 64


def _moe(capacity_factor: float | None, **kw) -> tuple[MoE, dict[str, np.ndarray]]:
    """Layer 0's MoE of tiny-moe, with its weights as float64 numpy arrays."""
    options = ExecutionOptions(moe_capacity_factor=capacity_factor, **kw)
    config = ModelRun(preset("tiny-moe"), options)
    layer0 = nnx.state(init_model(config, seed=2).layers[0].ffn)
    moe = nnx.eval_shape(lambda: MoE(config, rngs=nnx.Rngs(0)))
    nnx.update(moe, layer0)
    flat = {
        "/".join(p): np.asarray(v.get_value(), np.float64) for p, v in nnx.to_flat_state(layer0)
    }
    return moe, flat


def _inputs() -> np.ndarray:
    return np.array(jax.random.normal(jax.random.key(3), (G, T, D)))


def _reference(x_nD: np.ndarray, w, top_k: int, capacity: int | None, peers: int = 1):
    """One dispatch group (one device's tokens): output and number of dropped assignments."""
    n_experts = w["router/kernel"].shape[1]
    out, used, dropped = np.zeros_like(x_nD, np.float64), np.zeros(peers, int), 0
    for t, x in enumerate(x_nD.astype(np.float64)):
        logits = x @ w["router/kernel"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs, kind="stable")[:top_k]
        weights = probs[chosen] / probs[chosen].sum()
        for e, weight in zip(chosen, weights, strict=True):
            peer = e // (n_experts // peers)
            used[peer] += 1
            if capacity is not None and used[peer] > capacity:
                dropped += 1
                continue
            gate = x @ w["experts/gate_kernel"][e]
            h = gate / (1 + np.exp(-gate)) * (x @ w["experts/up_kernel"][e])
            out[t] += weight * (h @ w["experts/down_kernel"][e])
    return out, dropped


def _run(moe: MoE, x: np.ndarray) -> tuple[np.ndarray, int]:
    def f(m, x):
        with count_dropped() as drops:
            y = m(x)
        return y, total_dropped(drops)

    y, dropped = jax.jit(f)(moe, jnp.asarray(x))
    return np.asarray(y), int(dropped)


def test_dropless_equals_per_token_reference() -> None:
    moe, w = _moe(None)
    x = _inputs()
    got, dropped = _run(moe, x)
    want, want_dropped = _reference(x.reshape(-1, D), w, top_k=2, capacity=None)
    assert dropped == want_dropped == 0
    np.testing.assert_allclose(got.reshape(-1, D), want, atol=1e-5, rtol=1e-5)


def test_capacity_drops_exactly_the_assignments_past_capacity() -> None:
    moe, w = _moe(0.5)
    n = G * T
    capacity = moe.config.expert_capacity(n)
    assert capacity == math.ceil(0.5 * n * 2)  # one peer: half of the 2n assignments
    x = _inputs()
    got, dropped = _run(moe, x)
    want, want_dropped = _reference(x.reshape(-1, D), w, top_k=2, capacity=capacity)
    assert dropped == want_dropped == 2 * n - capacity
    np.testing.assert_allclose(got.reshape(-1, D), want, atol=1e-5, rtol=1e-5)


def _sharded(moe: MoE, x_BTD: np.ndarray, parallel: ParallelConfig, phase: str):
    """The MoE on a mesh: tokens split over the batch axes as the engine splits them."""
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.size])
    config = moe.config
    batch = ("dp", "sp", "ep") if phase == "decode" else ("dp", "ep")
    seq = "sp" if phase == "prefill" and parallel.sp > 1 else None
    spec = PartitionSpec(tuple(a for a in batch if parallel.degree(a) > 1) or None, seq)
    x = jax.device_put(jnp.asarray(x_BTD), NamedSharding(mesh, spec))

    def f(m, x):
        with sharding_context(mesh, phase, parallel, config), count_dropped() as drops:
            y = m(x)
            return y, total_dropped(drops)

    y, dropped = jax.jit(f)(moe, x)
    return np.asarray(y), int(dropped)


def _crafted(moe: MoE) -> None:
    """Every token prefers experts 0 and 1 (both on expert peer 0)."""
    kernel = np.zeros((D, 8), np.float32)
    kernel[0, 0], kernel[0, 1] = 200.0, 100.0
    moe.router.kernel.set_value(jnp.asarray(kernel))


@pytest.mark.parametrize("factor", [1.25, None])
def test_drop_counts_exact_when_every_token_picks_one_peer(factor) -> None:
    """ep=4: each device's 2n assignments all go to peer 0, which takes C of them."""
    moe, w = _moe(factor)
    _crafted(moe)
    w["router/kernel"] = np.asarray(moe.router.kernel.get_value(), np.float64)
    x = _inputs()
    x[..., 0] = np.abs(x[..., 0]) + 1.0  # positive feature 0: experts 0 > 1 > the rest
    parallel = ParallelConfig(ep=4, tp=2)
    got, dropped = _sharded(moe, x, parallel, "decode")
    n = G * T // 4  # tokens per device
    cap = moe.config.expert_capacity(n, peers=4)
    assert cap == (math.ceil(factor * n * 2 / 4) if factor else n * 2)
    assert dropped == 4 * (2 * n - cap)  # counted on every device holding tokens
    want = np.concatenate(
        [_reference(xd.reshape(-1, D), w, 2, cap, peers=4)[0] for xd in np.split(x, 4)]
    )
    np.testing.assert_allclose(got.reshape(-1, D), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("strategy", "phase"),
    [("ep=4,tp=2", "prefill"), ("dp=2,ep=2,tp=2", "decode"), ("sp=2,ep=4", "prefill")],
)
def test_sharded_capacity_equals_per_device_reference(strategy, phase) -> None:
    """Groups are each device's tokens (per sp shard in prefill), capacity per peer."""
    moe, w = _moe(1.0)
    x = _inputs()
    parallel = ParallelConfig.parse(strategy)
    got, dropped = _sharded(moe, x, parallel, phase)
    batch_shards = parallel.dp * parallel.ep * (parallel.sp if phase == "decode" else 1)
    seq_shards = parallel.sp if phase == "prefill" else 1
    want, want_dropped = np.zeros((G, T, D)), 0
    for b_blk in np.split(np.arange(G), batch_shards):
        for t_blk in np.split(np.arange(T), seq_shards):
            xd = x[b_blk][:, t_blk]
            cap = moe.config.expert_capacity(xd.shape[0] * xd.shape[1], peers=parallel.ep)
            out, drops = _reference(xd.reshape(-1, D), w, 2, cap, peers=parallel.ep)
            want[np.ix_(b_blk, t_blk)] = out.reshape(xd.shape)
            want_dropped += drops
    assert want_dropped > 0, "the test needs assignments over capacity"
    assert dropped == want_dropped
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
