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

import jax
import jax.numpy as jnp

from jaxpar.engine._filters import kept
from jaxpar.engine._grammar import allow_only
from jaxpar.engine._penalties import Seen, penalize
from jaxpar.engine._sampling_params import RowSampling, Sampling
from jaxpar.engine._vocab import VocabSplit
from jaxpar.errors import ConfigError


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
