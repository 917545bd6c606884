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
from typing import Any

from jaxpar.errors import ConfigError, InfeasiblePlanError
from jaxpar.models import ModelConfig
from jaxpar.plan._cost import PhaseCost, phase_cost
from jaxpar.plan._enumerate import Refused, Workload, check, legal_strategies
from jaxpar.plan._hardware import Hardware
from jaxpar.plan._memory import Memory, memory
from jaxpar.spec import MESH_AXES, ParallelConfig, Phase

OBJECTIVES = ("latency", "throughput", "cost")
MAX_BATCH_GROWTH = 64
SEARCH_LIMIT = 1 << 16


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One strategy's predicted cost for a workload."""

    config: ParallelConfig
    workload: Workload
    prefill: PhaseCost
    decode: PhaseCost
    memory: Memory
    budget: int  # HBM bytes per device it must fit in

    @property
    def devices(self) -> int:
        return self.config.size

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.budget

    @property
    def request_s(self) -> float:
        """Prefill plus ``gen_len`` decode steps."""
        return self.prefill.seconds + self.workload.gen_len * self.decode.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.workload.batch * self.workload.gen_len / self.request_s

    @property
    def device_s_per_token(self) -> float:
        return self.devices / self.tokens_per_s

    @property
    def comm_bytes(self) -> int:
        """Collective bytes per device for one request batch (prefill + every decode step)."""
        return self.prefill.comm_bytes + self.workload.gen_len * self.decode.comm_bytes

    def score(self, objective: str) -> float:
        """Lower is better."""
        if objective == "latency":
            return self.request_s
        if objective == "throughput":
            return -self.tokens_per_s
        return self.device_s_per_token

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": str(self.config),
            "degrees": {a: self.config.degree(a) for a in MESH_AXES},
            "microbatches": self.config.microbatches,
            "decode_groups": self.config.decode_groups,
            "devices": self.devices,
            "batch": self.workload.batch,
            "request_s": self.request_s,
            "tokens_per_s": self.tokens_per_s,
            "device_s_per_token": self.device_s_per_token,
            "comm_bytes_per_request": self.comm_bytes,
            "fits": self.fits,
            "memory": self.memory.to_dict(),
            "prefill": self.prefill.to_dict(),
            "decode": self.decode.to_dict(),
        }


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


def predict(
    model: ModelConfig,
    config: ParallelConfig,
    workload: Workload,
    hardware: Hardware,
    *,
    budget: int | None = None,
) -> Prediction:
    """Predicted cost and memory of one (legal) strategy."""
    mem = memory(
        model,
        config,
        batch=workload.batch,
        prompt_len=workload.prompt_len,
        max_seq_len=workload.max_seq_len,
    )
    kw = dict(
        batch=workload.batch,
        prompt_len=workload.prompt_len,
        max_seq_len=workload.max_seq_len,
        params_bytes=mem.params,
        cache_bytes=mem.kv_cache,
    )
    return Prediction(
        config,
        workload,
        phase_cost(model, config, Phase.PREFILL, hardware, **kw),
        phase_cost(model, config, Phase.DECODE, hardware, **kw),
        mem,
        hardware.hbm_bytes if budget is None else budget,
    )


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
    ranked = sorted(fitting, key=lambda p: (p.score(objective), p.comm_bytes, str(p.config)))
    return Planning(
        objective, workload, hardware, devices, tuple(ranked), tuple(unfit), tuple(refused), NOTES
    )


NOTES = (
    "One mesh serves both phases: each strategy's axes take their per-phase roles from the "
    "tables (sp splits prompt tokens in prefill and carries batch in decode; ep carries batch "
    "outside MoE layers), and the prefill microbatches and decode groups are chosen per phase. "
    "Pairs with different degrees per phase would need the weights laid out twice or "
    "disaggregated prefill/decode device groups, which the engine does not run yet; they are "
    "not proposed.",
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
