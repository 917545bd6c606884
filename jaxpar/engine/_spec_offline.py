"""Offline generation with speculative decoding: prompts served by a continuous batcher.

``InferenceEngine.generate`` decodes a fixed batch in lockstep; speculation changes each
row's tokens per step, which the continuous batcher's rows already handle. So
:func:`generate_speculative` serves the prompts through a
:class:`~jaxpar.engine.ContinuousBatcher` with the configuration, as ``jaxpar run
--speculative-config`` does: greedy tokens equal ``generate``'s; a sampled prompt ``i``
draws as a served request with seed ``seed + i`` (the same distribution, other draws).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from jaxpar.engine._batching import ContinuousBatcher
from jaxpar.engine._engine import Generation, InferenceEngine
from jaxpar.engine._sampling import Sampling
from jaxpar.engine._speculative import SpecStats, SpeculativeConfig


def generate_speculative(
    engine: InferenceEngine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    speculative: SpeculativeConfig,
    *,
    sampling: Sampling | None = None,
    seed: int = 0,
    stop_tokens: Sequence[int] = (),
) -> tuple[Generation, SpecStats]:
    """Each prompt's new tokens (up to ``max_new_tokens``, ending at a stop token), with
    speculative decoding; and the speculation's counters. ``prefill_seconds`` is the time
    to the last prompt's first token, ``decode_seconds`` the rest (compiles included:
    programs compile on first use)."""
    batcher = ContinuousBatcher(engine, speculative=speculative)
    start = time.perf_counter()
    with batcher:
        streams = [
            batcher.submit(
                list(p),
                max_tokens=max_new_tokens,
                sampling=sampling,
                seed=seed + i,
                stop_tokens=stop_tokens,
            )  # fmt: skip
            for i, p in enumerate(prompts)
        ]
        tokens = [s.result() for s in streams]
    end = time.perf_counter()
    first = max((s.token_times[0] for s in streams if s.token_times), default=start)
    generation = Generation(
        tokens=tokens,
        prefill_seconds=first - start,
        decode_seconds=end - first,
        prompt_tokens=sum(map(len, prompts)),
        new_tokens=sum(map(len, tokens)),
    )
    return generation, batcher.spec_stats
