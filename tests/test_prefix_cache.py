"""The prefix cache's book of pages (:class:`PageTable` with its hash-chain index), as
requests use it.

A property test drives a small pool the way a batcher does, in random order: admit a
request (look up its prompt's full pages, share the hits, grow for the rest, register its
full pages), decode (grow, write, sometimes register the pages that filled), end
(release). Prompts start with a prefix of one of a few fixed sequences over a three-token
alphabet, so prefixes collide, and the pool is small, so cached pages are evicted. After
every operation the test checks the book against what it computes itself: each page's
count against the rows holding it, free / cached / held disjoint and covering the pool,
shared pages only inside every holder's written full pages, and, through a model of what
each page holds (position ``p`` of a page holds the K/V of ``tokens[: p + 1]``), that
every indexed page and every page a request reads holds exactly its tokens' K/V: a
shared page is never written, an evicted page is never found. When every request has
ended no page is held and free + cached is the whole pool.

Deterministic tests pin down the rules one at a time: hits on full pages only, the hash
chain, least-recently-used eviction, an evicted page cannot be shared, and a key computed
twice keeps its first page.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxpar.engine._pages import PagePool, PageTable
from jaxpar.engine._prefix import cache_salt, page_keys
from jaxpar.models import SCRATCH_PAGE

Z = 4  # page size
SALT = cache_salt("test_prefix_cache")
#: Two batch shards of three rows; eight usable pages per shard, six per longest row.
POOL = PagePool(page_size=Z, pages_per_shard=9, shards=2, rows=6, max_seq_len=24)
#: Every prompt starts with a prefix (maybe empty) of one of these: prefixes collide.
BASES = tuple(tuple(np.random.default_rng(seed).integers(0, 3, 16).tolist()) for seed in range(3))
ALPHABET = st.integers(0, 2)


# -- the book's internals, read to check them against the rows (the class's own check()
# -- is not trusted to check itself)


def _free(table: PageTable, shard: int) -> list[int]:
    return list(table._free[shard])


def _cached(table: PageTable, shard: int) -> list[int]:
    return list(table._lru[shard])


def _index(table: PageTable, shard: int) -> dict[bytes, int]:
    return dict(table._index[shard])


def _rows_of(shard: int) -> range:
    per = POOL.rows // POOL.shards
    return range(shard * per, (shard + 1) * per)


def _held(table: PageTable, row: int) -> list[int]:
    return table.tables_BN[row, : table.held_B[row]].tolist()


@dataclasses.dataclass
class Request:
    row: int
    tokens: list[int]  # every token whose K/V is written: the prompt, then decoded ones


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests on a :data:`POOL` page table; ``kv`` models what each page holds."""

    # Whole-run tallies: the test asserts the machine reached the interesting states.
    totals: collections.Counter = collections.Counter()

    def __init__(self):
        super().__init__()
        self.table = PageTable(POOL)
        self.live: dict[int, Request] = {}
        # (shard, page) -> per slot, the tokens whose K/V it holds (None: never written)
        self.kv: dict[tuple[int, int], list[tuple[int, ...] | None]] = collections.defaultdict(
            lambda: [None] * Z
        )

    # -- operations

    def _write(self, req: Request, start: int) -> None:
        """The K/V of ``req.tokens[start:]`` into its pages (a prefill or decode step)."""
        shard = self.table.shard(req.row)
        indexed = set(_index(self.table, shard).values())
        for pos in range(start, len(req.tokens)):
            page = int(self.table.tables_BN[req.row, pos // Z])
            assert page != SCRATCH_PAGE
            assert self.table.refs[shard, page] == 1, f"row {req.row} writes shared page {page}"
            assert page not in indexed, f"row {req.row} writes indexed page {page}"
            self.kv[shard, page][pos % Z] = tuple(req.tokens[: pos + 1])

    def _holds(self, shard: int, page: int, tokens: list[int], i: int) -> bool:
        """Whether ``page`` holds the K/V of page ``i`` of ``tokens``."""
        return self.kv[shard, page] == [tuple(tokens[: i * Z + j + 1]) for j in range(Z)]

    def _free_rows(self) -> list[int]:
        return [r for r in range(POOL.rows) if r not in self.live]

    @precondition(lambda self: len(self.live) < POOL.rows)
    @rule(
        data=st.data(),
        base=st.sampled_from(BASES),
        keep=st.integers(0, len(BASES[0])),
        tail=st.lists(ALPHABET, max_size=6),
    )
    def admit(self, data, base, keep, tail):
        table = self.table
        row = data.draw(st.sampled_from(self._free_rows()), label="row")
        prompt = [*base[:keep], *tail] or [0]
        shard = table.shard(row)
        # The prompt's last token is always computed (its logits pick the first new
        # token): a prompt of whole pages looks up one page fewer.
        keys = page_keys(prompt, Z, SALT, pages=(len(prompt) - 1) // Z)
        hits = table.lookup(shard, keys)
        for i, page in enumerate(hits):
            assert self._holds(shard, page, prompt, i), f"hit page {page} holds other K/V"
        need = POOL.pages_for(len(prompt)) - len(hits)
        fits = need <= table.free_pages(shard) - table.reusable(shard, hits)
        table.share(row, hits)
        assert table.can_grow(row, len(prompt)) == fits
        if not fits:  # the batcher gives the shared pages back and leaves it queued
            assert not table.grow(row, len(prompt))
            assert table.release(row) == len(hits)
            self.totals["refused"] += 1
            return
        assert table.grow(row, len(prompt))
        req = self.live[row] = Request(row, prompt)
        self._write(req, start=len(hits) * Z)
        table.register(row, page_keys(prompt, Z, SALT))
        self.totals["admitted"] += 1
        self.totals["hit_pages"] += len(hits)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), register=st.booleans())
    def decode(self, data, register):
        table = self.table
        req = self.live[data.draw(st.sampled_from(sorted(self.live)), label="row")]
        room = POOL.max_seq_len - len(req.tokens)
        if not room:
            return
        new = data.draw(st.lists(ALPHABET, min_size=1, max_size=min(room, 2 * Z)), label="new")
        length = len(req.tokens) + len(new)
        need = POOL.pages_for(length) - int(table.held_B[req.row])
        fits = need <= table.free_pages(table.shard(req.row))
        assert table.grow(req.row, length) == fits
        if not fits:  # the batcher would preempt it: `end` covers that
            return
        start = len(req.tokens)
        req.tokens += new
        self._write(req, start)
        if register:
            table.register(req.row, page_keys(req.tokens, Z, SALT))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def end(self, data):
        row = data.draw(st.sampled_from(sorted(self.live)), label="row")
        req = self.live.pop(row)
        assert self.table.release(row) == POOL.pages_for(len(req.tokens))

    # -- what holds after every operation

    @invariant()
    def book_is_consistent(self):
        self.table.check()

    @invariant()
    def counts_are_the_rows_holding_each_page(self):
        table = self.table
        for row in range(POOL.rows):
            held = int(table.held_B[row])
            req = self.live.get(row)
            assert held == (POOL.pages_for(len(req.tokens)) if req else 0)
            assert (table.tables_BN[row, held:] == SCRATCH_PAGE).all()
        for shard in range(POOL.shards):
            counts = collections.Counter(p for r in _rows_of(shard) for p in _held(table, r))
            assert SCRATCH_PAGE not in counts
            for page in range(POOL.pages_per_shard):
                assert table.refs[shard, page] == counts.get(page, 0), (shard, page)
            if counts and max(counts.values()) > 1:
                self.totals["shared"] += 1

    @invariant()
    def free_cached_and_held_partition_the_pool(self):
        table = self.table
        for shard in range(POOL.shards):
            free, cached = _free(table, shard), _cached(table, shard)
            held = {p for r in _rows_of(shard) for p in _held(table, r)}
            assert len(set(free)) == len(free), f"a page twice on shard {shard}'s free list"
            assert not set(free) & held, f"pages {set(free) & held} free and held"
            assert not set(cached) & held, f"pages {set(cached) & held} cached and held"
            assert not set(free) & set(cached)
            assert set(free) | set(cached) | held == set(range(1, POOL.pages_per_shard))
            assert table.free_pages(shard) == len(free) + len(cached)
        assert table.used_pages == sum(
            len({p for r in _rows_of(s) for p in _held(table, r)}) for s in range(POOL.shards)
        )
        assert table.cached_pages == sum(len(_cached(table, s)) for s in range(POOL.shards))

    @invariant()
    def shared_pages_lie_inside_every_holders_written_full_pages(self):
        table = self.table
        for req in self.live.values():
            shard = table.shard(req.row)
            for i, page in enumerate(_held(table, req.row)):
                if table.refs[shard, page] > 1:
                    # The row's next write is position len(tokens): page len // Z.
                    assert (i + 1) * Z <= len(req.tokens), (
                        f"row {req.row} shares page {page} (its page {i}) but has written "
                        f"only {len(req.tokens)} tokens"
                    )

    @invariant()
    def every_read_and_every_indexed_page_holds_its_tokens(self):
        table = self.table
        for req in self.live.values():  # what a decode step of the row reads
            shard = table.shard(req.row)
            pages = _held(table, req.row)
            for pos in range(len(req.tokens)):
                assert self.kv[shard, pages[pos // Z]][pos % Z] == tuple(req.tokens[: pos + 1])
        for shard in range(POOL.shards):
            for key, page in _index(table, shard).items():
                tokens = self.kv[shard, page][-1]
                assert tokens is not None and len(tokens) % Z == 0, f"page {page} not full"
                assert page_keys(list(tokens), Z, SALT)[-1] == key, f"page {page} is stale"

    def teardown(self):
        table = self.table
        for row in list(self.live):
            self.end_row(row)
        table.check()
        assert table.used_pages == 0
        assert (table.tables_BN == SCRATCH_PAGE).all() and not table.held_B.any()
        assert sum(table.free_pages(s) for s in range(POOL.shards)) == POOL.usable_pages
        free = sum(len(_free(table, s)) for s in range(POOL.shards))
        assert free + table.cached_pages == POOL.usable_pages
        self.totals["evictions"] += table.evictions
        self.totals["runs"] += 1

    def end_row(self, row: int) -> None:
        req = self.live.pop(row)
        assert self.table.release(row) == POOL.pages_for(len(req.tokens))
        self.free_cached_and_held_partition_the_pool()


def test_page_table_under_random_requests():
    PrefixCacheMachine.totals.clear()
    test = PrefixCacheMachine.TestCase
    test.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
    test("runTest").runTest()
    totals = PrefixCacheMachine.totals
    # The runs reached what the test is for: prefix hits, pages shared between live
    # requests, evictions, and requests refused for room.
    for what in ("hit_pages", "shared", "evictions", "refused"):
        assert totals[what] > 0, f"no {what} in {dict(totals)}"


# -- deterministic cases


def _table(pages_per_shard: int = 17, rows: int = 4) -> PageTable:
    return PageTable(PagePool(Z, pages_per_shard, shards=1, rows=rows, max_seq_len=32))


def _admit(table: PageTable, row: int, prompt: list[int]) -> list[int]:
    """Shares the prompt's cached pages, grows for the rest, registers its full pages;
    the pages it hit."""
    hits = table.lookup(0, page_keys(prompt, Z, SALT, pages=(len(prompt) - 1) // Z))
    table.share(row, hits)
    assert table.grow(row, len(prompt))
    table.register(row, page_keys(prompt, Z, SALT))
    table.check()
    return hits


def test_only_full_pages_hit():
    table = _table()
    shared = list(range(10, 20))  # 2.5 pages
    _admit(table, 0, [*shared, 7, 7, 7])
    hits = _admit(table, 1, [*shared, 8, 8, 8, 8])
    assert hits == _held(table, 0)[:2]  # two whole pages; the half page is computed again
    assert _held(table, 1)[:2] == hits and _held(table, 1)[2] != _held(table, 0)[2]
    assert table.refs[0, hits].tolist() == [2, 2]
    # A prompt that is exactly the cached pages hits one page fewer: its last token is
    # computed (and would be written to the shared page if that were hit).
    assert _admit(table, 2, shared[:8]) == hits[:1]


def test_hash_chain_same_tokens_after_another_prefix_miss():
    table = _table()
    x, y, w = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    _admit(table, 0, [*x, *y, 0])
    assert table.lookup(0, page_keys([*x, *y], Z, SALT)) == _held(table, 0)[:2]
    after_w = page_keys([*w, *y], Z, SALT)
    assert after_w[1] != page_keys([*x, *y], Z, SALT)[1]
    assert table.lookup(0, after_w[1:]) == []  # y's page after w: another key
    assert table.lookup(0, page_keys(y, Z, SALT)) == []  # y's page first: another key
    assert table.lookup(0, page_keys([*x, *y], Z, cache_salt("other model"))) == []
    assert _admit(table, 1, [*w, *y, 0]) == []


def test_least_recently_used_pages_are_evicted_first():
    table = _table(pages_per_shard=8)  # seven usable pages: three requests of two, one free
    prompts = {name: [first] * 8 for first, name in enumerate("abc", start=1)}
    for row, name in enumerate("abc"):
        _admit(table, row, prompts[name])
    for row in (0, 2, 1):  # released a, c, b
        table.release(row)
    assert table.cached_pages == 6 and table.used_pages == 0 and table.free_pages(0) == 7

    def cached(name: str) -> int:
        return len(table.lookup(0, page_keys(prompts[name], Z, SALT)))

    a = _held_after(table, 0, prompts["a"] + [0])  # a used again: two hits, the free page
    assert a[:2] == table.lookup(0, page_keys(prompts["a"], Z, SALT))
    table.release(0)  # ... so least recently used: c, then b, then a
    assert table.evictions == 0 and table.cached_pages == 6
    _admit(table, 0, [4] * 12)  # three pages: the free one, then c's two
    assert table.evictions == 2 and (cached("a"), cached("b"), cached("c")) == (2, 2, 0)
    _admit(table, 1, [5] * 8)  # two more: b's
    assert table.evictions == 4 and (cached("a"), cached("b"), cached("c")) == (2, 0, 0)
    # Held pages are never evicted: with a's two pages held, nothing is left to take.
    table.share(2, table.lookup(0, page_keys(prompts["a"], Z, SALT)))
    assert table.free_pages(0) == 0 and not table.grow(3, 4)
    table.check()


def _held_after(table: PageTable, row: int, prompt: list[int]) -> list[int]:
    _admit(table, row, prompt)
    return _held(table, row)


def test_an_evicted_page_cannot_be_shared():
    table = _table(pages_per_shard=3)  # two usable pages
    prompt = [3] * 8
    _admit(table, 0, prompt)
    pages = _held(table, 0)
    table.release(0)
    assert table.lookup(0, page_keys(prompt, Z, SALT)) == pages  # cached
    assert table.reusable(0, pages) == 2
    assert table.grow(1, 8)  # another request (not registered yet) evicts both
    assert table.evictions == 2 and sorted(_held(table, 1)) == sorted(pages)
    assert table.lookup(0, page_keys(prompt, Z, SALT)) == []
    assert table.reusable(0, pages) == 0
    with pytest.raises(RuntimeError, match="not in the prefix cache"):
        table.share(2, pages[:1])
    table.check()


def test_a_key_computed_twice_keeps_its_first_page():
    table = _table()
    prompt = [1, 2, 3, 4, 5]
    _admit(table, 0, prompt)
    table.share(1, [])  # admitted before row 0 registered: computes its own page
    assert table.grow(1, len(prompt))
    table.register(1, page_keys(prompt, Z, SALT))
    first = _held(table, 0)[0]
    assert table.lookup(0, page_keys(prompt, Z, SALT)) == [first]
    table.release(1)  # its unindexed copy goes back to the free list, not the cache
    assert table.cached_pages == 0 and table.used_pages == 2
    table.release(0)
    assert table.cached_pages == 1 and table.free_pages(0) == table.pool.usable_pages
    table.check()
