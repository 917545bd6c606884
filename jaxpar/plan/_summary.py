"""What a plan says in words: why the best wins, the flags that run it, per-layer collectives."""

from __future__ import annotations

from typing import Any

from jaxpar.plan._cost import PhaseCost
from jaxpar.plan._planner import Planning
from jaxpar.plan._prediction import Prediction
from jaxpar.plan._serving import serve_flags
from jaxpar.spec import MESH_AXES, Module, ParallelConfig, Phase, mesh_axes, modules_of

LAYER_MODULES = ("attention", "ffn", "moe")


def duration(seconds: float) -> str:
    """``812 us``, ``3.42 ms``, ``1.18 s``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.4g} us"
    if seconds < 1:
        return f"{seconds * 1e3:.4g} ms"
    return f"{seconds:.4g} s"


def _parts(pred: Prediction) -> dict[str, float]:
    """Request time split into what the objective adds up (seconds per request; serving:
    per output token)."""
    g = pred.workload.gen_len
    if pred.workload.serving:
        d = pred.decode
        return {
            f"decode {'compute' if d.compute_s >= d.memory_s else 'HBM reads'}": max(
                d.compute_s, d.memory_s
            ),
            "decode communication": d.comm_s,
            "prefill between decode steps": pred.tpot_s - d.seconds,
        }
    out = {}
    for name, cost, times in (("prefill", pred.prefill, 1), ("decode", pred.decode, g)):
        busy = max(cost.compute_s, cost.memory_s) * times
        out[f"{name} {'compute' if cost.compute_s >= cost.memory_s else 'HBM reads'}"] = busy
        out[f"{name} communication"] = cost.comm_s * times
    out["K/V transfer"] = pred.transfer_s
    return out


def why(planning: Planning) -> str:
    """One line: what makes the best plan beat the runner-up."""
    best = planning.best
    head = (
        f"{best.label} is {best.prefill.bound}-bound in prefill and "
        f"{best.decode.bound}-bound in decode"
    )
    if len(planning.ranked) == 1:
        return f"{head}; it is the only legal strategy that fits."
    other = planning.ranked[1]
    mine, theirs = _parts(best), _parts(other)
    keys = set(mine) | set(theirs)
    gain = {k: theirs.get(k, 0.0) - mine.get(k, 0.0) for k in keys}
    key = max(gain, key=gain.__getitem__)
    metric = {
        "latency": f"{duration(best.request_s)} vs {duration(other.request_s)} per request",
        "throughput": f"{best.tokens_per_s:.0f} vs {other.tokens_per_s:.0f} tokens/s "
        f"(batch {best.workload.batch} vs {other.workload.batch})",
        "cost": f"{best.device_s_per_token * 1e3:.3g} vs {other.device_s_per_token * 1e3:.3g} "
        f"device-ms per token ({best.devices} vs {other.devices} devices)",
    }[planning.objective]
    per = "per output token" if best.workload.serving else "per request"
    return (
        f"{head}; it beats {other.label} ({metric}) mostly on {key}: "
        f"{duration(mine.get(key, 0.0))} vs {duration(theirs.get(key, 0.0))} {per}."
    )


def run_flags(pred: Prediction, source: str) -> str:
    """The command line of a plan: ``jaxpar run`` (``serve`` takes the same strategy flags);
    a serving or disaggregated plan's is ``jaxpar serve``'s (:func:`serve_flags`)."""
    if pred.workload.serving or pred.prefill_config is not None:
        return serve_flags(pred, source)
    c, w = pred.config, pred.workload
    flags = [f"--{a} {c.degree(a)}" for a in MESH_AXES if c.degree(a) > 1]
    if c.microbatches > 1:
        flags.append(f"--microbatches {c.microbatches}")
    if c.decode_groups > 1:
        flags.append(f"--decode-groups {c.decode_groups}")
    flags += [
        f"--batch {w.batch}",
        f"--max-seq-len {w.max_seq_len}",
        f"--max-new-tokens {w.gen_len}",
    ]
    return f"jaxpar run {source} {' '.join(flags)} --prompt ..."


def phase_config(pred: Prediction, phase: Phase) -> ParallelConfig:
    """The strategy ``phase`` runs under (a disaggregated plan's prefill has its own)."""
    if phase is Phase.PREFILL and pred.prefill_config is not None:
        return pred.prefill_config
    return pred.config


def axis_roles(model: Any, pred: Prediction, phase: Phase) -> dict[str, str]:
    """Mesh axis -> what it splits in ``phase``, module by module (axes of degree > 1)."""
    config = phase_config(pred, phase)
    roles: dict[str, list[str]] = {a: [] for a in config.active()}
    for module in modules_of(model):
        axes = mesh_axes(module, phase, config, dims=model)
        for axis in roles:
            dims = [d for d, on in axes.items() if axis in on and d != "expert_batch"]
            if dims:
                roles[axis].append(f"{Module.coerce(module).value}: {','.join(dims)}")
    return {a: "; ".join(r) or "replicated" for a, r in roles.items()}


def per_layer(cost: PhaseCost, layers_per_device: int) -> list[dict[str, Any]]:
    """The collectives of one decoder layer: bytes and predicted time per execution and per
    layer (every microbatch or decode group, bubbles included)."""
    rows = []
    for c in cost.comm:
        if c.item.module not in LAYER_MODULES and c.item.step != "stage boundary":
            continue
        per = c.executions / layers_per_device  # a stage boundary: spread over its layers
        rows.append(
            {
                "step": c.item.step,
                "kind": c.item.kind,
                "axes": ",".join(c.item.axes),
                "link": c.link,
                "bytes_each": c.item.bytes_each,
                "per_layer": per,
                "bytes_per_layer": c.item.bytes_each * per,
                "seconds_per_layer": c.seconds / layers_per_device,
            }
        )
    return rows
