"""Mixture of experts: router, stacked SwiGLU experts, per-device dispatch to expert peers.

The layer runs once per device (a ``shard_map`` over the MoE's logical axes), on all the
tokens that device holds: one dispatch group per device, in both phases (a decode step's
group is the device's B_local tokens, a prefill's its sequences' tokens of one sp shard).
Each device routes its tokens, sorts the (token, expert) assignments by expert
(:mod:`._moe_route`), sends each expert peer its rows (:mod:`._moe_exchange`: padded
all-to-all everywhere, ragged all-to-all of only the routed rows on GPU/TPU), runs its
local experts as one grouped matmul (``ragged_dot``; masked batched matmuls on XLA:CPU,
whose ``ragged_dot`` lowering copies the kernels) on the rows it received, sends the
(tensor-parallel partial) outputs back, combines each token's experts, and only then sums
the partials over tp: n token rows, as a dense FFN's down projection.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models import _moe_exchange as xchg
from jaxpar.models import _moe_route as route
from jaxpar.models._config import ModelConfig
from jaxpar.models._layers import BTD, FFN, ZEROS, bias_init, fan_in_normal, kernel, param
from jaxpar.models._moe_stats import record_dropped
from jaxpar.models._quant import scale_layout
from jaxpar.models._run import ModelRun
from jaxpar.spec import Module, active_mesh_axes, active_platform, constrain, logical_shard_map

#: Named scope around the exchange and the expert computation on received rows; the
#: collectives inside it are the MoE's token traffic (jaxpar.inspect classifies by it).
EXPERT_ROWS_SCOPE = "expert_rows"
#: The exchanges ``moe_dispatch`` may name once resolved.
MOE_PATHS = ("padded", "ragged")
ROUTER_AXES = ("embed", None)
GATE_UP_AXES = ("experts", "embed", "mlp")  # [E, D, F]
DOWN_AXES = ("experts", "mlp", "embed")  # [E, F, D]
DROPPED_AXES = ("batch", "seq")  # per-device drop counts, [1, 1] on each device
ROUTER_BIAS_AXES = (None,)  # [E], replicated like the router kernel
GATE_UP_BIAS_AXES = ("experts", "mlp")  # [E, F]
DOWN_BIAS_AXES = ("experts", "embed")  # [E, D]


def route_tokens(
    x_nD: jax.Array,
    kernel_DE: jax.Array,
    top_k: int,
    normalize: bool = True,
    bias_E: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Mixtral's and Qwen3-MoE's gate: softmax over experts in float32, top-k, renormalised
    (``normalize``, Hugging Face ``norm_topk_prob``) or not.

    GPT-OSS's gate (logits plus ``bias_E``, top-k of the logits, softmax over the k chosen)
    is this one with ``normalize``: the softmax is monotonic, so the same k win, and
    ``p_i / sum_k p_j = exp(l_i) / sum_k exp(l_j)``.

    Returns (weights [n, k] float32, summing to 1 if ``normalize``; expert ids [n, k] int32).
    """
    logits_nE = jnp.einsum(
        "nD,DE->nE", x_nD, kernel_DE.astype(x_nD.dtype), preferred_element_type=jnp.float32
    )
    if bias_E is not None:
        logits_nE = logits_nE + bias_E.astype(jnp.float32)
    probs_nE = jax.nn.softmax(logits_nE, axis=-1)
    weights_nk, experts_nk = _top_k(probs_nE, top_k)
    if normalize:
        weights_nk = weights_nk / jnp.sum(weights_nk, axis=-1, keepdims=True)
    return weights_nk, experts_nk


@dataclasses.dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek-V3's group-limited routing settings (``moe.router="sigmoid_grouped"``)."""

    groups: int
    topk_groups: int
    scale: float


def route_grouped(
    x_nD: jax.Array,
    kernel_DE: jax.Array,
    bias_E: jax.Array,
    top_k: int,
    normalize: bool,
    grouped: GroupedRouting,
) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's gate, all in float32: sigmoid scores; the correction bias added for the
    choice only; experts in ``groups`` contiguous groups, each scored by the sum of its two
    best biased scores; a token picks its top-k experts within its best ``topk_groups``
    groups; the weights are the unbiased scores of those experts, renormalised (``normalize``)
    and multiplied by ``scale`` (``moe.routed_scaling_factor``).

    Returns (weights [n, k] float32, expert ids [n, k] int32).
    """
    logits_nE = jnp.einsum(
        "nD,DE->nE",
        x_nD.astype(jnp.float32),
        kernel_DE.astype(jnp.float32),
        preferred_element_type=jnp.float32,
    )
    scores_nE = jax.nn.sigmoid(logits_nE)
    choice_nE = scores_nE + bias_E.astype(jnp.float32)
    n, e = choice_nE.shape
    g = grouped.groups
    best2_nG2, _ = jax.lax.top_k(choice_nE.reshape(n, g, e // g), 2)
    group_nG = jnp.sum(best2_nG2, axis=-1)
    _, groups_nk = _top_k(group_nG, grouped.topk_groups)
    keep_nG = jnp.any(jax.nn.one_hot(groups_nk, g, dtype=jnp.bool_), axis=1)
    keep_nE = jnp.repeat(keep_nG, e // g, axis=1)
    _, experts_nk = _top_k(jnp.where(keep_nE, choice_nE, -jnp.inf), top_k)
    weights_nk = jnp.take_along_axis(scores_nE, experts_nk, axis=-1)
    if normalize:
        weights_nk = weights_nk / (jnp.sum(weights_nk, axis=-1, keepdims=True) + 1e-20)
    return weights_nk * jnp.float32(grouped.scale), experts_nk


class Router(nnx.Module):
    """Top-k gate (:func:`route_tokens`, or :func:`route_grouped` with its correction bias
    ``[E]``, kept in float32 as transformers does); its ``[D, E]`` kernel stays replicated:
    every device routes its own tokens."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, e, pd = config.d_model, config.n_experts, config.param_dtype
        self.dtype, self.top_k, self.normalize = (
            config.dtype,
            config.moe.top_k,
            config.moe.norm_topk_prob,
        )
        self.kernel = param(rngs, fan_in_normal(d), (d, e), ROUTER_AXES, pd)
        if config.moe.router == "sigmoid_grouped":  # DeepSeek's correction bias, float32
            self.bias = param(rngs, ZEROS, (e,), ROUTER_BIAS_AXES, jnp.float32)
            self.grouped = grouped_routing(config)
        else:  # GPT-OSS's logit bias, or none
            self.bias = (
                bias_init(rngs, (e,), ROUTER_BIAS_AXES, pd) if config.moe.router_bias else None
            )
            self.grouped = None

    def __call__(self, x_nD: jax.Array) -> tuple[jax.Array, jax.Array]:
        bias = None if self.bias is None else self.bias[...]
        x_nD = x_nD.astype(self.dtype)
        if self.grouped is not None:
            return route_grouped(
                x_nD, self.kernel[...], bias, self.top_k, self.normalize, self.grouped
            )
        return route_tokens(x_nD, self.kernel[...], self.top_k, self.normalize, bias)


def grouped_routing(config: ModelConfig | ModelRun) -> GroupedRouting:
    """DeepSeek-V3's group-limited routing settings of ``config``."""
    return GroupedRouting(
        config.moe.groups, config.moe.topk_groups, config.moe.routed_scaling_factor
    )


def _top_k(probs_nE: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k`` as k rounds of argmax (ties to the lower index, like ``lax.top_k``)."""
    weights, experts = [], []
    for _ in range(k):
        idx_n = jnp.argmax(probs_nE, axis=-1).astype(jnp.int32)
        weights.append(jnp.take_along_axis(probs_nE, idx_n[..., None], axis=-1)[..., 0])
        experts.append(idx_n)
        taken_nE = jax.nn.one_hot(idx_n, probs_nE.shape[-1], dtype=jnp.bool_)
        probs_nE = jnp.where(taken_nE, -jnp.inf, probs_nE)
    return jnp.stack(weights, axis=-1), jnp.stack(experts, axis=-1)


class Experts(nnx.Module):
    """E SwiGLU experts with stacked kernels gate/up [E,D,F] and down [E,F,D].

    Quantized under ``config.quantize`` as every dense kernel is, per expert: each kernel
    has a ``<name>_scale`` ``[E, 1, F]`` / ``[E, 1, D]`` (int4: ``[E, D // group, F]`` /
    ``[E, F // group, D]``), split over ep with its experts and over tp with its columns
    (gate/up) or row groups (down); see :mod:`jaxpar.models._moe_matmul`.
    """

    def __init__(self, config: ModelConfig | ModelRun, *, rngs: nnx.Rngs):
        config = ModelRun.of(config)
        e, d, f, pd = config.n_experts, config.d_model, config.d_ff, config.param_dtype
        gate_up, down = (e, d, f), (e, f, d)
        # Quantized (config.quantize): each kernel has a <name>_scale, else None.
        self.gate_kernel, self.gate_kernel_scale = kernel(
            rngs, fan_in_normal(d), gate_up, GATE_UP_AXES, config, batch=1
        )
        self.up_kernel, self.up_kernel_scale = kernel(
            rngs, fan_in_normal(d), gate_up, GATE_UP_AXES, config, batch=1
        )
        self.down_kernel, self.down_kernel_scale = kernel(
            rngs, fan_in_normal(f), down, DOWN_AXES, config, batch=1
        )
        # GPT-OSS (config.ffn.bias): each expert's gate, up and down biases.
        biased = config.ffn.bias
        self.gate_bias = bias_init(rngs, (e, f), GATE_UP_BIAS_AXES, pd) if biased else None
        self.up_bias = bias_init(rngs, (e, f), GATE_UP_BIAS_AXES, pd) if biased else None
        self.down_bias = bias_init(rngs, (e, d), DOWN_BIAS_AXES, pd) if biased else None

    def scales(
        self, mode: str | None
    ) -> tuple[tuple[jax.Array, ...], tuple[tuple[str | None, ...], ...]]:
        """((gate, up, down) scales, their logical axes), or ((), ()) when float. The axes
        are derived again from the kernels' (not read off the variables, whose metadata
        names the stacked ``layers`` dim inside a scan over layers)."""
        if self.gate_kernel_scale is None:
            return (), ()
        kernels = (self.gate_kernel, self.up_kernel, self.down_kernel)
        axes = (GATE_UP_AXES, GATE_UP_AXES, DOWN_AXES)
        found = (self.gate_kernel_scale, self.up_kernel_scale, self.down_kernel_scale)
        return tuple(s[...] for s in found), tuple(
            scale_layout(k.shape, a, 1, mode, batch=1)[1]
            for k, a in zip(kernels, axes, strict=True)
        )

    def biases(self) -> tuple[jax.Array, ...]:
        """(gate [E, F], up [E, F], down [E, D]) biases, or () when the experts have none."""
        if self.gate_bias is None:
            return ()
        return (self.gate_bias[...], self.up_bias[...], self.down_bias[...])


@dataclasses.dataclass(frozen=True)
class _Local:
    """The per-device MoE: static settings of one traced layer."""

    n_experts: int
    top_k: int
    normalize: bool
    capacity_factor: float | None
    path: str
    dtype: jnp.dtype
    expert_axes: tuple[str, ...]
    mlp_axes: tuple[str, ...]
    cpu: bool = False
    #: A router bias array is the first extra argument after any scales (GPT-OSS's logit
    #: bias, DeepSeek's correction bias); GPT-OSS's clamped SwiGLU's (limit, alpha); expert
    #: biases arrive as the last three extra arguments when present.
    router_bias: bool = False
    clamp: tuple[float, float] | None = None
    grouped: GroupedRouting | None = None
    #: Quantized kernels: their (gate, up, down) scales are the first three extra arguments.
    quantized: bool = False

    def __call__(self, x_btD, router_DE, gate_EDF, up_EDF, down_EFD, *extra):
        b, t, d = x_btD.shape
        x_nD = x_btD.reshape(b * t, d).astype(self.dtype)
        scales, extra = (extra[:3], extra[3:]) if self.quantized else (None, extra)
        bias_E = extra[0] if self.router_bias else None
        biases = extra[1:] if self.router_bias else extra  # () or (gate, up, down)
        if self.grouped is None:
            weights_nk, experts_nk = route_tokens(
                x_nD, router_DE, self.top_k, self.normalize, bias_E
            )
        else:
            weights_nk, experts_nk = route_grouped(
                x_nD, router_DE, bias_E, self.top_k, self.normalize, self.grouped
            )
        peers = self.n_experts // gate_EDF.shape[0]
        cap = route.capacity_rows(b * t, self.top_k, self.n_experts, peers, self.capacity_factor)
        plan = route.send_plan(experts_nk, self.n_experts, peers, cap)
        # Cast where each matmul reads them (a quantized kernel is the dot's operand).
        weights = (gate_EDF, up_EDF, down_EFD)
        with jax.named_scope(EXPERT_ROWS_SCOPE):
            counts_PE, offsets_P = xchg.exchange_counts(plan, self.expert_axes)
            if self.path == "ragged":
                sent = route.sorted_rows(x_nD, plan)
                rows = xchg.ragged_dispatch(sent, plan, counts_PE, cap, self.expert_axes)
            else:
                rows = xchg.padded_dispatch(
                    route.pack_rows(x_nD, plan, peers * cap), peers, self.expert_axes
                )
            y_RD = self._experts(rows, counts_PE, cap, weights, biases, scales)
            if self.path == "ragged":
                back = xchg.ragged_combine(
                    y_RD, plan, counts_PE, offsets_P, sent.shape[0], self.expert_axes
                )
                index_A = plan.rank_A
            else:
                back, index_A = xchg.padded_combine(y_RD, peers, self.expert_axes), plan.slot_A
        out_nD = route.combine(back, index_A, weights_nk, plan)
        if self.mlp_axes:
            # The down projection is row-parallel over tp, so rows carry partial sums. The
            # combine is linear: summing after it reduces n token rows, not the P x C
            # received rows (nor even the top_k x n routed ones).
            out_nD = jax.lax.psum(out_nD, self.mlp_axes)
        return out_nD.reshape(b, t, d), plan.dropped.reshape(1, 1)

    def _experts(self, rows_RD, counts_PE, cap, weights, biases=(), scales=None):
        """The local experts on the received rows, grouped by expert (tp partial sums)."""
        recv = route.receive_plan(counts_PE, cap)
        # XLA:CPU lowers ragged_dot to a masked dense dot that copies the expert kernels.
        # int4 experts of several groups per column need ragged_dot_general with the groups
        # as a batch dim, which libtpu's compiler aborts on under ep (compile-only check,
        # v5e): they run the masked matmuls everywhere (each local expert's kernel read
        # once, E_l times the routed rows' FLOPs).
        grouped_int4 = scales is not None and scales[0].shape[1] > 1
        swiglu = route.masked_swiglu if self.cpu or grouped_int4 else route.grouped_swiglu
        swiglu = functools.partial(swiglu, scales=scales)
        glu = route.silu_glu
        if self.clamp is not None:
            glu = functools.partial(route.clamped_glu, limit=self.clamp[0], alpha=self.clamp[1])
        rows_RD = rows_RD[recv.order_R]
        if not biases:
            y_RD = swiglu(rows_RD, recv.group_sizes_E, *weights, glu=glu)
        else:
            y_RD = self._biased_experts(rows_RD, recv.group_sizes_E, weights, biases, swiglu, glu)
        return jnp.zeros_like(y_RD).at[recv.order_R].set(y_RD)

    def _biased_experts(self, rows_RD, group_sizes_E, weights, biases, swiglu, glu):
        """GPT-OSS's experts: each row's expert's biases gathered per row (zeros past the
        groups). The down bias is added on one tp rank only: the rows are tp partial sums,
        summed after the combine, and the bias must count once."""
        expert_R = route.expert_of_rows(group_sizes_E, rows_RD.shape[0])
        gate_RF, up_RF, down_RD = (
            b.astype(self.dtype).at[expert_R].get(mode="fill", fill_value=0) for b in biases
        )
        y_RD = swiglu(rows_RD, group_sizes_E, *weights, gate_RF, up_RF, glu=glu)
        if self.mlp_axes:
            down_RD = jnp.where(jax.lax.axis_index(self.mlp_axes) == 0, down_RD, 0)
        return y_RD + down_RD


class MoE(nnx.Module):
    """Sparse feed-forward block: route, dispatch to expert peers, run experts, combine."""

    def __init__(self, config: ModelConfig | ModelRun, *, rngs: nnx.Rngs):
        config = ModelRun.of(config)
        self.config = config
        self.router = Router(config, rngs=rngs)
        self.experts = Experts(config, rngs=rngs)
        # DeepSeek's shared experts: a dense SwiGLU every token runs, added to the routed sum.
        shared = config.moe.shared_d_ff
        self.shared = FFN(config, rngs=rngs, d_ff=shared) if shared else None

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        """x [B, T, D] -> [B, T, D]; each device's tokens are one dispatch group.

        With a capacity factor, the per-device drop counts are recorded for the engine
        (:func:`~jaxpar.models._moe_stats.count_dropped`).
        """
        c = self.config
        with jax.named_scope(Module.MOE.value):
            x_BTD = constrain(x_BTD, BTD, Module.MOE)
            e = self.experts
            scales, scale_axes = e.scales(
                c.quantize
            )  # split as their kernels: experts, mlp columns
            local = _Local(
                n_experts=c.n_experts,
                top_k=c.moe.top_k,
                normalize=c.moe.norm_topk_prob,
                capacity_factor=c.moe_capacity_factor,
                path="ragged" if c.moe_dispatch == "ragged" else "padded",
                dtype=c.dtype,
                expert_axes=active_mesh_axes("experts", Module.MOE),
                mlp_axes=active_mesh_axes("mlp", Module.MOE),
                cpu=active_platform() == "cpu",
                router_bias=self.router.bias is not None,
                clamp=None
                if c.moe.swiglu_limit is None
                else (c.moe.swiglu_limit, c.moe.swiglu_alpha),
                grouped=self.router.grouped,
                quantized=bool(scales),
            )
            args = [x_BTD, self.router.kernel[...], e.gate_kernel[...], e.up_kernel[...]]
            args.append(e.down_kernel[...])
            in_axes = [BTD, ROUTER_AXES, GATE_UP_AXES, GATE_UP_AXES, DOWN_AXES]
            args += scales
            in_axes += scale_axes
            if self.router.bias is not None:
                args.append(self.router.bias[...])
                in_axes.append(ROUTER_BIAS_AXES)
            if c.ffn.bias:
                args += e.biases()
                in_axes += [GATE_UP_BIAS_AXES, GATE_UP_BIAS_AXES, DOWN_BIAS_AXES]
            run = logical_shard_map(
                local, tuple(in_axes), (BTD, DROPPED_AXES), Module.MOE, multiple_outputs=True
            )
            y_BTD, dropped = run(*args)
            if c.moe_capacity_factor is not None:
                record_dropped(dropped)
            y_BTD = constrain(y_BTD.astype(x_BTD.dtype), BTD, Module.MOE)
        if self.shared is None:
            return y_BTD
        # Outside the MoE scope: the shared experts are an FFN block (its own tp row and
        # all-reduce, which the inspection counts as the FFN's).
        return y_BTD + self.shared(x_BTD)
