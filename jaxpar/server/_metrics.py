"""Prometheus metrics for ``GET /metrics``, named as vLLM names them but ``jaxpar:``.

:class:`ServiceCollector` reads the live batcher (running, waiting, KV-cache usage,
preemptions, the prefix cache's queries and hits) and the service's
:class:`~jaxpar.server._service.ServiceStats` (tokens, successful requests, latency
histograms with vLLM's bucket bounds) at each scrape, so nothing is kept in step with
them. With an :class:`~jaxpar.server._efficiency.Efficiency` profiled (``jaxpar serve``,
once warmed up), each phase's achieved HBM bandwidth, model FLOP/s, their fractions of
the hardware's peaks, and its compiled collective bytes against the minimum, labelled
``phase`` (:mod:`jaxpar.server._efficiency` says what is counted).
Each app has a :class:`~prometheus_client.CollectorRegistry` of its own (not the global
one: several apps in one process never collide). Every series carries ``model_name``, the
served name. The serving metrics are exported a second time under vLLM's own names
(``vllm:``, :mod:`jaxpar.server._vllm_metrics`), which routers and autoscalers read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from jaxpar.engine import WINDOW_STEPS
from jaxpar.server._efficiency import PhaseReading, finite, readings
from jaxpar.server._offload_metrics import HostTierCollector
from jaxpar.server._service import SUCCESS_REASONS, Histogram, Service
from jaxpar.server._spec_metrics import SpecCollector
from jaxpar.server._vllm_metrics import VllmCollector

PREFIX = "jaxpar:"


class ServiceCollector(Collector):
    """A service's metrics, read from its batcher and counters at each scrape."""

    def __init__(self, service: Service):
        self.service = service

    def collect(self) -> Iterator[Metric]:
        batcher, stats, name = self.service.batcher, self.service.stats, self.service.model.name

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            return family

        yield gauge("num_requests_running", "Requests holding a decode slot.", batcher.active)
        yield gauge("num_requests_waiting", "Requests queued for prefill.", batcher.queued)
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of the decode KV cache held by running requests (1 = full).",
            batcher.kv_cache_usage,
        )
        yield counter(
            "num_preemptions",
            "Running requests whose KV cache was taken back (recomputed later).",
            batcher.stats.preemptions,
        )
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            batcher.stats.prefix_queries,
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens looked up in the prefix cache and found there.",
            batcher.stats.prefix_hits,
        )
        yield counter(
            "prompt_tokens_cached",
            "Prompt tokens whose K/V came from the prefix cache, summed over requests (each "
            "choice of n its own; usage.prompt_tokens_details.cached_tokens).",
            batcher.stats.prompt_tokens_cached,
        )
        yield counter(
            "prompt_tokens",
            "Prompt tokens of requests that drew a token (their usage.prompt_tokens).",
            stats.prompt_tokens,
        )
        yield counter(
            "generation_tokens",
            "Tokens generated, as they arrive (the requests' usage.completion_tokens).",
            stats.generation_tokens,
        )
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Requests finished by a stop token or string ('stop'), max_tokens ('length'), "
            "or whose client left first ('abort').",
            labels=["model_name", "finished_reason"],
        )
        for reason in SUCCESS_REASONS:
            success.add_metric([name, reason], stats.succeeded[reason])
        yield success
        yield _histogram(
            "request_max_inter_token_latency_seconds",
            "The longest wait between two consecutive tokens of a request (one observation "
            "per request with at least two tokens): how long its stream stalled, as when "
            "other prompts prefilled or it was preempted.",
            stats.max_token_gap,
            name,
        )
        yield from _latency(stats, name)
        yield from _pipeline(batcher, gauge, counter)
        if self.service.efficiency is not None:
            yield from _efficiency(self.service, name)


def _pipeline(batcher, gauge, counter) -> Iterator[Metric]:
    """Pipelined decode's bubble (``pp > 1`` only): the share of stage-iterations the
    decode steps dispatched so far spent idle (fill and drain, or a group with no live
    row), and the two counts it divides."""
    slot_steps = getattr(batcher, "slot_steps", None)
    if getattr(slot_steps, "pipeline", None) is None:
        return
    stats = batcher.stats
    yield gauge(
        "pipeline_bubble_fraction",
        "Share of pipelined decode's stage-iterations spent idle since start (pipeline "
        "fill and drain, or a decode group with no live row); 0 before the first step.",
        stats.bubble_fraction,
    )
    yield counter(
        "pipeline_stage_iterations",
        "Stage-iterations pipelined decode steps dispatched (stages x iterations).",
        stats.stage_iterations,
    )
    yield counter(
        "pipeline_idle_stage_iterations",
        "Of those, the stage-iterations a stage spent idle.",
        stats.idle_stage_iterations,
    )


def _latency(stats, name: str) -> Iterator[Metric]:
    """vLLM's request latency histograms (each request: each choice of ``n`` its own)."""
    yield _histogram(
        "time_to_first_token_seconds",
        "From a request's submission to its first token reaching the host.",
        stats.time_to_first_token,
        name,
    )
    gaps = "Each wait between two consecutive tokens of a request (one observation per gap)"
    yield _histogram("inter_token_latency_seconds", gaps + ".", stats.inter_token_latency, name)
    yield _histogram(
        "time_per_output_token_seconds",
        gaps + "; vLLM's older name of inter_token_latency_seconds, the same observations.",
        stats.inter_token_latency,
        name,
    )
    yield _histogram(
        "e2e_request_latency_seconds",
        "From a request's submission to its last token reaching the host.",
        stats.e2e_request_latency,
        name,
    )
    yield _histogram(
        "request_queue_time_seconds",
        "From a request's submission until a prefill first took it from the queue.",
        stats.request_queue_time,
        name,
    )


def _efficiency(service: Service, name: str) -> Iterator[Metric]:
    """Per phase: bandwidth, FLOP/s and their fractions of peak (recent window), the
    totals they come from, and the compiled collective bytes per step."""
    phases = list(readings(service.efficiency, service.batcher))
    if not phases:  # not profiled yet (warming up)
        return
    hardware = service.efficiency.hardware
    if hardware is not None:
        info = GaugeMetricFamily(
            PREFIX + "hardware_info",
            "The hardware whose peaks the fractions divide by (1; its name as a label).",
            labels=["model_name", "hardware"],
        )
        info.add_metric([name, hardware.name], 1)
        yield info
    for metric, doc, value in _PHASE_GAUGES:
        family = GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name", "phase"])
        for phase, reading in phases:
            v = value(reading)
            if finite(v):
                family.add_metric([name, phase], v)
        if family.samples:
            yield family
    program = GaugeMetricFamily(
        PREFIX + "collective_program_info",
        "Which compiled step of each phase the collective bytes are of (1; as a label).",
        labels=["model_name", "phase", "program"],
    )
    for phase, reading in phases:
        program.add_metric([name, phase, reading.profile.program], 1)
    yield program
    for metric, doc, value in _PHASE_COUNTERS:
        family = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name", "phase"])
        for phase, reading in phases:
            family.add_metric([name, phase], value(reading))
        yield family


_RECENT = f"over the last {WINDOW_STEPS} steps of the phase"

#: (name, help, value of a reading) of the per-phase gauges; absent while None.
_PHASE_GAUGES: list[tuple[str, str, Callable[[PhaseReading], float | None]]] = [
    (
        "hbm_bytes_per_second",
        f"Achieved HBM bandwidth, all devices of the phase: bytes its steps read (weights "
        f"and other arguments, and the KV cache read) / their wall time, {_RECENT}.",
        lambda r: r.bandwidth,
    ),
    (
        "hbm_bandwidth_fraction",
        f"hbm_bytes_per_second / the hardware's peak HBM bandwidth x the phase's devices, "
        f"{_RECENT} (0..1).",
        lambda r: r.bandwidth_fraction,
    ),
    (
        "model_flops_per_second",
        f"Model FLOPs of the phase's steps (2 x weights per token, LM head per sequence, "
        f"causal attention) / their wall time, {_RECENT}.",
        lambda r: r.flops_per_s,
    ),
    (
        "model_flops_utilization",
        f"MFU: model_flops_per_second / the hardware's peak FLOP/s for the model's dtype x "
        f"the phase's devices, {_RECENT} (0..1).",
        lambda r: r.mfu,
    ),
    (
        "collective_bytes_per_step",
        "Collective bytes per device of one step, read from its compiled program (see "
        "collective_program_info).",
        lambda r: r.profile.collective_bytes,
    ),
    (
        "collective_bytes_min_per_step",
        "The analytic minimum of collective_bytes_per_step for the same step "
        "(jaxpar.inspect.communication_model).",
        lambda r: r.profile.collective_min_bytes,
    ),
]

#: (name, help, value of a reading) of the per-phase counters (Prometheus adds _total).
_PHASE_COUNTERS: list[tuple[str, str, Callable[[PhaseReading], float]]] = [
    ("steps", "Steps run (prefill: a long prompt's chunks each count).", lambda r: r.total.steps),
    ("step_seconds", "Wall time of the phase's steps, in seconds.", lambda r: r.total.seconds),
    ("hbm_bytes_read", "Bytes the phase's steps read from HBM.", lambda r: r.total_bytes),
    ("model_flops", "Model FLOPs of the phase's steps.", lambda r: r.total_flops),
    (
        "step_tokens",
        "Real tokens the phase's steps computed (decode: one per running row; prefill: "
        "the prompts' new tokens).",
        lambda r: r.total.tokens,
    ),
    (
        "step_tokens_computed",
        "Tokens the compiled steps computed, padding included (decode: the step's row "
        "bucket; prefill: its rows x tokens buckets); less step_tokens: padding.",
        lambda r: r.total.computed,
    ),
    (
        "kv_positions_read",
        "Cached KV positions the steps read per layer (decode: each running row's "
        "block-table width; prefill: the cached context).",
        lambda r: r.total.kv_read,
    ),
    (
        "kv_positions_live",
        "Of kv_positions_read, those the rows hold; the rest is block-table width past "
        "the rows' ends.",
        lambda r: r.total.kv_live,
    ),
]


def _histogram(metric: str, doc: str, values: Histogram, model: str) -> HistogramMetricFamily:
    family = HistogramMetricFamily(PREFIX + metric, doc, labels=["model_name"])
    buckets = list(zip(values.labels, values.cumulative(), strict=True))
    family.add_metric([model], buckets, sum_value=values.sum)
    return family


def metrics_registry(service: Service) -> CollectorRegistry:
    """A registry of its own holding ``service``'s collectors: jaxpar's names, and the
    same values under vLLM's (:mod:`._vllm_metrics`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(service))
    registry.register(VllmCollector(service))
    registry.register(HostTierCollector(service))
    registry.register(SpecCollector(service))
    return registry
