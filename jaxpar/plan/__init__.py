"""The planner: legal strategies for a model, a cluster and a workload, predicted and ranked.

``jaxpar plan`` in code: :func:`plan` enumerates every strategy the validator accepts for
the device count, predicts each phase's step time on a :class:`Hardware` (compute, HBM
reads, collectives from :func:`jaxpar.inspect.communication_model` on the links their mesh
axes cross) and its memory per device, and ranks those that fit by an objective.
"""

from jaxpar.plan._cost import (
    CommCost,
    PhaseCost,
    bubble,
    collective_seconds,
    executions,
    phase_cost,
    step_flops,
)
from jaxpar.plan._disaggregated import disaggregated_plans, kv_transfer_bytes
from jaxpar.plan._enumerate import Refused, Workload, check, legal_strategies, strategies
from jaxpar.plan._hardware import KINDS, Hardware, Link, device_hardware, load_hardware
from jaxpar.plan._memory import Memory, cache_bytes, memory, param_bytes
from jaxpar.plan._picture import draw_plan
from jaxpar.plan._placement import Placement, placement
from jaxpar.plan._planner import OBJECTIVES, Planning, largest_batch, min_devices, plan
from jaxpar.plan._prediction import Prediction, predict
from jaxpar.plan._serving import Bounds, max_prefill_tokens, prefill_batches, serve_flags
from jaxpar.plan._summary import axis_roles, duration, per_layer, run_flags, why

__all__ = [
    "KINDS",
    "OBJECTIVES",
    "Bounds",
    "CommCost",
    "Hardware",
    "Link",
    "Memory",
    "PhaseCost",
    "Placement",
    "Planning",
    "Prediction",
    "Refused",
    "Workload",
    "axis_roles",
    "bubble",
    "cache_bytes",
    "device_hardware",
    "check",
    "collective_seconds",
    "disaggregated_plans",
    "draw_plan",
    "duration",
    "executions",
    "kv_transfer_bytes",
    "largest_batch",
    "legal_strategies",
    "load_hardware",
    "max_prefill_tokens",
    "memory",
    "min_devices",
    "param_bytes",
    "per_layer",
    "phase_cost",
    "placement",
    "plan",
    "predict",
    "prefill_batches",
    "run_flags",
    "serve_flags",
    "step_flops",
    "strategies",
    "why",
]
