"""Model configuration: one frozen dataclass for every supported decoder-only architecture."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError

ARCHS: tuple[str, ...] = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen3_moe",
    "deepseek_v3",
    "gpt2",
    "gpt_oss",
)
#: The archs whose feed-forward blocks are mixtures of experts (every layer's but the first
#: ``first_dense_layers``).
MOE_ARCHS: tuple[str, ...] = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
_CHOICES: dict[str, tuple[str, ...]] = {
    "norm": ("rms", "layer"),
    "activation": ("silu", "gelu_tanh"),
    "positional": ("rope", "learned"),
    # How a MoE layer picks its experts: "softmax" (Mixtral, Qwen3-MoE: top-k of the softmax
    # probabilities); "sigmoid_grouped" (DeepSeek-V3: sigmoid scores, a correction bias that
    # steers selection only, the best ``moe_topk_groups`` of ``moe_groups`` expert groups).
    "moe_router": ("softmax", "sigmoid_grouped"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
    """Llama 3.x RoPE frequency scaling (Hugging Face ``rope_type: "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.low_freq_factor <= 0:
            raise ConfigError(f"rope_scaling: factors must be positive, got {self}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                "rope_scaling: high_freq_factor must exceed low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ConfigError("rope_scaling: original_max_position_embeddings must be positive")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> Llama3RopeScaling:
        """Builds the scaling from a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict."""
        kind = m.get("rope_type", m.get("type", "llama3"))
        if kind != "llama3":
            raise ConfigError(f"rope_scaling type {kind!r} is not supported; legal: 'llama3'")
        try:
            return cls(
                factor=float(m["factor"]),
                low_freq_factor=float(m["low_freq_factor"]),
                high_freq_factor=float(m["high_freq_factor"]),
                original_max_position_embeddings=int(m["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ConfigError(f"rope_scaling of type 'llama3' lacks key {e.args[0]!r}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnRopeScaling:
    """YaRN RoPE scaling (Hugging Face ``rope_type: "yarn"``; GPT-OSS, DeepSeek-V3, Qwen).

    Planes that rotate more than ``beta_fast`` times over the original context keep their
    frequency (extrapolation), planes that rotate less than ``beta_slow`` times are divided
    by ``factor`` (interpolation), with a linear ramp in between; cos and sin are then
    multiplied by :attr:`attention_factor` (the paper's softmax temperature, folded into
    q and k). DeepSeek-V3 additionally scales its softmax by ``mscale(factor,
    mscale_all_dim) ** 2``: that is the model's, not the rotation's.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    #: Explicit cos/sin multiplier; None: derived from ``factor`` (and ``mscale`` /
    #: ``mscale_all_dim`` when both are given).
    attention_factor_override: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    #: Whether the correction range is rounded outwards to whole planes (GPT-OSS: False).
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ConfigError(f"rope_scaling (yarn): factor must be >= 1, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError("rope_scaling (yarn): original_max_position_embeddings must be > 0")
        if self.beta_fast <= 0 or self.beta_slow <= 0:
            raise ConfigError(
                f"rope_scaling (yarn): beta_fast={self.beta_fast} and beta_slow={self.beta_slow} "
                "must be positive"
            )
        if self.attention_factor_override is not None and self.attention_factor_override <= 0:
            raise ConfigError("rope_scaling (yarn): attention_factor must be positive")

    @staticmethod
    def mscale_of(factor: float, mscale: float = 1.0) -> float:
        """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    @property
    def attention_factor(self) -> float:
        """The multiplier of cos and sin."""
        if self.attention_factor_override is not None:
            return self.attention_factor_override
        if self.mscale and self.mscale_all_dim:
            return self.mscale_of(self.factor, self.mscale) / self.mscale_of(
                self.factor, self.mscale_all_dim
            )
        return self.mscale_of(self.factor)

    @classmethod
    def from_mapping(
        cls, m: Mapping[str, Any], max_position_embeddings: int | None = None
    ) -> YarnRopeScaling:
        """Builds the scaling from a Hugging Face ``rope_scaling`` dict; a missing
        ``original_max_position_embeddings`` is ``max_position_embeddings`` (as transformers
        standardises it)."""
        original = m.get("original_max_position_embeddings") or max_position_embeddings
        if original is None:
            raise ConfigError(
                "rope_scaling of type 'yarn' lacks 'original_max_position_embeddings'"
            )
        factor = m.get("factor")
        if factor is None:  # transformers: the ratio of the two context lengths
            if max_position_embeddings is None:
                raise ConfigError("rope_scaling of type 'yarn' lacks 'factor'")
            factor = max_position_embeddings / original
        optional = {
            "attention_factor_override": m.get("attention_factor"),
            "mscale": m.get("mscale"),
            "mscale_all_dim": m.get("mscale_all_dim"),
        }
        return cls(
            factor=float(factor),
            original_max_position_embeddings=int(original),
            # transformers treats 0 / None as the defaults (``or``).
            beta_fast=float(m.get("beta_fast") or 32.0),
            beta_slow=float(m.get("beta_slow") or 1.0),
            truncate=bool(m.get("truncate", True)),
            **{k: None if v is None else float(v) for k, v in optional.items()},
        )


#: The RoPE frequency scalings a :class:`ModelConfig` can carry.
RopeScaling = Llama3RopeScaling | YarnRopeScaling
ROPE_SCALINGS: dict[str, type[Llama3RopeScaling] | type[YarnRopeScaling]] = {
    "llama3": Llama3RopeScaling,
    "yarn": YarnRopeScaling,
}


def rope_scaling_from_mapping(
    m: Mapping[str, Any], max_position_embeddings: int | None = None
) -> RopeScaling:
    """The scaling a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict names.

    Raises:
        ConfigError: an unknown ``rope_type`` (listing the legal ones) or a missing key.
    """
    kind = m.get("rope_type", m.get("type", "llama3"))
    if kind not in ROPE_SCALINGS:
        raise ConfigError(
            f"rope_scaling type {kind!r} is not supported; legal: "
            + ", ".join(map(repr, ROPE_SCALINGS))
        )
    if kind == "yarn":
        return YarnRopeScaling.from_mapping(m, max_position_embeddings)
    return Llama3RopeScaling.from_mapping(m)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes and architectural switches of a decoder-only Transformer: what a checkpoint's
    ``config.json`` says. How an engine runs it (kernels, layer form, MoE exchange,
    quantization, a compute dtype of its own) is :class:`~jaxpar.models.ExecutionOptions`;
    no engine rewrites a config.

    Satisfies :class:`jaxpar.spec._dims.ModelDims`. Frozen and hashable, so it can live in
    an NNX graphdef as static data. ``rope_scaling`` may be given as a mapping; it is
    stored as a :class:`Llama3RopeScaling` or :class:`YarnRopeScaling`. Dtypes may be given as names or dtypes.
    """

    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    norm: str = "rms"
    norm_eps: float = 1e-5
    activation: str = "silu"
    gated_ffn: bool = True
    positional: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    out_bias: bool = False
    #: Qwen3: an RMS norm with its own ``[head_dim]`` scale on every query head and every
    #: key head (``q_norm``, ``k_norm``), after the projections and before RoPE.
    qk_norm: bool = False
    #: Biases on the feed-forward projections: the dense FFN's, or (MoE) every expert's
    #: gate, up and down projections (GPT-OSS).
    mlp_bias: bool = False
    tie_embeddings: bool = False
    sliding_window: int | None = None
    #: Which layers use ``sliding_window`` (Gemma's interleaved local and global layers),
    #: one flag per layer; None: every layer does (or none, without a window).
    sliding_layers: tuple[bool, ...] | None = None
    #: RoPE base of the sliding layers (Gemma 3's ``rope_local_base_freq``); None: they
    #: use ``rope_theta`` like the others.
    rope_local_theta: float | None = None
    #: Linear RoPE scaling (``rope_type: "linear"``): the inverse frequencies of the layers
    #: on ``rope_theta`` (the global ones when ``rope_local_theta`` is set) divided by it.
    rope_linear_factor: float | None = None
    #: Gemma: token embeddings multiplied by sqrt(d_model), in the compute dtype.
    embed_scale: bool = False
    #: Gemma: RMS norms scale by ``1 + w`` (the stored weight is the offset from 1), in
    #: float32 before the cast back (Llama casts first, then scales by ``w``).
    norm_offset: bool = False
    #: GPT-OSS: RMS norms scale by ``w`` in float32, then cast back (as ``norm_offset``
    #: does); False (Llama): cast the normalised vector first, then scale in its dtype.
    #: The same in float32; in bfloat16 the two round differently.
    norm_scale_f32: bool = False
    #: Gemma 2/3: norms after attention and after the feed-forward block too, before each
    #: residual add (``post_attention_layernorm``, ``post_feedforward_layernorm``).
    sandwich_norm: bool = False
    #: Attention score scale; None: ``head_dim ** -0.5``. Gemma: ``query_pre_attn_scalar
    #: ** -0.5``.
    attn_scale: float | None = None
    #: Gemma 2: scores become ``c * tanh(scores / c)`` before the mask and softmax.
    attn_softcap: float | None = None
    #: Gemma 2: final logits become ``c * tanh(logits / c)``.
    final_softcap: float | None = None
    #: Multi-head latent attention (DeepSeek-V3) when set: keys and values are expanded per
    #: head from one compressed latent of this width (``kv_lora_rank``), which is what the
    #: cache keeps, with one RoPE key of ``qk_rope_head_dim`` shared by all heads. The
    #: cache's layout is then ``n_kv_heads=1`` "head" whose keys are the RoPE key and whose
    #: values are the latent (:attr:`cache_kv_dims`); ``head_dim`` is the absorbed query's
    #: width, ``kv_lora_rank + qk_rope_head_dim``.
    kv_lora_rank: int | None = None
    #: MLA: the queries' low-rank bottleneck (``q_a_proj`` -> RMS norm -> ``q_b_proj``);
    #: None projects queries directly (``q_proj``).
    q_lora_rank: int | None = None
    #: MLA: per-head query/key widths without and with RoPE, and the value width.
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    #: MLA: the RoPE dims of q and k are laid out in interleaved pairs (x0, x1), (x2, x3), ...
    #: (Hugging Face ``rope_interleave``, DeepSeek's default), de-interleaved before rotating.
    rope_interleave: bool = False
    n_experts: int = 0
    top_k: int = 0
    #: The first layers whose feed-forward block is a dense SwiGLU of width ``dense_d_ff``
    #: (DeepSeek-V3's ``first_k_dense_replace``); the others are mixtures of experts.
    first_dense_layers: int = 0
    dense_d_ff: int = 0
    #: Width of the shared experts, a dense SwiGLU every MoE layer adds to its routed
    #: output (DeepSeek-V3: ``n_shared_experts * moe_intermediate_size``); 0: none.
    shared_d_ff: int = 0
    moe_router: str = "softmax"
    #: ``moe_router="sigmoid_grouped"``: experts in ``moe_groups`` contiguous groups, each
    #: scored by the sum of its best two biased scores; a token's experts come from the
    #: best ``moe_topk_groups`` groups. The routed weights are multiplied by
    #: ``routed_scaling_factor`` (after renormalising, with ``norm_topk_prob``).
    moe_groups: int = 1
    moe_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    #: Whether a token's top-k routing weights are renormalised to sum to 1 (Hugging Face
    #: ``norm_topk_prob``; Mixtral always does). False keeps the softmax probabilities.
    norm_topk_prob: bool = True
    #: The checkpoint's compute and parameter dtypes (an engine may run another:
    #: ``ExecutionOptions.dtype``).
    dtype: Any = "float32"
    param_dtype: Any = "float32"
    #: GPT-OSS: a learned logit per query head (``sinks [N]``) joins every softmax
    #: denominator, as a key no query reads a value from: a head may attend to nothing.
    attn_sinks: bool = False
    #: GPT-OSS: the router adds a bias ``[E]`` to its logits before the top-k.
    router_bias: bool = False
    #: GPT-OSS's clamped SwiGLU in the experts: ``(clip(up, -l, l) + 1) * g * sigmoid(a *
    #: g)`` with ``g = min(gate, l)``, l = ``swiglu_limit``, a = ``swiglu_alpha``. None
    #: (both): the plain ``silu(gate) * up``.
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.sliding_layers, list):
            object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(
                self,
                "rope_scaling",
                rope_scaling_from_mapping(self.rope_scaling, self.max_position_embeddings),
            )
        for name in ("dtype", "param_dtype"):
            object.__setattr__(self, name, float_dtype(name, getattr(self, name)))
        self._check()

    def _check(self) -> None:
        if self.arch not in ARCHS:
            raise ConfigError(f"unknown arch {self.arch!r}; legal: {', '.join(ARCHS)}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.d_ff <= 0 or self.max_position_embeddings <= 0:
            raise ConfigError("d_ff and max_position_embeddings must be positive")
        for name, legal in _CHOICES.items():
            if getattr(self, name) not in legal:
                raise ConfigError(f"{name}={getattr(self, name)!r}; legal: {', '.join(legal)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                "(grouped-query attention shares each kv head among n_heads/n_kv_heads heads)"
            )
        if self.norm_eps <= 0:
            raise ConfigError(f"norm_eps must be positive, got {self.norm_eps}")
        if self.qk_norm and self.norm != "rms":
            raise ConfigError("qk_norm is an RMS norm per head: it needs norm='rms'")
        self._check_positions()
        self._check_gemma()
        self._check_moe()
        self._check_gpt_oss()
        self._check_mla()

    def _check_positions(self) -> None:
        if self.positional == "rope":
            if self.head_dim % 2:
                raise ConfigError(f"RoPE needs an even head_dim, got {self.head_dim}")
            if self.rope_theta <= 0:
                raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")
        elif self.rope_scaling is not None:
            raise ConfigError("rope_scaling is only meaningful with positional='rope'")
        if self.rope_local_theta is not None and isinstance(self.rope_scaling, YarnRopeScaling):
            # YaRN's cos/sin factor would reach the local layers too: no model does this.
            raise ConfigError("rope_local_theta with YaRN rope_scaling is not supported")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be None or positive, got {self.sliding_window}")

    def _check_gemma(self) -> None:
        layers = self.sliding_layers
        if layers is not None:
            if len(layers) != self.n_layers:
                raise ConfigError(
                    f"sliding_layers has {len(layers)} flags for n_layers={self.n_layers}; "
                    "it needs one per layer"
                )
            if self.sliding_window is None and any(layers):
                raise ConfigError("sliding_layers marks sliding layers but sliding_window is None")
        if self.rope_local_theta is not None:
            if self.rope_local_theta <= 0 or self.positional != "rope":
                raise ConfigError(
                    f"rope_local_theta={self.rope_local_theta} needs positional='rope' and > 0"
                )
            if self.sliding_window is None:
                raise ConfigError("rope_local_theta is the sliding layers' base: no sliding_window")
        if self.rope_linear_factor is not None:
            if self.rope_linear_factor <= 0 or self.positional != "rope":
                raise ConfigError(
                    f"rope_linear_factor={self.rope_linear_factor} needs positional='rope', > 0"
                )
            if self.rope_scaling is not None:
                raise ConfigError("rope_linear_factor and rope_scaling are exclusive")
        self._check_gemma_scales()

    def _check_gemma_scales(self) -> None:
        for name in ("attn_scale", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be None or positive, got {value}")
        if (self.norm_offset or self.sandwich_norm) and self.norm != "rms":
            raise ConfigError("norm_offset and sandwich_norm are RMS-norm options: norm='rms'")

    def _check_mla(self) -> None:
        if self.kv_lora_rank is None:
            mla_knobs = (self.q_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim)
            if (
                any(x not in (None, 0) for x in mla_knobs)
                or self.v_head_dim
                or self.rope_interleave
            ):
                raise ConfigError(
                    "q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_interleave "
                    "are multi-head "
                    "latent attention sizes: they need kv_lora_rank"
                )
            return
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"MLA: {name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"MLA: q_lora_rank must be None or positive, got {self.q_lora_rank}")
        width = self.kv_lora_rank + self.qk_rope_head_dim
        if self.n_kv_heads != 1 or self.head_dim != width:
            raise ConfigError(
                f"MLA caches one latent per token: n_kv_heads must be 1 and head_dim "
                f"kv_lora_rank + qk_rope_head_dim = {width}; got n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}"
            )
        self._check_mla_options()

    def _check_mla_options(self) -> None:
        if self.positional != "rope" or self.qk_rope_head_dim % 2:
            raise ConfigError("MLA needs positional='rope' and an even qk_rope_head_dim")
        if self.qkv_bias or self.out_bias or self.qk_norm or self.sliding_window is not None:
            raise ConfigError(
                "MLA has no q/k/v/o biases, q/k norms or sliding window here (attention_bias "
                "and windows are unsupported with kv_lora_rank)"
            )
        if self.attn_softcap is not None:
            raise ConfigError("MLA: attention soft caps are unsupported")

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    @property
    def attention_variant(self) -> str | None:
        """The attention variant whose rows of the spec tables apply (``"mla"``), or None
        for the module's own rows (read by :meth:`jaxpar.spec.SpecTable.for_model`)."""
        return "mla" if self.is_mla else None

    @property
    def cache_kv_dims(self) -> tuple[int, int]:
        """Widths of what the cache keeps per token and kv head, (keys, values).

        Multi-head attention: ``(head_dim, head_dim)`` over ``n_kv_heads`` heads. MLA: one
        "head" holding the shared RoPE key ``qk_rope_head_dim`` wide as its key and the
        compressed latent ``kv_lora_rank`` wide as its value; each head's keys and values
        are expanded from them after the cache (absorbed into the query and output).
        """
        if self.is_mla:
            return self.qk_rope_head_dim, self.kv_lora_rank
        return self.head_dim, self.head_dim

    def layer_is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s feed-forward block is a mixture of experts."""
        return self.is_moe and layer >= self.first_dense_layers

    def layer_slides(self, layer: int) -> bool:
        """Whether layer ``layer`` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return True if self.sliding_layers is None else bool(self.sliding_layers[layer])

    def _check_moe(self) -> None:
        if self.n_experts < 0:
            raise ConfigError(f"n_experts must be >= 0 (0 = dense), got {self.n_experts}")
        if (self.arch in MOE_ARCHS) != self.is_moe:
            raise ConfigError(
                f"arch {self.arch!r} with n_experts={self.n_experts}: only "
                f"{' and '.join(map(repr, MOE_ARCHS))} are mixtures of experts, and they need "
                "n_experts > 0"
            )
        if not self.is_moe:
            moe_knobs = (
                self.top_k,
                not self.norm_topk_prob,
                self.first_dense_layers,
                self.shared_d_ff,
                self.moe_router != "softmax",
            )
            if any(moe_knobs):
                raise ConfigError(
                    "top_k, norm_topk_prob, first_dense_layers, shared_d_ff, moe_router "
                    "need n_experts > 0"
                )
            return
        self._check_moe_layers()
        if not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        if not self.gated_ffn or self.activation != "silu":
            raise ConfigError("experts are SwiGLU: MoE needs gated_ffn=True, activation='silu'")

    def _check_gpt_oss(self) -> None:
        if (self.swiglu_limit is None) != (self.swiglu_alpha is None):
            raise ConfigError(
                "swiglu_limit and swiglu_alpha describe one clamped SwiGLU: set both or neither, "
                f"got swiglu_limit={self.swiglu_limit}, swiglu_alpha={self.swiglu_alpha}"
            )
        if self.swiglu_limit is not None:
            if not self.is_moe:
                raise ConfigError("swiglu_limit/swiglu_alpha shape the experts: need n_experts > 0")
            if self.swiglu_limit <= 0 or self.swiglu_alpha <= 0:
                raise ConfigError(
                    f"swiglu_limit={self.swiglu_limit} and swiglu_alpha={self.swiglu_alpha} "
                    "must be positive"
                )
        if self.router_bias and not self.is_moe:
            raise ConfigError("router_bias needs n_experts > 0 (a dense model has no router)")

    def _check_moe_layers(self) -> None:
        if not 0 <= self.first_dense_layers < self.n_layers:
            raise ConfigError(
                f"first_dense_layers must be in [0, n_layers={self.n_layers}), got "
                f"{self.first_dense_layers}"
            )
        if self.first_dense_layers and self.dense_d_ff <= 0:
            raise ConfigError("first_dense_layers > 0 needs the dense layers' width dense_d_ff > 0")
        if self.shared_d_ff < 0 or self.dense_d_ff < 0:
            raise ConfigError("shared_d_ff and dense_d_ff must be >= 0")
        self._check_moe_router()

    def _check_moe_router(self) -> None:
        g, tg = self.moe_groups, self.moe_topk_groups
        if self.moe_router == "softmax":
            if (g, tg, self.routed_scaling_factor) != (1, 1, 1.0):
                raise ConfigError(
                    "moe_groups, moe_topk_groups and routed_scaling_factor belong to "
                    "moe_router='sigmoid_grouped'"
                )
            return
        if g <= 0 or self.n_experts % g or not 1 <= tg <= g:
            raise ConfigError(
                f"moe_groups={g} must divide n_experts={self.n_experts} and moe_topk_groups={tg} "
                f"lie in [1, {g}]"
            )
        if self.n_experts // g < 2:
            raise ConfigError(
                "sigmoid_grouped scores each group by its best two experts: >= 2 each"
            )
        if self.top_k > tg * (self.n_experts // g):
            raise ConfigError(
                f"top_k={self.top_k} exceeds the {tg * (self.n_experts // g)} experts of the "
                f"moe_topk_groups={tg} groups a token may use"
            )
        if self.routed_scaling_factor <= 0:
            raise ConfigError(
                f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}"
            )

    @property
    def is_moe(self) -> bool:
        """Whether the feed-forward blocks are mixtures of experts."""
        return self.n_experts > 0

    @property
    def q_per_kv(self) -> int:
        """Query heads per kv head (G in einsum strings)."""
        return self.n_heads // self.n_kv_heads

    def check_max_seq_len(self, max_seq_len: int) -> None:
        """Raises if a cache of ``max_seq_len`` positions would outrun the position table.

        Learned positions (GPT-2) have ``max_position_embeddings`` rows; RoPE has no limit.

        Raises:
            ConfigError: ``max_seq_len`` is not positive or exceeds the learned table.
        """
        if max_seq_len <= 0:
            raise ConfigError(f"max_seq_len must be positive, got {max_seq_len}")
        if self.positional == "learned" and max_seq_len > self.max_position_embeddings:
            raise ConfigError(
                f"max_seq_len={max_seq_len} exceeds the {self.max_position_embeddings} learned "
                "positions of this model; lower max_seq_len"
            )


def float_dtype(name: str, value: Any) -> np.dtype:
    try:
        dt = jnp.dtype(value)
    except TypeError:
        raise ConfigError(f"{name}={value!r} is not a dtype") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ConfigError(f"{name} must be a floating dtype, got {dt}")
    return dt


_TINY = dict(
    vocab_size=256, d_model=64, n_layers=4, n_heads=8, head_dim=8, max_position_embeddings=128
)

PRESETS: dict[str, ModelConfig] = {
    "tiny-dense": ModelConfig(arch="llama", n_kv_heads=8, d_ff=128, **_TINY),
    "tiny-gqa": ModelConfig(arch="llama", n_kv_heads=2, d_ff=128, **_TINY),
    "tiny-moe": ModelConfig(arch="mixtral", n_kv_heads=8, d_ff=64, n_experts=8, top_k=2, **_TINY),
    "tiny-gpt2": ModelConfig(
        arch="gpt2",
        n_kv_heads=8,
        d_ff=256,
        norm="layer",
        activation="gelu_tanh",
        gated_ffn=False,
        positional="learned",
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        tie_embeddings=True,
        **_TINY,
    ),
    # Llama-3.2-1B shapes (~1.24B parameters), bfloat16: for GPU benchmarks only.
    "llama-1b": ModelConfig(
        arch="llama",
        vocab_size=128256,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        d_ff=8192,
        rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=131072,
        tie_embeddings=True,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
}


def preset(name: str) -> ModelConfig:
    """Returns the preset configuration called ``name``.

    Raises:
        ConfigError: ``name`` is not a preset; the message lists the presets.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}") from None
