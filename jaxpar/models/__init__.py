"""The model layer: single-device Flax NNX decoders that the engine shards.

Models name logical axes only (``constrain`` at module boundaries, ``out_sharding``
metadata on every parameter); the engine maps them to mesh axes.
"""

from jaxpar.models._attention import KV_SCORE_AXES, Q_AXES, Attention, Context
from jaxpar.models._attention_ops import interpret_kernels
from jaxpar.models._cache import (
    PREFILL_KV_AXES,
    STACKED_KV_AXES,
    KVCache,
    check_room,
    write_token,
)
from jaxpar.models._config import (
    ARCHS,
    PRESETS,
    AttentionConfig,
    DynamicRopeScaling,
    EmbedConfig,
    FfnConfig,
    LinearRopeScaling,
    Llama3RopeScaling,
    MlaConfig,
    ModelConfig,
    MoeConfig,
    NormConfig,
    RopeConfig,
    WindowConfig,
    YarnRopeScaling,
    preset,
)
from jaxpar.models._decoder import (
    Decoder,
    DecoderLayer,
    abstract_model,
    decode,
    init_model,
    init_params,
    param_logical_axes,
    params_layer_loop,
    prefill,
    quantize_params,
    with_layer_loop,
)
from jaxpar.models._eagle3 import Eagle3Head, load_eagle3
from jaxpar.models._hf import load_hf_checkpoint
from jaxpar.models._hf_config import SUPPORTED_ARCHITECTURES, config_from_hf, stored_quantization
from jaxpar.models._hidden_taps import HiddenTaps, prefill_with_taps
from jaxpar.models._kernel_choice import RING_MIN_TOKENS, sp_prefill_attention
from jaxpar.models._kv_groups import KVGroups, kv_groups, kv_positions, kv_windows
from jaxpar.models._kv_heads import repeat_kv_heads
from jaxpar.models._kv_quant import (
    KV_CACHE_DTYPES,
    QuantKV,
    as_stored,
    dequantize_kv,
    kv_bytes_per_vector,
    kv_map,
    quantize_kv,
    quantize_tree,
)
from jaxpar.models._layers import FFN, Embedding, LayerNorm, LMHead, RMSNorm
from jaxpar.models._moe import (
    DOWN_AXES,
    EXPERT_ROWS_SCOPE,
    GATE_UP_AXES,
    MOE_PATHS,
    Experts,
    MoE,
    Router,
    route_tokens,
)
from jaxpar.models._moe_route import capacity_rows, dropless_capacity
from jaxpar.models._moe_stats import count_dropped, record_dropped, total_dropped
from jaxpar.models._mtp import MtpHead, load_mtp
from jaxpar.models._options import ExecutionOptions
from jaxpar.models._paged import (
    PAGE_AXES,
    SCRATCH_PAGE,
    STACKED_PAGE_AXES,
    PagedKVCache,
    PagedLayer,
    read_pages,
    write_prompts,
)
from jaxpar.models._quant import (
    QUANT_DTYPES,
    element_bytes,
    held_quantization,
    param_bytes,
    params_quantization,
)
from jaxpar.models._ring_attention import K_TILE as RING_K_TILE
from jaxpar.models._ring_attention import Q_TILE as RING_Q_TILE
from jaxpar.models._rope import (
    apply_rope,
    dynamic_inv_freq,
    rope_attention_factor,
    rope_inv_freq,
)
from jaxpar.models._run import ModelRun

__all__ = [
    "Context",
    "sp_prefill_attention",
    "DOWN_AXES",
    "EXPERT_ROWS_SCOPE",
    "GATE_UP_AXES",
    "MOE_PATHS",
    "KV_SCORE_AXES",
    "PREFILL_KV_AXES",
    "Q_AXES",
    "RING_K_TILE",
    "RING_MIN_TOKENS",
    "RING_Q_TILE",
    "STACKED_KV_AXES",
    "config_from_hf",
    "stored_quantization",
    "write_token",
    "ARCHS",
    "FFN",
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "Attention",
    "Decoder",
    "DecoderLayer",
    "Embedding",
    "Experts",
    "KVCache",
    "PAGE_AXES",
    "SCRATCH_PAGE",
    "STACKED_PAGE_AXES",
    "PagedKVCache",
    "KVGroups",
    "kv_groups",
    "kv_positions",
    "kv_windows",
    "PagedLayer",
    "read_pages",
    "write_prompts",
    "LMHead",
    "LayerNorm",
    "DynamicRopeScaling",
    "LinearRopeScaling",
    "Llama3RopeScaling",
    "YarnRopeScaling",
    "AttentionConfig",
    "EmbedConfig",
    "FfnConfig",
    "MlaConfig",
    "MoeConfig",
    "NormConfig",
    "RopeConfig",
    "WindowConfig",
    "ModelConfig",
    "ModelRun",
    "ExecutionOptions",
    "params_layer_loop",
    "held_quantization",
    "params_quantization",
    "MoE",
    "RMSNorm",
    "Router",
    "abstract_model",
    "apply_rope",
    "check_room",
    "decode",
    "capacity_rows",
    "count_dropped",
    "dropless_capacity",
    "record_dropped",
    "route_tokens",
    "total_dropped",
    "init_model",
    "interpret_kernels",
    "init_params",
    "repeat_kv_heads",
    "quantize_params",
    "QUANT_DTYPES",
    "KV_CACHE_DTYPES",
    "QuantKV",
    "as_stored",
    "dequantize_kv",
    "kv_bytes_per_vector",
    "kv_map",
    "quantize_kv",
    "quantize_tree",
    "param_bytes",
    "element_bytes",
    "load_hf_checkpoint",
    "param_logical_axes",
    "preset",
    "prefill",
    "rope_attention_factor",
    "rope_inv_freq",
    "dynamic_inv_freq",
    "with_layer_loop",
    "Context",
    "Eagle3Head",
    "HiddenTaps",
    "MtpHead",
    "load_eagle3",
    "load_mtp",
    "prefill_with_taps",
]
