"""What a prefill costs by its shape, measured: the budget between decode steps in time.

A prefill's time on the XLA paged path grows with the cached context its new tokens
attend to, not only with the new tokens: on CPU the serving benchmarks' 4-layer model
took 8.5 ms for 64 new tokens alone and 76 ms for the same 64 after 4,096 cached ones
(the context is read from pages and scored as a ``[T, C + T]`` block).
A budget of new tokens lets a long prompt's late pieces stall the running streams many
times longer than its first ones. :class:`ChunkCost` holds the measured time of each
prefill shape (rows, padded new tokens, padded cached positions), taken on this backend
while the batcher is idle after its warm-up (:meth:`jaxpar.engine.ContinuousBatcher.warmup`),
and a least-squares fit over them for shapes not measured. The scheduler
(:mod:`jaxpar.engine._scheduler`) sizes a long prompt's pieces by it: the most new tokens
whose prefill costs no more than the budget's own (``max_prefill_tokens`` new tokens
without context). Plain Python: no devices.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from jaxpar.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ChunkCost:
    """Milliseconds of prefills by shape.

    Attributes:
        measured: ``(rows, tokens, context, ms)`` per measured shape: ``rows x tokens``
            new tokens (padded) after ``context`` cached positions (padded; 0: none).
    """

    measured: tuple[tuple[int, int, int, float], ...]

    def __post_init__(self) -> None:
        if not self.measured:
            raise ConfigError("ChunkCost needs at least one measured prefill shape")
        for rows, tokens, context, ms in self.measured:
            if rows < 1 or tokens < 1 or context < 0 or not ms >= 0:
                raise ConfigError(
                    f"ChunkCost: a measured shape needs rows, tokens >= 1, context >= 0 and "
                    f"ms >= 0; got ({rows}, {tokens}, {context}, {ms})"
                )

    @classmethod
    def of(cls, samples: Sequence[tuple[int, int, int, float]]) -> ChunkCost:
        """From samples, several of one shape kept as their median."""
        by: dict[tuple[int, int, int], list[float]] = {}
        for rows, tokens, context, ms in samples:
            by.setdefault((rows, tokens, context), []).append(ms)
        return cls(tuple((*k, float(np.median(v))) for k, v in sorted(by.items())))

    @functools.cached_property
    def _table(self) -> dict[tuple[int, int, int], float]:
        return {(r, t, c): ms for r, t, c, ms in self.measured}

    @functools.cached_property
    def coefficients(self) -> tuple[float, float, float]:
        """``(a, b, c)`` of the fit ``ms = a + b * rows * tokens + c * rows * tokens *
        (context + tokens)`` (least squares, each >= 0) over the measured shapes."""
        x = np.array([(1.0, r * t, r * t * (c + t)) for r, t, c, _ in self.measured])
        y = np.array([ms for *_, ms in self.measured])
        keep = [0, 1, 2]
        while True:  # drop a negative coefficient and fit again (non-negative least squares)
            coef = np.zeros(3)
            coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
            negative = [i for i in keep if coef[i] < 0]
            if not negative:
                return tuple(float(v) for v in coef)
            keep.remove(min(negative, key=lambda i: coef[i]))

    def ms(self, rows: int, tokens: int, context: int) -> float:
        """A prefill's milliseconds: measured, else the fit's."""
        got = self._table.get((rows, tokens, context))
        if got is not None:
            return got
        a, b, c = self.coefficients
        return a + b * rows * tokens + c * rows * tokens * (context + tokens)
