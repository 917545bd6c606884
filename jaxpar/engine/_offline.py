"""``InferenceEngine.generate`` on the serving core: the same pages, step and sampler.

Offline generation is continuous batching with every request admitted at once: the
prompts are prefilled together, their first tokens drawn by :class:`FirstTokens`, their
K/V written into pages by :meth:`SlotSteps.insert`, and then :meth:`SlotSteps.step` runs
until every row has stopped, each finished row released (its pages freed) as the host
learns of it. The pool holds every row at ``max_seq_len``, so nothing is ever preempted.

Rows sample with the caller's seed and their own row index (``RowSampling.row_B``): the
tokens of ``generate(prompts, seed=s)`` are those of the batch-wide sampler at each step,
on any mesh. Step ``i + 1`` is dispatched before step ``i``'s tokens are read, so the
host's reading and stop checks overlap the device; the one step drawn after the last row
finishes is discarded. Every process runs the same loop on the same host values (tokens
are read on every process), so it works under ``jax.distributed`` too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxpar.engine._kv_budget import PAGE_SIZE, batch_shards
from jaxpar.engine._logprobs import TokenLogprob
from jaxpar.engine._pages import PagePool, PageTable
from jaxpar.engine._penalties import History
from jaxpar.engine._placement import put_global
from jaxpar.engine._sampling import RowSampling, Sampling
from jaxpar.engine._slots import FirstTokens, Inserted, SlotSteps

if TYPE_CHECKING:
    from jaxpar.engine._engine import InferenceEngine


@dataclasses.dataclass
class OfflineCore:
    """The serving core of one engine for offline generation (built on first use)."""

    slot_steps: SlotSteps
    first_tokens: FirstTokens

    @classmethod
    def build(cls, engine: InferenceEngine) -> OfflineCore:
        program = engine.program
        shards = batch_shards(engine.parallel_config, program.model_config)
        page_size = min(PAGE_SIZE, engine.max_seq_len)
        rows_per_shard = engine.max_batch // shards
        per_row = -(-engine.max_seq_len // page_size)
        pool = PagePool(
            page_size=page_size,
            pages_per_shard=rows_per_shard * per_row + 1,  # every row at max_seq_len
            shards=shards,
            rows=engine.max_batch,
            max_seq_len=engine.max_seq_len,
        )
        return cls(SlotSteps(engine.steps, program.model_config, pool), FirstTokens(engine.steps))

    @property
    def pool(self) -> PagePool:
        return self.slot_steps.pool

    def widths(self, tokens: int) -> list[int]:
        """The block-table widths steps over rows of up to ``tokens`` tokens use."""
        table = PageTable(self.pool)
        return sorted({table.width(t) for t in range(1, tokens + 1)})


@dataclasses.dataclass
class Decoded:
    """What the loop returns: tokens per row (``-1`` past a row's end), the dropped MoE
    assignments of the prefill and of each decode step (None when dropless), and each
    row's tokens' logprobs (None unless asked for)."""

    tokens_BN: np.ndarray
    dropped: tuple[int, ...] | None
    logprobs: list[list[TokenLogprob]] | None = None


def decode_offline(
    engine: InferenceEngine,
    core: OfflineCore,
    tokens_BT: np.ndarray,
    lengths_B: np.ndarray,
    n_rows: int,
    max_new_tokens: int,
    sampling: Sampling,
    seed: int,
    stop_tokens: Sequence[int],
    callback: Callable[[int, np.ndarray], None] | None,
    on_prefilled: Callable[[], None] = lambda: None,
    logprobs: int | None = None,
) -> Decoded:
    """Prefill, insert and decode ``n_rows`` prompts (padded rows past them are dropped);
    ``logprobs``: each token's logprob and that many alternatives (None: none)."""
    b = engine.max_batch
    table = PageTable(core.pool)
    live = np.arange(b) < n_rows
    wants = live & (logprobs is not None)
    sampling_B = RowSampling.rows([sampling] * b, [seed] * b, rows=range(b), logprobs=wants)
    contexts = [(tokens_BT[i, : lengths_B[i]], ()) for i in range(b)]
    history = History.rows(contexts, live & sampling.penalized, b, core.slot_steps.history_width)
    slots, first, first_lp, dropped = _prefill_into_pages(
        engine, core, table, tokens_BT, lengths_B, n_rows, sampling_B, history
    )
    on_prefilled()
    out = np.full((b, max_new_tokens), -1, np.int32)
    logprobs_B: list[list[TokenLogprob]] = [[] for _ in range(b)]
    stops = np.asarray(list(stop_tokens), np.int32)
    out[live, 0] = first[live]
    _collect(logprobs_B, logprobs, first_lp, first, live)
    done = ~live | np.isin(first, stops) | (max_new_tokens == 1)
    if callback is not None:
        callback(0, out[:, 0].copy())
    cached = np.asarray(lengths_B, np.int64).copy()  # tokens each row has cached
    release = ~live  # padding rows: never active (their inserts were dropped)
    pending = None  # (step index, tokens, logprobs and dropped on device)
    step = 1
    while pending is not None or (step < max_new_tokens and not done.all()):
        dispatched = None
        if step < max_new_tokens and not done.all():
            slots, *drawn = _step(engine, core, table, slots, cached, done, release)
            release = np.zeros(b, bool)
            dispatched = (step, *drawn)
            step += 1
        if pending is not None:
            i, next_B, step_lp, step_dropped = pending
            host = engine.steps.host_batch(next_B)
            fresh = ~done
            out[fresh, i] = host[fresh]
            _collect(logprobs_B, logprobs, step_lp, host, fresh)
            if dropped is not None and fresh.any():
                dropped.append(int(np.asarray(step_dropped)))
            if callback is not None:
                callback(i, out[:, i].copy())
            finished = fresh & (np.isin(host, stops) | (i + 1 >= max_new_tokens))
            for row in np.nonzero(finished)[0]:
                table.release(row)
            release |= finished
            done |= finished
            if done.all():
                dispatched = None  # drawn after every row ended: discarded
        pending = dispatched
    return Decoded(
        out,
        None if dropped is None else tuple(dropped),
        None if logprobs is None else logprobs_B,
    )


def _collect(logprobs_B, top: int | None, step_lp, tokens_B: np.ndarray, rows_B: np.ndarray):
    """Appends the entries of ``rows_B`` of one step's logprobs (read back only when
    asked for, ``top`` alternatives each) to their rows' lists."""
    if top is None:
        return
    host = step_lp.host()
    for row in np.nonzero(rows_B)[0]:
        logprobs_B[row].append(host.entry(row, tokens_B[row], top))


def _prefill_into_pages(engine, core, table, tokens_BT, lengths_B, n_rows, sampling_B, history):
    """Prefills the prompts, draws their first tokens (step 0) and writes their K/V into
    pages of rows ``0..n_rows-1``; returns the slots, the first tokens on the host, their
    logprobs (on device), and the prefill's dropped MoE assignments as a list (None when
    dropless)."""
    steps, lay, b = engine.steps, engine.layouts, engine.max_batch
    lengths = put_global(np.asarray(lengths_B, np.int32), lay.lengths_prefill_B)
    tokens = put_global(np.asarray(tokens_BT, np.int32), lay.tokens_BT)
    logits_BV, k, v = steps.prefill(engine.params, tokens, lengths)
    dropped = [int(steps.last_dropped["prefill"])] if steps.counts_drops else None
    first_B, first_lp = core.first_tokens(logits_BV, sampling_B, history=history)
    slot_B = np.where(np.arange(b) < n_rows, np.arange(b), b).astype(np.int32)
    n_pages = core.pool.pages_for(tokens_BT.shape[1])
    pages_BN = np.full((b, n_pages), core.pool.pages, np.int32)
    for row in range(n_rows):
        table.grow(row, int(lengths_B[row]) + 1)
        pages_BN[row] = table.global_ids(row, n_pages)
    new = Inserted(k=k, v=v, lengths_P=lengths, first_P=first_B)
    rows = core.slot_steps
    zeros = np.zeros(b, np.int32)
    slots = rows.insert(rows.empty(), new, slot_B, pages_BN, zeros, sampling_B, history=history)
    return slots, steps.host_batch(first_B), first_lp, dropped


def _step(engine, core, table, slots, cached, done, release):
    """Dispatches one step for the rows not known to be done (pages for their next token
    first); ``cached`` counts it."""
    running = np.nonzero(~done)[0]
    for row in running:
        table.grow(row, int(cached[row]) + 1)
    width = table.width(int(cached[running].max()) + 1)
    rows = core.slot_steps.rows_for(~done)
    tables = core.slot_steps.tables(table.tables_BN[:, :width], rows)
    out = core.slot_steps.step(engine.params, slots, release, tables)
    cached[running] += 1
    return out
