"""A plan's prediction: both phases' costs, memory, and what the objectives read off it."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.models import ModelConfig
from jaxpar.plan._cost import PhaseCost, phase_cost
from jaxpar.plan._enumerate import Workload
from jaxpar.plan._hardware import Hardware
from jaxpar.plan._memory import Memory, memory
from jaxpar.spec import MESH_AXES, ParallelConfig, Phase


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
