#!/usr/bin/env python3
"""Build the Hugging Face oracle fixtures: tiny random-weight checkpoints plus reference outputs.

Needs torch (CPU) and transformers, kept out of the project's own environment::

    python3 -m venv .venv-hf && .venv-hf/bin/pip install torch==2.13.0
    .venv-hf/bin/pip install transformers safetensors numpy tokenizers
    .venv-hf/bin/python scripts/make_hf_fixtures.py            # writes tests/fixtures/hf/
    .venv-hf/bin/python -m pytest --noconftest -m hf_live tests/test_hf_live.py

Every fixture is a directory ``<out>/<name>/`` holding what ``save_pretrained`` writes
(``config.json`` and ``model.safetensors``, or sharded ``model-0000k-of-0000n.safetensors`` files
plus ``model.safetensors.index.json``) and the reference outputs computed by transformers in
float32 on CPU:

``reference.npz``
    ``n_prompts``          int32 scalar, 3
    ``tokens_{i}``         int32 [T_i]      prompt i (random ids in [0, vocab), lengths 7, 4, 11)
    ``logits_{i}``         float32 [T_i, V] logits at every prompt position, prompt run alone,
                           unpadded, no attention mask
    ``greedy_{i}``         int32 [16]       greedy continuation (plain argmax, KV cache, EOS ignored:
                           always exactly 16 new tokens)
    ``greedy_logits_{i}``  float32 [16, V]  the logits each greedy token was the argmax of (row 0 is
                           ``logits_{i}[-1]``, row k the decode step fed ``greedy_{i}[k-1]``)

``reference.json``
    metadata: fixture name, model class, prompt lengths, seed used, smallest top-1/top-2 logit gap
    over all greedy steps (and, for MoE, the smallest router margin), library versions.

Greedy decoding must be reproducible by another implementation whose float32 arithmetic differs
in the last bits, so every greedy step of every prompt must have a top-1/top-2 logit gap above
``--min-gap`` (and for Mixtral every routed token a gap between its k-th and (k+1)-th router
logit above the same bound, so that no expert choice is a near tie). A seed that fails this is
replaced, deterministically, by the next one (``base_seed + attempt``).

Weights use a large ``initializer_range`` so logits are well spread, and every 1-D parameter
(norm scales, biases), which transformers initialises to exact ones or zeros, is randomised too,
so that a loader that drops them is caught.

Fixtures (all 2 layers, 4 attention heads, float32):

=================  ===================  ==========================================================
name               class                notes
=================  ===================  ==========================================================
llama              LlamaForCausalLM     GQA 4 q / 2 kv heads, untied, rope_theta 1e4, tokenizer.json
llama3_rope        LlamaForCausalLM     rope_type llama3 (theta 5e5), tied embeddings, head_dim 16
llama_sharded      LlamaForCausalLM     like llama, saved in several safetensors shards + index
qwen2              Qwen2ForCausalLM     q/k/v biases, GQA 4/2, tied embeddings
qwen2_window       Qwen2ForCausalLM     qwen2 with use_sliding_window: layer 0 full (max_window_layers
                                        1), layer 1 a 4-token window (layer_types as saved)
qwen3              Qwen3ForCausalLM     q/k norms, head_dim 16 (4 x 16 != hidden 32), GQA 4/2, tied
mistral            MistralForCausalLM   MHA 4/4, sliding_window 4096 (longer than any sequence)
mixtral_fused      MixtralForCausalLM   4 experts top-2, fused expert tensors (transformers 5.x)
mixtral_legacy     MixtralForCausalLM   mixtral_fused's weights and reference, per-expert w1/w2/w3
qwen3_moe          Qwen3MoeForCausalLM  q/k norms, 64 experts top-8 (width 4), norm_topk_prob; the Hub's
                                        per-expert mlp.experts.{j}.gate/up/down_proj tensors
qwen3_moe_fused    Qwen3MoeForCausalLM  16 experts top-4, norm_topk_prob false, tied, fused experts
gemma2             Gemma2ForCausalLM    4 layers: window 4 on 0, 2, global 1, 3; attention soft cap 1,
                                        final soft cap 6; query_pre_attn_scalar 24, head_dim 12
gemma3_text        Gemma3ForCausalLM    4 layers: window 4 on 0-2, global 3; q/k norms; RoPE base
                                        100 (sliding), 1e4 linear x2 (global); scalar 24, head_dim 12
gpt2               GPT2LMHeadModel      n_positions 64, tied, Conv1D weights stored [in, out]
gpt_oss            GptOssForCausalLM    4 layers: window 4 on 0, 2, full 1, 3; attention sinks; YaRN
                                        (factor 32); 8 experts top-2 of width 32, router and expert
                                        biases, clamped SwiGLU (limit 1: binds); q/k/v/o biases,
                                        head_dim 12; fused interleaved gate_up_proj [E, D, 2F]
gpt_oss_mxfp4      GptOssForCausalLM    gpt_oss with its expert projections quantized to MXFP4
                                        (``*_blocks`` + ``*_scales``, quant_method mxfp4); the
                                        reference is transformers' on it (dequantized on load)
deepseek_v3        DeepseekV3ForCausalLM  3 layers: MLA (q_lora 24, kv_lora 16, rope 8 interleaved,
                                        nope 8, v 12); layer 0 dense, 1-2 16 experts top-4 in 4
                                        groups of 4 (best 2), sigmoid + random correction bias,
                                        2 shared, x2.5; the Hub's per-expert tensors
deepseek_v3_yarn   DeepseekV3ForCausalLM  deepseek_v3 with YaRN (x4 over 16 positions,
                                        mscale_all_dim 1); fused expert tensors
=================  ===================  ==========================================================

The DeepSeek fixtures have 3 layers, the Gemma and GPT-OSS fixtures 4 (the others 2);
DeepSeek's ``e_score_correction_bias`` buffers (zeros from transformers) are randomised like
the 1-D parameters. The Gemma, GPT-OSS and DeepSeek fixtures record in reference.json how much each
feature they exercise moves the logits (soft caps, window, RoPE bases: "effects"), asserted
above 1e-2 at build time.

Mixtral tensor layouts (checked against transformers 5.23 ``MixtralExperts.forward``, which does
``gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)``; ``h = silu(gate) * up``;
``out = linear(h, down_proj[e])``). With E experts, hidden D and expert intermediate F:

* fused (``save_pretrained(..., save_original_format=False)``; transformers 5.x's in-memory names)::

    model.layers.{i}.mlp.gate.weight                 [E, D]       router
    model.layers.{i}.mlp.experts.gate_up_proj        [E, 2F, D]   rows [:F] = gate, rows [F:] = up
    model.layers.{i}.mlp.experts.down_proj           [E, D, F]

* legacy (what older transformers and most hub checkpoints hold; NOTE: transformers 5.23's
  default ``save_pretrained`` (``save_original_format=True``) reverts to exactly these names)::

    model.layers.{i}.block_sparse_moe.gate.weight            [E, D]
    model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight  [F, D]  = gate_up_proj[j, :F]
    model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight  [F, D]  = gate_up_proj[j, F:]
    model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight  [D, F]  = down_proj[j]

The legacy file is converted here by hand and verified three ways: against an expert's forward
in the modeling code, against transformers' own default (legacy-format) save of the same model,
and by loading it back with ``from_pretrained`` and reproducing the fused reference exactly.

Everything is deterministic (fixed seeds, ``torch.use_deterministic_algorithms``, one thread, a
zip writer with fixed timestamps for the ``.npz``): running the script again rewrites identical
bytes, given the same library versions.

Usage (needs torch and transformers, e.g. the ``.venv-hf`` venv)::

    .venv-hf/bin/python scripts/make_hf_fixtures.py                # write tests/fixtures/hf
    .venv-hf/bin/python scripts/make_hf_fixtures.py --check        # ... and sanity-check them
    .venv-hf/bin/python scripts/make_hf_fixtures.py --check-only   # only check what is there

The functions are importable (``tests/test_hf_live.py`` loads this file by path).
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "hf"

PROMPT_LENGTHS: tuple[int, ...] = (7, 4, 11)
GREEDY_TOKENS = 16
DEFAULT_MIN_GAP = 1e-3
MAX_ATTEMPTS = 100
PAD_CHECK_TOL = 1e-5

# Files written by this script (besides the weights) and files save_pretrained writes that the
# fixtures do not need.
REFERENCE_NPZ = "reference.npz"
REFERENCE_JSON = "reference.json"
TOKENIZER_JSON = "tokenizer.json"
DROPPED_FILES = ("generation_config.json",)

# Fixed timestamp for the zip members of reference.npz (np.savez stamps the current time).
_ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)


# --------------------------------------------------------------------------------------------
# Fixture specifications
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FixtureSpec:
    """One fixture: which transformers classes, which config, how to save it."""

    name: str
    model_class: str  # attribute of `transformers`, e.g. "LlamaForCausalLM"
    config_class: str  # attribute of `transformers`, e.g. "LlamaConfig"
    config: dict[str, Any]
    base_seed: int
    max_shard_size: str | None = None  # e.g. "48KB" -> several shards + index
    fused_experts: bool = False  # MoE: write transformers 5.x fused expert tensors
    tokenizer: bool = False  # also write a toy tokenizer.json
    legacy_of: str | None = None  # derived fixture: same weights as `legacy_of`, legacy MoE names
    mxfp4_of: str | None = None  # derived fixture: `mxfp4_of`'s experts quantized to MXFP4
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # name -> config overrides that must change the logits (the feature binds), checked at
    # build time on the same weights; the max |logit diff| goes into reference.json.
    effects: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return any(
            k in self.config for k in ("num_local_experts", "num_experts", "n_routed_experts")
        )


_COMMON = dict(
    num_hidden_layers=2,
    num_attention_heads=4,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
    use_cache=True,
)

INIT_RANGE = 0.2

_LLAMA = dict(
    _COMMON,
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=INIT_RANGE,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

# Llama-3 RoPE scaling. The real checkpoints use original_max_position_embeddings 8192, where for
# a tiny head_dim and prompts of a few tokens the scaled (very low) frequencies change nothing
# measurable. With head_dim 16 and theta 5e5 the wavelengths 2*pi/inv_freq are about
# 6.3, 32, 167, 860, 4.4e3, ...; with original_max_position_embeddings 64 the llama3 rule
# (low_freq_wavelen = 64 / 1, high_freq_wavelen = 64 / 4 = 16) keeps the first frequency,
# smooths the second (16 <= 32 <= 64) and divides the other six by factor 8, which changes the
# logits clearly (checked at build time against the same weights with plain RoPE).
_LLAMA3_ROPE_PARAMETERS = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# Qwen3-MoE: many small experts (Qwen3-30B-A3B has 128 of width 768, top-8), every layer sparse.
_QWEN3_MOE = dict(
    _COMMON,
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,  # the dense MLP's width: unused, every layer is sparse
    moe_intermediate_size=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=64,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=512,
    use_sliding_window=False,
    router_aux_loss_coef=0.0,
    output_router_logits=False,
    initializer_range=INIT_RANGE,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)

# DeepSeek-V3: multi-head latent attention (q and kv low-rank projections, decoupled RoPE dims
# laid out interleaved, v_head_dim != qk head dim), the first layer dense, the others 16 routed
# experts top-4 chosen group-limited (4 groups of 4, best 2: 8 candidates, so both the group
# choice and the choice within the groups bind) by sigmoid scores plus a correction bias, 2
# shared experts, routed weights renormalised and scaled by 2.5.
_DEEPSEEK_V3 = dict(
    _COMMON,
    num_hidden_layers=3,
    vocab_size=256,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=8,
    num_key_value_heads=4,
    n_shared_experts=2,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=12,
    rope_interleave=True,
    max_position_embeddings=256,
    initializer_range=INIT_RANGE,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
# YaRN as DeepSeek-V3 ships it (factor 40, mscale = mscale_all_dim = 1 there), scaled down: with
# original_max_position_embeddings 16 and factor 4 the rope dims' wavelengths straddle the
# beta_fast/beta_slow ramp, and mscale_all_dim 1 multiplies the score scale by mscale^2.
_DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

# Gemma 2 / Gemma 3 (text): 4 layers so sliding and global layers both occur (twice for Gemma 2,
# whose default alternation starts sliding; Gemma 3's [s, s, s, f] differs between the two
# halves, so a pipeline stage that used its local layer index would pick the wrong kind).
# sliding_window 4 is shorter than the 7- and 11-token prompts and the 16 greedy tokens;
# head_dim 12 (4 x 12 != hidden 32), query_pre_attn_scalar 24 != head_dim.
_GEMMA = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    query_pre_attn_scalar=24,
    sliding_window=4,
    initializer_range=INIT_RANGE,
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
    use_cache=True,
)

# GPT-OSS: sliding layers (window 4, shorter than the 7- and 11-token prompts) alternate with
# full ones from the first (transformers' default layer_types); YaRN as the published models
# (factor 32, 4096 original positions, beta 32 / 1, not truncated); the SwiGLU clamp at 1.0
# (the published 7.0 never binds on a tiny random model) so that clipping is exercised.
_GPT_OSS_YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_GPT_OSS = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=32,  # a whole MXFP4 block along F (down_proj's contracted dim)
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=4,
    swiglu_limit=1.0,
    swiglu_alpha=1.702,
    attention_bias=True,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    router_aux_loss_coef=0.0,
    output_router_logits=False,
    initializer_range=INIT_RANGE,
    tie_word_embeddings=False,
    rope_parameters=dict(_GPT_OSS_YARN),
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    use_cache=True,
)

FIXTURES: tuple[FixtureSpec, ...] = (
    FixtureSpec(
        name="llama",
        model_class="LlamaForCausalLM",
        config_class="LlamaConfig",
        config=dict(_LLAMA),
        base_seed=1000,
        tokenizer=True,
        notes="GQA 4/2, untied embeddings, rope_theta 1e4",
    ),
    FixtureSpec(
        name="llama3_rope",
        model_class="LlamaForCausalLM",
        config_class="LlamaConfig",
        config=dict(
            _LLAMA,
            hidden_size=64,
            intermediate_size=96,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            rope_parameters=dict(_LLAMA3_ROPE_PARAMETERS),
        ),
        base_seed=2000,
        notes="llama3 rope scaling, theta 5e5, tied embeddings, head_dim 16",
    ),
    FixtureSpec(
        name="llama_sharded",
        model_class="LlamaForCausalLM",
        config_class="LlamaConfig",
        config=dict(_LLAMA),
        base_seed=3000,
        max_shard_size="40KB",
        notes="llama saved in several safetensors shards + model.safetensors.index.json",
    ),
    FixtureSpec(
        name="qwen2",
        model_class="Qwen2ForCausalLM",
        config_class="Qwen2Config",
        config=dict(
            _COMMON,
            vocab_size=256,
            hidden_size=32,
            intermediate_size=96,
            num_key_value_heads=2,
            max_position_embeddings=256,
            initializer_range=INIT_RANGE,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        base_seed=4000,
        notes="q/k/v biases, GQA 4/2, tied embeddings",
    ),
    FixtureSpec(
        name="qwen2_window",
        model_class="Qwen2ForCausalLM",
        config_class="Qwen2Config",
        config=dict(
            _COMMON,
            vocab_size=256,
            hidden_size=32,
            intermediate_size=96,
            num_key_value_heads=2,
            max_position_embeddings=256,
            initializer_range=INIT_RANGE,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        base_seed=4500,
        notes="qwen2 with use_sliding_window: layer 0 full, layer 1 a 4-token window",
        effects={"sliding_window": {"use_sliding_window": False}},
    ),
    FixtureSpec(
        name="qwen3",
        model_class="Qwen3ForCausalLM",
        config_class="Qwen3Config",
        config=dict(
            _COMMON,
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_key_value_heads=2,
            head_dim=16,  # independent of hidden_size: q_proj is [64, 32], o_proj [32, 64]
            max_position_embeddings=256,
            initializer_range=INIT_RANGE,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            attention_bias=False,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        base_seed=8000,
        notes="q/k RMS norms per head, head_dim 16 (4 x 16 != hidden 32), GQA 4/2, tied",
    ),
    FixtureSpec(
        name="mistral",
        model_class="MistralForCausalLM",
        config_class="MistralConfig",
        config=dict(
            _COMMON,
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_key_value_heads=4,
            max_position_embeddings=512,
            sliding_window=4096,
            initializer_range=INIT_RANGE,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        base_seed=5000,
        notes="MHA 4/4, untied, sliding_window 4096 (never reached)",
    ),
    FixtureSpec(
        name="mixtral_fused",
        model_class="MixtralForCausalLM",
        config_class="MixtralConfig",
        config=dict(
            _COMMON,
            vocab_size=128,
            hidden_size=32,
            intermediate_size=48,
            num_key_value_heads=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=512,
            sliding_window=None,
            router_jitter_noise=0.0,
            router_aux_loss_coef=0.0,
            output_router_logits=False,
            initializer_range=INIT_RANGE,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        base_seed=6000,
        fused_experts=True,
        notes="4 experts top-2, fused gate_up_proj/down_proj tensors",
    ),
    FixtureSpec(
        name="mixtral_legacy",
        model_class="MixtralForCausalLM",
        config_class="MixtralConfig",
        config={},  # taken from mixtral_fused
        base_seed=6000,
        legacy_of="mixtral_fused",
        notes="mixtral_fused's weights with per-expert block_sparse_moe.experts.{j}.w1/w2/w3 names",
    ),
    FixtureSpec(
        name="qwen3_moe",
        model_class="Qwen3MoeForCausalLM",
        config_class="Qwen3MoeConfig",
        config=dict(_QWEN3_MOE),
        base_seed=9000,
        notes="q/k norms, 64 experts top-8 of width 4, norm_topk_prob, per-expert tensors "
        "(the Hub's mlp.experts.{j}.gate_proj/up_proj/down_proj)",
    ),
    FixtureSpec(
        name="qwen3_moe_fused",
        model_class="Qwen3MoeForCausalLM",
        config_class="Qwen3MoeConfig",
        config=dict(
            _QWEN3_MOE,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=8,
            norm_topk_prob=False,
            tie_word_embeddings=True,
        ),
        base_seed=10000,
        fused_experts=True,
        notes="16 experts top-4, norm_topk_prob false (weights not renormalised), tied, fused "
        "gate_up_proj/down_proj tensors",
    ),
    FixtureSpec(
        name="gemma2",
        model_class="Gemma2ForCausalLM",
        config_class="Gemma2Config",
        config=dict(
            _GEMMA,
            # Small caps so that both bind (checked at build time: "effects").
            attn_logit_softcapping=1.0,
            final_logit_softcapping=6.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        base_seed=11011,
        notes="sliding window 4 on layers 0 and 2 (global 1, 3), attention soft cap 1, final "
        "soft cap 6, query_pre_attn_scalar 24, head_dim 12, GQA 4/2, tied, 1+w norms",
        effects={
            "attn_softcap": {"attn_logit_softcapping": None},
            "final_softcap": {"final_logit_softcapping": None},
            "sliding_window": {"sliding_window": 4096},
        },
    ),
    FixtureSpec(
        name="gemma3_text",
        model_class="Gemma3ForCausalLM",
        config_class="Gemma3TextConfig",
        config=dict(
            _GEMMA,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
        base_seed=12007,
        notes="q/k norms (1+w), sliding window 4 on layers 0-2 (global 3), local RoPE base 100, "
        "global base 1e4 with linear factor 2, query_pre_attn_scalar 24, head_dim 12, tied",
        effects={
            "sliding_window": {"sliding_window": 4096},
            "rope_linear": {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                }
            },
            "rope_local_base": {
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                }
            },
        },
    ),
    FixtureSpec(
        name="deepseek_v3",
        model_class="DeepseekV3ForCausalLM",
        config_class="DeepseekV3Config",
        config=dict(_DEEPSEEK_V3),
        base_seed=13000,
        extra={"randomise_buffers": ("e_score_correction_bias",)},
        notes="MLA (q_lora 24, kv_lora 16, rope 8 interleaved, nope 8, v 12), 3 layers: layer 0 "
        "dense, 1-2 16 experts top-4 in 4 groups of 4 (best 2), sigmoid + correction bias, 2 "
        "shared, scaling 2.5; the Hub's per-expert tensors",
        effects={
            "correction_bias": {"_zero_buffers": ("e_score_correction_bias",)},
            "group_limit": {"topk_group": 4},
        },
    ),
    FixtureSpec(
        name="deepseek_v3_yarn",
        model_class="DeepseekV3ForCausalLM",
        config_class="DeepseekV3Config",
        config=dict(_DEEPSEEK_V3, rope_parameters=dict(_DEEPSEEK_YARN)),
        base_seed=14000,
        fused_experts=True,
        extra={"randomise_buffers": ("e_score_correction_bias",)},
        notes="deepseek_v3 with YaRN RoPE (factor 4 over 16 positions, mscale_all_dim 1), "
        "fused expert tensors",
        effects={"yarn": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}},
    ),
    FixtureSpec(
        name="gpt2",
        model_class="GPT2LMHeadModel",
        config_class="GPT2Config",
        config=dict(
            vocab_size=256,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_inner=None,  # 4 * n_embd = 128
            activation_function="gelu_new",
            layer_norm_epsilon=1e-5,
            initializer_range=INIT_RANGE,
            bos_token_id=255,
            eos_token_id=255,
            tie_word_embeddings=True,
            use_cache=True,
        ),
        base_seed=7000,
        notes="learned positions (n_positions 64), tied, Conv1D [in, out] weights",
    ),
    FixtureSpec(
        name="gpt_oss",
        model_class="GptOssForCausalLM",
        config_class="GptOssConfig",
        config=dict(_GPT_OSS),
        base_seed=13000,
        fused_experts=True,
        notes="window 4 on layers 0 and 2 (full 1, 3), attention sinks, YaRN factor 32, 8 "
        "experts top-2 (width 32) with router and expert biases, clamped SwiGLU limit 1, q/k/v/o "
        "biases, head_dim 12, GQA 4/2, untied; interleaved gate_up_proj [E, D, 2F]",
        effects={
            "sliding_window": {"sliding_window": 4096},
            "yarn": {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
            "swiglu_limit": {"swiglu_limit": 1e6},
        },
    ),
    FixtureSpec(
        name="gpt_oss_mxfp4",
        model_class="GptOssForCausalLM",
        config_class="GptOssConfig",
        config={},  # gpt_oss's, plus quantization_config
        base_seed=13000,
        mxfp4_of="gpt_oss",
        notes="gpt_oss's expert gate_up_proj/down_proj quantized to MXFP4 (nearest E2M1 value, "
        "one power-of-two scale per 32), stored as *_blocks/*_scales with quant_method mxfp4; "
        "the reference is transformers' on this file (Mxfp4Config(dequantize=True))",
    ),
)

FIXTURES_BY_NAME: dict[str, FixtureSpec] = {spec.name: spec for spec in FIXTURES}


# --------------------------------------------------------------------------------------------
# Determinism and small helpers
# --------------------------------------------------------------------------------------------


def set_determinism() -> None:
    """Make torch's CPU arithmetic reproducible run to run (one thread, deterministic kernels)."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def versions() -> dict[str, str]:
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
    }


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write an ``.npz`` that ``np.load`` reads, byte-identical for identical arrays.

    ``np.savez`` stamps every zip member with the current time; this writer uses a fixed
    timestamp and a fixed member order (the dict's order).
    """
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key, value in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asarray(value), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=_ZIP_DATE_TIME)
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def make_prompts(seed: int, vocab_size: int) -> list[np.ndarray]:
    """The prompts of a fixture: random ids in [0, vocab_size), lengths PROMPT_LENGTHS."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n).astype(np.int32) for n in PROMPT_LENGTHS]


def safetensors_files(fixture_dir: Path) -> list[Path]:
    return sorted(fixture_dir.glob("*.safetensors"))


def read_safetensors(fixture_dir: Path) -> dict[str, np.ndarray]:
    """All tensors of a fixture (single file or shards) as numpy arrays."""
    tensors: dict[str, np.ndarray] = {}
    for path in safetensors_files(fixture_dir):
        for key, value in safetensors.torch.load_file(str(path)).items():
            assert key not in tensors, f"{key} in more than one shard"
            tensors[key] = value.numpy()
    return tensors


def dir_size_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def make_config(spec: FixtureSpec) -> transformers.PretrainedConfig:
    config_cls = getattr(transformers, spec.config_class)
    return config_cls(**copy.deepcopy(spec.config))


def _use_eager(model: torch.nn.Module) -> None:
    """Plain PyTorch attention and expert loops: the simplest, most reproducible kernels."""
    model.set_attn_implementation("eager")
    if hasattr(model, "set_experts_implementation") and getattr(
        model.config, "num_local_experts", None
    ):
        model.set_experts_implementation("eager")


def _randomise_1d_params(model: torch.nn.Module, seed: int, scale: float) -> None:
    """Give norm scales and biases random values instead of transformers' exact ones/zeros.

    Weights of 1-D parameters become ``1 + scale * N(0, 1)``, biases ``scale * N(0, 1)``.
    Parameters are visited in name order with a dedicated generator, so the result depends only
    on ``seed``.
    """
    gen = torch.Generator().manual_seed(seed + 7919)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            # GPT-OSS's expert biases are [E, 2F] and [E, D] (zeros from transformers too).
            if p.ndim != 1 and not name.endswith("_bias"):
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * scale
            if name.endswith("bias"):
                p.copy_(noise)
            else:
                p.copy_(1.0 + noise)


def _randomise_buffers(
    model: torch.nn.Module, seed: int, suffixes: tuple[str, ...], scale: float
) -> None:
    """Persistent buffers named ``*<suffix>`` (DeepSeek's ``e_score_correction_bias``, zeros
    from transformers) become ``scale * N(0, 1)``, so that a loader dropping them is caught."""
    gen = torch.Generator().manual_seed(seed + 104729)
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name in sorted(buffers):
            if name.endswith(suffixes):
                b = buffers[name]
                b.copy_(torch.randn(b.shape, generator=gen, dtype=torch.float32) * scale)


def build_model(spec: FixtureSpec, seed: int) -> torch.nn.Module:
    """A freshly initialised float32 model for `spec`, deterministic in `seed`."""
    torch.manual_seed(seed)
    config = make_config(spec)
    model_cls = getattr(transformers, spec.model_class)
    model = model_cls(config).to(torch.float32)
    _randomise_1d_params(model, seed, scale=config.initializer_range)
    _randomise_buffers(
        model, seed, spec.extra.get("randomise_buffers", ()), config.initializer_range
    )
    model.eval()
    _use_eager(model)
    return model


def load_model(fixture_dir: Path, model_class: str | None = None) -> torch.nn.Module:
    """Load a fixture directory with ``from_pretrained`` (float32, eager kernels)."""
    if model_class is None:
        model_class = json.loads((fixture_dir / REFERENCE_JSON).read_text())["model_class"]
    model_cls = getattr(transformers, model_class)
    kwargs: dict[str, Any] = {}
    qc = json.loads((fixture_dir / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("quant_method") == "mxfp4":  # no MXFP4 kernels on CPU: dequantize on load
        kwargs["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    model = model_cls.from_pretrained(str(fixture_dir), dtype=torch.float32, **kwargs)
    # The loaded tensors may sit at addresses only 8-byte aligned (views into the file's
    # buffer), where the CPU's single-row matmul kernel sums in another order than for the
    # freshly allocated tensors of build_model: decode logits then differ in the last bits
    # (seen: 2.4e-6 on qwen3). Fresh copies make the reloaded model compute identically.
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    model.eval()
    _use_eager(model)
    return model


# --------------------------------------------------------------------------------------------
# Reference outputs
# --------------------------------------------------------------------------------------------


@dataclass
class Reference:
    arrays: dict[str, np.ndarray]
    min_gap: float  # smallest top-1 minus top-2 logit over all greedy steps and prompts
    min_router_gap: float | None  # MoE: smallest (k-th - (k+1)-th) router logit over tokens


def _top_gap(logits: torch.Tensor) -> float:
    top2 = torch.topk(logits, 2).values
    return float(top2[0] - top2[1])


def _router_gap(router_logits: Any, top_k: int) -> float:
    """Smallest margin between the k-th and (k+1)-th router logit over tokens and layers."""
    gaps = []
    for layer_logits in router_logits:
        s = torch.sort(layer_logits.float(), dim=-1, descending=True).values
        gaps.append(float((s[..., top_k - 1] - s[..., top_k]).min()))
    return min(gaps)


def _grouped_margins(model: torch.nn.Module) -> list[float] | None:
    """DeepSeek's group-limited routing: hooks on every router recording, per call, the
    smallest margin of each choice it makes on the biased scores (the topk_group-th vs the
    next group score, the top_k-th vs the next expert within the chosen groups). The router
    logits alone (:func:`_router_gap`) miss near ties the correction bias creates. None for
    other models."""
    if not getattr(model.config, "n_group", None):
        return None
    margins: list[float] = []

    def hook(gate: torch.nn.Module, inputs: tuple, _out: Any) -> None:
        x = inputs[0].reshape(-1, gate.hidden_dim).float()
        scores = torch.nn.functional.linear(x, gate.weight.float()).sigmoid()
        choice = scores + gate.e_score_correction_bias
        per_group = gate.num_experts // gate.num_group
        groups = choice.view(-1, gate.num_group, per_group).topk(2, dim=-1)[0].sum(-1)
        ranked = groups.sort(dim=-1, descending=True).values
        if gate.topk_group < gate.num_group:
            margins.append(
                float((ranked[:, gate.topk_group - 1] - ranked[:, gate.topk_group]).min())
            )
        chosen = torch.zeros_like(groups).scatter_(1, groups.topk(gate.topk_group, -1)[1], 1)
        keep = chosen.bool().unsqueeze(-1).expand(-1, -1, per_group).reshape(choice.shape)
        within = choice.masked_fill(~keep, float("-inf")).sort(dim=-1, descending=True).values
        if gate.top_k < gate.topk_group * per_group:
            margins.append(float((within[:, gate.top_k - 1] - within[:, gate.top_k]).min()))

    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            gate.register_forward_hook(hook)
    return margins


@torch.no_grad()
def _forward(model: torch.nn.Module, input_ids: torch.Tensor, moe: bool, **kwargs: Any) -> Any:
    if moe:
        kwargs["output_router_logits"] = True
    return model(input_ids=input_ids, use_cache=True, **kwargs)


@torch.no_grad()
def compute_reference(model: torch.nn.Module, prompts: list[np.ndarray]) -> Reference:
    """Run each prompt alone (batch 1, unpadded, no mask) and decode GREEDY_TOKENS greedily.

    The greedy loop is an explicit argmax loop over the KV cache: no EOS handling, so exactly
    GREEDY_TOKENS tokens come out.
    """
    moe = bool(getattr(model.config, "num_local_experts", None))
    grouped = _grouped_margins(model)
    top_k = getattr(model.config, "num_experts_per_tok", 0)
    arrays: dict[str, np.ndarray] = {"n_prompts": np.asarray(len(prompts), dtype=np.int32)}
    min_gap = math.inf
    min_router_gap = math.inf if moe else None

    for i, tokens in enumerate(prompts):
        ids = torch.from_numpy(tokens.astype(np.int64))[None, :]
        out = _forward(model, ids, moe)
        logits = out.logits[0].float()
        past = out.past_key_values
        if moe:
            min_router_gap = min(min_router_gap, _router_gap(out.router_logits, top_k))

        greedy: list[int] = []
        step_logits: list[torch.Tensor] = []
        next_logits = logits[-1]
        for step in range(GREEDY_TOKENS):
            min_gap = min(min_gap, _top_gap(next_logits))
            token = int(torch.argmax(next_logits))
            greedy.append(token)
            step_logits.append(next_logits.clone())
            if step == GREEDY_TOKENS - 1:
                break
            out = _forward(model, torch.tensor([[token]]), moe, past_key_values=past)
            past = out.past_key_values
            next_logits = out.logits[0, -1].float()
            if moe:
                min_router_gap = min(min_router_gap, _router_gap(out.router_logits, top_k))

        arrays[f"tokens_{i}"] = tokens.astype(np.int32)
        arrays[f"logits_{i}"] = logits.numpy().astype(np.float32)
        arrays[f"greedy_{i}"] = np.asarray(greedy, dtype=np.int32)
        arrays[f"greedy_logits_{i}"] = torch.stack(step_logits).numpy().astype(np.float32)

    if grouped:  # the biased group and expert choices, not the raw logits
        min_router_gap = min(grouped)
    return Reference(arrays=arrays, min_gap=min_gap, min_router_gap=min_router_gap)


def _gaps_ok(ref: Reference, min_gap: float) -> bool:
    if not (ref.min_gap > min_gap):
        return False
    return ref.min_router_gap is None or ref.min_router_gap > min_gap


def _assert_same_reference(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a)} vs {sorted(b)}"
    for key in a:
        if not np.array_equal(a[key], b[key]):
            diff = np.max(np.abs(a[key].astype(np.float64) - b[key].astype(np.float64)))
            raise AssertionError(f"{what}: {key} differs (max abs diff {diff:.3g})")


# --------------------------------------------------------------------------------------------
# Extras: tokenizer, llama3 rope check, Mixtral legacy conversion
# --------------------------------------------------------------------------------------------


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A meaningless but valid WordLevel tokenizer with exactly `vocab_size` entries.

    Ids 0, 1, 2 are ``<unk>``, ``<s>``, ``</s>`` (matching the llama config's bos 1 / eos 2);
    the rest are made-up syllable words (``ba``, ``be``, ..., ``baba``, ...); whitespace splits.
    """
    specials = ["<unk>", "<s>", "</s>"]
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words: list[str] = []
    n = 0
    while len(specials) + len(words) < vocab_size:
        hi, lo = divmod(n, len(syllables))
        words.append(syllables[lo] + (syllables[hi - 1] if hi else ""))
        n += 1
    vocab = {tok: idx for idx, tok in enumerate(specials + words)}
    assert len(vocab) == vocab_size
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    return tok


def llama3_frequency_summary(config: transformers.PretrainedConfig) -> dict[str, Any]:
    """How the llama3 rule changed each RoPE inverse frequency (kept, smoothed or scaled)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    rp = config.rope_parameters
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = rp["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    ratio = (inv_llama3 / inv).tolist()
    kinds = [
        "kept"
        if abs(r - 1) < 1e-6
        else ("scaled" if abs(r - 1 / rp["factor"]) < 1e-6 else "smoothed")
        for r in ratio
    ]
    return {"ratio": [round(r, 6) for r in ratio], "kinds": kinds}


@torch.no_grad()
def llama3_rope_effect(model: torch.nn.Module, prompts: list[np.ndarray]) -> float:
    """Max |logit difference| between the llama3-scaled model and the same weights, plain RoPE."""
    config = copy.deepcopy(model.config)
    config.rope_parameters = {
        "rope_type": "default",
        "rope_theta": config.rope_parameters["rope_theta"],
    }
    plain = type(model)(config).to(torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.eval()
    _use_eager(plain)
    worst = 0.0
    for tokens in prompts:
        ids = torch.from_numpy(tokens.astype(np.int64))[None, :]
        a = model(input_ids=ids).logits
        b = plain(input_ids=ids).logits
        worst = max(worst, float((a - b).abs().max()))
    return worst


def mixtral_fused_to_legacy(
    tensors: dict[str, torch.Tensor], num_layers: int, num_experts: int
) -> dict[str, torch.Tensor]:
    """Rename/split transformers 5.x fused Mixtral tensors into the per-expert legacy names.

    ``gate_up_proj[j]`` is ``[2F, D]`` with the gate projection in rows ``[:F]`` and the up
    projection in rows ``[F:]`` (the modeling code's ``.chunk(2, dim=-1)`` on ``x @ W.T``), so
    ``w1 = gate_up_proj[j, :F]``, ``w3 = gate_up_proj[j, F:]``, ``w2 = down_proj[j]``.
    """
    out = dict(tensors)
    for i in range(num_layers):
        src = f"model.layers.{i}.mlp."
        dst = f"model.layers.{i}.block_sparse_moe."
        out[dst + "gate.weight"] = out.pop(src + "gate.weight")
        gate_up = out.pop(src + "experts.gate_up_proj")
        down = out.pop(src + "experts.down_proj")
        assert gate_up.shape[0] == num_experts and down.shape[0] == num_experts
        f = gate_up.shape[1] // 2
        for j in range(num_experts):
            e = f"{dst}experts.{j}."
            out[e + "w1.weight"] = gate_up[j, :f].contiguous().clone()
            out[e + "w3.weight"] = gate_up[j, f:].contiguous().clone()
            out[e + "w2.weight"] = down[j].contiguous().clone()
    assert not any(".mlp." in k for k in out), "unconverted fused tensors left"
    return out


@torch.no_grad()
def check_legacy_expert_math(model: torch.nn.Module, legacy: dict[str, torch.Tensor]) -> float:
    """Each expert of the modeling code vs ``w2 @ (silu(w1 @ x) * (w3 @ x))`` from legacy tensors.

    Returns the max abs difference over all layers and experts (should be ~1e-7).
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, model.config.hidden_size, generator=gen)
    worst = 0.0
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for j in range(model.config.num_local_experts):
            idx = torch.full((x.shape[0], 1), j, dtype=torch.long)
            weight = torch.ones(x.shape[0], 1)
            hf = experts(x, idx, weight)
            e = f"model.layers.{i}.block_sparse_moe.experts.{j}."
            w1, w2, w3 = legacy[e + "w1.weight"], legacy[e + "w2.weight"], legacy[e + "w3.weight"]
            ours = (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T
            worst = max(worst, float((hf - ours).abs().max()))
    return worst


# --------------------------------------------------------------------------------------------
# Building fixtures
# --------------------------------------------------------------------------------------------


def _clean_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _save_model(model: torch.nn.Module, spec: FixtureSpec, fixture_dir: Path) -> None:
    kwargs: dict[str, Any] = {}
    if spec.max_shard_size:
        kwargs["max_shard_size"] = spec.max_shard_size
    if spec.is_moe:
        # transformers 5.x reverts fused experts to the legacy per-expert names on save unless
        # told not to; fused fixtures keep the in-memory (fused) layout.
        kwargs["save_original_format"] = not spec.fused_experts
    model.save_pretrained(str(fixture_dir), **kwargs)
    for name in DROPPED_FILES:
        (fixture_dir / name).unlink(missing_ok=True)


def _reference_json(
    spec: FixtureSpec, seed: int, attempts: int, ref: Reference, extra: dict[str, Any]
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "fixture": spec.name,
        "model_class": spec.model_class,
        "notes": spec.notes,
        "n_prompts": len(PROMPT_LENGTHS),
        "prompt_lengths": list(PROMPT_LENGTHS),
        "greedy_tokens": GREEDY_TOKENS,
        "dtype": "float32",
        "seed": seed,
        "attempts": attempts,
        "min_greedy_logit_gap": round(ref.min_gap, 6),
        "arrays": {
            "n_prompts": "int32 scalar",
            "tokens_{i}": "int32 [T_i] prompt i",
            "logits_{i}": "float32 [T_i, V] logits at every prompt position (prompt run alone)",
            "greedy_{i}": f"int32 [{GREEDY_TOKENS}] greedy argmax continuation (KV cache, no EOS)",
            "greedy_logits_{i}": f"float32 [{GREEDY_TOKENS}, V] logits each greedy token is the "
            "argmax of",
        },
        "versions": versions(),
    }
    if ref.min_router_gap is not None:
        meta["min_router_gap"] = round(ref.min_router_gap, 6)
    meta.update(extra)
    return meta


def build_fixture(spec: FixtureSpec, out_dir: Path, min_gap: float = DEFAULT_MIN_GAP) -> dict:
    """Build one (non-derived) fixture into ``out_dir / spec.name``; return its reference.json."""
    assert spec.legacy_of is None, "derived fixtures are built by build_legacy_fixture"
    fixture_dir = out_dir / spec.name

    for attempt in range(MAX_ATTEMPTS):
        seed = spec.base_seed + attempt
        model = build_model(spec, seed)
        prompts = make_prompts(seed, model.config.vocab_size)
        ref = compute_reference(model, prompts)
        if _gaps_ok(ref, min_gap):
            break
    else:
        raise RuntimeError(f"{spec.name}: no seed with logit gaps > {min_gap} in {MAX_ATTEMPTS}")

    _clean_dir(fixture_dir)
    _save_model(model, spec, fixture_dir)

    # The reference is what the files on disk produce: reload and recompute, must be identical.
    reloaded = load_model(fixture_dir, spec.model_class)
    for key, value in model.state_dict().items():
        assert torch.equal(value, reloaded.state_dict()[key]), (
            f"{spec.name}: {key} not round-tripped"
        )
    ref_disk = compute_reference(reloaded, prompts)
    _assert_same_reference(ref.arrays, ref_disk.arrays, f"{spec.name} reloaded")

    extra: dict[str, Any] = {}
    if spec.config.get("rope_parameters", {}).get("rope_type") == "llama3":
        extra["llama3_inv_freq"] = llama3_frequency_summary(model.config)
        effect = llama3_rope_effect(model, prompts)
        assert effect > 1e-2, f"{spec.name}: llama3 scaling barely changes logits ({effect})"
        extra["llama3_vs_plain_rope_max_logit_diff"] = round(effect, 4)
    if spec.is_moe:
        extra["weights_layout"] = "fused" if spec.fused_experts else "legacy"
    for effect_name, overrides in spec.effects.items():
        effect = config_effect(model, spec, prompts, overrides)
        assert effect > 1e-2, f"{spec.name}: {effect_name} barely changes logits ({effect})"
        extra[f"effect_{effect_name}_max_logit_diff"] = round(effect, 4)
    if spec.tokenizer:
        build_tokenizer(model.config.vocab_size).save(str(fixture_dir / TOKENIZER_JSON))

    write_npz(fixture_dir / REFERENCE_NPZ, ref.arrays)
    meta = _reference_json(spec, seed, attempt + 1, ref, extra)
    write_json(fixture_dir / REFERENCE_JSON, meta)
    return meta


@torch.no_grad()
def config_effect(
    model: torch.nn.Module, spec: FixtureSpec, prompts: list[np.ndarray], overrides: dict
) -> float:
    """Max |logit difference| over the prompts between ``model`` and the same weights with
    ``overrides`` in its config: a feature the fixture is meant to exercise must bind."""
    overrides = dict(overrides)
    zero = overrides.pop("_zero_buffers", ())
    other = getattr(transformers, spec.model_class)(
        getattr(transformers, spec.config_class)(**{**copy.deepcopy(spec.config), **overrides})
    ).to(torch.float32)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, b in other.named_buffers():
            if name.endswith(tuple(zero)):
                b.zero_()
    other.eval()
    _use_eager(other)
    diff = 0.0
    for tokens in prompts:
        ids = torch.from_numpy(tokens.astype(np.int64))[None, :]
        a, b = model(input_ids=ids).logits, other(input_ids=ids).logits
        diff = max(diff, float((a - b).abs().max()))
    return diff


def build_legacy_fixture(spec: FixtureSpec, out_dir: Path) -> dict:
    """Derive ``spec.name`` from the already built fused Mixtral fixture ``spec.legacy_of``."""
    parent_dir = out_dir / spec.legacy_of
    fixture_dir = out_dir / spec.name
    parent_meta = json.loads((parent_dir / REFERENCE_JSON).read_text())
    config = json.loads((parent_dir / "config.json").read_text())
    files = safetensors_files(parent_dir)
    assert [f.name for f in files] == ["model.safetensors"], "expected one unsharded file"

    fused = safetensors.torch.load_file(str(files[0]))
    legacy = mixtral_fused_to_legacy(
        fused, config["num_hidden_layers"], config["num_local_experts"]
    )

    _clean_dir(fixture_dir)
    shutil.copyfile(parent_dir / "config.json", fixture_dir / "config.json")
    safetensors.torch.save_file(
        legacy, str(fixture_dir / "model.safetensors"), metadata={"format": "pt"}
    )

    # Check 1: the split halves do what the modeling code does with gate_up_proj.
    fused_model = load_model(parent_dir, spec.model_class)
    expert_err = check_legacy_expert_math(fused_model, legacy)
    assert expert_err < 1e-5, f"legacy w1/w3/w2 disagree with the modeling code ({expert_err})"

    # Check 2: transformers' own legacy-format save of the same model gives the same tensors.
    # (A model *loaded* from the fused file is saved back fused, so rebuild it from its seed.)
    rebuilt = build_model(FIXTURES_BY_NAME[spec.legacy_of], parent_meta["seed"])
    for key, value in fused_model.state_dict().items():
        assert torch.equal(value, rebuilt.state_dict()[key]), f"{key}: rebuilt model differs"
    with tempfile.TemporaryDirectory() as tmp:
        rebuilt.save_pretrained(tmp)  # default save_original_format=True: legacy names
        theirs = safetensors.torch.load_file(str(Path(tmp) / "model.safetensors"))
    assert theirs.keys() == legacy.keys(), sorted(set(theirs) ^ set(legacy))
    for key in legacy:
        assert torch.equal(theirs[key], legacy[key]), f"{key} differs from transformers' save"

    # Check 3: from_pretrained converts the legacy file back; same weights, same reference.
    legacy_model = load_model(fixture_dir, spec.model_class)
    for key, value in fused_model.state_dict().items():
        assert torch.equal(value, legacy_model.state_dict()[key]), f"{key} not restored"
    parent_ref = load_npz(parent_dir / REFERENCE_NPZ)
    n = int(parent_ref["n_prompts"])
    prompts = [parent_ref[f"tokens_{i}"] for i in range(n)]
    ref = compute_reference(legacy_model, prompts)
    _assert_same_reference(parent_ref, ref.arrays, f"{spec.name} vs {spec.legacy_of}")

    shutil.copyfile(parent_dir / REFERENCE_NPZ, fixture_dir / REFERENCE_NPZ)
    meta = dict(parent_meta)
    meta.update(
        fixture=spec.name,
        notes=spec.notes,
        weights_layout="legacy",
        same_weights_and_reference_as=spec.legacy_of,
        legacy_expert_math_max_abs_diff=float(f"{expert_err:.3g}"),
    )
    write_json(fixture_dir / REFERENCE_JSON, meta)
    return meta


FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float expert tensor ``W [E, A, R]`` as MXFP4 ``(blocks [E, R, A/32, 16], scales
    [E, R, A/32])``: per 32 values of a row of W^T the smallest power of two 2^k with
    ``max|v| / 2^k <= 6``, each value the nearest E2M1 code (first in table order on a tie),
    two codes a byte, the low nibble first; scales stored as ``k + 127``."""
    e, a, r = w.shape
    v = w.transpose(0, 2, 1).reshape(e, r, a // 32, 32).astype(np.float64)
    amax = np.abs(v).max(axis=-1)
    k = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127).astype(np.int32)
    q = v / np.exp2(k)[..., None]
    codes = np.abs(q[..., None] - FP4_VALUES.astype(np.float64)).argmin(axis=-1).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (k + 127).astype(np.uint8)


def build_mxfp4_fixture(spec: FixtureSpec, out_dir: Path, min_gap: float) -> dict:
    """Derive ``spec.name`` from the built fixture ``spec.mxfp4_of``: its expert projections
    quantized to MXFP4, the reference computed by transformers on the quantized file."""
    parent_dir, fixture_dir = out_dir / spec.mxfp4_of, out_dir / spec.name
    parent_meta = json.loads((parent_dir / REFERENCE_JSON).read_text())
    tensors = safetensors.torch.load_file(str(parent_dir / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = value
            continue
        blocks, scales = quantize_mxfp4(value.numpy())
        out[name + "_blocks"] = torch.from_numpy(blocks)
        out[name + "_scales"] = torch.from_numpy(scales)
    config = json.loads((parent_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    _clean_dir(fixture_dir)
    write_json(fixture_dir / "config.json", config)
    safetensors.torch.save_file(
        dict(sorted(out.items())), str(fixture_dir / "model.safetensors"), metadata={"format": "pt"}
    )
    model = load_model(fixture_dir, spec.model_class)
    # The parent's prompts first; on near ties, the next prompt seeds (the weights are fixed).
    for attempt in range(MAX_ATTEMPTS):
        prompts = make_prompts(parent_meta["seed"] + attempt, model.config.vocab_size)
        ref = compute_reference(model, prompts)
        if _gaps_ok(ref, min_gap):
            break
    else:
        raise RuntimeError(f"{spec.name}: no prompts with gaps > {min_gap} in {MAX_ATTEMPTS}")
    parent_ref = load_npz(parent_dir / REFERENCE_NPZ)
    # How far MXFP4 moved the weights and the logits from the parent's.
    state = model.state_dict()
    weight_err = max(
        float((state[n].float() - tensors[n]).abs().max())
        for n in tensors
        if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    )
    same_prompts = attempt == 0
    logit_moved = (
        max(
            float(np.abs(ref.arrays[f"logits_{i}"] - parent_ref[f"logits_{i}"]).max())
            for i in range(len(prompts))
            if same_prompts
        )
        if same_prompts
        else None
    )
    write_npz(fixture_dir / REFERENCE_NPZ, ref.arrays)
    meta = _reference_json(spec, parent_meta["seed"] + attempt, attempt + 1, ref, {})
    meta.update(
        weights_of=spec.mxfp4_of,
        quantization="mxfp4 experts (gate_up_proj, down_proj), dequantized by transformers",
        mxfp4_max_abs_weight_change=round(weight_err, 6),
        mxfp4_vs_float_max_logit_diff=None if logit_moved is None else round(logit_moved, 4),
    )
    write_json(fixture_dir / REFERENCE_JSON, meta)
    return meta


def build_all(
    out_dir: Path, names: list[str] | None = None, min_gap: float = DEFAULT_MIN_GAP
) -> dict[str, dict]:
    """Build the named fixtures (default: all) into `out_dir`; derived ones after their parent."""
    set_determinism()
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = [s for s in FIXTURES if names is None or s.name in names]
    metas: dict[str, dict] = {}
    for spec in wanted:
        if spec.legacy_of is None and spec.mxfp4_of is None:
            metas[spec.name] = build_fixture(spec, out_dir, min_gap)
    for spec in wanted:
        if spec.legacy_of is not None:
            if spec.legacy_of not in metas and not (out_dir / spec.legacy_of).is_dir():
                parent = FIXTURES_BY_NAME[spec.legacy_of]
                metas[parent.name] = build_fixture(parent, out_dir, min_gap)
            metas[spec.name] = build_legacy_fixture(spec, out_dir)
    for spec in wanted:
        if spec.mxfp4_of is not None:
            if spec.mxfp4_of not in metas and not (out_dir / spec.mxfp4_of).is_dir():
                parent = FIXTURES_BY_NAME[spec.mxfp4_of]
                metas[parent.name] = build_fixture(parent, out_dir, min_gap)
            metas[spec.name] = build_mxfp4_fixture(spec, out_dir, min_gap)
    return metas


# --------------------------------------------------------------------------------------------
# Checks (--check)
# --------------------------------------------------------------------------------------------


def check_reference_shapes(fixture_dir: Path) -> dict[str, np.ndarray]:
    """Load reference.npz and assert the documented keys, dtypes and shapes."""
    ref = load_npz(fixture_dir / REFERENCE_NPZ)
    config = json.loads((fixture_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    n = int(ref["n_prompts"])
    assert n == len(PROMPT_LENGTHS), n
    expected = {"n_prompts"}
    for i in range(n):
        t = PROMPT_LENGTHS[i]
        expected |= {f"tokens_{i}", f"logits_{i}", f"greedy_{i}", f"greedy_logits_{i}"}
        assert ref[f"tokens_{i}"].dtype == np.int32 and ref[f"tokens_{i}"].shape == (t,)
        assert ref[f"logits_{i}"].dtype == np.float32 and ref[f"logits_{i}"].shape == (t, vocab)
        assert ref[f"greedy_{i}"].dtype == np.int32
        assert ref[f"greedy_{i}"].shape == (GREEDY_TOKENS,)
        assert ref[f"greedy_logits_{i}"].shape == (GREEDY_TOKENS, vocab)
        assert np.all((ref[f"tokens_{i}"] >= 0) & (ref[f"tokens_{i}"] < vocab))
        assert np.all(np.isfinite(ref[f"logits_{i}"]))
        assert np.array_equal(ref[f"greedy_logits_{i}"].argmax(-1), ref[f"greedy_{i}"])
        assert np.array_equal(ref[f"greedy_logits_{i}"][0], ref[f"logits_{i}"][-1])
    assert set(ref) == expected, sorted(set(ref) ^ expected)
    return ref


@torch.no_grad()
def check_fixture(fixture_dir: Path) -> dict[str, float]:
    """Sanity checks of one fixture against transformers; returns the measured differences.

    * reference.npz has the documented shapes;
    * a right-padded batch of all prompts with an attention mask gives the stored (unpadded)
      logits at the real positions within PAD_CHECK_TOL;
    * recomputing prompt + greedy tokens in one cache-less forward gives the same argmaxes and
      the stored greedy logits within PAD_CHECK_TOL;
    * ``generate(do_sample=False)`` with EOS disabled gives the same greedy tokens.
    """
    ref = check_reference_shapes(fixture_dir)
    model = load_model(fixture_dir)
    n = int(ref["n_prompts"])
    prompts = [ref[f"tokens_{i}"].astype(np.int64) for i in range(n)]
    t_max = max(len(p) for p in prompts)

    ids = torch.zeros((n, t_max), dtype=torch.long)
    mask = torch.zeros((n, t_max), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.from_numpy(p)
        mask[i, : len(p)] = 1
    batch_logits = model(input_ids=ids, attention_mask=mask).logits.float().numpy()
    pad_diff = max(
        float(np.max(np.abs(batch_logits[i, : len(p)] - ref[f"logits_{i}"])))
        for i, p in enumerate(prompts)
    )
    assert pad_diff <= PAD_CHECK_TOL, f"padded batch differs by {pad_diff}"

    nocache_diff = 0.0
    for i, p in enumerate(prompts):
        greedy = ref[f"greedy_{i}"].astype(np.int64)
        full = torch.from_numpy(np.concatenate([p, greedy[:-1]]))[None, :]
        logits = model(input_ids=full, use_cache=False).logits[0, len(p) - 1 :].float().numpy()
        assert np.array_equal(logits.argmax(-1), greedy), f"prompt {i}: no-cache argmax differs"
        nocache_diff = max(nocache_diff, float(np.max(np.abs(logits - ref[f"greedy_logits_{i}"]))))
    # Float32 rounding grows with the logits' size: Gemma 3's (no final soft cap) reach ~9,
    # where a cache-less recompute summing in another order moves them by ~1e-5.
    biggest = max(float(np.max(np.abs(ref[f"greedy_logits_{i}"]))) for i in range(n))
    nocache_tol = PAD_CHECK_TOL * max(1.0, biggest / 4)
    assert nocache_diff <= nocache_tol, f"no-cache recompute differs by {nocache_diff}"

    # Plain argmax for exactly GREEDY_TOKENS steps: EOS must neither stop generation nor be
    # suppressed (min_new_tokens would mask it out), so drop it from the model's defaults, which
    # generate() merges into an explicit GenerationConfig.
    model.generation_config.eos_token_id = None
    gen_config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=GREEDY_TOKENS, pad_token_id=0
    )
    for i, p in enumerate(prompts):
        ids_i = torch.from_numpy(p)[None, :]
        out = model.generate(
            input_ids=ids_i, attention_mask=torch.ones_like(ids_i), generation_config=gen_config
        )
        new = out[0, len(p) :].numpy()
        assert np.array_equal(new, ref[f"greedy_{i}"]), f"prompt {i}: generate() differs: {new}"

    return {"padded_batch_max_abs_diff": pad_diff, "no_cache_max_abs_diff": nocache_diff}


def describe_tensors(fixture_dir: Path) -> list[str]:
    """One line per distinct tensor-name pattern (layer/expert indices replaced by {i}/{j})."""
    seen: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for path in safetensors_files(fixture_dir):
        with safetensors.safe_open(str(path), "np") as f:
            for key in sorted(f.keys()):
                pattern = re.sub(r"(layers|\bh)\.\d+\.", r"\1.{i}.", key)
                pattern = re.sub(r"experts\.\d+\.", "experts.{j}.", pattern)
                shape = tuple(f.get_slice(key).get_shape())
                dtype = f.get_slice(key).get_dtype()
                seen.setdefault(pattern, (pattern, shape, dtype))
    return [f"{p:60s} {str(list(s)):16s} {d}" for p, s, d in sorted(seen.values())]


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture root directory")
    parser.add_argument(
        "--only", nargs="+", choices=sorted(FIXTURES_BY_NAME), help="build only these fixtures"
    )
    parser.add_argument(
        "--min-gap",
        type=float,
        default=DEFAULT_MIN_GAP,
        help="smallest allowed top-1/top-2 logit gap (and MoE router margin); default %(default)s",
    )
    parser.add_argument("--check", action="store_true", help="sanity-check after building")
    parser.add_argument("--check-only", action="store_true", help="only check existing fixtures")
    parser.add_argument("--describe", action="store_true", help="print tensor names and shapes")
    args = parser.parse_args(argv)

    out_dir: Path = args.out
    names = args.only or [s.name for s in FIXTURES]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")

    if not args.check_only:
        metas = build_all(out_dir, args.only, args.min_gap)
        for name, meta in metas.items():
            router = meta.get("min_router_gap")
            router_s = f", min router gap {router:.4f}" if router is not None else ""
            print(
                f"{name:15s} seed {meta['seed']} (attempt {meta['attempts']}): "
                f"min greedy logit gap {meta['min_greedy_logit_gap']:.4f}{router_s}, "
                f"{dir_size_bytes(out_dir / name) / 1024:.0f} KiB"
            )
    else:
        set_determinism()

    if args.check or args.check_only:
        for name in names:
            stats = check_fixture(out_dir / name)
            print(
                f"check {name:15s} ok: padded-batch max |diff| "
                f"{stats['padded_batch_max_abs_diff']:.2e}, no-cache max |diff| "
                f"{stats['no_cache_max_abs_diff']:.2e}, generate() tokens equal"
            )

    if args.describe:
        for name in names:
            print(f"--- {name}: {[p.name for p in safetensors_files(out_dir / name)]}")
            for line in describe_tensors(out_dir / name):
                print("   ", line)

    total = dir_size_bytes(out_dir)
    du = subprocess.run(["du", "-sh", str(out_dir)], capture_output=True, text=True).stdout.strip()
    print(f"total size of {out_dir}: {total} bytes ({total / 2**20:.2f} MiB); du -sh: {du}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
