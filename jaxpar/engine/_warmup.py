"""Warm-up: the serving programs a batcher compiles before (or while) it serves.

A :class:`WarmupPlan` lists them, each a :class:`Bucket` (one prefill shape with the
first-token draw and insert that follow it, or one decode step shape), smallest first,
and says why there are so many (:meth:`WarmupPlan.describe`: the buckets of each kind).
:class:`Warmup` compiles a plan on a few daemon threads: tracing and lowering run one at
a time, XLA's compiles (which release the GIL) in parallel. :meth:`Warmup.wait_first`
returns once the first buckets are compiled (``lazy``: the server answers from then on;
a request that needs a program not compiled yet waits for it, see
:meth:`jaxpar.engine._steps.Steps._aot`), :meth:`Warmup.wait` once all are;
:meth:`Warmup.stop` drops what has not started (a shutdown does not wait for it).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from collections.abc import Callable, Sequence

#: Warm-up threads by default: XLA's compiles run in parallel, up to the host's cores.
MAX_WARMUP_THREADS = 8
#: How often a held warm-up looks again whether it may compile (seconds).
HOLD_POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One compiled shape. ``kind``: ``"prefill"`` (``rows x tokens`` new tokens, with the
    first-token draw and the insert into pages), ``"context"`` (the same after ``context``
    cached tokens), ``"decode"`` (a step of ``rows`` rows over ``tokens`` positions) or
    ``"split"`` (one group of a decode step split by width: ``rows`` rows chosen by id)."""

    kind: str
    rows: int
    tokens: int
    context: int = 0

    def describe(self) -> str:
        if self.kind == "decode":
            return f"decode step of {self.rows} rows x {self.tokens} tokens"
        if self.kind == "split":
            return f"decode group of {self.rows} rows x {self.tokens} tokens"
        if self.kind == "context":
            return f"prefill of {self.rows} x {self.tokens} tokens after {self.context} cached"
        return f"prefill and insert of {self.rows} x {self.tokens} tokens"


def _values(xs: Sequence[int]) -> str:
    return "{" + ",".join(str(x) for x in sorted(set(xs))) + "}"


@dataclasses.dataclass(frozen=True)
class WarmupPlan:
    """The buckets to compile, in order; the first ``first`` are what a lazy warm-up
    compiles before serving (the smallest prefill and decode step)."""

    buckets: tuple[Bucket, ...]
    first: int

    def __len__(self) -> int:
        return len(self.buckets)

    def describe(self) -> str:
        """``119 programs (prefill: rows {1,4} x tokens {8,16,32,64,128,256} (12); ...``."""
        parts = []
        for kind, what in (("prefill", "prefill"), ("context", "prefill after cached")):
            got = [b for b in self.buckets if b.kind == kind]
            if got:
                extra = (
                    f" x cached {_values([b.context for b in got])}" if kind == "context" else ""
                )
                parts.append(
                    f"{what}: rows {_values([b.rows for b in got])} x tokens "
                    f"{_values([b.tokens for b in got])}{extra} ({len(got)})"
                )
        for kind, what in (("decode", "decode"), ("split", "decode groups")):
            steps = [b for b in self.buckets if b.kind == kind]
            if steps:
                parts.append(
                    f"{what}: rows {_values([b.rows for b in steps])} x tokens "
                    f"{_values([b.tokens for b in steps])} ({len(steps)})"
                )
        return f"{len(self.buckets)} programs ({'; '.join(parts)})"


def ordered(buckets: Sequence[Bucket]) -> WarmupPlan:
    """A plan of ``buckets``, smallest first: the smallest plain prefill and decode step
    (what a lazy warm-up waits for), then by rows, then by size; decode groups of split
    steps last (until they are compiled, a step runs whole)."""
    order = {"prefill": 0, "decode": 1, "context": 2, "split": 3}
    key = lambda b: (b.kind == "split", b.rows, order[b.kind], b.tokens, b.context)  # noqa: E731
    rest = sorted(buckets, key=key)
    first = []
    for kind in ("prefill", "decode"):
        of_kind = [b for b in rest if b.kind == kind]
        if of_kind:
            first.append(of_kind[0])
            rest.remove(of_kind[0])
    return WarmupPlan(tuple(first + rest), len(first))


class Warmup:
    """Compiles ``jobs`` (``(what, compile)`` pairs, in order) on ``threads`` daemon
    threads; ``progress(done, total, what)`` after each."""

    def __init__(
        self,
        jobs: Sequence[tuple[str, Callable[[], object]]],
        threads: int | None = None,
        progress: Callable[[int, int, str], None] | None = None,
        hold: Callable[[], bool] | None = None,
    ):
        """``hold()`` true: start no job now (checked every :data:`HOLD_POLL_S`), e.g.
        while requests are served, so that background compiles do not slow them."""
        self.total = len(jobs)
        self._hold = hold or (lambda: False)
        self._pending = collections.deque(enumerate(jobs))
        self._done: set[int] = set()
        self._errors: list[BaseException] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._progress = progress or (lambda done, total, what: None)
        n = threads or min(MAX_WARMUP_THREADS, os.cpu_count() or 1)
        self._threads = [
            threading.Thread(target=self._work, name=f"warmup-{i}", daemon=True)
            for i in range(max(1, min(n, self.total)))
        ]

    def start(self) -> Warmup:
        for thread in self._threads:
            thread.start()
        return self

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and self._pending and self._hold():
                    self._cond.wait(HOLD_POLL_S)
                if self._stopped or not self._pending:
                    self._cond.notify_all()
                    return
                index, (what, job) = self._pending.popleft()
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - reported by wait_first / wait
                with self._cond:
                    self._errors.append(e)
                    self._stopped = True
                    self._cond.notify_all()
                return
            with self._cond:
                self._done.add(index)
                done = len(self._done)
                self._cond.notify_all()
            self._progress(done, self.total, what)

    @property
    def done(self) -> int:
        return len(self._done)

    @property
    def finished(self) -> bool:
        """Every job compiled (or the warm-up stopped or failed)."""
        with self._cond:
            return self._idle()

    def _idle(self) -> bool:
        alive = any(t.is_alive() for t in self._threads)
        return len(self._done) == self.total or (self._stopped and not alive)

    def wait_first(self, n: int, timeout: float | None = None) -> bool:
        """Blocks until jobs ``0..n-1`` are compiled (True), the warm-up stopped (False)
        or ``timeout`` passed (False). Raises the first job's error."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._errors or self._stopped or self._done.issuperset(range(n)),
                timeout,
            )
            if self._errors:
                raise self._errors[0]
            return bool(ok) and self._done.issuperset(range(n))

    def wait(self, timeout: float | None = None) -> bool:
        """:meth:`wait_first` of every job."""
        return self.wait_first(self.total, timeout)

    def stop(self) -> None:
        """Drops the jobs not started; those compiling finish in their daemon threads
        (nothing waits for them)."""
        with self._cond:
            self._stopped = True
            self._pending.clear()
            self._cond.notify_all()
