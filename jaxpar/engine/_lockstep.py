"""Serving from several processes: process 0 schedules, every process dispatches.

A model that spans hosts runs one JAX process per host (``jax.distributed``), and each
process must dispatch the same programs on the same inputs in the same order: a program
is one SPMD computation over every process's devices. Continuous batching decides what
to dispatch from events only process 0 sees (requests arriving over HTTP, clients going
away, tokens drawn), so process 0 runs the :class:`~jaxpar.engine.ContinuousBatcher`,
and its :class:`~jaxpar.engine._executor.Executor` records every command (the host
arrays of a prefill, an insert, a decode step: which requests, tokens, rows and pages,
sampling rows) before dispatching it. :class:`Leader` sends the record to the other
processes, each of which replays it on its own executor (:func:`follow`). Tokens come
back to process 0 only: the others never read a device array.

The record travels through the coordination service's key-value store, the
``jax.distributed`` service every process is already connected to (process 0 hosts it).
Chosen over ``multihost_utils.broadcast_one_to_all`` because a broadcast is itself a
device program: it would queue behind the step in flight on every device, so process 0
could not send step n+1's inputs while step n runs (the overlap the batcher is built
on), it needs the message's size agreed in advance (a second broadcast) and it compiles
per size. A key-value put is one RPC from process 0's host to its own service, and a
replaying process's blocking get returns as soon as the key exists, whatever its
devices are doing. Process 0 sends every command as soon as it is recorded, from a
thread of its own (:class:`Leader`): nothing process 0's scheduling thread does after
dispatching (block in a dispatch, stall on a loaded host) can keep a dispatched
command from the others. What accumulates while a put is in flight goes in the next
message (``scripts/bench.py``'s lockstep row measures the puts against the step). Keys
live under ``jaxpar/lockstep/<epoch>/``; process 0 deletes an epoch two epochs later,
when every process has long read it (a process cannot fall more than a step behind:
each step's collectives wait for it).

Failure: each replaying process writes a heartbeat key every second; process 0's
:class:`Monitor` names a process whose heartbeat stopped for ``lost_after_s`` (default
5 s) and fails the batcher with :class:`~jaxpar.errors.PeerLostError`, so every
request is answered 503 naming it and the server exits non-zero. A replaying process
whose process 0 is gone finds the key-value service gone with it and exits too.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxpar.engine._coordination import coordination_client as _client
from jaxpar.engine._distributed import mark_peer_lost
from jaxpar.engine._executor import Executor, Recorder
from jaxpar.errors import PeerLostError

PREFIX = "jaxpar/lockstep"
ALIVE = "jaxpar/alive"
#: Messages per key directory; process 0 deletes directory e - 2 when it starts e.
EPOCH = 256
#: Seconds between two heartbeats of a replaying process.
HEARTBEAT_S = 1.0
#: Seconds without a heartbeat after which process 0 declares a process lost: well
#: inside the 20-40 s after which JAX's own heartbeats (``heartbeat_timeout_s``, 40 s as
#: ``jaxpar.engine.initialize_distributed`` sets it) end every process, so that clients
#: get their 503 first.
LOST_AFTER_S = 5.0
#: Seconds process 0 waits for a process's first heartbeat (loading a checkpoint may
#: take one host longer than another); JAX's own heartbeats still end a dead one.
START_GRACE_S = 300.0
_STOP = "stop"


def _key(seq: int) -> str:
    return f"{PREFIX}/{seq // EPOCH}/{seq}"


class Leader(Recorder):
    """Process 0's recorder: pickles each command as it is recorded (its arrays may
    change afterwards) and hands it to a sender thread, which puts what has accumulated
    as one message as soon as the previous put returns. :meth:`flush` waits until
    everything recorded has been sent (and raises what a put raised).

    Why a thread: a command must reach the others whatever process 0's scheduling thread
    does next. Sent only when that thread was about to read (the earlier design), a
    dispatched command waited for it, and its collectives timed out on process 0 (CPU:
    15 s) while the others idled in :func:`follow`, if that thread stalled first: a
    dispatch blocks once 32 programs per device are in flight (XLA's CPU client), and a
    loaded host can deschedule it for seconds.

    ``messages``, ``commands``, ``bytes`` and ``seconds`` (in the puts) count what was
    sent, for the benchmark and the logs.
    """

    def __init__(self):
        self._client = _client()
        self._cond = threading.Condition()
        self._pending: list[bytes] = []
        self._sending = False
        self._closed = False
        self._error: BaseException | None = None
        self._seq = 0
        self.messages = self.commands = self.bytes = 0
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._send_loop, name="lockstep", daemon=True)
        self._thread.start()

    def record(self, name: str, args: tuple, kwargs: dict) -> None:
        record = pickle.dumps((name, args, kwargs), pickle.HIGHEST_PROTOCOL)
        with self._cond:
            self._pending.append(record)
            self._cond.notify_all()

    def flush(self) -> None:
        """Returns once every recorded command has been sent.

        Raises:
            JaxRuntimeError: a put failed (process 0's key-value service stopped).
        """
        with self._cond:
            self._cond.wait_for(lambda: self._error or not (self._pending or self._sending))
            if self._error is not None:
                raise self._error

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                batch, self._pending, self._sending = self._pending, [], True
            try:
                self._put(batch)
            except BaseException as e:  # noqa: BLE001 - raised by the next flush()
                with self._cond:
                    self._error, self._sending = e, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._sending = False
                self._cond.notify_all()

    def _put(self, batch: list[bytes]) -> None:
        start = time.perf_counter()
        payload = pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)
        self._client.key_value_set_bytes(_key(self._seq), payload)
        if self._seq % EPOCH == 0 and self._seq >= 2 * EPOCH:
            self._client.key_value_delete(f"{PREFIX}/{self._seq // EPOCH - 2}")
        self._seq += 1
        self.messages += 1
        self.commands += len(batch)
        self.bytes += len(payload)
        self.seconds += time.perf_counter() - start

    def stop(self) -> None:
        """Tells every replaying process to return from :func:`follow`; ends the sender."""
        self.record(_STOP, (), {})
        try:
            self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()


def follow(executor: Executor, *, poll_ms: int = 1000) -> int:
    """Replays process 0's commands on ``executor`` until process 0 says stop; returns
    the number of commands replayed.

    Raises:
        PeerLostError: process 0 (and its key-value service) is gone.
    """
    client, seq, replayed = _client(), 0, 0
    while True:
        payload = _get(client, _key(seq), poll_ms)
        seq += 1
        for record in pickle.loads(payload):
            name, args, kwargs = pickle.loads(record)
            if name == _STOP:
                return replayed
            executor.replay(name, args, kwargs)
            replayed += 1


def _get(client, key: str, poll_ms: int) -> bytes:
    """The value of ``key`` once process 0 sets it; polls so that a lost service shows."""
    while True:
        try:
            return client.blocking_key_value_get_bytes(key, poll_ms)
        except jax.errors.JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                continue  # nothing yet: process 0 is idle
            mark_peer_lost()
            raise PeerLostError(
                f"process {jax.process_index()} lost process 0 (its coordination service "
                f"stopped answering: {str(e).splitlines()[0]}); exiting"
            ) from e


class Heartbeat:
    """A replaying process's heartbeat key, rewritten every :data:`HEARTBEAT_S` by a
    thread from :meth:`start` (as soon as the process has a batcher: loading and
    compiling take as long on every process, and it must not look lost meanwhile)."""

    def __init__(self):
        self._client, self._stop = _client(), threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)

    def _beat(self) -> None:
        key, n = f"{ALIVE}/{jax.process_index()}", 0
        while not self._stop.is_set():
            n += 1
            try:
                self._client.key_value_set(key, str(n), allow_overwrite=True)
            except jax.errors.JaxRuntimeError:
                return  # the service is gone: follow() finds out at its next get
            self._stop.wait(HEARTBEAT_S)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()


class Monitor:
    """Process 0's watch over the other processes' heartbeats: calls ``on_lost(error)``
    once, with a :class:`PeerLostError` naming every process whose heartbeat stopped for
    ``lost_after_s``, or that has not sent its first within :data:`START_GRACE_S` of
    :meth:`start` (processes load and reach their batcher at different times).

    ``client`` (the coordination service's, by default), ``processes`` (the job's) and
    ``clock`` (``time.monotonic``) can be replaced, so the policy runs without a job:
    :meth:`arm` and :meth:`poll` are what the watch thread does, one look at a time.
    """

    def __init__(
        self,
        on_lost: Callable[[PeerLostError], Any],
        lost_after_s: float = LOST_AFTER_S,
        *,
        client: Any = None,
        processes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._client = client if client is not None else _client()
        self._on_lost, self.lost_after_s = on_lost, lost_after_s
        self._processes = processes if processes is not None else jax.process_count()
        self._clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="monitor", daemon=True)
        self._seen: dict[int, tuple[Any, float]] = {}
        self.lost: list[int] = []

    def start(self) -> Monitor:
        self.arm()
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def arm(self) -> None:
        """Every other process counted as not heard from yet, as of now: the start grace
        begins."""
        now = self._clock()
        self._seen = {pid: (None, now) for pid in range(1, self._processes)}

    def poll(self) -> list[int]:
        """One look at the heartbeats: the processes lost (empty: none). The first time
        some are, marks the peer lost and calls ``on_lost``; never again after."""
        if self.lost:
            return self.lost
        beats = dict(self._client.key_value_dir_get(ALIVE + "/"))
        now = self._clock()
        for pid, (value, _) in list(self._seen.items()):
            current = beats.get(f"{ALIVE}/{pid}")
            if current != value:
                self._seen[pid] = (current, now)
        lost = [
            pid
            for pid, (value, since) in self._seen.items()
            if now - since > (self.lost_after_s if value is not None else START_GRACE_S)
        ]
        if lost:
            self.lost = lost
            mark_peer_lost()
            self._on_lost(lost_error(lost, self._processes, self.lost_after_s))
        return lost

    def _watch(self) -> None:
        while not self._stop.wait(HEARTBEAT_S / 2):
            if self.poll():
                return


def lost_error(lost: list[int], n: int, after_s: float) -> PeerLostError:
    """The error every request gets once processes ``lost`` stopped answering."""
    which = ", ".join(map(str, lost))
    return PeerLostError(
        f"process{'es' if len(lost) > 1 else ''} {which} of {n} stopped answering (no "
        f"heartbeat for {after_s:.0f} s): the model spans every process, so this server "
        "cannot run it any more; restart all processes"
    )


def announce_ready() -> None:
    """A replaying process has compiled its programs (after its warm-up)."""
    _client().key_value_set(f"jaxpar/ready/{jax.process_index()}", "1")


def wait_ready(timeout_s: float = 3600.0) -> None:
    """Process 0: waits until every other process has compiled its programs, so no
    collective of a served request waits on a process still compiling (a CPU
    collective gives up after ``cpu_collective_timeout_s``)."""
    client = _client()
    for pid in range(1, jax.process_count()):
        client.blocking_key_value_get(f"jaxpar/ready/{pid}", int(timeout_s * 1000))
