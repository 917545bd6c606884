"""Next-token selection from (possibly vocab-sharded) logits: penalties, a grammar's token
mask, greedy, temperature, top-k, top-p.

One implementation of the filters and the draw (:func:`_filter_and_draw`), with the
parameters as per-row arrays (:class:`RowSampling`): changing them never recompiles.
:func:`select` applies one :class:`Sampling` to a whole batch (the pipelined schedule).
Penalties (:mod:`jaxpar.engine._penalties`) need each row's token counts, which only the
serving core keeps: :func:`select_rows` applies them, :func:`select` has none. So with
structured output's per-row token masks (:mod:`jaxpar.engine._grammar`): an input of
:func:`select_rows`, every bit set for a row without a grammar.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.engine._filters import kept
from jaxpar.engine._grammar import allow_only
from jaxpar.engine._penalties import Seen, penalize
from jaxpar.engine._vocab import VocabSplit
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


def select(
    logits_BV: jax.Array, key: jax.Array, sampling: Sampling, split: VocabSplit | None = None
) -> jax.Array:
    """The next token per row (int32 [B]), one :class:`Sampling` for the batch; traced.

    The filters are :func:`select_rows`' (one implementation); row ``b`` draws with
    ``fold_in(key, b)``, so the draw for token ``v`` depends on neither the batch size nor
    the vocabulary length (a vocabulary padded for tp, padded ids at -inf, samples the
    same tokens as the unpadded one).
    """
    if sampling.penalized:
        raise ConfigError(
            "penalties need each row's token counts, which the serving core keeps "
            "(unpipelined strategies); this schedule has none"
        )
    logits_BV = logits_BV.astype(jnp.float32)
    if sampling.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    b = logits_BV.shape[0]
    row_B = jnp.arange(b, dtype=jnp.int32)
    rows = RowSampling(
        temperature_B=jnp.full(b, sampling.temperature, jnp.float32),
        top_k_B=jnp.full(b, sampling.top_k or 0, jnp.int32),
        top_p_B=jnp.full(b, 1.0 if sampling.top_p is None else sampling.top_p, jnp.float32),
        key_B=jnp.zeros((b, 0), jnp.uint32),  # unused: the keys are given
        row_B=row_B,
        presence_B=jnp.zeros(b, jnp.float32),
        frequency_B=jnp.zeros(b, jnp.float32),
        repetition_B=jnp.ones(b, jnp.float32),
        logprobs_B=jnp.zeros(b, bool),
    )
    keys_B = jax.vmap(lambda r: jax.random.fold_in(key, r))(row_B)
    return _filter_and_draw(logits_BV, rows, keys_B, split or VocabSplit())


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


def select_rows(
    logits_BV: jax.Array,
    rows: RowSampling,
    step_B: jax.Array,
    seen: Seen | None = None,
    allowed_BW: jax.Array | None = None,
    split: VocabSplit | None = None,
) -> jax.Array:
    """The next token per row with that row's own parameters (int32 [B]); traced.

    Row ``b`` at its step ``step_B[b]`` draws with
    ``fold_in(fold_in(key_b, step_b), row_b)``: as row ``row_b`` of :func:`select` at that
    step. ``seen``: the rows' token counts, for their penalties (applied first, to greedy
    rows too; none without it). ``allowed_BW``: each row's packed token mask (structured
    output; :func:`~jaxpar.engine._grammar.allow_only`), applied after the penalties and
    before the filters, so temperature, top-k and top-p act on the tokens the grammar
    allows. ``split``: how the logits are split over the vocabulary (default whole), so
    the filters reduce per shard first and never gather the vocabulary. They run only
    when some row samples.
    """

    def key(key_data: jax.Array, step: jax.Array, row: jax.Array) -> jax.Array:
        return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(key_data), step), row)

    keys_B = jax.vmap(key)(rows.key_B, step_B, rows.row_B)
    split = split or VocabSplit()
    logits_BV = split.constrain(logits_BV.astype(jnp.float32))
    if seen is not None:
        logits_BV = split.constrain(penalize(logits_BV, seen, rows))
    if allowed_BW is not None:
        logits_BV = split.constrain(allow_only(logits_BV, allowed_BW))
    return _filter_and_draw(logits_BV, rows, keys_B, split)


def _filter_and_draw(
    logits_BV: jax.Array, rows: RowSampling, keys_B: jax.Array, split: VocabSplit
) -> jax.Array:
    """Temperature, top-k and top-p per row, then a categorical draw per row (argmax of the
    kept tokens' tempered logits + Gumbel noise from that row's key over ``[V]``); greedy
    rows take the argmax. Vocab-parallel (:mod:`jaxpar.engine._filters`): each reduction
    over V runs on each shard first, so no step gathers the vocabulary."""
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    sampled_B = rows.temperature_B > 0

    def draw(_) -> jax.Array:
        vocab = logits_BV.shape[-1]
        temperature_B1 = jnp.where(sampled_B, rows.temperature_B, 1.0)[:, None]
        scaled_BV = split.constrain(logits_BV / temperature_B1)
        filtered = jnp.any((rows.top_k_B > 0) | (rows.top_p_B < 1.0))
        keep_BV = jax.lax.cond(
            filtered,
            lambda: split.constrain(kept(scaled_BV, rows, split)),
            # Every token (derived from the logits: inside a stage's shard_map it varies
            # as they do).
            lambda: split.constrain(~jnp.isnan(scaled_BV)),
        )
        noise_BV = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,)))(keys_B)
        noise_BV = split.constrain(noise_BV)
        score_BV = split.constrain(
            jnp.where(split.constrain(keep_BV), scaled_BV + noise_BV, -jnp.inf)
        )
        drawn_B = jnp.argmax(score_BV, axis=-1).astype(jnp.int32)
        return jnp.where(sampled_B, drawn_B, greedy_B)

    return jax.lax.cond(jnp.any(sampled_B), draw, lambda _: greedy_B, None)
