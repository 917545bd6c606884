"""A continuous batcher's sizes and the programs it compiles.

How big its prefills are (:func:`prefill_rows`, :func:`size_prefill_batch`, :func:`row_buckets`,
:func:`default_max_prefill_tokens`), what a disaggregated pair must share
(:func:`check_pair`), and :class:`BatcherPrograms`: the programs serving runs, listed as
a :class:`~jaxpar.engine._warmup.WarmupPlan` (each prefill row and token bucket with the
first-token draw and insert after it, each prefill with context, each decode step's rows
and block-table width) and compiled, for :meth:`ContinuousBatcher.warmup
<jaxpar.engine.ContinuousBatcher.warmup>`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

import jax
import numpy as np

from jaxpar.engine._cache import CacheManager
from jaxpar.engine._decode_groups import DecodeGrouping, StepCost
from jaxpar.engine._engine import InferenceEngine
from jaxpar.engine._executor import Executor
from jaxpar.engine._kv_budget import KVBudget, size_pool
from jaxpar.engine._kv_regroup import regrouped_shapes
from jaxpar.engine._pages import PagePool, PageTable
from jaxpar.engine._prefix import cache_salt
from jaxpar.engine._scheduler import Scheduler, SchedulerConfig
from jaxpar.engine._slots import FirstTokens, Inserted, SlotSteps
from jaxpar.engine._warmup import Bucket, WarmupPlan, ordered
from jaxpar.errors import ConfigError
from jaxpar.models import KVCache
from jaxpar.spec import Module, Phase, mesh_axes

#: Prefill tokens a decode step's time could compute on an accelerator: decode reads
#: every weight once per step (bandwidth-bound), prefill is compute-bound, so one step
#: costs about as much as prefilling the machine balance (peak flops / bandwidth) in
#: tokens: ~240 for bf16 on TPU v5e, ~300 on H100.
ACCELERATOR_STEP_TOKENS = 256
#: Prefill tokens between two decode steps by default on CPU. There prefill and decode are
#: both compute-bound, so no budget hides a prefill behind a step: the budget trades how
#: long a running stream waits when a prompt arrives against how many prefills (each a
#: round trip between steps, each padded to its bucket) a prompt takes. Measured with
#: ``scripts/bench_serving.py``'s workloads (SmolLM2-135M shapes, f32, one CPU device, 2
#: cores shared with other jobs, load ~1.8; budgets 64 / 256 / 512): saturated output
#: tokens/s 100.5 / 104.8 / 110.0; light load TTFT p50 528 / 437 / 426 ms and ITL p99
#: 189 / 101 / 99 ms (a prompt of up to 256 tokens prefilled whole stalls a stream once,
#: in chunks of 64 up to four times). A long prompt's chunks are the budget's size too,
#: so its stalls grow with it: 256 keeps them near half of 512's.
CPU_MAX_PREFILL_TOKENS = 256
#: The pieces a long prompt (longer than a chunk) is prefilled in on CPU, one between two
#: decode steps: the streams running meanwhile stall for a piece, not a chunk. Same
#: workloads: a 1,600-token prompt among 8 streams gave the streams an ITL p99 of 537 ms
#: in 64-token chunks, 1,829 ms in 256-token ones.
CPU_LONG_CHUNK_TOKENS = 64


def default_max_prefill_tokens(platform: str, page_size: int) -> int:
    """Prefill tokens between two decode steps by default, in whole pages: on an
    accelerator about two decode steps' worth, so a running request waits at most about
    three steps' time for its next token; on CPU :data:`CPU_MAX_PREFILL_TOKENS`."""
    tokens = CPU_MAX_PREFILL_TOKENS if platform == "cpu" else 2 * ACCELERATOR_STEP_TOKENS
    return max(tokens // page_size, 1) * page_size


def prefill_rows(engine: InferenceEngine) -> int:
    """The prefill's batch shards: the product of the mesh axes that carry batch in prefill
    (dp, and ep for a MoE: the tables make ep split every module's batch), so the smallest
    prefill batch that divides over them; pipelined, times the prefill's microbatches
    (each takes its share of every shard's rows)."""
    pc = engine.parallel_config
    axes = mesh_axes(Module.ATTENTION, Phase.PREFILL, pc, dims=engine.model_config)["batch"]
    microbatches = pc.microbatches if pc.pp > 1 else 1
    return math.prod(pc.degree(a) for a in axes) * microbatches


def size_prefill_batch(engine: InferenceEngine, wanted: int | None, separate) -> int:
    """Most prompts prefilled together: by default the prefill engine's ``max_batch`` when
    disaggregated, else up to 4 per batch shard (fewer take a smaller row bucket)."""
    shards = prefill_rows(engine)
    default = engine.max_batch
    if separate is None:
        default = min(engine.max_batch, 4 * shards) // shards * shards
    pb = wanted or default
    if pb % shards or pb > engine.max_batch:
        raise ConfigError(
            f"prefill_batch={pb} must be a multiple of the prefill strategy's batch shards "
            f"({shards}: the degrees of the axes carrying batch in prefill, dp and ep for a "
            f"MoE, times the microbatches of a pipeline) and at most its "
            f"max_batch={engine.max_batch}"
        )
    return pb


def row_buckets(engine: InferenceEngine, batch: int) -> list[int]:
    """Prefill batch sizes: the prefill's batch shards (dp, times ep for a MoE) times
    powers of four, up to ``batch`` (few prefill compiles; a batch pads to at most four
    times its prompts)."""
    rows, out = prefill_rows(engine), []
    while rows < batch:
        out.append(rows)
        rows *= 4
    return [*out, batch]


def scheduler_config(
    engine: InferenceEngine,
    page_size: int,
    batch: int | None,
    max_prefill_tokens: int | None,
    separate: InferenceEngine | None,
    platform: str,
) -> SchedulerConfig:
    """A batcher's prefill limits on the prefill ``engine``: ``batch`` prompts at most
    (:func:`size_prefill_batch`) in :func:`row_buckets`, ``max_prefill_tokens`` between two
    decode steps (default :func:`default_max_prefill_tokens` on the decode devices'
    ``platform``), a chunk (the most a prompt prefills at once): what fits that in the
    smallest row bucket, in whole pages; and the pieces of a longer prompt: on CPU
    :data:`CPU_LONG_CHUNK_TOKENS` (at most a chunk), elsewhere a chunk."""
    batch = size_prefill_batch(engine, batch, separate)
    budget = max_prefill_tokens or default_max_prefill_tokens(platform, page_size)
    if budget < 1:
        raise ConfigError(f"max_prefill_tokens must be >= 1, got {budget}")
    buckets = row_buckets(engine, batch)
    chunk = max(budget // buckets[0] // page_size, 1) * page_size
    long_chunk = None
    if platform == "cpu":
        long_chunk = min(max(CPU_LONG_CHUNK_TOKENS // page_size, 1) * page_size, chunk)
    return SchedulerConfig(batch, tuple(buckets), chunk, budget, long_chunk)


def decode_pool(engine: InferenceEngine, budget: KVBudget) -> PagePool:
    """The decode rows' page pool: ``budget`` on the engine's devices, for its
    ``max_batch`` rows (room left for a decode step's temporaries)."""
    return size_pool(
        budget,
        config=engine.parallel_config,
        mesh=engine.mesh,
        dims=engine.program.run,
        rows=engine.max_batch,
        max_seq_len=engine.max_seq_len,
        step_temp_bytes=lambda: step_temp_bytes(engine),
    )


def prefill_pool(engine: InferenceEngine, budget: KVBudget, page_size: int, longest: int):
    """A disaggregated prefill group's own page pool: ``budget`` on its devices, for its
    ``max_batch`` rows of up to ``longest`` tokens, in the decode cache's page size."""
    return size_pool(
        dataclasses.replace(budget, page_size=page_size),
        config=engine.parallel_config,
        mesh=engine.mesh,
        dims=engine.program.run,
        rows=engine.max_batch,
        max_seq_len=longest,
        step_temp_bytes=lambda: 0,  # no decode step runs there
        release=False,  # whole prompts move to the decode group
    )


@dataclasses.dataclass(frozen=True)
class BatcherParts:
    """A batcher's page pools: the decode rows' (``pool``, its book ``pages``, their
    programs and cache manager) and the pages prefill writes (the same colocated; a
    disaggregated prefill group's own, which hold its prefix cache), the longest prompt
    either holds, and the scheduler over them."""

    pool: PagePool
    pages: PageTable
    slot_steps: SlotSteps
    cache: CacheManager
    prefill_cache: CacheManager
    prefill_slot_steps: SlotSteps
    max_prompt_len: int
    scheduler: Scheduler


def batcher_parts(
    engine: InferenceEngine,
    prefill: InferenceEngine | None,
    budget: KVBudget,
    caching: bool,
    batch: int | None,
    max_prefill_tokens: int | None,
    split_decode: bool = True,
) -> BatcherParts:
    """Sizes and builds the page pools of a batcher decoding on ``engine`` (prefilling on
    ``prefill`` when disaggregated), with prefix caching where prefill writes, and its
    scheduler (:func:`scheduler_config`'s limits; ``split_decode``: decode steps split by
    block-table width where :func:`decode_grouping` has a cost model)."""
    if prefill is not None:
        check_pair(engine, prefill)
    pool = decode_pool(engine, budget)
    pages, salt = PageTable(pool), cache_salt(engine.program.run)
    slot_steps = SlotSteps(engine.steps, engine.program.run, pool)
    longest = min(pool.max_seq_len, (prefill or engine).max_seq_len)
    cache = prefill_cache = CacheManager(pages, salt, caching=caching and prefill is None)
    prefill_steps, eng = slot_steps, prefill or engine
    if prefill is not None:
        own = prefill_pool(prefill, budget, pool.page_size, longest)
        prefill_cache = CacheManager(PageTable(own), salt, caching=caching)
        prefill_steps = SlotSteps(prefill.steps, prefill.program.run, own)
    platform = engine.mesh.devices.flat[0].platform
    config = scheduler_config(eng, pool.page_size, batch, max_prefill_tokens, prefill, platform)
    scheduler = Scheduler(
        config,
        cache,
        bucket=eng.bucket,
        prefill_cache=prefill_cache if prefill is not None else None,
        prefill_rows=eng.max_batch,
        grouping=decode_grouping(slot_steps, cache, platform) if split_decode else None,
    )
    return BatcherParts(
        pool, pages, slot_steps, cache, prefill_cache, prefill_steps, longest, scheduler
    )


def decode_grouping(
    slot_steps: SlotSteps,
    cache: CacheManager,
    platform: str,
    cost: StepCost | None = None,
    ready: Callable[[int, int], bool] | None = None,
) -> DecodeGrouping | None:
    """The policy splitting a decode step by block-table width
    (:mod:`jaxpar.engine._decode_groups`): on CPU, with the cost model fitted there
    (``cost``: another); None elsewhere (no model fitted: one dispatch per step).
    ``ready(computed, width)``: a group program may run now (None: any may)."""
    if cost is None and platform != "cpu":
        return None
    pool = slot_steps.pool
    return DecodeGrouping(
        cost or StepCost(),
        rows=pool.rows,
        shards=pool.shards,
        page_size=pool.page_size,
        width=cache.width,
        bucket=slot_steps.bucket,
        ready=ready,
    )


def check_pair(decode: InferenceEngine, prefill: InferenceEngine) -> None:
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


def step_temp_bytes(engine: InferenceEngine) -> int:
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


class BatcherPrograms:
    """The serving programs of one batcher, listed and compiled (nothing runs).

    Args:
        engine / prefill_engine: decode's and prefill's engines (the same colocated).
        slot_steps / prefill_slot_steps: the decode rows' page programs, and those of
            the pages prefill reads its context through (the same colocated).
        first_tokens: the first-token draw; ``executor``: the batcher's (its quantizer).
        cache / prefill_cache: the decode rows' pages, and prefill's.
        scheduler: its chunk size and context buckets.
        max_prompt_len: the longest prompt.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        prefill_engine: InferenceEngine,
        slot_steps: SlotSteps,
        prefill_slot_steps: SlotSteps,
        first_tokens: FirstTokens,
        executor: Executor,
        cache: CacheManager,
        prefill_cache: CacheManager,
        scheduler: Scheduler,
        max_prompt_len: int,
    ):
        self.engine, self.prefill_engine = engine, prefill_engine
        self.slot_steps, self.prefill_slot_steps = slot_steps, prefill_slot_steps
        self.first_tokens, self.executor = first_tokens, executor
        self.cache, self.prefill_cache = cache, prefill_cache
        self.scheduler = scheduler
        self.max_prompt_len = max_prompt_len
        self.disaggregated = prefill_cache is not cache

    def table_widths(self) -> list[int]:
        """The block-table widths a decode step compiles for (powers of two)."""
        longest = self.cache.pool.max_seq_len
        lengths = range(1, longest + 1, self.cache.page_size)
        widths = {self.cache.width(t) for t in lengths}
        return sorted(widths | {self.cache.width(longest)})

    def plan(self, prompt_lens: Iterable[int] | None = None) -> WarmupPlan:
        """What a warm-up compiles, smallest first: prefill and insert for each (rows,
        prompt-length bucket) (colocated, prompt lengths stop at a chunk's bucket: a longer
        prompt is prefilled in chunks), prefill with context for each (rows, new tokens,
        cached pages), the decode step for each (rows, block-table width), and with decode
        steps split by width, each group program a split can run (its rows by id:
        :meth:`DecodeGrouping.programs <jaxpar.engine._decode_groups.DecodeGrouping.programs>`)."""
        lens = list(prompt_lens or range(1, self.max_prompt_len + 1))
        eng, chunk = self.prefill_engine, self.scheduler.config.chunk_tokens
        if self.disaggregated:  # whole prompts move to the decode group: every length
            lengths = {eng.bucket(n) for n in lens}
        else:
            lengths = {eng.bucket(min(n, chunk)) for n in lens}
        rows = self.scheduler.config.row_buckets
        buckets = [Bucket("prefill", r, t) for r in rows for t in lengths]
        z = self.cache.page_size
        buckets += [Bucket("context", r, t, n * z) for r, t, n in self._context_buckets(max(lens))]
        buckets += [
            Bucket("decode", r, width * z)
            for r in self.slot_steps.row_buckets()
            for width in self.table_widths()
        ]
        grouping = self.scheduler.grouping
        if grouping is not None:
            shards = self.slot_steps.pool.shards
            buckets += [
                Bucket("split", rows * shards, width * z)
                for rows, width in grouping.programs(self.table_widths())
            ]
        return ordered(buckets)

    def _context_buckets(self, longest: int) -> list[tuple[int, int, int]]:
        """(rows, new tokens, cached pages) of every prefill with context for prompts of
        up to ``longest`` tokens: chunks of long prompts (one row bucket), and with
        prefix caching, prefix hits (every row bucket)."""
        z, caching = self.cache.page_size, self.prefill_cache.caching
        if longest <= self.scheduler.config.chunk_tokens and not caching:
            return []
        # Cached tokens are whole pages, and at least one token of a prompt is computed.
        width = self.prefill_cache.context_width
        n_pages = {width(n) for n in range(1, (longest - 1) // z + 1)}
        buckets = self.scheduler.config.row_buckets
        rows = buckets if caching else buckets[:1]
        lengths = self.scheduler.context_lengths()
        out = [(r, t, n) for r in rows for t in lengths for n in sorted(n_pages)]
        if longest > self.scheduler.config.chunk_tokens:  # a long prompt's smaller pieces
            pieces = set(self.scheduler.context_lengths(alone=True)) - set(lengths)
            out += [(buckets[0], t, n) for t in sorted(pieces) for n in sorted(n_pages)]
        return out

    def compiler(self, bucket: Bucket) -> Callable[[], object]:
        """Compiles one bucket's programs when called."""
        z = self.cache.page_size
        if bucket.kind in ("decode", "split"):
            width, indexed = bucket.tokens // z, bucket.kind == "split"
            return lambda: self.slot_steps.compile_step(
                self.engine.params, width, bucket.rows, indexed=indexed
            )
        n_pages = bucket.context // z
        return lambda: self.compile_prefill(bucket.rows, bucket.tokens, n_pages)

    def compile_prefill(self, rows: int, length: int, n_pages: int = 0) -> None:
        """Compiles a prefill of ``[rows, length]`` tokens (after ``n_pages`` cached pages)
        and what follows it: the first tokens' draw, the insert into pages (and, on a
        disaggregated prefill group, the read of whole prompts back from its pages)."""
        eng, steps = self.prefill_engine, self.prefill_slot_steps
        logits, k, v = eng.steps.compile_prefill(eng.params, rows, length)
        if n_pages:
            context = n_pages * self.cache.page_size
            steps.compile_context(rows, n_pages, eng.layouts.kv_prefill)
            eng.steps.compile_prefill_context(eng.params, rows, length, context)
        self.first_tokens.compile(logits)
        row_ints = jax.ShapeDtypeStruct((rows,), np.int32)
        steps.compile_insert(Inserted(k, v, row_ints, row_ints))
        if self.disaggregated:
            quantizer = self.executor.kv_quantizer  # quantized decode cache: quantized K/V in
            if quantizer is not None:
                k, v = quantizer.compile(k, v)
            have, want = eng.run.kv_head_replicas, self.engine.run.kv_head_replicas
            if have != want:  # the decode group holds another count of each K/V head
                k, v = (regrouped_shapes(x, have, want) for x in (k, v))
            self.slot_steps.compile_insert(Inserted(k, v, row_ints, row_ints))
            whole = self.prefill_cache.pool.pages_for(length)
            steps.compile_context(rows, whole, eng.layouts.kv_prefill, length)
