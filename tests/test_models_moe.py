"""MoE routing, dense dispatch/combine, and the capacity policy against naive references."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.models import MoE, dispatch_masks, init_model, preset

G, T = 3, 8


def _moe(capacity_factor: float | None) -> tuple[MoE, dict[str, np.ndarray]]:
    """Layer 0's MoE of tiny-moe, with its weights as float64 numpy arrays."""
    config = dataclasses.replace(preset("tiny-moe"), moe_capacity_factor=capacity_factor)
    layer0 = nnx.state(init_model(config, seed=2).layers[0].ffn)
    moe = nnx.eval_shape(lambda: MoE(config, rngs=nnx.Rngs(0)))
    nnx.update(moe, layer0)
    flat = {
        "/".join(p): np.asarray(v.get_value(), np.float64) for p, v in nnx.to_flat_state(layer0)
    }
    return moe, flat


def _inputs() -> np.ndarray:
    return np.asarray(jax.random.normal(jax.random.key(3), (G, T, 64)))


def _reference(x_GTD: np.ndarray, w: dict[str, np.ndarray], top_k: int, capacity: int | None):
    """Per-token loop: softmax router, top-k renormalised, SwiGLU experts, token-order slots.

    Returns the output and the set of dropped (group, token, expert) assignments.
    """
    out, dropped = np.zeros_like(x_GTD, np.float64), set()
    for g in range(x_GTD.shape[0]):
        used = np.zeros(w["router/kernel"].shape[1], int)
        for t in range(x_GTD.shape[1]):
            x = x_GTD[g, t].astype(np.float64)
            logits = x @ w["router/kernel"]
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            chosen = np.argsort(-probs)[:top_k]
            weights = probs[chosen] / probs[chosen].sum()
            for e, weight in zip(chosen, weights, strict=True):
                used[e] += 1
                if capacity is not None and used[e] > capacity:
                    dropped.add((g, t, int(e)))
                    continue
                gate = x @ w["experts/gate_kernel"][e]
                h = gate / (1 + np.exp(-gate)) * (x @ w["experts/up_kernel"][e])
                out[g, t] += weight * (h @ w["experts/down_kernel"][e])
    return out, dropped


def test_dropless_equals_per_token_reference() -> None:
    moe, w = _moe(None)
    x = _inputs()
    got = np.asarray(jax.jit(lambda m, x: m(x))(moe, jnp.asarray(x)))
    want, dropped = _reference(x, w, top_k=2, capacity=None)
    assert not dropped
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_capacity_drops_exactly_the_tokens_past_capacity() -> None:
    moe, w = _moe(0.5)
    capacity = moe.config.expert_capacity(T)
    assert capacity == math.ceil(0.5 * T * 2 / 8) == 1
    x = _inputs()
    got = np.asarray(jax.jit(lambda m, x: m(x))(moe, jnp.asarray(x)))
    want, dropped = _reference(x, w, top_k=2, capacity=capacity)
    assert len(dropped) >= 5, "the test needs tokens over capacity"
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # Dropping changes the result relative to dropless (weights are not renormalised).
    dropless, _ = _reference(x, w, top_k=2, capacity=None)
    assert np.abs(got - dropless).max() > 1e-3


def test_dispatch_masks_by_hand() -> None:
    # One group of 4 tokens choosing 2 experts each; capacity 2.
    experts = jnp.array([[[0, 1], [0, 2], [0, 1], [3, 0]]], jnp.int32)
    weights = jnp.array([[[0.75, 0.25], [0.5, 0.5], [0.9, 0.1], [0.6, 0.4]]], jnp.float32)
    dispatch, combine = dispatch_masks(weights, experts, n_experts=4, capacity=2)
    assert dispatch.shape == combine.shape == (1, 4, 4, 2)
    slots = {(t, e, c) for _, t, e, c in np.argwhere(np.asarray(dispatch) == 1)}
    # Expert 0: tokens 0 and 1 fill both slots; tokens 2 and 3 are dropped for it only.
    assert slots == {(0, 0, 0), (1, 0, 1), (0, 1, 0), (2, 1, 1), (1, 2, 0), (3, 3, 0)}
    np.testing.assert_allclose(np.asarray(combine)[0, 2, 1, 1], 0.1)
    np.testing.assert_allclose(np.asarray(combine)[0, 3, 3, 0], 0.6)
    np.testing.assert_allclose(np.asarray(combine).sum(axis=(2, 3))[0], [1.0, 1.0, 0.1, 0.6])


def test_decode_shaped_groups_have_one_slot() -> None:
    """A decode step (T=1) gets capacity 1 under either policy and stays exact."""
    for factor in (None, 0.25):
        moe, w = _moe(factor)
        assert moe.config.expert_capacity(1) == 1
        x = _inputs()[:, :1]
        got = np.asarray(jax.jit(lambda m, x: m(x))(moe, jnp.asarray(x)))
        np.testing.assert_allclose(got, _reference(x, w, 2, None)[0], atol=1e-5, rtol=1e-5)
