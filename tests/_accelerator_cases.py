"""The strategies compiled for TPU and lowered for CUDA (tests/test_accelerator_compile.py).

A Llama-like bf16 model at kernel-friendly sizes: head_dim 128 (TPU lanes), 256-token
sequences (whole splash blocks), 4 layers.
"""

from __future__ import annotations

import dataclasses

from jaxpar.models import ModelConfig, preset

# (preset, strategy, model overrides). tiny-gqa has 8 query and 2 kv heads: tp=4
# replicates the kv heads.
TPU_CASES: list[tuple[str, str, dict]] = [
    ("tiny-gqa", "", {}),
    ("tiny-gqa", "tp=2", {}),
    ("tiny-gqa", "dp=2,tp=2", {}),
    ("tiny-gqa", "sp=2,tp=2", {}),
    ("tiny-gqa", "pp=2,tp=2", {}),
    ("tiny-gqa", "tp=4", {}),
    ("tiny-gqa", "tp=2", {"sliding_window": 64}),
]
# "auto" takes cuDNN in both phases on GPU; the Pallas (Triton) decode kernel, which JAX
# deprecates, stays selectable by name and is lowered too, in the pipeline (its scan carry).
CUDA_CASES = [*TPU_CASES, ("tiny-gqa", "pp=2,tp=2", {"decode_attention": "pallas_gpu"})]
# Ragged MoE dispatch: expert parallel alone, and with data and tensor parallelism.
MOE_CASES = ["ep=2", "dp=2,ep=2,tp=2"]


def model_config(name: str, **overrides) -> ModelConfig:
    """``name``'s preset in bfloat16 at the sizes above."""
    return dataclasses.replace(
        preset(name),
        dtype="bfloat16",
        param_dtype="bfloat16",
        d_model=256,
        head_dim=128,
        max_position_embeddings=512,
        **overrides,
    )
