"""Decode slots for continuous batching over a paged KV cache: the device state and its
two programs.

A serving engine keeps ``B`` decode rows in the decode layout: the page pool of every
layer (:class:`~jaxpar.models.PagedKVCache`; which pages a row holds is the host's
:class:`~jaxpar.engine._pages.PageTable`) plus, per row, its length, the token it feeds
next, whether it is active, how many tokens it has drawn, its sampling parameters and
the tokens it has seen, for penalties (:class:`Slots`). Two compiled programs change it:

* ``insert``: takes prefill K/V of a few requests (``[P, T, K, H]`` per layer, in the
  prefill layout of this engine's strategy) and their first tokens, and writes them into
  their pages and rows: scatters into the donated pool, so only the new pages move; each
  row's token counts are built from its context (:class:`~jaxpar.engine._penalties.History`).
  One compile per (rows, prompt-length) bucket.
* ``step``: one decode step over every row, each with its own length, pages, sampling row
  and step; inactive rows write to their shard's scratch page. The block tables are an
  input of ``N`` columns, a power of two just above the longest live row: the step reads
  ``N`` pages per row, so its cost follows the live tokens. One compile per ``N``. It
  returns each row's token and, where some row asks, their logprobs
  (:class:`~jaxpar.engine._logprobs.Logprobs`). Each row's token mask (structured output,
  :mod:`jaxpar.engine._grammar`) is an input too, every bit set for rows without a
  grammar: a constrained request changes the mask, not the program.

:class:`FirstTokens` draws each request's first token (and its logprobs) from its prefill
logits, on the prefill devices (one compile per row count), so it reaches the client
before the insert, under its grammar's mask if it has one. Sampling parameters and masks
are arrays (:class:`RowSampling`), so no request ever recompiles.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.engine._grammar import all_allowed, mask_words
from jaxpar.engine._logprobs import Logprobs
from jaxpar.engine._pages import PagePool
from jaxpar.engine._penalties import History, Seen
from jaxpar.engine._pipeline_slots import SlotPipeline
from jaxpar.engine._placement import put_global
from jaxpar.engine._sampling import RowSampling, Sampling, select_rows
from jaxpar.engine._steps import Steps
from jaxpar.engine._vocab import mask_padded
from jaxpar.errors import ConfigError
from jaxpar.models import (
    ModelConfig,
    PagedKVCache,
    count_dropped,
    kv_groups,
    quantize_tree,
    read_pages,
    total_dropped,
    write_prompts,
)
from jaxpar.spec import Phase

DECODE = Phase.DECODE

#: The fewest rows a decode step computes per batch shard (fewer live rows pad to it),
#: by platform. On an accelerator a decode step is bound by reading the weights once, so
#: a few more rows cost almost nothing and a floor of 8 keeps the step compiles few. On
#: CPU the step is compute-bound, its cost about proportional to the rows it computes
#: (SmolLM2-135M shapes, 2 cores, rows of 256 tokens: 45 ms for one row, 94 ms for 8, 128 ms
#: for 16): a lone request computes one.
STEP_ROW_FLOOR = {"cpu": 1}
#: :data:`STEP_ROW_FLOOR` on the platforms it does not name.
ACCELERATOR_STEP_ROW_FLOOR = 8
#: Past one row, a step computes at least this many (per batch shard): on CPU two rows
#: cost what four do (same shapes: 75 ms and 76 ms), so a 2-row step would only add a
#: compile per block-table width.
ROWS_PAST_ONE = 4


def step_row_floor(platform: str) -> int:
    """The fewest rows per batch shard a decode step on ``platform`` computes."""
    return STEP_ROW_FLOOR.get(platform, ACCELERATOR_STEP_ROW_FLOOR)


@flax.struct.dataclass
class Slots:
    """The decode rows' device state: the page pool, and ``B`` rows of everything else."""

    k: Any  # the pool: per-layer [K, A, Z, H] tuple, or stacked [L, K, A, Z, H]
    v: Any
    lengths_B: jax.Array  # int32: tokens cached per row
    tokens_B: jax.Array  # int32: the token each row appends next
    active_B: jax.Array  # bool
    step_B: jax.Array  # int32: tokens drawn so far (the sampling key's step)
    sampling: RowSampling
    seen: Seen  # [B, V]: tokens generated (counts) and in the prompt, for penalties


@flax.struct.dataclass
class Inserted:
    """New requests' prefill results, ready for :meth:`SlotSteps.insert` (device arrays)."""

    k: Any  # per-layer [P, T, K, H] tuple, or stacked [L, P, T, K, H]
    v: Any
    lengths_P: jax.Array  # prompt lengths
    first_P: jax.Array  # each request's first new token (drawn after prefill)

    @property
    def nbytes(self) -> int:
        """Bytes of what moves between prefill and decode devices."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


class KVQuantizer:
    """Quantizes prefilled K/V where the prefill ran (``steps``' devices, its prefill
    layout), before a disaggregated transfer: the K/V then cross with their scales, at
    the stored width (int8/fp8 plus one float32 per token per kv head) rather than the
    compute dtype's. One compile per K/V shape."""

    def __init__(self, steps: Steps, mode: str):
        self.steps, self.mode = steps, mode

    def _program(self, k, v):
        lay = self.steps.layouts.kv_prefill
        return self.steps.compile(
            "quantize_kv",
            (jax.tree.map(jnp.shape, k), self.mode),
            lambda k, v: (quantize_tree(k, self.mode), quantize_tree(v, self.mode)),
            (lay, lay),
            (lay, lay),  # a prefix: a tensor's values and scales split alike
            (k, v),
        )

    def __call__(self, new: Inserted) -> Inserted:
        k, v = self._program(new.k, new.v)(new.k, new.v)
        return new.replace(k=k, v=v)

    def compile(self, k, v) -> tuple[Any, Any]:
        """Compiles the quantization of K/V shaped like ``k``, ``v`` (``ShapeDtypeStruct``
        trees) ahead of its first call; returns its outputs' shapes."""
        lay = self.steps.layouts.kv_prefill

        def placed(s, x):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), x)

        k, v = (jax.tree.map(placed, lay, x) for x in (k, v))
        return self._program(k, v).out_info


class SlotSteps:
    """Compiles and runs ``insert`` and ``step`` over ``steps``' decode layout.

    Args:
        steps: the engine's step functions (graph, layouts, mesh, strategy).
        model_config: the model as the engine runs it.
        pool: the paged cache's shape (rows, pages, page size).
    """

    def __init__(self, steps: Steps, model_config: ModelConfig, pool: PagePool):
        self.steps = steps
        #: The decode step through pipeline stages (None: unpipelined).
        self.pipeline = SlotPipeline.of(steps, model_config, pool)
        self.model_config = model_config
        self.pool = pool
        #: The KV groups of the pool (None: one block table, every layer a position).
        self.groups = kv_groups(model_config)
        if pool.groups != (1 if self.groups is None else self.groups.n_groups):
            raise ConfigError(
                f"a pool of {pool.groups} block table(s) per row for a model with "
                f"{1 if self.groups is None else self.groups.n_groups} KV group(s)"
            )
        self.n_slots = pool.rows
        platform = steps.platform or steps.mesh.devices.flat[0].platform
        #: The fewest rows per batch shard a step computes (:func:`step_row_floor`).
        self.row_floor = step_row_floor(platform)
        # Programs are cached on ``steps`` (shared with other SlotSteps of the engine, e.g.
        # offline generation's): keyed by the pool's shape too.
        self._pool_key = (pool.pages, pool.page_size)
        self._idle_sampling = RowSampling.rows([Sampling()] * pool.rows, [0] * pool.rows)
        self._keep_all: jax.Array | None = None  # release nothing (placed on first use)
        self._allow_all: jax.Array | None = None  # no grammar in any row (placed on first use)
        #: Words of a row's packed token mask: the (padded) vocabulary the step's logits have.
        self.mask_words = mask_words(model_config.vocab_size)
        #: Ids of a row's context an insert takes (:class:`History`): the longest row.
        self.history_width = pool.max_seq_len
        lay = steps.layouts
        row = lay.tokens_B
        row_x = NamedSharding(row.mesh, PartitionSpec(*row.spec, None))
        self.tables_layout = lay.paged.block_tables_BN
        #: Layout of the ``[B, words]`` token masks: rows as the batch, words whole.
        self.mask_layout = row_x
        self.layout = Slots(
            k=lay.paged.k,
            v=lay.paged.v,
            lengths_B=lay.paged.lengths_B,
            tokens_B=row,
            active_B=row,
            step_B=row,
            sampling=RowSampling.like(row, row_x),
            seen=Seen(row_x, row_x),
        )

    # --- state ---------------------------------------------------------------------------

    def empty(self) -> Slots:
        """Every row free, every page zero, in the decode layout."""
        return jax.jit(self._empty, out_shardings=self.layout)()

    def abstract(self) -> Slots:
        """:meth:`empty`'s shapes and shardings, allocating nothing."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            jax.eval_shape(self._empty),
            self.layout,
        )

    def _empty(self) -> Slots:
        b = self.n_slots
        c, pages, size = self.model_config, self.pool.pages, self.pool.page_size
        return Slots(
            k=PagedKVCache.empty_pool(c, pages, size, "k"),
            v=PagedKVCache.empty_pool(c, pages, size, "v"),
            lengths_B=jnp.zeros(b, jnp.int32),
            tokens_B=jnp.zeros(b, jnp.int32),
            active_B=jnp.zeros(b, bool),
            step_B=jnp.zeros(b, jnp.int32),
            sampling=jax.tree.map(jnp.asarray, self._idle_sampling),
            seen=Seen.zeros(b, self.model_config.vocab_size),
        )

    @property
    def pool_bytes(self) -> int:
        """Bytes of the whole pool (every device's share)."""
        return PagedKVCache.pool_bytes(self.model_config, self.pool.pages, self.pool.page_size)

    def pool_bytes_per_device(self) -> int:
        """Bytes of the pool on one device (its shard of pages and kv heads)."""
        shapes = jax.eval_shape(self._empty)
        pools = jax.tree.leaves((shapes.k, shapes.v))  # values, and scales when quantized
        shardings = jax.tree.leaves((self.layout.k, self.layout.v))
        return sum(
            math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
            for x, s in zip(pools, shardings, strict=True)
        )

    # --- traced bodies -------------------------------------------------------------------

    def _insert(
        self, slots: Slots, new: Inserted, slot_P, pages_PN, step_P, sampling_P, start_P, history
    ):
        """Writes new rows ``slot_P`` (``>= B``: a padding row, dropped) and their pages
        ``pages_PN`` (global ids; ``>= A``: dropped); ``step_P``: each row's draws so far;
        ``start_P``: tokens each row had cached before these (its pages ``pages_PN`` start
        at that position, a page boundary); ``history``: each row's context, whose
        generated tokens and the first new one it counts."""
        with self.steps.context(DECODE):

            def put(x_B, x_P):
                return x_B.at[slot_P].set(x_P.astype(x_B.dtype), mode="drop")

            seen_P = history.seen(self.model_config.vocab_size)
            seen_P = seen_P.add(new.first_P, jnp.ones_like(slot_P, bool))

            return Slots(
                k=write_prompts(slots.k, new.k, pages_PN, self.groups),
                v=write_prompts(slots.v, new.v, pages_PN, self.groups),
                lengths_B=put(slots.lengths_B, new.lengths_P + start_P),
                tokens_B=put(slots.tokens_B, new.first_P),
                active_B=put(slots.active_B, jnp.ones_like(slot_P, bool)),
                step_B=put(slots.step_B, step_P + 1),
                sampling=jax.tree.map(put, slots.sampling, sampling_P),
                seen=jax.tree.map(put, slots.seen, seen_P),
            )

    def _row_views(self, rows: int):
        """``take``: the first ``rows / shards`` rows of every batch shard of a ``[B, ...]``
        array, as ``[rows, ...]``; ``put``: writes such rows back. Local to each shard."""
        b, shards = self.n_slots, self.pool.shards
        if rows == b:
            return (lambda x: x), (lambda x, y: y)
        per, local = b // shards, rows // shards

        def take(x_B):
            return x_B.reshape(shards, per, *x_B.shape[1:])[:, :local].reshape(rows, *x_B.shape[1:])

        def put(x_B, x_R):
            x_SPx = x_B.reshape(shards, per, *x_B.shape[1:])
            x_SPx = x_SPx.at[:, :local].set(x_R.reshape(shards, local, *x_R.shape[1:]))
            return x_SPx.reshape(x_B.shape)

        return take, put

    def _index_views(self, rows_R):
        """:meth:`_row_views` for the rows ``rows_R`` (global ids, each shard's in its own
        span of ``R / shards``; ``-1``: padding, read as zeros, never written)."""
        shards, per = self.pool.shards, self.n_slots // self.pool.shards
        local_SL = rows_R.reshape(shards, -1)
        local_SL = jnp.where(local_SL < 0, per, local_SL - per * jnp.arange(shards)[:, None])

        def take(x_B):
            x_SP = x_B.reshape(shards, per, *x_B.shape[1:])
            x_SL = jax.vmap(lambda x, i: x.at[i].get(mode="fill", fill_value=0))(x_SP, local_SL)
            return x_SL.reshape(-1, *x_B.shape[1:])

        def put(x_B, x_R):
            x_SP = x_B.reshape(shards, per, *x_B.shape[1:])
            x_SL = x_R.reshape(shards, -1, *x_R.shape[1:]).astype(x_B.dtype)
            x_SP = jax.vmap(lambda x, i, y: x.at[i].set(y, mode="drop"))(x_SP, local_SL, x_SL)
            return x_SP.reshape(x_B.shape)

        return take, put

    def _step(self, params, slots: Slots, release_B, tables_RN, allowed_BW, rows_R=None):
        """One decode step over the rows ``tables_RN`` covers (the first ``R / shards`` of
        each batch shard: every live row), each drawing among the tokens its mask
        ``allowed_BW`` allows; returns the tokens ``[B]`` (``-1`` for inactive rows), their
        logprobs (zeros unless some row asks; of the model's distribution, unmasked) and,
        for a capacity-limited MoE, the step's dropped expert assignments."""
        with self.steps.context(DECODE), count_dropped() as drops:
            if rows_R is None:
                take, put = self._row_views(tables_RN.shape[-2])
            else:  # one group of a split step (:mod:`jaxpar.engine._decode_groups`)
                take, put = self._index_views(rows_R)
            # Released rows (finished requests) are freed wherever they lie.
            active_B = slots.active_B & ~release_B
            lengths_B = jnp.where(active_B, slots.lengths_B, 0)
            tokens_B = jnp.where(active_B, slots.tokens_B, 0)
            # A row past the longest sequence has finished (the host stops requests before
            # max_seq_len, and learns it one step late).
            active_R = take(active_B) & (take(lengths_B) < self.pool.max_seq_len)
            # Inactive rows append at position 0 of their shard's scratch page, never read.
            cache = PagedKVCache(
                k=slots.k,
                v=slots.v,
                # [R, N], or [G, R, N] with KV groups: rows last but one either way
                block_tables_BN=jnp.where(active_R[:, None], tables_RN, 0),
                lengths_B=jnp.where(active_R, take(lengths_B), 0),
                groups=self.groups,
            )
            step_R = take(slots.step_B)
            sampling_R = jax.tree.map(take, slots.sampling).live(active_R)
            seen_R = jax.tree.map(take, slots.seen)
            split = self.steps.vocab_split(DECODE)
            allowed_RW = take(allowed_BW)

            def draw(logits_RV, sampling_R, step_R, seen_R, allowed_RW):
                logits_RV = mask_padded(logits_RV, self.steps.vocab_size)
                next_R = select_rows(logits_RV, sampling_R, step_R, seen_R, allowed_RW, split)
                return next_R, Logprobs.for_rows(logits_RV, next_R, sampling_R.logprobs_B, split)

            rows = (sampling_R, step_R, seen_R, allowed_RW)
            model = self.steps.model(params)
            if self.pipeline is None:
                logits_RV, cache = model.decode(take(tokens_B), cache)
                next_R, logprobs_R = draw(logits_RV, *rows)
            else:  # through the stages, drawn on the last (jaxpar.engine._pipeline_slots)
                next_R, logprobs_R, cache = self.pipeline.step(
                    model, cache, take(tokens_B), draw, rows
                )
            top = logprobs_R.top.shape[-1]  # min(MAX_TOP_LOGPROBS, padded vocabulary)
            logprobs_B = jax.tree.map(put, Logprobs.zeros(tokens_B.shape, top), logprobs_R)
            seen_R = seen_R.add(next_R, active_R)
            slots = Slots(
                k=cache.k,
                v=cache.v,
                lengths_B=put(lengths_B, jnp.where(active_R, cache.lengths_B, 0)),
                tokens_B=put(tokens_B, jnp.where(active_R, next_R, 0)),
                active_B=put(active_B, active_R),
                step_B=put(slots.step_B, step_R + active_R.astype(jnp.int32)),
                sampling=slots.sampling,
                seen=jax.tree.map(put, slots.seen, seen_R),
            )
            drawn_B = put(jnp.full_like(tokens_B, -1), jnp.where(active_R, next_R, -1))
            out = (slots, drawn_B, logprobs_B)
            return (*out, total_dropped(drops)) if self.steps.counts_drops else out

    # --- compiled entry points -----------------------------------------------------------

    def _insert_program(self, slots, new: Inserted, *rows, lower: bool = False):
        lay, rep = self.steps.layouts, self.steps.layouts.replicated
        sampling = RowSampling.like(rep)
        inserted = Inserted(lay.kv_prefill, lay.kv_prefill, lay.lengths_prefill_B, rep)
        return self.steps.compile_or_lower(
            lower,
            "insert",
            (jax.tree.map(jnp.shape, new.k), self._pool_key, self.history_width),
            self._insert,
            (self.layout, inserted, rep, rep, rep, sampling, rep, History(rep, rep, rep)),
            self.layout,
            (slots, new, *rows),
            donate_argnums=(0,),
        )

    def insert(
        self,
        slots: Slots,
        new: Inserted,
        slot_P: np.ndarray,
        pages_PN: np.ndarray,
        step_P: np.ndarray,
        sampling_P: RowSampling,
        start_P: np.ndarray | None = None,
        history: History | None = None,
    ) -> Slots:
        """Writes ``new`` into rows ``slot_P`` and pages ``pages_PN`` (donates ``slots``).

        ``slot_P >= B`` and page ids ``>= A`` are not written; ``step_P``: tokens each
        request has drawn before this one (0, or more for a preempted request resumed);
        ``start_P``: tokens already cached before ``new`` (default 0): ``pages_PN`` are
        the pages from that position on, and a row's length becomes start + new. A chunk
        of a longer prompt writes its pages only (``slot_P >= B``). ``history``: the
        rows' contexts, for their penalties (default: none penalised)."""
        rep = self.steps.layouts.replicated
        if start_P is None:
            start_P = np.zeros(len(slot_P), np.int32)
        if history is None:
            history = History.empty(len(slot_P), self.history_width)
        host = (slot_P, pages_PN, step_P)
        rows = [put_global(np.asarray(x, np.int32), rep) for x in host]
        start = put_global(np.asarray(start_P, np.int32), rep)
        sampling_P = jax.tree.map(lambda x: put_global(x, rep), sampling_P)
        history = jax.tree.map(lambda x: put_global(x, rep), history.fit(self.history_width))
        args = (slots, new, *rows, sampling_P, start, history)
        return self._insert_program(*args)(*args)

    def compile_insert(self, new: Inserted, *, lower: bool = False) -> Any:
        """Compiles ``insert`` for prefill results shaped like ``new`` (``ShapeDtypeStruct``
        trees are enough) ahead of its first call (``lower``: returns the
        ``jax.stages.Lowered`` program instead, compiling nothing)."""
        rows = new.lengths_P.shape[0]
        rep = self.steps.layouts.replicated

        def spec(x, sharding=rep):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        lay = self.steps.layouts

        def placed(sharding, x):  # a prefix: a quantized tensor's values and scales alike
            return jax.tree.map(lambda a: spec(a, sharding), x)

        new = Inserted(
            k=jax.tree.map(placed, lay.kv_prefill, new.k),
            v=jax.tree.map(placed, lay.kv_prefill, new.v),
            lengths_P=spec(new.lengths_P, lay.lengths_prefill_B),
            first_P=spec(new.first_P),
        )
        host = RowSampling.rows([Sampling()] * rows, [0] * rows)
        t = jax.tree.leaves(new.k)[0].shape[-3]
        shape = (rows, *self.pool.ids_shape(self.pool.pages_for(t)))
        pages = jax.ShapeDtypeStruct(shape, np.int32, sharding=rep)
        row_ints = spec(np.zeros(rows, np.int32))
        history = jax.tree.map(spec, History.empty(rows, self.history_width))
        return self._insert_program(
            self.abstract(),
            new,
            row_ints,
            pages,
            row_ints,
            jax.tree.map(spec, host),
            row_ints,
            history,
            lower=lower,
        )

    # --- prefill context -----------------------------------------------------------------

    def _gather(self, slots: Slots, pages_PN, length: int | None):
        with self.steps.context(DECODE):

            def read(pool):
                # [(L,) P, N * Z, K, H], dequantized (a quantized pool) in the model dtype
                x = read_pages(pool, pages_PN, self.model_config.dtype, self.groups)
                return jax.tree.map(lambda a: a[..., :length, :, :], x)

            return read(slots.k), read(slots.v)

    def _context_program(self, slots, pages_PN, out_layout, length):
        rep = self.steps.layouts.replicated
        return self.steps.compile(
            "context",
            (pages_PN.shape, length, self._pool_key),
            functools.partial(self._gather, length=length),
            (self.layout, rep),
            (out_layout, out_layout),
            (slots, pages_PN),
        )

    def context(
        self, slots: Slots, pages_PN: np.ndarray, out_layout: Any, length: int | None = None
    ) -> tuple[Any, Any]:
        """The K and V of ``pages_PN`` (global ids; ``>= A``: zeros) per row, laid out as
        prefill's K/V (``out_layout``, the prefill engine's ``kv_prefill`` on these
        devices; the first ``length`` positions, default all): the cached context a
        prefill with context continues. Reads ``slots`` (not donated). One compile per
        ``pages_PN`` shape and length."""
        pages = put_global(np.asarray(pages_PN, np.int32), self.steps.layouts.replicated)
        return self._context_program(slots, pages, out_layout, length)(slots, pages)

    def compile_context(
        self, rows: int, n_pages: int, out_layout: Any, length: int | None = None
    ) -> None:
        """Compiles :meth:`context` for ``[rows, n_pages]`` page ids ahead of its first call."""
        rep = self.steps.layouts.replicated
        shape = (rows, *self.pool.ids_shape(n_pages))
        pages = jax.ShapeDtypeStruct(shape, np.int32, sharding=rep)
        self._context_program(self.abstract(), pages, out_layout, length)

    def _step_program(
        self, params, slots, release, tables, allowed, rows=None, lower: bool = False
    ):
        lay = self.steps.layouts
        ins = (
            self.steps.params_in,
            self.layout,
            self.layout.active_B,
            self.tables_layout,
            self.mask_layout,
        )
        args = (params, slots, release, tables, allowed)
        if rows is not None:  # one group of a split step: the rows it computes, by id
            ins, args = (*ins, lay.replicated), (*args, rows)
        return self.steps.compile_or_lower(
            lower,
            "slot_step",
            (tables.shape, self._pool_key, rows is not None),
            self._step,
            ins,
            self.steps.with_drops((self.layout, *(lay.replicated,) * 2)),
            args,
            donate_argnums=(1,),
        )

    def masks(self, allowed_BW: np.ndarray | None) -> jax.Array:
        """Token masks placed for :meth:`step`: ``allowed_BW`` (``int32 [B, words]``), or
        with None every token allowed in every row (placed once, reused: steps with no
        constrained row copy nothing to the devices)."""
        if allowed_BW is None:
            if self._allow_all is None:
                allow = all_allowed(self.n_slots, self.model_config.vocab_size)
                self._allow_all = put_global(allow, self.mask_layout)
            return self._allow_all
        return put_global(np.asarray(allowed_BW, np.int32), self.mask_layout)

    def tables(self, tables_BN: np.ndarray, rows: int | None = None) -> jax.Array:
        """Block tables placed for :meth:`step`: those of the first ``rows / shards`` rows
        of every batch shard (default: every row). Place them once while they do not
        change."""
        return put_global(self.table_rows(tables_BN, rows), self.tables_layout)

    def table_rows(self, tables_BN: np.ndarray, rows: int | None = None) -> np.ndarray:
        """:meth:`tables` on the host: the first ``rows / shards`` rows of every shard."""
        rows = rows or self.n_slots
        shards, per = self.pool.shards, self.n_slots // self.pool.shards
        lead = tables_BN.shape[:-2]  # (G,) with KV groups
        tables = tables_BN.reshape(*lead, shards, per, -1)[..., : rows // shards, :]
        return np.ascontiguousarray(tables.reshape(*lead, rows, -1), np.int32)

    def rows_for(self, live: np.ndarray, floor: int | None = None) -> int:
        """The rows a step computes: per batch shard, a power of two above its last live
        row (at least ``floor``, default :attr:`row_floor`; one, or at least
        :data:`ROWS_PAST_ONE`; at most the shard's rows): few step compiles, and a step's
        cost follows the live rows rather than ``max_batch``."""
        per = self.n_slots // self.pool.shards
        local = np.nonzero(live)[0] % per
        return self.bucket(int(local.max()) + 1 if local.size else 1, floor) * self.pool.shards

    def bucket(self, need: int, floor: int | None = None) -> int:
        """The rows per batch shard a step computes for ``need`` rows there
        (:meth:`rows_for`'s buckets)."""
        floor = self.row_floor if floor is None else floor
        per = self.n_slots // self.pool.shards
        need = max(need, min(floor, per))
        rows = 1 if need == 1 else max(1 << (need - 1).bit_length(), ROWS_PAST_ONE)
        return min(rows, per)

    def row_buckets(self, floor: int | None = None) -> list[int]:
        """Every row count :meth:`rows_for` gives."""
        per = self.n_slots // self.pool.shards
        counts = {self.rows_for(np.arange(self.n_slots) == i, floor) for i in range(per)}
        return sorted(counts)

    def step(
        self,
        params,
        slots: Slots,
        release_B: np.ndarray,
        tables: jax.Array,
        allowed: jax.Array | None = None,
        rows_R: np.ndarray | None = None,
    ):
        """Donates ``slots``; ``release_B`` frees rows before the step (finished requests);
        ``tables``: the block tables of the rows to compute, from :meth:`tables`;
        ``allowed``: the rows' token masks, from :meth:`masks` (default: no constraint);
        ``rows_R``: the rows ``tables`` are of, by id (default: the first ``R / shards``
        of each batch shard; see :meth:`step_groups`).

        Returns the new slots, the tokens ``[B]``, their :class:`Logprobs` (zeros unless
        some row asks for them) and the step's dropped MoE assignments (an int32 scalar;
        None unless the model has a capacity factor)."""
        if release_B.any():
            release = put_global(np.asarray(release_B, bool), self.layout.active_B)
        else:  # most steps free nothing: no host-to-device copy for them
            if self._keep_all is None:
                self._keep_all = put_global(np.zeros(self.n_slots, bool), self.layout.active_B)
            release = self._keep_all
        allowed = self.masks(None) if allowed is None else allowed
        args = (params, slots, release, tables, allowed)
        if rows_R is not None:
            args = (*args, put_global(np.asarray(rows_R, np.int32), self.steps.layouts.replicated))
        out = self._step_program(*args)(*args)
        return out if self.steps.counts_drops else (*out, None)

    def step_groups(
        self,
        params,
        slots: Slots,
        release_B: np.ndarray,
        groups: tuple[tuple[np.ndarray, np.ndarray], ...],
        allowed: jax.Array | None = None,
    ):
        """:meth:`step` split into dispatches: ``groups`` holds each one's rows (global
        ids, see :func:`~jaxpar.engine._decode_groups.group_rows`) and their block tables
        on the host; ``release_B`` frees rows before the first. Returns what :meth:`step`
        returns, each row's token and logprobs from the dispatch that computed it."""
        next_B = logprobs = dropped = None
        for i, (rows_R, tables_RN) in enumerate(groups):
            release = release_B if i == 0 else np.zeros_like(release_B)
            tables = put_global(np.asarray(tables_RN, np.int32), self.tables_layout)
            slots, drawn_B, lp, drops = self.step(
                params, slots, release, tables, allowed, rows_R=rows_R
            )
            if next_B is None:
                next_B, logprobs, dropped = drawn_B, lp, drops
                continue
            mine_B = drawn_B >= 0
            next_B = jnp.where(mine_B, drawn_B, next_B)
            logprobs = jax.tree.map(
                lambda a, b, m=mine_B: jnp.where(m.reshape(-1, *(1,) * (a.ndim - 1)), a, b),
                lp,
                logprobs,
            )
            dropped = None if drops is None else dropped + drops
        return slots, next_B, logprobs, dropped

    def compile_step(
        self,
        params,
        width: int,
        rows: int | None = None,
        *,
        lower: bool = False,
        indexed: bool = False,
    ) -> Any:
        """Compiles ``step`` for block tables of ``width`` columns over ``rows`` rows
        (default all) ahead of its first call; returns the compiled program (``lower``:
        the ``jax.stages.Lowered`` one, compiling nothing)."""
        rows = rows or self.n_slots
        release = jax.ShapeDtypeStruct((self.n_slots,), bool, sharding=self.layout.active_B)
        shape = (rows, width) if self.groups is None else (self.groups.n_groups, rows, width)
        tables = jax.ShapeDtypeStruct(shape, np.int32, sharding=self.tables_layout)
        allowed = jax.ShapeDtypeStruct(
            (self.n_slots, self.mask_words), np.int32, sharding=self.mask_layout
        )
        ids = None
        if indexed:  # a group of a split step (:meth:`step_groups`)
            rep = self.steps.layouts.replicated
            ids = jax.ShapeDtypeStruct((rows,), np.int32, sharding=rep)
        return self._step_program(params, self.abstract(), release, tables, allowed, ids, lower)


class FirstTokens:
    """Draws prefilled requests' first tokens where the prefill ran (``steps``' devices).

    ``logits [P, V]`` (the engine's padded vocabulary; padded ids never drawn) and one
    sampling row per request, at step 0: as ``generate`` draws its first token. Penalised
    rows count their context (:class:`History`, ``history_width`` ids: default the
    engine's ``max_seq_len``); rows that ask get their token's :class:`Logprobs`; a row
    with a grammar draws among the tokens its mask allows.
    """

    def __init__(self, steps: Steps, history_width: int | None = None):
        self.steps = steps
        self.history_width = history_width or steps.max_seq_len

    def _draw(self, logits_PV, sampling_P, step_P, history, allowed_PW):
        with self.steps.context(Phase.PREFILL):
            if logits_PV.ndim == 3:  # pipelined: stage-major, the last stage's row is real
                logits_PV = logits_PV[-1]
            logits_PV = mask_padded(logits_PV, self.steps.vocab_size)
            seen_P = history.seen(logits_PV.shape[-1])
            split = self.steps.vocab_split(Phase.PREFILL)
            first_P = select_rows(logits_PV, sampling_P, step_P, seen_P, allowed_PW, split)
            return first_P, Logprobs.for_rows(logits_PV, first_P, sampling_P.logprobs_B, split)

    def _program(self, logits_PV, sampling_P, step_P, history, allowed_PW, lower=False):
        lay = self.steps.layouts
        rep = lay.replicated
        return self.steps.compile_or_lower(
            lower,
            "first_tokens",
            (logits_PV.shape, self.history_width),
            self._draw,
            (lay.logits_prefill, RowSampling.like(rep), rep, History(rep, rep, rep), rep),
            rep,
            (logits_PV, sampling_P, step_P, history, allowed_PW),
        )

    def __call__(
        self,
        logits_PV: jax.Array,
        sampling_P: RowSampling,
        step_P: np.ndarray | None = None,
        history: History | None = None,
        allowed_PW: np.ndarray | None = None,
    ) -> tuple[jax.Array, Logprobs]:
        """Each row's token at its sampling step ``step_P`` (default 0: a first token) and
        its logprobs (zeros unless some row asks); ``history``: the rows' contexts, for
        their penalties (default: none penalised); ``allowed_PW``: the rows' packed token
        masks, ``int32 [P, ceil(V / 32)]`` over the logits' (padded) vocabulary V (default:
        every token allowed)."""
        rep = self.steps.layouts.replicated
        rows = logits_PV.shape[-2]  # [(P,) rows, V]
        sampling_P = jax.tree.map(lambda x: put_global(x, rep), sampling_P)
        if step_P is None:
            step_P = np.zeros(rows, np.int32)
        if history is None:
            history = History.empty(rows, self.history_width)
        step = put_global(np.asarray(step_P, np.int32), rep)
        history = jax.tree.map(lambda x: put_global(x, rep), history.fit(self.history_width))
        if allowed_PW is None:
            allowed_PW = all_allowed(rows, logits_PV.shape[-1])
        allowed = put_global(np.asarray(allowed_PW, np.int32), rep)
        args = (logits_PV, sampling_P, step, history, allowed)
        return self._program(*args)(*args)

    def compile(self, logits_PV: jax.ShapeDtypeStruct, *, lower: bool = False) -> Any:
        """Compiles the draw for ``logits_PV``'s shape ahead of its first call (``lower``:
        returns the ``jax.stages.Lowered`` program instead, compiling nothing)."""
        rep = self.steps.layouts.replicated
        rows = logits_PV.shape[-2]  # [(P,) rows, V]
        host = RowSampling.rows([Sampling()] * rows, [0] * rows)
        logits = jax.ShapeDtypeStruct(
            logits_PV.shape, logits_PV.dtype, sharding=self.steps.layouts.logits_prefill
        )

        def spec(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)

        history = jax.tree.map(spec, History.empty(rows, self.history_width))
        step = jax.ShapeDtypeStruct((rows,), np.int32, sharding=rep)
        allowed = spec(all_allowed(rows, logits_PV.shape[-1]))
        return self._program(logits, jax.tree.map(spec, host), step, history, allowed, lower)
