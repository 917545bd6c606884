"""A plan's prediction: both phases' costs, memory, and what the objectives read off it."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.engine import KV_PAGE_SIZE, kv_cache_tokens_for
from jaxpar.models import ModelConfig
from jaxpar.plan._cost import PhaseCost, phase_cost
from jaxpar.plan._enumerate import Workload
from jaxpar.plan._hardware import Hardware
from jaxpar.plan._memory import Memory, cache_bytes, memory
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
    #: The served pool's token budget (``--kv-cache-tokens``) that holds the batch at
    #: ``max_seq_len``, windows released: ``batch * max_seq_len`` without windows.
    kv_tokens: int | None = None
    #: TPU: what each mesh axis spans on the slice's chips (``jaxpar.spec.mesh_layout``),
    #: of the decode group and of a disaggregated prefill group; None off TPU.
    layout: str | None = None
    prefill_layout: str | None = None

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
    def ttft_s(self) -> float:
        """Time to first token: the prefill step (+ the K/V transfer when disaggregated);
        colocated serving adds the decode step a new request waits for (admission happens
        between two decode steps). Queueing behind other requests is not modelled: the
        arrival rate is assumed within what the plan sustains."""
        wait = self.decode.seconds if self.workload.serving and not self.disaggregated else 0.0
        return wait + self.prefill.seconds + self.transfer_s

    @property
    def tpot_s(self) -> float:
        """Time per output token: the decode step at the batch. Colocated serving adds the
        prefill interleaved between decode steps, on average: each step, ``batch / gen_len``
        requests finish and as many new prompts are prefilled (``prefill_batch`` per
        prefill step)."""
        w = self.workload
        if not w.serving or self.disaggregated:
            return self.decode.seconds
        return self.decode.seconds + w.batch / w.gen_len * self.prefill.seconds / w.prefill_rows

    @property
    def request_s(self) -> float:
        """Offline (``jaxpar run``): prefill (+ the K/V transfer) plus ``gen_len`` decode
        steps. Serving: ``ttft + (gen_len - 1) x tpot``."""
        w = self.workload
        if w.serving:
            return self.ttft_s + (w.gen_len - 1) * self.tpot_s
        return self.prefill.seconds + self.transfer_s + w.gen_len * self.decode.seconds

    @property
    def tokens_per_s(self) -> float:
        """Steady state: disaggregated groups overlap one batch's prefill with another's
        decode, so the busier group sets the rate. Serving colocated: ``batch / tpot``."""
        w = self.workload
        if w.serving and not self.disaggregated:
            return w.batch / self.tpot_s
        if w.serving:  # prefill makes prefill_batch prompts per step; decode needs batch/gen
            prefill_rate = w.prefill_rows * w.gen_len / (self.prefill.seconds + self.transfer_s)
            return min(w.batch / self.decode.seconds, prefill_rate)
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
            "prefill_batch": self.workload.prefill_rows,
            "serving": self.workload.serving,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "request_s": self.request_s,
            "tokens_per_s": self.tokens_per_s,
            "device_s_per_token": self.device_s_per_token,
            "comm_bytes_per_request": self.comm_bytes,
            "fits": self.fits,
            "layout": self.layout,
            "prefill_layout": self.prefill_layout,
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
    """Predicted cost and memory of one (legal) strategy: prefill steps of
    ``workload.prefill_rows`` prompts, decode steps of ``workload.batch`` sequences."""
    mem = memory(
        model,
        config,
        batch=workload.batch,
        prompt_len=workload.prompt_len,
        max_seq_len=workload.max_seq_len,
        prefill_batch=workload.prefill_batch,
        release_windows=workload.serving,
        platform=hardware.platform,
    )
    kw = dict(
        prompt_len=workload.prompt_len,
        max_seq_len=workload.max_seq_len,
        params_bytes=mem.params,
        # What a decode step reads: a window layer's step still gathers every column of
        # its block table (released ones point at the scratch page).
        cache_bytes=cache_bytes(model, config, workload.batch, workload.max_seq_len),
    )
    return Prediction(
        config,
        workload,
        phase_cost(model, config, Phase.PREFILL, hardware, batch=workload.prefill_rows, **kw),
        # A server's pipeline (continuous batching over decode groups) runs full.
        phase_cost(
            model,
            config,
            Phase.DECODE,
            hardware,
            batch=workload.batch,
            steady=workload.serving,
            **kw,
        ),
        mem,
        hardware.hbm_bytes if budget is None else budget,
        kv_tokens=kv_cache_tokens_for(model, workload.batch, workload.max_seq_len, KV_PAGE_SIZE),
    )
