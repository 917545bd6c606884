"""Planning for a server (``jaxpar serve``): latency bounds, the prefill batch, serve flags.

The serving model (what :class:`jaxpar.engine.ContinuousBatcher` does, in steady state):

* ``batch`` sequences (the server's slots, ``--max-num-seqs``) decode together; new prompts
  are prefilled ``prefill_batch`` at a time (``--prefill-batch``; ``--max-prefill-tokens``
  = one such step's padded tokens, so no prompt is chunked). Colocated, one prefill step
  runs between two decode steps; disaggregated, the prefill group prefills while the
  decode group decodes, and each prefilled batch's K/V moves once.
* Time to first token (TTFT) = the prefill step of ``prefill_batch`` prompts, plus
  (colocated) the decode step it waits for, or (disaggregated) the K/V transfer.
* Time per output token (TPOT) = the decode step at ``batch``, plus (colocated) the mean
  prefill time interleaved per decode step: each step ``batch / gen_len`` requests finish
  and as many new prompts are prefilled.
* Queueing is not modelled: requests are assumed to arrive no faster than the plan serves
  them (beyond that, any server's queue, and its TTFT, grow without bound).

A plan whose TTFT or TPOT exceeds ``--max-ttft-ms`` / ``--max-tpot-ms`` is not chosen; the
prefill batch is the largest (up to the server's default, 4 per batch shard) that meets
them. A pipelined plan (``pp > 1``; across hosts, stages pass each other only activations,
where ``tp`` runs its all-reduces over the slower link and ``dp`` holds every weight on
each side of it) serves with ``pp`` decode groups and ``pp`` prefill microbatches (the
one schedule planned, which keeps the search as small as the unpipelined one's), and its
decode step is costed in steady state, every stage busy (:func:`jaxpar.plan._cost.bubble`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from jaxpar.engine import prompt_bucket
from jaxpar.errors import ConfigError
from jaxpar.models import ModelConfig
from jaxpar.plan._enumerate import Refused, Workload, check
from jaxpar.plan._hardware import Hardware
from jaxpar.plan._prediction import Prediction, predict
from jaxpar.spec import MESH_AXES, ParallelConfig, batch_multiple

#: Tokens per KV page that ``jaxpar serve`` uses by default (``--page-size``); the planned
#: ``--max-prefill-tokens`` is a whole number of them.
PAGE_SIZE = 16
#: Prompts per batch shard the server prefills together by default.
PREFILL_PER_SHARD = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bounds:
    """Latency bounds a serving plan must meet (seconds; None: unbounded)."""

    max_ttft_s: float | None = None
    max_tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name, flag in (("max_ttft_s", "--max-ttft-ms"), ("max_tpot_s", "--max-tpot-ms")):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{flag} must be > 0, got {value * 1e3:g}")

    @property
    def given(self) -> bool:
        return self.max_ttft_s is not None or self.max_tpot_s is not None

    def met(self, pred: Prediction) -> bool:
        ttft_ok = self.max_ttft_s is None or pred.ttft_s <= self.max_ttft_s
        return ttft_ok and (self.max_tpot_s is None or pred.tpot_s <= self.max_tpot_s)

    def describe(self) -> str:
        parts = []
        if self.max_ttft_s is not None:
            parts.append(f"TTFT <= {self.max_ttft_s * 1e3:g} ms")
        if self.max_tpot_s is not None:
            parts.append(f"TPOT <= {self.max_tpot_s * 1e3:g} ms")
        return " and ".join(parts)


NO_BOUNDS = Bounds()


def prefill_batches(model: ModelConfig, config: ParallelConfig, batch: int) -> Iterator[int]:
    """Prefill batches to try, largest first: the smallest legal batch of ``config``
    doubled up to the server's default (4 per batch shard), at most ``batch``."""
    step = batch_multiple(model, config)
    top = max(step, min(batch, PREFILL_PER_SHARD * step))
    sizes = [step * 2**k for k in range(64) if step * 2**k <= top]
    yield from reversed(sizes)


def prefill_workload(workload: Workload, prefill_batch: int) -> Workload:
    return dataclasses.replace(workload, prefill_batch=prefill_batch)


def served(
    model: ModelConfig,
    config: ParallelConfig,
    workload: Workload,
    hardware: Hardware,
    budget: int,
    bounds: Bounds,
) -> tuple[Prediction | None, Prediction | None]:
    """(the best serving prediction of ``config`` at ``workload.batch`` that fits and meets
    ``bounds``, the fastest-to-first-token one that fits whatever the bounds): the largest
    prefill batch meeting them wins."""
    fastest = None
    for rows in prefill_batches(model, config, workload.batch):
        pred = predict(model, config, prefill_workload(workload, rows), hardware, budget=budget)
        if not pred.fits:
            continue
        if bounds.met(pred):
            return pred, pred
        if fastest is None or pred.ttft_s < fastest.ttft_s:
            fastest = pred
    return None, fastest


def max_prefill_tokens(pred: Prediction) -> int:
    """One prefill step's padded tokens (``prefill_batch`` prompts, each padded as the
    engine pads it: :func:`jaxpar.engine.prompt_bucket`) in whole pages. The batcher then
    runs one whole prefill step between two decode steps, and its chunk (this budget over
    the prefill ``dp``, in whole pages) holds a whole prompt: no prompt is chunked."""
    w = pred.workload
    prefill = pred.prefill_config or pred.config
    padded = prompt_bucket(w.prompt_len, prefill.sp, w.max_seq_len)
    return math.ceil(w.prefill_rows * padded / PAGE_SIZE) * PAGE_SIZE


def serve_flags(pred: Prediction, source: str) -> str:
    """The ``jaxpar serve`` command line of a serving plan (``source``: ``--hf DIR`` and
    ``--quantize``): decode's degrees, ``--prefill STRATEGY`` when disaggregated, the slots,
    the KV cache the plan counted (``batch x max_seq_len`` tokens, less with sliding windows
    released: :func:`~jaxpar.engine.kv_cache_tokens_for`), the longest request and
    the prefill batch and tokens."""
    c, w = pred.config, pred.workload
    flags = [f"--{a} {c.degree(a)}" for a in MESH_AXES if c.degree(a) > 1]
    if pred.prefill_config is not None:
        flags.append(f"--prefill {pred.prefill_config}")
    flags += [
        f"--max-num-seqs {w.batch}",
        f"--kv-cache-tokens {pred.kv_tokens or w.batch * w.max_seq_len}",
        f"--max-seq-len {w.max_seq_len}",
        f"--prefill-batch {w.prefill_rows}",
        f"--max-prefill-tokens {max_prefill_tokens(pred)}",
    ]
    return f"jaxpar serve {source} {' '.join(flags)}"


def check_serving(model: ModelConfig, config: ParallelConfig, workload: Workload) -> Refused | None:
    """None when ``config`` can serve ``workload`` (legal; pipelined: ``pp`` decode groups
    and ``pp`` prefill microbatches, one per stage, so that every stage has work each
    step), else why not."""
    why = check(model, config, workload)
    if why is not None or config.pp == 1:
        return why
    if config.decode_groups == config.microbatches == config.pp:
        return None
    return Refused(
        config,
        "serve-pipeline-groups",
        f"a served pipeline splits its decode rows into pp={config.pp} groups and its "
        f"prefill into pp microbatches, one per stage, so every stage has work each step; "
        f"not decode_groups={config.decode_groups}, microbatches={config.microbatches}",
    )
