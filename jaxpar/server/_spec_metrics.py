"""Speculative decoding's metrics, under vLLM's names and jaxpar's.

vLLM (v1) counts, per verification, each request that had drafts as one draft
(``vllm:spec_decode_num_drafts``), its drafted tokens
(``vllm:spec_decode_num_draft_tokens``), the drafts the target accepted
(``vllm:spec_decode_num_accepted_tokens``) and, per draft position, how often the draft
there was accepted (``vllm:spec_decode_num_accepted_tokens_per_pos``, label
``position``); its mean acceptance length is ``1 + accepted / drafts``. jaxpar exports
the same counters, and as gauges the mean acceptance length and the number of drafted
tokens the cost model chose for the last step (``jaxpar:spec_decode_chosen_k``: 0 when
speculation was off) and the mean of the rows' own caps in the last verification
(``jaxpar:spec_decode_row_k_mean``), plus the verification and plain steps since start and
the steps per ``K`` chosen (``jaxpar:spec_decode_steps_by_k``, label ``k``; ``0``: plain
steps while speculation was on). Nothing is exported when the batcher does not speculate.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxpar.server._service import Service

ENGINE = "0"  # vLLM's engine index label (one engine core per server)


class SpecCollector(Collector):
    """A service's speculative decoding counters, read at each scrape."""

    def __init__(self, service: Service):
        self.service = service

    def collect(self) -> Iterator[Metric]:
        spec = getattr(self.service.batcher, "spec_stats", None)
        if spec is None:
            return
        name = self.service.model.name
        labels, values = ["model_name", "engine"], [name, ENGINE]
        for metric, doc, value in [
            ("num_drafts", "Number of spec decoding drafts.", spec.num_drafts),
            ("num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens),
            ("num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens),
        ]:
            family = CounterMetricFamily(f"vllm:spec_decode_{metric}", doc, labels=labels)
            family.add_metric(values, value)
            yield family
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*labels, "position"],
        )
        for position, value in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([*values, str(position)], value)
        yield per_pos
        for metric, doc, value in [
            ("spec_decode_mean_acceptance_length",
             "Tokens per drafted request per verification (accepted drafts + 1).",
             spec.mean_acceptance_length),
            ("spec_decode_chosen_k",
             "Drafted tokens per row the cost model chose for the last step (0: off).",
             spec.chosen_k),
            ("spec_decode_row_k_mean",
             "Drafted tokens per drafting row in the last verification (mean).",
             spec.row_k_mean),
        ]:  # fmt: skip
            gauge = GaugeMetricFamily(f"jaxpar:{metric}", doc, labels=["model_name"])
            gauge.add_metric([name], value)
            yield gauge
        for metric, doc, value in [
            ("spec_decode_verify_steps", "Verification steps run.", spec.verify_steps),
            ("spec_decode_plain_steps", "Plain decode steps run while speculation was on.",
             spec.plain_steps),
        ]:  # fmt: skip
            family = CounterMetricFamily(f"jaxpar:{metric}", doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family
        by_k = CounterMetricFamily(
            "jaxpar:spec_decode_steps_by_k",
            "Decode steps per drafted tokens per row the cost model chose (0: plain).",
            labels=["model_name", "k"],
        )
        for k, value in enumerate(spec.steps_by_k):
            by_k.add_metric([name, str(k)], value)
        yield by_k
