"""The batcher's policy without devices: the scheduler and cache manager on plain requests.

Every test here builds a real :class:`~jaxpar.engine._pages.PageTable` and
:class:`~jaxpar.engine._cache.CacheManager` (host-side NumPy) and a
:class:`~jaxpar.engine._scheduler.Scheduler`, and plays the runner's part by hand: a
prefill plan draws one token per request it completes, a decode plan one per live row.
Nothing compiles; the file runs in a few seconds.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxpar.engine._cache import CacheManager
from jaxpar.engine._chunk_cost import ChunkCost
from jaxpar.engine._pages import SCRATCH_PAGE, PagePool, PageTable
from jaxpar.engine._scheduler import PrefillPlan, Scheduler, SchedulerConfig
from jaxpar.errors import ConfigError

Z = 4  # tokens per page


@dataclasses.dataclass(eq=False)
class Req:
    """A request as the scheduler sees it: a prompt, the tokens drawn, a cancel flag."""

    prompt: list[int]
    max_tokens: int
    drawn: list[int] = dataclasses.field(default_factory=list)
    cancel_requested: bool = False
    done: bool = False

    @property
    def context(self) -> list[int]:
        return [*self.prompt, *self.drawn]


def bucket(n: int) -> int:
    """A prefill's padded length: a power of two >= 8."""
    return max(8, 1 << (n - 1).bit_length())


def make(
    *,
    pages: int = 16,
    shards: int = 1,
    rows: int = 4,
    max_seq_len: int = 32,
    prefill_batch: int = 2,
    chunk: int = 8,
    budget: int = 16,
    caching: bool = True,
    long_chunk: int | None = None,
) -> Scheduler:
    pool = PagePool(Z, pages, shards, rows, max_seq_len)
    cache = CacheManager(PageTable(pool), b"test", caching=caching)
    buckets = tuple(sorted({1, prefill_batch}))
    config = SchedulerConfig(prefill_batch, buckets, chunk, budget, long_chunk)
    return Scheduler(config, cache, bucket=bucket)


def prefill(sched: Scheduler, budget: int | None = None, spent: int = 0) -> PrefillPlan:
    """Plans a prefill (``spent`` tokens already prefilled this step) and runs it as the
    runner would: requests it completes draw their first token (and end there if that was
    their last)."""
    plan = sched.schedule_prefill(budget, spent)
    for request in plan.cancelled:
        request.done = True
    live = []
    for chunk in plan.chunks:
        request = chunk.request
        if plan.final:
            request.drawn.append(len(request.drawn))
            request.done = len(request.drawn) >= request.max_tokens
        live.append(not request.done)
    sched.prefilled(plan, live)
    return plan


def decode(sched: Scheduler) -> list[Req]:
    """One decode step: every running row reserved (preempting if a shard is short),
    then one token each; returns the preempted requests."""
    preempted = []
    if sched.running and not sched.reserve():
        preempted = [r for _, r in sched.preempt_for_room()]
    if not sched.running:
        return preempted
    plan = sched.decode_plan()
    for row, live in enumerate(plan.live):
        if not live:
            continue
        request = sched.owners[row]
        request.drawn.append(len(request.drawn))
        if len(request.drawn) >= request.max_tokens:
            request.done = True
            sched.finish(row)
    return preempted


def admit(sched: Scheduler) -> list[PrefillPlan]:
    """A colocated batcher's admission (:meth:`ServingCore.admit
    <jaxpar.engine._core.ServingCore.admit>`): prefills within the step's budget, whether
    or not requests decode; returns the plans run."""
    budget, spent, plans = sched.config.max_prefill_tokens, 0, []
    while spent < budget:
        plan = prefill(sched, budget, spent)
        if not plan.chunks:
            break
        plans.append(plan)
        spent += plan.cost
    return plans


def step(sched: Scheduler) -> list[Req]:
    """A colocated batcher's loop iteration: cancellations, admission within the budget,
    then a decode step."""
    for _, request in sched.cancelled_running():
        request.done = True
    chunk = sched.cancelled_chunk()
    if chunk is not None:
        chunk.done = True
    admit(sched)
    return decode(sched)


def conserved(sched: Scheduler) -> None:
    """Every usable page is held, cached or free, once; no page is counted twice."""
    pages = sched.cache.pages
    pages.check()
    free = sum(pages.free_pages(s) for s in range(pages.pool.shards))
    assert pages.used_pages + free == pages.pool.usable_pages


def test_preemption_takes_the_latest_admitted_request_of_the_short_shard():
    sched = make(pages=7, rows=4, max_seq_len=24)  # 6 usable pages, one shard
    old, new = Req([1] * 7, 20), Req([2] * 7, 20)
    sched.add(old)
    prefill(sched)
    sched.add(new)
    prefill(sched)
    assert sched.owners[:2] == [old, new]
    preempted = []
    for _ in range(8):
        preempted += decode(sched)
        conserved(sched)
        if preempted:
            break
    assert preempted == [new]  # admitted last: it goes, the oldest keeps running
    assert sched.waiting[0] is new  # back at the front of the queue
    assert old in sched.owners and new not in sched.owners
    # It comes back with the tokens it drew, to be prefilled again from its context.
    assert len(new.context) == len(new.prompt) + len(new.drawn) > len(new.prompt)


def test_victim_is_chosen_within_the_shard():
    sched = make(pages=8, shards=2, rows=4)
    requests = [Req([i] * 3, 8) for i in range(4)]
    for request in requests:
        sched.add(request)
    prefill(sched)
    prefill(sched)
    rows = {sched.owners.index(r): r for r in requests}
    for shard in (0, 1):
        victim = sched.victim(shard)
        assert sched.cache.shard(victim) == shard
        in_shard = [row for row in rows if sched.cache.shard(row) == shard]
        # The victim is the request of that shard admitted last.
        order = [requests.index(rows[row]) for row in in_shard]
        assert requests.index(rows[victim]) == max(order)


def test_long_prompts_prefill_alone_in_chunks_within_the_budget():
    sched = make(pages=32, rows=4, max_seq_len=64, chunk=8, budget=16)
    short = Req([5] * 3, 4)
    sched.add(short)
    prefill(sched)  # decoding from now on: the budget applies
    long, after = Req(list(range(21)), 4), Req([7] * 3, 4)
    sched.add(long)
    sched.add(after)
    plans = []
    while long.context == long.prompt:
        plan = prefill(sched, 16)
        assert plan.chunks, "a chunk within the budget is always planned"
        plans.append(plan)
    assert [len(p.chunks) for p in plans] == [1, 1, 1]  # alone, chunk by chunk
    assert [len(p.chunks[0].tokens) for p in plans] == [8, 8, 5]
    assert [p.chunks[0].start for p in plans] == [0, 8, 16]  # each continues the last
    assert [p.final for p in plans] == [False, False, True]
    assert all(p.chunked for p in plans)
    assert all(p.cost <= 16 for p in plans)
    assert after in sched.waiting  # it waited for the long prompt's last chunk
    # A budget below one chunk's padded cost plans nothing more than a chunk.
    sched.add(Req(list(range(30, 50)), 2))
    sched.waiting.remove(after)
    plan = prefill(sched, 16)
    assert len(plan.chunks) == 1 and plan.cost <= 16
    assert prefill(sched, 16, spent=16).chunks == ()  # the next chunk waits for the next step


def test_a_prompt_within_a_chunk_goes_whole_a_longer_one_in_long_pieces():
    """With pieces smaller than a chunk (CPU's default): a prompt that fits a chunk is
    prefilled at once; a longer one alone, in pieces, its last piece too."""
    sched = make(pages=32, rows=4, max_seq_len=64, chunk=16, budget=16, long_chunk=4)
    whole = Req(list(range(1, 15)), 4)  # 14 tokens: within a chunk
    sched.add(whole)
    plan = prefill(sched, 16)
    assert [len(c.tokens) for c in plan.chunks] == [14] and plan.final and not plan.chunked
    long = Req(list(range(100, 118)), 4)  # 18 tokens (no prefix hit): longer than a chunk
    sched.add(long)
    plans = []
    while long.context == long.prompt:
        plans.append(prefill(sched, 16))
        assert prefill(sched, 16, spent=4).chunks == ()  # one piece per step, budget or not
    assert [len(p.chunks[0].tokens) for p in plans] == [4, 4, 4, 4, 2]
    assert [p.chunks[0].start for p in plans] == [0, 4, 8, 12, 16]
    assert all(p.chunked for p in plans) and [p.final for p in plans] == [False] * 4 + [True]
    assert sched.context_lengths() == [8, 16]  # the piece's bucket (8) among them
    with pytest.raises(ConfigError, match="long_chunk_tokens must be in 1..chunk_tokens=16"):
        SchedulerConfig(2, (1, 2), 16, 16, long_chunk_tokens=32)


def _linear_cost(a: float, b: float, c: float) -> ChunkCost:
    """A ChunkCost measured on shapes whose times follow ``a + b r t + c r t (C + t)``."""
    shapes = [(1, t, ctx) for t in (4, 8, 16, 32) for ctx in (0, 16, 64, 256)]
    return ChunkCost.of(
        [(r, t, ctx, a + b * r * t + c * r * t * (ctx + t)) for r, t, ctx in shapes]
    )


def _pieces(sched: Scheduler, prompt: int) -> list:
    long = Req(list(range(1, prompt + 1)), 2)
    sched.add(long)
    plans = []
    while long.context == long.prompt:
        plans.append(prefill(sched, 32))
    return plans


def test_a_long_prompts_pieces_are_sized_by_the_measured_cost_of_their_context():
    """The budget counts the attention over the context: with a measured ChunkCost, each
    piece is the longest (whole pages) whose prefill after the context its pages hold
    costs at most the budget's own time (32 new tokens, no context), so the first piece
    (no context) is a whole chunk, past ``long_chunk_tokens``; with ``min_piece_tokens``
    the late ones shrink below it (by default they do not: TTFT)."""

    def make_long(min_piece: int | None = 4) -> Scheduler:
        pool = PagePool(Z, 80, 1, 2, 256)
        cache = CacheManager(PageTable(pool), b"test", caching=False)
        config = SchedulerConfig(2, (1, 2), 32, 32, 16, min_piece)
        return Scheduler(config, cache, bucket=lambda n: max(4, 1 << (n - 1).bit_length()))

    by_tokens = make_long()
    assert by_tokens.piece_lengths() == [4, 8]  # a quarter and a half of a 16-token piece
    assert {len(p.chunks[0].tokens) for p in _pieces(by_tokens, 200)[:-1]} == {16}
    default = make_long(None)
    assert default.piece_lengths() == []  # nothing shorter compiled
    default.chunk_cost = _linear_cost(1.0, 1.0, 0.05)
    assert [len(p.chunks[0].tokens) for p in _pieces(default, 200)] == [32] + [16] * 10 + [8]
    with pytest.raises(ConfigError, match="min_piece_tokens must be in 1..long_chunk_tokens=16"):
        SchedulerConfig(2, (1, 2), 32, 32, 16, 17)

    sched = make_long()
    cost = sched.chunk_cost = _linear_cost(1.0, 1.0, 0.05)
    assert cost.coefficients == pytest.approx((1.0, 1.0, 0.05))
    budget_ms = cost.ms(1, 32, 0)
    plans = _pieces(sched, 200)
    takes = [len(p.chunks[0].tokens) for p in plans]
    starts = [p.chunks[0].start for p in plans]
    assert sum(takes) == 200 and starts == [sum(takes[:i]) for i in range(len(takes))]
    assert all(s % Z == 0 for s in starts)  # each piece continues on a whole page
    assert takes[0] == 32 > 16 > takes[-2]  # no context: a whole chunk; late: small
    for plan in plans:
        chunk = plan.chunks[0]
        context = sched.prefill_cache.context_width(chunk.start // Z) * Z if chunk.start else 0
        ms = cost.ms(1, plan.length, context)
        assert ms <= budget_ms or len(chunk.tokens) == 4  # within it, or the smallest piece
    assert all(a >= b for a, b in zip(takes[:-1], takes[1:-1], strict=False))  # shrinking
    # Attention that costs nothing: a whole chunk, then pieces of long_chunk_tokens (the
    # longest after context whose cost is measured).
    free = make_long()
    free.chunk_cost = _linear_cost(1.0, 1.0, 0.0)
    assert [len(p.chunks[0].tokens) for p in _pieces(free, 200)] == [32] + [16] * 10 + [8]


def test_chunk_cost_takes_what_was_measured_and_fits_the_rest():
    cost = ChunkCost.of([(1, 8, 0, 3.0), (1, 8, 0, 5.0), (1, 8, 0, 4.0), (1, 16, 64, 9.0)])
    assert cost.ms(1, 8, 0) == 4.0  # the median of one shape's samples
    assert cost.ms(1, 16, 64) == 9.0
    a, b, c = cost.coefficients
    assert min(a, b, c) >= 0  # a time never falls as a shape grows
    with pytest.raises(ConfigError, match="at least one measured prefill shape"):
        ChunkCost(())
    with pytest.raises(ConfigError, match=r"got \(1, 0, 0, 1.0\)"):
        ChunkCost(((1, 0, 0, 1.0),))


def test_requests_share_a_prefill_within_the_budget():
    sched = make(pages=32, rows=4, prefill_batch=2, chunk=8, budget=16)
    for i in range(3):
        sched.add(Req([i] * 5, 4))
    plan = sched.schedule_prefill(16)
    assert len(plan.chunks) == 2 and plan.cost <= 16  # two rows of 8 padded tokens
    assert [c.request.prompt[0] for c in plan.chunks] == [0, 1]  # in order


def test_a_queue_with_no_running_rows_is_admitted_over_several_steps_within_the_budget():
    """Nothing decodes and eight requests wait: each step prefills at most the budget's
    padded tokens (two 8-token rows of 16), in order, then decodes, so the first requests
    draw their second tokens before the last ones are prefilled."""
    sched = make(pages=64, rows=8, max_seq_len=32, prefill_batch=2, chunk=8, budget=16)
    requests = [Req([i] * 5, 4) for i in range(8)]
    for request in requests:
        sched.add(request)
    admitted, second_token_at, last_admitted_at = [], None, None
    for n in range(10):
        plans = admit(sched)
        assert sum(p.cost for p in plans) <= 16
        admitted.append([c.request.prompt[0] for p in plans for c in p.chunks])
        if requests[-1].drawn and last_admitted_at is None:
            last_admitted_at = n
        decode(sched)
        if len(requests[0].drawn) >= 2 and second_token_at is None:
            second_token_at = n
    assert [a for a in admitted if a] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # in order
    assert second_token_at == 0 and last_admitted_at == 3
    assert all(r.done for r in requests)
    conserved(sched)


def test_requests_arriving_between_steps_join_later_steps_in_order():
    sched = make(pages=64, rows=8, max_seq_len=32, prefill_batch=2, chunk=8, budget=16)
    early = [Req([i] * 5, 8) for i in range(3)]
    for request in early:
        sched.add(request)
    first = admit(sched)
    decode(sched)
    late = [Req([10 + i] * 5, 8) for i in range(2)]
    for request in late:  # they arrive while the step ran
        sched.add(request)
    assert [c.request for p in first for c in p.chunks] == early[:2]
    second = [c.request for p in admit(sched) for c in p.chunks]
    assert second == [early[2], late[0]]  # the older one first, then the arrivals
    decode(sched)
    assert [c.request for p in admit(sched) for c in p.chunks] == [late[1]]
    assert all(len(r.drawn) >= 1 for r in [*early, *late])


def test_a_long_prompt_alone_goes_even_past_a_small_budget():
    """A budget below one chunk's padded cost: the step's first prefill goes anyway, one
    chunk a step, so a lone long prompt is not starved (whether or not rows decode)."""
    sched = make(pages=32, rows=4, max_seq_len=64, chunk=8, budget=4)
    long = Req(list(range(21)), 3)
    sched.add(long)
    steps = 0
    while not long.drawn:
        plans = admit(sched)
        assert len(plans) == 1 and plans[0].chunks[0].request is long  # one chunk per step
        decode(sched)
        steps += 1
    assert steps == 3  # 8 + 8 + 5 tokens


def test_a_prefix_hit_costs_only_its_suffix_in_the_budget():
    """Two prompts of 15 tokens cost 2 rows x 16 padded tokens: over a budget of 16, they
    prefill in two steps. With their first 12 tokens cached, each computes 3 tokens (one
    8-token bucket), and both go in one step."""

    def plan_two(cached: bool) -> list[PrefillPlan]:
        sched = make(pages=32, rows=4, max_seq_len=32, prefill_batch=2, chunk=16, budget=16)
        if cached:
            sched.add(Req(list(range(13)), 1))  # ends at its first token: 3 pages cached
            admit(sched)
        for tail in (50, 60):
            sched.add(Req([*range(12), tail, tail + 1, tail + 2], 4))
        return admit(sched)

    (plan,) = plan_two(cached=True)
    assert [c.hit for c in plan.chunks] == [12, 12] and plan.cost <= 16
    assert [len(p.chunks) for p in plan_two(cached=False)] == [1]  # the other waits


def test_prefix_hit_is_placed_in_the_shard_that_caches_it():
    sched = make(pages=10, shards=2, rows=4, max_seq_len=32, chunk=16)
    first = Req(list(range(13)), 1)  # ends at its first token: its pages stay cached
    sched.add(first)
    plan = prefill(sched)
    shard = sched.cache.shard(plan.chunks[0].row)
    assert sched.cache.pages.cached_pages == 3  # its three full pages
    # Hold pages in the caching shard so the other has more free ones.
    filler = Req([99] * 5, 8)
    sched.add(filler)
    prefill(sched)
    cache = sched.cache
    assert cache.free_pages(shard) < cache.free_pages(1 - shard)
    again = Req([*range(13), 50, 51], 4)
    sched.add(again)
    plan = prefill(sched)
    (chunk,) = plan.chunks
    assert sched.cache.shard(chunk.row) == shard  # where its prefix is, not the emptier shard
    assert chunk.start == 12 and chunk.hit == 12  # three cached pages
    assert chunk.tokens == (12, 50, 51)  # only the rest is computed
    # A prompt that is exactly its cached pages still computes its last token.
    filler.cancel_requested = True  # (a row of the caching shard frees)
    sched.cancelled_running()
    same = Req(list(range(12)), 2)
    sched.add(same)
    (chunk,) = prefill(sched).chunks
    assert chunk.start == 8 and chunk.tokens == tuple(range(8, 12))
    conserved(sched)


def test_admission_under_a_tight_pool_keeps_order():
    sched = make(pages=6, rows=4, max_seq_len=20)  # 5 usable pages
    big, small = Req(list(range(17)), 4), Req([1, 2], 2)  # big: 17 tokens + its next: 5 pages
    running = Req([3] * 3, 8)
    sched.add(running)
    prefill(sched)  # holds one page
    sched.add(big)
    sched.add(small)
    plan = sched.schedule_prefill(None)
    assert plan.chunks == ()  # big does not fit; small does not overtake it
    assert list(sched.waiting) == [big, small]
    conserved(sched)
    while not running.done:
        decode(sched)
    plan = prefill(sched)
    assert [c.request for c in plan.chunks] == [big]  # first in, first admitted
    conserved(sched)


def test_cancelled_requests_leave_the_queue_and_free_their_rows():
    sched = make()
    gone, kept = Req([1] * 3, 4, cancel_requested=True), Req([2] * 3, 4)
    sched.add(gone)
    sched.add(kept)
    plan = prefill(sched)
    assert plan.cancelled == (gone,) and [c.request for c in plan.chunks] == [kept]
    kept.cancel_requested = True
    assert sched.cancelled_running() == [(plan.chunks[0].row, kept)]
    assert sched.running == 0 and sched.cache.pages.used_pages == 0


def test_no_request_starves():
    sched = make(pages=9, shards=2, rows=4, max_seq_len=24, chunk=8, budget=16)
    lengths = [3, 17, 5, 9, 2, 20, 4, 11, 6, 8, 13, 3, 7, 19, 2, 5]
    requests = [Req([i % 7] * n, 4 + i % 5) for i, n in enumerate(lengths)]
    first_admitted = {}
    for request in requests:
        sched.add(request)
    for n in range(400):
        before = set(map(id, sched.waiting))
        step(sched)
        conserved(sched)
        for request in requests:
            admitted = id(request) in before and id(request) not in set(map(id, sched.waiting))
            if admitted:
                first_admitted.setdefault(id(request), n)
        if all(r.done for r in requests):
            break
    assert all(r.done for r in requests), f"unfinished after {n + 1} steps"
    assert all(len(r.drawn) == r.max_tokens for r in requests)
    order = [first_admitted[id(r)] for r in requests]
    assert order == sorted(order)  # admitted first come, first served
    assert sched.cache.pages.used_pages == 0


class SchedulerMachine(RuleBasedStateMachine):
    """Random submissions, cancellations, prefills and decode steps against the invariants:
    pages conserved and never held twice, plans within their limits, and every admitted
    request finishing once the queue drains."""

    @initialize(
        shards=st.sampled_from([1, 2]),
        pages=st.integers(6, 14),
        caching=st.booleans(),
    )
    def setup(self, shards, pages, caching):
        self.sched = make(
            pages=pages, shards=shards, rows=4, max_seq_len=20, chunk=8, budget=16,
            caching=caching,
        )  # fmt: skip
        self.requests: list[Req] = []

    @rule(
        length=st.integers(1, 16),
        new=st.integers(1, 12),
        vocab=st.integers(1, 3),
    )
    def submit(self, length, new, vocab):
        usable = (self.sched.cache.pool.pages_per_shard - 1) * Z
        new = min(new, 20 - length + 1)
        if length + new - 1 > usable - Z:  # the batcher's admission refuses what never fits
            return
        request = Req([i % vocab for i in range(length)], new)
        self.requests.append(request)
        self.sched.add(request)

    @precondition(lambda self: any(not r.done for r in self.requests))
    @rule(data=st.data())
    def cancel(self, data):
        live = [r for r in self.requests if not r.done]
        data.draw(st.sampled_from(live)).cancel_requested = True

    @rule(budget=st.sampled_from([None, 4, 8, 16, 32]), spent=st.sampled_from([0, 0, 4, 8]))
    def plan_prefill(self, budget, spent):
        plan = prefill(self.sched, budget, spent)
        config = self.sched.config
        assert len(plan.chunks) <= config.prefill_batch
        assert plan.rows in (0, *config.row_buckets) and plan.rows >= len(plan.chunks)
        assert all(0 < len(c.tokens) <= config.chunk_tokens for c in plan.chunks)
        assert all(c.start % Z == 0 for c in plan.chunks)
        if (
            budget is not None and plan.chunks and (spent or len(plan.chunks) > 1)
        ):  # a first may go over
            assert spent + plan.cost <= budget
        rows = [c.row for c in plan.chunks]
        assert len(set(rows)) == len(rows)

    @rule()
    def run_step(self):
        step(self.sched)

    @invariant()
    def pages_conserved(self):
        conserved(self.sched)

    @invariant()
    def rows_hold_one_request(self):
        owners = [r for r in self.sched.owners if r is not None]
        assert len(owners) == len({id(r) for r in owners})
        assert not {id(r) for r in owners} & {id(r) for r in self.sched.waiting}

    def teardown(self):
        sched = self.sched
        for _ in range(300):
            if all(r.done for r in self.requests):
                break
            step(sched)
            conserved(sched)
        assert all(r.done for r in self.requests), "an admitted request never finished"
        assert sched.running == 0 and not sched.waiting and sched.chunking is None
        assert sched.cache.pages.used_pages == 0


SchedulerMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_machine = SchedulerMachine.TestCase


ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(path: pathlib.Path, package: str) -> set[str]:
    """Every module ``path`` imports, at the top or inside functions (absolute names)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}  # a submodule imported by name
    return names


def _module_file(name: str) -> pathlib.Path | None:
    parts = name.split(".")
    for candidate in (
        ROOT.joinpath(*parts).with_suffix(".py"),
        ROOT.joinpath(*parts, "__init__.py"),
    ):
        if candidate.exists():
            return candidate
    return None


def _reached(module: str) -> set[str]:
    """``module`` and every jaxpar module it imports, transitively; third-party names too."""
    seen, todo, names = set(), [module], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_file(name)
        if path is None:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for imported in _imports(path, package):
            names.add(imported)
            if imported.startswith("jaxpar.") and _module_file(imported) is not None:
                todo.append(imported)
    return names | seen


@pytest.mark.parametrize("module", ["jaxpar.engine._scheduler", "jaxpar.engine._cache"])
def test_policy_modules_import_no_jax(module):
    reached = _reached(module)
    assert "jaxpar.engine._pages" in reached or module.endswith("_pages")
    assert {"jaxpar.engine._chunk_cost", "jaxpar.engine._decode_groups"} <= _reached(
        "jaxpar.engine._scheduler"
    )  # the cost models are policy too
    heavy = sorted(n for n in reached if n.split(".")[0] in {"jax", "jaxlib", "flax", "optax"})
    assert heavy == [], f"{module} reaches {heavy}"
    engine_heavy = {"jaxpar.engine._engine", "jaxpar.engine._executor", "jaxpar.models"}
    assert not engine_heavy & reached


def test_import_walk_sees_jax_where_it_is():
    # The walk is not vacuous: a request (its grammar masks are JAX arrays) reaches JAX.
    assert "jax" in {n.split(".")[0] for n in _reached("jaxpar.engine._requests")}


def test_scratch_page_matches_the_models():
    from jaxpar.models import SCRATCH_PAGE as MODELS_SCRATCH

    assert SCRATCH_PAGE == MODELS_SCRATCH
