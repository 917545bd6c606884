"""Shared helpers for engine tests: presets, prompts, single-device references."""

from __future__ import annotations

import functools
import itertools

import jax
import numpy as np

from jaxpar.engine import InferenceEngine
from jaxpar.models._config import preset
from jaxpar.models._decoder import init_params
from jaxpar.spec import ParallelConfig, make_mesh

MAX_BATCH = 8
MAX_SEQ_LEN = 64
NEW_TOKENS = 16
# Prompts of different lengths (one row of the batch stays a padding row).
PROMPTS = [
    [5, 17, 99, 3, 250, 7, 31],
    [42, 8],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
    [200],
    [77, 66, 55, 44],
    [9, 19, 29, 39, 49, 59, 69, 79, 89, 99],
    [128, 64, 32],
]


@functools.cache
def model(name: str):
    config = preset(name)
    return config, init_params(config, seed=0)


def engine(name: str, parallel: ParallelConfig, **kw) -> InferenceEngine:
    config, params = model(name)
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.size])
    kw.setdefault("max_batch", MAX_BATCH)
    kw.setdefault("max_seq_len", MAX_SEQ_LEN)
    return InferenceEngine(config, params, parallel, mesh=mesh, **kw)


@functools.cache
def reference(name: str) -> tuple[np.ndarray, list[list[int]]]:
    """Single-device prefill logits at the last prompt position, and 16 greedy tokens."""
    eng = engine(name, ParallelConfig())
    tokens, lengths = eng.pad_prompts(PROMPTS)
    logits = np.asarray(eng.prefill(tokens, lengths)[0])
    return logits, eng.generate(PROMPTS, NEW_TOKENS).tokens


def factorizations(total: int, n: int) -> list[tuple[int, ...]]:
    """Every ordered n-tuple of positive ints whose product is ``total``."""
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    return [c for c in itertools.product(divisors, repeat=n) if np.prod(c) == total]
