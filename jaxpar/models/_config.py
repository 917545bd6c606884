"""Model configuration: one frozen dataclass for every supported decoder-only architecture."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.models._config_groups import (
    GROUPS,
    AttentionConfig,
    EmbedConfig,
    FfnConfig,
    MlaConfig,
    MoeConfig,
    NormConfig,
    RopeConfig,
    WindowConfig,
    changed_fields,
    group_from_mapping,
)
from jaxpar.models._rope_scaling import (
    ROPE_SCALINGS,
    DynamicRopeScaling,
    LinearRopeScaling,
    Llama3RopeScaling,
    RopeScaling,
    YarnRopeScaling,
    rope_scaling_from_mapping,
)

__all__ = [
    "ARCHS",
    "MOE_ARCHS",
    "PRESETS",
    "ROPE_SCALINGS",
    "DynamicRopeScaling",
    "LinearRopeScaling",
    "AttentionConfig",
    "EmbedConfig",
    "FfnConfig",
    "Llama3RopeScaling",
    "MlaConfig",
    "ModelConfig",
    "MoeConfig",
    "NormConfig",
    "RopeConfig",
    "RopeScaling",
    "WindowConfig",
    "YarnRopeScaling",
    "float_dtype",
    "preset",
    "rope_scaling_from_mapping",
]

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
#: ``moe.first_dense_layers``).
MOE_ARCHS: tuple[str, ...] = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
POSITIONALS: tuple[str, ...] = ("rope", "learned")
_CORE_SIZES = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes and architectural switches of a decoder-only Transformer: what a checkpoint's
    ``config.json`` says. How an engine runs it (kernels, layer form, MoE exchange,
    quantization, a compute dtype of its own) is :class:`~jaxpar.models.ExecutionOptions`;
    no engine rewrites a config.

    The sizes every model has are fields of their own; the rest is grouped by topic
    (:attr:`norms`, :attr:`ffn`, :attr:`attention`, :attr:`rope`, :attr:`window`,
    :attr:`embed`, :attr:`mla`, :attr:`moe`), each group a frozen dataclass whose defaults
    are the plain Llama-style choices, so a config names only the groups its model changes.
    A group may be given as a mapping of its fields; it is stored as its dataclass. Each
    group checks its own fields; this class checks what ties them to the sizes and to each
    other, and its errors name fields as they are read (``rope.theta``).

    Satisfies :class:`jaxpar.spec._dims.ModelDims`. Frozen and hashable, so it can live in
    an NNX graphdef as static data. Dtypes may be given as names or dtypes.
    """

    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    #: The feed-forward width: the dense block's, or each expert's in a mixture of experts.
    d_ff: int
    #: Routed experts per MoE layer; 0: a dense model (how they route: :attr:`moe`).
    n_experts: int = 0
    max_position_embeddings: int = 2048
    #: "rope" (rotary, :attr:`rope`) or "learned" (GPT-2's position table of
    #: ``max_position_embeddings`` rows).
    positional: str = "rope"
    #: The checkpoint's compute and parameter dtypes (an engine may run another:
    #: ``ExecutionOptions.dtype``).
    dtype: Any = "float32"
    param_dtype: Any = "float32"
    norms: NormConfig = NormConfig()
    ffn: FfnConfig = FfnConfig()
    attention: AttentionConfig = AttentionConfig()
    rope: RopeConfig = RopeConfig()
    window: WindowConfig = WindowConfig()
    embed: EmbedConfig = EmbedConfig()
    mla: MlaConfig = MlaConfig()
    moe: MoeConfig = MoeConfig()

    def __post_init__(self) -> None:
        for name, cls in GROUPS.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):
                value = group_from_mapping(
                    name, value, max_position_embeddings=self.max_position_embeddings
                )
                object.__setattr__(self, name, value)
            elif not isinstance(value, cls):
                raise ConfigError(
                    f"{name} must be a {cls.__name__} (or a mapping of its fields), got "
                    f"{type(value).__name__}"
                )
        for name in ("dtype", "param_dtype"):
            object.__setattr__(self, name, float_dtype(name, getattr(self, name)))
        self._check()

    def _check(self) -> None:
        if self.arch not in ARCHS:
            raise ConfigError(f"unknown arch {self.arch!r}; legal: {', '.join(ARCHS)}")
        for name in _CORE_SIZES:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_position_embeddings <= 0:
            raise ConfigError(
                f"max_position_embeddings must be positive, got {self.max_position_embeddings}"
            )
        if self.positional not in POSITIONALS:
            raise ConfigError(f"positional={self.positional!r}; legal: {', '.join(POSITIONALS)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                "(grouped-query attention shares each kv head among n_heads/n_kv_heads heads)"
            )
        self._check_positions()
        self._check_window()
        self._check_moe()
        self._check_mla()

    def _check_positions(self) -> None:
        rope = self.rope
        if self.positional == "rope":
            if self.head_dim % 2:
                raise ConfigError(f"RoPE needs an even head_dim, got {self.head_dim}")
            if self.is_mla and isinstance(rope.scaling, DynamicRopeScaling):
                raise ConfigError(
                    "rope.scaling: dynamic NTK is not built for multi-head latent attention "
                    "(its RoPE key is cached apart); legal there: None, 'llama3', 'yarn', 'linear'"
                )
            return
        named = [n for n in ("scaling", "local_theta", "linear_factor") if getattr(rope, n)]
        if named:
            raise ConfigError(
                f"{', '.join(f'rope.{n}' for n in named)}: only meaningful with positional='rope'"
            )

    def _check_window(self) -> None:
        layers = self.window.layers
        if layers is not None and len(layers) != self.n_layers:
            raise ConfigError(
                f"window.layers has {len(layers)} flags for n_layers={self.n_layers}; "
                "it needs one per layer"
            )
        if self.rope.local_theta is not None and self.window.size is None:
            raise ConfigError("rope.local_theta is the sliding layers' base: it needs window.size")

    def _check_mla(self) -> None:
        if not self.is_mla:
            return
        mla = self.mla
        width = mla.kv_lora_rank + mla.qk_rope_head_dim
        if self.n_kv_heads != 1 or self.head_dim != width:
            raise ConfigError(
                f"MLA caches one latent per token: n_kv_heads must be 1 and head_dim "
                f"mla.kv_lora_rank + mla.qk_rope_head_dim = {width}; got "
                f"n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}"
            )
        if self.positional != "rope":
            raise ConfigError("MLA needs positional='rope'")
        attn = self.attention
        if attn.qkv_bias or attn.out_bias or self.norms.qk or self.window.size is not None:
            raise ConfigError(
                "MLA has no q/k/v/o biases, q/k norms or sliding window here "
                "(attention.qkv_bias, attention.out_bias, norms.qk and window.size must be "
                "unset with mla.kv_lora_rank)"
            )
        if attn.softcap is not None:
            raise ConfigError("MLA: attention.softcap (attention soft caps) is unsupported")

    def _check_moe(self) -> None:
        if self.n_experts < 0:
            raise ConfigError(f"n_experts must be >= 0 (0 = dense), got {self.n_experts}")
        if (self.arch in MOE_ARCHS) != self.is_moe:
            raise ConfigError(
                f"arch {self.arch!r} with n_experts={self.n_experts}: only "
                f"{' and '.join(map(repr, MOE_ARCHS))} are mixtures of experts, and they need "
                "n_experts > 0"
            )
        moe, e = self.moe, self.n_experts
        if not self.is_moe:
            changed = changed_fields(moe)
            if changed:
                raise ConfigError(
                    f"{', '.join(f'moe.{n}' for n in changed)}: expert settings; they need "
                    "n_experts > 0 (a dense model has no router or experts)"
                )
            return
        if not 1 <= moe.top_k <= e:
            raise ConfigError(f"moe.top_k must be in [1, n_experts={e}], got {moe.top_k}")
        if moe.first_dense_layers >= self.n_layers:
            raise ConfigError(
                f"moe.first_dense_layers must be in [0, n_layers={self.n_layers}), got "
                f"{moe.first_dense_layers}"
            )
        if not self.ffn.gated or self.ffn.activation != "silu":
            raise ConfigError("experts are SwiGLU: MoE needs ffn.gated=True, ffn.activation='silu'")
        if moe.router == "sigmoid_grouped":
            self._check_groups()

    def _check_groups(self) -> None:
        g, tg, e = self.moe.groups, self.moe.topk_groups, self.n_experts
        if e % g:
            raise ConfigError(f"moe.groups={g} must divide n_experts={e}")
        if e // g < 2:
            raise ConfigError(
                "moe.router='sigmoid_grouped' scores each group by its best two experts: "
                f">= 2 each (n_experts={e} / moe.groups={g})"
            )
        if self.moe.top_k > tg * (e // g):
            raise ConfigError(
                f"moe.top_k={self.moe.top_k} exceeds the {tg * (e // g)} experts of the "
                f"moe.topk_groups={tg} groups a token may use"
            )

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (``mla.kv_lora_rank`` set)."""
        return self.mla.enabled

    @property
    def attention_variant(self) -> str | None:
        """The attention variant whose rows of the spec tables apply (``"mla"``), or None
        for the module's own rows (read by :meth:`jaxpar.spec.SpecTable.for_model`)."""
        return "mla" if self.is_mla else None

    @property
    def cache_kv_dims(self) -> tuple[int, int]:
        """Widths of what the cache keeps per token and kv head, (keys, values).

        Multi-head attention: ``(head_dim, head_dim)`` over ``n_kv_heads`` heads. MLA: one
        "head" holding the shared RoPE key ``mla.qk_rope_head_dim`` wide as its key and the
        compressed latent ``mla.kv_lora_rank`` wide as its value; each head's keys and
        values are expanded from them after the cache (absorbed into the query and output).
        """
        if self.is_mla:
            return self.mla.qk_rope_head_dim, self.mla.kv_lora_rank
        return self.head_dim, self.head_dim

    def layer_is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s feed-forward block is a mixture of experts."""
        return self.is_moe and layer >= self.moe.first_dense_layers

    def layer_slides(self, layer: int) -> bool:
        """Whether layer ``layer`` attends through the sliding window."""
        if self.window.size is None:
            return False
        layers = self.window.layers
        return True if layers is None else bool(layers[layer])

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
    "tiny-moe": ModelConfig(
        arch="mixtral", n_kv_heads=8, d_ff=64, n_experts=8, moe=MoeConfig(top_k=2), **_TINY
    ),
    "tiny-gpt2": ModelConfig(
        arch="gpt2",
        n_kv_heads=8,
        d_ff=256,
        positional="learned",
        norms=NormConfig(kind="layer"),
        ffn=FfnConfig(activation="gelu_tanh", gated=False, bias=True),
        attention=AttentionConfig(qkv_bias=True, out_bias=True),
        embed=EmbedConfig(tied=True),
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
        rope=RopeConfig(
            theta=500000.0,
            scaling=Llama3RopeScaling(
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
        max_position_embeddings=131072,
        embed=EmbedConfig(tied=True),
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
