"""What each step of a batcher did and how long it took, for efficiency metrics.

The batcher records shape facts of every step (rows, tokens, KV positions read, query-key
pairs attended) and its measured wall time, not bytes or FLOPs: turning those facts into
bytes and FLOPs needs the compiled programs and the hardware, which the server knows
(:mod:`jaxpar.server._efficiency`). Both are linear in these facts, so they are summed
here: over every step since start (for Prometheus counters, which ``rate()`` divides) and
over the last :data:`WINDOW_STEPS` steps (for gauges that read as "now").

Times, as the batcher measures them:

* decode: from one step's tokens reaching the host to the next's; colocated, less the
  prefill time spent in between (prefill runs between two decode steps). A prefill waits
  for the decode step still in flight, so a little of a decode step can count as prefill.
* prefill: from building the batch to its first tokens on the host (the first tokens'
  draw included). A long prompt's chunks before its last are dispatched without waiting
  for them; their facts and time join the next prefill that waits, so the window holds
  whole prompts' work against the time it took.

Written by the batcher's threads, read by scrapes: every access holds a lock.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

#: Steps per phase the recent-window gauges cover.
WINDOW_STEPS = 64


@dataclasses.dataclass(frozen=True)
class StepFacts:
    """What one step (or several, summed) computed and read.

    Attributes:
        steps: programs run (a long prompt's chunks each count).
        seconds: their measured wall time.
        rows: sequences the step computed logits for (decode: running rows; prefill: the
            prompts it finished), each one LM-head position.
        tokens: real tokens whose K/V the step computed (decode: one per running row;
            prefill: the prompts' new tokens, padding not counted).
        kv_read: cached KV positions the step read, per layer (decode: every running
            row's pages up to the block-table width; prefill: the cached context of a
            prefix hit or earlier chunks).
        pairs: (query, key) position pairs attended, per layer and head: each real
            token attends to its cached context and, causally, to itself and the tokens
            before it.
        computed: tokens the compiled programs computed, padding included (decode: the
            step's row bucket, one token per row; prefill: its row bucket x its token
            bucket). ``computed - tokens`` is padding.
        kv_live: of ``kv_read``, the positions the rows hold (decode: the running rows'
            lengths; prefill: their cached context). ``kv_read - kv_live`` is block-table
            width past the rows' ends.
    """

    steps: int = 0
    seconds: float = 0.0
    rows: int = 0
    tokens: int = 0
    kv_read: int = 0
    pairs: int = 0
    computed: int = 0
    kv_live: int = 0

    def __add__(self, other: StepFacts) -> StepFacts:
        return StepFacts(*(a + b for a, b in zip(_fields(self), _fields(other), strict=True)))

    def __sub__(self, other: StepFacts) -> StepFacts:
        diff = StepFacts(*(a - b for a, b in zip(_fields(self), _fields(other), strict=True)))
        return dataclasses.replace(diff, seconds=max(diff.seconds, 0.0))  # never below zero


def _fields(facts: StepFacts) -> tuple:
    return dataclasses.astuple(facts)


class PhaseLog:
    """One phase's steps: their sum since start and over the last ``window`` steps (kept
    as running sums: a scrape reads them without adding up the window)."""

    def __init__(self, window: int = WINDOW_STEPS):
        self.total = StepFacts()
        self._window = window
        self._recent: collections.deque[StepFacts] = collections.deque()
        self._recent_sum = StepFacts()
        self._lock = threading.Lock()

    def record(self, facts: StepFacts) -> None:
        with self._lock:
            self.total = self.total + facts
            self._recent.append(facts)
            recent = self._recent_sum + facts
            if len(self._recent) > self._window:
                recent = recent - self._recent.popleft()
            self._recent_sum = recent

    def recent(self) -> StepFacts:
        """The last ``window`` records summed (zeros before the first)."""
        with self._lock:
            return self._recent_sum


class StepLog:
    """A batcher's decode and prefill steps (see the module docstring for the times).

    Args:
        colocated: prefill runs on the decode devices between decode steps, so a decode
            interval less the prefill time in it is the decode step's time.
        window: steps per phase of the recent window.
        clock: what "now" is when a prefill ends (the batcher's ``time.perf_counter``).
    """

    def __init__(
        self,
        *,
        colocated: bool,
        window: int = WINDOW_STEPS,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.colocated = colocated
        self._clock = clock
        self.decode = PhaseLog(window)
        self.prefill = PhaseLog(window)
        self._lock = threading.Lock()
        self._in_flight: collections.deque[StepFacts] = collections.deque()
        # (end, seconds) of the prefills since the last decode delivery (bounded: a
        # prefill-only load delivers no decode step).
        self._prefills: collections.deque[tuple[float, float]] = collections.deque(maxlen=256)
        self._chunks = StepFacts()  # chunks dispatched without waiting, not yet recorded

    def decode_dispatched(
        self, live_lengths: list[int], width_tokens: int | list[int], rows: int
    ) -> None:
        """A decode step was dispatched over rows holding ``live_lengths`` tokens each,
        with block tables ``width_tokens`` positions wide (one width, or each row's when
        the step was split by width), computing ``rows`` rows (its row buckets: the live
        ones and padding)."""
        n = len(live_lengths)
        widths = width_tokens if isinstance(width_tokens, list) else [width_tokens] * n
        facts = StepFacts(
            steps=1,
            rows=n,
            tokens=n,
            kv_read=sum(widths),
            pairs=sum(live_lengths) + n,  # each new token attends to its row and itself
            computed=rows,
            kv_live=sum(live_lengths),
        )
        with self._lock:
            self._in_flight.append(facts)

    def decode_delivered(self, since: float, now: float) -> None:
        """The oldest dispatched decode step's tokens reached the host at ``now``
        (``perf_counter``); the previous step's did at ``since`` (or the loop woke up)."""
        with self._lock:
            facts = self._in_flight.popleft() if self._in_flight else StepFacts(steps=1)
            prefill_s = sum(s for end, s in self._prefills if end > since)
            self._prefills.clear()
        seconds = now - since
        if self.colocated:
            seconds = max(seconds - prefill_s, 0.0)
        self.decode.record(dataclasses.replace(facts, seconds=seconds))

    def prefill_done(
        self,
        takes: list[int],
        starts: list[int],
        seconds: float,
        *,
        final: bool,
        shape: tuple[int, int],
    ) -> None:
        """A prefill of ``takes`` new tokens per prompt after ``starts`` cached ones took
        ``seconds``; ``final``: it finished its prompts (their first tokens are on the
        host), else it was a chunk dispatched without waiting; ``shape``: its (rows,
        tokens) buckets."""
        facts = StepFacts(
            steps=1,
            seconds=seconds,
            rows=len(takes) if final else 0,
            tokens=sum(takes),
            kv_read=sum(starts),
            pairs=sum(t * s + t * (t + 1) // 2 for t, s in zip(takes, starts, strict=True)),
            computed=shape[0] * shape[1],
            kv_live=sum(starts),
        )
        with self._lock:
            if self.colocated:
                self._prefills.append((self._clock(), seconds))
            if not final:
                self._chunks = self._chunks + facts
                return
            facts, self._chunks = self._chunks + facts, StepFacts()
        self.prefill.record(facts)
