"""Compiled collective bytes of every strategy in the bench matrix against the minimum.

Bytes are deterministic, so the traffic above the analytic minimum is asserted exactly:
each (preset, strategy, phase) must match ``scripts/bench.py``'s ``DOCUMENTED`` causes and
byte counts (empty: within 5% of the minimum). A new collective, a bigger one, or a fix
that removes a documented one, fails here until the table is updated
(``python scripts/bench.py --sections collectives --print-documented`` prints it measured).
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import sys
from pathlib import Path

import pytest
from scipy.stats import spearmanr

from jaxpar.inspect import CAUSES, TOLERANCE, classify, parse_collectives
from jaxpar.models import preset as preset_config
from jaxpar.plan import Workload, load_hardware, predict
from jaxpar.spec import ParallelConfig
from tests._tiers import sweep

_spec = importlib.util.spec_from_file_location(
    "jaxpar_bench", Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)

CASES = [(p, s, phase) for p, s in bench.MATRIX for phase in ("prefill", "decode")]


@functools.cache
def case(preset: str, strategy: str):
    """Engine and reports of a matrix entry, built once per test session."""
    return bench.build_case(preset, strategy, _PARAMS)


_PARAMS: dict = {}


def test_matrix_covers_every_primitive_on_dense_and_moe():
    kinds = {(p.split("-")[1], bench.strategy_kind(s)) for p, s in bench.MATRIX}
    for needed in ("TP", "SP+TP", "DP", "PP+TP"):
        assert ("dense", needed) in kinds, needed
    for needed in ("EP", "EP+TP", "DP", "TP", "PP+EP"):
        assert ("moe", needed) in kinds, needed


def test_documented_exceptions_name_known_causes_of_matrix_entries():
    for (preset, strategy, phase), causes in bench.DOCUMENTED.items():
        assert (preset, strategy) in bench.MATRIX and phase in ("prefill", "decode")
        assert set(causes) <= set(CAUSES) - {"unclassified"}, causes


# The fast tier's points: dp, sp and tp together; experts split beside dp and tp; a pipeline.
FAST = {
    ("tiny-dense", "dp=2,sp=2,tp=2"),
    ("tiny-moe", "dp=2,ep=2,tp=2"),
    ("tiny-dense", "pp=2,dp=2,tp=2,microbatches=2,decode_groups=2"),
}


@pytest.mark.parametrize(
    ("preset", "strategy", "phase"),
    sweep(CASES, lambda case: case[:2] in FAST),
    ids=lambda x: str(x),
)
def test_compiled_bytes_meet_the_minimum_or_the_documented_exceptions(preset, strategy, phase):
    c = case(preset, strategy)
    report = c.reports[phase]
    assert report.trip_counts_known
    assert report.exceptions == bench.DOCUMENTED.get((preset, strategy, phase), {})
    if not report.exceptions:
        assert report.ratio is None or report.ratio <= TOLERANCE, report.to_dict()
    # Read again from the compiled program, apart from the report's grouping: no collective
    # is left out of the report.
    collectives = parse_collectives(c.compiled[phase])
    assert sum(x.bytes * x.trip_count for x in collectives) == report.compiled_bytes
    # A named cause is backed by collectives that really are of that cause ...
    cache_dims = (bench.MAX_SEQ_LEN, bench.model_of(preset, preset_config).head_dim)
    classified = collections.Counter()
    for x in collectives:
        classified[classify(x, phase, cache_dims=cache_dims)] += x.bytes * x.trip_count
    for cause, excess in report.exceptions.items():
        if cause != "pp-bubble":
            assert classified[cause] >= excess, (cause, excess, classified)
    # ... and a pipeline bubble costs exactly (M + pp - 1) / M times the minimum.
    parallel = ParallelConfig.parse(strategy)
    runs = parallel.microbatches if phase == "prefill" else parallel.decode_groups
    for row in report.rows:
        if row.minimum_bytes:  # the model never asks for more than XLA needed
            assert row.compiled_bytes >= row.minimum_bytes / TOLERANCE, row
        if "pp-bubble" in row.causes:
            assert row.compiled_bytes * runs == row.minimum_bytes * (runs + parallel.pp - 1), row


# Compiles the whole matrix (a minute on CPU): the full tier's. The fast tier checks the
# planner against compiled programs in tests/test_plan.py (its top plans).
@pytest.mark.sweep
def test_planner_ranks_the_matrix_as_its_compiled_programs():
    """``jaxpar plan``'s predicted communication per request (prefill + every decode step
    of the bench's cache) ranks the matrix's strategies as their compiled bytes do."""
    workload = Workload(
        batch=bench.BATCH, prompt_len=bench.PROMPT_LEN, gen_len=bench.MAX_SEQ_LEN - bench.PROMPT_LEN
    )
    hardware = load_hardware("cpu")
    predicted, compiled = [], []
    for preset, strategy in bench.MATRIX:
        parallel = ParallelConfig.parse(strategy)
        pred = predict(bench.model_of(preset, preset_config), parallel, workload, hardware)
        reports = case(preset, strategy).reports
        predicted.append(pred.prefill.comm_bytes + workload.gen_len * pred.decode.comm_bytes)
        compiled.append(
            reports["prefill"].compiled_bytes + workload.gen_len * reports["decode"].compiled_bytes
        )
    rho = spearmanr(predicted, compiled).statistic
    assert len(set(compiled)) > len(compiled) // 2  # a ranking with something to rank
    assert rho >= 0.95, list(zip(bench.MATRIX, predicted, compiled, strict=True))
