"""Continuous batching: requests queue, prefill in buckets, decode over a paged KV cache.

:class:`ContinuousBatcher` is a thin shell over the parts vLLM v1 splits serving into:
the scheduler (:mod:`jaxpar.engine._scheduler`, plain Python: admission, prefix
placement, chunks, preemption, as step plans), the cache manager (:mod:`._cache`: pages
and the prefix cache), the runner (:mod:`._runner`: plans through the recordable
executor, tokens back to their streams) and the serving core (:mod:`._core`: one step of
the three). The shell keeps the threads and loops, the life cycle and failures, the
multi-process part (:mod:`._process_group`), warm-up (:mod:`._batcher_programs`), stats.

Threads: clients :meth:`~ContinuousBatcher.submit` from any thread; the decode loop runs
in one thread, and when disaggregated the prefill loop in another. ``_cond`` guards what
they share (the scheduler and cache managers, ready prefills, counters, closing flags):
see :mod:`._core` for who owns what.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Sequence

import jax

from jaxpar.engine._admission import Admission
from jaxpar.engine._batcher_programs import (
    BatcherPrograms,
    batcher_parts,
)
from jaxpar.engine._cache import KVEventSink
from jaxpar.engine._chunk_cost import ChunkCost
from jaxpar.engine._core import ServingCore
from jaxpar.engine._efficiency import StepLog
from jaxpar.engine._engine import InferenceEngine
from jaxpar.engine._executor import Executor
from jaxpar.engine._grammar import Constraint, Grammar
from jaxpar.engine._host_pages import attach_host_tier
from jaxpar.engine._kv_budget import KVBudget, cache_dtype_name, describe
from jaxpar.engine._process_group import ProcessGroup
from jaxpar.engine._pulse import Pulse
from jaxpar.engine._requests import RequestStream, new_request
from jaxpar.engine._runner import BatcherStats, Runner
from jaxpar.engine._sampling import Sampling
from jaxpar.engine._slots import FirstTokens
from jaxpar.engine._spec_step import Speculation
from jaxpar.engine._speculative import SpeculativeConfig
from jaxpar.engine._warmup import Warmup, WarmupPlan
from jaxpar.errors import ConfigError, QueueFullError

#: Seconds :meth:`ContinuousBatcher.close` waits for its loops once a drain has run out
#: (one process): a loop compiling a program on first use is left to the process's exit.
LATE_JOIN_S = 2.0


class ContinuousBatcher:
    """Serves requests that arrive at any time over one engine's decode slots.

    Args:
        engine: runs decode; its ``max_batch`` is the number of slots, its
            ``max_seq_len`` bounds prompt + ``max_tokens`` - 1 per request.
        prefill_engine: disaggregated prefill on other devices (its own strategy, mesh,
            pages and prefix cache); default: on ``engine``, between decode steps.
        prefill_batch: most prompts prefilled together (a multiple of the prefill
            strategy's ``dp``). Default: ``4 * dp`` (disaggregated: its ``max_batch``).
        max_queue: requests waiting beyond this are refused (:class:`QueueFullError`).
        kv_budget: the paged KV cache's page size and size; default :class:`KVBudget`.
        prefix_caching: reuse earlier prompts' K/V pages that a new prompt starts with.
        max_prefill_tokens: prefill tokens (padded) run between two decode steps,
            whether or not requests are decoding (the first prefill always runs); longer
            prompts are prefilled in chunks of about that many tokens, and a long queue
            over several steps. Default: :func:`~._batcher_programs.default_max_prefill_tokens`.
        kv_offload_gb: a host tier for the prefix cache of that many GiB of host memory
            (per process): pages the device pool evicts are kept there, and copied back
            for a later prefix hit (:mod:`._host_tier`). None: evicted pages are dropped.
        speculative: speculative decoding (:class:`SpeculativeConfig`, or vLLM's JSON
            keys); default the engine's ``speculative``, else none.
        split_decode: on CPU, a decode step whose rows' lengths differ widely runs as two
            dispatches, short rows at their own block-table width
            (:mod:`._decode_groups`), when its fitted cost model says that costs less and
            both dispatches' programs are ready: compiled by the warm-up (those a split
            can run) and run once by the idle loop. A split never compiles, nor runs a
            program for the first time, while the streams wait. Default (None): on,
            except for pipelined engines (pp > 1), whose steps do not split, and in a
            multi-process job, where no group program is primed (none would ever run).
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
        kv_offload_gb: float | None = None,
        speculative: SpeculativeConfig | str | dict | None = None,
        split_decode: bool | None = None,
    ):
        self.engine, self.prefill_engine = engine, prefill_engine or engine
        self.disaggregated = prefill_engine is not None
        eng, limits = self.prefill_engine, (prefill_batch, max_prefill_tokens)
        if max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue, self.prefix_caching = max_queue, prefix_caching
        budget = kv_budget or KVBudget()
        if split_decode is None:  # a split runs only programs primed while idle, which
            # several processes do not do (their steps would wait in collectives)
            split_decode = engine.parallel_config.pp == 1 and jax.process_count() == 1
        p = batcher_parts(engine, prefill_engine, budget, prefix_caching, *limits, split_decode)
        self.pool, self.pages, self.slot_steps, self.cache = p.pool, p.pages, p.slot_steps, p.cache
        self.prefill_cache, self.prefill_slot_steps = p.prefill_cache, p.prefill_slot_steps
        #: The longest request (prompt + ``max_tokens`` - 1), and the longest prompt.
        self.max_seq_len, self.max_prompt_len = self.pool.max_seq_len, p.max_prompt_len
        self.scheduler, config = p.scheduler, p.scheduler.config
        self.prefill_batch, self.chunk_tokens = config.prefill_batch, config.chunk_tokens
        self.max_prefill_tokens = config.max_prefill_tokens
        self.first_tokens = FirstTokens(eng.steps)
        #: What a request may ask: one rule for the engine, batcher, CLI and server.
        vocab = engine.model_config.vocab_size
        self.admission = Admission(vocab, self.max_seq_len, self.max_prompt_len)
        self.stats = BatcherStats()
        #: Each step's shape facts and time, for efficiency metrics.
        self.step_log = StepLog(colocated=not self.disaggregated)
        self._cond = threading.Condition()
        #: Decode steps compiled by a warm-up and not run yet: (rows, block-table columns,
        #: a split step's group), run once each while the loop is idle
        #: (:meth:`_prime_idle`); and those it ran (groups in :attr:`primed_groups`).
        self._unprimed: collections.deque[tuple[int, int, bool]] = collections.deque()
        self.primed: list[tuple[int, int]] = []
        self.primed_groups: list[tuple[int, int]] = []
        #: Prefills a warm-up compiled for a long prompt's pieces, to time while idle
        #: (rows, new tokens, cached pages), and their times: the scheduler's
        #: :class:`~._chunk_cost.ChunkCost` once all are measured (one process only).
        self._unmeasured: collections.deque[tuple[int, int, int]] = collections.deque()
        self.prefill_samples: list[tuple[int, int, int, float]] = []
        self._to_measure, self._compiled_prefills = 0, []
        if self.scheduler.grouping is not None:  # splits run only primed group programs
            self.scheduler.grouping.ready = self._group_primed
        self._next_id, self._closing, self._stopping, self._closed = 0, False, False, False
        self._close_lock = threading.Lock()
        self.group = ProcessGroup()
        #: Not process 0: it replays process 0's commands (:meth:`follow`), never schedules.
        self.replays = self.group.replays
        prefill_steps = self.prefill_slot_steps if self.disaggregated else None
        self.executor = Executor(
            engine, eng, self.slot_steps, prefill_steps, self.first_tokens,
            keeps_outputs=not self.replays,
        )  # fmt: skip
        self.executor.recorder = self.group.leader  # dispatches; holds the device state
        args = (self.stats, self._cond)
        self.runner = Runner(self.executor, engine, eng, self.slot_steps, *args, self.step_log)
        self.core = ServingCore(self.scheduler, self.runner, self.cache, self.prefill_cache, *args)
        #: Speculative decoding's configuration (None: off); its counters in :attr:`spec_stats`.
        self.speculative = SpeculativeConfig.parse(speculative or engine.speculative)
        if split_decode and engine.parallel_config.pp > 1:
            raise ConfigError(
                f"split_decode runs unpipelined steps; {engine.parallel_config} has "
                f"pp={engine.parallel_config.pp}: leave split_decode at its default (off here)"
            )
        if self.speculative is not None and engine.parallel_config.pp > 1:
            raise ConfigError(
                f"speculative decoding does not compose with pipeline stages yet "
                f"({engine.parallel_config} has pp={engine.parallel_config.pp}): serve "
                "without it, or with pp=1"
            )
        if self.speculative is not None:
            self.core.speculation = Speculation(self.speculative, self.core)
        self.programs = BatcherPrograms(
            engine, eng, self.slot_steps, self.prefill_slot_steps, self.first_tokens,
            self.executor, self.cache, self.prefill_cache, self.scheduler, self.max_prompt_len,
        )  # fmt: skip
        #: The loops' threads, and those still running after :meth:`close` gave up on them.
        self._threads, self._stragglers = [], []
        #: The warm-up compiling (lazy: in the background while serving), once started.
        self.warming: Warmup | None = None
        self._failure: BaseException | None = None  # what stopped the loops
        #: The decode loop's heartbeat (a liveness probe reads :meth:`Pulse.stalled_s`).
        self.pulse = Pulse()
        #: The prefix cache's host tier (None: evicted pages are dropped).
        self.host_tier = None
        if kv_offload_gb is not None:
            steps = self.prefill_slot_steps
            self.host_tier = attach_host_tier(
                kv_offload_gb, self.prefill_cache, steps, self.executor
            )

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
        """Queues a request; its stream yields tokens as they are drawn (with ``logprobs``,
        each one's logprob and that many alternatives). ``grammar``: structured output, a
        :class:`Constraint` (compiled with the engine's tokenizer) or a grammar compiled
        for this model's vocabulary (:meth:`~jaxpar.engine._grammar.Grammars.compile`).

        Raises:
            ShapeError / CacheOverflowError: a bad prompt or one that does not fit.
            GrammarError: an invalid constraint, or a grammar for another vocabulary.
            ConfigError: a constraint, and an engine without a tokenizer.
            QueueFullError: ``max_queue`` requests are already waiting, or the batcher is
                closing.
        """
        if isinstance(grammar, Constraint):
            grammar = self.engine.grammar(grammar)
        ids, vocab = self.admission.check(prompt, max_tokens), self.engine.steps.vocab_size
        request = new_request(
            ids, max_tokens=max_tokens, vocab_size=vocab, sampling=sampling, seed=seed,
            stop_tokens=stop_tokens, logprobs=logprobs, grammar=grammar,
        )  # fmt: skip
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
            stream = RequestStream(self._next_id, request, on_finish=self._count_finished)
            self._next_id += 1
            self.scheduler.add(stream)
            self.stats.submitted += 1
            self._cond.notify_all()
        return stream

    @property
    def queued(self) -> int:
        """Requests waiting for a prefill."""
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
        return self.group.stats()

    @property
    def spec_stats(self):
        """Speculative decoding's counters (:class:`~._speculative.SpecStats`; None: off)."""
        speculation = self.core.speculation
        return None if speculation is None else speculation.stats

    @property
    def slots(self) -> int:
        return self.engine.max_batch

    def publish_kv_events(self, sink: KVEventSink | None) -> None:
        """Tells ``sink`` of every page the prefix cache indexes or evicts from now on
        (None: stop); the pool that caches is prefill's (the decode rows' colocated)."""
        self.prefill_cache.events = sink

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    # --- warm-up -------------------------------------------------------------------------

    def row_buckets(self) -> list[int]:
        """Prefill batch sizes (a prefill pads to the smallest that holds its prompts)."""
        return list(self.scheduler.config.row_buckets)

    def table_widths(self) -> list[int]:
        """The block-table widths a decode step compiles for (powers of two)."""
        return self.programs.table_widths()

    def warmup_plan(self, prompt_lens: Iterable[int] | None = None) -> WarmupPlan:
        """What :meth:`warmup` compiles for ``prompt_lens`` (default: all lengths)."""
        return self.programs.plan(prompt_lens)

    def warmup(
        self,
        prompt_lens: Iterable[int] | None = None,
        progress: Callable[[int, int, str], None] | None = None,
        *,
        lazy: bool = False,
        threads: int | None = None,
        kinds: Iterable[str] | None = None,
    ) -> list[tuple[int, int]]:
        """Compiles the programs of :meth:`warmup_plan` on ``threads`` threads (default:
        one per core, up to 8), calling ``progress(done, total, what)`` after each. Nothing
        runs. ``lazy``: return once the smallest prefill and decode step are compiled; the
        rest compile in the background (:attr:`warming`) while requests are served, or on
        first use. ``kinds``: only buckets of these kinds (e.g. ``("split",)``: a split
        decode step's groups; default all). Returns the (rows, length) prefill buckets
        compiled (or compiling)."""
        plan = self.warmup_plan(prompt_lens)
        if kinds is not None:
            wanted = set(kinds)
            plan = WarmupPlan(tuple(b for b in plan.buckets if b.kind in wanted), 0)
        jobs = [(b.describe(), self._then_prime(b)) for b in plan.buckets]
        # Lazy: the background compiles yield to requests (queued or running).
        hold = (lambda: self.stats.finished < self.stats.submitted) if lazy else None
        self.warming = Warmup(jobs, threads, progress, hold).start()
        if self._closing:  # closed meanwhile: compile nothing more
            self.warming.stop()
        self.warming.wait_first(plan.first if lazy else len(plan))
        return [(b.rows, b.tokens) for b in plan.buckets if b.kind == "prefill"]

    def _then_prime(self, bucket) -> Callable[[], None]:
        """``bucket``'s compile; a decode step's then waits for the decode loop to run it
        once while idle (:meth:`_prime_idle`)."""
        compile_ = self.programs.compiler(bucket)
        if bucket.kind not in ("decode", "split"):
            config = self.scheduler.config
            alone = bucket.rows == config.row_buckets[0]  # a long prompt's pieces go alone
            # After cached tokens, pieces of at most long_chunk_tokens are timed: a longer
            # one there costs what the fit says (seconds each at long contexts on CPU).
            small = bucket.kind == "prefill" or bucket.tokens <= config.long_piece
            if not (alone and small) or self.group.leader is not None:
                return compile_
            self._to_measure += 1

            def measure() -> None:
                compile_()
                with self._cond:  # timed once all are compiled (fewer compiles beside)
                    n_pages = bucket.context // self.pool.page_size
                    self._compiled_prefills.append((bucket.rows, bucket.tokens, n_pages))
                    if len(self._compiled_prefills) == self._to_measure:
                        self._unmeasured.extend(self._compiled_prefills)
                        self._cond.notify_all()

            return measure
        if self.group.leader is not None:
            # Several processes: a step primed here would wait in its collectives for the
            # others, which replay only once their own warm-up is done (on a loaded host,
            # past the CPU collective and gloo set-up timeouts).
            return compile_
        width = bucket.tokens // self.pool.page_size

        def run() -> None:
            compile_()
            with self._cond:
                self._unprimed.append((bucket.rows, width, bucket.kind == "split"))
                self._cond.notify_all()

        return run

    def _group_primed(self, computed: int, width: int) -> bool:
        """A split step's group over ``computed`` rows per shard at ``width`` columns has
        a compiled program that already ran once (:meth:`_prime_idle`)."""
        return (computed * self.pool.shards, width) in self.primed_groups

    def _prime_idle(self) -> bool:
        """With nothing queued, running or in flight: runs one compiled decode step that
        never ran (:meth:`Executor.prime_step <jaxpar.engine._executor.Executor.prime_step>`),
        so its first, slower run stalls no request; then times one compiled prefill
        (:meth:`_measure`). True if it ran either."""
        with self._cond:
            busy = self.scheduler.waiting or self.scheduler.running or self.core.ready
            if busy or self._stopping or not (self._unprimed or self._unmeasured):
                return False
            if not self._unprimed:
                shape = self._unmeasured.popleft()
            else:
                rows, width, group = self._unprimed.popleft()
                shape = None
        if shape is not None:
            self._measure(*shape)
            return True
        self.executor.prime_step(rows, width, indexed=group)
        (self.primed_groups if group else self.primed).append((rows, width))
        return True

    def _measure(self, rows: int, length: int, n_pages: int) -> None:
        """Times a compiled prefill (its second run: the first is slower); once every one
        the warm-up compiled for a single row is timed, the scheduler sizes a long prompt's
        pieces by their costs (:class:`~._chunk_cost.ChunkCost`)."""
        self.executor.time_prefill(rows, length, n_pages)
        ms = 1e3 * self.executor.time_prefill(rows, length, n_pages)
        self.prefill_samples.append((rows, length, n_pages * self.pool.page_size, ms))
        if len(self.prefill_samples) == self._to_measure:
            with self._cond:
                self.scheduler.chunk_cost = ChunkCost.of(self.prefill_samples)

    # --- life cycle ----------------------------------------------------------------------

    def start(self) -> ContinuousBatcher:
        """Starts the decode loop (and the prefill loop when disaggregated) in threads.

        In a multi-process job, process 0 only; it also watches the other processes'
        heartbeats and fails every request, naming the process, if one is lost."""
        if self.replays:
            raise ConfigError(
                f"process {self.group.index} replays process 0's schedule: call "
                "follow() there, and start() on process 0"
            )
        if self._threads:
            return self
        self.group.watch(self.fail)
        self.executor.start()
        loops = [self._decode_loop] + ([self._prefill_loop] if self.disaggregated else [])
        for loop in loops:  # an exception in one ends every request (finish reason "error")
            run = self.group.guard(loop, self.fail, lambda: self._failure is not None)
            thread = threading.Thread(target=run, name=loop.__name__, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def follow(self) -> int:
        """A process other than 0 of a multi-process job: replays process 0's commands
        until its batcher closes (returns how many). Raises :class:`PeerLostError` if
        process 0 is gone, or a collective lost another process."""
        if not self.replays:
            raise ConfigError("process 0 schedules (start()); follow() is for the others")
        return self.group.follow(self.executor)

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
            with self._cond:
                self._cond.wait_for(self._idle, timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            late = drain and not self._idle()
        if late:  # drained for ``timeout``: what is left ends now, not after the loops'
            self._end_all("shutdown")  # step (or a compile) in flight: clients hear at once
        wait = None
        if self._failure is not None:  # a loop may be stuck in a collective with a lost
            wait = 1.0  # process (it ends with the process: the loops are daemon threads)
        elif late and self.group.leader is None:  # a loop may be compiling on first use
            wait = LATE_JOIN_S  # (minutes for a big model): its requests are ended
        for thread in self._threads:
            thread.join(wait)
        self._stragglers = [t for t in self._threads if t.is_alive()]
        self._threads = []
        self._end_all("shutdown")  # what never started (or was never taken) ends too
        self.group.close(failed=self._failure is not None)  # the others return from follow()

    def __enter__(self) -> ContinuousBatcher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _count_finished(self) -> None:
        """A request finished (its stream calls this once, before its waiters wake)."""
        with self._cond:
            self.stats.finished += 1
            self._cond.notify_all()

    def _idle(self) -> bool:
        """Every submitted request has finished (none queued, prefilling or decoding)."""
        return self.stats.finished == self.stats.submitted

    def _end_all(self, reason: str, error: BaseException | None = None) -> None:
        with self._cond:
            streams = self.core.holding()
        for stream in streams:
            stream.finish(reason, error)

    # --- loops ---------------------------------------------------------------------------

    def _prefill_loop(self) -> None:
        """Disaggregated: prefills on the prefill devices, ahead of decode."""
        while True:
            self.executor.flush()  # before waiting: the others dispatch what this one did
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self.core.wants_prefill())
                if self._stopping:
                    return
            if not self.core.prefill_ahead():  # nothing fits its pool yet
                self.executor.flush()
                with self._cond:
                    self._cond.wait(0.01)

    def _wait_for_work(self, busy: bool) -> bool:
        """Blocks while there is nothing to do; False once the loop should end. Each
        call is a beat of :attr:`pulse` (a wait is not a stall)."""
        self.pulse.beat()
        if not busy:
            self.executor.flush()  # the other processes dispatch what this one did
        with self._cond:
            if not busy:
                waiting = lambda: (  # noqa: E731
                    self.scheduler.waiting or self.core.ready or self._unprimed or self._unmeasured
                )
                with self.pulse.waiting():
                    self._cond.wait_for(lambda: self._stopping or waiting())
                self.runner.loop_started()
            return not self._stopping

    def _decode_loop(self) -> None:
        """Decode steps over the rows (:meth:`ServingCore.decode
        <jaxpar.engine._core.ServingCore.decode>`), refilled in between."""
        sched, core = self.scheduler, self.core
        pending = None  # the step in flight: its handle and who held each row then
        chunking = lambda: not self.disaggregated and sched.chunking is not None  # noqa: E731
        while self._wait_for_work(sched.running > 0 or pending is not None or chunking()):
            if pending is None and not chunking() and self._prime_idle():
                continue
            core.cancel_running()
            if self.disaggregated:
                core.insert_ready()
            else:
                core.admit(self.max_prefill_tokens)
            pending = core.decode(pending)
        self._end_all("shutdown")
