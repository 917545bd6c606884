"""``jaxpar plan`` against the compiled programs it predicts, on 8 simulated CPU devices.

For the top 3 plans of each preset under two workloads, the planner's collective bytes per
step must equal what ``jaxpar.inspect`` reads from the compiled prefill and decode programs
(within 1%), and its parameter + KV cache + input bytes per device what
``memory_analysis()`` reports as the steps' arguments (within 2%). Every program is
compiled once (module-level cache). The ranking over every strategy of the bench matrix
is checked where those programs are compiled anyway (``tests/test_bench_collectives.py``).

MoE assumptions: the predicted MoE collectives come from
``jaxpar.inspect.communication_model`` (the routed-token minimum); the planner adds the
pipeline's bubbles and the padded exchange's blocks beyond the routed rows
(``moe-dispatch-buffer``: ``P x C`` rows per all-to-all, and the row counts).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxpar.engine import AbstractEngine
from jaxpar.errors import InfeasiblePlanError
from jaxpar.inspect import parse_collectives
from jaxpar.models import preset
from jaxpar.plan import Workload, legal_strategies, load_hardware, plan, predict
from jaxpar.spec import ParallelConfig, make_mesh, validate
from tests._tiers import sweep

MODELS = ("tiny-dense", "tiny-gqa", "tiny-moe")
WORKLOADS = {
    "b8": Workload(batch=8, prompt_len=16, gen_len=16),
    "b2": Workload(batch=2, prompt_len=32, gen_len=32),
}
HW = load_hardware("cpu")
# LLVM's optimisations change neither the collectives (inserted by the SPMD partitioner)
# nor the buffer sizes; skipping them halves the compile time.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.cache
def planning(name: str, workload: str):
    return plan(preset(name), HW, 8, WORKLOADS[workload])


@functools.cache
def compiled(name: str, config: ParallelConfig, workload: str) -> dict[str, tuple[int, int]]:
    """Per phase: (collective bytes per step, argument bytes per device) of the compiled step
    (on the first ``config.size`` devices: a disaggregated plan's groups compile alone)."""
    w = WORKLOADS[workload]
    mesh = make_mesh(config, jax.devices()[: config.size])
    eng = AbstractEngine.build(
        preset(name), config, max_batch=w.batch, max_seq_len=w.max_seq_len, mesh=mesh
    )
    out = {}
    for phase in ("prefill", "decode"):
        program = eng.lower(phase, prompt_len=w.prompt_len).compile(FAST_COMPILE)
        moved = sum(c.bytes * (c.trip_count or 1) for c in parse_collectives(program))
        out[phase] = (moved, program.memory_analysis().argument_size_in_bytes)
    return out


# The top 3 of each; the MoE's 4th under b2 (a pipelined plan) as well, for the JAX releases.
TOP = [(m, w, i) for m in MODELS for w in WORKLOADS for i in range(3)] + [("tiny-moe", "b2", 3)]
# Version-sensitive (scripts/test.sh runs them on both JAX releases): MoE with dp and pp.
COMPAT = {("tiny-moe", "b2", 0), ("tiny-moe", "b2", 3)}
TOP = [pytest.param(*t, marks=pytest.mark.jax_compat) if t in COMPAT else t for t in TOP]


# The fast tier compiles the dense model's best plan for the larger batch (the MoE's and
# the GQA model's are the full tier's; tests/test_plan_cli.py plans MoEs in the fast tier).
FAST_TOP = {("tiny-dense", "b8", 0)}


@pytest.mark.parametrize(
    ("name", "workload", "rank"), sweep(TOP, FAST_TOP.__contains__), ids=lambda x: str(x)
)
def test_top_plans_match_the_compiled_programs(name, workload, rank):
    pred = planning(name, workload).ranked[rank]
    # A disaggregated plan's prefill runs its own strategy on its own group.
    prefill = compiled(name, pred.prefill_config or pred.config, workload)["prefill"]
    decode = compiled(name, pred.config, workload)["decode"]
    for cost, got in ((pred.prefill, prefill[0]), (pred.decode, decode[0])):
        assert cost.comm_bytes == pytest.approx(got, rel=0.01, abs=0), (
            pred.label,
            cost.phase,
            [(c.item.step, c.bytes) for c in cost.comm],
        )
    # Arguments: the parameters and token ids in prefill; and the whole KV cache in decode.
    pre, mem = pred.prefill_memory or pred.memory, pred.memory
    assert pre.params + pre.prefill_inputs == pytest.approx(prefill[1], rel=0.02)
    assert mem.params + mem.kv_cache + mem.decode_inputs == pytest.approx(decode[1], rel=0.02)


def test_no_refused_strategy_is_proposed_and_none_is_lost():
    for name in MODELS:
        for workload, w in WORKLOADS.items():
            p = planning(name, workload)
            for pred in p.ranked:
                groups = [pred.config, *([pred.prefill_config] if pred.disaggregated else [])]
                assert sum(g.size for g in groups) == 8
                for group in groups:
                    validate(
                        preset(name),
                        group,
                        n_devices=group.size,
                        batch=pred.workload.batch,
                        max_seq_len=w.max_seq_len,
                    )
            colocated = [x for x in (*p.ranked, *p.unfit) if not x.disaggregated]
            proposed = {str(x.config) for x in colocated}
            refused = {str(r.config) for r in p.refused}
            assert proposed and not proposed & refused
            # Every candidate is either proposed or refused with a reason.
            legal, bad = legal_strategies(preset(name), 8, w)
            assert len(proposed) + len(refused) == len(legal) + len(bad)


def test_infeasible_request_names_the_smallest_device_count():
    model = preset("tiny-dense")
    w = WORKLOADS["b8"]
    # A budget between the 1-device and the 8-device footprint: fits on some device count.
    one = predict(model, ParallelConfig(), w, HW).memory.total
    with pytest.raises(InfeasiblePlanError) as err:
        plan(model, HW, 1, w, hbm_budget_gib=one * 0.6 / 2**30)
    need = err.value.min_devices
    assert need is not None and need > 1 and f"fits is {need}" in str(err.value)
    # It does fit there, and on no smaller count.
    plan(model, HW, need, w, hbm_budget_gib=one * 0.6 / 2**30)
    for smaller in range(2, need):
        with pytest.raises(InfeasiblePlanError):
            plan(model, HW, smaller, w, hbm_budget_gib=one * 0.6 / 2**30)


def test_infeasible_everywhere_says_so():
    with pytest.raises(InfeasiblePlanError, match="fits on no device count") as err:
        plan(preset("tiny-dense"), HW, 8, WORKLOADS["b8"], hbm_budget_gib=1e-6)
    assert err.value.min_devices is None


def test_disaggregated_groups_overlap_in_throughput():
    """tiny-moe, 2 sequences: 4 | 4 device splits exist; their throughput counts the busier
    group only (prefill of one batch runs while another decodes), their latency both."""
    w = WORKLOADS["b2"]
    p = plan(preset("tiny-moe"), HW, 8, w)
    split = [x for x in p.ranked if x.disaggregated]
    assert split
    for x in split:
        assert x.prefill_config.pp == x.config.pp == 1
        assert x.transfer_bytes == 2 * 4 * 2 * 32 * 8 * 8 * 4 + 2 * 2 * 4  # 2LBTKH f32 + rows
        busier = max(x.prefill.seconds + x.transfer_s, w.gen_len * x.decode.seconds)
        assert x.tokens_per_s == pytest.approx(w.batch * w.gen_len / busier)
        assert x.request_s > busier


# Three plans of the MoE: the full tier's (the fast tier's throughput and latency plans:
# tests/test_plan_serving.py).
@pytest.mark.sweep
def test_objectives_differ_where_they_should():
    model, w = preset("tiny-moe"), WORKLOADS["b2"]
    lat = plan(model, HW, 8, w, objective="latency")
    thr = plan(model, HW, 8, w, objective="throughput")
    cost = plan(model, HW, 8, w, objective="cost")
    assert thr.best.workload.batch >= w.batch and thr.best.tokens_per_s >= lat.best.tokens_per_s
    assert cost.best.device_s_per_token <= lat.best.device_s_per_token
    assert np.all(np.diff([p.request_s for p in lat.ranked]) >= 0)
