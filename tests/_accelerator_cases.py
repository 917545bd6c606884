"""The strategies compiled for TPU and lowered for CUDA (tests/test_accelerator_compile.py):
the TPU section of ``scripts/bench.py`` (``TPU_MATRIX``), one list for both.

A Llama-like bf16 model at kernel-friendly sizes (``bench.tpu_config``): head_dim 128 (TPU
lanes), 256-token sequences (whole splash blocks), 4 layers.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "jaxpar_bench", Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
)
bench = sys.modules.get(_spec.name) or importlib.util.module_from_spec(_spec)
if _spec.name not in sys.modules:
    sys.modules[_spec.name] = bench
    _spec.loader.exec_module(bench)

# (preset, strategy, model overrides): the dense entries. tiny-gqa has 8 query and 2 kv
# heads: at tp=4 each kv head is held by its 2 devices (rule kv-head-replicas).
TPU_CASES: list[tuple[str, str, dict]] = [c for c in bench.TPU_MATRIX if c[0] != "tiny-moe"]
# "auto" takes cuDNN in both phases on GPU; the Pallas (Triton) decode kernel, which JAX
# deprecates, stays selectable by name and is lowered too, in the pipeline (its scan carry).
CUDA_CASES = [*TPU_CASES, ("tiny-gqa", "pp=2,tp=2", {"decode_attention": "pallas_gpu"})]
# Ragged MoE dispatch: expert parallel alone, and with data and tensor parallelism.
MOE_CASES = [strategy for name, strategy, _ in bench.TPU_MATRIX if name == "tiny-moe"]
model_config = bench.tpu_config
