"""The serving metrics under vLLM's names, for routers and autoscalers that read them.

The Gateway API Inference Extension's endpoint picker (GKE Inference Gateway, llm-d)
treats a model server it knows nothing else of as vLLM and reads ``vllm:*`` series:
queued and running requests, KV-cache use, the cache's block size and count. A
HorizontalPodAutoscaler on ``vllm:num_requests_waiting`` reads the same. So every serving
metric :mod:`jaxpar.server._metrics` exports as ``jaxpar:`` is exported again here with
vLLM's name, type and labels (``model_name``, the served name, and ``engine``, vLLM's
engine index: ``"0"``, one engine per server), read from the same counters at the same
scrape, so the two can never disagree. ``vllm:cache_config_info`` is vLLM's info gauge
(always 1): its labels are the page size (``block_size``), the pages requests can hold
(``num_gpu_blocks``, every batch shard's, scratch pages left out), whether prefix caching
is on, and ``engine`` (no ``model_name``, as in vLLM).

The prefix-cache counters count tokens as vLLM's do: a request's whole context is a
query when it is taken from the queue, the tokens found cached are hits. A request is
one choice (``n`` choices are that many), as in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from jaxpar.server._service import SUCCESS_REASONS, Histogram, Service

PREFIX = "vllm:"
#: vLLM's engine index label: one engine core per server.
ENGINE = "0"
LABELS = ["model_name", "engine"]


class VllmCollector(Collector):
    """A service's serving metrics under vLLM's names, read at each scrape."""

    def __init__(self, service: Service):
        self.service = service

    def collect(self) -> Iterator[Metric]:
        batcher, stats = self.service.batcher, self.service.stats
        values = [self.service.model.name, ENGINE]

        def family(kind, metric: str, doc: str, value: float):
            out = kind(PREFIX + metric, doc, labels=LABELS)
            out.add_metric(values, value)
            return out

        yield family(
            GaugeMetricFamily,
            "num_requests_running",
            "Number of requests in model execution batches.",
            batcher.active,
        )
        yield family(
            GaugeMetricFamily,
            "num_requests_waiting",
            "Number of requests waiting to be processed.",
            batcher.queued,
        )
        yield family(
            GaugeMetricFamily,
            "kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            batcher.kv_cache_usage,
        )
        info = _cache_info(batcher)
        if info is not None:
            yield info
        counters = [
            ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             batcher.stats.prefix_queries),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             batcher.stats.prefix_hits),
            ("num_preemptions", "Cumulative number of preemption from the engine.",
             batcher.stats.preemptions),
            ("prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            ("generation_tokens", "Number of generation tokens processed.",
             stats.generation_tokens),
        ]  # fmt: skip
        for metric, doc, value in counters:
            yield family(CounterMetricFamily, metric, doc, value)
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Count of successfully processed requests.",
            labels=[*LABELS, "finished_reason"],
        )
        for reason in SUCCESS_REASONS:
            success.add_metric([*values, reason], stats.succeeded[reason])
        yield success
        histograms = [
            ("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
             stats.time_to_first_token),
            ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
             stats.inter_token_latency),
            ("time_per_output_token_seconds", "Histogram of time per output token in seconds.",
             stats.inter_token_latency),
            ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
             stats.e2e_request_latency),
            ("request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request.", stats.request_queue_time),
        ]  # fmt: skip
        for metric, doc, histogram in histograms:
            yield _histogram(metric, doc, histogram, values)


def _cache_info(batcher) -> GaugeMetricFamily | None:
    """``vllm:cache_config_info``: the paged cache's shape as labels (None without a
    page pool)."""
    pool = getattr(batcher, "pool", None)
    if pool is None:
        return None
    labels = {
        "block_size": str(pool.page_size),
        "num_gpu_blocks": str(pool.usable_pages),
        "enable_prefix_caching": str(bool(getattr(batcher, "prefix_caching", False))),
        "engine": ENGINE,
    }
    info = GaugeMetricFamily(
        PREFIX + "cache_config_info",
        "Information of the LLMEngine CacheConfig",
        labels=list(labels),
    )
    info.add_metric(list(labels.values()), 1)
    return info


def _histogram(
    metric: str, doc: str, values: Histogram, labels: list[str]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(PREFIX + metric, doc, labels=LABELS)
    buckets = list(zip(values.labels, values.cumulative(), strict=True))
    family.add_metric(labels, buckets, sum_value=values.sum)
    return family
