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
from tests._prompts import MAX_BATCH, MAX_SEQ_LEN, NEW_TOKENS, PROMPTS  # noqa: F401


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
