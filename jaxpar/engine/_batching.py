"""Continuous batching: requests queue, prefill in buckets, decode over a paged KV cache.

:class:`ContinuousBatcher` runs one decode loop over the engine's ``max_batch`` rows
(:mod:`jaxpar.engine._slots`) and a pool of KV pages (:mod:`jaxpar.engine._pages`).
Between two decode steps it frees the rows and pages of finished or cancelled requests
and admits queued requests, in order, while their pages fit: their prompts are prefilled
together (up to ``prefill_batch`` at a time, padded to a power-of-two bucket), and each
one's K/V is written into its pages. A running request takes a page whenever it crosses a
page boundary; when its batch shard has none left, the most recently admitted request of
that shard is preempted: its pages are freed and it goes back to the front of the queue,
to be prefilled again from its prompt and the tokens it already drew (with the same
sampling steps, so its tokens are those it would have drawn anyway). A request never
waits for another to finish, and nothing recompiles per request: prefill and insert
compile once per bucket, the decode step once per block-table width.

Prefix caching: the full pages a prompt wrote stay indexed by their tokens (a hash chain,
:mod:`jaxpar.engine._prefix`) after the request ends, until the pool needs them. A new
request is placed in the batch shard holding the longest cached run of its prefix, shares
those pages (reference-counted, never written while shared), and prefills only the rest:
a *prefill with context*, whose tokens also attend to the cached K/V (read from the
pages into the prefill layout). At least its last token is computed, for its logits.

Chunked prefill: while requests decode, at most ``max_prefill_tokens`` (padded) are
prefilled between two decode steps. A prompt longer than a chunk is prefilled alone, one
chunk (whole pages) per step, each a prefill with context over the chunks before it, so
running requests keep streaming; its row starts decoding after its last chunk.

Structured output: a request with a grammar (:mod:`jaxpar.engine._grammar`) draws every
token under its row's token mask, an input of the first-token draw and of the decode step
(every bit set in the other rows: nothing recompiles). A mask depends on the token drawn
just before, so while some running request has a grammar, each decode step's tokens are
read back before the next step is dispatched: the host's reading, streaming and mask
computation no longer overlap the device's step (with no grammar running, steps are
dispatched ahead as before, and the masks are one array placed once). The masks are host
arrays in the executor's commands, so in a multi-process job they reach every process
with the step that uses them; only process 0 keeps matchers.

Disaggregated (``prefill_engine`` given): prefill runs on that engine's devices with its
own strategy, in a thread of its own, so it overlaps the decode steps. The prefill group
keeps a page pool of its own for its prefix cache and chunks; each finished batch's K/V
(read back from its pages when it had context) and logits move to the decode devices
once (:attr:`BatcherStats.transfer_bytes`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np

from jaxpar.engine._admission import Admission
from jaxpar.engine._distributed import peer_failures
from jaxpar.engine._efficiency import StepLog
from jaxpar.engine._engine import InferenceEngine
from jaxpar.engine._executor import DECODE, PREFILL, Executor
from jaxpar.engine._grammar import Constraint, Grammar, all_allowed, fill_masks
from jaxpar.engine._kv_budget import (
    KVBudget,
    cache_dtype_name,
    describe,
    size_pool,
)
from jaxpar.engine._kv_regroup import regrouped_shapes
from jaxpar.engine._lockstep import (
    HEARTBEAT_S,
    Heartbeat,
    Leader,
    Monitor,
    follow,
    lost_error,
)
from jaxpar.engine._logprobs import MAX_TOP_LOGPROBS, Logprobs, TokenLogprob
from jaxpar.engine._pages import PageTable
from jaxpar.engine._penalties import History
from jaxpar.engine._prefix import cache_salt, page_keys
from jaxpar.engine._requests import Request, RequestStream
from jaxpar.engine._sampling import RowSampling, Sampling
from jaxpar.engine._slots import FirstTokens, Inserted, SlotSteps
from jaxpar.engine._warmup import Bucket, Warmup, WarmupPlan, ordered
from jaxpar.errors import (
    ConfigError,
    GrammarError,
    PeerLostError,
    QueueFullError,
    ShapeError,
)
from jaxpar.models import KVCache
from jaxpar.spec import Module, Phase, mesh_axes

#: Seconds :meth:`ContinuousBatcher.close` waits for its loops once a drain has run out
#: (one process): a loop compiling a program on first use is left to the process's exit.
LATE_JOIN_S = 2.0
#: Prefilled batches waiting for decode slots (disaggregated): enough to keep the decode
#: side fed without prefilling far ahead of it.
READY_BATCHES = 2


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


@dataclasses.dataclass
class _Prefill:
    """A request admitted for prefill: its decode row and pages are taken (colocated), and
    ``done`` tokens of its context are already in its pages (a prefix hit, then chunks)."""

    stream: RequestStream
    row: int | None
    context: list[int]  # what its pages will hold: the prompt, and tokens drawn before
    keys: list[bytes]  # prefix keys of the context's full pages
    done: int = 0

    @property
    def remaining(self) -> int:
        return len(self.context) - self.done


@dataclasses.dataclass
class _Side:
    """Pages a prefill reads its context from and writes its K/V into: the decode rows'
    own (colocated), or the prefill group's (disaggregated: its own pool on its devices,
    which also holds its prefix cache; finished prompts move to the decode group whole)."""

    name: str  # the executor's name of these pages (DECODE or PREFILL)
    pages: PageTable
    slot_steps: SlotSteps
    owners: list[RequestStream | None]  # decoding rows (colocated); None: free or prefilling
    caching: bool  # prefix caching on these pages


@dataclasses.dataclass
class _Batch:
    """Requests prefilled together (whole, or one chunk of one long prompt); their prefill
    results are the executor's batch ``handle`` (``shape``: its rows and tokens).

    ``streams[i]`` is row i's request, or None once it finished at its first token.
    """

    streams: list[RequestStream | None]
    handle: int
    shape: tuple[int, int]
    sampling_P: RowSampling
    contexts: list[int]  # tokens each row has cached after this batch
    steps_P: np.ndarray  # tokens each row had drawn before its prefill (preempted: > 0)
    rows: list[int | None]  # decode rows taken at admission (None: placed at insert)
    starts_P: np.ndarray  # tokens each row had cached before this batch (page-aligned)
    final: bool = True  # False: a chunk that leaves more of its prompt to prefill
    works: list[_Prefill] | None = None  # the admitted requests (None: moved to decode)
    history: History | None = None  # each row's context, for its penalties (None: none)

    @property
    def live(self) -> list[tuple[int, RequestStream]]:
        return [(i, s) for i, s in enumerate(self.streams) if s is not None]


class ContinuousBatcher:
    """Serves requests that arrive at any time over one engine's decode slots.

    Args:
        engine: runs decode; its ``max_batch`` is the number of slots, its
            ``max_seq_len`` bounds prompt + ``max_tokens`` - 1 per request.
        prefill_engine: disaggregated prefill on other devices (its own strategy and
            mesh); default: prefill on ``engine``, between decode steps.
        prefill_batch: most prompts prefilled together (a multiple of the prefill
            strategy's ``dp``); fewer waiting use the smallest row bucket (``dp`` doubled)
            that holds them. Default: ``4 * dp`` (the prefill engine's ``max_batch`` when
            disaggregated).
        max_queue: requests waiting beyond this are refused (:class:`QueueFullError`).
        kv_budget: the paged KV cache's page size and size (a token budget or a fraction
            of free device memory); default :class:`KVBudget`. ``engine.max_seq_len``
            bounds one request, capped by what one batch shard's pages hold.
        prefix_caching: reuse the K/V pages of earlier requests' prompts that a new
            prompt starts with (disaggregated: in the prefill group's own pages).
        max_prefill_tokens: prefill tokens (padded) run between two decode steps while
            requests are decoding; a prompt longer than a chunk is prefilled in chunks
            of about that many tokens, with decode steps in between. Default:
            :func:`default_max_prefill_tokens`.
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
        self.prefill_engine = prefill_engine or engine
        self.disaggregated = prefill_engine is not None
        program = engine.program
        self.pool = size_pool(
            kv_budget or KVBudget(),
            config=engine.parallel_config,
            mesh=engine.mesh,
            dims=program.run,
            rows=engine.max_batch,
            max_seq_len=engine.max_seq_len,
            step_temp_bytes=lambda: _step_temp_bytes(engine),
        )
        self.pages = PageTable(self.pool)
        self.slot_steps = SlotSteps(engine.steps, program.run, self.pool)
        #: The longest request (prompt + max_tokens - 1).
        self.max_seq_len = self.pool.max_seq_len
        if self.disaggregated:
            _check_pair(engine, prefill_engine)
        self.first_tokens = FirstTokens(self.prefill_engine.steps)
        self.prefill_batch = _prefill_batch(self.prefill_engine, prefill_batch, prefill_engine)
        if max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self.max_prompt_len = min(self.max_seq_len, self.prefill_engine.max_seq_len)
        #: What a request may ask (prompt ids and length, new tokens): one rule for the
        #: engine, this batcher, ``jaxpar run`` and the server.
        self.admission = Admission(
            engine.model_config.vocab_size, self.max_seq_len, self.max_prompt_len
        )
        self.prefix_caching = prefix_caching
        self._salt = cache_salt(program.run)
        self.max_prefill_tokens = max_prefill_tokens or default_max_prefill_tokens(
            engine.mesh.devices.flat[0].platform, self.pool.page_size
        )
        if self.max_prefill_tokens < 1:
            raise ConfigError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        #: Tokens of one chunk of a long prompt: what fits ``max_prefill_tokens`` in the
        #: smallest prefill row bucket, in whole pages (chunks start on a page boundary).
        self.chunk_tokens = (
            max(self.max_prefill_tokens // self.row_buckets()[0] // self.pool.page_size, 1)
            * self.pool.page_size
        )
        self._chunking: _Prefill | None = None  # a long prompt between two of its chunks
        #: Requests taken from the queue for the prefill in flight, until they decode (or
        #: their batch is ready): ended with the rest if the batcher fails meanwhile.
        self._prefilling: list[RequestStream] = []
        self.stats = BatcherStats()
        #: Each step's shape facts and time, for efficiency metrics.
        self.step_log = StepLog(colocated=not self.disaggregated)
        self._cond = threading.Condition()
        self._queue: collections.deque[RequestStream] = collections.deque()
        self._ready: collections.deque[_Batch] = collections.deque()
        self._active = 0
        self._next_id = 0
        self._closing = False
        self._stopping = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._owners: list[RequestStream | None] = [None] * engine.max_batch
        decode_side = _Side(DECODE, self.pages, self.slot_steps, self._owners, False)
        if self.disaggregated:
            self._decode_side = decode_side
            self._side = self._prefill_side(kv_budget or KVBudget())
        else:
            self._decode_side = self._side = dataclasses.replace(
                decode_side, caching=prefix_caching
            )
        #: Dispatches the programs and holds their device state (:mod:`._executor`).
        self.executor = Executor(
            engine,
            self.prefill_engine,
            self.slot_steps,
            self._side.slot_steps if self.disaggregated else None,
            self.first_tokens,
            keeps_outputs=not self.replays,
        )
        #: Process 0 of a multi-process job: sends the executor's commands to the others.
        self.leader = Leader() if jax.process_count() > 1 and not self.replays else None
        self.executor.recorder = self.leader
        self._monitor: Monitor | None = None
        multi = jax.process_count() > 1
        self._heartbeat = Heartbeat().start() if multi and self.replays else None
        self._lengths = np.zeros(engine.max_batch, np.int64)  # tokens cached per row (host)
        self._admitted = np.zeros(engine.max_batch, np.int64)  # admission order per row
        self._admissions = 0
        self._tables: tuple[int, ...] | None = None  # (version, width, rows) last placed
        self._threads: list[threading.Thread] = []
        #: Loop threads still running after :meth:`close` gave up waiting for them.
        self._stragglers: list[threading.Thread] = []
        #: The warm-up compiling (lazy: in the background while serving), once started.
        self.warming: Warmup | None = None
        self._failure: BaseException | None = None
        self._loop_started = self._last_read = 0.0  # for BatcherStats.decode_seconds

    def _prefill_side(self, budget: KVBudget) -> _Side:
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
        slot_steps = SlotSteps(eng.steps, eng.program.run, pool)
        owners = [None] * eng.max_batch
        return _Side(PREFILL, PageTable(pool), slot_steps, owners, self.prefix_caching)

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
            GrammarError: an invalid constraint, or a grammar compiled for another
                vocabulary.
            ConfigError: a constraint, and an engine without a tokenizer.
            QueueFullError: ``max_queue`` requests are already waiting, or the batcher is
                closing.
        """
        if isinstance(grammar, Constraint):
            grammar = self.engine.grammar(grammar)
        request = Request(
            prompt=tuple(int(t) for t in self._check(prompt, max_tokens)),
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
            if len(self._queue) >= self.max_queue:
                raise QueueFullError(
                    f"{len(self._queue)} requests are already waiting (max_queue="
                    f"{self.max_queue}); retry shortly"
                )
            stream = RequestStream(self._next_id, request)
            self._next_id += 1
            self._queue.append(stream)
            self.stats.submitted += 1
            self._cond.notify_all()
        return stream

    def _check(self, prompt: Sequence[int], max_tokens: int) -> np.ndarray:
        return self.admission.check(prompt, max_tokens)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        """Requests holding a decode slot."""
        return self._active

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV cache's pages held by running requests (0..1)."""
        return self.pages.usage

    def describe_cache(self) -> str:
        """One line: the KV cache's pages, tokens and their dtype, GiB per device,
        sequences that fit."""
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
        if self.leader is None:
            return None
        lead = self.leader
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
    def prefill_slot_steps(self) -> SlotSteps:
        """The page programs prefill reads its context through (disaggregated: the
        prefill group's own pages)."""
        return self._side.slot_steps

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    @property
    def failure(self) -> BaseException | None:
        return self._failure

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

    def row_buckets(self) -> list[int]:
        """Prefill batch sizes: the prefill's batch shards (dp, times ep for a MoE) times
        powers of four, up to ``prefill_batch`` (few prefill compiles; a batch pads to at
        most four times its prompts)."""
        rows, out = _prefill_rows(self.prefill_engine), []
        while rows < self.prefill_batch:
            out.append(rows)
            rows *= 4
        return [*out, self.prefill_batch]

    def _rows(self, n: int) -> int:
        return next(r for r in self.row_buckets() if r >= n)

    def warmup_plan(self, prompt_lens: Iterable[int] | None = None) -> WarmupPlan:
        """What :meth:`warmup` compiles, smallest first: prefill and insert for each
        (rows, prompt-length bucket) (colocated, prompt lengths stop at a chunk's bucket:
        a longer prompt is prefilled in chunks), prefill with context for each (rows,
        new tokens, cached pages), then the decode step for each (rows, block-table
        width).

        Args:
            prompt_lens: the prompt lengths to cover (default: all up to ``max_seq_len``).
        """
        lens = list(prompt_lens or range(1, self.max_prompt_len + 1))
        eng = self.prefill_engine
        if self.disaggregated:  # whole prompts move to the decode group: every length
            lengths = {eng.bucket(n) for n in lens}
        else:
            lengths = {eng.bucket(min(n, self.chunk_tokens)) for n in lens}
        buckets = [Bucket("prefill", rows, t) for rows in self.row_buckets() for t in lengths]
        z = self.pool.page_size
        buckets += [Bucket("context", r, t, n * z) for r, t, n in self._context_buckets(max(lens))]
        buckets += [
            Bucket("decode", rows, width * z)
            for rows in self.slot_steps.row_buckets()
            for width in self.table_widths()
        ]
        return ordered(buckets)

    def warmup(
        self,
        prompt_lens: Iterable[int] | None = None,
        progress: Callable[[int, int, str], None] | None = None,
        *,
        lazy: bool = False,
        threads: int | None = None,
    ) -> list[tuple[int, int]]:
        """Compiles the programs of :meth:`warmup_plan` on ``threads`` threads (default:
        one per core, up to 8). Nothing runs.

        Args:
            prompt_lens: the prompt lengths to cover (default: all up to ``max_seq_len``).
            progress: called as ``progress(done, total, what)`` after each bucket.
            lazy: return once the smallest prefill and decode step are compiled; the rest
                compile in the background (:attr:`warming`), or on first use. Default:
                return once every program is compiled.
            threads: warm-up threads.

        Returns:
            The (rows, length) prefill buckets compiled (or being compiled).
        """
        plan = self.warmup_plan(prompt_lens)
        jobs = [(b.describe(), self._compiler(b)) for b in plan.buckets]
        # Lazy: the background compiles yield to requests (a request that needs a program
        # not compiled yet compiles it, or waits for the thread compiling it).
        hold = self._serving if lazy else None
        self.warming = Warmup(jobs, threads, progress, hold).start()
        if self._closing:  # closed meanwhile: compile nothing more
            self.warming.stop()
        self.warming.wait_first(plan.first if lazy else len(plan))
        return [(b.rows, b.tokens) for b in plan.buckets if b.kind == "prefill"]

    def _serving(self) -> bool:
        """Some request is queued or running (the lazy warm-up's background waits)."""
        return self.stats.finished < self.stats.submitted

    def _compiler(self, bucket: Bucket) -> Callable[[], object]:
        z = self.pool.page_size
        if bucket.kind == "decode":
            width = bucket.tokens // z
            return lambda: self.slot_steps.compile_step(self.engine.params, width, bucket.rows)
        n_pages = bucket.context // z
        return lambda: self._compile_prefill(bucket.rows, bucket.tokens, n_pages)

    def _compile_prefill(self, rows: int, length: int, n_pages: int = 0) -> None:
        """Compiles a prefill of ``[rows, length]`` tokens (after ``n_pages`` cached pages)
        and what follows it: the first tokens' draw, the insert into pages (and, on a
        disaggregated prefill group, the read of whole prompts back from its pages)."""
        eng, side = self.prefill_engine, self._side
        logits, k, v = eng.steps.compile_prefill(eng.params, rows, length)
        if n_pages:
            context = n_pages * self.pool.page_size
            side.slot_steps.compile_context(rows, n_pages, eng.layouts.kv_prefill)
            eng.steps.compile_prefill_context(eng.params, rows, length, context)
        self.first_tokens.compile(logits)
        row_ints = jax.ShapeDtypeStruct((rows,), np.int32)
        side.slot_steps.compile_insert(Inserted(k, v, row_ints, row_ints))
        if self.disaggregated:
            quantizer = self.executor._quantizer  # quantized decode cache: quantized K/V in
            if quantizer is not None:
                k, v = quantizer.compile(k, v)
            have, want = eng.run.kv_head_replicas, self.engine.run.kv_head_replicas
            if have != want:  # the decode group holds another count of each K/V head
                k, v = (regrouped_shapes(x, have, want) for x in (k, v))
            self.slot_steps.compile_insert(Inserted(k, v, row_ints, row_ints))
            whole = side.pages.pool.pages_for(length)
            side.slot_steps.compile_context(rows, whole, eng.layouts.kv_prefill, length)

    def _context_buckets(self, longest: int) -> list[tuple[int, int, int]]:
        """(rows, new tokens, cached pages) of every prefill with context for prompts of
        up to ``longest`` tokens: chunks of long prompts (one row bucket), and with
        prefix caching, prefix hits (every row bucket)."""
        z = self.pool.page_size
        if longest <= self.chunk_tokens and not self.prefix_caching:
            return []
        # Cached tokens are whole pages, and at least one token of a prompt is computed.
        n_pages = {self._context_width(n) for n in range(1, (longest - 1) // z + 1)}
        rows = self.row_buckets() if self.prefix_caching else self.row_buckets()[:1]
        return [(r, t, n) for r in rows for t in self._context_lengths() for n in sorted(n_pages)]

    def _context_lengths(self) -> list[int]:
        """New-token buckets of a prefill with context: a chunk's bucket, and a quarter of
        it (a short suffix after a prefix hit pads to that: few compiles)."""
        top = self.prefill_engine.bucket(self.chunk_tokens)
        return sorted({top, max(8, top // 4)} if top >= 8 else {top})

    def _context_width(self, need: int) -> int:
        """Cached pages a prefill with context reads for ``need`` pages: a power of four
        (the context's attention is a small part of a chunk's cost; few compiles), at
        most the power of two that holds a whole row."""
        cap = 1 << (self._side.pages.pool.pages_per_row - 1).bit_length()
        n = 1
        while n < need:
            n *= 4
        return min(n, cap)

    def table_widths(self) -> list[int]:
        """The block-table widths a decode step compiles for (powers of two)."""
        lengths = range(1, self.max_seq_len + 1, self.pool.page_size)
        widths = {self.pages.width(t) for t in lengths}
        return sorted(widths | {self.pages.width(self.max_seq_len)})

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
        """Stops taking requests, then ends the loops.

        ``drain``: let queued and running requests finish first (up to ``timeout``
        seconds); what is left is then cancelled with finish reason ``"shutdown"``.
        A second call (e.g. a signal's drain, then the server's shutdown) waits for the
        first to finish.
        """
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
            with self._cond:
                self._cond.wait_for(self._idle, _remaining(deadline))
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            late = drain and not self._idle()
        if late:  # drained for ``timeout``: what is left ends now, not after the loops'
            self._end_all("shutdown")  # step (or a compile) in flight: clients hear at once
        wait = None
        if self._failure is not None:
            # After a failure a loop may be stuck in a collective with a lost process
            # (it ends with the process: the loops are daemon threads).
            wait = 1.0
        elif late and self.leader is None:
            # A loop may be compiling a program on first use (minutes for a big model):
            # its requests are ended; one process has nobody to keep in step with.
            wait = LATE_JOIN_S
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
            streams = [*self._queue, *(s for b in self._ready for s in b.streams if s)]
            streams += self._prefilling
            if self._chunking is not None:
                streams.append(self._chunking.stream)
            self._queue.clear()
            self._ready.clear()
        for stream in [*streams, *self._owners_snapshot()]:
            stream.finish(reason, error)

    def _owners_snapshot(self) -> list[RequestStream]:
        return [s for s in list(self._owners) if s is not None]

    # --- prefill -------------------------------------------------------------------------

    def _wanted(self) -> RequestStream | None:
        """The first queued request that is still wanted (call with the lock held)."""
        while self._queue:
            stream = self._queue[0]
            if not stream.cancel_requested:
                return stream
            self._queue.popleft()
            stream.finish(stream.cancel_reason)
            self.stats.finished += 1
            self._cond.notify_all()
        return None

    def _take(self, n: int) -> list[_Prefill]:
        """Up to ``n`` queued requests that are still wanted, in order, unplaced
        (disaggregated prefill; call with the lock held)."""
        taken = []
        while len(taken) < n and (stream := self._wanted()) is not None:
            self._queue.popleft()
            context = _context(stream)
            taken.append(_Prefill(stream, None, context, []))
        return taken

    def _admit_work(self, budget: int | None, side: _Side) -> list[_Prefill]:
        """The next prefill on ``side`` (call with the lock held): the next chunk of a long
        prompt, or queued requests placed in free rows with their pages (the cached ones
        of their prefix shared), in order, while their pages fit, their padded tokens stay
        within ``budget`` (None: no bound), and each fits one chunk. A request longer than
        a chunk is prefilled alone, chunk by chunk, even with nothing decoding: on CPU a
        4,096-token prompt prefilled whole took 3-4x as long as in chunks (its bucket
        pads it, and its attention is one [T, T] block)."""
        if self._chunking is not None:
            work = self._chunking
            cost = self._cost(1, min(work.remaining, self.chunk_tokens))
            return [work] if budget is None or cost <= budget else []
        works: list[_Prefill] = []
        while len(works) < self.prefill_batch and (stream := self._wanted()) is not None:
            work = self._place(stream, [w.row for w in works], side=side)
            if work is None:
                break
            long = work.remaining > self.chunk_tokens
            longest = max(w.remaining for w in [*works, work])
            cost = self._cost(len(works) + 1, min(longest, self.chunk_tokens))
            if (works and long) or (budget is not None and works and cost > budget):
                side.pages.release(work.row)  # it waits for the next prefill
                break
            self._queue.popleft()
            self._count_hit(work, side)
            works.append(work)
            if long:  # alone, chunk by chunk
                self._chunking = work
                break
        return works

    def _cost(self, n: int, longest: int) -> int:
        """Padded tokens of a prefill of ``n`` rows of up to ``longest`` new tokens."""
        return self._rows(n) * self.prefill_engine.bucket(longest)

    def _place(
        self,
        stream: RequestStream,
        taken: list[int | None],
        context: list[int] | None = None,
        side: _Side | None = None,
    ) -> _Prefill | None:
        """A free decode row, its shard's cached pages of the request's prefix, and pages for
        the rest of its context and its first new token: in the shard with the longest
        cached prefix (then the most free pages). None if no shard has room."""
        side = side or self._decode_side
        pages = side.pages
        context = _context(stream) if context is None else context
        z, n = self.pool.page_size, len(context)
        keys = page_keys(context, z, self._salt) if side.caching else []
        # At least one token is computed: its logits draw the first new one.
        lookup_keys = keys[: (n - 1) // z]
        tokens = min(n + 1, pages.pool.max_seq_len)
        best, seen = None, set()
        for row, owner in enumerate(side.owners):
            shard = pages.shard(row)
            if owner is not None or row in taken or pages.held_B[row] or shard in seen:
                continue
            seen.add(shard)
            hit = pages.lookup(shard, lookup_keys)
            room = pages.free_pages(shard) - pages.reusable(shard, hit)
            if pages.pool.groups * (pages.pool.pages_for(tokens) - len(hit)) > room:
                continue
            score = (len(hit), pages.free_pages(shard))
            if best is None or score > best[0]:
                best = (score, row, hit)
        if best is None:
            return None
        _, row, hit = best
        pages.share(row, hit)
        pages.grow(row, tokens)
        return _Prefill(stream, row, context, keys, done=len(hit) * z)

    def _count_hit(self, work: _Prefill, side: _Side) -> None:
        """Prefix-cache counters, and the request's ``cached_tokens`` on its first
        admission (call with the lock held)."""
        if not side.caching:
            return
        self.stats.prefix_queries += len(work.context)
        self.stats.prefix_hits += work.done
        stream = work.stream
        if not stream.tokens:  # not a preempted request coming back
            stream.cached_tokens = min(work.done, len(stream.request.prompt))
            self.stats.prompt_tokens_cached += stream.cached_tokens

    def _prefill(self, works: list[_Prefill], side: _Side) -> _Batch:
        """Prefills ``works`` together (or the next chunk of one long prompt) and, for those
        it completes, draws their first tokens (sent to the clients at once); the results
        laid out for the decode engine. A request with cached tokens (a prefix hit, earlier
        chunks) attends to them, read from ``side``'s pages. A preempted request is
        prefilled with the tokens it drew, and draws its next one at its own step."""
        eng, rows = self.prefill_engine, self._rows(len(works))
        start = time.perf_counter()
        with self._cond:
            self._prefilling = [w.stream for w in works]
        takes = [min(w.remaining, self.chunk_tokens) for w in works]
        final = all(t == w.remaining for t, w in zip(takes, works, strict=True))
        streams = [w.stream for w in works]
        steps_P = np.zeros(rows, np.int32)
        steps_P[: len(works)] = [len(s.tokens) for s in streams]
        starts_P = np.zeros(rows, np.int32)
        starts_P[: len(works)] = [w.done for w in works]
        with_context = bool(starts_P.any())
        length = eng.bucket(max(takes))
        if with_context:  # pads to the fewer buckets of a prefill with context
            length = next((t for t in self._context_lengths() if t >= length), length)
        tokens_PT = np.zeros((rows, length), np.int32)
        lengths_P = np.ones(rows, np.int32)
        for i, (work, take) in enumerate(zip(works, takes, strict=True)):
            tokens_PT[i, :take] = work.context[work.done : work.done + take]
            lengths_P[i] = take
        requests = [s.request for s in streams]
        requests += [requests[0]] * (rows - len(streams))
        wants = [r.logprobs is not None for r in requests[: len(streams)]]
        sampling_P = RowSampling.rows(
            [r.sampling for r in requests],
            [r.seed for r in requests],
            logprobs=wants + [False] * (rows - len(streams)),
        )
        history = _history(streams, rows, self.max_seq_len)
        handle = self.executor.prefill(
            tokens_PT,
            lengths_P,
            side=side.name,
            final=final,
            sampling_P=sampling_P,
            steps_P=steps_P,
            history=history,
            starts_P=starts_P if with_context else None,
            pages_PN=self._context_pages(works, rows, side) if with_context else None,
            allowed_PW=self._first_masks(streams, rows) if final else None,
        )
        live: list[RequestStream | None] = list(streams)
        if final:
            out = self.executor.tokens(handle, logprobs=any(wants))
            self.stats.prefill_batches += 1
            live = [
                self._first(s, int(t), _logprob(out.logprobs, i, int(t), s.request))
                for i, (s, t) in enumerate(zip(streams, out.tokens, strict=False))
            ]
            dropped = out.dropped
        else:
            dropped = self.executor.dropped(handle) if eng.steps.counts_drops else 0
        if dropped:
            with self._cond:
                self.stats.moe_dropped += dropped
        if self._chunking is not None and works[0] is self._chunking:
            self.stats.prefill_chunks += 1
        took = time.perf_counter() - start
        self.stats.prefill_seconds += took
        self.step_log.prefill_done(takes, [w.done for w in works], took, final=final)
        contexts = [w.done + t for w, t in zip(works, takes, strict=True)]
        placed = [w.row for w in works]
        shape = (rows, length)
        return _Batch(
            live,
            handle,
            shape,
            sampling_P,
            contexts,
            steps_P,
            placed,
            starts_P,
            final,
            works,
            history,
        )

    def _first_masks(self, streams: list[RequestStream], rows: int) -> np.ndarray | None:
        """The token masks of a prefill's first tokens (None: no request has a grammar)."""
        if not _constrained(streams):
            return None
        vocab = self.prefill_engine.program.run.vocab_size  # the logits' (padded)
        return _masks(streams, rows, vocab)

    def _context_pages(self, works: list[_Prefill], rows: int, side: _Side) -> np.ndarray:
        """Global ids of each row's cached pages, as many columns as the longest needs
        (a power of two: few compiles); out of range past a row's cached pages."""
        n = self._context_width(max(self.pool.pages_for(w.done) for w in works))
        pages_PN = np.full((rows, *side.pages.pool.ids_shape(n)), side.pages.pool.pages, np.int32)
        for i, work in enumerate(works):
            held = self.pool.pages_for(work.done)
            pages_PN[i, ..., :held] = side.pages.global_ids(work.row, held)
        return pages_PN

    def _first(
        self, stream: RequestStream, token: int, logprob: TokenLogprob | None
    ) -> RequestStream | None:
        """Sends a request its first token; None if that finished it (its row then only
        keeps its prompt's pages for the prefix cache, and is freed at insert)."""
        if stream.emit(token, logprob) is None:
            return stream
        with self._cond:
            self.stats.finished += 1
            self._cond.notify_all()
        return None

    def _prefill_loop(self) -> None:
        """Disaggregated: prefill queued requests on the prefill devices, ahead of decode.

        Prefills read and write the prefill group's own pages (prefix hits, chunks); each
        finished batch moves to the decode devices whole, once."""
        side = self._side
        while True:
            self.executor.flush()  # before waiting: the others dispatch what this one did
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._stopping
                        or ((self._queue or self._chunking) and len(self._ready) < READY_BATCHES)
                    )
                )
                if self._stopping:
                    return
                self._drop_cancelled_chunk(side)
                works = self._admit_work(None, side)
                if not works:  # nothing fits its pool yet (it frees at every batch's end)
                    self.executor.flush()
                    self._cond.wait(0.01)
                    continue
            batch = self._prefill(works, side)
            self._insert(batch, side, keep=batch.final)
            if not batch.final:
                continue
            start = time.perf_counter()
            shape = self._whole(batch, side)
            self.stats.transfer_bytes += self.executor.transfer(batch.handle)
            self.stats.transfers += 1
            for work in works:  # its pages stay cached for later prompts
                side.pages.release(work.row)
            self.executor.wait(batch.handle)
            self.stats.prefill_seconds += time.perf_counter() - start
            ready = _Batch(
                batch.streams,
                batch.handle,
                shape,
                batch.sampling_P,
                batch.contexts,
                batch.steps_P,
                [None] * len(batch.streams),
                np.zeros_like(batch.starts_P),
                history=batch.history,
            )
            with self._cond:
                self._ready.append(ready)
                self._prefilling = []
                self._cond.notify_all()

    def _whole(self, batch: _Batch, side: _Side) -> tuple[int, int]:
        """Makes a finished batch's K/V whole from the first token on: its own if it cached
        nothing before, else read back from the prefill group's pages (context and new
        tokens). Returns its (rows, tokens)."""
        if not batch.starts_P.any():
            return batch.shape
        eng = self.prefill_engine
        rows = batch.shape[0]
        length = eng.bucket(max(batch.contexts))
        n = side.pages.pool.pages_for(length)
        pages_PN = np.full((rows, *side.pages.pool.ids_shape(n)), side.pages.pool.pages, np.int32)
        lengths_P = np.ones(rows, np.int32)
        for i, row in enumerate(batch.rows):
            pages_PN[i] = side.pages.global_ids(row, n)
            lengths_P[i] = batch.contexts[i]
        self.executor.read_back(batch.handle, pages_PN, lengths_P, length)
        return rows, length

    def _drop_cancelled_chunk(self, side: _Side) -> None:
        """Ends the long prompt between its chunks if its client cancelled it."""
        work = self._chunking
        if work is not None and work.stream.cancel_requested:
            self._chunking = None
            side.pages.release(work.row)
            work.stream.finish(work.stream.cancel_reason)
            with self._cond:
                self.stats.finished += 1
                self._cond.notify_all()

    # --- decode --------------------------------------------------------------------------

    def _admit(self, owners, release_B) -> None:
        """Colocated: prefills queued requests (and chunks of a long prompt) and writes them
        into their rows and pages. While requests are decoding, at most about
        ``max_prefill_tokens`` padded tokens (one dispatch at least) run before the next
        decode step; otherwise everything that fits."""
        budget = self.max_prefill_tokens if any(owners) else None
        while budget is None or budget > 0:
            with self._cond:
                works = self._admit_work(budget, self._side)
            if not works:
                break
            batch = self._prefill(works, self._side)
            self._insert(batch, self._side, release_B=release_B)
            if budget is not None:
                budget -= batch.shape[0] * batch.shape[1]

    def _ready_batches(self) -> list[_Batch]:
        """Disaggregated: the prefilled batches whose requests all fit, in order."""
        with self._cond:
            batches = []
            while self._ready and self._fits(self._ready[0]):
                batches.append(self._ready.popleft())
            self._cond.notify_all()
        return batches

    def _fits(self, batch: _Batch) -> bool:
        """Places a prefilled batch's live requests (rows and pages), all or none."""
        rows: list[int] = []
        for i, stream in batch.live:
            # Its prefill's context (the stream already holds its first new token).
            work = self._place(stream, rows, _context(stream)[: batch.contexts[i]])
            if work is None:
                for taken in rows:
                    self.pages.release(taken)
                return False
            rows.append(work.row)
        placed = iter(rows)
        batch.rows = [next(placed) if s is not None else None for s in batch.streams]
        return True

    def _wait_for_work(self, busy: bool) -> bool:
        """Blocks while there is nothing to do; False once the loop should end."""
        if not busy:
            self.executor.flush()  # the other processes dispatch what this one did
        with self._cond:
            if not busy:
                self._cond.wait_for(lambda: self._stopping or self._queue or self._ready)
                self._loop_started = time.perf_counter()
            return not self._stopping

    def _decode_loop(self) -> None:
        """Decode steps over the rows, refilled in between.

        Step n+1 is dispatched before step n's tokens are read back, so the host's work
        (reading, streaming, stop checks, admitting) overlaps the device's. A request that
        finished at step n has one more token drawn at step n+1; it is dropped. Device
        programs run in the order they are dispatched (each takes the last one's donated
        state), so pages freed on the host are rewritten only after that extra step.
        """
        b = self.engine.max_batch
        owners = self._owners
        release_B = np.zeros(b, bool)
        pending = None  # the last step's handle and who held each row then
        chunking = lambda: not self.disaggregated and self._chunking is not None  # noqa: E731
        while self._wait_for_work(any(owners) or pending is not None or chunking()):
            self._release_cancelled(owners, release_B)
            if self.disaggregated:
                for batch in self._ready_batches():
                    self._insert(batch, self._decode_side, release_B=release_B)
            else:
                self._admit(owners, release_B)
            if any(owners) and not self._reserve(owners):
                # A shard is out of pages: read the step in flight (it may end requests),
                # then preempt until every running row has its next page.
                if pending is not None:
                    self._deliver(*pending, owners, release_B)
                    pending = None
                self._preempt_for_room(owners, release_B)
            constrained = _constrained(owners)
            if constrained and pending is not None:
                # The next step's masks follow the tokens of the step in flight: read it.
                self._deliver(*pending, owners, release_B)
                pending = None
                constrained = _constrained(owners)
            dispatched = None
            if any(owners):
                allowed = self._step_masks(owners) if constrained else None
                handle = self.executor.step(release_B, self._step_tables(owners), allowed)
                live = [int(n) for n, s in zip(self._lengths, owners, strict=True) if s is not None]
                width = self._tables[1]  # pages: the block tables this step reads
                self.step_log.decode_dispatched(live, width * self.pool.page_size)
                self._lengths += [s is not None for s in owners]
                release_B[:] = False
                dispatched = (handle, list(owners))
            if pending is not None:
                self._deliver(*pending, owners, release_B)
            pending = dispatched
        for stream in self._owners_snapshot():
            stream.finish("shutdown")
        self._end_all("shutdown")

    def _step_masks(self, owners) -> np.ndarray:
        """The decode rows' token masks, from their requests' grammars."""
        vocab = self.engine.program.run.vocab_size  # the logits' (padded)
        return _masks(owners, len(owners), vocab)

    def _reserve(self, owners) -> bool:
        """Pages for every running row's next token, after giving back those that left
        every layer's window (sliding-window models); False if some shard ran out."""
        for i, stream in enumerate(owners):
            if stream is not None:
                self.pages.trim(i, int(self._lengths[i]))
        return all(
            self.pages.grow(i, int(self._lengths[i]) + 1)
            for i, s in enumerate(owners)
            if s is not None
        )

    def _preempt_for_room(self, owners, release_B) -> None:
        """Preempts the latest-admitted request of each shard that is out of pages until
        every running row has room for its next token (the oldest always fits alone)."""
        for i, stream in enumerate(owners):
            while stream is not None and not self.pages.grow(i, int(self._lengths[i]) + 1):
                shard = self.pages.shard(i)
                victims = [j for j, s in enumerate(owners) if s and self.pages.shard(j) == shard]
                victim = max(victims, key=lambda j: self._admitted[j])
                self._preempt(owners, release_B, victim)
                stream = owners[i]

    def _preempt(self, owners, release_B, i: int) -> None:
        """Frees row ``i`` and its pages; its request goes back to the front of the queue."""
        stream = owners[i]
        owners[i] = None
        release_B[i] = True
        self.pages.release(i)
        with self._cond:
            self._active -= 1
            self.stats.preemptions += 1
            self._queue.appendleft(stream)
            self._cond.notify_all()

    def _step_tables(self, owners) -> np.ndarray | None:
        """The block tables of the rows a step computes (as many as cover the running
        rows), as wide as the longest needs; None while they are those of the last step
        (placed again only when they change)."""
        live = np.array([s is not None for s in owners])
        longest = int(self._lengths[live].max()) + 1
        width = self.pages.width(longest)
        rows = self.slot_steps.rows_for(live)
        key = (self.pages.version, width, rows)
        if self._tables == key:
            return None
        self._tables = key
        return self.slot_steps.table_rows(self.pages.step_tables(width), rows)

    def _deliver(self, handle: int, holders, owners, release_B) -> None:
        """Streams one step's tokens (and logprobs, read only if some request asked) to the
        requests that held the rows when it ran."""
        asked = any(s is not None and s.request.logprobs is not None for s in holders)
        out = self.executor.tokens(handle, logprobs=asked)
        tokens_B, host_lp = out.tokens, out.logprobs
        if out.dropped:
            with self._cond:
                self.stats.moe_dropped += out.dropped
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
                self._free(owners, release_B, i)

    def _insert(self, batch: _Batch, side: _Side, *, release_B=None, keep: bool = False) -> None:
        """Writes a batch's K/V into its rows' pages on ``side``, from where each row's
        cache ends, and (where those rows decode) starts decoding the requests it
        completes. The full pages written join the prefix cache; a request that finished
        at its first token keeps no row (its pages are written for the cache, then
        released). On a prefill group's pages the caller releases the rows; ``keep``: the
        batch stays with the executor (to move to the decode devices)."""
        pages, pool = side.pages, side.pages.pool
        decodes = side.owners is self._owners  # rows that decode here (else: prefill group)
        rows = batch.shape[0]  # the row bucket: padding rows are dropped
        n_pages = pool.pages_for(batch.shape[1])
        slot_P = np.full(rows, pool.rows, np.int32)
        pages_PN = np.full((rows, *pool.ids_shape(n_pages)), pool.pages, np.int32)
        started = 0
        for i, row in enumerate(batch.rows):
            if row is None:  # disaggregated: finished at its first token, never placed
                continue
            first = int(batch.starts_P[i]) // pool.page_size
            pages_PN[i] = pages.global_ids(row, n_pages, first)
            stream = batch.streams[i]
            if decodes and batch.final and stream is not None:
                slot_P[i] = row
                side.owners[row] = stream
                release_B[row] = False
                self._lengths[row] = batch.contexts[i]
                self._admissions += 1
                self._admitted[row] = self._admissions
                started += 1
        if (pages_PN < pool.pages).any():
            with self._cond:
                self._active += started
            start = time.perf_counter()
            self.executor.insert(
                batch.handle,
                slot_P,
                pages_PN,
                side=side.name,
                steps_P=batch.steps_P,
                sampling_P=batch.sampling_P,
                starts_P=batch.starts_P,
                history=batch.history,
                keep=keep,
            )
            self.stats.insert_seconds += time.perf_counter() - start
        elif not keep:
            self.executor.drop(batch.handle)
        self._inserted(batch, side, decodes)
        if not self.disaggregated:  # (disaggregated: cleared when the batch is ready)
            with self._cond:
                self._prefilling = []

    def _inserted(self, batch: _Batch, side: _Side, decodes: bool) -> None:
        """After an insert: the admitted requests' cached lengths and prefix pages, and
        the rows of those that finished at their first token (freed) or the long prompt
        whose last chunk this was."""
        for i, work in enumerate(batch.works or []):
            work.done = batch.contexts[i]
            if side.caching:
                side.pages.register(work.row, work.keys[: work.done // side.pages.pool.page_size])
            if batch.final and decodes and batch.streams[i] is None:
                side.pages.release(work.row)
            else:  # its next query (chunk or decode) sits at ``done``: the window's pages
                side.pages.trim(work.row, work.done)
            if batch.final and self._chunking is work:
                self._chunking = None

    def _release_cancelled(self, owners, release_B) -> None:
        for i, stream in enumerate(owners):
            if stream is not None and stream.cancel_requested:
                stream.finish(stream.cancel_reason)
                self._free(owners, release_B, i)
        if not self.disaggregated:
            self._drop_cancelled_chunk(self._side)

    def _free(self, owners, release_B, i: int) -> None:
        with self._cond:
            self._active -= 1
            self.stats.finished += 1
            self._cond.notify_all()
        owners[i] = None
        release_B[i] = True
        self.pages.release(i)


def _constrained(owners: Sequence[RequestStream | None]) -> bool:
    """Some running request has a grammar."""
    return any(s is not None and s.matcher is not None for s in owners)


def _masks(streams: Sequence[RequestStream | None], rows: int, vocab: int) -> np.ndarray:
    """``int32 [rows, ceil(vocab / 32)]``: each stream's next-token mask from its grammar's
    state, every bit set for rows without one (and padding rows past ``streams``)."""
    mask_BW = all_allowed(rows, vocab)
    fill_masks(
        [(s.matcher, i) for i, s in enumerate(streams) if s is not None and s.matcher], mask_BW
    )
    return mask_BW


def _context(stream: RequestStream) -> list[int]:
    """Tokens a request's prefill caches: its prompt and what it drew before a preemption."""
    return [*stream.request.prompt, *stream.tokens]


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


#: Prefill tokens a decode step's time could compute on an accelerator: decode reads
#: every weight once per step (bandwidth-bound), prefill is compute-bound, so one step
#: costs about as much as prefilling the machine balance (peak flops / bandwidth) in
#: tokens: ~240 for bf16 on TPU v5e, ~300 on H100.
ACCELERATOR_STEP_TOKENS = 256
#: The same on CPU, where a decode step is compute-bound too: about the rows it computes
#: (at least 8 per batch shard), plus its dispatch.
CPU_STEP_TOKENS = 32


def default_max_prefill_tokens(platform: str, page_size: int) -> int:
    """Prefill tokens between two decode steps by default: about two decode steps' worth,
    so a running request waits at most about three steps' time for its next token (the
    rule the long-prompt benchmark checks), in whole pages."""
    step = CPU_STEP_TOKENS if platform == "cpu" else ACCELERATOR_STEP_TOKENS
    return max(2 * step // page_size, 1) * page_size


def _step_temp_bytes(engine: InferenceEngine) -> int:
    """Temporaries per device of the engine's contiguous decode step (its paged step's
    are of the same order), from the compiler's memory analysis: 0 if not reported."""
    cache = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        jax.eval_shape(lambda: KVCache.empty(engine.program.run, engine.max_batch, 1)),
        engine.layouts.cache,
    )
    tokens = jax.ShapeDtypeStruct((engine.max_batch,), np.int32, sharding=engine.layouts.tokens_B)
    compiled = engine.steps.lower_decode(engine.params, cache, tokens).compile()
    analysis = compiled.memory_analysis()
    return int(getattr(analysis, "temp_size_in_bytes", 0) or 0)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _prefill_rows(engine: InferenceEngine) -> int:
    """The prefill's batch shards: the product of the mesh axes that carry batch in prefill
    (dp, and ep for a MoE: the tables make ep split every module's batch), so the smallest
    prefill batch that divides over them."""
    pc = engine.parallel_config
    axes = mesh_axes(Module.ATTENTION, Phase.PREFILL, pc, dims=engine.model_config)["batch"]
    return math.prod(pc.degree(a) for a in axes)


def _prefill_batch(engine: InferenceEngine, wanted: int | None, separate) -> int:
    """Most prompts prefilled together: by default the prefill engine's ``max_batch`` when
    disaggregated, else up to 4 per batch shard (fewer take a smaller row bucket)."""
    shards = _prefill_rows(engine)
    default = engine.max_batch
    if separate is None:
        default = min(engine.max_batch, 4 * shards) // shards * shards
    pb = wanted or default
    if pb % shards or pb > engine.max_batch:
        raise ConfigError(
            f"prefill_batch={pb} must be a multiple of the prefill strategy's batch shards "
            f"({shards}: the degrees of the axes carrying batch in prefill, dp and ep for a "
            f"MoE) and at most its max_batch={engine.max_batch}"
        )
    return pb


def _check_pair(decode: InferenceEngine, prefill: InferenceEngine) -> None:
    """A disaggregated pair: one model, disjoint devices, the same cache form."""
    if decode.model_config != prefill.model_config:
        raise ConfigError("prefill and decode engines must run the same model config")
    forms = [(e.program.run.dtype, e.options.layer_loop) for e in (prefill, decode)]
    if forms[0] != forms[1]:
        raise ConfigError(
            "prefill and decode engines must hold the same cache form (dtype, layer_loop); "
            f"prefill has {forms[0]}, decode {forms[1]}"
        )
    shared = set(decode.mesh.devices.flat) & set(prefill.mesh.devices.flat)
    if shared:
        raise ConfigError(
            f"disaggregated prefill and decode must use disjoint devices; both use "
            f"{sorted(d.id for d in shared)}"
        )
    if prefill.parallel_config.pp > 1:
        raise ConfigError("disaggregated prefill runs unpipelined strategies (pp=1)")
