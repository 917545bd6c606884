"""Efficiency of the steps a server runs: HBM bandwidth, MFU and collective bytes.

The batcher records shape facts and times of its steps (:class:`~jaxpar.engine.StepLog`);
this module turns them into bytes and FLOPs with a :class:`PhaseProfile` per phase, made
once after warm-up from the compiled programs (:func:`profile_batcher`), and into
fractions of the hardware's peaks (:class:`~jaxpar.plan.Hardware`, figures per device,
times the devices of the phase).

What is counted, per step of a phase (all its devices together):

* bytes read: what the compiled step takes as arguments besides the KV cache
  (``memory_analysis().argument_size_in_bytes``, per device, times the devices: the
  weights, and the decode rows' small state), plus the KV cache it reads: decode, every
  running row's pages up to the block-table width; prefill, the cached context of a
  prefix hit or earlier chunks. KV bytes per position are the pool's bytes on every
  device over its positions, so replicated K/V heads count once per replica, as read.
  Writes (the new tokens' K/V, activations) are not counted.
* model FLOPs: ``2 x`` the weights each token multiplies (the planner's
  :func:`~jaxpar.plan.step_flops` count: attention projections, the FFN or the
  ``top_k`` routed experts and the router), the LM head once per sequence that draws a
  token, and attention ``4 x n_heads x head_dim`` per layer for every (query, key)
  pair a real token attends to (causal; padding and masked positions not counted).
* collective bytes: the compiled program of a decode step over every row with the
  widest block table, and of the largest prefill bucket, against the analytic minimum
  (:func:`jaxpar.inspect.collective_report`; bytes per device per step).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from jaxpar.engine import StepFacts
from jaxpar.inspect import collective_report, communication_model, parse_collectives
from jaxpar.models import ModelRun
from jaxpar.plan import Hardware, device_hardware, load_hardware, step_flops
from jaxpar.spec import Phase

PHASES = ("prefill", "decode")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseProfile:
    """One phase's cost per step fact, from its compiled programs (all devices).

    Attributes:
        devices: devices the phase runs on.
        dtype: the model's compute dtype (which peak FLOP/s applies).
        step_bytes: bytes a step reads besides the KV cache.
        kv_bytes_per_position: bytes of one cached position, all layers, K and V.
        flops_per_token: weight FLOPs per real token.
        flops_per_row: LM-head FLOPs per sequence drawing a token.
        flops_per_pair: attention FLOPs per (query, key) pair, all layers and heads.
        collective_bytes: compiled collective bytes per device per step.
        collective_min_bytes: the analytic minimum of the same step.
        program: which compiled step the collectives are of.
        collective_branch_bytes: of ``collective_bytes``, those in conditional branches
            (the vocab-parallel sampler's O(B x k) exchanges): a step runs them only
            when a row samples, so a greedy step moves ``collective_bytes`` less these.
    """

    devices: int
    dtype: str
    step_bytes: int
    kv_bytes_per_position: float
    flops_per_token: float
    flops_per_row: float
    flops_per_pair: float
    collective_bytes: int
    collective_min_bytes: int
    program: str
    collective_branch_bytes: int = 0

    def bytes(self, facts: StepFacts) -> float:
        return self.step_bytes * facts.steps + self.kv_bytes_per_position * facts.kv_read

    def flops(self, facts: StepFacts) -> float:
        return (
            self.flops_per_token * facts.tokens
            + self.flops_per_row * facts.rows
            + self.flops_per_pair * facts.pairs
        )


@dataclasses.dataclass(frozen=True)
class Peaks:
    """A phase's peaks: HBM bytes/s and FLOP/s of all its devices together."""

    hbm_bytes_per_s: float
    flops_per_s: float


class Efficiency:
    """A served batcher's efficiency: profiles (set once warmed up) and peaks.

    Args:
        hardware: the device kind's figures, or None when the kind is unknown (the
            fractions of peak are then not reported).
    """

    def __init__(self, hardware: Hardware | None):
        self.hardware = hardware
        self.profiles: dict[str, PhaseProfile] = {}

    def measure(self, batcher: Any) -> None:
        """Profiles ``batcher``'s compiled programs (after its warm-up: they are cached)."""
        self.profiles = profile_batcher(batcher)

    def peaks(self, phase: str) -> Peaks | None:
        """The phase's peaks (its devices, its dtype); None without hardware figures."""
        hw, profile = self.hardware, self.profiles.get(phase)
        if hw is None or profile is None or profile.dtype not in hw.peak_tflops:
            return None
        n = profile.devices
        return Peaks(hw.hbm_gbps * 1e9 * n, hw.peak_flops(profile.dtype) * n)


def resolve_hardware(name: str | None) -> Hardware | None:
    """``--hardware NAME`` (a kind of :data:`jaxpar.plan.KINDS` or a TOML file), else the
    kind of ``jax.devices()[0]`` (None if it is none the planner knows).

    Raises:
        ConfigError: an unknown name (the message lists the known ones).
    """
    if name is not None:
        return load_hardware(name)
    device = jax.devices()[0]
    kind = device_hardware(device.platform, device.device_kind)
    return None if kind is None else load_hardware(kind)


# --- profiles ------------------------------------------------------------------------------


def profile_batcher(batcher: Any) -> dict[str, PhaseProfile]:
    """Both phases' profiles from the batcher's compiled programs (cached after warm-up:
    nothing compiles again)."""
    return {"decode": _decode_profile(batcher), "prefill": _prefill_profile(batcher)}


def _decode_profile(batcher: Any) -> PhaseProfile:
    eng, slot_steps = batcher.engine, batcher.slot_steps
    width = batcher.table_widths()[-1]
    rows = slot_steps.row_buckets()[-1]
    compiled = slot_steps.compile_step(eng.params, width, rows)
    pool_bytes = slot_steps.pool_bytes_per_device()
    args = _argument_bytes(compiled, fallback=_param_bytes(eng) + pool_bytes)
    positions = width * batcher.pool.page_size
    return _profile(
        eng,
        Phase.DECODE,
        compiled,
        step_bytes=(args - pool_bytes) * eng.mesh.size,
        kv_bytes=_kv_bytes_per_position(slot_steps),
        batch=eng.max_batch,
        prompt_len=1,
        program=f"decode step of {rows} rows x {positions} positions",
    )


def _prefill_profile(batcher: Any) -> PhaseProfile:
    eng = batcher.prefill_engine
    rows = batcher.row_buckets()[-1]
    length = eng.bucket(min(batcher.max_prompt_len, batcher.chunk_tokens))
    compiled = eng.steps.compiled_prefill(eng.params, rows, length)
    args = _argument_bytes(compiled, fallback=_param_bytes(eng))
    return _profile(
        eng,
        Phase.PREFILL,
        compiled,
        step_bytes=args * eng.mesh.size,
        kv_bytes=_kv_bytes_per_position(batcher.prefill_slot_steps),
        batch=rows,
        prompt_len=length,
        program=f"prefill of {rows} x {length} tokens",
    )


def _profile(eng, phase, compiled, *, step_bytes, kv_bytes, batch, prompt_len, program):
    config = ModelRun(eng.model_config, eng.options)  # the true vocabulary, the run's MoE
    # The programs the server runs: the decode step samples (its minimum includes the
    # vocab-parallel sampler's O(B x k) exchange); prefill is a serving bucket.
    serving = "serve_decode" if phase is Phase.DECODE else "serve_prefill"
    minimum = communication_model(
        config,
        eng.parallel_config,
        phase,
        batch=batch,
        prompt_len=prompt_len,
        program=serving,
    )
    collectives = parse_collectives(compiled)
    report = collective_report(
        collectives,
        eng.mesh,
        minimum,
        cache_dims=(eng.max_seq_len, config.head_dim),
    )
    head = 2.0 * config.d_model * config.vocab_size
    one_token = step_flops(config, Phase.DECODE, batch=1, prompt_len=1, context=0)
    return PhaseProfile(
        devices=eng.mesh.size,
        dtype=np.dtype(config.dtype).name,
        step_bytes=int(step_bytes),
        kv_bytes_per_position=kv_bytes,
        flops_per_token=one_token - head,
        flops_per_row=head,
        flops_per_pair=4.0 * config.n_layers * config.n_heads * config.head_dim,
        collective_bytes=report.compiled_bytes,
        collective_min_bytes=report.minimum_bytes,
        program=program,
        collective_branch_bytes=sum(
            c.bytes * (c.trip_count or 1) for c in collectives if c.in_branch
        ),
    )


def _argument_bytes(compiled: Any, *, fallback: int) -> int:
    """Per device: the compiled program's argument bytes (``fallback`` where the backend
    reports no memory analysis)."""
    analysis = compiled.memory_analysis()
    size = getattr(analysis, "argument_size_in_bytes", None)
    return int(size) if size else fallback


def _param_bytes(eng: Any) -> int:
    """Per device: the bytes of the engine's parameters on its first device."""
    first = eng.mesh.devices.flat[0]
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(eng.params)
        for s in x.addressable_shards
        if s.device == first
    )


def _kv_bytes_per_position(slot_steps: Any) -> float:
    """Bytes of one position of the page pool on all devices (replicas included), every
    layer: with KV groups a page holds one group's layers, and a step reads a page per
    group."""
    pool = slot_steps.pool
    devices = slot_steps.steps.mesh.size
    per_page = slot_steps.pool_bytes_per_device() * devices / (pool.pages * pool.page_size)
    return per_page * pool.groups


# --- what a scrape reports --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PhaseReading:
    """One phase at a scrape: totals since start, and the recent window's rates."""

    total_bytes: float
    total_flops: float
    total: StepFacts
    bandwidth: float | None  # bytes/s over the recent window (None: no timed step yet)
    bandwidth_fraction: float | None
    flops_per_s: float | None
    mfu: float | None
    profile: PhaseProfile


def read_phase(
    profile: PhaseProfile, total: StepFacts, recent: StepFacts, peaks: Peaks | None
) -> PhaseReading:
    """``recent``'s bytes and FLOPs over its seconds, as fractions of ``peaks``."""
    bandwidth = flops_per_s = None
    if recent.steps and recent.seconds > 0:
        bandwidth = profile.bytes(recent) / recent.seconds
        flops_per_s = profile.flops(recent) / recent.seconds
    fraction = mfu = None
    if peaks is not None and bandwidth is not None:
        fraction = bandwidth / peaks.hbm_bytes_per_s
        mfu = flops_per_s / peaks.flops_per_s
    return PhaseReading(
        total_bytes=profile.bytes(total),
        total_flops=profile.flops(total),
        total=total,
        bandwidth=bandwidth,
        bandwidth_fraction=fraction,
        flops_per_s=flops_per_s,
        mfu=mfu,
        profile=profile,
    )


def readings(efficiency: Efficiency, batcher: Any) -> Iterator[tuple[str, PhaseReading]]:
    """(phase, reading) of each profiled phase, from the batcher's step log now."""
    log = batcher.step_log
    for phase in PHASES:
        profile = efficiency.profiles.get(phase)
        if profile is None:
            continue
        phase_log = getattr(log, phase)
        peaks = efficiency.peaks(phase)
        yield phase, read_phase(profile, phase_log.total, phase_log.recent(), peaks)


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
