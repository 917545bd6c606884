"""The decode loop's heartbeat: how long it has had work without coming round again.

A liveness probe must tell a loop that is stuck (a step that never returns, a collective
waiting on a process that is gone) from one that is idle (waiting for requests, which may
last hours). :class:`Pulse` keeps both facts: the loop calls :meth:`beat` at the top of
every iteration and wraps its wait for work in :meth:`waiting`; :meth:`stalled_s` is then
0 while it waits and otherwise the seconds since its last beat. Reading it takes no lock
(two attribute reads; a probe may see a beat a moment late, never a false stall longer
than one iteration).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

#: Seconds a loop may have work without coming round before a liveness probe fails
#: (``jaxpar serve --stall-timeout``).
DEFAULT_STALL_S = 10.0


class Pulse:
    """When a loop last came round, and whether it is waiting for work.

    Args:
        clock: seconds, monotonic (a test passes its own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.last = clock()
        self.idle = True  # not started: nothing to be stuck in

    def beat(self) -> None:
        """The loop came round (call at the top of each iteration)."""
        self.last = self.clock()
        self.idle = False

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The loop waits for work meanwhile (not a stall); it beats when woken."""
        self.idle = True
        try:
            yield
        finally:
            self.beat()

    def stalled_s(self) -> float:
        """Seconds the loop has been busy since it last came round (0 while it waits)."""
        return 0.0 if self.idle else max(self.clock() - self.last, 0.0)
