"""The runner: a scheduler's plans turned into the executor's commands, and tokens back.

:class:`Runner` executes what :class:`~jaxpar.engine._scheduler.Scheduler` decided,
through the recordable :class:`~jaxpar.engine._executor.Executor` (so a multi-process
job replays it): a :class:`~jaxpar.engine._scheduler.PrefillPlan` becomes a prefill (the
chunks' tokens padded to the plan's buckets, each request's sampling row, penalty
history, first-token masks, and the pages of its cached context), then the first
tokens' draw, sent to their clients at once, then the insert of its K/V into its rows'
pages (:meth:`~Runner.insert`); a :class:`~jaxpar.engine._scheduler.DecodePlan` becomes
a decode step (the block tables of the rows it computes, placed only when they change,
and the grammar masks of the rows that have one), whose tokens and logprobs
:meth:`~Runner.deliver` streams to the requests that held the rows when it ran.

Structured output: a request with a grammar draws every token under its row's token
mask, an input of the first-token draw and of the decode step (every bit set in the
other rows: nothing recompiles). The masks are host arrays in the executor's commands,
so in a multi-process job they reach every process with the step that uses them.

Disaggregated: a finished prefill's K/V is made whole from its first token
(:meth:`~Runner.whole`: read back from the prefill group's pages when it had context)
before it moves to the decode devices.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxpar.engine._cache import CacheManager
from jaxpar.engine._decode_groups import group_rows, group_tables
from jaxpar.engine._efficiency import StepLog
from jaxpar.engine._engine import InferenceEngine
from jaxpar.engine._executor import DECODE, Executor
from jaxpar.engine._grammar import all_allowed, fill_masks
from jaxpar.engine._host_tier import OFFLOAD
from jaxpar.engine._logprobs import Logprobs
from jaxpar.engine._penalties import History
from jaxpar.engine._requests import Request, RequestStream
from jaxpar.engine._sampling import RowSampling
from jaxpar.engine._scheduler import DecodePlan, PrefillPlan
from jaxpar.engine._slots import SlotSteps


@dataclasses.dataclass
class BatcherStats:
    """Counters since start (read them while it runs; they only grow)."""

    submitted: int = 0
    finished: int = 0
    decode_steps: int = 0
    prefill_batches: int = 0
    transfer_bytes: int = 0  # prefill -> decode devices (disaggregated only)
    transfers: int = 0
    decode_seconds: float = 0.0  # wall time from one step's tokens on the host to the next's
    prefill_seconds: float = 0.0  # wall time in prefill, first tokens, transfer
    insert_seconds: float = 0.0  # wall time dispatching inserts
    moe_dropped: int = 0  # expert assignments dropped (capacity-limited MoE), prefill + decode
    preemptions: int = 0  # running requests whose pages were taken back (recomputed later)
    prefix_queries: int = 0  # context tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found cached (not computed)
    prompt_tokens_cached: int = 0  # requests' prompt tokens served from the cache
    prefill_chunks: int = 0  # chunks of long prompts prefilled (the last one included)
    # Pipelined decode (pp > 1): stage-iterations dispatched, and those a stage idled
    # (pipeline fill and drain, or a group with no live row).
    stage_iterations: int = 0
    idle_stage_iterations: int = 0

    @property
    def bubble_fraction(self) -> float:
        """The share of pipelined decode's stage-iterations spent idle (0 unpipelined)."""
        return self.idle_stage_iterations / self.stage_iterations if self.stage_iterations else 0.0


@dataclasses.dataclass
class Prefilled:
    """A prefill that ran: its results are the executor's batch ``handle`` (``shape``:
    its rows and tokens).

    ``streams[i]`` is row i's request, or None once it finished at its first token;
    ``rows[i]`` the row whose pages it writes (None: not placed yet, or finished)."""

    streams: list[RequestStream | None]
    handle: int
    shape: tuple[int, int]
    sampling_P: RowSampling
    contexts: list[int]  # tokens each row has cached after this prefill
    steps_P: np.ndarray  # tokens each row had drawn before its prefill (preempted: > 0)
    rows: list[int | None]
    starts_P: np.ndarray  # tokens each row had cached before this prefill (page-aligned)
    final: bool = True
    history: History | None = None  # each row's context, for its penalties (None: none)

    @property
    def live(self) -> list[tuple[int, RequestStream]]:
        return [(i, s) for i, s in enumerate(self.streams) if s is not None]


class Runner:
    """Runs plans on one batcher's executor; counts into its stats under its lock.

    Args:
        executor: dispatches the programs.
        engine: decode's engine; ``prefill_engine``: prefill's (the same colocated).
        slot_steps: the decode rows' programs.
        stats: the batcher's counters; ``lock``: the batcher's condition, held to count
            finished requests (and notified).
        step_log: each step's shape facts and time.
    """

    def __init__(
        self,
        executor: Executor,
        engine: InferenceEngine,
        prefill_engine: InferenceEngine,
        slot_steps: SlotSteps,
        stats: BatcherStats,
        lock: threading.Condition,
        step_log: StepLog,
    ):
        self.executor = executor
        self.engine = engine
        self.prefill_engine = prefill_engine
        self.slot_steps = slot_steps
        self.stats = stats
        self._lock = lock
        self.step_log = step_log
        self._tables: tuple[int, ...] | None = None  # (version, width, rows) last placed
        self._loop_started = self._last_read = 0.0  # for BatcherStats.decode_seconds

    def _count_dropped(self, dropped: int) -> None:
        if dropped:
            with self._lock:
                self.stats.moe_dropped += dropped

    # --- prefill -------------------------------------------------------------------------

    def prefill(self, plan: PrefillPlan, cache: CacheManager, side: str) -> Prefilled:
        """Runs ``plan``'s prefill on ``side``'s pages (``cache``) and, if it completes its
        requests, draws their first tokens (sent to the clients at once). A request with
        cached tokens attends to them, read from its pages; a preempted request draws its
        next token at its own sampling step."""
        start = time.perf_counter()
        self.move_pages(cache, side)  # before the context is read and pages written
        rows, length, chunks = plan.rows, plan.length, plan.chunks
        streams = [c.request for c in chunks]
        steps_P = np.zeros(rows, np.int32)
        steps_P[: len(chunks)] = [len(s.tokens) for s in streams]
        starts_P = np.zeros(rows, np.int32)
        starts_P[: len(chunks)] = [c.start for c in chunks]
        tokens_PT = np.zeros((rows, length), np.int32)
        lengths_P = np.ones(rows, np.int32)
        for i, chunk in enumerate(chunks):
            tokens_PT[i, : len(chunk.tokens)] = chunk.tokens
            lengths_P[i] = len(chunk.tokens)
        requests = [s.request for s in streams]
        requests += [requests[0]] * (rows - len(streams))
        wants = [r.logprobs is not None for r in requests[: len(streams)]]
        sampling_P = RowSampling.rows(
            [r.sampling for r in requests],
            [r.seed for r in requests],
            logprobs=wants + [False] * (rows - len(streams)),
        )
        history = _history(streams, rows, self.slot_steps.pool.max_seq_len)  # the longest request
        context = plan.with_context
        pages_PN = None
        if context:
            pages_PN = cache.context_pages([c.row for c in chunks], [c.start for c in chunks], rows)
        handle = self.executor.prefill(
            tokens_PT,
            lengths_P,
            side=side,
            final=plan.final,
            sampling_P=sampling_P,
            steps_P=steps_P,
            history=history,
            starts_P=starts_P if context else None,
            pages_PN=pages_PN,
            allowed_PW=self._first_masks(streams, rows) if plan.final else None,
        )
        live: list[RequestStream | None] = list(streams)
        if plan.final:
            out = self.executor.tokens(handle, logprobs=any(wants))
            self.stats.prefill_batches += 1
            live = [
                self._first(s, int(t), _logprob(out.logprobs, i, int(t), s.request))
                for i, (s, t) in enumerate(zip(streams, out.tokens, strict=False))
            ]
            dropped = out.dropped
        else:
            counts = self.prefill_engine.steps.counts_drops
            dropped = self.executor.dropped(handle) if counts else 0
        self._count_dropped(dropped)
        if plan.chunked:
            self.stats.prefill_chunks += 1
        took = time.perf_counter() - start
        self.stats.prefill_seconds += took
        takes = [len(c.tokens) for c in chunks]
        starts = [c.start for c in chunks]
        self.step_log.prefill_done(takes, starts, took, final=plan.final, shape=(rows, length))
        return Prefilled(
            live,
            handle,
            (rows, length),
            sampling_P,
            [c.end for c in chunks],
            steps_P,
            [c.row for c in chunks],
            starts_P,
            plan.final,
            history,
        )

    def _first_masks(self, streams: list[RequestStream], rows: int) -> np.ndarray | None:
        """The token masks of a prefill's first tokens (None: no request has a grammar)."""
        if not constrained(streams):
            return None
        vocab = self.prefill_engine.program.run.vocab_size  # the logits' (padded)
        return masks(streams, rows, vocab)

    def _first(self, stream: RequestStream, token: int, logprob) -> RequestStream | None:
        """Sends a request its first token; None if that finished it."""
        return stream if stream.emit(token, logprob) is None else None

    def insert(
        self,
        batch: Prefilled,
        cache: CacheManager,
        side: str,
        slots: Sequence[int | None],
        *,
        keep: bool = False,
    ) -> None:
        """Writes a prefill's K/V into its rows' pages on ``side`` (``cache``'s), from where
        each row's cache ends; ``slots[i]``: the decode row that starts decoding row
        ``i``'s request (None: none). ``keep``: the batch stays with the executor (to
        move to the decode devices)."""
        pool = cache.pool
        rows = batch.shape[0]  # the row bucket: padding rows are dropped
        n_pages = pool.pages_for(batch.shape[1])
        slot_P = np.full(rows, pool.rows, np.int32)
        pages_PN = np.full((rows, *pool.ids_shape(n_pages)), pool.pages, np.int32)
        for i, row in enumerate(batch.rows):
            if row is None:  # disaggregated: finished at its first token, never placed
                continue
            first = int(batch.starts_P[i]) // pool.page_size
            pages_PN[i] = cache.global_ids(row, n_pages, first)
            if slots[i] is not None:
                slot_P[i] = slots[i]
        if (pages_PN < pool.pages).any():
            start = time.perf_counter()
            self.executor.insert(
                batch.handle,
                slot_P,
                pages_PN,
                side=side,
                steps_P=batch.steps_P,
                sampling_P=batch.sampling_P,
                starts_P=batch.starts_P,
                history=batch.history,
                keep=keep,
            )
            self.stats.insert_seconds += time.perf_counter() - start
        elif not keep:
            self.executor.drop(batch.handle)

    def whole(self, batch: Prefilled, cache: CacheManager) -> tuple[int, int]:
        """Disaggregated: makes a finished prefill's K/V whole from the first token on: its
        own if it cached nothing before, else read back from the prefill group's pages
        (context and new tokens). Returns its (rows, tokens)."""
        if not batch.starts_P.any():
            return batch.shape
        rows = batch.shape[0]
        length = self.prefill_engine.bucket(max(batch.contexts))
        n = cache.pool.pages_for(length)
        pages_PN = np.full((rows, *cache.pool.ids_shape(n)), cache.pool.pages, np.int32)
        lengths_P = np.ones(rows, np.int32)
        for i, row in enumerate(batch.rows):
            pages_PN[i] = cache.global_ids(row, n)
            lengths_P[i] = batch.contexts[i]
        self.executor.read_back(batch.handle, pages_PN, lengths_P, length)
        return rows, length

    def move_pages(self, cache: CacheManager, side: str) -> None:
        """Dispatches the host tier's copies queued since the last call, in order: pages
        evicted to the host (before anything writes them) and hits copied back (before
        the prefill reads them)."""
        if cache.host is None:
            return
        with self._lock:
            moves = cache.host.take_moves()
        for move in moves:
            if move.kind == OFFLOAD:
                self.executor.offload(move.pages, move.slots, side=side)
            else:
                self.executor.restore(move.slots, move.pages, side=side)

    # --- decode --------------------------------------------------------------------------

    def step(self, plan: DecodePlan, owners: Sequence, cache: CacheManager) -> int:
        """Dispatches a decode step over ``plan``'s rows; returns its handle."""
        self.move_pages(cache, DECODE)  # before the step writes pages evicted for it
        allowed = None
        if constrained(owners):
            allowed = masks(owners, len(owners), self.engine.program.run.vocab_size)
        if plan.groups is not None:  # split by width (jaxpar.engine._decode_groups)
            return self._step_groups(plan, cache, allowed)
        live = np.array(plan.live)
        width = cache.width(plan.longest)
        rows = self.slot_steps.rows_for(live)
        key = (cache.version, width, rows)
        tables = None  # placed again only when they change
        if self._tables != key:
            self._tables = key
            tables = self.slot_steps.table_rows(cache.step_tables(width), rows)
        handle = self.executor.step(np.array(plan.released), tables, allowed)
        pipeline = self.slot_steps.pipeline
        if pipeline is not None:
            total, idle = pipeline.stage_iterations(live, rows)
            self.stats.stage_iterations += total
            self.stats.idle_stage_iterations += idle
        lengths = [n for n, b in zip(plan.lengths, plan.live, strict=True) if b]
        self.step_log.decode_dispatched(lengths, width * cache.page_size, rows)
        return handle

    def _step_groups(self, plan: DecodePlan, cache: CacheManager, allowed) -> int:
        """Dispatches a decode step split into ``plan.groups``, each at its own width."""
        shards, z = cache.pool.shards, cache.page_size
        groups, widths, computed = [], [0] * len(plan.live), 0
        for group in plan.groups:
            rows_R = group_rows(group, len(plan.live), shards)
            groups.append((rows_R, group_tables(cache.step_tables(group.width), rows_R)))
            computed += group.computed * shards
            for row in group.rows:
                widths[row] = group.width * z
        handle = self.executor.step(np.array(plan.released), None, allowed, groups=tuple(groups))
        live = [i for i, b in enumerate(plan.live) if b]
        lengths = [plan.lengths[i] for i in live]
        self.step_log.decode_dispatched(lengths, [widths[i] for i in live], computed)
        return handle

    def loop_started(self) -> None:
        """The decode loop woke up with work (its waiting is not decode time)."""
        self._loop_started = time.perf_counter()

    def deliver(
        self, handle: int, holders: Sequence, owners: Sequence, ended: Callable[[int], None]
    ) -> None:
        """Streams one step's tokens (and logprobs, read only if some request asked) to the
        requests that held the rows when it ran; calls ``ended(row)`` as soon as a row's
        request ends (to free it)."""
        asked = any(s is not None and s.request.logprobs is not None for s in holders)
        out = self.executor.tokens(handle, logprobs=asked)
        tokens_B, host_lp = out.tokens, out.logprobs
        self._count_dropped(out.dropped)
        now = time.perf_counter()
        self.stats.decode_steps += 1
        since = max(self._last_read, self._loop_started)
        self.stats.decode_seconds += now - since
        self.step_log.decode_delivered(since, now)
        self._last_read = now
        for i, stream in enumerate(holders):
            if stream is None or stream.done or owners[i] is not stream:
                continue  # ended, or preempted after this step (its token is drawn again)
            token = int(tokens_B[i])
            if stream.emit(token, _logprob(host_lp, i, token, stream.request)) is not None:
                ended(i)


def constrained(streams: Sequence[RequestStream | None]) -> bool:
    """Some request has a grammar."""
    return any(s is not None and s.matcher is not None for s in streams)


def masks(streams: Sequence[RequestStream | None], rows: int, vocab: int) -> np.ndarray:
    """``int32 [rows, ceil(vocab / 32)]``: each stream's next-token mask from its grammar's
    state, every bit set for rows without one (and padding rows past ``streams``)."""
    mask_BW = all_allowed(rows, vocab)
    fill_masks(
        [(s.matcher, i) for i, s in enumerate(streams) if s is not None and s.matcher], mask_BW
    )
    return mask_BW


def _history(streams: list[RequestStream], rows: int, width: int) -> History | None:
    """The contexts of a prefill's requests (``rows``: with its padding rows), for their
    penalties: each prompt, and what it drew before a preemption; None when no request
    is penalised (nothing to send)."""
    if not any(s.request.sampling.penalized for s in streams):
        return None
    contexts = [(s.request.prompt, s.tokens) for s in streams] + [((), ())] * (rows - len(streams))
    penalized = [s.request.sampling.penalized for s in streams] + [False] * (rows - len(streams))
    return History.rows(contexts, penalized, rows, width)


def _logprob(host: Logprobs | None, row: int, token: int, request: Request):
    """Row ``row``'s entry of a step's logprobs on the host, if its request asked."""
    if host is None or request.logprobs is None:
        return None
    return host.entry(row, token, request.logprobs)
