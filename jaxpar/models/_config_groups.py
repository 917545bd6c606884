"""The topic groups of a :class:`~jaxpar.models.ModelConfig`: norms, feed-forward block,
attention, RoPE, sliding window, embeddings, multi-head latent attention, mixture of experts.

Each group is a frozen dataclass whose every field has a default (the plain Llama-style
choice), so a config names only what its model changes. A group checks its own fields in
``__post_init__`` and names them as a config reader spells them (``rope.theta``); what
ties a group to the model's sizes or to another group (a window's flags per layer, MLA's
head width) is checked by ``ModelConfig``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.models._rope_scaling import (
    RopeScaling,
    YarnRopeScaling,
    rope_scaling_from_mapping,
)

NORM_KINDS: tuple[str, ...] = ("rms", "layer")
ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh")
#: How a MoE layer picks its experts: "softmax" (Mixtral, Qwen3-MoE: top-k of the softmax
#: probabilities); "sigmoid_grouped" (DeepSeek-V3: sigmoid scores, a correction bias that
#: steers selection only, the best ``topk_groups`` of ``groups`` expert groups).
MOE_ROUTERS: tuple[str, ...] = ("softmax", "sigmoid_grouped")


def _choice(name: str, value: str, legal: tuple[str, ...]) -> None:
    if value not in legal:
        raise ConfigError(f"{name}={value!r}; legal: {', '.join(legal)}")


def _positive_or_none(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{name} must be None or positive, got {value}")


def changed_fields(group: Any) -> list[str]:
    """The fields of a group that differ from their defaults, in declaration order."""
    return [f.name for f in dataclasses.fields(group) if getattr(group, f.name) != f.default]


@dataclasses.dataclass(frozen=True, kw_only=True)
class NormConfig:
    """The model's norms: their kind and epsilon, and where and how they scale."""

    #: "rms" (Llama and most others) or "layer" (GPT-2's LayerNorm with a bias).
    kind: str = "rms"
    eps: float = 1e-5
    #: Gemma: RMS norms scale by ``1 + w`` (the stored weight is the offset from 1), in
    #: float32 before the cast back (Llama casts first, then scales by ``w``).
    offset: bool = False
    #: GPT-OSS: RMS norms scale by ``w`` in float32, then cast back (as ``offset`` does);
    #: False (Llama): cast the normalised vector first, then scale in its dtype. The same
    #: in float32; in bfloat16 the two round differently.
    scale_f32: bool = False
    #: Gemma 2/3: norms after attention and after the feed-forward block too, before each
    #: residual add (``post_attention_layernorm``, ``post_feedforward_layernorm``).
    sandwich: bool = False
    #: Qwen3, Gemma 3: an RMS norm with its own ``[head_dim]`` scale on every query head and
    #: every key head (``q_norm``, ``k_norm``), after the projections and before RoPE.
    qk: bool = False

    def __post_init__(self) -> None:
        _choice("norms.kind", self.kind, NORM_KINDS)
        if self.eps <= 0:
            raise ConfigError(f"norms.eps must be positive, got {self.eps}")
        if self.kind != "rms":
            rms_only = [n for n in ("offset", "sandwich", "qk") if getattr(self, n)]
            if rms_only:
                names = ", ".join(f"norms.{n}" for n in rms_only)
                raise ConfigError(f"{names}: RMS-norm options; they need norms.kind='rms'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FfnConfig:
    """The feed-forward block: its activation, gating and biases (its width is the model's
    ``d_ff``; the experts' extras are :class:`MoeConfig`'s)."""

    activation: str = "silu"
    #: Whether the block is gated (SwiGLU / GeGLU: ``act(gate) * up``) or plain
    #: (GPT-2: ``act(up)``).
    gated: bool = True
    #: Biases on the projections: the dense block's, or (MoE) every expert's gate, up and
    #: down projections (GPT-OSS).
    bias: bool = False

    def __post_init__(self) -> None:
        _choice("ffn.activation", self.activation, ACTIVATIONS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Attention's biases, score scale, score soft cap and sinks."""

    qkv_bias: bool = False
    out_bias: bool = False
    #: Attention score scale; None: ``head_dim ** -0.5``. Gemma: ``query_pre_attn_scalar
    #: ** -0.5``.
    scale: float | None = None
    #: Gemma 2: scores become ``c * tanh(scores / c)`` before the mask and softmax.
    softcap: float | None = None
    #: GPT-OSS: a learned logit per query head (``sinks [N]``) joins every softmax
    #: denominator, as a key no query reads a value from: a head may attend to nothing.
    sinks: bool = False

    def __post_init__(self) -> None:
        _positive_or_none("attention.scale", self.scale)
        _positive_or_none("attention.softcap", self.softcap)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary position embedding: its base, a frequency scaling, and Gemma 3's second base
    for the sliding layers. Read only with ``positional="rope"``.

    ``scaling`` may be given as a Hugging Face ``rope_scaling`` mapping; it is stored as a
    :class:`~jaxpar.models.Llama3RopeScaling` or :class:`~jaxpar.models.YarnRopeScaling`.
    """

    theta: float = 10000.0
    scaling: RopeScaling | None = None
    #: RoPE base of the sliding layers (Gemma 3's ``rope_local_base_freq``); None: they
    #: use ``theta`` like the others.
    local_theta: float | None = None
    #: Linear RoPE scaling (``rope_type: "linear"``): the inverse frequencies of the layers
    #: on ``theta`` (the global ones when ``local_theta`` is set) divided by it.
    linear_factor: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.scaling, Mapping):
            object.__setattr__(self, "scaling", rope_scaling_from_mapping(self.scaling))
        if self.theta <= 0:
            raise ConfigError(f"rope.theta must be positive, got {self.theta}")
        _positive_or_none("rope.local_theta", self.local_theta)
        _positive_or_none("rope.linear_factor", self.linear_factor)
        if self.linear_factor is not None and self.scaling is not None:
            raise ConfigError("rope.linear_factor and rope.scaling are exclusive")
        if self.local_theta is not None and isinstance(self.scaling, YarnRopeScaling):
            # YaRN's cos/sin factor would reach the local layers too: no model does this.
            raise ConfigError("rope.local_theta with a YaRN rope.scaling is not supported")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowConfig:
    """Sliding-window attention: the window and which layers use it (Gemma's and GPT-OSS's
    local layers interleaved with global ones)."""

    #: Positions a sliding layer attends to (the current one included); None: no window.
    size: int | None = None
    #: One flag per layer, whether it slides; None: every layer does (or none, without a
    #: window). A list is stored as a tuple.
    layers: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.layers, list):
            object.__setattr__(self, "layers", tuple(self.layers))
        _positive_or_none("window.size", self.size)
        if self.size is None and self.layers is not None and any(self.layers):
            raise ConfigError("window.layers marks sliding layers but window.size is None")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbedConfig:
    """The token embedding and the output head (the unembedding)."""

    #: Whether the output head is the token embedding, transposed.
    tied: bool = False
    #: Gemma: token embeddings multiplied by sqrt(d_model), in the compute dtype.
    scale: bool = False
    #: Gemma 2: final logits become ``c * tanh(logits / c)``.
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        _positive_or_none("embed.logit_softcap", self.logit_softcap)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V3), on when ``kv_lora_rank`` is set.

    Keys and values are expanded per head from one compressed latent ``kv_lora_rank``
    wide, which is what the cache keeps, with one RoPE key of ``qk_rope_head_dim`` shared
    by all heads. The cache's layout is then ``n_kv_heads=1`` "head" whose keys are the
    RoPE key and whose values are the latent (:attr:`ModelConfig.cache_kv_dims`); the
    model's ``head_dim`` is the absorbed query's width, ``kv_lora_rank +
    qk_rope_head_dim``.
    """

    kv_lora_rank: int | None = None
    #: The queries' low-rank bottleneck (``q_a_proj`` -> RMS norm -> ``q_b_proj``); None
    #: projects queries directly (``q_proj``).
    q_lora_rank: int | None = None
    #: Per-head query/key widths without and with RoPE, and the value width.
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    #: The RoPE dims of q and k are laid out in interleaved pairs (x0, x1), (x2, x3), ...
    #: (Hugging Face ``rope_interleave``, DeepSeek's default), de-interleaved before
    #: rotating.
    rope_interleave: bool = False

    def __post_init__(self) -> None:
        if self.kv_lora_rank is None:
            if changed_fields(self):
                raise ConfigError(
                    f"{', '.join(f'mla.{n}' for n in changed_fields(self))}: multi-head latent "
                    "attention settings; they need mla.kv_lora_rank"
                )
            return
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"mla.{name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"mla.q_lora_rank must be None or positive, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"mla.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def enabled(self) -> bool:
        """Whether attention is multi-head latent attention."""
        return self.kv_lora_rank is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """How a mixture-of-experts model routes and shapes its experts (their number is the
    model's ``n_experts``; a dense model keeps every default)."""

    #: Experts per token.
    top_k: int = 0
    router: str = "softmax"
    #: Whether a token's top-k routing weights are renormalised to sum to 1 (Hugging Face
    #: ``norm_topk_prob``; Mixtral always does). False keeps the softmax probabilities.
    norm_topk_prob: bool = True
    #: The first layers whose feed-forward block is a dense SwiGLU of width ``dense_d_ff``
    #: (DeepSeek-V3's ``first_k_dense_replace``); the others are mixtures of experts.
    first_dense_layers: int = 0
    dense_d_ff: int = 0
    #: Width of the shared experts, a dense SwiGLU every MoE layer adds to its routed
    #: output (DeepSeek-V3: ``n_shared_experts * moe_intermediate_size``); 0: none.
    shared_d_ff: int = 0
    #: ``router="sigmoid_grouped"``: experts in ``groups`` contiguous groups, each scored
    #: by the sum of its best two biased scores; a token's experts come from the best
    #: ``topk_groups`` groups. The routed weights are multiplied by
    #: ``routed_scaling_factor`` (after renormalising, with ``norm_topk_prob``).
    groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    #: GPT-OSS: the router adds a bias ``[E]`` to its logits before the top-k.
    router_bias: bool = False
    #: GPT-OSS's clamped SwiGLU in the experts: ``(clip(up, -l, l) + 1) * g * sigmoid(a *
    #: g)`` with ``g = min(gate, l)``, l = ``swiglu_limit``, a = ``swiglu_alpha``. None
    #: (both): the plain ``silu(gate) * up``.
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None

    def __post_init__(self) -> None:
        _choice("moe.router", self.router, MOE_ROUTERS)
        if self.top_k < 0:
            raise ConfigError(f"moe.top_k must be >= 0, got {self.top_k}")
        for name in ("first_dense_layers", "dense_d_ff", "shared_d_ff"):
            if getattr(self, name) < 0:
                raise ConfigError(f"moe.{name} must be >= 0, got {getattr(self, name)}")
        if self.first_dense_layers and self.dense_d_ff <= 0:
            raise ConfigError(
                "moe.first_dense_layers > 0 needs the dense layers' width moe.dense_d_ff > 0"
            )
        self._check_router()
        self._check_swiglu()

    def _check_router(self) -> None:
        g, tg = self.groups, self.topk_groups
        if self.router == "softmax":
            if (g, tg, self.routed_scaling_factor) != (1, 1, 1.0):
                raise ConfigError(
                    "moe.groups, moe.topk_groups and moe.routed_scaling_factor belong to "
                    "moe.router='sigmoid_grouped'"
                )
            return
        if g <= 0 or not 1 <= tg <= g:
            raise ConfigError(
                f"moe.groups={g} must be positive and moe.topk_groups={tg} lie in [1, {g}]"
            )
        if self.routed_scaling_factor <= 0:
            raise ConfigError(
                f"moe.routed_scaling_factor must be > 0, got {self.routed_scaling_factor}"
            )

    def _check_swiglu(self) -> None:
        limit, alpha = self.swiglu_limit, self.swiglu_alpha
        if (limit is None) != (alpha is None):
            raise ConfigError(
                "moe.swiglu_limit and moe.swiglu_alpha describe one clamped SwiGLU: set both "
                f"or neither, got swiglu_limit={limit}, swiglu_alpha={alpha}"
            )
        if limit is not None and (limit <= 0 or alpha <= 0):
            raise ConfigError(
                f"moe.swiglu_limit={limit} and moe.swiglu_alpha={alpha} must be positive"
            )


#: ``ModelConfig``'s group fields and their types (a mapping given for one is built into
#: its group).
GROUPS: dict[str, type] = {
    "norms": NormConfig,
    "ffn": FfnConfig,
    "attention": AttentionConfig,
    "rope": RopeConfig,
    "window": WindowConfig,
    "embed": EmbedConfig,
    "mla": MlaConfig,
    "moe": MoeConfig,
}


def group_from_mapping(name: str, m: Mapping[str, Any], **context: Any) -> Any:
    """Builds group ``name`` from a mapping of its fields.

    ``context`` (``max_position_embeddings``) completes a RoPE scaling given as a mapping
    (a YaRN scaling without ``original_max_position_embeddings`` takes the model's).

    Raises:
        ConfigError: a key that is no field of the group (listing the fields).
    """
    cls = GROUPS[name]
    legal = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(m) - set(legal))
    if unknown:
        raise ConfigError(
            f"{name}: unknown field(s) {', '.join(unknown)}; legal: {', '.join(legal)}"
        )
    fields = dict(m)
    scaling = fields.get("scaling")
    if name == "rope" and isinstance(scaling, Mapping):
        fields["scaling"] = rope_scaling_from_mapping(
            scaling, context.get("max_position_embeddings")
        )
    return cls(**fields)
