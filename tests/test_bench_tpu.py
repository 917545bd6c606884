"""The TPU section of ``scripts/bench.py``: steps compiled for TPU v5e on this CPU host.

Two entries (one device, tp=2) are compiled for the compile-only ``v5e:2x4`` topology and
for the CPU devices, same bfloat16 config; the figures must be real: tp=2 halves the
arguments, collectives meet the minimum on TPU (XLA:CPU all-reduces bf16 in f32: twice),
splash runs in every prefill layer. libtpu comes from the venv's ``accel`` folder (scripts/test.sh).
"""

from __future__ import annotations

import math

import pytest

import jaxpar.inspect
from jaxpar.errors import ConfigError
from tests._accelerator_cases import bench

pytestmark = pytest.mark.usefixtures("accelerator_compiles")


@pytest.fixture(scope="module")
def section() -> dict:
    path, _ = bench.libtpu()
    if path is None:
        pytest.fail("no libtpu under <venv>/accel/tpu: run scripts/test.sh, which installs it")
    return bench.tpu_section([("tiny-gqa", "", {}), ("tiny-gqa", "tp=2", {})])


@pytest.mark.accel
def test_tpu_rows_are_real_figures(section):
    assert "skipped" not in section, section
    assert section["device_kind"].startswith("TPU v5") and section["libtpu"]
    by = {(r["strategy"], r["platform"], r["phase"]): r for r in section["rows"]}
    assert len(by) == len(section["rows"]) == 8
    layers = section["rows"][0]["n_layers"]
    for (strategy, platform, phase), r in by.items():
        assert r["argument_bytes"] > 0 and r["output_bytes"] > 0 and r["compile_s"] > 0
        # Kernels only on TPU: splash in every prefill layer, XLA decode.
        splash = layers if (platform, phase) == ("tpu", "prefill") else 0
        assert r["kernel_calls"]["splash"] == splash, r
        assert r["kernel_calls"]["ragged_all_to_all"] == 0
        assert r["trip_counts_known"]
        if strategy == "":
            assert r["compiled_bytes"] == r["minimum_bytes"] == 0
    for platform in ("tpu", "cpu"):
        one, tp2 = by["", platform, "decode"], by["tp=2", platform, "decode"]
        # Weights and cache split over tp: about half the arguments per device.
        assert tp2["argument_bytes"] < 0.55 * one["argument_bytes"]
    for phase in ("prefill", "decode"):
        tpu, cpu = by["tp=2", "tpu", phase], by["tp=2", "cpu", phase]
        assert tpu["minimum_bytes"] == cpu["minimum_bytes"] > 0
        assert math.isfinite(tpu["ratio"]) and tpu["ratio"] == 1.0 and not tpu["exceptions"]
        assert cpu["ratio"] == 2.0 and set(cpu["exceptions"]) == {"cpu-bf16-upcast"}
        assert tpu["argument_bytes"] == pytest.approx(cpu["argument_bytes"], rel=0.01)


@pytest.mark.accel
def test_tpu_table_pairs_each_step_with_cpu(section):
    lines = bench.tpu_markdown(section)
    assert "nothing ran on a TPU" in lines[0] and section["libtpu"] in lines[0]
    rows = [line for line in lines if line.startswith("| tiny-gqa")]
    assert len(rows) == 4  # one per (strategy, phase): TPU and CPU side by side
    assert "| tp=2 | prefill |" in rows[2] and "| 1.00 | 2.00 |" in rows[2]


def test_without_libtpu_the_section_says_what_to_install(monkeypatch):
    def missing(*args, **kwargs):
        raise ConfigError("cannot build the compile-only TPU topology: no libtpu")

    monkeypatch.setattr(jaxpar.inspect, "tpu_devices", missing)
    result = bench.tpu_section([("tiny-gqa", "tp=2", {})])
    assert set(result) == {"skipped"} and "libtpu" in result["skipped"]
    assert "install" in result["skipped"]
    (line,) = bench.tpu_markdown(result)
    assert line.startswith("skipped: no libtpu")
