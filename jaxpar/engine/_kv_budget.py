"""How many KV pages a serving engine gets: from a token budget, or from device memory.

``kv_cache_tokens`` fixes the pool; otherwise it takes ``kv_cache_memory_fraction`` (default
0.9) of what each device has free once the weights are placed, less the decode step's
temporaries. On CPU, where "free memory" is the host's and means little, the default is
:data:`CPU_KV_TOKENS`. :func:`describe` is the line ``jaxpar serve`` prints at start.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import numpy as np

from jaxpar.engine._coordination import agree_min
from jaxpar.engine._pages import PagePool
from jaxpar.errors import ConfigError
from jaxpar.models import (
    PAGE_AXES,
    ModelConfig,
    ModelRun,
    kv_groups,
    kv_positions,
    kv_windows,
)
from jaxpar.spec import Module, ParallelConfig, Phase, mesh_axes, partition_spec

#: Tokens of KV cache on CPU when neither a token budget nor a memory fraction is given.
CPU_KV_TOKENS = 16384
#: Fraction of free device memory the cache takes by default (accelerators).
MEMORY_FRACTION = 0.9
#: Tokens per page by default.
PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class KVBudget:
    """What the user asked for (``None``: the default)."""

    page_size: int = PAGE_SIZE
    tokens: int | None = None
    memory_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.tokens is not None and self.memory_fraction is not None:
            raise ConfigError(
                "give the KV cache a token budget or a memory fraction, not both "
                f"(kv_cache_tokens={self.tokens}, kv_cache_memory_fraction={self.memory_fraction})"
            )
        if self.tokens is not None and self.tokens < 1:
            raise ConfigError(f"kv_cache_tokens must be >= 1, got {self.tokens}")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ConfigError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.memory_fraction}"
            )
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")


@dataclasses.dataclass(frozen=True)
class GroupPages:
    """One KV group's share of a decoding sequence (:func:`sequence_pages`)."""

    layers: int  # layers in the group
    window: int | None  # the sliding window its pages are released by (None: full)
    pages: int  # the most pages one sequence of max_seq_len holds in it


def sequence_pages(dims: ModelConfig, max_seq_len: int, page_size: int) -> list[GroupPages]:
    """Per KV group (one, without groups), the most pages of ``page_size`` tokens a
    decoding sequence of up to ``max_seq_len`` tokens holds: every page in a full group,
    at most what the window spans (``window / page_size + 1``) in a window group. A
    prompt being prefilled holds its pages until its chunks pass them."""
    windows = kv_windows(dims)
    pool = PagePool(page_size, 2, 1, 1, max_seq_len, windows)
    groups = kv_groups(dims)
    counts = (
        [dims.n_layers]
        if groups is None
        else [groups.group_of.count(g) for g in range(pool.groups)]
    )
    return [GroupPages(counts[g], windows[g], pool.group_pages(g)) for g in range(pool.groups)]


def cache_fraction(dims: ModelConfig, max_seq_len: int, page_size: int) -> float:
    """The share of a full cache (every layer holding ``max_seq_len`` tokens) a decoding
    sequence holds over pages with released windows: 1.0 without windows. A group's
    positions no layer uses (Gemma 3's last window group) count: they take memory."""
    need = sequence_pages(dims, max_seq_len, page_size)
    if all(g.window is None for g in need):
        return 1.0
    width = kv_positions(dims)
    tokens = sum(width * min(max_seq_len, g.pages * page_size) for g in need)
    return tokens / (dims.n_layers * max_seq_len)


def kv_cache_tokens_for(dims: ModelConfig, rows: int, max_seq_len: int, page_size: int) -> int:
    """The token budget (:class:`KVBudget` ``tokens``, ``--kv-cache-tokens``: tokens of
    every layer) whose pool holds ``rows`` sequences of ``max_seq_len`` decoding
    together, their windows released (``rows * max_seq_len`` without windows), and at
    least one prompt of ``max_seq_len`` whole: a row takes its prompt's pages in every
    group at admission and gives a window's back as its chunks pass them."""
    need = sequence_pages(dims, max_seq_len, page_size)
    if all(g.window is None for g in need):
        return rows * max_seq_len
    whole = len(need) * math.ceil(max_seq_len / page_size)
    pages = max(rows * sum(g.pages for g in need), whole)  # of kv_positions layers each
    return math.ceil(pages * kv_positions(dims) / dims.n_layers) * page_size


def batch_shards(config: ParallelConfig, dims: ModelConfig) -> int:
    """Decode's batch shards: the pool splits into one slice per shard."""
    axes = mesh_axes(Module.ATTENTION, Phase.DECODE, config, dims=dims)["pages"]
    return math.prod(config.degree(a) for a in axes)


def pages_per_shard(tokens: int, page_size: int, shards: int) -> int:
    """Pages of each shard's slice of a pool holding ``tokens`` tokens (all shards), its
    scratch page included."""
    return math.ceil(math.ceil(tokens / page_size) / shards) + 1


def page_bytes_per_device(
    config: ParallelConfig, mesh: jax.sharding.Mesh, dims: ModelConfig, page_size: int
) -> int:
    """Bytes one page takes on each device holding it: keys and values of every layer
    (with KV groups, of one group's layers: :func:`~jaxpar.models.kv_positions`), for
    the kv heads the device keeps (all of them when replicated over tp); a quantized
    cache's values at their stored width plus one float32 scale per token per kv head."""
    spec = partition_spec(PAGE_AXES, Module.ATTENTION, Phase.DECODE, config, dims=dims)
    kv_axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],) if spec[0] else ()
    local_heads = dims.n_kv_heads // math.prod(mesh.shape[a] for a in kv_axes)
    per_head = ModelRun.of(dims).cache_bytes_per_token // dims.n_kv_heads
    # With KV groups a page holds one group's layers (kv_positions of n_layers).
    return local_heads * page_size * per_head * kv_positions(dims) // dims.n_layers


#: What :func:`free_device_bytes` agrees on for a process with none of the devices.
NO_DEVICES = 2**62


def free_device_bytes(devices) -> int | None:
    """The least free memory over ``devices`` (None where a device does not report it).

    A process can read only its own devices' memory; in a multi-process job each reads
    its share of ``devices`` and every process takes the least of all (so every process
    sizes the same cache: their programs must be the same)."""
    free = []
    for device in devices:
        if device.process_index != jax.process_index():
            continue
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            free = [-1]  # not reported: the other processes must learn it too
            break
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    # A process with none of ``devices`` (a group on other processes) bounds nothing.
    least = min(free) if free else NO_DEVICES
    if jax.process_count() > 1:
        least = agree_min("free_device_bytes", least)
    return None if least < 0 or least == NO_DEVICES else least


def size_pool(
    budget: KVBudget,
    *,
    config: ParallelConfig,
    mesh: jax.sharding.Mesh,
    dims: ModelConfig,
    rows: int,
    max_seq_len: int,
    step_temp_bytes: Callable[[], int] | None = None,
    release: bool = True,
) -> PagePool:
    """The page pool for ``budget`` on ``mesh``.

    Args:
        budget: the user's sizing flags.
        config, mesh, dims: the decode strategy, its mesh and the model as it runs.
        rows: the most sequences decoded together.
        max_seq_len: the longest request the engine takes; capped to what one batch shard's
            pages hold.
        step_temp_bytes: the decode step's temporaries per device (compiled on demand:
            only when sizing from memory).
        release: rows give back the pages before a sliding window (a decode pool);
            False: every page is kept (a disaggregated prefill group's, which hands
            whole prompts on).

    A token budget is tokens of every layer: with KV groups (a page holds one group's
    layers, ``kv_positions`` of them) it buys ``n_layers / kv_positions`` times as many
    pages, the same bytes. All groups share the pages, so memory splits between them as
    the rows need it: a full group's row holds a page per ``page_size`` tokens, a window
    group's at most the pages its window spans (``PagePool.group_pages``).
    """
    shards = batch_shards(config, dims)
    page_bytes = page_bytes_per_device(config, mesh, dims, budget.page_size)
    windows = kv_windows(dims) if release else (None,) * len(kv_windows(dims))

    def pages_for(tokens: int) -> int:  # tokens of every layer, in pages of kv_positions
        return math.ceil(tokens * dims.n_layers / kv_positions(dims) / budget.page_size)

    if budget.tokens is not None:
        pages = pages_for(budget.tokens)
    else:
        free = free_device_bytes(mesh.devices.flat)
        if free is None or mesh.devices.flat[0].platform == "cpu":
            if budget.memory_fraction is not None:
                raise ConfigError(
                    "kv_cache_memory_fraction needs devices that report their memory; "
                    f"{mesh.devices.flat[0].platform} does not: give kv_cache_tokens"
                )
            pages = pages_for(CPU_KV_TOKENS)
        else:
            fraction = budget.memory_fraction or MEMORY_FRACTION
            temp = step_temp_bytes() if step_temp_bytes is not None else 0
            usable = int((free - temp) * fraction)
            if usable < 2 * page_bytes:
                raise ConfigError(
                    f"no room for a KV cache: {free / 2**30:.2f} GiB free per device, "
                    f"{temp / 2**30:.2f} GiB of it for the decode step's temporaries; use "
                    "more devices (tp), a smaller model or dtype, or give kv_cache_tokens"
                )
            pages = (usable // page_bytes - 1) * shards  # one scratch page per shard
    per_shard = pages_per_shard(pages * budget.page_size, budget.page_size, shards)
    # A row takes its whole prompt's pages in every group at admission.
    longest = min(max_seq_len, (per_shard - 1) // len(windows) * budget.page_size)
    return PagePool(budget.page_size, per_shard, shards, rows, longest, windows)


def cache_dtype_name(dims: ModelConfig) -> str:
    """The KV cache's storage as ``describe`` names it: ``int8``/``fp8`` (+ scales), or
    the compute dtype's name."""
    mode = getattr(dims, "kv_cache_dtype", None)
    return f"{mode} + f32 scales" if mode else np.dtype(dims.dtype).name


def describe(pool: PagePool, bytes_per_device: int, cache_dtype: str | None = None) -> str:
    """One line: pages, tokens (and their storage, ``cache_dtype``: see
    :func:`cache_dtype_name`), GiB per device, and how many sequences of half the longest
    request's length fit together (with a released window, each holding at most the
    pages its window spans)."""
    mean = max(pool.max_seq_len // 2, 1)
    fit = min(pool.rows, pool.usable_pages // pool.seq_pages(mean))
    size = (
        f"{bytes_per_device / 2**30:.2f} GiB"
        if bytes_per_device >= 2**30
        else f"{bytes_per_device / 2**20:.1f} MiB"
    )
    # With KV groups a page holds one group's layers: its tokens are not every layer's.
    tokens = f" = {pool.tokens} tokens" if pool.groups == 1 else f" of {pool.groups} KV groups"
    return (
        f"KV cache: {pool.usable_pages} pages x {pool.page_size} tokens{tokens}"
        f"{f' ({cache_dtype})' if cache_dtype else ''}, {size} per device; {fit} sequences of "
        f"{mean} tokens fit together (max {pool.rows}), at most {pool.max_seq_len} per request"
        + (
            f"; pages before the {pool.window}-token window are released "
            f"(at most {pool.row_pages} per decoding row)"
            if pool.window is not None
            else ""
        )
    )
