"""Continuous batching: requests queue, prefill in buckets, decode over a paged KV cache.

:class:`ContinuousBatcher` runs one decode loop over the engine's ``max_batch`` rows and
a pool of KV pages. It is a thin shell over three parts, split as vLLM v1 splits them:

* the scheduler (:mod:`jaxpar.engine._scheduler`, plain Python): admission, prefix
  placement, chunked prefill, page reservation and preemption, as step plans;
* the cache manager (:mod:`jaxpar.engine._cache`): the page book and the prefix cache;
* the runner (:mod:`jaxpar.engine._runner`): each plan through the recordable
  executor, and the tokens back to their streams.

The shell keeps the threads, the loops, the life cycle and failures, the multi-process
follow, warm-up (:mod:`jaxpar.engine._batcher_programs`) and stats.

Threads: clients call :meth:`~ContinuousBatcher.submit` from any thread; the decode loop
runs in a thread of its own, and when disaggregated (``prefill_engine`` given) the
prefill loop in another, so prefill on its devices overlaps the decode steps. The
scheduler and both cache managers are host state of both loops: every call into them is
made with ``_cond`` held (it is quick: no device work), as are the ready batches, the
requests prefilling and the counters of finished requests. The decode loop alone owns
the runner's decode side (its step tables and timings); the prefill loop (colocated: the
decode loop) owns the prefills it runs until they are inserted or ready. The executor
serialises the two loops' commands itself.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np

from jaxpar.engine._admission import Admission
from jaxpar.engine._batcher_programs import (
    BatcherPrograms,
    check_pair,
    default_max_prefill_tokens,
    row_buckets,
    size_prefill_batch,
    step_temp_bytes,
)
from jaxpar.engine._cache import CacheManager
from jaxpar.engine._distributed import peer_failures
from jaxpar.engine._efficiency import StepLog
from jaxpar.engine._engine import InferenceEngine
from jaxpar.engine._executor import DECODE, PREFILL, Executor
from jaxpar.engine._grammar import Constraint, Grammar
from jaxpar.engine._kv_budget import KVBudget, cache_dtype_name, describe, size_pool
from jaxpar.engine._lockstep import HEARTBEAT_S, Heartbeat, Leader, Monitor, follow, lost_error
from jaxpar.engine._logprobs import MAX_TOP_LOGPROBS
from jaxpar.engine._pages import PageTable
from jaxpar.engine._prefix import cache_salt
from jaxpar.engine._requests import Request, RequestStream
from jaxpar.engine._runner import BatcherStats, Prefilled, Runner, constrained
from jaxpar.engine._sampling import Sampling
from jaxpar.engine._scheduler import PrefillPlan, Scheduler, SchedulerConfig
from jaxpar.engine._slots import FirstTokens, SlotSteps
from jaxpar.engine._warmup import Warmup, WarmupPlan
from jaxpar.errors import ConfigError, GrammarError, PeerLostError, QueueFullError, ShapeError

__all__ = ["BatcherStats", "ContinuousBatcher", "default_max_prefill_tokens"]

#: Seconds :meth:`ContinuousBatcher.close` waits for its loops once a drain has run out
#: (one process): a loop compiling a program on first use is left to the process's exit.
LATE_JOIN_S = 2.0
#: Prefilled batches waiting for decode slots (disaggregated): enough to keep the decode
#: side fed without prefilling far ahead of it.
READY_BATCHES = 2


class ContinuousBatcher:
    """Serves requests that arrive at any time over one engine's decode slots.

    Args:
        engine: runs decode; its ``max_batch`` is the number of slots, its
            ``max_seq_len`` bounds prompt + ``max_tokens`` - 1 per request.
        prefill_engine: disaggregated prefill on other devices (its own strategy, mesh
            and page pool, which holds its prefix cache); default: prefill on ``engine``,
            between decode steps.
        prefill_batch: most prompts prefilled together (a multiple of the prefill
            strategy's ``dp``). Default: ``4 * dp`` (disaggregated: its ``max_batch``).
        max_queue: requests waiting beyond this are refused (:class:`QueueFullError`).
        kv_budget: the paged KV cache's page size and size; default :class:`KVBudget`.
        prefix_caching: reuse the K/V pages of earlier requests' prompts that a new
            prompt starts with.
        max_prefill_tokens: prefill tokens (padded) run between two decode steps while
            requests are decoding; longer prompts are prefilled in chunks of about that
            many tokens. Default: :func:`default_max_prefill_tokens`.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        *,
        prefill_engine: InferenceEngine | None = None,
        prefill_batch: int | None = None,
        max_queue: int = 256,
        kv_budget: KVBudget | None = None,
        prefix_caching: bool = True,
        max_prefill_tokens: int | None = None,
    ):
        self.engine = engine
        #: A process other than 0 of a multi-process job: it replays process 0's
        #: commands (:meth:`follow`) instead of scheduling (:meth:`start`).
        self.replays = jax.process_index() != 0
        self.prefill_engine = eng = prefill_engine or engine
        self.disaggregated = prefill_engine is not None
        budget, run = kv_budget or KVBudget(), engine.program.run
        self.pool = size_pool(
            budget,
            config=engine.parallel_config,
            mesh=engine.mesh,
            dims=run,
            rows=engine.max_batch,
            max_seq_len=engine.max_seq_len,
            step_temp_bytes=lambda: step_temp_bytes(engine),
        )
        self.pages = PageTable(self.pool)  # read it; the cache manager changes it
        self.slot_steps = SlotSteps(engine.steps, run, self.pool)
        self.max_seq_len = self.pool.max_seq_len  #: The longest request.
        if self.disaggregated:
            check_pair(engine, eng)
        self.first_tokens = FirstTokens(eng.steps)
        self.prefill_batch = prefill_batch_ = size_prefill_batch(eng, prefill_batch, prefill_engine)
        if max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self.max_prompt_len = min(self.max_seq_len, eng.max_seq_len)
        #: What a request may ask: one rule for the engine, batcher, CLI and server.
        self.admission = Admission(
            engine.model_config.vocab_size, self.max_seq_len, self.max_prompt_len
        )
        self.prefix_caching = prefix_caching
        z, salt = self.pool.page_size, cache_salt(run)
        self.max_prefill_tokens = max_prefill_tokens or default_max_prefill_tokens(
            engine.mesh.devices.flat[0].platform, z
        )
        if self.max_prefill_tokens < 1:
            raise ConfigError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        buckets = row_buckets(eng, prefill_batch_)
        #: Tokens of one chunk of a long prompt: what fits ``max_prefill_tokens`` in the
        #: smallest prefill row bucket, in whole pages (chunks start on a page boundary).
        self.chunk_tokens = max(self.max_prefill_tokens // buckets[0] // z, 1) * z
        self.cache = CacheManager(
            self.pages, salt, caching=prefix_caching and not self.disaggregated
        )
        self.prefill_cache, self.prefill_slot_steps = self.cache, self.slot_steps
        if self.disaggregated:
            self.prefill_cache, self.prefill_slot_steps = self._prefill_side(budget, salt)
        config = SchedulerConfig(
            prefill_batch_, tuple(buckets), self.chunk_tokens, self.max_prefill_tokens
        )
        self.scheduler = Scheduler(
            config,
            self.cache,
            bucket=eng.bucket,
            prefill_cache=self.prefill_cache if self.disaggregated else None,
            prefill_rows=eng.max_batch,
        )
        self.stats = BatcherStats()
        #: Each step's shape facts and time, for efficiency metrics.
        self.step_log = StepLog(colocated=not self.disaggregated)
        self._cond = threading.Condition()
        self._ready: collections.deque[Prefilled] = collections.deque()
        #: Requests taken for the prefill in flight, until they decode (or are ready):
        #: ended with the rest if the batcher fails meanwhile.
        self._prefilling: list[RequestStream] = []
        self._next_id = 0
        self._closing = self._stopping = self._closed = False
        self._close_lock = threading.Lock()
        #: Dispatches the programs and holds their device state (:mod:`._executor`).
        self.executor = Executor(
            engine,
            eng,
            self.slot_steps,
            self.prefill_slot_steps if self.disaggregated else None,
            self.first_tokens,
            keeps_outputs=not self.replays,
        )
        #: Process 0 of a multi-process job: sends the executor's commands to the others.
        self.leader = Leader() if jax.process_count() > 1 and not self.replays else None
        self.executor.recorder = self.leader
        self._monitor: Monitor | None = None
        multi = jax.process_count() > 1
        self._heartbeat = Heartbeat().start() if multi and self.replays else None
        self.runner = Runner(
            self.executor, engine, eng, self.slot_steps, self.stats, self._cond, self.step_log
        )
        self.programs = BatcherPrograms(
            engine,
            eng,
            self.slot_steps,
            self.prefill_slot_steps,
            self.first_tokens,
            self.executor,
            self.cache,
            self.prefill_cache,
            self.scheduler,
            self.max_prompt_len,
        )
        self._threads: list[threading.Thread] = []
        #: Loop threads still running after :meth:`close` gave up waiting for them.
        self._stragglers: list[threading.Thread] = []
        #: The warm-up compiling (lazy: in the background while serving), once started.
        self.warming: Warmup | None = None
        self._failure: BaseException | None = None

    def _prefill_side(self, budget: KVBudget, salt: bytes) -> tuple[CacheManager, SlotSteps]:
        """The prefill group's pages (disaggregated): ``budget`` sized on its devices, for
        its ``max_batch`` rows, the decode cache's page size."""
        eng = self.prefill_engine
        pool = size_pool(
            dataclasses.replace(budget, page_size=self.pool.page_size),
            config=eng.parallel_config,
            mesh=eng.mesh,
            dims=eng.program.run,
            rows=eng.max_batch,
            max_seq_len=self.max_prompt_len,
            step_temp_bytes=lambda: 0,  # no decode step runs there
            release=False,  # whole prompts move to the decode group
        )
        cache = CacheManager(PageTable(pool), salt, caching=self.prefix_caching)
        return cache, SlotSteps(eng.steps, eng.program.run, pool)

    # --- clients -------------------------------------------------------------------------

    def submit(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        sampling: Sampling | None = None,
        seed: int = 0,
        stop_tokens: Sequence[int] = (),
        logprobs: int | None = None,
        grammar: Grammar | Constraint | None = None,
    ) -> RequestStream:
        """Queues a request; its stream yields tokens as they are drawn (and, with
        ``logprobs``, each token's logprob and that many alternatives). ``grammar``:
        structured output: a :class:`Constraint` (compiled with the engine's tokenizer,
        :meth:`InferenceEngine.grammar`) or a grammar compiled for this model's vocabulary
        (:meth:`Grammars.compile <jaxpar.engine._grammar.Grammars.compile>`).

        Raises:
            ShapeError / CacheOverflowError: a bad prompt or one that does not fit.
            GrammarError: an invalid constraint, or a grammar for another vocabulary.
            ConfigError: a constraint, and an engine without a tokenizer.
            QueueFullError: ``max_queue`` requests are already waiting, or the batcher is
                closing.
        """
        if isinstance(grammar, Constraint):
            grammar = self.engine.grammar(grammar)
        request = Request(
            prompt=tuple(int(t) for t in self.admission.check(prompt, max_tokens)),
            max_tokens=max_tokens,
            sampling=sampling or Sampling(),
            seed=int(seed),
            stop_tokens=frozenset(int(t) for t in stop_tokens),
            logprobs=logprobs,
            grammar=grammar,
        )
        vocab = self.engine.steps.vocab_size
        if grammar is not None and grammar.vocab_size != vocab:
            raise GrammarError(
                f"the grammar was compiled for a vocabulary of {grammar.vocab_size} ids; this "
                f"model's has {vocab}: compile it with Grammars(tokenizer, {vocab}, eos_ids)"
            )
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ShapeError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
        with self._cond:
            if self._failure is not None:
                raise QueueFullError(f"the batcher stopped after an error: {self._failure!r}")
            if self._closing:
                raise QueueFullError("the batcher is shutting down and takes no new requests")
            if self.queued >= self.max_queue:
                raise QueueFullError(
                    f"{self.queued} requests are already waiting (max_queue="
                    f"{self.max_queue}); retry shortly"
                )
            stream = RequestStream(self._next_id, request)
            self._next_id += 1
            self.scheduler.add(stream)
            self.stats.submitted += 1
            self._cond.notify_all()
        return stream

    @property
    def queued(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def active(self) -> int:
        """Requests holding a decode slot."""
        return self.scheduler.running

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV cache's pages held by running requests (0..1)."""
        return self.cache.usage

    def describe_cache(self) -> str:
        """One line: the KV cache's pages, tokens and dtype, GiB per device, sequences."""
        dtype = cache_dtype_name(self.slot_steps.model_config)
        return describe(self.pool, self.slot_steps.pool_bytes_per_device(), dtype)

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]], top: int = 0):
        """:meth:`InferenceEngine.prompt_logprobs` on the prefill engine, dispatched as a
        command (so every process of a multi-process server scores too)."""
        ex = self.executor
        return self.prefill_engine.prompt_logprobs(
            prompts, top, run=lambda tokens_BT, lengths_B: ex.scores(ex.score(tokens_BT, lengths_B))
        )

    def lockstep_stats(self) -> dict[str, float] | None:
        """Process 0 of a multi-process job: what it sent the others (messages, the
        commands in them, bytes, seconds in the puts); None otherwise."""
        lead = self.leader
        if lead is None:
            return None
        return {
            "processes": jax.process_count(),
            "messages": lead.messages,
            "commands": lead.commands,
            "bytes": lead.bytes,
            "seconds": lead.seconds,
        }

    @property
    def slots(self) -> int:
        return self.engine.max_batch

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    # --- warm-up -------------------------------------------------------------------------

    def row_buckets(self) -> list[int]:
        """Prefill batch sizes (:func:`~jaxpar.engine._batcher_programs.row_buckets`)."""
        return list(self.scheduler.config.row_buckets)

    def table_widths(self) -> list[int]:
        """The block-table widths a decode step compiles for (powers of two)."""
        return self.programs.table_widths()

    def warmup_plan(self, prompt_lens: Iterable[int] | None = None) -> WarmupPlan:
        """What :meth:`warmup` compiles (:meth:`BatcherPrograms.plan
        <jaxpar.engine._batcher_programs.BatcherPrograms.plan>`) for ``prompt_lens``
        (default: every length up to ``max_seq_len``)."""
        return self.programs.plan(prompt_lens)

    def warmup(
        self,
        prompt_lens: Iterable[int] | None = None,
        progress: Callable[[int, int, str], None] | None = None,
        *,
        lazy: bool = False,
        threads: int | None = None,
    ) -> list[tuple[int, int]]:
        """Compiles the programs of :meth:`warmup_plan` on ``threads`` threads (default:
        one per core, up to 8), calling ``progress(done, total, what)`` after each. Nothing
        runs. ``lazy``: return once the smallest prefill and decode step are compiled; the
        rest compile in the background (:attr:`warming`) while requests are served, or on
        first use. Returns the (rows, length) prefill buckets compiled (or compiling)."""
        plan = self.warmup_plan(prompt_lens)
        jobs = [(b.describe(), self.programs.compiler(b)) for b in plan.buckets]
        # Lazy: the background compiles yield to requests (queued or running).
        hold = (lambda: self.stats.finished < self.stats.submitted) if lazy else None
        self.warming = Warmup(jobs, threads, progress, hold).start()
        if self._closing:  # closed meanwhile: compile nothing more
            self.warming.stop()
        self.warming.wait_first(plan.first if lazy else len(plan))
        return [(b.rows, b.tokens) for b in plan.buckets if b.kind == "prefill"]

    # --- life cycle ----------------------------------------------------------------------

    def start(self) -> ContinuousBatcher:
        """Starts the decode loop (and the prefill loop when disaggregated) in threads.

        In a multi-process job, process 0 only; it also watches the other processes'
        heartbeats and fails every request, naming the process, if one is lost."""
        if self.replays:
            raise ConfigError(
                f"process {jax.process_index()} replays process 0's schedule: call "
                "follow() there, and start() on process 0"
            )
        if self._threads:
            return self
        if self.leader is not None:
            self._monitor = Monitor(self.fail).start()
        self.executor.start()
        loops = [self._decode_loop] + ([self._prefill_loop] if self.disaggregated else [])
        for loop in loops:
            thread = threading.Thread(target=self._guard(loop), name=loop.__name__, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def follow(self) -> int:
        """A process other than 0 of a multi-process job: replays process 0's commands
        until its batcher closes (returns the number replayed).

        Raises:
            PeerLostError: process 0 is gone, or a collective lost another process.
        """
        if not self.replays:
            raise ConfigError("process 0 schedules (start()); follow() is for the others")
        try:
            with peer_failures():
                return follow(self.executor)
        finally:
            if self._heartbeat is not None:
                self._heartbeat.close()

    def fail(self, error: BaseException) -> None:
        """Ends every request with finish reason ``"error"`` and ``error``, and stops the
        loops (the first failure wins): e.g. a lost process of a multi-process job."""
        with self._cond:
            if self._failure is not None:
                return
            self._failure = error
            self._stopping = True
            self._cond.notify_all()
        self._end_all("error", error)

    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stops taking requests, then ends the loops. ``drain``: let queued and running
        requests finish first (up to ``timeout`` seconds); what is left is then cancelled
        with finish reason ``"shutdown"``. A second call waits for the first to finish."""
        with self._close_lock:
            if not self._closed:
                self._close(drain, timeout)
                self._closed = True

    @property
    def busy_after_close(self) -> bool:
        """A loop or warm-up thread is still running (compiling) after :meth:`close`:
        the process should exit without waiting for it (``os._exit``)."""
        warming = self.warming is not None and not self.warming.finished
        return warming or any(t.is_alive() for t in self._stragglers)

    @property
    def closing(self) -> bool:
        """:meth:`close` was called (the batcher takes no more requests)."""
        return self._closing

    def _close(self, drain: bool, timeout: float | None) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self.warming is not None:  # what has not started compiling never will
            self.warming.stop()
        if drain and self._failure is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            with self._cond:
                self._cond.wait_for(self._idle, left)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            late = drain and not self._idle()
        if late:  # drained for ``timeout``: what is left ends now, not after the loops'
            self._end_all("shutdown")  # step (or a compile) in flight: clients hear at once
        wait = None
        if self._failure is not None:  # a loop may be stuck in a collective with a lost
            wait = 1.0  # process (it ends with the process: the loops are daemon threads)
        elif late and self.leader is None:  # a loop may be compiling on first use
            wait = LATE_JOIN_S  # (minutes for a big model): its requests are ended
        for thread in self._threads:
            thread.join(wait)
        self._stragglers = [t for t in self._threads if t.is_alive()]
        self._threads = []
        self._end_all("shutdown")  # what never started (or was never taken) ends too
        if self._monitor is not None:
            self._monitor.close()
        if self.leader is not None and self._failure is None:
            self.leader.stop()  # the other processes return from follow()

    def __enter__(self) -> ContinuousBatcher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _idle(self) -> bool:
        """Every submitted request has finished (none queued, prefilling or decoding)."""
        return self.stats.finished == self.stats.submitted

    def _guard(self, loop):
        """Runs ``loop``; an exception ends every request with finish reason ``"error"``."""

        def run() -> None:
            try:
                with peer_failures():
                    loop()
            except PeerLostError as e:  # name the process if the heartbeats tell which
                self.fail(self._lost(e))
            except BaseException as e:  # noqa: BLE001 - reported to every waiting client
                self.fail(e)

        return run

    def _lost(self, error: PeerLostError) -> PeerLostError:
        """A collective failed for a lost process: the heartbeat monitor's verdict if it
        comes within its timeout (it names the process), else ``error``."""
        monitor = self._monitor
        if monitor is None:
            return error
        deadline = time.monotonic() + monitor.lost_after_s + 2 * HEARTBEAT_S
        while not monitor.lost and time.monotonic() < deadline and self._failure is None:
            time.sleep(0.1)
        if monitor.lost:
            return lost_error(monitor.lost, jax.process_count(), monitor.lost_after_s)
        return error

    def _end_all(self, reason: str, error: BaseException | None = None) -> None:
        with self._cond:
            streams = [*self.scheduler.drain(), *self._prefilling]
            streams += [s for b in self._ready for s in b.streams if s]
            streams += [s for s in self.scheduler.owners if s is not None]
            self._ready.clear()
        for stream in streams:
            stream.finish(reason, error)

    def _ended(self, streams: Iterable[RequestStream | None]) -> None:
        """Finishes cancelled requests and counts them (call with ``_cond`` held)."""
        ended = [s for s in streams if s is not None]
        for stream in ended:
            stream.finish(stream.cancel_reason)
        self.stats.finished += len(ended)
        self._cond.notify_all()

    # --- loops ---------------------------------------------------------------------------

    def _took(self, plan: PrefillPlan) -> None:
        """A prefill was planned (``_cond`` held): its cancelled requests end, its prefix
        hits are counted, and its requests are prefilling."""
        self._ended(plan.cancelled)
        self._prefilling = [c.request for c in plan.chunks]
        for chunk in plan.chunks:
            if not (chunk.admitted and chunk.queried):
                continue
            self.stats.prefix_queries += chunk.queried
            self.stats.prefix_hits += chunk.hit
            stream = chunk.request
            if not stream.tokens:  # not a preempted request coming back
                stream.cached_tokens = min(chunk.hit, len(stream.request.prompt))
                self.stats.prompt_tokens_cached += stream.cached_tokens

    def _prefill_loop(self) -> None:
        """Disaggregated: prefills queued requests on the prefill devices, ahead of decode,
        in the prefill group's own pages (prefix hits, chunks); each finished prefill
        moves to the decode devices whole, once."""
        sched, cache = self.scheduler, self.prefill_cache
        while True:
            self.executor.flush()  # before waiting: the others dispatch what this one did
            with self._cond:
                self._cond.wait_for(
                    lambda: self._stopping or (sched.pending() and len(self._ready) < READY_BATCHES)
                )
                if self._stopping:
                    return
                self._ended([sched.cancelled_chunk()])
                plan = sched.schedule_prefill(None)
                self._took(plan)
                if not plan.chunks:  # nothing fits its pool yet (it frees at every batch's end)
                    self.executor.flush()
                    self._cond.wait(0.01)
                    continue
            batch = self.runner.prefill(plan, cache, PREFILL)
            self.runner.insert(batch, cache, PREFILL, [None] * len(plan.chunks), keep=batch.final)
            with self._cond:
                sched.prefilled(plan, [s is not None for s in batch.streams])
            if not batch.final:
                continue
            start = time.perf_counter()
            shape = self.runner.whole(batch, cache)
            self.stats.transfer_bytes += self.executor.transfer(batch.handle)
            self.stats.transfers += 1
            with self._cond:  # its pages stay cached for later prompts
                sched.release_prefill(plan)
            self.executor.wait(batch.handle)
            self.stats.prefill_seconds += time.perf_counter() - start
            ready = dataclasses.replace(
                batch,
                shape=shape,
                rows=[None] * len(batch.streams),
                starts_P=np.zeros_like(batch.starts_P),
            )
            with self._cond:
                self._ready.append(ready)
                self._prefilling = []
                self._cond.notify_all()

    def _admit(self) -> None:
        """Colocated: prefills queued requests (and chunks of a long prompt) and writes them
        into their rows and pages: while requests decode, about ``max_prefill_tokens``
        padded tokens (one prefill at least) before the next step; else all that fit."""
        sched = self.scheduler
        budget = self.max_prefill_tokens if sched.running else None
        while budget is None or budget > 0:
            with self._cond:
                plan = sched.schedule_prefill(budget)
                self._took(plan)
            if not plan.chunks:
                break
            batch = self.runner.prefill(plan, self.cache, DECODE)
            live = [s is not None for s in batch.streams]
            slots = [
                c.row if plan.final and ok else None
                for c, ok in zip(plan.chunks, live, strict=True)
            ]
            self.runner.insert(batch, self.cache, DECODE, slots)
            with self._cond:
                sched.prefilled(plan, live)
                self._prefilling = []
            if budget is not None:
                budget -= plan.cost

    def _insert_ready(self) -> None:
        """Disaggregated: places the prefilled batches whose requests all fit, in order,
        and starts decoding them."""
        sched, batches = self.scheduler, []
        with self._cond:
            while self._ready:
                batch = self._ready[0]
                live = batch.live
                rows = sched.place([s.context[: batch.contexts[i]] for i, s in live])
                if rows is None:
                    break
                batch.rows = [None] * len(batch.streams)
                for (i, stream), row in zip(live, rows, strict=True):
                    batch.rows[i] = row
                    sched.start_decoding(row, stream, batch.contexts[i])
                batches.append(self._ready.popleft())
            self._cond.notify_all()
        for batch in batches:
            self.runner.insert(batch, self.cache, DECODE, batch.rows)

    def _wait_for_work(self, busy: bool) -> bool:
        """Blocks while there is nothing to do; False once the loop should end."""
        if not busy:
            self.executor.flush()  # the other processes dispatch what this one did
        with self._cond:
            if not busy:
                self._cond.wait_for(lambda: self._stopping or self.scheduler.waiting or self._ready)
                self.runner.loop_started()
            return not self._stopping

    def _decode_loop(self) -> None:
        """Decode steps over the rows, refilled in between.

        Step n+1 is dispatched before step n's tokens are read back, so the host's work
        (reading, streaming, stop checks, admitting) overlaps the device's. A request that
        finished at step n has one more token drawn at step n+1; it is dropped. Device
        programs run in the order they are dispatched (each takes the last one's donated
        state), so pages freed on the host are rewritten only after that extra step. While
        some running request has a grammar, each step's tokens are read before the next
        is dispatched (its masks follow them).
        """
        sched, owners = self.scheduler, self.scheduler.owners
        pending = None  # the last step's handle and who held each row then
        colocated = not self.disaggregated
        while self._wait_for_work(
            sched.running > 0 or pending is not None or (colocated and sched.chunking is not None)
        ):
            with self._cond:
                self._ended(s for _, s in sched.cancelled_running())
                if colocated:
                    self._ended([sched.cancelled_chunk()])
            if colocated:
                self._admit()
            else:
                self._insert_ready()
            with self._cond:
                short = sched.running > 0 and not sched.reserve()
            if short:  # read the step in flight (it may end requests), then preempt
                if pending is not None:
                    self._deliver(*pending)
                    pending = None
                with self._cond:
                    self.stats.preemptions += len(sched.preempt_for_room())
                    self._cond.notify_all()
            if constrained(owners) and pending is not None:
                self._deliver(*pending)  # the next step's masks follow its tokens
                pending = None
            dispatched = None
            if sched.running:
                with self._cond:
                    plan = sched.decode_plan()
                dispatched = (self.runner.step(plan, owners, self.cache), list(owners))
            if pending is not None:
                self._deliver(*pending)
            pending = dispatched
        self._end_all("shutdown")

    def _deliver(self, handle: int, holders: list) -> None:
        """Streams a step's tokens; frees each row whose request ended, at once."""
        self.runner.deliver(handle, holders, self.scheduler.owners, self._finished)

    def _finished(self, row: int) -> None:
        with self._cond:
            self.stats.finished += 1
            self._cond.notify_all()
            self.scheduler.finish(row)
