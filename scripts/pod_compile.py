#!/usr/bin/env python
"""Compile-only checks at real model sizes on Cloud TPU slices (libtpu, no TPU).

Each case is a published model's ``config.json`` (``tests/fixtures/configs``: shapes only,
no weights), a TPU slice (a compile-only topology libtpu builds with no chip attached), a
strategy and a workload. For each, this builds the mesh over the slice's devices (the
topology-aware ``jaxpar.make_mesh``), the engine over abstract parameters, and compiles the
steps a server runs, then reads from the compiled TPU programs: compile seconds, bytes per
device (``memory_analysis``: arguments + outputs + temporaries - aliased) beside the
planner's prediction, collectives against the analytic minimum, the attention kernels
called, and the data movement (copies of weights or of the cache) against parameter +
cache bytes. ::

    python scripts/pod_compile.py                  # every case, full depth; Markdown table
    python scripts/pod_compile.py --layers 2       # each model cut to 2 layers per stage
    python scripts/pod_compile.py --case 70b-v5e16-plan --json out.json

``tests/test_pod_compile.py`` runs every case at reduced depth (real widths) and asserts
the figures; the README's accelerator table comes from a full-depth run of this script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
for _p in (ROOT, ROOT / "scripts"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


@dataclasses.dataclass(frozen=True)
class PodCase:
    """One compile-only check: a model shape on a TPU slice with a strategy.

    ``strategy=None``: the planner's top plan for the workload on that slice.
    """

    name: str
    model: str  # a directory under tests/fixtures/configs
    topology: str  # libtpu's name, e.g. "v5e:4x4"
    hardware: str  # the planner's hardware file for the chip
    strategy: str | None
    batch: int = 64
    prompt_len: int = 1024
    gen_len: int = 256

    @property
    def devices(self) -> int:
        dims = self.topology.split(":")[1].split("x")
        out = 1
        for d in dims:
            out *= int(d)
        return out


CASES: tuple[PodCase, ...] = (
    PodCase(name="8b-v5e8-tp8", model="llama-3-8b", topology="v5e:2x4", hardware="tpu-v5e", strategy="tp=8"),
    PodCase(name="8b-v5e8-dp2tp4", model="llama-3-8b", topology="v5e:2x4", hardware="tpu-v5e", strategy="dp=2,tp=4"),
    PodCase(name="8b-v6e16-dp2tp8", model="llama-3-8b", topology="v6e:4x4", hardware="tpu-v6e", strategy="dp=2,tp=8"),
    PodCase(name="70b-v5e16-plan", model="llama-3-70b", topology="v5e:4x4", hardware="tpu-v5e", strategy=None),
    PodCase(name="70b-v5e16-pp2tp8", model="llama-3-70b", topology="v5e:4x4", hardware="tpu-v5e", strategy="pp=2,tp=8"),
    PodCase(name="70b-v5e64-plan", model="llama-3-70b", topology="v5e:8x8", hardware="tpu-v5e", strategy=None),
    PodCase(name="qwen3moe-v5e8-ep8", model="qwen3-30b-a3b", topology="v5e:2x4", hardware="tpu-v5e", strategy="ep=8"),
    PodCase(name="dsv3-v5p64-ep8tp8", model="deepseek-v3", topology="v5p:4x4x4", hardware="tpu-v5p", strategy="ep=8,tp=8", batch=64, prompt_len=512, gen_len=256),
)  # fmt: skip


def model_config(case: PodCase, layers_per_stage: int | None = None) -> Any:
    """The case's model in bf16 from its ``config.json``; ``layers_per_stage`` cuts its
    depth to that many layers per pipeline stage (an MoE model that starts with dense
    layers keeps one of them, then its MoE layers: every kind of layer it has, at the
    least depth; DeepSeek-V3's three dense layers compile as one)."""
    from jaxpar.models import config_from_hf

    hf = json.loads((CONFIGS / case.model / "config.json").read_text())
    config = config_from_hf(hf, source=str(CONFIGS / case.model))
    config = dataclasses.replace(config, dtype="bfloat16", param_dtype="bfloat16")
    if layers_per_stage is not None:
        pp = _pp(case)
        layers = layers_per_stage * pp
        moe = config.moe
        if moe.first_dense_layers:
            moe = dataclasses.replace(moe, first_dense_layers=1)
            layers = max(layers, 1 + pp)
        config = dataclasses.replace(config, n_layers=layers, moe=moe)
    return config


def _pp(case: PodCase) -> int:
    from jaxpar.spec import ParallelConfig

    return ParallelConfig.parse(case.strategy).pp if case.strategy else 1


def workload(case: PodCase) -> Any:
    from jaxpar.plan import Workload

    return Workload(batch=case.batch, prompt_len=case.prompt_len, gen_len=case.gen_len)


def strategy_for(case: PodCase, config: Any) -> str:
    """The case's strategy, or the planner's top plan for its workload on the slice."""
    if case.strategy is not None:
        return case.strategy
    from jaxpar.plan import load_hardware, plan

    planning = plan(config, load_hardware(case.hardware), case.devices, workload(case))
    return str(planning.ranked[0].config)


def programs_for(parallel: Any) -> tuple[str, ...]:
    """The steps compiled: the offline prefill and decode, and the paged decode step with
    its sampler that ``jaxpar serve`` runs (unpipelined; the pipelined one's copies and
    HBM are checked in ``tests/test_pipeline_serving_tpu.py``, not against the planner)."""
    return ("prefill", "decode") if parallel.pp > 1 else ("prefill", "decode", "serve_decode")


def run_case(case: PodCase, *, layers_per_stage: int | None = None, library_path=None) -> dict:
    """Compiles the case's steps (:func:`programs_for`) for its TPU slice; returns the
    figures of each beside the planner's prediction."""
    from jaxpar.engine import AbstractEngine
    from jaxpar.inspect import kernel_calls, phase_report, tpu_devices
    from jaxpar.plan import load_hardware, predict
    from jaxpar.spec import ParallelConfig, make_mesh
    from tests._movement import moved_fraction

    full = model_config(case)
    strategy = strategy_for(case, full)
    config = model_config(dataclasses.replace(case, strategy=strategy), layers_per_stage)
    parallel = ParallelConfig.parse(strategy)
    devices = tpu_devices(case.topology, library_path=library_path)
    start = time.perf_counter()
    mesh = make_mesh(parallel, devices=devices)
    engine = AbstractEngine.build(
        config,
        parallel,
        max_batch=case.batch,
        max_seq_len=case.prompt_len + case.gen_len,
        mesh=mesh,
    )
    hardware = load_hardware(case.hardware)
    pred = predict(config, parallel, workload(case), hardware)
    row: dict[str, Any] = {
        "case": case.name,
        "model": case.model,
        "topology": case.topology,
        "strategy": strategy,
        "layers": config.n_layers,
        "full_layers": full.n_layers,
        "limit_bytes": hardware.hbm_bytes,
        "build_s": round(time.perf_counter() - start, 1),
        "phases": {},
    }
    for phase in programs_for(parallel):
        t0 = time.perf_counter()
        report, compiled = phase_report(engine, phase, prompt_len=case.prompt_len)
        seconds = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        compiled_bytes = (
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes
        )
        rep = report.to_dict()
        row["phases"][phase] = {
            "compile_s": round(seconds, 1),
            "argument_bytes": mem.argument_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes,
            "temp_bytes": mem.temp_size_in_bytes,
            "alias_bytes": mem.alias_size_in_bytes,
            "compiled_bytes": compiled_bytes,
            "predicted_bytes": predicted_bytes(pred, phase),
            "collective_bytes": rep["compiled_bytes"],
            "minimum_bytes": rep["minimum_bytes"],
            "ratio": rep["ratio"],
            "ratio_explained": report.ratio_explained,
            "exceptions": report.exceptions,
            "kernel_calls": kernel_calls(compiled),
            "splash_expected": _splash_expected(engine, phase),
            "moved_fraction": moved_fraction(
                compiled, engine, case.batch, case.prompt_len + case.gen_len
            ),
        }
        print(
            f"  {case.name} {phase}: {seconds:.1f} s, "
            f"{compiled_bytes / 2**30:.2f} GiB (predicted {predicted_bytes(pred, phase) / 2**30:.2f})",
            file=sys.stderr,
        )
    return row


def predicted_bytes(pred: Any, phase: str) -> int:
    """The planner's bytes per device for one compiled step of ``phase`` (the served
    decode step's pool holds the same batch x max_seq_len tokens as the offline cache)."""
    return pred.memory.prefill_step if phase == "prefill" else pred.memory.decode_step


def _splash_expected(engine: Any, phase: str) -> int:
    """Splash calls the step must hold where the options chose the kernel for prefill."""
    if (
        phase not in ("prefill", "serve_prefill")
        or engine.options.prefill_attention != "pallas_tpu"
    ):
        return 0
    from bench import splash_expected

    return splash_expected(engine)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | slice | strategy | phase | compile s | GiB/device compiled | predicted | "
        "collectives / minimum | moved |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for phase, p in row["phases"].items():
            ratio = p["ratio"] if isinstance(p["ratio"], str) else f"{p['ratio']:.2f}x"
            lines.append(
                f"| {row['model']} ({row['layers']} layers) | {row['topology']} | "
                f"{row['strategy']} | {phase} | {p['compile_s']} | {_gib(p['compiled_bytes'])} | "
                f"{_gib(p['predicted_bytes'])} | {ratio} | {p['moved_fraction']:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", help="case names (default: all)")
    parser.add_argument("--layers", type=int, help="layers per pipeline stage (default: all)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_platforms", "cpu")
    from bench import libtpu

    path, _ = libtpu()
    cases = [c for c in CASES if not args.case or c.name in args.case]
    rows = []
    for case in cases:
        rows.append(run_case(case, layers_per_stage=args.layers, library_path=path))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
