"""The multi-process Monitor (process 0's lost-peer detection), with a fake coordination
client and a fake clock: no processes, no waiting.

Each replaying process rewrites its heartbeat key (``jaxpar/alive/<pid>``) every second;
the Monitor names a process whose value has not changed for ``lost_after_s``, or that has
sent none within ``START_GRACE_S`` of the start, and calls ``on_lost`` once with a
:class:`PeerLostError` naming every such process. While the values keep changing it must
never fire, however long it watches.
"""

from __future__ import annotations

import threading

import pytest

from jaxpar.engine import _distributed
from jaxpar.engine._lockstep import ALIVE, HEARTBEAT_S, START_GRACE_S, Monitor
from jaxpar.errors import PeerLostError


class FakeClient:
    """The coordination service's key-value directory of heartbeats."""

    def __init__(self):
        self.beats: dict[int, int] = {}
        self.reads = 0

    def beat(self, *pids: int) -> None:
        for pid in pids:
            self.beats[pid] = self.beats.get(pid, 0) + 1

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        assert prefix == ALIVE + "/"
        self.reads += 1
        return [(f"{ALIVE}/{pid}", str(n)) for pid, n in self.beats.items()]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def _no_exit_after_the_test(monkeypatch):
    """Firing marks the process as having lost a peer (it would then exit at once at
    interpreter exit): keep that flag as it was."""
    monkeypatch.setattr(_distributed, "_peer_lost", _distributed._peer_lost)


def _monitor(processes: int = 4, lost_after_s: float = 5.0):
    client, clock, errors = FakeClient(), FakeClock(), []
    monitor = Monitor(errors.append, lost_after_s, client=client, processes=processes, clock=clock)
    monitor.arm()
    return monitor, client, clock, errors


def _run(monitor, client, clock, seconds: float, beating=()) -> list[int]:
    """Polls every half heartbeat for ``seconds`` (fake), the ``beating`` processes
    beating every heartbeat; the processes the last poll names (empty: none)."""
    lost: list[int] = []
    for i in range(int(seconds / (HEARTBEAT_S / 2))):
        if i % 2 == 0:
            client.beat(*beating)
        clock.now += HEARTBEAT_S / 2
        lost = monitor.poll()
    return lost


def test_never_fires_while_every_heartbeat_changes():
    monitor, client, clock, errors = _monitor()
    # An hour of fake time, far past the timeout and the start grace.
    assert _run(monitor, client, clock, 3600.0, beating=(1, 2, 3)) == []
    assert errors == [] and monitor.lost == []
    assert client.reads == 7200


def test_a_heartbeat_that_stops_changing_fires_after_the_timeout():
    monitor, client, clock, errors = _monitor(lost_after_s=5.0)
    assert _run(monitor, client, clock, 30.0, beating=(1, 2, 3)) == []
    # Process 2 stops: its value stays what it was. Not lost at 4.5 s, lost by 5.5 s.
    assert _run(monitor, client, clock, 4.5, beating=(1, 3)) == []
    assert errors == []
    assert _run(monitor, client, clock, 1.0, beating=(1, 3)) == [2]
    assert monitor.lost == [2]
    assert len(errors) == 1 and isinstance(errors[0], PeerLostError)
    assert "process 2 of 4 stopped answering" in str(errors[0])
    assert "no heartbeat for 5 s" in str(errors[0])
    # It fires once: later polls do not call on_lost again.
    _run(monitor, client, clock, 30.0, beating=(1,))
    assert len(errors) == 1


@pytest.mark.parametrize("lost_after_s", [2.0, 12.0])
def test_the_timeout_is_lost_after_s(lost_after_s):
    monitor, client, clock, errors = _monitor(processes=2, lost_after_s=lost_after_s)
    _run(monitor, client, clock, 10.0, beating=(1,))
    assert _run(monitor, client, clock, lost_after_s - 0.5) == []
    assert _run(monitor, client, clock, 1.0) == [1]
    assert f"no heartbeat for {lost_after_s:.0f} s" in str(errors[0])


def test_start_grace_for_a_first_heartbeat():
    """A process that has not beaten yet (still loading) has START_GRACE_S, not the
    timeout; one that never beats is named after it, together with any other lost."""
    monitor, client, clock, errors = _monitor(processes=3, lost_after_s=5.0)
    assert _run(monitor, client, clock, START_GRACE_S - 1.0, beating=(1,)) == []
    assert errors == []
    assert _run(monitor, client, clock, 2.0, beating=(1,)) == [2]
    assert "process 2 of 3" in str(errors[0])
    # Two silent from the start: both named in one error.
    monitor, client, clock, errors = _monitor(processes=3)
    assert _run(monitor, client, clock, START_GRACE_S + 1.0) == [1, 2]
    assert len(errors) == 1 and "processes 1, 2 of 3" in str(errors[0])


def test_a_late_first_heartbeat_then_the_timeout():
    """The first beat inside the grace starts the ordinary timeout from the poll that
    sees it (half a heartbeat later)."""
    monitor, client, clock, errors = _monitor(processes=2, lost_after_s=5.0)
    assert _run(monitor, client, clock, 100.0) == []
    client.beat(1)
    assert _run(monitor, client, clock, 5.0) == []
    assert _run(monitor, client, clock, 1.0) == [1]


def test_the_watch_thread_fires_and_stops():
    """start() polls from a thread every half heartbeat; close() ends it."""
    client, clock, fired = FakeClient(), FakeClock(), threading.Event()
    errors: list[PeerLostError] = []

    def on_lost(error):
        errors.append(error)
        fired.set()

    monitor = Monitor(on_lost, 5.0, client=client, processes=2, clock=clock).start()
    clock.now += START_GRACE_S + 1.0  # the fake clock jumps past the grace
    assert fired.wait(10 * HEARTBEAT_S)
    assert monitor.lost == [1] and len(errors) == 1
    monitor.close()

    quiet = Monitor(on_lost, 5.0, client=FakeClient(), processes=2, clock=FakeClock()).start()
    quiet.close()
    quiet._thread.join(5 * HEARTBEAT_S)
    assert not quiet._thread.is_alive()
    assert len(errors) == 1
