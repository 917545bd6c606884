"""The pre-paging serving baseline, kept for ``bench_serving.py``'s paged-vs-dense comparison.

Before the KV cache was paged, continuous batching gave each running request one of the
engine's ``max_batch`` *slots*: one row of a contiguous :class:`~jaxpar.models.KVCache`
of ``max_seq_len`` positions, held from admission to the last token whatever the request's
length. This module restores that serving path (commit ``1fef4f5``'s ``SlotSteps`` and
``ContinuousBatcher`` decode over ``KVCache`` rows), trimmed to what the benchmark drives,
on today's models and engine APIs:

* :class:`DenseSlotSteps`: the device state (cache rows, next tokens, active flags,
  sampling rows) and its two compiled programs, ``insert`` (prefilled K/V scattered into
  chosen rows) and ``step`` (one decode step over every row, over all ``max_seq_len``
  positions of each);
* :class:`DenseBatcher`: the decode loop, with :class:`ContinuousBatcher`'s request-stream
  API (``submit``, ``start``, ``warmup``, ``close``, ``active``, ``queued``, ``stats``),
  so the benchmark drives both the same way.

Not part of the library: no disaggregated prefill, no cancellation, no multi-process
guard, no MoE drop counts. Same scheduling as the paged batcher otherwise: prefill in
power-of-two (rows, length) buckets between decode steps, and step ``n + 1`` dispatched
before step ``n``'s tokens are read back.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Iterable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.engine import (
    BatcherStats,
    FirstTokens,
    InferenceEngine,
    Inserted,
    Request,
    RequestStream,
    RowSampling,
    Sampling,
    Steps,
    mask_padded,
    put_global,
    select_rows,
)
from jaxpar.errors import CacheOverflowError, ConfigError, QueueFullError
from jaxpar.models import KVCache, ModelConfig
from jaxpar.spec import Phase

DECODE = Phase.DECODE


@flax.struct.dataclass
class DenseSlots:
    """The decode slots' device state (every field has ``B`` rows)."""

    cache: KVCache  # [B, K, S, H] per layer: S = max_seq_len positions for every row
    tokens_B: jax.Array  # int32: the token each slot appends next
    active_B: jax.Array  # bool
    step_B: jax.Array  # int32: tokens drawn so far (the sampling key's step)
    sampling: RowSampling


class DenseSlotSteps:
    """Compiles and runs the contiguous ``insert`` and ``step`` over ``steps``' layout.

    Args:
        steps: the engine's step functions (graph, layouts, mesh, strategy); pp=1.
        model_config: the model as the engine runs it.
        slots: ``B``, the number of decode slots.
        max_seq_len: ``S``, the positions of every slot (default: the engine's).
    """

    def __init__(
        self, steps: Steps, model_config: ModelConfig, slots: int, max_seq_len: int | None = None
    ):
        if steps.config.pp > 1:
            raise ConfigError(f"the dense baseline runs unpipelined strategies, not {steps.config}")
        self.steps = steps
        self.model_config = model_config
        self.n_slots = slots
        self.max_seq_len = max_seq_len or steps.max_seq_len
        self._idle_sampling = RowSampling.rows([Sampling()] * slots, [0] * slots)
        self._keep_all: jax.Array | None = None
        lay = steps.layouts
        row = lay.tokens_B
        key_row = NamedSharding(row.mesh, PartitionSpec(*row.spec, None))
        self.layout = DenseSlots(
            cache=lay.cache,
            tokens_B=row,
            active_B=row,
            step_B=row,
            sampling=RowSampling.like(row, key_row),
        )

    def empty(self) -> DenseSlots:
        """Every slot free, in the decode layout."""
        return jax.jit(self._empty, out_shardings=self.layout)()

    def abstract(self) -> DenseSlots:
        """:meth:`empty`'s shapes and shardings, allocating nothing."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            jax.eval_shape(self._empty),
            self.layout,
        )

    def _empty(self) -> DenseSlots:
        b = self.n_slots
        return DenseSlots(
            cache=KVCache.empty(self.model_config, b, self.max_seq_len),
            tokens_B=jnp.zeros(b, jnp.int32),
            active_B=jnp.zeros(b, bool),
            step_B=jnp.zeros(b, jnp.int32),
            sampling=jax.tree.map(jnp.asarray, self._idle_sampling),
        )

    # --- traced bodies -------------------------------------------------------------------

    def _insert(self, slots: DenseSlots, new: Inserted, slot_P, sampling_P) -> DenseSlots:
        """Writes new rows ``slot_P`` (``>= B``: a padding row, dropped)."""
        with self.steps._context(DECODE):
            cache = _write_rows(slots.cache, new, slot_P)

            def put(x_B, x_P):
                return x_B.at[slot_P].set(x_P.astype(x_B.dtype), mode="drop")

            return DenseSlots(
                cache=cache.replace(lengths_B=put(cache.lengths_B, new.lengths_P)),
                tokens_B=put(slots.tokens_B, new.first_P),
                active_B=put(slots.active_B, jnp.ones_like(slot_P, bool)),
                step_B=put(slots.step_B, jnp.ones_like(slot_P)),
                sampling=jax.tree.map(put, slots.sampling, sampling_P),
            )

    def _step(self, params, slots: DenseSlots, release_B):
        """One decode step over every slot: the new slots and tokens (``-1``: inactive)."""
        with self.steps._context(DECODE):
            cache = slots.cache
            active_B = slots.active_B & ~release_B & (cache.lengths_B < cache.max_seq_len)
            # A free slot appends at position 0, never read: an insert rewrites the row.
            cache = cache.replace(lengths_B=jnp.where(active_B, cache.lengths_B, 0))
            logits_BV, cache = self.steps._model(params).decode(slots.tokens_B, cache)
            logits_BV = mask_padded(logits_BV, self.steps.vocab_size)
            next_B = select_rows(logits_BV, slots.sampling, slots.step_B)
            slots = DenseSlots(
                cache=cache.replace(lengths_B=jnp.where(active_B, cache.lengths_B, 0)),
                tokens_B=jnp.where(active_B, next_B, 0),
                active_B=active_B,
                step_B=slots.step_B + active_B.astype(jnp.int32),
                sampling=slots.sampling,
            )
            return slots, jnp.where(active_B, next_B, -1)

    # --- compiled entry points -----------------------------------------------------------

    def _insert_program(self, slots, new: Inserted, slot_P, sampling_P):
        lay, rep = self.steps.layouts, self.steps.layouts.replicated
        inserted = Inserted(lay.kv_prefill, lay.kv_prefill, lay.lengths_prefill_B, rep)
        return self.steps._compile(
            "dense_insert",
            (self.n_slots, self.max_seq_len, jax.tree.map(jnp.shape, new.k)),
            self._insert,
            (self.layout, inserted, rep, RowSampling.like(rep)),
            self.layout,
            (slots, new, slot_P, sampling_P),
            donate_argnums=(0,),
        )

    def insert(
        self, slots: DenseSlots, new: Inserted, slot_P: np.ndarray, sampling_P: RowSampling
    ) -> DenseSlots:
        """Writes ``new`` into slots ``slot_P`` (donates ``slots``; ``>= B``: not written)."""
        rep = self.steps.layouts.replicated
        slot_P = put_global(np.asarray(slot_P, np.int32), rep)
        sampling_P = jax.tree.map(lambda x: put_global(x, rep), sampling_P)
        return self._insert_program(slots, new, slot_P, sampling_P)(slots, new, slot_P, sampling_P)

    def compile_insert(self, new: Inserted) -> None:
        """Compiles ``insert`` for prefill results shaped like ``new`` (shape structs)."""
        rows = new.lengths_P.shape[0]
        lay, rep = self.steps.layouts, self.steps.layouts.replicated

        def spec(x, sharding=rep):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        new = Inserted(
            k=jax.tree.map(spec, new.k, lay.kv_prefill),
            v=jax.tree.map(spec, new.v, lay.kv_prefill),
            lengths_P=spec(new.lengths_P, lay.lengths_prefill_B),
            first_P=spec(new.first_P),
        )
        host = RowSampling.rows([Sampling()] * rows, [0] * rows)
        self._insert_program(
            self.abstract(), new, spec(np.zeros(rows, np.int32)), jax.tree.map(spec, host)
        )

    def _step_program(self, params, slots, release):
        lay = self.steps.layouts
        return self.steps._compile(
            "dense_step",
            (self.n_slots, self.max_seq_len),
            self._step,
            (lay.params, self.layout, self.layout.active_B),
            (self.layout, lay.replicated),
            (params, slots, release),
            donate_argnums=(1,),
        )

    def step(self, params, slots: DenseSlots, release_B: np.ndarray):
        """Donates ``slots``; ``release_B`` frees slots first. The new slots and tokens."""
        if release_B.any():
            release = put_global(np.asarray(release_B, bool), self.layout.active_B)
        else:  # most steps free nothing: no host-to-device copy for them
            if self._keep_all is None:
                self._keep_all = put_global(np.zeros(self.n_slots, bool), self.layout.active_B)
            release = self._keep_all
        return self._step_program(params, slots, release)(params, slots, release)

    def compile_step(self, params) -> None:
        """Compiles ``step`` ahead of its first call."""
        release = jax.ShapeDtypeStruct((self.n_slots,), bool, sharding=self.layout.active_B)
        self._step_program(params, self.abstract(), release)


def _write_rows(cache: KVCache, new: Inserted, slot_P: jax.Array) -> KVCache:
    """Writes prefill K/V ``[P, T, K, H]`` into cache rows ``slot_P``, positions ``[0, T)``."""
    if cache.stacked:  # [L, B, S, K, H] <- [L, P, T, K, H]
        t = new.k.shape[2]

        def put_stacked(cache_LBSKH, new_LPTKH):
            new_LPTKH = new_LPTKH.astype(cache_LBSKH.dtype)
            return cache_LBSKH.at[:, slot_P, :t].set(new_LPTKH, mode="drop")

        return cache.replace(k=put_stacked(cache.k, new.k), v=put_stacked(cache.v, new.v))

    def put(cache_BKSH, new_PTKH):  # [B, K, S, H] <- [P, T, K, H]
        t = new_PTKH.shape[1]
        new_PKTH = new_PTKH.transpose(0, 2, 1, 3).astype(cache_BKSH.dtype)
        return cache_BKSH.at[slot_P, :, :t].set(new_PKTH, mode="drop")

    return cache.replace(k=tuple(map(put, cache.k, new.k)), v=tuple(map(put, cache.v, new.v)))


@dataclasses.dataclass
class _Batch:
    """Requests prefilled together; ``streams[i]`` is None once row i finished at once."""

    streams: list[RequestStream | None]
    inserted: Inserted
    sampling_P: RowSampling

    @property
    def live(self) -> list[tuple[int, RequestStream]]:
        return [(i, s) for i, s in enumerate(self.streams) if s is not None]


class DenseBatcher:
    """Continuous batching over ``engine.max_batch`` contiguous slots (the baseline).

    Args:
        engine: prefills and decodes; its ``max_seq_len`` is the positions every slot
            holds, and the bound on prompt + ``max_tokens`` - 1.
        slots: decode slots (default: the engine's ``max_batch``). Fewer slots than the
            engine's rows lets the baseline share an engine, and its compiled prefill
            programs, with a paged batcher.
        prefill_batch: most prompts prefilled together (default: up to 4, as the paged
            batcher on one device).
        max_queue: requests waiting beyond this are refused (:class:`QueueFullError`).
    """

    def __init__(
        self,
        engine: InferenceEngine,
        *,
        slots: int | None = None,
        prefill_batch: int | None = None,
        max_queue: int = 256,
    ):
        n_slots = slots or engine.max_batch
        self.engine = engine
        self.slot_steps = DenseSlotSteps(engine.steps, engine.program.run, n_slots)
        self.first_tokens = FirstTokens(engine.steps)
        self.prefill_batch = prefill_batch or min(n_slots, 4)
        self.max_queue = max_queue
        self.max_seq_len = engine.max_seq_len
        self.stats = BatcherStats()
        self._cond = threading.Condition()
        self._queue: collections.deque[RequestStream] = collections.deque()
        self._owners: list[RequestStream | None] = [None] * n_slots
        self._active = 0
        self._next_id = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    # --- clients -------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], *, max_tokens: int, seed: int = 0) -> RequestStream:
        """Queues a greedy request; its stream yields tokens as they are drawn."""
        if len(prompt) + max_tokens - 1 > self.max_seq_len:
            raise CacheOverflowError(
                f"prompt ({len(prompt)}) + max_tokens={max_tokens} exceeds "
                f"max_seq_len={self.max_seq_len} + 1"
            )
        request = Request(prompt=tuple(int(t) for t in prompt), max_tokens=max_tokens, seed=seed)
        with self._cond:
            if self._failure is not None or self._stopping:
                raise QueueFullError(f"the dense batcher is stopped ({self._failure!r})")
            if len(self._queue) >= self.max_queue:
                raise QueueFullError(f"{len(self._queue)} requests are already waiting")
            stream = RequestStream(self._next_id, request)
            self._next_id += 1
            self._queue.append(stream)
            self.stats.submitted += 1
            self._cond.notify_all()
        return stream

    @property
    def active(self) -> int:
        """Requests holding a decode slot."""
        return self._active

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def slots(self) -> int:
        return self.slot_steps.n_slots

    # --- life cycle ----------------------------------------------------------------------

    def row_buckets(self) -> list[int]:
        """Prefill batch sizes: 1 doubled up to ``prefill_batch``."""
        rows, out = 1, []
        while rows < self.prefill_batch:
            out.append(rows)
            rows *= 2
        return [*out, self.prefill_batch]

    def warmup(self, prompt_lens: Iterable[int]) -> None:
        """Compiles prefill, first-token draw and insert per (rows, length) bucket, and the
        decode step, before the first request."""
        eng = self.engine
        for rows in self.row_buckets():
            for length in sorted({eng.bucket(n) for n in prompt_lens}):
                logits, k, v = eng.steps.compile_prefill(eng.params, rows, length)
                self.first_tokens.compile(logits)
                row_ints = jax.ShapeDtypeStruct((rows,), np.int32)
                self.slot_steps.compile_insert(Inserted(k, v, row_ints, row_ints))
        self.slot_steps.compile_step(eng.params)

    def start(self) -> DenseBatcher:
        """Starts the decode loop in a thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._guarded, name="dense_decode", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Ends the loop; what has not finished ends with reason ``"shutdown"``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._end_all("shutdown")

    def _guarded(self) -> None:
        try:
            self._decode_loop()
        except BaseException as e:  # noqa: BLE001 - reported to every waiting client
            with self._cond:
                self._failure = e
                self._stopping = True
            self._end_all("error", e)

    def _end_all(self, reason: str, error: BaseException | None = None) -> None:
        with self._cond:
            streams = [*self._queue, *(s for s in self._owners if s is not None)]
            self._queue.clear()
        for stream in streams:
            stream.finish(reason, error)

    # --- prefill -------------------------------------------------------------------------

    def _prefill(self, streams: list[RequestStream]) -> _Batch:
        """Prefills ``streams`` together and sends each its first token at once."""
        eng = self.engine
        rows = next(r for r in self.row_buckets() if r >= len(streams))
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
        requests = [s.request for s in streams]
        requests += [requests[0]] * (rows - len(streams))
        sampling_P = RowSampling.rows([r.sampling for r in requests], [r.seed for r in requests])
        first_P, _ = self.first_tokens(logits_PV, sampling_P, np.zeros(rows, np.int32))
        first = np.asarray(jax.device_get(first_P))
        self.stats.prefill_batches += 1
        live = [self._first(s, int(t)) for s, t in zip(streams, first[: len(streams)], strict=True)]
        inserted = Inserted(k=k, v=v, lengths_P=lengths, first_P=first_P)
        self.stats.prefill_seconds += time.perf_counter() - start
        return _Batch(live, inserted, sampling_P)

    def _first(self, stream: RequestStream, token: int) -> RequestStream | None:
        """Sends a request its first token; None if that finished it (it takes no slot)."""
        if stream.emit(token) is None:
            return stream
        with self._cond:
            self.stats.finished += 1
        return None

    # --- decode --------------------------------------------------------------------------

    def _next_batches(self, free: int) -> list[_Batch]:
        """Queued requests prefilled into at most ``free`` slots, in order."""
        batches = []
        while free:
            with self._cond:
                n = min(free, self.prefill_batch, len(self._queue))
                streams = [self._queue.popleft() for _ in range(n)]
            if not streams:
                break
            batches.append(self._prefill(streams))
            free -= len(batches[-1].live)
        return batches

    def _wait_for_work(self, busy: bool) -> bool:
        """Blocks while there is nothing to do; False once the loop should end."""
        with self._cond:
            if not busy:
                self._cond.wait_for(lambda: self._stopping or self._queue)
            return not self._stopping

    def _decode_loop(self) -> None:
        """Decode steps over the slots, refilled in between; step ``n + 1`` is dispatched
        before step ``n``'s tokens are read, so host work overlaps the device's."""
        slots = self.slot_steps.empty()
        owners = self._owners
        release_B = np.zeros(len(owners), bool)
        pending = None  # the last step's tokens (on device) and who held each slot then
        while self._wait_for_work(any(owners) or pending is not None):
            free = [i for i, s in enumerate(owners) if s is None]
            for batch in self._next_batches(len(free)):
                slots = self._insert(slots, batch, free, owners, release_B)
            dispatched = None
            if any(owners):
                slots, next_B = self.slot_steps.step(self.engine.params, slots, release_B)
                release_B[:] = False
                dispatched = (next_B, list(owners))
            if pending is not None:
                self._deliver(*pending, owners, release_B)
            pending = dispatched

    def _deliver(self, next_B, holders, owners, release_B) -> None:
        """Streams one step's tokens to the requests that held the slots when it ran."""
        tokens_B = np.asarray(jax.device_get(next_B))
        self.stats.decode_steps += 1
        for i, stream in enumerate(holders):
            if stream is None or stream.done:
                continue
            if stream.emit(int(tokens_B[i])) is not None and owners[i] is stream:
                owners[i] = None
                release_B[i] = True
                with self._cond:
                    self._active -= 1
                    self.stats.finished += 1

    def _insert(self, slots, batch: _Batch, free: list[int], owners, release_B):
        """Writes a batch's live requests into free slots (padding rows are dropped)."""
        live = batch.live
        if not live:
            return slots
        slot_P = np.full(batch.inserted.lengths_P.shape[0], len(owners), np.int32)
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
