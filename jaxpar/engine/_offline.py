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

With a grammar (structured output, :mod:`jaxpar.engine._grammar`), each row keeps a
matcher, every draw takes the rows' masks, and each step's tokens are read before the next
is dispatched (a mask follows the token before it); a row ends when its grammar does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxpar.engine._grammar import Grammar, Matcher, all_allowed, fill_masks
from jaxpar.engine._kv_budget import PAGE_SIZE, batch_shards
from jaxpar.engine._logprobs import TokenLogprob
from jaxpar.engine._pages import PagePool, PageTable
from jaxpar.engine._penalties import History
from jaxpar.engine._placement import put_global
from jaxpar.engine._sampling import RowSampling, Sampling
from jaxpar.engine._slots import FirstTokens, Inserted, SlotSteps
from jaxpar.engine._steps import Steps
from jaxpar.errors import GrammarError
from jaxpar.models import kv_windows


@dataclasses.dataclass
class OfflineCore:
    """The serving core of one engine for offline generation (built on first use): its
    steps, the rows it generates at once, the slot steps over a pool that holds every
    row at full length, and the first tokens' draw."""

    steps: Steps
    max_batch: int
    slot_steps: SlotSteps
    first_tokens: FirstTokens

    @classmethod
    def build(cls, steps: Steps, max_batch: int) -> OfflineCore:
        """The core over ``steps`` (an engine's: the run, strategy and ``max_seq_len``
        are theirs) for ``max_batch`` rows."""
        run, max_seq_len = steps.dims, steps.max_seq_len
        shards = batch_shards(steps.config, run)
        page_size = min(PAGE_SIZE, max_seq_len)
        rows_per_shard = max_batch // shards
        per_row = -(-max_seq_len // page_size)
        groups = len(kv_windows(run.config))  # a block table per KV group
        pool = PagePool(
            page_size=page_size,
            pages_per_shard=groups * rows_per_shard * per_row + 1,  # every row at max_seq_len
            shards=shards,
            rows=max_batch,
            max_seq_len=max_seq_len,
            windows=(None,) * groups,  # sized for every page: none is given back
        )
        return cls(steps, max_batch, SlotSteps(steps, run, pool), FirstTokens(steps))

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
    core: OfflineCore,
    params: Any,
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
    grammar: Grammar | None = None,
) -> Decoded:
    """Prefill, insert and decode ``n_rows`` prompts (padded rows past them are dropped)
    with the engine's placed ``params``; ``logprobs``: each token's logprob and that many
    alternatives (None: none); ``grammar``: every row's structured output (None: none)."""
    b = core.max_batch
    table = PageTable(core.pool)
    live = np.arange(b) < n_rows
    wants = live & (logprobs is not None)
    sampling_B = RowSampling.rows([sampling] * b, [seed] * b, rows=range(b), logprobs=wants)
    contexts = [(tokens_BT[i, : lengths_B[i]], ()) for i in range(b)]
    history = History.rows(contexts, live & sampling.penalized, b, core.slot_steps.history_width)
    rows = _RowGrammars(grammar, live)
    slots, first, first_lp, dropped = _prefill_into_pages(
        core, params, table, tokens_BT, lengths_B, n_rows, sampling_B, history, rows
    )
    on_prefilled()
    loop = _Loop(core, table, max_new_tokens, stop_tokens, logprobs, callback, rows, dropped)
    loop.out[live, 0] = first[live]
    _collect(loop.logprobs_B, logprobs, first_lp, first, live)
    loop.done[:] = ~live | np.isin(first, loop.stops) | (max_new_tokens == 1)
    loop.done |= rows.consume(first, live)
    if callback is not None:
        callback(0, loop.out[:, 0].copy())
    cached = np.asarray(lengths_B, np.int64).copy()  # tokens each row has cached
    loop.release[:] = ~live  # padding rows: never active (their inserts were dropped)
    pending = None  # (step index, tokens, logprobs and dropped on device)
    step = 1
    while pending is not None or (step < max_new_tokens and not loop.done.all()):
        if rows.any and pending is not None:  # the next masks follow the step in flight
            loop.read(*pending)
            pending = None
            continue
        dispatched = None
        if step < max_new_tokens and not loop.done.all():
            allowed = core.slot_steps.masks(
                rows.masks(loop.done, core.slot_steps.model_config.vocab_size)
            )
            slots, *drawn = _step(core, params, table, slots, cached, loop, allowed)
            dispatched = (step, *drawn)
            step += 1
        if pending is not None and loop.read(*pending):
            dispatched = None  # drawn after every row ended: discarded
        pending = dispatched
    return Decoded(
        loop.out,
        None if dropped is None else tuple(dropped),
        None if logprobs is None else loop.logprobs_B,
    )


class _RowGrammars:
    """The rows' matchers under one grammar (none: every method a no-op)."""

    def __init__(self, grammar: Grammar | None, live: np.ndarray):
        self.matchers: list[Matcher | None] = [
            grammar.matcher() if grammar is not None and is_live else None for is_live in live
        ]
        self.any = grammar is not None

    def masks(self, done: np.ndarray, vocab: int) -> np.ndarray | None:
        """``int32 [B, words]`` masks of the rows still running (None: no grammar)."""
        if not self.any:
            return None
        mask_BW = all_allowed(len(self.matchers), vocab)
        fill_masks([(m, i) for i, m in enumerate(self.matchers) if m and not done[i]], mask_BW)
        return mask_BW

    def consume(self, tokens_B: np.ndarray, rows_B: np.ndarray) -> np.ndarray:
        """Advances the matchers of ``rows_B`` past their tokens; the rows whose grammar
        has ended."""
        ended = np.zeros(len(self.matchers), bool)
        for row in np.nonzero(rows_B)[0]:
            matcher = self.matchers[row]
            if matcher is None:
                continue
            if not matcher.consume(int(tokens_B[row])):
                raise GrammarError(f"row {row} drew token {tokens_B[row]}: {matcher.error}")
            ended[row] = matcher.done
        return ended


class _Loop:
    """The host side of the decode loop: tokens so far, which rows are done, which to
    release at the next step."""

    def __init__(self, core, table, max_new_tokens, stop_tokens, top, callback, rows, dropped):
        b = core.max_batch
        self.steps, self.table, self.max_new_tokens = core.steps, table, max_new_tokens
        self.top, self.callback, self.rows, self.dropped = top, callback, rows, dropped
        self.stops = np.asarray(list(stop_tokens), np.int32)
        self.out = np.full((b, max_new_tokens), -1, np.int32)
        self.logprobs_B: list[list[TokenLogprob]] = [[] for _ in range(b)]
        self.done = np.zeros(b, bool)
        self.release = np.zeros(b, bool)

    def read(self, i: int, next_B, step_lp, step_dropped) -> bool:
        """Takes step ``i``'s tokens for the rows still running; True once all are done."""
        host = self.steps.host_batch(next_B)
        fresh = ~self.done
        self.out[fresh, i] = host[fresh]
        _collect(self.logprobs_B, self.top, step_lp, host, fresh)
        if self.dropped is not None and fresh.any():
            self.dropped.append(int(np.asarray(step_dropped)))
        if self.callback is not None:
            self.callback(i, self.out[:, i].copy())
        finished = fresh & (np.isin(host, self.stops) | (i + 1 >= self.max_new_tokens))
        finished |= self.rows.consume(host, fresh & ~finished)
        for row in np.nonzero(finished)[0]:
            self.table.release(row)
        self.release |= finished
        self.done |= finished
        return bool(self.done.all())


def _collect(logprobs_B, top: int | None, step_lp, tokens_B: np.ndarray, rows_B: np.ndarray):
    """Appends the entries of ``rows_B`` of one step's logprobs (read back only when
    asked for, ``top`` alternatives each) to their rows' lists."""
    if top is None:
        return
    host = step_lp.host()
    for row in np.nonzero(rows_B)[0]:
        logprobs_B[row].append(host.entry(row, tokens_B[row], top))


def _prefill_into_pages(
    core, params, table, tokens_BT, lengths_B, n_rows, sampling_B, history, rows: _RowGrammars
):
    """Prefills the prompts, draws their first tokens (step 0) and writes their K/V into
    pages of rows ``0..n_rows-1``; returns the slots, the first tokens on the host, their
    logprobs (on device), and the prefill's dropped MoE assignments as a list (None when
    dropless)."""
    steps, b = core.steps, core.max_batch
    lay = steps.layouts
    lengths = put_global(np.asarray(lengths_B, np.int32), lay.lengths_prefill_B)
    tokens = put_global(np.asarray(tokens_BT, np.int32), lay.tokens_BT)
    logits_BV, k, v = steps.prefill(params, tokens, lengths)
    dropped = [int(steps.last_dropped["prefill"])] if steps.counts_drops else None
    allowed = rows.masks(np.zeros(b, bool), logits_BV.shape[-1])
    first_B, first_lp = core.first_tokens(
        logits_BV, sampling_B, history=history, allowed_PW=allowed
    )
    slot_B = np.where(np.arange(b) < n_rows, np.arange(b), b).astype(np.int32)
    n_pages = core.pool.pages_for(tokens_BT.shape[1])
    pages_BN = np.full((b, *core.pool.ids_shape(n_pages)), core.pool.pages, np.int32)
    for row in range(n_rows):
        table.grow(row, int(lengths_B[row]) + 1)
        pages_BN[row] = table.global_ids(row, n_pages)
    new = Inserted(k=k, v=v, lengths_P=lengths, first_P=first_B)
    rows = core.slot_steps
    zeros = np.zeros(b, np.int32)
    slots = rows.insert(rows.empty(), new, slot_B, pages_BN, zeros, sampling_B, history=history)
    return slots, steps.host_batch(first_B), first_lp, dropped


def _step(core, params, table, slots, cached, loop: _Loop, allowed):
    """Dispatches one step for the rows not known to be done (pages for their next token
    first), releasing the rows ``loop`` says; ``cached`` counts it."""
    done = loop.done
    running = np.nonzero(~done)[0]
    for row in running:
        table.grow(row, int(cached[row]) + 1)
    width = table.width(int(cached[running].max()) + 1)
    rows = core.slot_steps.rows_for(~done)
    tables = core.slot_steps.tables(table.step_tables(width), rows)
    out = core.slot_steps.step(params, slots, loop.release.copy(), tables, allowed)
    loop.release[:] = False
    cached[running] += 1
    return out
