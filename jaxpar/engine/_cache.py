"""The cache manager: what the scheduler may ask of a pool of KV pages, and nothing more.

:class:`CacheManager` puts one API over a :class:`~jaxpar.engine._pages.PageTable` (the
host's book of which pages each row holds) and the prefix index over its full pages
(:mod:`jaxpar.engine._prefix`), as vLLM v1's KV cache manager does for its scheduler:

* :meth:`~CacheManager.computed`: the pages of a shard that already hold a prompt's
  prefix (a prefix hit), and whether a request with that hit fits the shard;
* :meth:`~CacheManager.admit` / :meth:`~CacheManager.allocate`: a row's pages for ``n``
  tokens (the hit shared first);
* :meth:`~CacheManager.free` / :meth:`~CacheManager.trim`: give a row's pages back (all,
  or those that left every window);
* :meth:`~CacheManager.commit`: index the full pages a row has written, so later prompts
  that start with the same tokens reuse them (least recently used first out).

Neither the scheduler nor the batcher touches the page table's internals: everything
that grows, shares, registers, looks up or releases pages goes through here. It is plain
Python and NumPy (no JAX), so the scheduler's property test drives it without devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from jaxpar.engine._host_tier import HostTier
from jaxpar.engine._pages import PagePool, PageTable
from jaxpar.engine._prefix import page_keys
from jaxpar.errors import ConfigError


class KVEventSink(Protocol):
    """What hears of the prefix cache's pages (the server's KV events publisher). Called
    on the batcher's loop threads with its lock held: it must only queue the news."""

    def stored(self, pages: list[tuple[int, int, bytes, Sequence[int]]], keys: Sequence[bytes]):
        """Pages indexed now, as (group, column, prefix key, its tokens); ``keys``: the
        row's keys from its first page (column ``i - 1``'s is column ``i``'s parent)."""

    def removed(self, key: bytes, group: int):
        """The page of ``key`` in ``group`` was evicted."""


@dataclasses.dataclass(frozen=True)
class Hit:
    """The cached pages of one shard that hold the start of a context.

    Attributes:
        shard: the batch shard whose pages these are.
        pages: one entry per column (a page id, or with KV groups a tuple of one per
            group; None before a window: not shared, never read).
        tokens: the context's tokens these pages and the host's hold (whole pages).
        room: pages a row of this shard can still take once it shares them.
        host: the prefix keys of the pages after ``pages`` that the host tier holds
            (:mod:`._host_tier`): copied back into the row's next pages on admission.
    """

    shard: int
    pages: tuple
    tokens: int
    room: int
    host: tuple[bytes, ...] = ()


class CacheManager:
    """One pool of KV pages (the decode rows', or a disaggregated prefill group's).

    Args:
        pages: the page table it manages (owned from then on: read it, never change it).
        salt: the prefix keys' root (:func:`~jaxpar.engine._prefix.cache_salt`).
        caching: index prompts' full pages for reuse (the prefix cache).
    """

    def __init__(self, pages: PageTable, salt: bytes = b"", *, caching: bool = False):
        self.pages = pages
        self.salt = salt
        self.caching = caching
        self._events: KVEventSink | None = None
        #: The host tier evicted pages go to (None: they are dropped).
        self.host: HostTier | None = None

    def attach_host(self, host: HostTier) -> None:
        """Evicted pages go to ``host`` from now on, and hits continue there."""
        pool = self.pool
        if not self.caching:
            raise ConfigError(
                "kv_offload_gb (--kv-offload-gb) is a host tier for the prefix cache, which "
                "is off: turn prefix caching on (drop --no-prefix-caching)"
            )
        if pool.groups != 1 or pool.window is not None:
            raise ConfigError(
                "the host tier (kv_offload_gb) serves models whose layers all attend to "
                f"every position; this one has {pool.groups} KV group(s), windows "
                f"{pool.windows}: leave kv_offload_gb off"
            )
        self.host = host
        self.pages.on_spill = host.spill
        host.events = _host_sink(self._events)

    # --- what the scheduler asks ---------------------------------------------------------

    @property
    def pool(self) -> PagePool:
        return self.pages.pool

    @property
    def page_size(self) -> int:
        return self.pages.pool.page_size

    def shard(self, row: int) -> int:
        return self.pages.shard(row)

    def row_free(self, row: int) -> bool:
        """``row`` holds no page (it can be given a request)."""
        return not self.pages.held_B[row]

    def free_pages(self, shard: int) -> int:
        """Pages a row of ``shard`` can take (free ones, and cached ones nobody holds)."""
        return self.pages.free_pages(shard)

    def keys(self, context: Sequence[int]) -> list[bytes]:
        """Prefix keys of ``context``'s full pages (none without prefix caching)."""
        return page_keys(context, self.page_size, self.salt) if self.caching else []

    def computed(self, shard: int, keys: Sequence[bytes], tokens: int) -> Hit:
        """The cached pages of ``shard`` holding the longest prefix of a context of
        ``tokens`` tokens whose full pages have ``keys``: at least its last token is left
        to compute (its logits draw the next token)."""
        keys = keys[: (tokens - 1) // self.page_size]
        hit = self.pages.lookup(shard, keys)
        room = self.pages.free_pages(shard) - self.pages.reusable(shard, hit)
        host = ()
        if self.host is not None:
            host = tuple(keys[len(hit) : len(hit) + len(self.host.lookup(keys[len(hit) :]))])
        return Hit(shard, tuple(hit), (len(hit) + len(host)) * self.page_size, room, host)

    def fits(self, hit: Hit, tokens: int) -> bool:
        """A row of the hit's shard can hold ``tokens`` tokens with the hit shared."""
        pool = self.pool
        return pool.groups * (pool.pages_for(tokens) - len(hit.pages)) <= hit.room

    def admit(self, row: int, hit: Hit, tokens: int) -> None:
        """Gives an empty ``row`` the hit's pages, then pages up to ``tokens`` tokens
        (checked by :meth:`fits`); the hit's host pages are copied back into the pages
        after its shared ones."""
        self.pages.share(row, list(hit.pages))
        if hit.host:  # taking pages may evict to the host: not into the hit's slots
            self.host.pin(hit.host)
        try:
            if not self.pages.grow(row, tokens):
                raise RuntimeError(f"row {row} was admitted for {tokens} tokens that do not fit")
        finally:
            if hit.host:
                self.host.unpin()
        if hit.host:
            n = len(hit.pages)
            ids = self.pages.global_ids(row, n + len(hit.host))[n:]
            self.host.restore(hit.host, ids.tolist())

    def allocate(self, row: int, tokens: int) -> bool:
        """Pages for ``row`` to hold ``tokens`` tokens; False (nothing taken) if its shard
        has too few."""
        return self.pages.grow(row, tokens)

    def trim(self, row: int, query: int) -> int:
        """Gives back ``row``'s pages wholly before the window of its next query at
        position ``query`` (sliding-window groups); returns how many."""
        return self.pages.trim(row, query)

    def free(self, row: int) -> int:
        """Gives back every page of ``row`` (indexed ones stay cached); returns how many."""
        return self.pages.release(row)

    def commit(self, row: int, keys: Sequence[bytes], tokens: Sequence[int]) -> None:
        """Indexes ``row``'s first full pages under ``keys`` (it has written them; they
        hold the first pages of ``tokens``, its context): the prefix cache serves them to
        later prompts (no-op without prefix caching). With :attr:`events`, the pages
        indexed now are told, with their tokens."""
        if not self.caching:
            return
        new = self.pages.register(row, keys)
        if new and self.events is not None:
            z = self.page_size
            pages = [(g, i, keys[i], tokens[i * z : (i + 1) * z]) for g, i in new]
            self.events.stored(pages, keys)

    @property
    def events(self) -> KVEventSink | None:
        """Where page events go (the KV events publisher), or None (default: nowhere)."""
        return self._events

    @events.setter
    def events(self, sink: KVEventSink | None) -> None:
        self._events = sink
        self.pages.on_evict = None if sink is None else sink.removed
        if self.host is not None:
            self.host.events = _host_sink(sink)

    # --- what the runner reads -----------------------------------------------------------

    @property
    def version(self) -> int:
        """Bumped whenever a row's block table changes."""
        return self.pages.version

    def width(self, tokens: int) -> int:
        """Block-table columns a decode step reads for rows of up to ``tokens`` tokens."""
        return self.pages.width(tokens)

    def step_tables(self, width: int) -> np.ndarray:
        return self.pages.step_tables(width)

    def global_ids(self, row: int, n: int, first: int = 0) -> np.ndarray:
        """``n`` pages of ``row`` from its page ``first`` on, as ids into the whole pool."""
        return self.pages.global_ids(row, n, first)

    def context_width(self, need: int) -> int:
        """Cached pages a prefill with context reads for ``need`` pages: a power of four
        (the context's attention is a small part of a chunk's cost; few compiles), at
        most the power of two that holds a whole row."""
        cap = 1 << (self.pool.pages_per_row - 1).bit_length()
        n = 1
        while n < need:
            n *= 4
        return min(n, cap)

    def context_pages(self, rows: Sequence[int], starts: Sequence[int], n_rows: int):
        """``[n_rows, (G,) N]`` global ids of each row's first ``starts[i]`` tokens' pages,
        ``N`` as wide as the longest needs (:meth:`context_width`); out of range past a
        row's cached pages."""
        pool = self.pool
        n = self.context_width(max(pool.pages_for(s) for s in starts))
        pages_PN = np.full((n_rows, *pool.ids_shape(n)), pool.pages, np.int32)
        for i, (row, start) in enumerate(zip(rows, starts, strict=True)):
            held = pool.pages_for(start)
            pages_PN[i, ..., :held] = self.global_ids(row, held)
        return pages_PN

    @property
    def usage(self) -> float:
        return self.pages.usage

    def check(self) -> None:
        """Raises if the page book is inconsistent (:meth:`PageTable.check`)."""
        self.pages.check()


def _host_sink(sink: KVEventSink | None):
    """``sink`` where it hears of host pages too (the KV events publisher), else None."""
    return sink if sink is not None and hasattr(sink, "offloaded") else None
