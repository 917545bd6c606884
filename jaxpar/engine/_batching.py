"""Continuous batching: requests queue, prefill in buckets, decode over slots.

:class:`ContinuousBatcher` runs one decode loop over the engine's ``max_batch`` slots
(:mod:`jaxpar.engine._slots`). Between two decode steps it frees the slots of finished
or cancelled requests and fills free slots with queued requests: their prompts are
prefilled together (up to ``prefill_batch`` at a time, padded to a power-of-two bucket),
and each one's K/V is written into its slot. A request never waits for another to finish,
and nothing recompiles per request: prefill and insert compile once per bucket, the
decode step once.

Disaggregated (``prefill_engine`` given): prefill runs on that engine's devices with its
own strategy, in a thread of its own, so it overlaps the decode steps; each batch's K/V
and logits move to the decode devices once (:attr:`BatcherStats.transfer_bytes`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from jaxpar.engine._engine import InferenceEngine
from jaxpar.engine._placement import put_global
from jaxpar.engine._requests import Request, RequestStream
from jaxpar.engine._sampling import RowSampling, Sampling
from jaxpar.engine._slots import FirstTokens, Inserted, SlotSteps
from jaxpar.errors import CacheOverflowError, ConfigError, QueueFullError, ShapeError

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


@dataclasses.dataclass
class _Batch:
    """Requests prefilled together, with their prefill results on the decode devices.

    ``streams[i]`` is row i's request, or None once it finished at its first token.
    """

    streams: list[RequestStream | None]
    inserted: Inserted
    sampling_P: RowSampling

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
    """

    def __init__(
        self,
        engine: InferenceEngine,
        *,
        prefill_engine: InferenceEngine | None = None,
        prefill_batch: int | None = None,
        max_queue: int = 256,
    ):
        if jax.process_count() > 1:
            raise ConfigError(
                "continuous batching schedules requests in one process; under "
                f"jax.distributed ({jax.process_count()} processes) every process would have "
                "to make the same scheduling decisions. Serve from one host, or use "
                "InferenceEngine.generate for multi-host batches"
            )
        self.engine = engine
        self.prefill_engine = prefill_engine or engine
        self.disaggregated = prefill_engine is not None
        self.slot_steps = SlotSteps(engine.steps, engine.program.model_config, engine.max_batch)
        if self.disaggregated:
            _check_pair(engine, prefill_engine)
        self.first_tokens = FirstTokens(self.prefill_engine.steps)
        self.prefill_batch = _prefill_batch(self.prefill_engine, prefill_batch, prefill_engine)
        if max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self.max_prompt_len = min(engine.max_seq_len, self.prefill_engine.max_seq_len)
        self.stats = BatcherStats()
        self._cond = threading.Condition()
        self._queue: collections.deque[RequestStream] = collections.deque()
        self._ready: collections.deque[_Batch] = collections.deque()
        self._active = 0
        self._next_id = 0
        self._closing = False
        self._stopping = False
        self._owners: list[RequestStream | None] = []
        self._threads: list[threading.Thread] = []
        self._failure: BaseException | None = None
        self._loop_started = self._last_read = 0.0  # for BatcherStats.decode_seconds

    # --- clients -------------------------------------------------------------------------

    def submit(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        sampling: Sampling | None = None,
        seed: int = 0,
        stop_tokens: Sequence[int] = (),
    ) -> RequestStream:
        """Queues a request; its stream yields tokens as they are drawn.

        Raises:
            ShapeError / CacheOverflowError: a bad prompt or one that does not fit.
            QueueFullError: ``max_queue`` requests are already waiting, or the batcher is
                closing.
        """
        request = Request(
            prompt=tuple(int(t) for t in self._check(prompt, max_tokens)),
            max_tokens=max_tokens,
            sampling=sampling or Sampling(),
            seed=int(seed),
            stop_tokens=frozenset(int(t) for t in stop_tokens),
        )
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
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0:
            raise ShapeError("prompt must be a non-empty 1-D sequence of token ids")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ShapeError(f"prompt has dtype {ids.dtype}; token ids must be integers")
        vocab = self.engine.model_config.vocab_size
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.size:
            raise ShapeError(f"token id(s) {bad[:5].tolist()} outside the vocabulary [0, {vocab})")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ShapeError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if ids.size > self.max_prompt_len:
            raise CacheOverflowError(
                f"prompt of {ids.size} tokens exceeds max_seq_len={self.max_prompt_len}"
            )
        if ids.size + max_tokens - 1 > self.engine.max_seq_len:
            raise CacheOverflowError(
                f"prompt ({ids.size} tokens) + max_tokens={max_tokens} exceeds "
                f"max_seq_len={self.engine.max_seq_len} + 1; lower max_tokens to at most "
                f"{self.engine.max_seq_len + 1 - ids.size}"
            )
        return ids

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        """Requests holding a decode slot."""
        return self._active

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the decode KV cache held by running requests (0..1)."""
        return self._active / self.engine.max_batch

    @property
    def slots(self) -> int:
        return self.engine.max_batch

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    # --- life cycle ----------------------------------------------------------------------

    def start(self) -> ContinuousBatcher:
        """Starts the decode loop (and the prefill loop when disaggregated) in threads."""
        if self._threads:
            return self
        loops = [self._decode_loop] + ([self._prefill_loop] if self.disaggregated else [])
        for loop in loops:
            thread = threading.Thread(target=self._guard(loop), name=loop.__name__, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def row_buckets(self) -> list[int]:
        """Prefill batch sizes: the prefill ``dp`` doubled up to ``prefill_batch``."""
        rows, out = self.prefill_engine.parallel_config.dp, []
        while rows < self.prefill_batch:
            out.append(rows)
            rows *= 2
        return [*out, self.prefill_batch]

    def _rows(self, n: int) -> int:
        return next(r for r in self.row_buckets() if r >= n)

    def warmup(self, prompt_lens: Iterable[int] | None = None) -> list[tuple[int, int]]:
        """Compiles every program before the first request: prefill and insert for each
        (rows, prompt-length bucket), then the decode step. Nothing runs.

        Args:
            prompt_lens: the prompt lengths to cover (default: all up to ``max_seq_len``).

        Returns:
            The (rows, length) buckets compiled.
        """
        lens = prompt_lens or range(1, self.max_prompt_len + 1)
        buckets = [
            (rows, length)
            for rows in self.row_buckets()
            for length in sorted({self.prefill_engine.bucket(n) for n in lens})
        ]
        eng = self.prefill_engine
        for rows, length in buckets:
            logits, k, v = eng.steps.compile_prefill(eng.params, rows, length)
            self.first_tokens.compile(logits)
            row_ints = jax.ShapeDtypeStruct((rows,), np.int32)
            self.slot_steps.compile_insert(Inserted(k, v, row_ints, row_ints))
        self.slot_steps.compile_step(self.engine.params)
        return buckets

    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stops taking requests, then ends the loops.

        ``drain``: let queued and running requests finish first (up to ``timeout``
        seconds); what is left is then cancelled with finish reason ``"shutdown"``.
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if drain:
            deadline = None if timeout is None else time.monotonic() + timeout
            with self._cond:
                self._cond.wait_for(self._idle, _remaining(deadline))
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        self._threads = []
        self._end_all("shutdown")  # what never started (or was never taken) ends too

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
                loop()
            except BaseException as e:  # noqa: BLE001 - reported to every waiting client
                with self._cond:
                    self._failure = e
                    self._stopping = True
                    self._cond.notify_all()
                self._end_all("error", e)

        return run

    def _end_all(self, reason: str, error: BaseException | None = None) -> None:
        with self._cond:
            streams = [*self._queue, *(s for b in self._ready for s in b.streams)]
            self._queue.clear()
            self._ready.clear()
        for stream in [*streams, *self._owners_snapshot()]:
            stream.finish(reason, error)

    def _owners_snapshot(self) -> list[RequestStream]:
        return [s for s in list(self._owners) if s is not None]

    # --- prefill -------------------------------------------------------------------------

    def _take(self, n: int) -> list[RequestStream]:
        """Up to ``n`` queued requests that are still wanted (call with the lock held)."""
        taken = []
        while self._queue and len(taken) < n:
            stream = self._queue.popleft()
            if stream.cancel_requested:
                stream.finish(stream.cancel_reason)
                self.stats.finished += 1
                self._cond.notify_all()
            else:
                taken.append(stream)
        return taken

    def _prefill(self, streams: list[RequestStream]) -> _Batch:
        """Prefills ``streams`` together and draws their first tokens (sent to the clients
        at once); the results laid out for the decode engine."""
        eng, rows = self.prefill_engine, self._rows(len(streams))
        start = time.perf_counter()
        longest = max(len(s.request.prompt) for s in streams)
        tokens_PT = np.zeros((rows, eng.bucket(longest)), np.int32)
        lengths_P = np.ones(rows, np.int32)
        for i, stream in enumerate(streams):
            tokens_PT[i, : len(stream.request.prompt)] = stream.request.prompt
            lengths_P[i] = len(stream.request.prompt)
        lay = eng.layouts
        tokens = put_global(tokens_PT, lay.tokens_BT)
        lengths = put_global(lengths_P, lay.lengths_prefill_B)
        logits_PV, k, v = eng.steps.prefill(eng.params, tokens, lengths)
        if eng.steps.counts_drops:
            dropped = int(eng.steps.last_dropped["prefill"])
            with self._cond:
                self.stats.moe_dropped += dropped
        requests = [s.request for s in streams]
        requests += [requests[0]] * (rows - len(streams))
        sampling_P = RowSampling.rows([r.sampling for r in requests], [r.seed for r in requests])
        first_P = self.first_tokens(logits_PV, sampling_P)
        first = np.asarray(jax.device_get(first_P))
        self.stats.prefill_batches += 1
        live = [
            self._first(stream, int(token))
            for stream, token in zip(streams, first[: len(streams)], strict=True)
        ]
        inserted = Inserted(k=k, v=v, lengths_P=lengths, first_P=first_P)
        if self.disaggregated:
            inserted = self._transfer(inserted)
        jax.block_until_ready(inserted)
        self.stats.prefill_seconds += time.perf_counter() - start
        return _Batch(live, inserted, sampling_P)

    def _first(self, stream: RequestStream, token: int) -> RequestStream | None:
        """Sends a request its first token; None if that finished it (it takes no slot)."""
        if stream.emit(token) is None:
            return stream
        with self._cond:
            self.stats.finished += 1
            self._cond.notify_all()
        return None

    def _transfer(self, new: Inserted) -> Inserted:
        """Moves a prefilled batch onto the decode devices, in their prefill layout."""
        lay = self.engine.layouts
        moved = Inserted(
            k=jax.device_put(new.k, lay.kv_prefill),
            v=jax.device_put(new.v, lay.kv_prefill),
            lengths_P=jax.device_put(new.lengths_P, lay.lengths_prefill_B),
            first_P=jax.device_put(new.first_P, lay.replicated),
        )
        self.stats.transfer_bytes += moved.nbytes
        self.stats.transfers += 1
        return moved

    def _prefill_loop(self) -> None:
        """Disaggregated: prefill queued requests on the prefill devices, ahead of decode."""
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._stopping or (self._queue and len(self._ready) < READY_BATCHES)
                )
                if self._stopping:
                    return
                streams = self._take(self.prefill_batch)
            if not streams:
                continue
            batch = self._prefill(streams)
            with self._cond:
                self._ready.append(batch)
                self._cond.notify_all()

    # --- decode --------------------------------------------------------------------------

    def _next_batches(self, free: int) -> list[_Batch]:
        """Prefilled batches that fit ``free`` slots (prefilling now unless disaggregated)."""
        if self.disaggregated:
            with self._cond:
                batches = []
                while self._ready and len(self._ready[0].live) <= free:
                    batches.append(self._ready.popleft())
                    free -= len(batches[-1].live)
                self._cond.notify_all()
            return batches
        batches = []
        while free:
            with self._cond:
                streams = self._take(min(free, self.prefill_batch))
            if not streams:
                break
            batches.append(self._prefill(streams))
            free -= len(batches[-1].live)
        return batches

    def _wait_for_work(self, busy: bool) -> bool:
        """Blocks while there is nothing to do; False once the loop should end."""
        with self._cond:
            if not busy:
                self._cond.wait_for(lambda: self._stopping or self._queue or self._ready)
                self._loop_started = time.perf_counter()
            return not self._stopping

    def _decode_loop(self) -> None:
        """Decode steps over the slots, refilled in between.

        Step n+1 is dispatched before step n's tokens are read back, so the host's work
        (reading, streaming, stop checks, admitting) overlaps the device's. A request that
        finished at step n has one more token drawn at step n+1; it is dropped.
        """
        b = self.engine.max_batch
        slots = self.slot_steps.empty()
        owners: list[RequestStream | None] = [None] * b
        self._owners = owners
        release_B = np.zeros(b, bool)
        pending = None  # the last step's tokens (on device) and who held each slot then
        while self._wait_for_work(any(owners) or pending is not None):
            self._release_cancelled(owners, release_B)
            free = [i for i, s in enumerate(owners) if s is None]
            for batch in self._next_batches(len(free)):
                slots = self._insert(slots, batch, free, owners, release_B)
            dispatched = None
            if any(owners):
                slots, *step = self.slot_steps.step(self.engine.params, slots, release_B)
                release_B[:] = False
                dispatched = (*step, list(owners))
            if pending is not None:
                self._deliver(*pending, owners, release_B)
            pending = dispatched
        for stream in self._owners_snapshot():
            stream.finish("shutdown")
        self._end_all("shutdown")

    def _deliver(self, next_B, dropped, holders, owners, release_B) -> None:
        """Streams one step's tokens to the requests that held the slots when it ran."""
        tokens_B = np.asarray(jax.device_get(next_B))
        if dropped is not None:
            with self._cond:
                self.stats.moe_dropped += int(dropped)
        now = time.perf_counter()
        self.stats.decode_steps += 1
        self.stats.decode_seconds += now - max(self._last_read, self._loop_started)
        self._last_read = now
        for i, stream in enumerate(holders):
            if stream is None or stream.done:
                continue
            if stream.emit(int(tokens_B[i])) is not None and owners[i] is stream:
                self._free(owners, release_B, i)

    def _insert(self, slots, batch: _Batch, free: list[int], owners, release_B):
        """Writes a batch's live requests into free slots (the others' rows are dropped)."""
        live = batch.live
        if not live:
            return slots
        rows = batch.inserted.lengths_P.shape[0]  # the row bucket: padding rows are dropped
        slot_P = np.full(rows, self.engine.max_batch, np.int32)
        for row, stream in live:
            slot = free.pop(0)
            slot_P[row] = slot
            owners[slot] = stream
            release_B[slot] = False
        with self._cond:
            self._active += len(live)
        start = time.perf_counter()
        slots = self.slot_steps.insert(slots, batch.inserted, slot_P, batch.sampling_P)
        self.stats.insert_seconds += time.perf_counter() - start
        return slots

    def _release_cancelled(self, owners, release_B) -> None:
        for i, stream in enumerate(owners):
            if stream is not None and stream.cancel_requested:
                stream.finish(stream.cancel_reason)
                self._free(owners, release_B, i)

    def _free(self, owners, release_B, i: int) -> None:
        owners[i] = None
        release_B[i] = True
        with self._cond:
            self._active -= 1
            self.stats.finished += 1
            self._cond.notify_all()


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _prefill_batch(engine: InferenceEngine, wanted: int | None, separate) -> int:
    """Most prompts prefilled together: by default the prefill engine's ``max_batch`` when
    disaggregated, else up to 4 per ``dp`` shard (fewer take a smaller row bucket)."""
    dp = engine.parallel_config.dp
    default = engine.max_batch if separate is not None else min(engine.max_batch, 4 * dp) // dp * dp
    pb = wanted or default
    if pb % dp or pb > engine.max_batch:
        raise ConfigError(
            f"prefill_batch={pb} must be a multiple of the prefill strategy's dp={dp} and at "
            f"most its max_batch={engine.max_batch}"
        )
    return pb


def _check_pair(decode: InferenceEngine, prefill: InferenceEngine) -> None:
    """A disaggregated pair: one model, disjoint devices, the same cache form."""
    if decode.model_config != prefill.model_config:
        raise ConfigError("prefill and decode engines must run the same model config")
    shared = set(decode.mesh.devices.flat) & set(prefill.mesh.devices.flat)
    if shared:
        raise ConfigError(
            f"disaggregated prefill and decode must use disjoint devices; both use "
            f"{sorted(d.id for d in shared)}"
        )
    if prefill.parallel_config.pp > 1:
        raise ConfigError("disaggregated prefill runs unpipelined strategies (pp=1)")
