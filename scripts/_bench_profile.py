"""Where a served workload's time went, from what ``jaxpar serve`` already records: the
batcher's counters (``GET /health``'s ``stats``: :class:`jaxpar.engine.BatcherStats`) and
the per-phase step counters of ``GET /metrics`` (``jaxpar:steps_total``,
``jaxpar:step_seconds_total``, the token counters), read before and after a workload.

The breakdown (:func:`breakdown`), over the workload's wall time:

* decode loop: the batcher's ``decode_seconds``, the sum of the intervals from one step's
  tokens on the host to the next's (from the loop waking with work, for its first step):
  every prefill and insert run while rows decode lies inside;
* decode steps: their count and time (the decode loop less the prefills and inserts in
  it: device time and the host's work around each step), ms per step, and the rows that
  did useful work per step (tokens generated after the first of each request / steps);
* prefill: batches, chunks of long prompts, their time (batch built to first tokens on
  the host), prompt tokens computed (prompt tokens less cached ones) and tokens per
  second of prefill time;
* inserts: host time dispatching prefilled rows into the decode cache;
* outside the decode loop: wall time less the decode loop (the server idle, waiting for
  arrivals, or the client's own gaps);
* padding (``jaxpar:step_tokens_total`` against ``jaxpar:step_tokens_computed_total``, and
  ``jaxpar:kv_positions_live_total`` against ``jaxpar:kv_positions_read_total``): the
  share of a decode step's rows that were padding (its row bucket against the live
  rows), the share of the block-table positions it read past the rows' ends, and the share
  of prefill tokens that were padding (row and token buckets against the prompts' tokens).

What the counters do not hold: device time apart from the host's inside a step.
"""

from __future__ import annotations

from typing import Any

#: ``BatcherStats`` fields the breakdown reads.
STATS = ("decode_steps", "decode_seconds", "prefill_seconds", "prefill_batches", "insert_seconds",
         "prefill_chunks", "prefix_hits", "preemptions")  # fmt: skip
#: ``/metrics`` samples the breakdown reads.
METRICS = ("jaxpar:generation_tokens_total", "jaxpar:prompt_tokens_total",
           "jaxpar:prompt_tokens_cached_total", "jaxpar:request_success_total")  # fmt: skip


def parse_phases(text: str) -> dict[str, float]:
    """Prometheus text: ``name`` (or ``name{phase}`` for samples with a phase label) -> the
    sum over the other labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            phase = sample.labels.get("phase")
            key = f"{sample.name}{{{phase}}}" if phase else sample.name
            out[key] = out.get(key, 0.0) + float(sample.value)
    return out


class Probe:
    """Reads a ``jaxpar serve``'s counters (``server``: a ``_bench_served.Server``)."""

    def __init__(self, server):
        self.server = server

    def read(self) -> dict[str, float]:
        import httpx

        health = httpx.get(f"{self.server.url}/health", timeout=10).json()
        text = httpx.get(f"{self.server.url}/metrics", timeout=10).text
        stats = health.get("stats", {})
        return {**{k: float(stats.get(k, 0)) for k in STATS}, **parse_phases(text)}

    def wait_idle(self) -> None:
        self.server.wait_idle()

    @staticmethod
    def delta(before: dict, after: dict, seconds: float) -> dict[str, Any]:
        d = {k: after[k] - before.get(k, 0.0) for k in after}
        return breakdown(d, seconds)


def breakdown(d: dict[str, float], wall_s: float) -> dict[str, Any]:
    """The counters' growth ``d`` over ``wall_s`` seconds as the module docstring's figures."""
    steps = d.get("decode_steps", 0.0)
    finished = d.get("jaxpar:request_success_total", 0.0)
    decode_tokens = d.get("jaxpar:generation_tokens_total", 0.0) - finished
    prompt = d.get("jaxpar:prompt_tokens_total", 0.0)
    computed = prompt - d.get("jaxpar:prompt_tokens_cached_total", 0.0)
    loop_s, prefill_s = d.get("decode_seconds", 0.0), d.get("prefill_seconds", 0.0)
    insert_s = d.get("insert_seconds", 0.0)
    decode_s = max(loop_s - prefill_s - insert_s, 0.0)
    return {
        "wall_s": wall_s,
        "decode_loop_s": loop_s,
        "decode_steps": int(steps),
        "decode_s": decode_s,
        "decode_ms_per_step": 1e3 * decode_s / steps if steps else float("nan"),
        "useful_rows_per_step": decode_tokens / steps if steps else float("nan"),
        "decode_ms_per_token": 1e3 * decode_s / decode_tokens if decode_tokens else float("nan"),
        "prefill_batches": int(d.get("prefill_batches", 0.0)),
        "prefill_chunks": int(d.get("prefill_chunks", 0.0)),
        "prefill_s": prefill_s,
        "prompt_tokens_computed": int(computed),
        "prefill_tokens_per_s": computed / prefill_s if prefill_s else float("nan"),
        "insert_s": insert_s,
        "outside_loop_s": wall_s - loop_s,
        "preemptions": int(d.get("preemptions", 0.0)),
        "decode_padded_rows": _padding(d, "decode"),
        "decode_kv_past_rows": _kv_past_rows(d),
        "prefill_padded_tokens": _padding(d, "prefill"),
    }


def _padding(d: dict[str, float], phase: str) -> float:
    """Share of the tokens ``phase``'s compiled steps computed that were padding."""
    computed = d.get(f"jaxpar:step_tokens_computed_total{{{phase}}}", 0.0)
    real = d.get(f"jaxpar:step_tokens_total{{{phase}}}", 0.0)
    return 1.0 - real / computed if computed else float("nan")


def _kv_past_rows(d: dict[str, float]) -> float:
    """Share of the KV positions decode steps read past the rows' ends (block-table width)."""
    read = d.get("jaxpar:kv_positions_read_total{decode}", 0.0)
    live = d.get("jaxpar:kv_positions_live_total{decode}", 0.0)
    return 1.0 - live / read if read else float("nan")


def markdown(profiles: dict[str, dict[str, Any]]) -> list[str]:
    """One row per workload."""
    lines = [
        "| workload | wall s | decode loop s | decode steps | steps s | ms/step | useful "
        "rows/step | ms/token | prefill batches (chunks) | prefill s | prompt tokens computed "
        "| prefill tok/s | inserts s | outside the loop s | decode rows padded | decode KV "
        "read past rows | prefill tokens padded |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in profiles.items():
        lines.append(
            f"| {name} | {p['wall_s']:.1f} | {p['decode_loop_s']:.1f} | {p['decode_steps']} | "
            f"{p['decode_s']:.1f} | "
            f"{p['decode_ms_per_step']:.1f} | {p['useful_rows_per_step']:.1f} | "
            f"{p['decode_ms_per_token']:.1f} | {p['prefill_batches']} ({p['prefill_chunks']}) | "
            f"{p['prefill_s']:.1f} | {p['prompt_tokens_computed']} | "
            f"{p['prefill_tokens_per_s']:.0f} | {p['insert_s']:.2f} | {p['outside_loop_s']:.1f} | "
            f"{_pct(p.get('decode_padded_rows'))} | {_pct(p.get('decode_kv_past_rows'))} | "
            f"{_pct(p.get('prefill_padded_tokens'))} |"
        )
    return lines


def _pct(x: float | None) -> str:
    return "-" if x is None or x != x else f"{100 * x:.0f}%"
