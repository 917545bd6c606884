"""The host's book of the paged KV cache: which pages each decode row holds.

The pool (:class:`~jaxpar.models.PagedKVCache`) is split over decode's batch shards, and
each shard's rows use only that shard's pages: :class:`PageTable` keeps one free list per
shard and the block table ``[B, N]`` of local page ids that every decode step is given.
Local page 0 of each shard is the scratch page free rows write to; it is never handed out.

It is plain Python on the host (no device reads): pages are taken when a request is
admitted and as it grows, and given back when it ends or is preempted; with the prefix
cache, full pages stay cached after that until a shard needs room (least recently used
first), and requests that start with the same tokens share them (reference counts).

Sliding windows: where every layer attends through a window of ``W`` tokens
(``PagePool.window``), a row's pages that lie wholly before the window of the next query
it computes are given back as it grows (:meth:`PageTable.trim`): a decode query at
position ``p`` (or a prefill chunk whose first query is ``p``) attends from ``p - W + 1``,
so a page whose last position is below that is never read again. Its column in the block
table points at the scratch page (the window masks those scores; the gather stays in
bounds), and a page the prefix cache indexes stays cached, as at release. A row then holds
about ``W / page_size + 1`` pages however long it grows.

Freeing a page twice, or a page whose count is not the rows holding it, raises: a leak
would otherwise only show as a pool that slowly fills up.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.models import SCRATCH_PAGE

#: The fewest positions per row a decode step reads (its narrowest block table).
MIN_STEP_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class PagePool:
    """The shape of a paged cache.

    Attributes:
        page_size: tokens per page (``Z``).
        pages_per_shard: pages in each batch shard's slice of the pool, its scratch page
            included.
        shards: decode's batch shards (the product of the mesh axes ``batch`` splits over).
        rows: decode rows (``B``, the most sequences decoded together).
        max_seq_len: the longest sequence a row may hold (prompt + new tokens - 1).
        window: the sliding window every layer attends through (tokens), whose pages
            before it a row gives back (:meth:`PageTable.trim`); None: rows keep every page.
    """

    page_size: int
    pages_per_shard: int
    shards: int
    rows: int
    max_seq_len: int
    window: int | None = None

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        if self.pages_per_shard < 2:
            raise ConfigError(
                f"a KV cache of {self.pages_per_shard} page(s) per batch shard holds no "
                "sequence (one page per shard is scratch): give it more tokens"
            )
        if self.rows % self.shards:
            raise ConfigError(f"{self.rows} decode rows do not split over {self.shards} shards")
        if self.window is not None and self.window < 1:
            raise ConfigError(f"a sliding window must be >= 1 token, got {self.window}")

    @property
    def pages(self) -> int:
        """Pages of the whole pool (every shard, scratch pages included)."""
        return self.pages_per_shard * self.shards

    @property
    def usable_pages(self) -> int:
        """Pages sequences can hold (every shard)."""
        return (self.pages_per_shard - 1) * self.shards

    @property
    def tokens(self) -> int:
        """Tokens the pool holds (every shard)."""
        return self.usable_pages * self.page_size

    @property
    def shard_tokens(self) -> int:
        """Tokens one shard holds: the longest sequence that can ever fit."""
        return (self.pages_per_shard - 1) * self.page_size

    @property
    def pages_per_row(self) -> int:
        """Block-table columns: pages of the longest sequence (``N``)."""
        return math.ceil(self.max_seq_len / self.page_size)

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def first_kept(self, query: int) -> int:
        """The first page a row keeps when the earliest query it will still compute sits
        at position ``query``: every earlier page lies wholly before that query's window
        (0 without a window)."""
        if self.window is None:
            return 0
        return max(query - self.window + 1, 0) // self.page_size

    def seq_pages(self, tokens: int) -> int:
        """The most pages a decoding sequence of ``tokens`` tokens holds: all of them, or
        with a window at most :attr:`row_pages`."""
        return min(self.pages_for(tokens), self.row_pages)

    @property
    def row_pages(self) -> int:
        """The most pages a decoding row ever holds: ``pages_per_row``, or with a window
        the most pages ``window`` consecutive positions span (the new token's included:
        ``window / page_size + 1`` for a whole number of pages), whichever is fewer."""
        if self.window is None:
            return self.pages_per_row
        return min(self.pages_per_row, -(-(self.window - 1) // self.page_size) + 1)


class PageTable:
    """Pages per shard, the pages each row holds, and the prefix cache over them (host side).

    A page is *free*, *held* (by one or more rows: ``refs`` counts them) or *cached*: held
    by none but indexed by the prefix key of the tokens it holds (:mod:`._prefix`), kept
    for a later request that starts with those tokens, and evicted least recently used
    when a shard needs room. Only full pages are indexed, and a row only ever writes past
    its context, so a page shared by several rows is never written.
    """

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.tables_BN = np.full((pool.rows, pool.pages_per_row), SCRATCH_PAGE, np.int32)
        self.held_B = np.zeros(pool.rows, np.int32)  # columns each row has covered
        # A row's first column it still holds (> 0 once a window released earlier pages):
        # it holds columns [first_B, held_B).
        self.first_B = np.zeros(pool.rows, np.int32)
        first = SCRATCH_PAGE + 1
        self._free = [
            list(range(pool.pages_per_shard - 1, first - 1, -1)) for _ in range(pool.shards)
        ]
        self._is_free = np.ones((pool.shards, pool.pages_per_shard), bool)
        self._is_free[:, SCRATCH_PAGE] = False
        self.refs = np.zeros((pool.shards, pool.pages_per_shard), np.int32)
        # Prefix index per shard: key -> page, page -> key, and the unheld indexed pages in
        # least-recently-used order (evicted first).
        self._index: list[dict[bytes, int]] = [{} for _ in range(pool.shards)]
        self._key_of: list[dict[int, bytes]] = [{} for _ in range(pool.shards)]
        self._lru: list[collections.OrderedDict[int, None]] = [
            collections.OrderedDict() for _ in range(pool.shards)
        ]
        self.evictions = 0
        self.version = 0  # bumped on every change of tables_BN

    @property
    def rows_per_shard(self) -> int:
        return self.pool.rows // self.pool.shards

    def shard(self, row: int) -> int:
        return row // self.rows_per_shard

    def free_pages(self, shard: int) -> int:
        """Pages a row of ``shard`` can take: free ones, and cached ones nobody holds."""
        return len(self._free[shard]) + len(self._lru[shard])

    @property
    def used_pages(self) -> int:
        """Pages held by at least one row."""
        return int((self.refs > 0).sum())

    @property
    def cached_pages(self) -> int:
        """Pages kept for the prefix cache that no row holds (evictable)."""
        return sum(len(lru) for lru in self._lru)

    @property
    def usage(self) -> float:
        """Fraction of the usable pages held by rows."""
        return self.used_pages / self.pool.usable_pages

    def can_grow(self, row: int, tokens: int) -> bool:
        need = self.pool.pages_for(tokens) - int(self.held_B[row])
        return need <= self.free_pages(self.shard(row))

    def _take(self, shard: int) -> int:
        """A page for a row: a free one, else the least recently used cached one."""
        if self._free[shard]:
            page = self._free[shard].pop()
            self._is_free[shard, page] = False
            return page
        page, _ = self._lru[shard].popitem(last=False)
        del self._index[shard][self._key_of[shard].pop(page)]
        self.evictions += 1
        return page

    def grow(self, row: int, tokens: int) -> bool:
        """Gives ``row`` pages for ``tokens`` tokens; False (nothing taken) if its shard
        has too few free pages."""
        tokens = min(tokens, self.pool.max_seq_len)
        want = self.pool.pages_for(tokens)
        held = int(self.held_B[row])
        if want <= held:
            return True
        if not self.can_grow(row, tokens):
            return False
        shard = self.shard(row)
        taken = [self._take(shard) for _ in range(want - held)]
        self.refs[shard, taken] = 1
        self.tables_BN[row, held:want] = taken
        self.held_B[row] = want
        self.version += 1
        return True

    def lookup(self, shard: int, keys: Sequence[bytes]) -> list[int | None]:
        """The cached pages of ``shard`` for the longest prefix of ``keys`` it can serve.

        Without a window: the longest run of ``keys`` from the first. With one, a hit of
        ``n`` pages needs only the pages the window of its first computed query (position
        ``n * page_size``) reaches: the ones before are None (not shared, never read), so
        a hit survives the eviction of a prompt's head; a hit whose window reaches an
        evicted page is shortened to one whose window does not."""
        index = self._index[shard]
        if self.pool.window is None:
            pages = []
            for key in keys:
                page = index.get(key)
                if page is None:
                    break
                pages.append(page)
            return pages
        found = [index.get(key) for key in keys]
        n = len(found)
        while n and any(
            p is None for p in found[self.pool.first_kept(n * self.pool.page_size) : n]
        ):
            n -= 1
        first = self.pool.first_kept(n * self.pool.page_size)
        return [None] * first + found[first:n]

    def reusable(self, shard: int, pages: Sequence[int | None]) -> int:
        """How many of ``pages`` are cached and unheld (sharing them takes them off the
        evictable list)."""
        return sum(p in self._lru[shard] for p in pages if p is not None)

    def share(self, row: int, pages: Sequence[int | None]) -> None:
        """Gives an empty ``row`` the cached ``pages`` (from :meth:`lookup`) as its first;
        leading Nones (before a window) are columns it does not hold."""
        if self.held_B[row]:
            raise RuntimeError(f"row {row} already holds pages; shared pages come first")
        shard = self.shard(row)
        first = sum(1 for _ in itertools.takewhile(lambda p: p is None, pages))
        kept = list(pages[first:])
        for page in kept:
            if page is None or page not in self._key_of[shard]:
                raise RuntimeError(f"page {page} of shard {shard} is not in the prefix cache")
            self._lru[shard].pop(page, None)
        n = len(pages)
        self.refs[shard, kept] += 1
        self.tables_BN[row, first:n] = kept
        self.held_B[row] = n
        self.first_B[row] = first
        if n:
            self.version += 1

    def register(self, row: int, keys: Sequence[bytes]) -> None:
        """Indexes ``row``'s first pages under ``keys`` (full pages it has written): later
        requests starting with those tokens reuse them. A key already cached keeps its page."""
        shard = self.shard(row)
        index, key_of = self._index[shard], self._key_of[shard]
        first = min(int(self.first_B[row]), len(keys))  # columns before it: released
        pages = self.tables_BN[row, first : len(keys)].tolist()
        for page, key in zip(pages, keys[first:], strict=True):
            if key not in index and page not in key_of:
                index[key] = page
                key_of[page] = key

    def release(self, row: int) -> int:
        """Gives back every page of ``row``; returns how many. A page no row holds any
        more stays cached if it is indexed (most recently used), else it becomes free."""
        held = self._give_back(row, int(self.first_B[row]), int(self.held_B[row]))
        self.tables_BN[row] = SCRATCH_PAGE
        if self.held_B[row]:
            self.version += 1
        self.held_B[row] = 0
        self.first_B[row] = 0
        return held

    def trim(self, row: int, query: int) -> int:
        """Gives back ``row``'s pages that lie wholly before the window of its earliest
        query still to compute (position ``query``: its cached length); returns how many.
        Nothing without a window. Their columns point at the scratch page; a page the
        prefix cache indexes stays cached."""
        first, end = int(self.first_B[row]), int(self.held_B[row])
        upto = min(self.pool.first_kept(query), end)
        if upto <= first:
            return 0
        freed = self._give_back(row, first, upto)
        self.tables_BN[row, first:upto] = SCRATCH_PAGE
        self.first_B[row] = upto
        self.version += 1
        return freed

    def _give_back(self, row: int, first: int, end: int) -> int:
        """Drops ``row``'s hold on its columns ``[first, end)`` (the table is the caller's)."""
        pages = self.tables_BN[row, first:end].tolist()
        shard = self.shard(row)
        if len(set(pages)) != len(pages) or (self.refs[shard, pages] < 1).any():
            raise RuntimeError(f"row {row} frees page(s) {pages} that are already free")
        # Last page first: a prefix's tail then becomes the least recently used, so
        # eviction shortens cached prefixes from their end and never strands their tail.
        for page in reversed(pages):
            self.refs[shard, page] -= 1
            if self.refs[shard, page]:
                continue
            if page in self._key_of[shard]:
                self._lru[shard][page] = None
            else:
                self._is_free[shard, page] = True
                self._free[shard].append(page)
        return len(pages)

    def global_ids(self, row: int, n: int, first: int = 0) -> np.ndarray:
        """``n`` pages of ``row`` from its page ``first`` on, as ids into the whole pool
        (shard-major); columns past what it holds are ``pages`` (out of range: a write
        there is dropped, a read gives zeros)."""
        ids = np.full(n, self.pool.pages, np.int32)
        held = max(min(int(self.held_B[row]) - first, n), 0)
        local = self.tables_BN[row, first : first + held]
        ids[:held] = local + self.shard(row) * self.pool.pages_per_shard
        # Columns a window released hold no page (a read gives zeros, masked).
        ids[: max(min(int(self.first_B[row]) - first, n), 0)] = self.pool.pages
        return ids

    def check(self) -> None:
        """Every page is free, cached or held; a held page's count is the rows holding it;
        an indexed page is held or cached (raises otherwise)."""
        for shard in range(self.pool.shards):
            rows = range(shard * self.rows_per_shard, (shard + 1) * self.rows_per_shard)
            counts = collections.Counter(
                int(p) for r in rows for p in self.tables_BN[r, self.first_B[r] : self.held_B[r]]
            )
            for r in rows:
                if (self.tables_BN[r, : self.first_B[r]] != SCRATCH_PAGE).any():
                    raise RuntimeError(f"row {r}: a released column does not point at scratch")
            for page in range(self.pool.pages_per_shard):
                if page == SCRATCH_PAGE:
                    continue
                held, refs = counts.get(page, 0), int(self.refs[shard, page])
                free = bool(self._is_free[shard, page])
                cached = page in self._lru[shard]
                indexed = page in self._key_of[shard]
                states = (held > 0) + free + cached
                if refs != held or states != 1 or (cached and not indexed) or (free and indexed):
                    raise RuntimeError(
                        f"shard {shard} page {page}: held by {held} row(s) with count {refs}, "
                        f"free={free}, cached={cached}, indexed={indexed}"
                    )
            if sorted(self._free[shard]) != sorted(np.nonzero(self._is_free[shard])[0].tolist()):
                raise RuntimeError(f"shard {shard}: the free list and free flags disagree")

    def width(self, tokens: int) -> int:
        """Block-table columns a step reads for rows of up to ``tokens`` tokens: a power
        of two of pages covering at least :data:`MIN_STEP_TOKENS`, at most
        ``pages_per_row``; few step compiles."""
        need = max(self.pool.pages_for(tokens), self.pool.pages_for(MIN_STEP_TOKENS), 1)
        return min(1 << (need - 1).bit_length(), self.pool.pages_per_row)
