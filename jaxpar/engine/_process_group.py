"""The batcher's side of a multi-process job (:mod:`jaxpar.engine._lockstep`).

:class:`ProcessGroup` holds what one process of the job runs besides the batcher's loops:
on process 0, the :class:`~jaxpar.engine._lockstep.Leader` that sends the executor's
commands to the others and the :class:`~jaxpar.engine._lockstep.Monitor` that watches
their heartbeats; on every other process, its heartbeat, and :meth:`~ProcessGroup.follow`
(replaying process 0's commands). One process alone has none of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax

from jaxpar.engine._distributed import peer_failures
from jaxpar.engine._executor import Executor
from jaxpar.engine._lockstep import HEARTBEAT_S, Heartbeat, Leader, Monitor, follow, lost_error
from jaxpar.errors import PeerLostError


class ProcessGroup:
    """This process's part in a multi-process job (nothing when alone).

    ``replays``: a process other than 0 (it replays, never schedules)."""

    def __init__(self):
        self.index = jax.process_index()
        self.replays = self.index != 0
        multi = jax.process_count() > 1
        #: Process 0 of a multi-process job: sends the executor's commands to the others.
        self.leader = Leader() if multi and not self.replays else None
        self.monitor: Monitor | None = None
        self._heartbeat = Heartbeat().start() if multi and self.replays else None

    def watch(self, fail: Callable[[PeerLostError], object]) -> None:
        """Process 0: calls ``fail`` if another process's heartbeat stops."""
        if self.leader is not None:
            self.monitor = Monitor(fail).start()

    def guard(
        self, loop: Callable[[], None], fail: Callable[[BaseException], object], failed
    ) -> Callable[[], None]:
        """``loop``, run so that an exception in it calls ``fail`` with it (a lost process
        named, when the heartbeats tell which: :meth:`lost`; ``failed()``: the batcher
        already failed, stop waiting for that)."""

        def run() -> None:
            try:
                with peer_failures():
                    loop()
            except PeerLostError as e:
                fail(self.lost(e, failed))
            except BaseException as e:  # noqa: BLE001 - reported to every waiting client
                fail(e)

        return run

    def follow(self, executor: Executor) -> int:
        """Replays process 0's commands until it stops (returns how many)."""
        try:
            with peer_failures():
                return follow(executor)
        finally:
            if self._heartbeat is not None:
                self._heartbeat.close()

    def lost(self, error: PeerLostError, failed: Callable[[], bool]) -> PeerLostError:
        """A collective failed for a lost process: the monitor's verdict if it comes
        within its timeout (it names the process; ``failed``: stop waiting), else
        ``error``."""
        monitor = self.monitor
        if monitor is None:
            return error
        deadline = time.monotonic() + monitor.lost_after_s + 2 * HEARTBEAT_S
        while not monitor.lost and time.monotonic() < deadline and not failed():
            time.sleep(0.1)
        if monitor.lost:
            return lost_error(monitor.lost, jax.process_count(), monitor.lost_after_s)
        return error

    def stats(self) -> dict[str, float] | None:
        """Process 0: what it sent the others (messages, the commands in them, bytes,
        seconds in the puts); None otherwise."""
        lead = self.leader
        if lead is None:
            return None
        return {
            "processes": jax.process_count(),
            "messages": lead.messages,
            "commands": lead.commands,
            "bytes": lead.bytes,
            "seconds": lead.seconds,
        }

    def close(self, failed: bool) -> None:
        """Stops watching; unless the job failed, the other processes return from
        :meth:`follow`."""
        if self.monitor is not None:
            self.monitor.close()
        if self.leader is not None and not failed:
            self.leader.stop()
