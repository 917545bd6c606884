"""``plan``: every legal strategy predicted, filtered by memory, ranked by an objective.

Objectives (each plan serves the workload's batch of requests; a request's time is its
prefill step plus ``gen_len`` decode steps):

* ``latency``: the shortest request time on all the devices given.
* ``throughput``: the most generated tokens per second on all the devices given; each
  strategy may grow the batch (x2, x4, ... up to x64) while it stays legal and fits in HBM,
  as a server fills its decode slots.
* ``cost``: the fewest device-seconds per generated token, on any device count that
  divides the devices given (the rest stay free for other work).
"""

from __future__ import annotations

import dataclasses

from jaxpar.errors import ConfigError, InfeasiblePlanError
from jaxpar.models import ModelConfig
from jaxpar.plan._disaggregated import MAX_BATCH_GROWTH, disaggregated_plans
from jaxpar.plan._enumerate import Refused, Workload, check, legal_strategies
from jaxpar.plan._hardware import Hardware
from jaxpar.plan._memory import memory
from jaxpar.plan._prediction import Prediction, predict
from jaxpar.spec import ParallelConfig

OBJECTIVES = ("latency", "throughput", "cost")
SEARCH_LIMIT = 1 << 16


@dataclasses.dataclass(frozen=True)
class Planning:
    """The ranked plans (best first), what did not fit, what the validator refused."""

    objective: str
    workload: Workload
    hardware: Hardware
    devices: int
    ranked: tuple[Prediction, ...]
    unfit: tuple[Prediction, ...]
    refused: tuple[Refused, ...]
    notes: tuple[str, ...]

    @property
    def best(self) -> Prediction:
        return self.ranked[0]


def _grown(model, config, workload, hardware, budget) -> Prediction | None:
    """The largest batch (workload's x 2^k) that is legal and fits, predicted."""
    best = None
    factor = 1
    while factor <= MAX_BATCH_GROWTH:
        grown = workload.scaled(factor)
        if factor > 1 and check(model, config, grown) is not None:
            break
        pred = predict(model, config, grown, hardware, budget=budget)
        if not pred.fits:
            break
        best = pred
        factor *= 2
    return best


def _device_counts(devices: int, objective: str) -> list[int]:
    if objective != "cost":
        return [devices]
    return [d for d in range(1, devices + 1) if devices % d == 0]


def plan(
    model: ModelConfig,
    hardware: Hardware,
    devices: int,
    workload: Workload,
    *,
    objective: str = "latency",
    hbm_budget_gib: float | None = None,
) -> Planning:
    """Ranks every legal strategy for ``model`` on ``devices`` of ``hardware``.

    Raises:
        ConfigError: an unknown objective or a bad workload.
        InfeasiblePlanError: no legal strategy fits; the message names the smallest device
            count on which one would.
    """
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective {objective!r}; choose from {', '.join(OBJECTIVES)}")
    model.check_max_seq_len(workload.max_seq_len)
    budget = hardware.hbm_bytes if hbm_budget_gib is None else int(hbm_budget_gib * 2**30)
    fitting, unfit, refused = [], [], []
    for count in _device_counts(devices, objective):
        legal, bad = legal_strategies(model, count, workload)
        refused += bad
        for config in legal:
            pred = predict(model, config, workload, hardware, budget=budget)
            if not pred.fits:
                unfit.append(pred)
                continue
            if objective == "throughput":
                pred = _grown(model, config, workload, hardware, budget) or pred
            fitting.append(pred)
    if not fitting:
        raise _infeasible(model, hardware, devices, workload, budget, unfit, refused)
    for count in _device_counts(devices, objective):
        grow = objective == "throughput"
        fitting += disaggregated_plans(model, hardware, count, workload, budget, grow=grow)
    ranked = sorted(fitting, key=lambda p: (p.score(objective), p.comm_bytes, p.label))
    return Planning(
        objective, workload, hardware, devices, tuple(ranked), tuple(unfit), tuple(refused), NOTES
    )


NOTES = (
    "Colocated plans run both phases on one mesh: each axis takes its per-phase role from the "
    "tables (sp splits prompt tokens in prefill and carries batch in decode; ep carries batch "
    "outside MoE layers) and the prefill microbatches and decode groups are chosen per phase. "
    "Disaggregated plans ('prefill X | decode Y') put decode on the first devices and prefill "
    "on the rest, each with the fastest legal unpipelined strategy that fits its group, and "
    "move each batch's K/V once (ContinuousBatcher(prefill_engine=...), explain --prefill).",
)


def _infeasible(model, hardware, devices, workload, budget, unfit, refused) -> InfeasiblePlanError:
    what = f"{workload.batch} x ({workload.prompt_len} + {workload.gen_len}) tokens"
    gib = budget / 2**30
    if unfit:
        least = min(unfit, key=lambda p: p.memory.total)
        detail = (
            f"the smallest per-device footprint is {least.memory.total / 2**30:.2f} GiB "
            f"({least.config}: parameters {least.memory.params / 2**30:.2f} GiB, KV cache "
            f"{least.memory.kv_cache / 2**30:.2f} GiB) against {gib:.2f} GiB of HBM"
        )
    else:
        rules = sorted({r.rule for r in refused})
        detail = f"no strategy on {devices} devices is legal (rules: {', '.join(rules)})"
    need = min_devices(model, hardware, devices, workload, budget)
    where = (
        f"the smallest device count on which it fits is {need}"
        if need
        else "it fits on no device count (searched up to the most devices a strategy can use)"
    )
    return InfeasiblePlanError(
        f"{model.arch} model ({what}) fits nowhere on {devices} {hardware.name} "
        f"device{'s' if devices > 1 else ''}: "
        f"{detail}; {where}",
        need,
    )


def min_devices(
    model: ModelConfig, hardware: Hardware, devices: int, workload: Workload, budget: int
) -> int | None:
    """The smallest device count above ``devices`` with a legal strategy that fits.

    Counts are searched up to the most devices any strategy can use (batch x layers x heads
    x experts) and skipped while even a perfect split of the parameters and the KV cache
    over them would not fit.
    """
    single = memory(
        model,
        ParallelConfig(),
        batch=workload.batch,
        prompt_len=workload.prompt_len,
        max_seq_len=workload.max_seq_len,
    )
    stored = single.params + single.kv_cache
    most = workload.batch * model.n_layers * model.n_heads * max(1, model.n_experts)
    limit = min(SEARCH_LIMIT, most)
    counts = sorted({*range(devices + 1, 4 * devices + 1), *(2**k for k in range(17))})
    for count in counts:
        if count <= devices or count > limit or stored / count > budget:
            continue
        legal, _ = legal_strategies(model, count, workload)
        for config in legal:
            need = memory(
                model,
                config,
                batch=workload.batch,
                prompt_len=workload.prompt_len,
                max_seq_len=workload.max_seq_len,
            )
            if need.total <= budget:
                return count
    return None
