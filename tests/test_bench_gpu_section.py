"""The GPU section of ``scripts/bench.py`` runs end to end (here on one CPU device).

No GPU runs the suite, so the section that measures decode bandwidth, prefill MFU and compile
seconds on one would otherwise rot unseen; ``devices`` and ``quick`` exercise every line of it
on a tiny model. No figure is checked against the hardware: CPUs have no entry in the peak
table, so the fractions must come back as None rather than as invented numbers.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax

_spec = importlib.util.spec_from_file_location(
    "jaxpar_bench_gpu", Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)


def test_gpu_section_runs_on_a_tiny_model_and_renders():
    result = bench.gpu_section("tiny-dense", devices=jax.devices()[:1], quick=True)
    assert result["device_kind"] == jax.devices()[0].device_kind
    assert result["peak_hbm_bytes_per_s"] is None  # no invented peak for a CPU
    assert [(r["batch"], r["context"]) for r in result["decode"]] == [(1, 16), (4, 16)]
    for row in result["decode"]:
        assert row["decode_ms"] > 0 and row["hbm_fraction"] is None
        assert row["bytes_per_step"] > 0
    assert all(r["prefill_ms"] > 0 and r["mfu"] is None for r in result["prefill"])
    loops = {(r["n_layers"], r["layer_loop"]) for r in result["compile"]}
    assert loops == {(2, "unrolled"), (2, "scan"), (4, "unrolled"), (4, "scan")}
    assert all(r["prefill_compile_s"] > 0 and r["decode_compile_s"] > 0 for r in result["compile"])
    has_torch = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
    assert ("skipped" in result["peer"]) == (not has_torch)
    text = "\n".join(bench.gpu_markdown(result))
    assert "| decode batch | context |" in text and "| layers | layer loop |" in text
