"""Device groups per phase: one strategy on the first devices, or disaggregated serving.

Without ``--prefill`` both phases run one strategy on the first devices. With
``--prefill STRATEGY`` decode keeps the degree flags on the first devices and prefill runs
``STRATEGY`` on the devices after them; each request's K/V then moves from the prefill
group to the decode group once (:func:`handoff`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import jax

from jaxpar.engine import AbstractEngine, check_groups, moves_globally
from jaxpar.errors import ConfigError
from jaxpar.models import PREFILL_KV_AXES, ModelConfig, ModelRun
from jaxpar.spec import Module, ParallelConfig, Phase, make_mesh, partition_spec, slice_order


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
    """A strategy on the contiguous devices ``[first, first + parallel.size)``."""

    parallel: ParallelConfig
    first: int = 0

    @property
    def end(self) -> int:
        return self.first + self.parallel.size

    @property
    def devices(self) -> range:
        return range(self.first, self.end)

    def mesh(self):
        # TPU: chips in slice order (x fastest), where the planner placed this group.
        return make_mesh(self.parallel, slice_order(jax.devices())[self.first : self.end])

    def abstract_engine(self, config: ModelConfig, args: argparse.Namespace) -> AbstractEngine:
        """The group's layouts and steps over abstract parameters."""
        return AbstractEngine.build(
            config,
            self.parallel,
            max_batch=args.batch,
            max_seq_len=args.max_seq_len,
            mesh=self.mesh(),
        )


def device_groups(decode: ParallelConfig, prefill: str | None) -> dict[Phase, DeviceGroup]:
    """Where each phase runs: ``decode`` on the first devices, prefill after them if given."""
    group = DeviceGroup(decode)
    if not prefill:
        return {Phase.PREFILL: group, Phase.DECODE: group}
    return {
        Phase.PREFILL: DeviceGroup(ParallelConfig.parse(prefill), decode.size),
        Phase.DECODE: group,
    }


def check_devices(groups: dict[Phase, DeviceGroup]) -> None:
    """Raises unless this job has the devices every group needs."""
    needed, available = max(g.end for g in groups.values()), jax.device_count()
    if needed > available:
        split = " + ".join(
            f"{phase.value} {g.parallel} ({g.parallel.size})" for phase, g in groups.items()
        )
        if groups[Phase.PREFILL] == groups[Phase.DECODE]:
            split = f"{groups[Phase.DECODE].parallel} ({needed})"
        raise ConfigError(
            f"{split} needs {needed} devices but {available} are available; lower the "
            f"degrees, or on the CPU simulate more with --cpu-devices {needed}"
        )


def check_across(groups: dict[Phase, DeviceGroup]) -> None:
    """Raises unless disaggregated groups of a multi-process job can move K/V between
    them (:func:`jaxpar.engine.check_groups`: as many devices each). Each group's devices
    follow the processes' order: with 4 devices a process, decode ``tp=4`` runs on
    process 0 and ``--prefill tp=4`` on process 1."""
    if moves_globally():
        check_groups(*(groups[p].mesh() for p in (Phase.PREFILL, Phase.DECODE)))


def describe_groups(groups: dict[Phase, DeviceGroup]) -> str:
    prefill, decode = groups[Phase.PREFILL], groups[Phase.DECODE]
    if prefill == decode:
        return str(decode.parallel)
    return (
        f"prefill {prefill.parallel} on devices {prefill.first}-{prefill.end - 1}, "
        f"decode {decode.parallel} on devices {decode.first}-{decode.end - 1}"
    )


def handoff(
    config: ModelConfig, groups: dict[Phase, DeviceGroup], *, batch: int, prompt_len: int
) -> dict[str, Any]:
    """What moves from the prefill group to the decode group per prefilled batch.

    K and V of every layer for the batch's rows and padded prompt length, plus each
    row's prompt length and first token (int32), leave the prefill layout (``sp``/``tp``
    of the prefill strategy) and arrive in the decode strategy's prefill layout, from
    which the insert writes the decode slots.
    """
    # Each group's run K/V heads (rule kv-head-replicas); across two replica counts the
    # checkpoint's heads cross and the decode group repeats them (engine._kv_regroup).
    runs = {p: ModelRun.of(config).with_kv_heads_for(g.parallel) for p, g in groups.items()}
    same = runs[Phase.PREFILL].n_kv_heads == runs[Phase.DECODE].n_kv_heads
    heads = runs[Phase.DECODE].n_kv_heads if same else runs[Phase.DECODE].config.n_kv_heads
    kv_shape = (batch, prompt_len, heads, config.head_dim)
    kv_bytes = 2 * config.n_layers * math.prod(kv_shape) * config.dtype.itemsize
    rows_bytes = 2 * batch * 4
    specs = {
        phase.value: str(
            partition_spec(
                PREFILL_KV_AXES, Module.ATTENTION, Phase.PREFILL, g.parallel, dims=runs[phase]
            )
        )
        for phase, g in groups.items()
    }
    return {
        "groups": {
            phase.value: {"strategy": str(g.parallel), "devices": list(g.devices)}
            for phase, g in groups.items()
        },
        "transfer": {
            "what": "K and V of every layer [B, T, K, H], prompt lengths and first tokens",
            "shape_per_layer": list(kv_shape),
            "from_spec": specs[Phase.PREFILL.value],
            "to_spec": specs[Phase.DECODE.value],
            "bytes_per_batch": kv_bytes + rows_bytes,
            "bytes_per_request": (kv_bytes + rows_bytes) // batch,
            "when": "once per prefilled batch, overlapping the decode steps of running requests",
        },
    }
