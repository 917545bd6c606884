"""Prometheus metrics for ``GET /metrics``, named as vLLM names them but ``jaxpar:``.

:class:`ServiceCollector` reads the live batcher (running, waiting, KV-cache usage,
preemptions) and the service's :class:`~jaxpar.server._service.ServiceStats` (tokens,
successful requests) at each scrape, so nothing is kept in step with them. Each app has a
:class:`~prometheus_client.CollectorRegistry` of its own (not the global one: several apps
in one process never collide). Every series carries ``model_name``, the served name.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxpar.server._service import SUCCESS_REASONS, Service

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


def metrics_registry(service: Service) -> CollectorRegistry:
    """A registry of its own holding ``service``'s collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(service))
    return registry
