"""Metrics of the prefix cache's host tier (``--kv-offload-gb``), under jaxpar's names and
vLLM's.

Read from the batcher's :class:`~jaxpar.engine._host_tier.HostTier` at each scrape
(nothing is exported without one):

* ``jaxpar:kv_offload_host_hits``: prompt tokens served from host pages (copied back to
  the devices instead of computed again);
* ``jaxpar:kv_offload_total_bytes{transfer_type}``: bytes copied to the host
  (``GPU_to_CPU``: pages the device pool evicted) and back (``CPU_to_GPU``: pages copied
  back for a hit), whole pages, every kv head; vLLM's labels whatever the accelerator, and
  exported again as vLLM's ``vllm:kv_offload_total_bytes`` (with its ``engine`` label),
  the twin of jaxpar's as every ``vllm:`` series is;
* ``jaxpar:kv_offload_host_usage_perc``: the fraction of the host tier's pages in use,
  and ``jaxpar:kv_offload_host_evictions``: pages it evicted to make room.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxpar.server._service import Service

#: vLLM's engine index label (one engine per server), as in :mod:`._vllm_metrics`.
ENGINE = "0"


class HostTierCollector(Collector):
    """A service's host-tier metrics, read at each scrape."""

    def __init__(self, service: Service):
        self.service = service

    def collect(self) -> Iterator[Metric]:
        tier = getattr(self.service.batcher, "host_tier", None)
        if tier is None:
            return
        name = self.service.model.name

        def one(kind, metric: str, doc: str, value: float):
            family = kind("jaxpar:" + metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            return family

        yield one(
            CounterMetricFamily,
            "kv_offload_host_hits",
            "Prompt tokens served from the prefix cache's host tier.",
            tier.hit_tokens,
        )
        yield one(
            CounterMetricFamily,
            "kv_offload_host_evictions",
            "Pages the host tier evicted to make room.",
            tier.evicted,
        )
        yield one(
            GaugeMetricFamily,
            "kv_offload_host_usage_perc",
            "Fraction of the host tier's pages in use. 1 means 100 percent usage.",
            tier.usage,
        )
        moved = [("GPU_to_CPU", tier.offloaded_bytes), ("CPU_to_GPU", tier.restored_bytes)]
        ours = CounterMetricFamily(
            "jaxpar:kv_offload_total_bytes",
            "Bytes of KV pages copied between the devices and the host tier.",
            labels=["model_name", "transfer_type"],
        )
        vllm = CounterMetricFamily(
            "vllm:kv_offload_total_bytes",
            "Number of bytes offloaded by KV connector",
            labels=["model_name", "engine", "transfer_type"],
        )
        for transfer, value in moved:
            ours.add_metric([name, transfer], value)
            vllm.add_metric([name, ENGINE, transfer], value)
        yield ours
        yield vllm
