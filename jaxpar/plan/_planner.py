"""``plan``: every legal strategy predicted, filtered by memory, ranked by an objective.

Objectives (each plan serves the workload's batch of requests; a request's time is its
prefill step plus ``gen_len`` decode steps):

* ``latency``: the shortest request time on all the devices given.
* ``throughput``: the most generated tokens per second on all the devices given; each
  strategy may grow the batch (x2, x4, ... up to x64) while it stays legal and fits in HBM,
  as a server fills its decode slots.
* ``cost``: the fewest device-seconds per generated token, on any device count that
  divides the devices given (the rest stay free for other work).

Serving (``throughput``, or latency bounds given): the batch is the server's decode slots and
prompts are prefilled a few at a time between decode steps (:mod:`jaxpar.plan._serving`),
not all at once; plans whose time to first token or per output token exceed the bounds are
not chosen, and pipelined strategies are planned with ``pp`` decode groups and prefill
microbatches (the served pipeline's; its decode has no bubble in steady state). Across hosts (``--hosts``, or
TPU slices) the hardware file's ``slow_link`` is the link between them: where it is slow,
``pp`` across hosts with ``tp`` inside wins over ``tp`` or ``dp`` spanning it.
"""

from __future__ import annotations

import dataclasses

from jaxpar.errors import ConfigError, InfeasiblePlanError
from jaxpar.models import ModelConfig
from jaxpar.plan._disaggregated import MAX_BATCH_GROWTH, disaggregated_plans
from jaxpar.plan._enumerate import Refused, Workload, check, legal_strategies
from jaxpar.plan._hardware import Hardware
from jaxpar.plan._memory import memory
from jaxpar.plan._placement import Placement, placement, with_layout
from jaxpar.plan._prediction import Prediction, predict
from jaxpar.plan._serving import NO_BOUNDS, Bounds, check_serving, served
from jaxpar.spec import ParallelConfig, batch_multiple

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
    bounds: Bounds = NO_BOUNDS
    missed: tuple[Prediction, ...] = ()  # serving: fit, but miss the bounds at every batch

    @property
    def serving(self) -> bool:
        return self.best.workload.serving

    @property
    def best(self) -> Prediction:
        return self.ranked[0]


def _grown_serving(model, config, workload, hardware, budget, bounds, grow):
    """Serving: (the largest batch, workload's x 2^k, that is legal, fits and meets
    ``bounds``, the fastest-to-first-token prediction at the workload's batch). A larger
    batch only lengthens both the decode step and the prefill interleaved with it."""
    best, fastest, factor = None, None, 1
    while factor <= (MAX_BATCH_GROWTH if grow else 1):
        grown = workload.scaled(factor)
        if factor > 1 and check(model, config, grown) is not None:
            break
        pred, quick = served(model, config, grown, hardware, budget, bounds)
        fastest = fastest or quick
        if pred is None:
            break
        best, factor = pred, factor * 2
    return best, fastest


def _colocated(model, config, workload, hardware, budget, bounds, serving, grow):
    """(the plan of ``config`` or None, serving: its fastest prediction missing the bounds,
    its prediction at the workload's batch, for memory)."""
    smallest = batch_multiple(model, config) if serving else None
    first = dataclasses.replace(workload, prefill_batch=smallest)
    pred = predict(model, config, first, hardware, budget=budget)
    if not pred.fits:
        return None, None, pred
    if not serving:  # throughput always plans serving
        return pred, None, pred
    best, fastest = _grown_serving(model, config, workload, hardware, budget, bounds, grow)
    return best, fastest, pred


def _legal(model, count, workload, serving, where=None):
    """(legal, refused) strategies; serving refuses pipelines with other than ``pp``
    decode groups and microbatches;
    on TPU, those ``make_mesh`` cannot lay out on the chips (``where``) are refused."""
    legal, refused = legal_strategies(model, count, workload, where)
    if not serving:
        return legal, refused
    whys = [(c, check_serving(model, c, workload)) for c in legal]
    return [c for c, why in whys if why is None], refused + [w for _, w in whys if w]


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
    bounds: Bounds | None = None,
) -> Planning:
    """Ranks every legal strategy for ``model`` on ``devices`` of ``hardware``.

    Raises:
        ConfigError: an unknown objective or a bad workload.
        InfeasiblePlanError: no legal strategy fits (the message names the smallest device
            count on which one would, and the largest batch that fits these devices), or
            none meets ``bounds`` (the message names the best figures predicted).
    """
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective {objective!r}; choose from {', '.join(OBJECTIVES)}")
    bounds = bounds or NO_BOUNDS
    serving = objective == "throughput" or bounds.given
    grow = objective == "throughput"
    model.check_max_seq_len(workload.max_seq_len)
    budget = hardware.hbm_bytes if hbm_budget_gib is None else int(hbm_budget_gib * 2**30)
    fitting, unfit, refused, missed = [], [], [], []
    for count in _device_counts(devices, objective):
        legal, bad = _legal(model, count, workload, serving, placement(hardware, devices))
        refused += bad
        for config in legal:
            best, fastest, pred = _colocated(
                model, config, workload, hardware, budget, bounds, serving, grow
            )
            if not pred.fits:
                unfit.append(pred)
            elif best is not None:
                fitting.append(best)
            elif fastest is not None:
                missed.append(fastest)
    if not fitting and not missed:
        raise _infeasible(model, hardware, devices, workload, budget, unfit, refused, serving)
    counts = _device_counts(devices, objective)
    for count in counts:
        fitting += disaggregated_plans(
            model,
            hardware,
            count,
            workload,
            budget,
            grow=grow,
            serving=serving,
            bounds=bounds,
            cluster=devices,
        )
    if not fitting:
        raise _unbounded(model, hardware, counts, workload, budget, bounds, missed)
    ranked = sorted(fitting, key=lambda p: (p.score(objective), p.comm_bytes, p.label))
    ranked = [with_layout(p, hardware, devices) for p in ranked]
    notes = NOTES + (SERVING_NOTE,) if serving else NOTES
    return Planning(
        objective,
        workload,
        hardware,
        devices,
        tuple(ranked),
        tuple(unfit),
        tuple(refused),
        notes,
        bounds,
        tuple(missed),
    )


NOTES = (
    "Colocated plans run both phases on one mesh: each axis takes its per-phase role from the "
    "tables (sp splits prompt tokens in prefill and carries batch in decode; ep carries batch "
    "outside MoE layers) and the prefill microbatches and decode groups are chosen per phase. "
    "Disaggregated plans ('prefill X | decode Y') put decode on the first devices and prefill "
    "on the rest, each with the fastest legal unpipelined strategy that fits its group, and "
    "move each batch's K/V once (ContinuousBatcher(prefill_engine=...), explain --prefill).",
)


SERVING_NOTE = (
    "Serving model: the batch is the server's decode slots; prompts are prefilled "
    "prefill-batch at a time between decode steps (disaggregated: on the prefill group). "
    "TTFT = that prefill step + the decode step it waits for (or the K/V transfer); TPOT = "
    "the decode step + the prefill interleaved per step on average; queueing is not modelled."
)


def _unbounded(model, hardware, counts, workload, budget, bounds, missed) -> InfeasiblePlanError:
    """No plan meets the latency bounds: the best TTFT and TPOT that were predicted
    (colocated, and disaggregated without the bounds)."""
    devices = max(counts)
    for count in counts:
        missed = [
            *missed,
            *disaggregated_plans(
                model, hardware, count, workload, budget, serving=True, cluster=devices
            ),
        ]
    what = f"{workload.batch} x ({workload.prompt_len} + {workload.gen_len}) tokens"

    def figures(p: Prediction) -> str:
        return (
            f"{p.label} at batch {p.workload.batch}, prefill batch {p.workload.prefill_rows}: "
            f"TTFT {p.ttft_s * 1e3:.4g} ms, TPOT {p.tpot_s * 1e3:.4g} ms"
        )

    head = (
        f"no plan for {model.arch} ({what}) on {devices} {hardware.name} "
        f"device{'s' if devices > 1 else ''} meets {bounds.describe()}"
    )
    if not missed:
        return InfeasiblePlanError(f"{head}: no strategy fits")
    ttft = min(missed, key=lambda p: (p.ttft_s, p.tpot_s))
    tpot = min(missed, key=lambda p: (p.tpot_s, p.ttft_s))
    if tpot is ttft:
        best = f"the lowest TTFT and TPOT predicted are both those of {figures(ttft)}"
    else:
        best = (
            f"the lowest TTFT predicted is that of {figures(ttft)}; the lowest TPOT that of "
            f"{figures(tpot)}"
        )
    return InfeasiblePlanError(f"{head}: {best}. Loosen the bounds, lower --batch or add devices")


def largest_batch(
    model: ModelConfig,
    devices: int,
    workload: Workload,
    budget: int,
    *,
    serving: bool = False,
    where: Placement | None = None,
    platform: str | None = None,
) -> tuple[int, ParallelConfig] | None:
    """The largest batch below ``workload.batch`` that a strategy legal for the workload on
    ``devices`` fits in ``budget`` bytes per device (serving: one a server runs, prefilling its
    smallest batch), with that strategy; None when not even the smallest batch fits.
    Memory grows with the batch, so each strategy's largest is found by bisection over the
    multiples of its smallest legal batch. On TPU, only strategies that lay out on the chips
    (``where``) count."""
    best: tuple[int, ParallelConfig] | None = None
    for config in legal_strategies(model, devices, workload, where)[0]:
        if serving and check_serving(model, config, workload) is not None:
            continue
        step = batch_multiple(model, config)

        def fits(k: int, config=config, step=step) -> bool:
            w = dataclasses.replace(workload, batch=k * step)
            if check(model, config, w) is not None:
                return False
            need = memory(
                model,
                config,
                batch=w.batch,
                prompt_len=w.prompt_len,
                max_seq_len=w.max_seq_len,
                prefill_batch=step if serving else None,
                release_windows=serving,
                platform=platform,
            )
            return need.total <= budget

        lo, hi = 0, (workload.batch - 1) // step  # invariant: lo fits (0: nothing)
        if best is not None:  # only a larger batch than the best so far matters
            nxt = best[0] // step + 1
            if nxt > hi or not fits(nxt):
                continue
            lo = nxt
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        if lo and (best is None or lo * step > best[0]):
            best = (lo * step, config)
    return best


def _infeasible(
    model, hardware, devices, workload, budget, unfit, refused, serving=False
) -> InfeasiblePlanError:
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
    if unfit and workload.batch > 1:
        largest = largest_batch(
            model,
            devices,
            workload,
            budget,
            serving=serving,
            where=placement(hardware, devices),
            platform=hardware.platform,
        )
        if largest is not None:
            where += (
                f"; on {devices} device{'s' if devices > 1 else ''} the largest batch that "
                f"fits is {largest[0]} ({largest[1]})"
            )
        else:
            where += f"; on {devices} device{'s' if devices > 1 else ''} no batch fits"
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
        legal, _ = legal_strategies(model, count, workload, placement(hardware, count))
        for config in legal:
            need = memory(
                model,
                config,
                batch=workload.batch,
                prompt_len=workload.prompt_len,
                max_seq_len=workload.max_seq_len,
                platform=hardware.platform,
            )
            if need.total <= budget:
                return count
    return None
