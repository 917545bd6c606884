"""The host's book of the paged KV cache: which pages each decode row holds.

The pool (:class:`~jaxpar.models.PagedKVCache`) is split over decode's batch shards, and
each shard's rows use only that shard's pages: :class:`PageTable` keeps one free list per
shard and the block table ``[B, N]`` of local page ids that every decode step is given.
Local page 0 of each shard is the scratch page free rows write to; it is never handed out.

It is plain Python on the host (no device reads): pages are taken when a request is
admitted and as it grows, and given back when it ends or is preempted. Freeing a page
twice, or leaving a page neither free nor held, raises: a leak would otherwise only show
as a pool that slowly fills up.
"""

from __future__ import annotations

import dataclasses
import math

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
    """

    page_size: int
    pages_per_shard: int
    shards: int
    rows: int
    max_seq_len: int

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


class PageTable:
    """Free pages per shard and the pages each row holds (host side)."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.tables_BN = np.full((pool.rows, pool.pages_per_row), SCRATCH_PAGE, np.int32)
        self.held_B = np.zeros(pool.rows, np.int32)  # pages each row holds
        first = SCRATCH_PAGE + 1
        self._free = [
            list(range(pool.pages_per_shard - 1, first - 1, -1)) for _ in range(pool.shards)
        ]
        self._is_free = np.ones((pool.shards, pool.pages_per_shard), bool)
        self._is_free[:, SCRATCH_PAGE] = False
        self.version = 0  # bumped on every change of tables_BN

    @property
    def rows_per_shard(self) -> int:
        return self.pool.rows // self.pool.shards

    def shard(self, row: int) -> int:
        return row // self.rows_per_shard

    def free_pages(self, shard: int) -> int:
        return len(self._free[shard])

    @property
    def used_pages(self) -> int:
        return int(self.held_B.sum())

    @property
    def usage(self) -> float:
        """Fraction of the usable pages held by rows."""
        return self.used_pages / self.pool.usable_pages

    def can_grow(self, row: int, tokens: int) -> bool:
        need = self.pool.pages_for(tokens) - int(self.held_B[row])
        return need <= self.free_pages(self.shard(row))

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
        free, taken = self._free[self.shard(row)], []
        for _ in range(want - held):
            taken.append(free.pop())
        self._is_free[self.shard(row), taken] = False
        self.tables_BN[row, held:want] = taken
        self.held_B[row] = want
        self.version += 1
        return True

    def release(self, row: int) -> int:
        """Gives back every page of ``row``; returns how many."""
        held = int(self.held_B[row])
        pages = self.tables_BN[row, :held]
        shard = self.shard(row)
        if self._is_free[shard, pages].any() or len(set(pages.tolist())) != held:
            raise RuntimeError(f"row {row} frees page(s) {pages.tolist()} that are already free")
        self._is_free[shard, pages] = True
        self._free[shard].extend(int(p) for p in pages[::-1])
        self.tables_BN[row] = SCRATCH_PAGE
        self.held_B[row] = 0
        if held:
            self.version += 1
        return held

    def global_ids(self, row: int, n: int) -> np.ndarray:
        """The first ``n`` pages of ``row`` as ids into the whole pool (shard-major);
        columns past what it holds are ``pages`` (out of range: a write there is dropped)."""
        ids = np.full(n, self.pool.pages, np.int32)
        held = min(int(self.held_B[row]), n)
        ids[:held] = self.tables_BN[row, :held] + self.shard(row) * self.pool.pages_per_shard
        return ids

    def check(self) -> None:
        """Every page is free or held by exactly one row (raises otherwise)."""
        for shard in range(self.pool.shards):
            rows = range(shard * self.rows_per_shard, (shard + 1) * self.rows_per_shard)
            held = [int(p) for r in rows for p in self.tables_BN[r, : self.held_B[r]]]
            free = self._free[shard]
            every = sorted(held + free)
            want = [p for p in range(self.pool.pages_per_shard) if p != SCRATCH_PAGE]
            if every != want:
                raise RuntimeError(
                    f"shard {shard}: pages held {sorted(held)} and free {sorted(free)} do not "
                    f"partition its {len(want)} pages"
                )

    def width(self, tokens: int) -> int:
        """Block-table columns a step reads for rows of up to ``tokens`` tokens: a power
        of two of pages covering at least :data:`MIN_STEP_TOKENS`, at most
        ``pages_per_row``; few step compiles."""
        need = max(self.pool.pages_for(tokens), self.pool.pages_for(MIN_STEP_TOKENS), 1)
        return min(1 << (need - 1).bit_length(), self.pool.pages_per_row)
