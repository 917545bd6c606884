"""The continuous batcher's speculative decode step (host side).

:class:`Speculation` sits in front of :meth:`ServingCore.decode
<jaxpar.engine._core.ServingCore.decode>`: each decode-loop turn the cost model chooses
how many tokens to draft (``K``: 0 .. ``num_speculative_tokens``, for the batch, each row
capped by its own acceptance), the proposer drafts them (:mod:`._spec_propose`: n-gram
lookup, a draft model, an EAGLE-3 or MTP head over the target's hidden states), each constrained request's grammar is walked along its drafts (a
draft it does not allow cuts them; the grammar's mask at each position is the
verification's), and if the drafts still pay a verification runs
(:meth:`Executor.verify <jaxpar.engine._executor.Executor.verify>`, a recorded command: a
multi-process job replays it with the same host arrays), streams each row's accepted
tokens, advances the scheduler's lengths by what each row kept and tells the proposer.
Otherwise the plain step runs as before. A head's rows without a tapped state for their
latest position verify their next token alone once (a "hungry" verification), which taps
it; a verification feeding a head also returns the hidden states it reads. A verification is synchronous (the next drafts
need its tokens), so the step in flight is read first.

It falls back to the plain step whenever a row lacks room for ``K + 1`` positions
(pages, or ``max_seq_len``): the plain step's reservation then preempts as usual, so a
preempted row's drafts are simply never made. Logprobs are the target's at each emitted
position.
"""

from __future__ import annotations

import time

import numpy as np

from jaxpar.engine._executor import DECODE
from jaxpar.engine._grammar import mask_words
from jaxpar.engine._runner import _logprob, masks
from jaxpar.engine._spec_heads import HEAD_METHODS, load_head
from jaxpar.engine._spec_propose import Ask, NgramProposer, Proposer, constrain
from jaxpar.engine._speculative import CostModel, SpecStats, SpeculativeConfig


def make_proposer(config: SpeculativeConfig, core) -> Proposer:
    """The proposer of ``config.method`` for a batcher's serving core."""
    if config.method == "draft_model":
        from jaxpar.engine._spec_draft import DraftModelProposer

        return DraftModelProposer(config, core)
    # A process that replays gets the drafts recorded with each verification.
    if config.method in HEAD_METHODS and core.runner.executor.keeps_outputs:
        return load_head(config, core.runner.engine)
    return NgramProposer(config)


class Speculation:
    """Speculative steps for one batcher's core (``core``: its :class:`ServingCore`)."""

    def __init__(self, config: SpeculativeConfig, core):
        self.config, self.core = config, core
        self.k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_pos=[0] * self.k, steps_by_k=[0] * (self.k + 1))
        self.cost = CostModel(self.k, config.adaptive)
        self.proposer = make_proposer(config, core)
        self._plain_started: tuple[float, tuple[int, int], int] | None = None
        self._seen: set[tuple[int, int, int]] = set()  # (rows, width, K) verified (compiled)
        self._plain_seen: set[tuple[int, int]] = set()  # (rows, width) stepped once

    def _key(self, row: int) -> tuple[int, int]:
        """Row ``row``'s present request: the row and its admission number."""
        return row, self.core.scheduler._admitted[row]

    def _asks(self, owners) -> list[Ask]:
        """Each live row's question for the proposer, ``k`` its cap (its acceptance, its
        tokens left, ``max_seq_len``)."""
        sched = self.core.scheduler
        max_seq = self.core.cache.pool.max_seq_len
        out = []
        for i, stream in enumerate(owners):
            if stream is None:
                continue
            length = sched.lengths[i]
            left = stream.request.max_tokens - len(stream.tokens) - 1
            k = min(self.cost.row_cap(self._key(i)), max(left, 0))
            if length + self.k + 1 > max_seq:
                k = 0
            context = stream.context[: length + 1]
            out.append(Ask(i, stream, context, length, k, self._key(i)[1]))
        return out

    def decode(self, pending: tuple | None) -> tuple[bool, tuple | None]:
        """One speculative step if it pays; returns (whether it ran, the plain step still
        in flight: None once read). While the cost model rules speculation out even with
        every row drafting, the plain steps keep their overlap (nothing is read early)."""
        core = self.core
        sched = core.scheduler
        self._plain_done()
        running = sched.running
        limit = self.config.disable_by_batch_size
        if running == 0 or (limit is not None and running >= limit):
            return False, pending
        live = np.array([s is not None for s in sched.owners])
        rows = core.runner.slot_steps.rows_for(live)
        if not self.cost.worth_drafting(rows, int(live.sum())):
            return self._plain(rows, pending)
        if pending is not None:  # drafts need every token so far
            core.deliver(*pending)
        with core.lock:
            planned = self._plan()
        if isinstance(planned, int):
            return self._plain(planned, None)
        self._run(*planned)
        return True, None

    def _plan(self):
        """The verification to run (lock held): (rows computed, K, drafts by row, their
        q, token masks, released rows, lengths before it); or the rows a plain step
        computes instead, when no row has a draft, it does not pay, or some row lacks
        room for ``K + 1`` tokens."""
        sched, cache = self.core.scheduler, self.core.cache
        owners = sched.owners
        live = np.array([s is not None for s in owners])
        rows = self.core.runner.slot_steps.rows_for(live)
        asks = self._asks(owners)
        keys = {(a.row, a.admission) for a in asks}
        for key in [k for k in self.cost.rows if k not in keys]:
            self.cost.forget(key)
        rates = [self.cost.rows.get((a.row, a.admission), self.cost.acceptance) for a in asks]
        caps = [a.k for a in asks]
        k = self.k if self.cost.exploring else self.cost.best(rows, caps, rates)
        if k == 0:
            return rows
        if not all(cache.allocate(a.row, a.length + k + 1) for a in asks):
            return rows  # the plain step reserves (and preempts) for one token
        asks = [Ask(a.row, a.stream, a.context, a.length, min(a.k, k), a.admission) for a in asks]
        proposal = self.proposer.propose(asks, cache)
        drafts = {a.row: proposal.drafts.get(a.row, []) for a in asks}
        q = dict(proposal.q or {})
        allowed = None
        if any(a.stream.matcher is not None for a in asks):
            vocab = self.core.runner.engine.program.run.vocab_size
            allowed = np.full((len(owners), k + 1, mask_words(vocab)), -1, np.int32)
            for a in asks:
                if a.stream.matcher is not None:
                    kept, allowed[a.row] = constrain(a.stream.matcher, drafts[a.row], vocab, k + 1)
                    drafts[a.row] = kept
                    if a.row in q:
                        q[a.row] = q[a.row][: len(kept)]
        counts = [len(d) for d in drafts.values()]
        # A head's rows without a tapped state verify their next token alone once (a
        # "hungry" step), which taps it: drafting was judged to pay, or this ran not.
        hungry = not any(counts) and getattr(self.proposer, "hungry", False)
        if not hungry and (
            not any(counts) or not (self.cost.exploring or self.cost.pays(rows, counts, rates))
        ):
            for a in asks:  # a draft model's pages: back to what the target holds
                self.proposer.verified(a.row, a.length)
            return rows
        released = np.array(sched.released)
        sched.released = [False] * len(owners)
        return rows, k, drafts, q, allowed, released, list(sched.lengths)

    def _inputs(self, rows: int, k: int, drafts: dict[int, list[int]], lengths: list[int]):
        """The verification's host arrays: global page ids of the rows computed, drafts,
        draft counts."""
        cache, pool, b = self.core.cache, self.core.cache.pool, len(lengths)
        width = cache.width(max(lengths[i] for i in drafts) + k + 1)
        global_BN = np.full((b, width), pool.pages, np.int32)
        drafts_BK = np.zeros((b, k), np.int32)
        n_drafts_B = np.zeros(b, np.int32)
        for i, d in drafts.items():
            held = min(pool.pages_for(lengths[i] + k + 1), width)
            global_BN[i, :held] = cache.global_ids(i, held)
            drafts_BK[i, : len(d)] = d
            n_drafts_B[i] = len(d)
        steps = self.core.runner.slot_steps
        pages_RN = steps.table_rows(global_BN[None], rows)[0]
        tables_RN = steps.table_rows(cache.step_tables(width), rows)
        return tables_RN, pages_RN, drafts_BK, n_drafts_B

    def _q(self, k: int, drafts: dict[int, list[int]], q: dict[int, np.ndarray], holders):
        """The drafts' distributions ``[B, K, V]`` for the verification; None when no row
        samples (greedy acceptance needs no ``q``) or the proposer has none (point
        masses)."""
        sampled = any(
            s is not None and s.request.sampling.temperature > 0 and drafts.get(i)
            for i, s in enumerate(holders)
        )
        if not q or not sampled:
            return None
        vocab = next(iter(q.values())).shape[-1]
        q_BKV = np.zeros((len(holders), k, vocab), np.float32)
        for i, d in drafts.items():
            if i in q:
                q_BKV[i, : len(d)] = q[i][: len(d)]
            else:
                q_BKV[i, np.arange(len(d)), d] = 1.0
        return q_BKV

    def _run(self, rows, k, drafts, q, allowed, released, lengths) -> None:
        """Runs a verification, streams each row's tokens, counts."""
        core, runner = self.core, self.core.runner
        self._plain_started = None
        start = time.perf_counter()
        tables_RN, pages_RN, drafts_BK, n_drafts_B = self._inputs(rows, k, drafts, lengths)
        holders = list(core.scheduler.owners)
        if allowed is None and any(s is not None and s.matcher is not None for s in holders):
            allowed = masks(holders, len(holders), runner.engine.program.run.vocab_size)
        ex = runner.executor
        # Pages taken for the drafts may have evicted cached ones to the host tier: their
        # copies go out before the verification writes them.
        runner.move_pages(core.cache, DECODE)
        q_BKV = self._q(k, drafts, q, holders)
        taps = getattr(self.proposer, "taps", None)
        handle = ex.verify(
            released, tables_RN, pages_RN, drafts_BK, n_drafts_B, allowed, q_BKV, taps
        )
        features = None if taps is None else ex.spec_features(handle)
        asked = any(s is not None and s.request.logprobs is not None for s in holders)
        tokens_BT, logprobs, dropped = ex.spec_tokens(handle, logprobs=asked)
        runner._count_dropped(dropped)
        took = time.perf_counter() - start
        accepted = 0
        for i, d in drafts.items():
            count = int((tokens_BT[i] >= 0).sum())
            kept = self._count(d, count - 1)
            accepted += kept
            if d:
                self.cost.row_verified(self._key(i), len(d), kept)
            with core.lock:
                core.scheduler.lengths[i] = lengths[i] + count
            self.proposer.verified(i, lengths[i] + count)
            if features is not None:  # a head: the states it drafts from next
                self.proposer.observe(i, holders[i], lengths[i], tokens_BT[i, :count], features[i])
            self._emit(i, holders[i], tokens_BT[i, :count], logprobs)
        self.stats.verify_steps += 1
        self.stats.chose(k)
        drafting = [len(d) for d in drafts.values() if d]
        self.stats.row_k_mean = float(np.mean(drafting)) if drafting else 0.0
        with core.lock:
            core.stats.decode_steps += 1
            core.stats.decode_seconds += took
        key = (rows, pages_RN.shape[-1], k)
        first = key not in self._seen
        self._seen.add(key)
        if not first:  # a program's first run compiles it
            self.cost.verified(rows, took, int(n_drafts_B.sum()), accepted, k)
            drafted = getattr(self.proposer, "last", None)
            if drafted is not None:
                self.cost.drafted(rows, *drafted)

    def _count(self, drafted: list[int], kept: int) -> int:
        """Counts a row's drafts and accepted ones (vLLM's metrics); returns ``kept``."""
        if not drafted:
            return 0
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += len(drafted)
        stats.num_accepted_tokens += kept
        for j in range(kept):
            stats.accepted_per_pos[j] += 1
        return kept

    def _emit(self, row: int, stream, tokens: np.ndarray, logprobs) -> None:
        """Streams a row's tokens until its request ends (its row then freed)."""
        for j, token in enumerate(tokens.tolist()):
            lp = None if logprobs is None else logprobs[j]
            if stream.emit(token, _logprob(lp, row, token, stream.request)) is not None:
                self.core.finished(row)
                return

    def _plain(self, rows: int, pending):
        """A plain step runs this turn (timed until the next turn, for the cost model)."""
        self.stats.chose(0)
        sched = self.core.scheduler
        longest = max((n for n, o in zip(sched.lengths, sched.owners, strict=True) if o), default=0)
        key = (rows, self.core.cache.width(longest + 1))
        self._plain_started = (time.perf_counter(), key, self._prefills())
        return False, pending

    def _prefills(self) -> int:
        stats = self.core.stats
        return stats.prefill_batches + stats.prefill_chunks

    def _plain_done(self) -> None:
        """The last turn ran a plain step: its time, from that turn's start to this one's."""
        if self._plain_started is not None:
            started, key, prefills = self._plain_started
            first = key not in self._plain_seen  # a program's first run compiles it
            self._plain_seen.add(key)
            if prefills == self._prefills() and not first:  # a prefill takes time too
                self.cost.plain(key[0], time.perf_counter() - started)
            self.stats.plain_steps += 1
            self._plain_started = None
