"""Mixture of experts: router, stacked SwiGLU experts, dense GShard dispatch/combine.

The dispatch is a pair of one-hot einsums, so it runs on every backend (no ragged
all-to-all). Tokens are grouped per sequence (G = B groups of T tokens). Under expert
parallelism the reshard of the dispatched tensor from token-sharded [G,E,C,D] to
expert-sharded [E,G,C,D] is what XLA turns into an all-to-all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models._config import ModelConfig
from jaxpar.models._layers import BTD, fan_in_normal, param
from jaxpar.spec import Module, constrain

# The named scope around the expert-slot count (a cumsum over a group's tokens).
EXPERT_SLOTS_SCOPE = "expert_slots"
GROUPED_AXES = ("batch", None, None, "embed")  # [G, E, C, D], token-sharded
EXPERT_AXES = ("experts", "expert_batch", None, "embed")  # [E, G, C, D], expert-sharded
EXPERT_HIDDEN_AXES = ("experts", "expert_batch", None, "mlp")  # [E, G, C, F]


class Router(nnx.Module):
    """Top-k gate: softmax over experts in float32, top-k, renormalised (as Mixtral)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, e = config.d_model, config.n_experts
        self.dtype, self.top_k = config.dtype, config.top_k
        # Router weights stay replicated: every device routes its own tokens.
        self.kernel = param(rngs, fan_in_normal(d), (d, e), ("embed", None), config.param_dtype)

    def __call__(self, x_GTD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Returns (weights [G, T, k] float32 summing to 1, expert ids [G, T, k] int32)."""
        logits_GTE = jnp.einsum(
            "GTD,DE->GTE",
            x_GTD,
            self.kernel[...].astype(self.dtype),
            preferred_element_type=jnp.float32,
        )
        probs_GTE = jax.nn.softmax(logits_GTE, axis=-1)
        weights_GTk, experts_GTk = _top_k(probs_GTE, self.top_k)
        weights_GTk = weights_GTk / jnp.sum(weights_GTk, axis=-1, keepdims=True)
        return weights_GTk, experts_GTk


def _top_k(probs_GTE: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k`` as k rounds of argmax (ties to the lower index, like ``lax.top_k``).

    XLA's SPMD partitioner does not split the TopK custom call along the batch: it gathers
    the router probabilities over every batch axis and routes all tokens on every device.
    Argmax rounds partition like any reduction, with no collective.
    """
    weights, experts = [], []
    for _ in range(k):
        idx_GT = jnp.argmax(probs_GTE, axis=-1).astype(jnp.int32)
        weights.append(jnp.take_along_axis(probs_GTE, idx_GT[..., None], axis=-1)[..., 0])
        experts.append(idx_GT)
        taken_GTE = jax.nn.one_hot(idx_GT, probs_GTE.shape[-1], dtype=jnp.bool_)
        probs_GTE = jnp.where(taken_GTE, -jnp.inf, probs_GTE)
    return jnp.stack(weights, axis=-1), jnp.stack(experts, axis=-1)


class Experts(nnx.Module):
    """E SwiGLU experts with stacked kernels gate/up [E,D,F] and down [E,F,D]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        e, d, f, pd = config.n_experts, config.d_model, config.d_ff, config.param_dtype
        self.dtype = config.dtype
        self.gate_kernel = param(rngs, fan_in_normal(d), (e, d, f), ("experts", "embed", "mlp"), pd)
        self.up_kernel = param(rngs, fan_in_normal(d), (e, d, f), ("experts", "embed", "mlp"), pd)
        self.down_kernel = param(rngs, fan_in_normal(f), (e, f, d), ("experts", "mlp", "embed"), pd)

    def __call__(self, x_EGCD: jax.Array) -> jax.Array:
        """Runs each expert on its own slots: [E, G, C, D] -> [E, G, C, D]."""
        gate_EGCF = jnp.einsum("EGCD,EDF->EGCF", x_EGCD, self.gate_kernel[...].astype(self.dtype))
        up_EGCF = jnp.einsum("EGCD,EDF->EGCF", x_EGCD, self.up_kernel[...].astype(self.dtype))
        h_EGCF = constrain(jax.nn.silu(gate_EGCF) * up_EGCF, EXPERT_HIDDEN_AXES, Module.MOE)
        y_EGCD = jnp.einsum("EGCF,EFD->EGCD", h_EGCF, self.down_kernel[...].astype(self.dtype))
        return constrain(y_EGCD, EXPERT_AXES, Module.MOE)


def dispatch_masks(
    weights_GTk: jax.Array, experts_GTk: jax.Array, n_experts: int, capacity: int
) -> tuple[jax.Array, jax.Array]:
    """One-hot dispatch and weighted combine tensors, both [G, T, E, C].

    Within a group, an expert's slots are filled in token order (a token's top-k experts
    are distinct, so each takes at most one slot per expert). A token whose slot would be
    >= ``capacity`` is dropped for that expert only: its other experts still count and its
    weights are not renormalised.
    """
    onehot_GTkE = jax.nn.one_hot(experts_GTk, n_experts, dtype=jnp.int32)
    chosen_GTE = jnp.sum(onehot_GTkE, axis=2)
    with jax.named_scope(EXPERT_SLOTS_SCOPE):  # jaxpar.inspect names its traffic by this
        slot_GTE = jnp.cumsum(chosen_GTE, axis=1) - 1
    kept_GTE = (chosen_GTE > 0) & (slot_GTE < capacity)
    # one_hot of an out-of-range slot is all zeros, and kept masks the rest.
    dispatch_GTEC = jax.nn.one_hot(jnp.where(kept_GTE, slot_GTE, capacity), capacity)
    weight_GTE = jnp.einsum("GTkE,GTk->GTE", onehot_GTkE.astype(jnp.float32), weights_GTk)
    combine_GTEC = dispatch_GTEC * weight_GTE[..., None]
    return dispatch_GTEC, combine_GTEC


class MoE(nnx.Module):
    """Sparse feed-forward block: route, dispatch to expert slots, run experts, combine."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.router = Router(config, rngs=rngs)
        self.experts = Experts(config, rngs=rngs)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        """x [B, T, D] -> [B, T, D]; each batch row is one dispatch group."""
        with jax.named_scope(Module.MOE.value):
            dtype = self.config.dtype
            x_GTD = constrain(x_BTD, BTD, Module.MOE)
            weights_GTk, experts_GTk = self.router(x_GTD)
            capacity = self.config.expert_capacity(x_GTD.shape[1])
            dispatch, combine = dispatch_masks(
                weights_GTk, experts_GTk, self.config.n_experts, capacity
            )
            x_GECD = jnp.einsum("GTD,GTEC->GECD", x_GTD, dispatch.astype(dtype))
            x_GECD = constrain(x_GECD, GROUPED_AXES, Module.MOE)
            x_EGCD = constrain(x_GECD.transpose(1, 0, 2, 3), EXPERT_AXES, Module.MOE)
            y_EGCD = self.experts(x_EGCD)
            y_GECD = constrain(y_EGCD.transpose(1, 0, 2, 3), GROUPED_AXES, Module.MOE)
            y_GTD = jnp.einsum("GECD,GTEC->GTD", y_GECD, combine.astype(dtype))
            return constrain(y_GTD, BTD, Module.MOE)
