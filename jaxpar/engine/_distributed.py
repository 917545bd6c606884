"""Multi-process start-up: one call on every process, before any other JAX call.

jaxpar needs nothing special after ``jax.distributed.initialize``: ``make_mesh`` spans
``jax.devices()`` (every process's devices), inputs become global arrays built from the
host copy every process holds, and what the engine hands back to the host (generated and
streamed tokens) is gathered to every process, so every process gets the same result.

What :func:`initialize` adds over calling ``jax.distributed.initialize`` directly:

* CPU runs use gloo collectives over TCP, and ``local_device_count`` simulates devices;
* failure detection tuned for inference rather than week-long training: a peer that stops
  sending heartbeats is declared dead after ``heartbeat_timeout_s`` (JAX: 100 s), and a CPU
  collective gives up after ``cpu_collective_timeout_s`` (XLA: far longer);
* every process reads and writes the persistent compile cache (JAX: process 0 only), in
  a directory of its own (:mod:`jaxpar.engine._compile_cache`);
* a worker that cannot reach the coordinator gets :class:`DistributedError` instead of
  JAX aborting the process;
* after :class:`PeerLostError` the process exits without waiting at JAX's shutdown
  barrier, which can never complete and would end in an abort with a long log.

How a dead peer ends the survivors (times measured with the defaults, 2 processes on one
machine), whichever comes first:

1. a collective the survivor is in fails, and :func:`peer_failures` turns the runtime
   error into :class:`PeerLostError` (exit status :data:`PEER_LOST_EXIT_STATUS`): on CPU
   ``cpu_collective_timeout_s`` after the collective started (about 15 s), or at once when
   the peer's connection is reset mid-transfer; a survivor still setting up the gloo
   connections gives up after gloo's fixed 30 s;
2. the coordination service misses the peer's heartbeats (sent every half timeout) and,
   between ``heartbeat_timeout_s / 2`` and ``heartbeat_timeout_s`` after the death, JAX
   terminates every other process (``SIGABRT``) with "Terminating process because the JAX
   distributed service detected fatal errors ... The following tasks are unhealthy
   (stopped sending heartbeats): <ids>". This also ends a survivor that is not in a
   collective at all.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import re
import socket
import sys
import time
from collections.abc import Iterator, Sequence

import jax

from jaxpar.engine._compile_cache import cache_every_process
from jaxpar.errors import DistributedError, PeerLostError


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in the job (what :func:`initialize` returns)."""

    process_id: int
    num_processes: int
    local_devices: int
    global_devices: int


#: Exit status of a process that leaves after a :class:`PeerLostError` (EX_TEMPFAIL: the
#: job can be restarted as it is).
PEER_LOST_EXIT_STATUS = 75
_peer_lost = False

# Runtime errors that mean "a peer is gone", from gloo and the coordination service.
_PEER_LOST = re.compile(
    r"Connection (closed|reset) by peer|Gloo .* failed|Broken pipe|timed out|"
    r"DEADLINE_EXCEEDED|unhealthy|stopped sending heartbeats|UNAVAILABLE",
    re.IGNORECASE,
)


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    heartbeat_timeout_s: int = 40,
    cpu_collective_timeout_s: int | None = 15,
    initialization_timeout_s: int = 300,
    shutdown_timeout_s: int = 30,
) -> ProcessInfo:
    """Joins this process to a multi-process JAX job (call once, first, on every process).

    Args:
        coordinator: ``host:port`` of process 0, where it starts the coordination service
            and every process connects. All three of ``coordinator``, ``num_processes``
            and ``process_id`` left ``None``: JAX detects the cluster (Cloud TPU, SLURM,
            Open MPI, Kubernetes).
        num_processes: processes in the job.
        process_id: this process, ``0 <= process_id < num_processes``.
        local_device_count: CPU only: simulated devices of this process (JAX's
            ``jax_num_cpu_devices``, which wins over ``XLA_FLAGS``); GPU and TPU ignore it.
        local_device_ids: GPU only: which local devices this process uses.
        heartbeat_timeout_s: a process that sends no heartbeat for this long is declared
            dead and JAX terminates the others. The heartbeats come from a background
            thread, so compiling or a long step does not delay them.
        cpu_collective_timeout_s: CPU only: a collective that waits longer than this for
            its peers fails (:class:`PeerLostError` under :func:`peer_failures`). It must
            exceed how far apart the processes reach the same step (mostly compilation),
            so large models on CPU need more. ``None`` keeps XLA's default, and a
            ``--xla_cpu_collective_timeout_seconds`` already in ``XLA_FLAGS`` wins.
        initialization_timeout_s: how long to wait for every process to connect.
        shutdown_timeout_s: how long a finishing process waits for the others at exit.

    Returns:
        This process's id, the number of processes, local and global device counts.

    Raises:
        DistributedError: called twice or after JAX started its backends, invalid
            arguments, or (process ``> 0``) the coordinator did not answer within
            ``initialization_timeout_s``. Process 0 waiting in vain for the others is
            terminated by JAX itself ("DEADLINE_EXCEEDED ... RegisterTask").
    """
    _check_not_started()
    _check_timeouts(
        heartbeat_timeout_s=heartbeat_timeout_s,
        initialization_timeout_s=initialization_timeout_s,
        shutdown_timeout_s=shutdown_timeout_s,
        cpu_collective_timeout_s=cpu_collective_timeout_s,
    )
    _configure_cpu(local_device_count, cpu_collective_timeout_s)
    if coordinator is not None and process_id:
        # JAX aborts the whole process when it cannot register with the coordinator;
        # probing the port first turns the usual mistake into an exception.
        _wait_for_coordinator(coordinator, process_id, initialization_timeout_s)
    try:
        jax.distributed.initialize(
            coordinator,
            num_processes,
            process_id,
            local_device_ids=local_device_ids,
            initialization_timeout=initialization_timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
            shutdown_timeout_seconds=shutdown_timeout_s,
        )
    except (ValueError, TypeError, RuntimeError) as e:  # argument checks, cluster detection
        raise DistributedError(f"invalid distributed set-up: {e}") from e
    cache_every_process()  # this process's own compile cache entries, read and written

    # Registered after JAX's own exit hook, so it runs first (atexit is last in, first out).
    atexit.register(_exit_after_peer_loss)
    return ProcessInfo(
        process_id=jax.process_index(),
        num_processes=jax.process_count(),
        local_devices=jax.local_device_count(),
        global_devices=jax.device_count(),
    )


def _check_not_started() -> None:
    from jax._src import xla_bridge  # no public "have the backends started?" query

    if jax.distributed.is_initialized():
        raise DistributedError("jax.distributed is already initialized in this process")
    if xla_bridge.backends_are_initialized():
        raise DistributedError(
            "the distributed initialize must run before any other JAX call in this process "
            "(jax.devices(), an array, a jit): JAX has already started its backends"
        )


def _check_timeouts(**timeouts: int | None) -> None:
    for name, value in timeouts.items():
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise DistributedError(f"{name} must be an int >= 1, got {value!r}")


def _configure_cpu(local_device_count: int | None, cpu_collective_timeout_s: int | None) -> None:
    """CPU backend settings: harmless on GPU/TPU, which do not read them."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", int(local_device_count))
    if cpu_collective_timeout_s is not None:
        _set_xla_flag("xla_cpu_collective_timeout_seconds", cpu_collective_timeout_s)


@contextlib.contextmanager
def peer_failures() -> Iterator[None]:
    """Turns a runtime error caused by a lost peer process into :class:`PeerLostError`.

    Wrap the engine calls of a multi-process job in it. Errors that do not look like a lost
    peer pass through unchanged; so does everything in a single-process run. Once it has
    raised, the process exits with :data:`PEER_LOST_EXIT_STATUS` at interpreter exit.
    """
    global _peer_lost
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() == 1 or not _PEER_LOST.search(str(e)):
            raise
        _peer_lost = True
        raise PeerLostError(
            f"process {jax.process_index()} of {jax.process_count()} lost contact with a "
            f"peer process during a collective: {_first_line(e)}. Another process of the "
            "job probably died; see its log. Restart all processes."
        ) from e


def mark_peer_lost() -> None:
    """This process lost a peer: at exit, leave without JAX's shutdown barrier (with
    :data:`PEER_LOST_EXIT_STATUS`)."""
    global _peer_lost
    _peer_lost = True


def _exit_after_peer_loss() -> None:
    """At exit after a lost peer: skip JAX's shutdown barrier, which cannot complete.

    Without this the process would wait ``shutdown_timeout_s`` at the barrier and then be
    aborted by the coordination client with a long log that buries the real error.
    """
    if _peer_lost:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(PEER_LOST_EXIT_STATUS)


def _wait_for_coordinator(address: str, process_id: int, timeout_s: int) -> None:
    """Retries a TCP connection to ``host:port`` until it succeeds or ``timeout_s`` passes."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise DistributedError(f"coordinator address {address!r} is not host:port")
    host = host.strip("[]")  # IPv6 literal
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"process {process_id} could not reach the coordinator at {address} within "
                    f"{timeout_s} s ({e}); start process 0 with the same address and port, "
                    "and check that this host can reach it"
                ) from e
            time.sleep(0.5)


def _set_xla_flag(name: str, value: int) -> None:
    """Adds ``--name=value`` to ``XLA_FLAGS`` unless ``name`` is already set there.

    XLA reads the variable when the backend starts, which is after this call.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if f"--{name}=" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{name}={value}".strip()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
