"""The demo's check of a sharded run against one device, honest about precision.

float32: the greedy tokens must be identical. Lower precision (bfloat16, float16): sums in
a different order (a split reduction, an all-reduce) round differently, so a near-tie
between two tokens (or, in an MoE layer, between two experts) can flip and that sequence
goes on another path. Neither low-precision run is the exact answer; float32 is. So the
check is on the logits, teacher-forced (every engine is fed the one-device tokens): the
sharded run's mean |error| against a one-device float32 run must be within
:data:`ERROR_FACTOR` times the one-device low-precision run's. Token agreement is reported
as measured, with the one-device logit gap between the two tokens where a sequence diverges.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxpar.engine import InferenceEngine, to_host

#: A sharded low-precision run passes when its mean |logit error| against float32 is at
#: most this many times the one-device low-precision run's (rounding in another order is
#: of the same size; a wrong sharding is off by the logits' own scale, orders more).
ERROR_FACTOR = 3.0


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The verdict and what it rests on."""

    ok: bool
    rows: int
    rows_identical: int
    divergences: tuple[tuple[int, int, float | None], ...]  # (row, step, 1-device logit gap)
    sharded_error: float | None = None  # mean |logits - float32 logits| (low precision only)
    single_error: float | None = None
    max_abs_diff: float | None = None  # max |sharded - 1 device| logits, for information

    def lines(self, dtype: str) -> list[str]:
        out = [
            f"tokens: {self.rows_identical} of {self.rows} sequences identical to the "
            "single-device run"
        ]
        for row, step, gap in self.divergences:
            near = (
                ""
                if gap is None
                else f"; there the 1-device logits of the two tokens differ by {gap:.4g}"
            )
            out.append(f"  sequence {row} first differs at new token {step}{near}")
        if self.sharded_error is not None:
            ratio = self.sharded_error / self.single_error if self.single_error else float("inf")
            out.append(
                f"logits ({dtype}, teacher-forced on the 1-device tokens, every step), mean "
                f"|error| against 1-device float32: sharded {self.sharded_error:.4g}, 1 device "
                f"{self.single_error:.4g} (ratio {ratio:.2f}; tolerance: ratio <= {ERROR_FACTOR:g}); "
                f"max |sharded - 1 device| {self.max_abs_diff:.4g}"
            )
        return out


def first_divergence(got: Sequence[int], want: Sequence[int]) -> int | None:
    for step, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return step
    return None if len(got) == len(want) else min(len(got), len(want))


def compare_exact(tokens: list[list[int]], reference: list[list[int]]) -> Comparison:
    """float32: every sequence's tokens identical."""
    divergences = tuple(
        (row, step, None)
        for row, (got, want) in enumerate(zip(tokens, reference, strict=True))
        if (step := first_divergence(got, want)) is not None
    )
    return Comparison(
        ok=not divergences,
        rows=len(tokens),
        rows_identical=len(tokens) - len(divergences),
        divergences=divergences,
    )


def compare_to_float32(
    tokens: list[list[int]],
    reference: list[list[int]],
    logits_NBV: np.ndarray,
    reference_logits_NBV: np.ndarray,
    float32_logits_NBV: np.ndarray,
    factor: float = ERROR_FACTOR,
) -> Comparison:
    """Lower precision: the sharded logits as close to float32 as the one-device ones.

    ``*_NBV[s, b]`` are the logits from which new token ``s`` of sequence ``b`` is chosen,
    every engine fed the reference tokens before it (:func:`teacher_forced_logits`).
    """
    rows = len(tokens)
    got, single, exact = (
        np.asarray(x, np.float32)[:, :rows]
        for x in (logits_NBV, reference_logits_NBV, float32_logits_NBV)
    )
    sharded_error = float(np.mean(np.abs(got - exact)))
    single_error = float(np.mean(np.abs(single - exact)))
    divergences = []
    for row, (mine, ref) in enumerate(zip(tokens, reference, strict=True)):
        step = first_divergence(mine, ref)
        if step is None:
            continue
        gap = None
        if step < min(len(mine), len(ref), single.shape[0]):
            gap = float(single[step, row, ref[step]] - single[step, row, mine[step]])
        divergences.append((row, step, gap))
    return Comparison(
        ok=sharded_error <= factor * single_error + 1e-6,
        rows=rows,
        rows_identical=rows - len(divergences),
        divergences=tuple(divergences),
        sharded_error=sharded_error,
        single_error=single_error,
        max_abs_diff=float(np.max(np.abs(got - single))),
    )


def teacher_forced_logits(
    engine: InferenceEngine, prompts: list[list[int]], tokens: list[list[int]]
) -> np.ndarray:
    """``[N, B, V]``: the logits of every new token when the engine is fed ``tokens``.

    Step 0 is prefill's last position; step ``s`` is the decode step fed token ``s - 1``.
    """
    n_steps = min(len(t) for t in tokens)
    tokens_BT, lengths_B = engine.pad_prompts(prompts)
    logits_BV, cache, _ = engine.prefill(tokens_BT, lengths_B)
    out = [to_host(logits_BV)]
    for step in range(1, n_steps):
        fed_B = np.zeros(engine.max_batch, np.int32)
        fed_B[: len(tokens)] = [t[step - 1] for t in tokens]
        logits_BV, cache = engine.decode(cache, fed_B)
        out.append(to_host(logits_BV))
    return np.stack(out)
