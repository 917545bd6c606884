"""Counting the assignments a capacity-limited MoE drops, per traced step.

The MoE layer :func:`record_dropped` its per-shard drop counts while a step is traced; the
engine opens :func:`count_dropped` around the traced body and returns the total as one
more output of the step, so drops are reported, never silent. Nothing is recorded in
dropless mode (nothing can drop), and nothing is counted where no collector is open.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

_COLLECTOR: contextvars.ContextVar[list[jax.Array] | None] = contextvars.ContextVar(
    "jaxpar_moe_dropped", default=None
)


@contextlib.contextmanager
def count_dropped() -> Iterator[list[jax.Array]]:
    """Collects the drop counts recorded while tracing inside; sum them with
    :func:`total_dropped` in the same trace (a loop body opens its own)."""
    token = _COLLECTOR.set([])
    try:
        yield _COLLECTOR.get()
    finally:
        _COLLECTOR.reset(token)


def record_dropped(count: jax.Array) -> None:
    """Adds one layer's drop counts (any shape; summed) to the open collector, if any."""
    collected = _COLLECTOR.get()
    if collected is not None:
        collected.append(count)


def total_dropped(collected: list[jax.Array]) -> jax.Array:
    """The int32 sum of everything collected (0 if nothing was).

    Counts of one shape are added elementwise first (same sharding, no collective), so the
    one cross-device sum happens once per step.
    """
    if not collected:
        return jnp.zeros((), jnp.int32)
    first = collected[0]
    if all(c.shape == first.shape for c in collected):
        # Flattened first: summing a [batch shards, seq shards] array dimension by
        # dimension makes XLA all-reduce twice (once per mesh axis).
        return jnp.sum(sum(collected[1:], first).reshape(-1), dtype=jnp.int32)
    return sum((jnp.sum(c, dtype=jnp.int32) for c in collected), jnp.zeros((), jnp.int32))
