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

import numpy as np

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
    """One plan's predicted cost for a workload.

    Colocated: both phases run ``config`` on the same devices. Disaggregated
    (``prefill_config`` set): decode runs ``config`` on the first devices, prefill runs
    ``prefill_config`` on the devices after them, and each prefilled batch's K/V moves once
    (``transfer_bytes`` in ``transfer_s``); the two groups work at the same time.
    """

    config: ParallelConfig
    workload: Workload
    prefill: PhaseCost
    decode: PhaseCost
    memory: Memory  # per device (disaggregated: of the decode group)
    budget: int  # HBM bytes per device it must fit in
    prefill_config: ParallelConfig | None = None
    prefill_memory: Memory | None = None
    transfer_bytes: int = 0
    transfer_s: float = 0.0

    @property
    def disaggregated(self) -> bool:
        return self.prefill_config is not None

    @property
    def label(self) -> str:
        if self.prefill_config is None:
            return str(self.config)
        return f"prefill {self.prefill_config} | decode {self.config}"

    @property
    def devices(self) -> int:
        return self.config.size + (self.prefill_config.size if self.prefill_config else 0)

    @property
    def fits(self) -> bool:
        if self.prefill_memory is None:
            return self.memory.total <= self.budget
        return max(self.memory.decode_total, self.prefill_memory.prefill_total) <= self.budget

    @property
    def request_s(self) -> float:
        """Prefill (+ the K/V transfer) plus ``gen_len`` decode steps."""
        return self.prefill.seconds + self.transfer_s + self.workload.gen_len * self.decode.seconds

    @property
    def tokens_per_s(self) -> float:
        """Steady state: disaggregated groups overlap one batch's prefill with another's decode."""
        w = self.workload
        if not self.disaggregated:
            return w.batch * w.gen_len / self.request_s
        busiest = max(self.prefill.seconds + self.transfer_s, w.gen_len * self.decode.seconds)
        return w.batch * w.gen_len / busiest

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
            "strategy": self.label,
            "disaggregated": self.disaggregated,
            "prefill_strategy": str(self.prefill_config or self.config),
            "transfer_bytes": self.transfer_bytes,
            "transfer_s": self.transfer_s,
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


def kv_transfer_bytes(model: ModelConfig, workload: Workload) -> int:
    """What one prefilled batch sends to the decode group: K and V of every layer
    ``[B, T, K, H]``, and each row's prompt length and first token (int32)."""
    b, t = workload.batch, workload.prompt_len
    kv = 2 * model.n_layers * b * t * model.n_kv_heads * model.head_dim
    return kv * np.dtype(model.dtype).itemsize + 2 * b * 4


def _best_group(model, hardware, count, workload, budget, phase) -> Prediction | None:
    """The unpipelined legal strategy on ``count`` devices with the fastest ``phase`` step
    that fits what that group holds (prefill: weights and prompt K/V; decode: weights and
    the KV cache)."""
    best = None
    for config in legal_strategies(model, count, workload)[0]:
        if config.pp > 1:  # disaggregated groups run unpipelined strategies
            continue
        pred = predict(model, config, workload, hardware, budget=budget)
        mem = pred.memory.prefill_total if phase is Phase.PREFILL else pred.memory.decode_total
        cost = pred.prefill if phase is Phase.PREFILL else pred.decode
        if mem <= budget and (best is None or cost.seconds < best[0]):
            best = (cost.seconds, pred)
    return best and best[1]


def disaggregated_plans(
    model: ModelConfig,
    hardware: Hardware,
    devices: int,
    workload: Workload,
    budget: int,
    *,
    grow: bool = False,
) -> list[Prediction]:
    """For each split of ``devices`` into a decode group (first) and a prefill group (after
    it), the best strategy of each group and the K/V transfer between them; with ``grow``
    (throughput), at the largest batch (x 2^k, up to x64) both groups still fit.

    The transfer runs over the fast link when both groups sit in one fast-link domain, else
    over the slow one, spread over the smaller group's devices.
    """
    out = []
    for decode_devices in range(1, devices):
        best = None
        factor = 1
        while factor <= (MAX_BATCH_GROWTH if grow else 1):
            pair = _pair(model, hardware, decode_devices, devices, workload.scaled(factor), budget)
            if pair is None:
                break
            best, factor = pair, factor * 2
        if best is not None:
            out.append(best)
    return out


def _pair(model, hardware, decode_devices, devices, workload, budget) -> Prediction | None:
    prefill_devices = devices - decode_devices
    dec = _best_group(model, hardware, decode_devices, workload, budget, Phase.DECODE)
    pre = _best_group(model, hardware, prefill_devices, workload, budget, Phase.PREFILL)
    if dec is None or pre is None:
        return None
    link = hardware.fast_link if devices <= hardware.domain(devices) else hardware.slow_link
    size = kv_transfer_bytes(model, workload)
    seconds = size / (min(decode_devices, prefill_devices) * link.bytes_per_s)
    return dataclasses.replace(
        dec,
        prefill=pre.prefill,
        prefill_config=pre.config,
        prefill_memory=pre.memory,
        transfer_bytes=size,
        transfer_s=seconds + link.latency_s,
    )
