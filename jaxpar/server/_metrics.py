"""Prometheus metrics for ``GET /metrics``, named as vLLM names them but ``jaxpar:``.

:class:`ServiceCollector` reads the live batcher (running, waiting, KV-cache usage,
preemptions, the prefix cache's queries and hits) and the service's
:class:`~jaxpar.server._service.ServiceStats` (tokens, successful requests, each request's
longest wait between two tokens) at each scrape, so nothing is kept in step with them.
Each app has a :class:`~prometheus_client.CollectorRegistry` of its own (not the global
one: several apps in one process never collide). Every series carries ``model_name``, the
served name.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from jaxpar.server._service import SUCCESS_REASONS, Histogram, Service

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
            "Requests finished by a stop token or string ('stop') or max_tokens ('length').",
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


def _histogram(metric: str, doc: str, values: Histogram, model: str) -> HistogramMetricFamily:
    family = HistogramMetricFamily(PREFIX + metric, doc, labels=["model_name"])
    bounds = [*map(floatToGoString, values.bounds), "+Inf"]
    buckets = list(zip(bounds, values.cumulative(), strict=True))
    family.add_metric([model], buckets, sum_value=values.sum)
    return family


def metrics_registry(service: Service) -> CollectorRegistry:
    """A registry of its own holding ``service``'s collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(service))
    return registry
