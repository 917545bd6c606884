"""How the next token is chosen: one request's :class:`Sampling`, and the same parameters
as per-row arrays (:class:`RowSampling`) that the serving core's compiled steps take.

Parameters only: the filters and the draw that use them are :mod:`jaxpar.engine._sampling`
(with :mod:`jaxpar.engine._filters` and :mod:`jaxpar.engine._penalties`), which import
them from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the next token is chosen. ``temperature=0`` is greedy (argmax).

    Sampling is reproducible: the key of step ``i`` is ``fold_in(PRNGKey(seed), i)`` and
    JAX's partitionable threefry gives the same bits whatever the sharding.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    #: OpenAI's: subtracted from the logit of every token generated so far (once).
    presence_penalty: float = 0.0
    #: OpenAI's: subtracted once per time a token was generated so far.
    frequency_penalty: float = 0.0
    #: HF's and vLLM's (CTRL): the logits of tokens in the prompt or generated so far are
    #: divided by it where positive, multiplied where negative; 1 is off.
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature == 0 and (self.top_k is not None or self.top_p is not None):
            raise ConfigError("top_k / top_p need temperature > 0 (temperature 0 is greedy)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def penalized(self) -> bool:
        """Some penalty is on: the draw depends on the tokens seen so far."""
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (
            0.0,
            0.0,
            1.0,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@flax.struct.dataclass
class RowSampling:
    """Sampling parameters per row, as arrays: serving slots change them without a compile.

    ``temperature_B`` 0 is greedy; ``top_k_B`` 0 and ``top_p_B`` 1 switch those filters
    off; ``key_B`` holds each row's ``key_data(PRNGKey(seed))``; ``row_B`` is the row's
    place in the batch its seed was given for. A row draws as row ``row_B`` of an offline
    :func:`select` with the same seed and step: a served request (row 0) samples the tokens
    ``generate([prompt], seed=seed)`` does, and ``generate(prompts, seed=seed)`` draws
    through these arrays with rows ``0..B-1``.

    ``presence_B``, ``frequency_B`` (0: off) and ``repetition_B`` (1: off) are the
    penalties (:mod:`jaxpar.engine._penalties`); ``logprobs_B``: the row returns the
    logprobs of its tokens (:mod:`jaxpar.engine._logprobs`).
    """

    temperature_B: jax.Array
    top_k_B: jax.Array
    top_p_B: jax.Array
    key_B: jax.Array
    row_B: jax.Array
    presence_B: jax.Array
    frequency_B: jax.Array
    repetition_B: jax.Array
    logprobs_B: jax.Array

    @classmethod
    def rows(
        cls,
        samplings: Sequence[Sampling],
        seeds: Sequence[int],
        rows: Sequence[int] | None = None,
        logprobs: Sequence[bool] | None = None,
    ) -> RowSampling:
        """Host arrays for one :class:`Sampling` and seed (and row, default 0; and whether
        it returns logprobs, default not) per row."""
        keys = [np.asarray(jax.random.key_data(jax.random.key(int(s)))) for s in seeds]
        n = len(seeds)
        return cls(
            temperature_B=np.array([s.temperature for s in samplings], np.float32),
            top_k_B=np.array([s.top_k or 0 for s in samplings], np.int32),
            top_p_B=np.array([1.0 if s.top_p is None else s.top_p for s in samplings], np.float32),
            key_B=np.stack(keys).astype(np.uint32),
            row_B=np.zeros(n, np.int32) if rows is None else np.asarray(rows, np.int32),
            presence_B=np.array([s.presence_penalty for s in samplings], np.float32),
            frequency_B=np.array([s.frequency_penalty for s in samplings], np.float32),
            repetition_B=np.array([s.repetition_penalty for s in samplings], np.float32),
            logprobs_B=np.zeros(n, bool) if logprobs is None else np.asarray(logprobs, bool),
        )

    def live(self, active_B: jax.Array) -> RowSampling:
        """Penalties and logprobs off in the rows not ``active_B`` (traced): a free row's
        stale parameters then cost no step anything."""
        return self.replace(
            presence_B=jnp.where(active_B, self.presence_B, 0.0),
            frequency_B=jnp.where(active_B, self.frequency_B, 0.0),
            repetition_B=jnp.where(active_B, self.repetition_B, 1.0),
            logprobs_B=self.logprobs_B & active_B,
        )

    @classmethod
    def like(cls, sharding: Any, key_sharding: Any = None) -> RowSampling:
        """Every field laid out as ``sharding`` (the key data as ``key_sharding``, default
        the same): the layout tree of a :class:`RowSampling`."""
        fields = {f.name: sharding for f in dataclasses.fields(cls)}
        return cls(**fields | {"key_B": key_sharding or sharding})
