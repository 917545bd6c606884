"""Readiness and liveness: what ``GET /health`` and ``GET /live`` answer a fleet.

A Kubernetes deployment asks two questions. *Readiness* (``GET /health``): can this server
take a request now? Only once it is warmed up, while every process of a multi-process
job is there, the decode loop runs and is not stuck, and it is not shutting down; a
router or Service sends requests only to ready pods. *Liveness* (``GET /live``): should
the pod be restarted? Only when waiting cannot help: a lost process (a multi-process job
cannot go on without it; LeaderWorkerSet then recreates the whole group), an engine that
failed, a decode loop that died, a warm-up that failed, or a decode loop that has had work
and not come round for more than ``stall_s`` seconds (a step or collective that never
returns). A server warming up or draining is alive.

The stall is read from the batcher's heartbeat (:class:`~jaxpar.engine.Pulse`): the loop
beats at every iteration and is idle, not stuck, while it waits for requests. A compile is
not a stall either (a step may wait for a program on first use, minutes for a large model
on an accelerator): while a lazy warm-up still compiles in the background, or any program
is being compiled, no stall is counted, and one counts from the later of the loop's last
beat and the last compile's end. A lost process is known within the
heartbeat monitor's 5 s, and both probes fail from then on.
"""

from __future__ import annotations

from typing import Any

from jaxpar.engine import DEFAULT_STALL_S
from jaxpar.errors import PeerLostError
from jaxpar.server._errors import APIError

__all__ = ["DEFAULT_STALL_S", "dead", "live", "not_ready", "stalled_s"]


def stalled_s(batcher) -> float:
    """Seconds the batcher's decode loop has been busy since it last came round (0 while
    it waits for work, or while a lazy warm-up may make a step wait for a compile)."""
    pulse = getattr(batcher, "pulse", None)
    if pulse is None:
        return 0.0
    warming = getattr(batcher, "warming", None)
    if warming is not None and not warming.finished:
        return 0.0
    steps = [e.steps for e in {id(e): e for e in _engines(batcher)}.values()]
    if any(s.compiling for s in steps):
        return 0.0
    since_compile = pulse.clock() - max((s.compiled_at for s in steps), default=0.0)
    return min(pulse.stalled_s(), max(since_compile, 0.0))


def _engines(batcher) -> list:
    """The batcher's decode and prefill engines (either may be absent in a test double)."""
    return [e for e in (getattr(batcher, a, None) for a in ("engine", "prefill_engine")) if e]


def dead(service, stall_s: float) -> str | None:
    """Why the server should be restarted (``GET /live`` 503), or None: it is alive."""
    batcher = service.batcher
    failure = batcher.failure
    if isinstance(failure, PeerLostError):
        return str(failure)
    if failure is not None:
        return f"the engine failed: {failure!r}"
    if service.warmup_error is not None:
        return f"warmup failed: {service.warmup_error!r}"
    if not service.closing and not getattr(batcher, "running", True):
        return "the decode loop is not running"
    stalled = stalled_s(batcher)
    if stalled > stall_s:
        return (
            f"the decode loop has had work for {stalled:.1f} s without finishing a step "
            f"(the limit is {stall_s:g} s)"
        )
    return None


def not_ready(service, stall_s: float) -> str | None:
    """Why no request can be served now (``GET /health`` 503), or None: ready. Whatever
    makes the server dead makes it unready at once (a lost process included)."""
    try:
        service.check_available()
    except APIError as e:
        return e.message
    return dead(service, stall_s)


def live(service, stall_s: float) -> tuple[int, dict[str, Any]]:
    """``GET /live``'s status code and body."""
    problem = dead(service, stall_s)
    if problem is not None:
        return 503, {"status": problem}
    return 200, {"status": "ok", "stalled_s": round(stalled_s(service.batcher), 3)}
