"""The continuous batcher's speculative decode step (host side).

:class:`Speculation` sits in front of :meth:`ServingCore.decode
<jaxpar.engine._core.ServingCore.decode>`: each decode-loop turn it drafts tokens for
the running rows (:func:`~jaxpar.engine._speculative.ngram_propose` over each request's
prompt and output), asks the cost model whether a verification pays, and if so runs one
(:meth:`Executor.verify <jaxpar.engine._executor.Executor.verify>`, a recorded command:
a multi-process job replays it with the same host arrays), streams each row's accepted
tokens and advances the scheduler's lengths by what each row kept. Otherwise the plain
step runs as before. A verification is synchronous (the next drafts need its tokens),
so the step in flight is read first.

It falls back to the plain step whenever a row lacks room for ``K + 1`` positions
(pages, or ``max_seq_len``): the plain step's reservation then preempts as usual, so a
preempted row's drafts are simply never made. Rows with a grammar or asking for
logprobs are verified with no drafts (one token, under the row's mask; logprobs are the
target's at each emitted position).
"""

from __future__ import annotations

import time

import numpy as np

from jaxpar.engine._executor import DECODE
from jaxpar.engine._runner import _logprob, masks
from jaxpar.engine._spec_heads import HEAD_METHODS, load_head
from jaxpar.engine._speculative import CostModel, SpecStats, SpeculativeConfig, ngram_propose


class Speculation:
    """Speculative steps for one batcher's core (``core``: its :class:`ServingCore`)."""

    def __init__(self, config: SpeculativeConfig, core):
        self.config, self.core = config, core
        self.k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)
        self.cost = CostModel(self.k, config.adaptive)
        self._plain_started: tuple[float, tuple[int, int], int] | None = None
        self._seen: set[tuple[int, int]] = set()  # (rows, width) verified once (compiled)
        self._plain_seen: set[tuple[int, int]] = set()  # (rows, width) stepped once
        #: ``eagle3``/``mtp``: the head that drafts (:mod:`._spec_heads`); None: n-gram, or
        #: a process that replays (the drafts come recorded with each verification).
        self.heads = None
        if config.method in HEAD_METHODS and core.runner.executor.keeps_outputs:
            self.heads = load_head(config, core.runner.engine)

    def _drafts(self, owners) -> dict[int, list[int]]:
        c, sched = self.config, self.core.scheduler
        max_seq = self.core.cache.pool.max_seq_len
        out, wanted = {}, {}
        for i, stream in enumerate(owners):
            if stream is None:
                continue
            out[i] = []
            if stream.matcher is not None or sched.lengths[i] + self.k + 1 > max_seq:
                continue
            left = stream.request.max_tokens - len(stream.tokens) - 1
            k = min(self.k, max(left, 0))
            if k and self.heads is not None:
                wanted[i] = k
            elif k:
                out[i] = ngram_propose(stream.context, k, c.prompt_lookup_min, c.prompt_lookup_max)
        if self.heads is not None:
            out.update(self.heads.drafts(wanted, owners, sched.lengths))
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
        """The verification to run (lock held): (rows computed, drafts by row, released
        rows, lengths before it); or the rows a plain step computes instead, when no row
        has a draft, it does not pay, or some row lacks room for ``K + 1`` tokens."""
        sched, cache = self.core.scheduler, self.core.cache
        owners = sched.owners
        drafts = self._drafts(owners)
        live = np.array([s is not None for s in owners])
        rows = self.core.runner.slot_steps.rows_for(live)
        counts = [len(d) for d in drafts.values()]
        # A head's rows without a tapped state verify their next token alone once (a
        # "hungry" step), which taps it: drafting was judged to pay, or this ran not.
        hungry = self.heads is not None and self.heads.hungry
        if not any(counts) and not hungry:
            return rows
        if any(counts) and not (self.cost.exploring or self.cost.pays(rows, counts)):
            return rows
        if not all(cache.allocate(i, sched.lengths[i] + self.k + 1) for i in drafts):
            return rows  # the plain step reserves (and preempts) for one token
        released = np.array(sched.released)
        sched.released = [False] * len(owners)
        return rows, drafts, released, list(sched.lengths)

    def _inputs(self, rows: int, drafts: dict[int, list[int]], lengths: list[int]):
        """The verification's host arrays: global page ids of the rows computed, drafts,
        draft counts."""
        cache, pool, b = self.core.cache, self.core.cache.pool, len(lengths)
        width = cache.width(max(lengths[i] for i in drafts) + self.k + 1)
        global_BN = np.full((b, width), pool.pages, np.int32)
        drafts_BK = np.zeros((b, self.k), np.int32)
        n_drafts_B = np.zeros(b, np.int32)
        for i, d in drafts.items():
            held = min(pool.pages_for(lengths[i] + self.k + 1), width)
            global_BN[i, :held] = cache.global_ids(i, held)
            drafts_BK[i, : len(d)] = d
            n_drafts_B[i] = len(d)
        steps = self.core.runner.slot_steps
        pages_RN = steps.table_rows(global_BN[None], rows)[0]
        tables_RN = steps.table_rows(cache.step_tables(width), rows)
        return tables_RN, pages_RN, drafts_BK, n_drafts_B

    def _run(self, rows, drafts, released, lengths) -> None:
        """Runs a verification, streams each row's tokens, counts."""
        core, runner = self.core, self.core.runner
        self._plain_started = None
        start = time.perf_counter()
        tables_RN, pages_RN, drafts_BK, n_drafts_B = self._inputs(rows, drafts, lengths)
        holders = list(core.scheduler.owners)
        allowed = None
        if any(s is not None and s.matcher is not None for s in holders):
            allowed = masks(holders, len(holders), runner.engine.program.run.vocab_size)
        ex = runner.executor
        # Pages taken for the drafts may have evicted cached ones to the host tier: their
        # copies go out before the verification writes them.
        runner.move_pages(core.cache, DECODE)
        taps = None if self.heads is None else self.heads.taps
        handle = ex.verify(released, tables_RN, pages_RN, drafts_BK, n_drafts_B, allowed, taps)
        features = None if taps is None else ex.spec_features(handle)
        asked = any(s is not None and s.request.logprobs is not None for s in holders)
        tokens_BT, logprobs, dropped = ex.spec_tokens(handle, logprobs=asked)
        runner._count_dropped(dropped)
        took = time.perf_counter() - start
        accepted = 0
        for i, d in drafts.items():
            count = int((tokens_BT[i] >= 0).sum())
            accepted += self._count(d, count - 1)
            with core.lock:
                core.scheduler.lengths[i] = lengths[i] + count
            if features is not None:
                self.heads.observe(i, holders[i], lengths[i], tokens_BT[i, :count], features[i])
            self._emit(i, holders[i], tokens_BT[i, :count], logprobs)
        self.stats.verify_steps += 1
        self.stats.chosen_k = self.k
        with core.lock:
            core.stats.decode_steps += 1
            core.stats.decode_seconds += took
        first = (rows, pages_RN.shape[-1]) not in self._seen
        self._seen.add((rows, pages_RN.shape[-1]))
        if not first:  # a program's first run compiles it
            self.cost.verified(rows, took, int(n_drafts_B.sum()), accepted)

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
        self.stats.chosen_k = 0
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
