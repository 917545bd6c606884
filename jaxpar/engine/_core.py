"""One step of serving: the scheduler's plans, run by the runner, and their results back.

:class:`ServingCore` is what vLLM calls the engine core: each of its steps asks the
scheduler (:mod:`jaxpar.engine._scheduler`) for a plan, has the runner
(:mod:`jaxpar.engine._runner`) execute it, and reports the outcome back (requests that
ended, rows that start decoding, pages written). The batcher's threads call it
(:class:`~jaxpar.engine.ContinuousBatcher`): the decode loop :meth:`~ServingCore.decode`
(after :meth:`~ServingCore.admit` colocated, or :meth:`~ServingCore.insert_ready`
disaggregated), the prefill loop :meth:`~ServingCore.prefill_ahead` (disaggregated).

Locking: the scheduler, the cache managers, the ready prefills, the requests prefilling
and the finished count are shared by the two loops and the clients; they are read and
changed only under ``lock`` (the batcher's condition). The scheduler's calls are quick
host work; device work (the runner's) runs outside the lock. Decode rows change owner
only on the decode loop's thread (the prefill loop has rows of its own pages).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Iterable

import numpy as np

from jaxpar.engine._cache import CacheManager
from jaxpar.engine._executor import DECODE, PREFILL
from jaxpar.engine._requests import RequestStream
from jaxpar.engine._runner import BatcherStats, Prefilled, Runner, constrained
from jaxpar.engine._scheduler import PrefillPlan, Scheduler

#: Prefilled batches waiting for decode slots (disaggregated): enough to keep the decode
#: side fed without prefilling far ahead of it.
READY_BATCHES = 2


class ServingCore:
    """The steps of one batcher (see the module's docstring for who calls what).

    Args:
        scheduler / runner: decide and execute.
        cache / prefill_cache: the decode rows' pages, and those prefill writes (the same
            colocated).
        stats: the batcher's counters; ``lock``: its condition.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        cache: CacheManager,
        prefill_cache: CacheManager,
        stats: BatcherStats,
        lock: threading.Condition,
    ):
        self.scheduler, self.runner = scheduler, runner
        self.cache, self.prefill_cache = cache, prefill_cache
        self.stats, self.lock = stats, lock
        #: Disaggregated: prefilled batches waiting for decode rows, in order.
        self.ready: collections.deque[Prefilled] = collections.deque()
        #: Requests taken for the prefill in flight, until they decode (or are ready):
        #: ended with the rest if the batcher fails meanwhile.
        self.prefilling: list[RequestStream] = []
        #: Speculative decoding (:class:`~jaxpar.engine._spec_step.Speculation`), or None.
        self.speculation = None

    # --- bookkeeping (lock held) ---------------------------------------------------------

    def ended(self, streams: Iterable[RequestStream | None]) -> None:
        """Finishes cancelled requests (call with the lock held; each counts itself)."""
        for stream in streams:
            if stream is not None:
                stream.finish(stream.cancel_reason)

    def took(self, plan: PrefillPlan) -> None:
        """A prefill was planned (lock held): its cancelled requests end, its prefix hits
        are counted, and its requests are prefilling."""
        self.ended(plan.cancelled)
        self.prefilling = [c.request for c in plan.chunks]
        now = time.perf_counter()
        for chunk in plan.chunks:
            if chunk.admitted and chunk.request.scheduled_at is None:
                chunk.request.scheduled_at = now  # its queue time ends (vLLM's)
            if not (chunk.admitted and chunk.queried):
                continue
            self.stats.prefix_queries += chunk.queried
            self.stats.prefix_hits += chunk.hit
            stream = chunk.request
            if not stream.tokens:  # not a preempted request coming back
                stream.cached_tokens = min(chunk.hit, len(stream.request.prompt))
                self.stats.prompt_tokens_cached += stream.cached_tokens

    def holding(self) -> list[RequestStream]:
        """Every request not finished by a loop yet, taken from the scheduler and the ready
        prefills (lock held): the batcher is ending them."""
        streams = [*self.scheduler.drain(), *self.prefilling]
        streams += [s for b in self.ready for s in b.streams if s]
        streams += [s for s in self.scheduler.owners if s is not None]
        self.ready.clear()
        return streams

    def finished(self, row: int) -> None:
        """A decoding row's request ended (its stream counted itself): its row and pages
        are freed."""
        with self.lock:
            self.scheduler.finish(row)
            self.lock.notify_all()

    # --- prefill -------------------------------------------------------------------------

    def admit(self, max_prefill_tokens: int) -> None:
        """Colocated: prefills queued requests (and chunks of a long prompt) and writes them
        into their rows and pages, about ``max_prefill_tokens`` padded tokens before the
        next decode step (the first prefill at least), whether or not requests decode:
        a long queue is prefilled over several steps while its first requests decode, and
        requests that arrive meanwhile are considered at the next step (vLLM's
        ``max_num_batched_tokens``). Prefilling a whole queue before a step instead gave
        64 requests arriving at 16/s their second tokens only after all 64 first ones."""
        sched, spent = self.scheduler, 0
        while spent < max_prefill_tokens:
            with self.lock:
                plan = sched.schedule_prefill(max_prefill_tokens, spent)
                self.took(plan)
            if not plan.chunks:
                break
            batch = self.runner.prefill(plan, self.cache, DECODE)
            live = [s is not None for s in batch.streams]
            chunks = zip(plan.chunks, live, strict=True)
            slots = [c.row if plan.final and ok else None for c, ok in chunks]
            self.runner.insert(batch, self.cache, DECODE, slots)
            with self.lock:
                sched.prefilled(plan, live)
                self.prefilling = []
            spent += plan.cost

    def wants_prefill(self) -> bool:
        """Disaggregated (lock held): something to prefill, and room for it when done."""
        return self.scheduler.pending() and len(self.ready) < READY_BATCHES

    def prefill_ahead(self) -> bool:
        """Disaggregated: the next prefill on the prefill group's own pages (prefix hits,
        chunks); once a prompt is whole it moves to the decode devices, ready for rows.
        False if nothing fit its pool (it frees at every prefill's end)."""
        sched, cache, runner = self.scheduler, self.prefill_cache, self.runner
        with self.lock:
            self.ended([sched.cancelled_chunk()])
            plan = sched.schedule_prefill(None)
            self.took(plan)
        if not plan.chunks:
            return False
        batch = runner.prefill(plan, cache, PREFILL)
        runner.insert(batch, cache, PREFILL, [None] * len(plan.chunks), keep=batch.final)
        with self.lock:
            sched.prefilled(plan, [s is not None for s in batch.streams])
        if not batch.final:
            return True
        start = time.perf_counter()
        shape = runner.whole(batch, cache)
        self.stats.transfer_bytes += runner.executor.transfer(batch.handle)
        self.stats.transfers += 1
        with self.lock:  # its pages stay cached for later prompts
            sched.release_prefill(plan)
        runner.executor.wait(batch.handle)
        self.stats.prefill_seconds += time.perf_counter() - start
        rows, starts_P = [None] * len(batch.streams), np.zeros_like(batch.starts_P)
        with self.lock:
            self.ready.append(dataclasses.replace(batch, shape=shape, rows=rows, starts_P=starts_P))
            self.prefilling = []
            self.lock.notify_all()
        return True

    def insert_ready(self) -> None:
        """Disaggregated: places the prefilled batches whose requests all fit, in order,
        and starts decoding them."""
        sched, batches = self.scheduler, []
        with self.lock:
            while self.ready:
                batch = self.ready[0]
                live = batch.live
                rows = sched.place([s.context[: batch.contexts[i]] for i, s in live])
                if rows is None:
                    break
                batch.rows = [None] * len(batch.streams)
                for (i, stream), row in zip(live, rows, strict=True):
                    batch.rows[i] = row
                    sched.start_decoding(row, stream, batch.contexts[i])
                batches.append(self.ready.popleft())
            self.lock.notify_all()
        for batch in batches:
            self.runner.insert(batch, self.cache, DECODE, batch.rows)

    # --- decode --------------------------------------------------------------------------

    def decode(self, pending: tuple | None) -> tuple | None:
        """One decode step over the rows (cancelled ones freed first, new ones admitted by
        the caller); ``pending``: the step in flight, (handle, holders), read back here.
        Returns the step it dispatched (None if no row runs).

        Step n+1 is dispatched before step n's tokens are read back, so the host's work
        (reading, streaming, stop checks, admitting) overlaps the device's. A request that
        finished at step n has one more token drawn at step n+1; it is dropped. Device
        programs run in the order they are dispatched, so pages freed on the host are
        rewritten only after that extra step. When a shard is out of pages, or some
        running request has a grammar (its mask follows its last token), the step in
        flight is read first."""
        if self.speculation is not None:  # a verification step instead, when it pays
            ran, pending = self.speculation.decode(pending)
            if ran:
                return None
        sched, owners = self.scheduler, self.scheduler.owners
        with self.lock:
            short = sched.running > 0 and not sched.reserve()
        if short:  # read the step in flight (it may end requests), then preempt
            if pending is not None:
                self.deliver(*pending)
                pending = None
            with self.lock:
                self.stats.preemptions += len(sched.preempt_for_room())
                self.lock.notify_all()
        if constrained(owners) and pending is not None:
            self.deliver(*pending)
            pending = None
        dispatched = None
        if sched.running:
            with self.lock:
                plan = sched.decode_plan()
            dispatched = (self.runner.step(plan, owners, self.cache), list(owners))
        if pending is not None:
            self.deliver(*pending)
        return dispatched

    def cancel_running(self) -> None:
        """Ends the decoding requests their clients cancelled, freeing their rows (and,
        colocated, a long prompt's between its chunks)."""
        with self.lock:
            self.ended(s for _, s in self.scheduler.cancelled_running())
            if self.prefill_cache is self.cache:
                self.ended([self.scheduler.cancelled_chunk()])

    def deliver(self, handle: int, holders: list) -> None:
        """Streams a step's tokens; frees each row whose request ended, at once."""
        self.runner.deliver(handle, holders, self.scheduler.owners, self.finished)
