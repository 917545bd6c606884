"""The host's book of the paged KV cache: which pages each decode row holds.

The pool (:class:`~jaxpar.models.PagedKVCache`) is split over decode's batch shards, and
each shard's rows use only that shard's pages: :class:`PageTable` keeps one free list per
shard and the block table ``[B, N]`` of local page ids that every decode step is given.
Local page 0 of each shard is the scratch page free rows write to; it is never handed out.

It is plain Python on the host (no device reads): pages are taken when a request is
admitted and as it grows, and given back when it ends or is preempted; with the prefix
cache, full pages stay cached after that until a shard needs room (least recently used
first), and requests that start with the same tokens share them (reference counts).

Sliding windows: a row has one block table per KV group (:mod:`jaxpar.models._kv_groups`;
one table for a model whose layers are all of one kind), all drawing on the shard's one
free list. In a group whose layers attend through a window of ``W`` tokens
(``PagePool.windows``), a row's pages that lie wholly before the window of the next query
it computes are given back as it grows (:meth:`PageTable.trim`): a decode query at
position ``p`` (or a prefill chunk whose first query is ``p``) attends from ``p - W + 1``,
so a page whose last position is below that is never read again. Its column in the block
table points at the scratch page (the window masks those scores; the gather stays in
bounds), and a page the prefix cache indexes stays cached, as at release. A row then holds
about ``W / page_size + 1`` pages of that group however long it grows.

Freeing a page twice, or a page whose count is not the rows holding it, raises: a leak
would otherwise only show as a pool that slowly fills up.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from jaxpar.errors import ConfigError

#: Local page id of each shard's scratch page (free rows write there; never handed out).
#: The models' paged cache names the same page (``jaxpar.models.SCRATCH_PAGE``, checked
#: equal by a test); it is repeated here so the host's page book imports no JAX.
SCRATCH_PAGE = 0

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
        windows: per block table of a row (one per KV group,
            :mod:`jaxpar.models._kv_groups`), the sliding window whose earlier pages it
            gives back (:meth:`PageTable.trim`); None: it keeps every page.
    """

    page_size: int
    pages_per_shard: int
    shards: int
    rows: int
    max_seq_len: int
    windows: tuple[int | None, ...] = (None,)

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
        if not self.windows or any(w is not None and w < 1 for w in self.windows):
            raise ConfigError(f"windows must be >= 1 token or None per group, got {self.windows}")

    @property
    def groups(self) -> int:
        """Block tables per row (KV groups)."""
        return len(self.windows)

    @property
    def window(self) -> int | None:
        """The sliding window some group gives its pages back by (None: none does)."""
        return next((w for w in self.windows if w is not None), None)

    def ids_shape(self, n: int) -> tuple[int, ...]:
        """Shape of one row's ``n`` page ids per group: ``(n,)``, or ``(G, n)``."""
        return (n,) if self.groups == 1 else (self.groups, n)

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
        """Tokens the pool holds (every shard; with KV groups, tokens of one group)."""
        return self.usable_pages * self.page_size

    @property
    def shard_tokens(self) -> int:
        """Tokens one shard holds: the longest sequence that can ever fit (with KV groups,
        each group holding its pages of it)."""
        return (self.pages_per_shard - 1) // self.groups * self.page_size

    @property
    def pages_per_row(self) -> int:
        """Block-table columns: pages of the longest sequence (``N``)."""
        return math.ceil(self.max_seq_len / self.page_size)

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def first_kept(self, query: int, group: int = 0) -> int:
        """The first page a row keeps in ``group`` when the earliest query it will still
        compute sits at position ``query``: every earlier page lies wholly before that
        query's window (0 without a window)."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(query - window + 1, 0) // self.page_size

    def group_pages(self, group: int) -> int:
        """The most pages a decoding row holds in ``group``: ``pages_per_row``, or with a
        window the most pages ``window`` consecutive positions span (the new token's
        included: ``window / page_size + 1`` for a whole number of pages)."""
        window = self.windows[group]
        if window is None:
            return self.pages_per_row
        return min(self.pages_per_row, -(-(window - 1) // self.page_size) + 1)

    @property
    def row_pages(self) -> int:
        """The most pages a decoding row ever holds, every group's together."""
        return sum(self.group_pages(g) for g in range(self.groups))

    def seq_pages(self, tokens: int) -> int:
        """The most pages a decoding sequence of ``tokens`` tokens holds: in each group
        all of them, or with a window at most what the window spans."""
        need = self.pages_for(tokens)
        return sum(min(need, self.group_pages(g)) for g in range(self.groups))


class PageTable:
    """Pages per shard, the pages each row holds, and the prefix cache over them (host side).

    A page is *free*, *held* (by one or more rows: ``refs`` counts them) or *cached*: held
    by none but indexed by the prefix key of the tokens it holds (:mod:`._prefix`), kept
    for a later request that starts with those tokens, and evicted least recently used
    when a shard needs room. Only full pages are indexed, and a row only ever writes past
    its context, so a page shared by several rows is never written.

    With KV groups each row has one block table per group (``tables_GBN``), all drawing
    on the shard's one free list; a page belongs to one group at a time, and the prefix
    cache keys a group's pages apart (the key and the group). A column's entry of a hit
    (:meth:`lookup`) is then a tuple of one page per group.
    """

    def __init__(self, pool: PagePool):
        self.pool = pool
        g = pool.groups
        self.tables_GBN = np.full((g, pool.rows, pool.pages_per_row), SCRATCH_PAGE, np.int32)
        self.held_GB = np.zeros((g, pool.rows), np.int32)  # columns each row has covered
        # A row's first column it still holds per group (> 0 once a window released
        # earlier pages): it holds columns [first, held).
        self.first_GB = np.zeros((g, pool.rows), np.int32)
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
        self.version = 0  # bumped on every change of the tables
        #: Called with (prefix key, group) when an indexed page is evicted (the KV events'
        #: BlockRemoved); None: nobody listens.
        self.on_evict: Callable[[bytes, int], None] | None = None
        #: Called with (global page id, its key) when an indexed page is evicted, before
        #: anything can write it (the host tier copies it out, :mod:`._host_tier`).
        self.on_spill: Callable[[int, bytes], None] | None = None

    @property
    def tables_BN(self) -> np.ndarray:
        """The first group's block tables (every row's, with one group)."""
        return self.tables_GBN[0]

    @property
    def held_B(self) -> np.ndarray:
        """Columns each row has covered (the same in every group); 0: a free row."""
        return self.held_GB[0]

    @property
    def first_B(self) -> np.ndarray:
        """The first group's first held column per row."""
        return self.first_GB[0]

    def step_tables(self, width: int) -> np.ndarray:
        """The first ``width`` columns a step reads: ``[B, width]``, or ``[G, B, width]``."""
        tables = self.tables_GBN[..., :width]
        return tables[0] if self.pool.groups == 1 else tables

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

    def _need(self, row: int, tokens: int) -> int:
        want = self.pool.pages_for(min(tokens, self.pool.max_seq_len))
        return sum(max(want - int(held), 0) for held in self.held_GB[:, row])

    def can_grow(self, row: int, tokens: int) -> bool:
        return self._need(row, tokens) <= self.free_pages(self.shard(row))

    def _take(self, shard: int) -> int:
        """A page for a row: a free one, else the least recently used cached one."""
        if self._free[shard]:
            page = self._free[shard].pop()
            self._is_free[shard, page] = False
            return page
        page, _ = self._lru[shard].popitem(last=False)
        key = self._key_of[shard].pop(page)
        del self._index[shard][key]
        self.evictions += 1
        if self.on_spill is not None:
            self.on_spill(shard * self.pool.pages_per_shard + page, key)
        if self.on_evict is not None:
            self.on_evict(*self._unkey(key))
        return page

    def grow(self, row: int, tokens: int) -> bool:
        """Gives ``row`` pages for ``tokens`` tokens in every group; False (nothing taken)
        if its shard has too few free pages."""
        tokens = min(tokens, self.pool.max_seq_len)
        want = self.pool.pages_for(tokens)
        if not self._need(row, tokens):
            return True
        if not self.can_grow(row, tokens):
            return False
        shard = self.shard(row)
        for g in range(self.pool.groups):
            held = int(self.held_GB[g, row])
            if want <= held:
                continue
            taken = [self._take(shard) for _ in range(want - held)]
            self.refs[shard, taken] = 1
            self.tables_GBN[g, row, held:want] = taken
            self.held_GB[g, row] = want
        self.version += 1
        return True

    def _key(self, key: bytes, group: int) -> bytes:
        """A group's prefix key: its pages hold other layers' K/V than another group's."""
        return key if self.pool.groups == 1 else key + bytes([group])

    def _unkey(self, key: bytes) -> tuple[bytes, int]:
        """A group's prefix key as (the prefix key, the group)."""
        return (key, 0) if self.pool.groups == 1 else (key[:-1], key[-1])

    def lookup(self, shard: int, keys: Sequence[bytes]) -> list:
        """The cached pages of ``shard`` for the longest prefix of ``keys`` every group can
        serve, one entry per column (with KV groups, a tuple of one page per group).

        Without a window: the longest run of ``keys`` from the first. A window group needs
        for a hit of ``n`` pages only the pages the window of its first computed query
        (position ``n * page_size``) reaches: the ones before are None (not shared, never
        read), so a hit survives the eviction of a prompt's head; a hit whose window reaches
        an evicted page is shortened to one whose window does not, in every group."""
        index, pool = self._index[shard], self.pool
        if pool.groups == 1 and pool.window is None:
            pages = []
            for key in keys:
                page = index.get(key)
                if page is None:
                    break
                pages.append(page)
            return pages
        found = [[index.get(self._key(key, g)) for key in keys] for g in range(pool.groups)]

        def serves(n: int) -> bool:
            firsts = (pool.first_kept(n * pool.page_size, g) for g in range(pool.groups))
            return all(p is not None for g, first in enumerate(firsts) for p in found[g][first:n])

        n = len(keys)
        while n and not serves(n):
            n -= 1
        columns = []
        for g in range(pool.groups):
            first = pool.first_kept(n * pool.page_size, g)
            columns.append([None] * first + found[g][first:n])
        if pool.groups == 1:
            return columns[0]
        return list(zip(*columns, strict=True))

    def _by_group(self, pages: Sequence) -> list[list[int | None]]:
        """A hit's columns as one list per group."""
        if self.pool.groups == 1:
            return [list(pages)]
        return [[column[g] for column in pages] for g in range(self.pool.groups)]

    def reusable(self, shard: int, pages: Sequence) -> int:
        """How many of a hit's pages are cached and unheld (sharing them takes them off
        the evictable list)."""
        lru = self._lru[shard]
        return sum(p in lru for group in self._by_group(pages) for p in group if p is not None)

    def share(self, row: int, pages: Sequence) -> None:
        """Gives an empty ``row`` the cached ``pages`` (from :meth:`lookup`) as its first;
        leading Nones (before a window) are columns it does not hold."""
        if self.held_GB[:, row].any():
            raise RuntimeError(f"row {row} already holds pages; shared pages come first")
        shard = self.shard(row)
        n = len(pages)
        for g, group in enumerate(self._by_group(pages)):
            first = sum(1 for _ in itertools.takewhile(lambda p: p is None, group))
            kept = group[first:]
            for page in kept:
                if page is None or page not in self._key_of[shard]:
                    raise RuntimeError(f"page {page} of shard {shard} is not in the prefix cache")
                self._lru[shard].pop(page, None)
            self.refs[shard, kept] += 1
            self.tables_GBN[g, row, first:n] = kept
            self.held_GB[g, row] = n
            self.first_GB[g, row] = first
        if n:
            self.version += 1

    def register(self, row: int, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """Indexes ``row``'s first pages under ``keys`` (full pages it has written): later
        requests starting with those tokens reuse them. A key already cached keeps its
        page; columns a window released are skipped. Returns the (group, column) of each
        page indexed now."""
        shard = self.shard(row)
        index, key_of = self._index[shard], self._key_of[shard]
        new = []
        for g in range(self.pool.groups):
            first = min(int(self.first_GB[g, row]), len(keys))
            pages = self.tables_GBN[g, row, first : len(keys)].tolist()
            for i, (page, key) in enumerate(zip(pages, keys[first:], strict=True), first):
                key = self._key(key, g)
                if key not in index and page not in key_of:
                    index[key] = page
                    key_of[page] = key
                    new.append((g, i))
        return new

    def release(self, row: int) -> int:
        """Gives back every page of ``row``; returns how many. A page no row holds any
        more stays cached if it is indexed (most recently used), else it becomes free."""
        held = sum(
            self._give_back(row, int(self.first_GB[g, row]), int(self.held_GB[g, row]), g)
            for g in range(self.pool.groups)
        )
        self.tables_GBN[:, row] = SCRATCH_PAGE
        if self.held_GB[:, row].any():
            self.version += 1
        self.held_GB[:, row] = 0
        self.first_GB[:, row] = 0
        return held

    def trim(self, row: int, query: int) -> int:
        """Gives back ``row``'s pages that lie wholly before the window of its earliest
        query still to compute (position ``query``: its cached length), in every group
        with a window; returns how many. Their columns point at the scratch page; a page
        the prefix cache indexes stays cached."""
        freed = 0
        for g in range(self.pool.groups):
            first, end = int(self.first_GB[g, row]), int(self.held_GB[g, row])
            upto = min(self.pool.first_kept(query, g), end)
            if upto <= first:
                continue
            freed += self._give_back(row, first, upto, g)
            self.tables_GBN[g, row, first:upto] = SCRATCH_PAGE
            self.first_GB[g, row] = upto
        if freed:
            self.version += 1
        return freed

    def _give_back(self, row: int, first: int, end: int, group: int) -> int:
        """Drops ``row``'s hold on its columns ``[first, end)`` of ``group`` (the table is
        the caller's)."""
        pages = self.tables_GBN[group, row, first:end].tolist()
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
        (shard-major): ``[n]``, or ``[G, n]`` with KV groups. Columns it does not hold
        (past its pages, or released by a window) are ``pages`` (out of range: a write
        there is dropped, a read gives zeros)."""
        ids = np.full((self.pool.groups, n), self.pool.pages, np.int32)
        offset = self.shard(row) * self.pool.pages_per_shard
        for g in range(self.pool.groups):
            lo = max(int(self.first_GB[g, row]), first)
            hi = min(int(self.held_GB[g, row]), first + n)
            if hi > lo:
                ids[g, lo - first : hi - first] = self.tables_GBN[g, row, lo:hi] + offset
        return ids[0] if self.pool.groups == 1 else ids

    def check(self) -> None:
        """Every page is free, cached or held; a held page's count is the rows (and
        groups) holding it; an indexed page is held or cached; a released column points
        at scratch (raises otherwise)."""
        for shard in range(self.pool.shards):
            rows = range(shard * self.rows_per_shard, (shard + 1) * self.rows_per_shard)
            counts = collections.Counter(
                int(p)
                for g in range(self.pool.groups)
                for r in rows
                for p in self.tables_GBN[g, r, self.first_GB[g, r] : self.held_GB[g, r]]
            )
            for g in range(self.pool.groups):
                for r in rows:
                    if (self.tables_GBN[g, r, : self.first_GB[g, r]] != SCRATCH_PAGE).any():
                        raise RuntimeError(
                            f"row {r} group {g}: a released column does not point at scratch"
                        )
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
