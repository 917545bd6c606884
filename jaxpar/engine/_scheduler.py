"""The continuous batcher's policy: who prefills what, who decodes, who is preempted.

:class:`Scheduler` is plain Python (no JAX, no devices): from the request queue, the
running rows and the cache manager's answers (:mod:`jaxpar.engine._cache`) it returns
step plans, frozen dataclasses that the runner (:mod:`jaxpar.engine._runner`) executes:

* :meth:`~Scheduler.schedule_prefill`: the next prefill, a :class:`PrefillPlan`. Queued
  requests are admitted in order (first come, first served; a preempted request goes
  back to the front) while a free row and the pages for their context and first new
  token fit, their padded tokens stay within the step's budget (``max_prefill_tokens``
  between two decode steps, whether or not rows decode; the step's first prefill always
  goes), and each fits one chunk. A request is
  placed in the batch shard holding the longest cached run of its prefix (then the one
  with the most free pages) and prefills only the rest. A prompt longer than a chunk is
  prefilled alone, one piece (whole pages) per plan, each continuing the ones before:
  of ``long_chunk_tokens``, or, once a :class:`~jaxpar.engine._chunk_cost.ChunkCost` is
  measured, the most new tokens (from ``min_piece_tokens`` to a chunk) whose prefill
  after the context cached so far costs no more than the budget's own
  (``max_prefill_tokens`` new tokens without context): the budget counts the attention
  over the context.
* :meth:`~Scheduler.prefilled`: after the runner ran a plan: the pages written join the
  prefix cache, and the requests it completed start decoding in their rows.
* :meth:`~Scheduler.reserve`, :meth:`~Scheduler.preempt_for_room` and
  :meth:`~Scheduler.decode_plan`: every running row's page for its next token (and,
  with a :class:`~jaxpar.engine._decode_groups.DecodeGrouping`, the step split by
  block-table width when two dispatches cost less than one); when a
  shard runs out, the request admitted last in that shard is preempted (its pages are
  freed and it goes back to the front of the queue, to be prefilled again with the
  tokens it drew) until the others fit: the oldest always fits alone, so every admitted
  request finishes.

Fairness: admission is first come, first served, and a request that does not fit yet
holds the head of the queue (a later, smaller one does not overtake it, so none waits
forever); a preempted request goes back to the front.

Requests are opaque to it (:class:`Schedulable`): anything with ``cancel_requested`` and
``context`` (the tokens its pages will hold: the prompt, and what it drew before a
preemption). It is not thread-safe: :class:`~jaxpar.engine.ContinuousBatcher` calls it
with its lock held (:mod:`jaxpar.engine._core`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from jaxpar.engine._cache import CacheManager, Hit
from jaxpar.engine._chunk_cost import ChunkCost
from jaxpar.engine._decode_groups import DecodeGroup, DecodeGrouping
from jaxpar.errors import ConfigError


class Schedulable(Protocol):
    """What the scheduler reads of a request (:class:`~jaxpar.engine.RequestStream`)."""

    @property
    def cancel_requested(self) -> bool: ...

    @property
    def context(self) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits.

    Attributes:
        prefill_batch: most requests prefilled together.
        row_buckets: prefill batch sizes (ascending, the last ``prefill_batch``); a
            prefill of ``n`` requests pads to the smallest that holds them.
        chunk_tokens: the most new tokens a prompt prefills at once (whole pages): a
            longer one is long.
        long_chunk_tokens: new tokens of each piece of a long prompt (whole pages, at
            most ``chunk_tokens``; None: ``chunk_tokens``). Smaller than a chunk, it keeps
            the streams running while a long prompt prefills from stalling for a whole
            chunk at a time (vLLM's ``long_prefill_token_threshold``).
        min_piece_tokens: the shortest piece a long prompt's prefill takes after cached
            tokens when a measured cost says a longer one exceeds the budget there (None:
            ``long_chunk_tokens``, never shorter). Shorter pieces stall the running
            streams less, but each adds a round trip between decode steps: on CPU they
            cut the streams' longest gap about 2x in two runs of three and lengthened the
            long prompt's TTFT 1.4-1.6x in two (``scripts/bench_serving.py --sections
            chunked``, a loaded machine).
        max_prefill_tokens: padded prefill tokens between two decode steps (vLLM's
            ``max_num_batched_tokens``), whether or not requests decode: a queue is
            admitted over several steps, each within it, so the first requests decode
            while later ones prefill, and requests arriving meanwhile join later steps.
    """

    prefill_batch: int
    row_buckets: tuple[int, ...]
    chunk_tokens: int
    max_prefill_tokens: int
    long_chunk_tokens: int | None = None
    min_piece_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.row_buckets or self.row_buckets[-1] != self.prefill_batch:
            raise ConfigError(
                f"row_buckets {self.row_buckets} must end with prefill_batch={self.prefill_batch}"
            )
        if list(self.row_buckets) != sorted(set(self.row_buckets)):
            raise ConfigError(f"row_buckets must ascend, got {self.row_buckets}")
        for name in ("chunk_tokens", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.piece_floor <= self.long_piece:
            raise ConfigError(
                f"min_piece_tokens must be in 1..long_chunk_tokens={self.long_piece}, "
                f"got {self.min_piece_tokens}"
            )
        if not 1 <= self.long_piece <= self.chunk_tokens:
            raise ConfigError(
                f"long_chunk_tokens must be in 1..chunk_tokens={self.chunk_tokens}, "
                f"got {self.long_chunk_tokens}"
            )

    @property
    def long_piece(self) -> int:
        """New tokens of each piece of a long prompt."""
        return self.chunk_tokens if self.long_chunk_tokens is None else self.long_chunk_tokens

    @property
    def piece_floor(self) -> int:
        """The shortest piece after cached tokens (:attr:`min_piece_tokens`)."""
        return self.long_piece if self.min_piece_tokens is None else self.min_piece_tokens

    def rows(self, n: int) -> int:
        """The row bucket of a prefill of ``n`` requests."""
        return next(r for r in self.row_buckets if r >= n)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One request's part of a prefill.

    Attributes:
        request: the request.
        row: the row whose pages it reads its context from and writes to (disaggregated:
            a row of the prefill group's pages).
        start: tokens of its context already in its pages (a prefix hit, earlier
            chunks), whole pages.
        tokens: the new tokens this prefill computes (its context from ``start``).
        total: its whole context's length (``start + len(tokens)`` on its last chunk).
        admitted: it joined this prefill from the queue (not a later chunk).
        queried: context tokens looked up in the prefix cache on admission (0: none).
    """

    request: Any
    row: int
    start: int
    tokens: tuple[int, ...]
    total: int
    admitted: bool = True
    queried: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def hit(self) -> int:
        """Tokens served by the prefix cache on admission."""
        return self.start if self.admitted else 0


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """One prefill: its chunks (one per row), the padded shape, and what it leaves.

    Attributes:
        chunks: the requests' parts (none: nothing to prefill now).
        rows: the row bucket (padding rows past the chunks).
        length: the new-token bucket (padding tokens past each chunk).
        final: it completes every chunk's context (its rows draw their first tokens).
        chunked: a chunk of a long prompt (its last included).
        cancelled: queued requests found cancelled on the way (to finish).
    """

    chunks: tuple[Chunk, ...] = ()
    rows: int = 0
    length: int = 0
    final: bool = True
    chunked: bool = False
    cancelled: tuple = ()

    @property
    def cost(self) -> int:
        """Padded tokens."""
        return self.rows * self.length

    @property
    def with_context(self) -> bool:
        return any(c.start for c in self.chunks)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """One decode step over the rows.

    Attributes:
        live: per row, whether it computes a token for a running request.
        lengths: per row, tokens its pages hold before the step.
        released: per row, freed since the last step (its device state is reset).
        groups: the step split by block-table width, one dispatch per group, short rows
            first (:mod:`jaxpar.engine._decode_groups`); None: one dispatch over every row
            at the longest row's width.
    """

    live: tuple[bool, ...]
    lengths: tuple[int, ...]
    released: tuple[bool, ...]
    groups: tuple[DecodeGroup, ...] | None = None

    @property
    def longest(self) -> int:
        """Tokens the longest running row holds after the step."""
        return max(n for n, b in zip(self.lengths, self.live, strict=True) if b) + 1


@dataclasses.dataclass
class _Work:
    """A request admitted for prefill: its row is taken and ``done`` tokens of its
    context are in its pages (a prefix hit, then chunks)."""

    request: Any
    row: int
    context: list[int]
    keys: list[bytes]
    done: int = 0
    admitted: bool = True
    queried: int = 0

    @property
    def remaining(self) -> int:
        return len(self.context) - self.done


class Scheduler:
    """Queue, running rows and policy of one continuous batcher.

    Args:
        config: its limits.
        cache: the decode rows' pages.
        bucket: a prefill's padded new-token length for its longest chunk.
        prefill_cache: a disaggregated prefill group's own pages (default: ``cache``,
            colocated: prefill writes the decode rows' pages).
        prefill_rows: rows of the prefill group's pages (disaggregated only).
        grouping: splits a decode step by block-table width when that costs less
            (None: never split).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheManager,
        *,
        bucket: Callable[[int], int],
        prefill_cache: CacheManager | None = None,
        prefill_rows: int = 0,
        grouping: DecodeGrouping | None = None,
    ):
        self.config = config
        self.grouping = grouping
        self.cache = cache
        self.bucket = bucket
        self.disaggregated = prefill_cache is not None
        self.prefill_cache = prefill_cache or cache
        rows = cache.pool.rows
        #: Queued requests, in order.
        self.waiting: collections.deque = collections.deque()
        #: The request decoding in each row (None: free, or prefilling).
        self.owners: list = [None] * rows
        #: The rows a prefill group's requests hold (disaggregated; never decoding).
        self._prefill_owners = [None] * prefill_rows if self.disaggregated else self.owners
        self.lengths = [0] * rows  # tokens cached per decoding row
        self.released = [False] * rows  # rows freed since the last step
        self._admitted = [0] * rows  # admission order of each decoding row
        self._admissions = 0
        #: A long prompt between two of its chunks.
        self.chunking: _Work | None = None
        #: Measured prefill costs: a long prompt's pieces sized by time (None: by tokens).
        self.chunk_cost: ChunkCost | None = None
        self._works: dict[int, _Work] = {}  # by id(request): admitted, not decoding yet

    # --- queue ---------------------------------------------------------------------------

    def add(self, request) -> None:
        self.waiting.append(request)

    @property
    def running(self) -> int:
        """Requests decoding."""
        return sum(s is not None for s in self.owners)

    def pending(self) -> bool:
        """Something waits to be prefilled (queued requests, or a long prompt's chunks)."""
        return bool(self.waiting) or self.chunking is not None

    def _wanted(self, cancelled: list):
        """The first queued request still wanted; cancelled ones before it are dropped
        into ``cancelled``."""
        while self.waiting:
            request = self.waiting[0]
            if not request.cancel_requested:
                return request
            cancelled.append(self.waiting.popleft())
        return None

    def drain(self) -> list:
        """Every request it holds that is not decoding (queued, or a long prompt between
        chunks), removed: the batcher is ending them."""
        out = list(self.waiting)
        self.waiting.clear()
        if self.chunking is not None:
            out.append(self.chunking.request)
        return out

    # --- prefill -------------------------------------------------------------------------

    def context_lengths(self, alone: bool = False) -> list[int]:
        """New-token buckets of a prefill with context: a chunk's bucket, a quarter of it
        (a short suffix after a prefix hit pads to that: few compiles), and a long
        prompt's piece's; ``alone`` (one request, the smallest row bucket: a long
        prompt's pieces) also :meth:`piece_lengths`."""
        top = self.bucket(self.config.chunk_tokens)
        piece = self.bucket(self.config.long_piece)
        lengths = {top, max(8, top // 4), piece} if top >= 8 else {top}
        return sorted(lengths | set(self.piece_lengths()) if alone else lengths)

    def piece_lengths(self) -> list[int]:
        """The smaller pieces a long prompt's prefill may take after a long context (a
        half and a quarter of ``long_chunk_tokens``, in whole pages, down to
        ``min_piece_tokens``), when the measured :attr:`chunk_cost` says a piece of
        ``long_chunk_tokens`` costs more than the budget there. None by default."""
        z, piece = self.prefill_cache.page_size, self.config.long_piece
        floor = max(self.config.piece_floor, z)
        return sorted({p for p in (piece // 2, piece // 4) if p >= floor and p % z == 0})

    def _length(self, takes: Sequence[int], with_context: bool, piece: bool = False) -> int:
        """The new-token bucket of a prefill whose chunks take ``takes`` new tokens
        (``with_context``: after cached tokens, padded to :meth:`context_lengths`; of a
        long prompt's ``piece``: its smaller pieces' too)."""
        length = self.bucket(max(takes))
        if with_context:  # pads to the fewer buckets of a prefill with context
            lengths = self.context_lengths(alone=piece)
            length = next((t for t in lengths if t >= length), length)
        return length

    def _long(self, works: Sequence[_Work]) -> bool:
        """``works`` is a long prompt's piece (prefilled alone)."""
        return len(works) == 1 and (
            works[0] is self.chunking or works[0].remaining > self.config.chunk_tokens
        )

    def _cost(self, works: Sequence[_Work]) -> int:
        """Padded tokens of a prefill of ``works``: its rows times its new-token bucket. A
        prefix hit costs only its suffix (its cached tokens are not computed again)."""
        takes = [self._take(w) for w in works]
        length = self._length(takes, any(w.done for w in works), self._long(works))
        return self.config.rows(len(works)) * length

    def _take(self, work: _Work) -> int:
        """New tokens ``work`` prefills next: all it has left when that fits a chunk and it
        is not long, else its next piece of a long prompt (:meth:`_piece`)."""
        if work is self.chunking or work.remaining > self.config.chunk_tokens:
            return min(work.remaining, self._piece(work))
        return work.remaining

    def _piece(self, work: _Work) -> int:
        """A long prompt's next piece: ``long_chunk_tokens``; with a measured
        :attr:`chunk_cost`, the longest piece (whole pages) whose prefill after the
        context its pages hold costs at most the budget's time, a prefill of
        ``max_prefill_tokens`` new tokens without context (none fits: the shortest). The
        first piece (no context) may be a whole chunk, from ``long_chunk_tokens`` up;
        later ones ``long_chunk_tokens``, or down to ``min_piece_tokens`` (the shapes
        whose costs are measured, not fitted)."""
        config, cost = self.config, self.chunk_cost
        if cost is None:
            return config.long_piece
        cache, rows = self.prefill_cache, config.row_buckets[0]
        z = cache.page_size
        context = cache.context_width(-(-work.done // z)) * z if work.done else 0
        budget_ms = cost.ms(rows, self.bucket(config.max_prefill_tokens), 0)
        top = config.long_piece if work.done else config.chunk_tokens
        floor = config.piece_floor if work.done else config.long_piece
        sizes = [top, *self.context_lengths(alone=True)]
        sizes = sorted({t for t in sizes if t % z == 0 and floor <= t <= top})
        fits = [
            t
            for t in sizes
            if cost.ms(rows, self._length([min(t, work.remaining)], bool(work.done), True), context)
            <= budget_ms
        ]
        return max(fits) if fits else sizes[0]

    def schedule_prefill(self, budget: int | None, spent: int = 0) -> PrefillPlan:
        """The next prefill: the next chunk of a long prompt, or queued requests placed in
        free rows with their pages, in order, while their pages fit, their padded tokens
        and the ``spent`` ones already prefilled since the last decode step stay within
        ``budget`` (None: no bound), and each fits one chunk. The step's first prefill
        (``spent`` 0) always goes, over the budget if it must: a lone long request is not
        starved. A request longer than a chunk is prefilled alone, piece by piece, one
        piece per step (on CPU a 4,096-token prompt prefilled whole took 3-4x as long as
        in chunks)."""
        chunk, cancelled = self.config.chunk_tokens, []

        def fits(works: Sequence[_Work], first: bool) -> bool:
            return first or budget is None or spent + self._cost(works) <= budget

        if self.chunking is not None:  # a long prompt: one piece per decode step
            return self._plan([self.chunking], ()) if not spent else PrefillPlan()
        works: list[_Work] = []
        cache, owners = self.prefill_cache, self._prefill_owners
        while len(works) < self.config.prefill_batch:
            request = self._wanted(cancelled)
            if request is None:
                break
            work = self._place(request, [w.row for w in works], request.context, cache, owners)
            if work is None:
                break
            long = work.remaining > chunk
            if (works and long) or not fits([*works, work], not (works or spent)):
                cache.free(work.row)  # it waits for the next prefill
                break
            self.waiting.popleft()
            work.queried = len(work.context) if cache.caching else 0
            works.append(work)
            if long:  # alone, chunk by chunk
                self.chunking = work
                break
        return self._plan(works, tuple(cancelled))

    def _plan(self, works: list[_Work], cancelled: tuple) -> PrefillPlan:
        if not works:
            return PrefillPlan(cancelled=cancelled)
        takes = [self._take(w) for w in works]
        length = self._length(takes, any(w.done for w in works), self._long(works))
        chunks = []
        for work, take in zip(works, takes, strict=True):
            self._works[id(work.request)] = work
            tokens = tuple(work.context[work.done : work.done + take])
            chunks.append(
                Chunk(
                    work.request,
                    work.row,
                    work.done,
                    tokens,
                    len(work.context),
                    work.admitted,
                    work.queried,
                )
            )
            work.admitted, work.queried = False, 0
        return PrefillPlan(
            tuple(chunks),
            self.config.rows(len(works)),
            length,
            final=all(t == w.remaining for t, w in zip(takes, works, strict=True)),
            chunked=self.chunking is not None and works[0] is self.chunking,
            cancelled=cancelled,
        )

    def _place(
        self, request, taken: Sequence[int], context: list[int], cache: CacheManager, owners
    ) -> _Work | None:
        """A free row, its shard's cached pages of the context's prefix, and pages for the
        rest of it and its first new token: in the shard with the longest cached prefix
        (then the most free pages). None if no shard has room."""
        keys = cache.keys(context)
        tokens = min(len(context) + 1, cache.pool.max_seq_len)
        best: tuple[tuple[int, int], int, Hit] | None = None
        seen = set()
        for row, owner in enumerate(owners):
            shard = cache.shard(row)
            if owner is not None or row in taken or not cache.row_free(row) or shard in seen:
                continue
            seen.add(shard)
            hit = cache.computed(shard, keys, len(context))
            if not cache.fits(hit, tokens):
                continue
            score = (len(hit.pages), cache.free_pages(shard))
            if best is None or score > best[0]:
                best = (score, row, hit)
        if best is None:
            return None
        _, row, hit = best
        cache.admit(row, hit, tokens)
        return _Work(request, row, context, keys, done=hit.tokens)

    def prefilled(self, plan: PrefillPlan, live: Sequence[bool]) -> list[int]:
        """After the runner ran ``plan`` (and wrote its K/V): the full pages written join
        the prefix cache, and where prefill writes the decode rows (colocated) the
        requests it completed start decoding (``live[i]``: chunk ``i``'s request did not
        finish at its first token; one that did is freed). Returns the rows that start
        decoding."""
        cache, started = self.prefill_cache, []
        for chunk, alive in zip(plan.chunks, live, strict=True):
            work = self._works[id(chunk.request)]
            work.done = chunk.end
            cache.commit(work.row, work.keys[: work.done // cache.page_size], work.context)
            if plan.final and not self.disaggregated and not alive:
                cache.free(work.row)
            else:  # its next query (chunk or decode) sits at ``done``: the window's pages
                cache.trim(work.row, work.done)
            if plan.final:
                del self._works[id(chunk.request)]
                if self.chunking is work:
                    self.chunking = None
                if alive and not self.disaggregated:
                    self.start_decoding(work.row, chunk.request, work.done)
                    started.append(work.row)
        return started

    def release_prefill(self, plan: PrefillPlan) -> None:
        """Disaggregated: a finished prefill moved to the decode rows; its rows of the
        prefill group's pages are freed (their full pages stay cached)."""
        for chunk in plan.chunks:
            self.prefill_cache.free(chunk.row)

    def cancelled_chunk(self):
        """The long prompt between chunks, if its client cancelled it: its row is freed;
        returned to finish (else None)."""
        work = self.chunking
        if work is None or not work.request.cancel_requested:
            return None
        self.chunking = None
        self._works.pop(id(work.request), None)
        self.prefill_cache.free(work.row)
        return work.request

    # --- decode --------------------------------------------------------------------------

    def place(self, contexts: Sequence[list[int]]) -> list[int] | None:
        """Disaggregated: decode rows with pages for prefilled requests' contexts (all or
        none; None if they do not all fit now)."""
        rows: list[int] = []
        for context in contexts:
            work = self._place(None, rows, context, self.cache, self.owners)
            if work is None:
                for taken in rows:
                    self.cache.free(taken)
                return None
            rows.append(work.row)
        return rows

    def start_decoding(self, row: int, request, length: int) -> None:
        """``request`` decodes in ``row`` (its pages taken), ``length`` tokens cached."""
        self.owners[row] = request
        self.released[row] = False
        self.lengths[row] = length
        self._admissions += 1
        self._admitted[row] = self._admissions

    def cancelled_running(self) -> list[tuple[int, Any]]:
        """Decoding requests whose clients cancelled them: their rows are freed;
        returned as (row, request) to finish."""
        out = [(i, s) for i, s in enumerate(self.owners) if s is not None and s.cancel_requested]
        for i, _ in out:
            self.finish(i)
        return out

    def finish(self, row: int):
        """Frees a decoding row and its pages (its request ended); returns the request."""
        request = self.owners[row]
        self.owners[row] = None
        self.released[row] = True
        self.cache.free(row)
        return request

    def reserve(self) -> bool:
        """Pages for every running row's next token, after giving back those that left
        every layer's window (sliding-window models); False if some shard ran out."""
        for i, request in enumerate(self.owners):
            if request is not None:
                self.cache.trim(i, self.lengths[i])
        return all(
            self.cache.allocate(i, self.lengths[i] + 1)
            for i, s in enumerate(self.owners)
            if s is not None
        )

    def victim(self, shard: int) -> int:
        """The row to preempt when ``shard`` is out of pages: the request admitted last
        there (it has waited least; the oldest keeps running)."""
        rows = [
            j for j, s in enumerate(self.owners) if s is not None and self.cache.shard(j) == shard
        ]
        return max(rows, key=lambda j: self._admitted[j])

    def preempt_for_room(self) -> list[tuple[int, Any]]:
        """Preempts until every running row has room for its next token; returns the
        (row, request) preempted, each back at the front of the queue."""
        out = []
        for i, request in enumerate(self.owners):
            while request is not None and not self.cache.allocate(i, self.lengths[i] + 1):
                victim = self.victim(self.cache.shard(i))
                preempted = self.finish(victim)
                self.waiting.appendleft(preempted)
                out.append((victim, preempted))
                request = self.owners[i]
        return out

    def decode_plan(self) -> DecodePlan:
        """The next decode step (call once rows are reserved): then counts its token."""
        live = tuple(s is not None for s in self.owners)
        groups = None
        if self.grouping is not None and any(live):
            groups = self.grouping.groups(live, self.lengths)
        plan = DecodePlan(live, tuple(self.lengths), tuple(self.released), groups)
        self.lengths = [n + b for n, b in zip(self.lengths, live, strict=True)]
        self.released = [False] * len(self.owners)
        return plan
