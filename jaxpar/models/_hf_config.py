"""Hugging Face ``config.json`` -> :class:`ModelConfig`: the one place that maps Hugging
Face's names onto jaxpar's fields, for every family."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.models._config import ModelConfig
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
)
from jaxpar.models._rope_scaling import (
    ROPE_SCALINGS,
    DynamicRopeScaling,
    LinearRopeScaling,
    RopeScaling,
    YarnRopeScaling,
    rope_scaling_from_mapping,
)

#: Hugging Face architecture class -> jaxpar arch.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GPT2LMHeadModel": "gpt2",
    "GptOssForCausalLM": "gpt_oss",
}
_MODEL_TYPES = {v: v for v in SUPPORTED_ARCHITECTURES.values() if v != "gemma3"}
_MODEL_TYPES["gemma3_text"] = "gemma3"  # "gemma3" is the multimodal model: not supported
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")


def hf_arch(hf: Mapping[str, Any], source: str) -> str:
    """The jaxpar arch of a Hugging Face config, from ``architectures`` or ``model_type``."""
    names = list(hf.get("architectures") or [])
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    if not names and hf.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[hf["model_type"]]
    found = ", ".join(names) or f"model_type={hf.get('model_type')!r}"
    raise CheckpointError(
        f"{source}: unsupported architecture {found}; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def stored_quantization(hf: Mapping[str, Any], *, source: str) -> str | None:
    """The weight quantization a checkpoint runs in as stored ("fp8" for the pre-quantized
    formats jaxpar loads), None for a float checkpoint or GPT-OSS's MXFP4 (dequantized at
    load).

    Raises:
        CheckpointError: a ``quantization_config`` jaxpar does not load.
    """
    from jaxpar.models._hf_mxfp4 import is_mxfp4
    from jaxpar.models._hf_quant import prequantized

    if is_mxfp4(hf, hf_arch(hf, source), source):
        return None
    prequant = prequantized(hf, source)
    return None if prequant is None else prequant.mode


def config_from_hf(hf: Mapping[str, Any], *, source: str) -> ModelConfig:
    """Builds the :class:`ModelConfig` a Hugging Face ``config.json`` describes: the
    architecture as stored, its dtype the checkpoint's ``dtype`` / ``torch_dtype`` (else
    float32). How it runs (another dtype, quantization, layer form) is an
    :class:`~jaxpar.models.ExecutionOptions`.

    Args:
        hf: Parsed ``config.json``.
        source: File name for error messages.

    Raises:
        CheckpointError: Unsupported architecture or option, or a missing key.
    """
    from jaxpar.models._hf_mxfp4 import is_mxfp4
    from jaxpar.models._hf_quant import check_model, prequantized

    arch = hf_arch(hf, source)
    # MXFP4 experts (GPT-OSS) are dequantized at load: a float model. Any other
    # quantization_config jaxpar does not load is refused by prequantized.
    prequant = None if is_mxfp4(hf, arch, source) else prequantized(hf, source)
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    try:
        if arch == "gpt2":
            fields = _gpt2_fields(hf, source)
        elif arch in ("gemma2", "gemma3"):
            fields = _gemma_fields(hf, arch, source)
        elif arch == "gpt_oss":
            fields = _gpt_oss_fields(hf, source)
        elif arch == "deepseek_v3":
            fields = _deepseek_fields(hf, source)
        else:
            fields = _llama_fields(hf, arch, source)
        check_model(prequant, arch, bool(fields.get("n_experts")), source)
        return ModelConfig(
            arch=arch,
            dtype=dtype,
            param_dtype=dtype,
            **fields,
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: missing key {e.args[0]!r}") from None
    except ConfigError as e:
        raise CheckpointError(f"{source}: unsupported configuration: {e}") from None


def _sizes(
    hf: Mapping[str, Any], *, head_dim: int, eps: float, positions: int, tied: bool
) -> dict[str, Any]:
    """The sizes every decoder's ``config.json`` names alike; the arguments are the family's
    defaults where a key is absent (``head_dim``, ``rms_norm_eps``,
    ``max_position_embeddings``, ``tie_word_embeddings``). Norms and embeddings are
    groups a family may replace with more of its own fields (keeping ``norms.eps`` and
    ``embed.tied``)."""
    n_heads = hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or head_dim,
        d_ff=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", positions),
        norms=NormConfig(eps=hf.get("rms_norm_eps", eps)),
        embed=EmbedConfig(tied=bool(hf.get("tie_word_embeddings", tied))),
    )


def _llama_fields(hf: Mapping[str, Any], arch: str, source: str) -> dict[str, Any]:
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act {hf['hidden_act']!r} unsupported; 'silu'")
    theta, scaling = _rope(hf, source)
    head_dim = _default_head_dim(hf, arch)
    fields = _sizes(hf, head_dim=head_dim, eps=1e-6, positions=2048, tied=False)
    window, sliding = _window(hf, arch, source)
    fields.update(
        rope=RopeConfig(theta=theta, scaling=scaling),
        window=WindowConfig(size=window, layers=sliding),
    )
    if arch == "qwen2":
        # Qwen2 hard-codes q/k/v biases, none on o_proj.
        fields["attention"] = AttentionConfig(qkv_bias=True)
    elif arch == "llama":
        bias = bool(hf.get("attention_bias", False))
        fields["attention"] = AttentionConfig(qkv_bias=bias, out_bias=bias)
        fields["ffn"] = FfnConfig(bias=bool(hf.get("mlp_bias", False)))
    elif arch in ("qwen3", "qwen3_moe"):
        # q_norm/k_norm on every head; attention_bias puts biases on q, k, v and o alike.
        bias = bool(hf.get("attention_bias", False))
        fields["attention"] = AttentionConfig(qkv_bias=bias, out_bias=bias)
        fields["norms"] = NormConfig(eps=fields["norms"].eps, qk=True)
    if arch == "mixtral":
        fields.update(
            n_experts=hf["num_local_experts"], moe=MoeConfig(top_k=hf["num_experts_per_tok"])
        )
    elif arch == "qwen3_moe":
        fields.update(_qwen3_moe_fields(hf, source))
    return fields


def _deepseek_fields(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    """DeepSeek-V3: multi-head latent attention, the first ``first_k_dense_replace`` layers
    dense, the others routed experts (group-limited sigmoid routing) plus shared experts.

    The cache keeps the latent and the RoPE key (one "kv head", see
    :attr:`ModelConfig.cache_kv_dims`), so ``n_kv_heads`` is 1 whatever
    ``num_key_value_heads`` says (transformers expands every head from the latent).
    """
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act {hf['hidden_act']!r} unsupported; 'silu'")
    if hf.get("attention_bias", False):
        raise CheckpointError(
            f"{source}: attention_bias=true (biases on q_a_proj, kv_a_proj_with_mqa, o_proj) "
            "is unsupported for DeepseekV3ForCausalLM; it must be false"
        )
    if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != (
        "sigmoid"
    ):
        raise CheckpointError(
            f"{source}: topk_method={hf.get('topk_method')!r}, scoring_func="
            f"{hf.get('scoring_func')!r}: only DeepSeek-V3's 'noaux_tc' with 'sigmoid' scores "
            "is supported"
        )
    theta, scaling = _rope(hf, source)
    rank, rope, nope = hf["kv_lora_rank"], hf["qk_rope_head_dim"], hf["qk_nope_head_dim"]
    n_layers = hf["num_hidden_layers"]
    first_dense = int(hf.get("first_k_dense_replace", 0) or 0)
    if first_dense >= n_layers:
        raise CheckpointError(
            f"{source}: first_k_dense_replace={first_dense} makes every layer dense "
            f"(num_hidden_layers={n_layers}); a DeepSeek-V3 needs MoE layers"
        )
    experts = hf["n_routed_experts"]
    moe_width = hf["moe_intermediate_size"]
    return dict(
        _sizes(hf, head_dim=rank + rope, eps=1e-6, positions=4096, tied=False),
        n_kv_heads=1,
        head_dim=rank + rope,
        d_ff=moe_width,
        n_experts=experts,
        rope=RopeConfig(theta=theta, scaling=scaling),
        mla=MlaConfig(
            kv_lora_rank=rank,
            q_lora_rank=hf.get("q_lora_rank"),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=hf["v_head_dim"],
            rope_interleave=bool(hf.get("rope_interleave", True)),
        ),
        attention=AttentionConfig(scale=_deepseek_score_scale(nope + rope, scaling)),
        moe=MoeConfig(
            top_k=hf["num_experts_per_tok"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            first_dense_layers=first_dense,
            dense_d_ff=hf["intermediate_size"] if first_dense else 0,
            shared_d_ff=int(hf.get("n_shared_experts") or 0) * moe_width,
            router="sigmoid_grouped",
            groups=int(hf.get("n_group") or 1),
            topk_groups=int(hf.get("topk_group") or 1),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        ),
    )


def _deepseek_score_scale(qk_head_dim: int, scaling: RopeScaling | None) -> float:
    """Scores over the expanded heads are scaled by ``qk_head_dim ** -0.5``; with YaRN and
    ``mscale_all_dim`` DeepSeek multiplies that by ``mscale(factor, mscale_all_dim) ** 2``
    (transformers' ``yarn_apply_mscale``), apart from the cos/sin attention factor."""
    scale = float(qk_head_dim) ** -0.5
    if isinstance(scaling, YarnRopeScaling) and scaling.mscale_all_dim:
        scale *= YarnRopeScaling.mscale_of(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


def _default_head_dim(hf: Mapping[str, Any], arch: str) -> int:
    """transformers' head_dim when config.json names none (Qwen3Config's default is 128)."""
    return 128 if arch == "qwen3" else hf["hidden_size"] // hf["num_attention_heads"]


def _qwen3_moe_fields(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Qwen3-MoE's experts: every layer sparse, ``moe_intermediate_size`` wide.

    Hugging Face makes layer i a dense MLP (``intermediate_size`` wide) when i is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``. jaxpar runs one kind of
    layer per model (the layers stack under ``scan`` and split evenly into pipeline
    stages), so a config that mixes dense and sparse layers is refused, naming the field.
    """
    # The Hub's configs say num_experts; transformers 5.x saves num_local_experts.
    key = "num_experts" if "num_experts" in hf else "num_local_experts"
    n_experts = hf[key]
    step = hf.get("decoder_sparse_step", 1)
    dense = sorted(set(hf.get("mlp_only_layers") or ()))
    if n_experts <= 0:
        raise CheckpointError(
            f"{source}: {key}={n_experts} makes every layer a dense MLP; unsupported for "
            "Qwen3MoeForCausalLM (a dense Qwen3 checkpoint is Qwen3ForCausalLM)"
        )
    if dense:
        raise CheckpointError(
            f"{source}: mlp_only_layers={dense} makes those layers dense MLPs and the others "
            "mixtures of experts; jaxpar runs one kind of feed-forward block in every layer, "
            "so mixed dense and sparse layers are unsupported (mlp_only_layers must be empty)"
        )
    if step != 1:
        raise CheckpointError(
            f"{source}: decoder_sparse_step={step} makes only every {step}th layer a mixture "
            "of experts and the others dense MLPs; jaxpar runs one kind of feed-forward block "
            "in every layer, so mixed dense and sparse layers are unsupported "
            "(decoder_sparse_step must be 1)"
        )
    return dict(
        d_ff=hf["moe_intermediate_size"],
        n_experts=n_experts,
        moe=MoeConfig(
            top_k=hf["num_experts_per_tok"],
            # transformers' Qwen3MoeConfig defaults to False (Qwen3-30B-A3B's config says
            # true).
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        ),
    )


def _rope(
    hf: Mapping[str, Any], source: str, legal: tuple[str, ...] = tuple(ROPE_SCALINGS)
) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling, from top-level keys or transformers 5.x ``rope_parameters``;
    ``legal``: the scalings the family takes (default: every one jaxpar has)."""
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return float(theta), None
    if kind not in legal:
        names = ", ".join(map(repr, ("default", *legal)))
        raise CheckpointError(f"{source}: rope type {kind!r} unsupported; legal: {names}")
    if kind == "yarn" and hf.get("original_max_position_embeddings"):
        # transformers prefers a top-level original_max_position_embeddings (Phi-3 style).
        scaling = {
            **scaling,
            "original_max_position_embeddings": hf["original_max_position_embeddings"],
        }
    try:
        return float(theta), rope_scaling_from_mapping(scaling, hf.get("max_position_embeddings"))
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from None


def _window(
    hf: Mapping[str, Any], arch: str, source: str
) -> tuple[int | None, tuple[bool, ...] | None]:
    """The sliding window and which layers take it (None: every layer): Mistral's window is
    on every layer; Qwen2/Qwen3 slide only with ``use_sliding_window``, on the layers
    ``layer_types`` names, else (transformers' rule) those from ``max_window_layers`` on."""
    window = hf.get("sliding_window")
    kinds = hf.get("layer_types")
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        if not hf.get("use_sliding_window", False) or window is None:
            return None, None
        if arch == "qwen3_moe":
            raise CheckpointError(
                f"{source}: use_sliding_window=true is unsupported for Qwen3MoeForCausalLM "
                "(transformers releases disagree on which of its layers slide)"
            )
        if kinds is None:
            first = hf.get("max_window_layers", 28)
            kinds = [
                "sliding_attention" if i >= first else "full_attention"
                for i in range(hf["num_hidden_layers"])
            ]
    if not kinds:
        return window, None
    n = hf["num_hidden_layers"]
    unknown = sorted(set(kinds) - set(_LAYER_TYPES))
    if unknown or len(kinds) != n:
        raise CheckpointError(
            f"{source}: layer_types must list {n} entries of {', '.join(_LAYER_TYPES)}; got "
            f"{len(kinds)} entries" + (f" with {unknown}" if unknown else "")
        )
    sliding = tuple(kind == "sliding_attention" for kind in kinds)
    if not any(sliding):
        return None, None
    if window is None:
        raise CheckpointError(
            f"{source}: layer_types has sliding_attention layers but sliding_window is null"
        )
    return int(window), None if all(sliding) else sliding


def _gemma_fields(hf: Mapping[str, Any], arch: str, source: str) -> dict[str, Any]:
    """Gemma 2 and Gemma 3 (text): scaled embeddings, ``1 + w`` RMS norms in float32,
    GeGLU, norms before and after attention and MLP, ``query_pre_attn_scalar``, soft caps,
    q/k norms (Gemma 3), sliding layers interleaved with global ones, each kind with its
    RoPE base (Gemma 3)."""
    act_key = "hidden_activation" if hf.get("hidden_activation") else "hidden_act"
    act = hf.get(act_key) or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise CheckpointError(
            f"{source}: {act_key} {act!r} unsupported for {arch}; legal: {', '.join(_GELU_TANH)}"
        )
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError(
            f"{source}: use_bidirectional_attention=true (an encoder-style Gemma) is "
            "unsupported; jaxpar decodes causally (it must be false or absent)"
        )
    layers, window = _gemma_layers(hf, arch, source)
    theta, local_theta, linear = _gemma_rope(hf, arch, source)
    bias = bool(hf.get("attention_bias", False))
    caps = {
        theirs: None if hf.get(theirs) is None else float(hf[theirs])
        for theirs in ("attn_logit_softcapping", "final_logit_softcapping")
    }
    # head_dim 256: Gemma2Config's and Gemma3TextConfig's default.
    fields = _sizes(hf, head_dim=256, eps=1e-6, positions=8192, tied=True)
    return dict(
        fields,
        ffn=FfnConfig(activation="gelu_tanh"),
        rope=RopeConfig(
            theta=theta, local_theta=local_theta if layers else None, linear_factor=linear
        ),
        window=WindowConfig(size=window, layers=layers),
        attention=AttentionConfig(
            qkv_bias=bias,
            out_bias=bias,
            scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            softcap=caps["attn_logit_softcapping"],
        ),
        norms=NormConfig(eps=fields["norms"].eps, qk=arch == "gemma3", offset=True, sandwich=True),
        embed=EmbedConfig(
            tied=fields["embed"].tied,
            scale=True,
            logit_softcap=caps["final_logit_softcapping"],
        ),
    )


_LAYER_TYPES = ("sliding_attention", "full_attention")


def _gemma_layers(
    hf: Mapping[str, Any], arch: str, source: str
) -> tuple[tuple[bool, ...] | None, int | None]:
    """Which layers slide, from ``layer_types`` or transformers' default pattern (Gemma 2:
    every other layer from the first; Gemma 3: all but every ``sliding_window_pattern``-th)."""
    n = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if kinds is None:
        # Gemma 2 and GPT-OSS: every other layer slides, from the first.
        pattern = 2 if arch in ("gemma2", "gpt_oss") else int(hf.get("sliding_window_pattern", 6))
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    unknown = sorted(set(kinds) - set(_LAYER_TYPES))
    if unknown or len(kinds) != n:
        raise CheckpointError(
            f"{source}: layer_types must list {n} entries of {', '.join(_LAYER_TYPES)}; got "
            f"{len(kinds)} entries" + (f" with {unknown}" if unknown else "")
        )
    sliding = tuple(kind == "sliding_attention" for kind in kinds)
    window = hf.get("sliding_window")
    if not any(sliding):
        return None, None
    if window is None:
        raise CheckpointError(
            f"{source}: layer_types has sliding_attention layers but sliding_window is null"
        )
    return sliding, int(window)


def _gemma_rope(
    hf: Mapping[str, Any], arch: str, source: str
) -> tuple[float, float | None, float | None]:
    """(global base, sliding layers' base or None, linear factor of the global layers).

    Gemma 3 keeps a RoPE per layer kind: transformers 5.x writes ``rope_parameters`` as
    ``{"full_attention": {...}, "sliding_attention": {...}}``; older files have
    ``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling`` (global layers only).
    Global layers take ``default`` or ``linear``; sliding layers ``default``.
    """
    params = hf.get("rope_parameters") or {}
    if arch == "gemma2":  # one RoPE for every layer
        full, local = {**params, **(hf.get("rope_scaling") or {})}, None
        full["rope_theta"] = hf.get("rope_theta", full.get("rope_theta", 10_000.0))
    elif "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", 1_000_000.0)
        local.setdefault("rope_theta", 10_000.0)
    else:
        full = {"rope_theta": hf.get("rope_theta", 1_000_000.0), **(hf.get("rope_scaling") or {})}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    linear = None
    kind = full.get("rope_type", full.get("type", "default"))
    if kind == "linear":
        linear = float(full["factor"])
    elif kind != "default":
        raise CheckpointError(
            f"{source}: rope type {kind!r} on the global layers (rope_scaling / "
            "rope_parameters) unsupported for this model; legal: 'default', 'linear'"
        )
    if local is not None:
        local_kind = local.get("rope_type", local.get("type", "default"))
        if local_kind != "default":
            raise CheckpointError(
                f"{source}: rope type {local_kind!r} on the sliding layers "
                "(rope_parameters.sliding_attention) unsupported; legal: 'default'"
            )
    local_theta = None if local is None else float(local["rope_theta"])
    return float(full["rope_theta"]), local_theta, linear


def _gpt_oss_fields(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    """GPT-OSS: attention sinks and q/k/v/o biases; sliding layers alternating with full ones
    (``layer_types``, else every other from the first); YaRN RoPE; every layer a mixture of
    experts with a biased router (top-k of the logits, softmax over the k), expert biases and
    the clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``: transformers' defaults 7.0 and
    1.702 where config.json has none)."""
    theta, scaling = _rope(hf, source, legal=("llama3", "yarn"))
    layers, window = _gemma_layers(hf, "gpt_oss", source)
    bias = bool(hf.get("attention_bias", True))
    # GptOssConfig's defaults: head_dim 64, eps 1e-5, 131072 positions.
    fields = _sizes(hf, head_dim=64, eps=1e-5, positions=131072, tied=False)
    return dict(
        fields,
        n_experts=hf["num_local_experts"],
        rope=RopeConfig(theta=theta, scaling=scaling),
        window=WindowConfig(size=window, layers=layers),
        attention=AttentionConfig(qkv_bias=bias, out_bias=bias, sinks=True),
        norms=NormConfig(eps=fields["norms"].eps, scale_f32=True),
        ffn=FfnConfig(bias=True),
        moe=MoeConfig(
            top_k=hf["num_experts_per_tok"],
            norm_topk_prob=True,  # softmax over the chosen logits: renormalised probabilities
            router_bias=True,
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        ),
    )


def _gpt2_fields(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    if act not in _GELU_TANH:
        raise CheckpointError(
            f"{source}: activation_function {act!r} unsupported; legal: {', '.join(_GELU_TANH)}"
        )
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
        raise CheckpointError(
            f"{source}: only standard 1/sqrt(head_dim) attention scaling is supported"
        )
    d, n = hf["n_embd"], hf["n_head"]
    return dict(
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layers=hf["n_layer"],
        n_heads=n,
        n_kv_heads=n,
        head_dim=d // n,
        d_ff=hf.get("n_inner") or 4 * d,
        positional="learned",
        max_position_embeddings=hf["n_positions"],
        norms=NormConfig(kind="layer", eps=hf.get("layer_norm_epsilon", 1e-5)),
        ffn=FfnConfig(activation="gelu_tanh", gated=False, bias=True),
        attention=AttentionConfig(qkv_bias=True, out_bias=True),
        embed=EmbedConfig(tied=bool(hf.get("tie_word_embeddings", True))),
    )


#: jaxpar arch -> the Hugging Face architecture class :func:`hf_config_of` writes.
_CLASS_OF = {arch: name for name, arch in SUPPORTED_ARCHITECTURES.items()}


def hf_config_of(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` that describes ``config``: the inverse of
    :func:`config_from_hf`, so that ``config_from_hf(hf_config_of(c)) == c``.

    Raises:
        ConfigError: ``config`` is no model a ``config.json`` of its architecture can
            describe (say Llama with a bias on q/k/v but not on o); the message names the
            fields that would change.
    """
    arch = config.arch
    if arch == "gpt2":
        out = _gpt2_hf(config)
    else:
        out = _common_hf(config)
        if arch in ("gemma2", "gemma3"):
            del out["hidden_act"], out["rope_theta"]  # Gemma's own keys name them
            out.update(_gemma_hf(config))
        elif arch == "deepseek_v3":
            out.update(_deepseek_hf(config))
        elif arch == "gpt_oss":
            out.update(_gpt_oss_hf(config))
        else:
            out.update(_llama_hf(config))
    back = config_from_hf(out, source="hf_config_of")
    if back != config:
        changed = _changed(config, back)
        raise ConfigError(
            f"no {_CLASS_OF[arch]} config.json describes this config: {', '.join(changed)} "
            "would read back differently"
        )
    return out


def _changed(a: Any, b: Any, prefix: str = "") -> list[str]:
    """The dotted names of the fields where dataclasses ``a`` and ``b`` differ."""
    out = []
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x != y and dataclasses.is_dataclass(x) and type(x) is type(y) and f.name in GROUPS:
            out += _changed(x, y, f"{prefix}{f.name}.")
        elif x != y:
            out.append(f"{prefix}{f.name}")
    return out


def _common_hf(c: ModelConfig) -> dict[str, Any]:
    """The keys every decoder but GPT-2 names alike (``_sizes``'s), RoPE included."""
    model_type = "gemma3_text" if c.arch == "gemma3" else c.arch
    out = dict(
        architectures=[_CLASS_OF[c.arch]],
        model_type=model_type,
        dtype=str(c.dtype),
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        intermediate_size=c.d_ff,
        rms_norm_eps=c.norms.eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.embed.tied,
        hidden_act="silu",
        rope_theta=c.rope.theta,
    )
    if c.rope.scaling is not None:
        out["rope_scaling"] = _rope_scaling_hf(c.rope.scaling)
    return out


def _rope_scaling_hf(s: RopeScaling) -> dict[str, Any]:
    if isinstance(s, LinearRopeScaling):
        return dict(rope_type="linear", factor=s.factor)
    if isinstance(s, DynamicRopeScaling):
        return dict(
            rope_type="dynamic",
            factor=s.factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    if isinstance(s, YarnRopeScaling):
        out = dict(
            rope_type="yarn",
            factor=s.factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
            beta_fast=s.beta_fast,
            beta_slow=s.beta_slow,
            truncate=s.truncate,
        )
        optional = dict(
            attention_factor=s.attention_factor_override,
            mscale=s.mscale,
            mscale_all_dim=s.mscale_all_dim,
        )
        return out | {k: v for k, v in optional.items() if v is not None}
    return dict(rope_type="llama3", **dataclasses.asdict(s))


def _layer_types(c: ModelConfig) -> list[str]:
    return [
        "sliding_attention" if c.layer_slides(i) else "full_attention" for i in range(c.n_layers)
    ]


def _llama_hf(c: ModelConfig) -> dict[str, Any]:
    """Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE."""
    out: dict[str, Any] = {}
    if c.window.size is not None:
        out.update(sliding_window=c.window.size, layer_types=_layer_types(c))
        if c.arch in ("qwen2", "qwen3", "qwen3_moe"):
            out["use_sliding_window"] = True
    if c.arch in ("llama", "qwen3", "qwen3_moe"):
        out["attention_bias"] = c.attention.qkv_bias
    if c.arch == "llama":
        out["mlp_bias"] = c.ffn.bias
    if c.arch == "mixtral":
        out.update(num_local_experts=c.n_experts, num_experts_per_tok=c.moe.top_k)
    elif c.arch == "qwen3_moe":
        out.update(
            num_experts=c.n_experts,
            num_experts_per_tok=c.moe.top_k,
            moe_intermediate_size=c.d_ff,
            norm_topk_prob=c.moe.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return out


def _deepseek_hf(c: ModelConfig) -> dict[str, Any]:
    mla, moe = c.mla, c.moe
    return dict(
        attention_bias=False,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        num_key_value_heads=c.n_heads,  # transformers expands every head from the latent
        head_dim=mla.qk_rope_head_dim,  # transformers' DeepseekV3Config says so
        kv_lora_rank=mla.kv_lora_rank,
        q_lora_rank=mla.q_lora_rank,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        rope_interleave=mla.rope_interleave,
        n_routed_experts=c.n_experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=c.d_ff,
        intermediate_size=moe.dense_d_ff or c.d_ff,
        first_k_dense_replace=moe.first_dense_layers,
        n_shared_experts=moe.shared_d_ff // c.d_ff,
        n_group=moe.groups,
        topk_group=moe.topk_groups,
        routed_scaling_factor=moe.routed_scaling_factor,
        norm_topk_prob=moe.norm_topk_prob,
    )


def _gemma_hf(c: ModelConfig) -> dict[str, Any]:
    """Gemma 2 and 3: the layer kinds, soft caps, score scale and per-kind RoPE."""
    scale = c.attention.scale if c.attention.scale is not None else c.head_dim**-0.5
    out: dict[str, Any] = dict(
        hidden_activation="gelu_pytorch_tanh",
        attention_bias=c.attention.qkv_bias,
        # The scale is stored as its square root's inverse: round off the float error.
        query_pre_attn_scalar=round(scale**-2, 9),
        attn_logit_softcapping=c.attention.softcap,
        final_logit_softcapping=c.embed.logit_softcap,
        layer_types=_layer_types(c),
        sliding_window=c.window.size,
    )
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope.theta}
    if c.rope.linear_factor is not None:
        full.update(rope_type="linear", factor=c.rope.linear_factor)
    if c.arch == "gemma2":
        out["rope_theta"] = c.rope.theta
        if c.rope.linear_factor is not None:
            out["rope_scaling"] = full
        return out
    params = {"full_attention": full}
    if c.rope.local_theta is not None:
        params["sliding_attention"] = {"rope_type": "default", "rope_theta": c.rope.local_theta}
    out["rope_parameters"] = params
    return out


def _gpt_oss_hf(c: ModelConfig) -> dict[str, Any]:
    return dict(
        layer_types=_layer_types(c),
        sliding_window=c.window.size,
        attention_bias=c.attention.qkv_bias,
        num_local_experts=c.n_experts,
        num_experts_per_tok=c.moe.top_k,
        swiglu_limit=c.moe.swiglu_limit,
        swiglu_alpha=c.moe.swiglu_alpha,
    )


def _gpt2_hf(c: ModelConfig) -> dict[str, Any]:
    return dict(
        architectures=[_CLASS_OF["gpt2"]],
        model_type="gpt2",
        dtype=str(c.dtype),
        vocab_size=c.vocab_size,
        n_embd=c.d_model,
        n_layer=c.n_layers,
        n_head=c.n_heads,
        n_inner=c.d_ff,
        n_positions=c.max_position_embeddings,
        layer_norm_epsilon=c.norms.eps,
        activation_function="gelu_new",
        tie_word_embeddings=c.embed.tied,
    )
