"""Speculative decoding's verification step over the decode slots, and its sampler.

A verification step feeds each row ``K + 1`` tokens, the token it appends next and the
``K`` tokens drafted after it, at positions ``length .. length + K`` after the row's
cached context in its pages: one forward pass of ``K + 1`` positions per row (the
model's prefill with context over the row's pages, gathered as chunked prefill gathers
them), in the decode layout (sequence never split: SP is illegal in decode, and the
step is classified as decode in ``sharding_specs/rules.toml``). It writes the K/V of all
``K + 1`` positions into the row's pages and then keeps only the accepted ones: a
rejected draft is rolled back by the row's length alone (nothing is copied; a later
step overwrites its slots).

Each position's target distribution goes through the same penalties, grammar mask (the
first position only: a constrained row is never drafted for), temperature, top-k and
top-p as a plain decode step's (:func:`target_probs`); then :func:`accept_or_resample`
accepts draft ``d`` with probability ``min(1, p(d) / q(d))`` and otherwise draws from the
normalised residual ``max(p - q, 0)``: the emitted tokens are distributed as the target's
(Leviathan et al., 2023). For a proposer without a distribution (n-gram lookup) ``q`` is
a point mass on ``d``. Greedy rows have a one-hot ``p``: a draft is accepted exactly when
it is the argmax, and a rejection emits the argmax, so greedy speculation emits the
tokens of greedy decoding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.engine._filters import kept
from jaxpar.engine._grammar import allow_only
from jaxpar.engine._logprobs import Logprobs
from jaxpar.engine._penalties import Seen, penalize
from jaxpar.engine._placement import put_global
from jaxpar.engine._sampling import RowSampling
from jaxpar.engine._vocab import VocabSplit, mask_padded
from jaxpar.errors import ConfigError
from jaxpar.models import as_stored, count_dropped, kv_map, read_pages, total_dropped
from jaxpar.spec import Phase

DECODE = Phase.DECODE


def target_probs(
    logits_BV: jax.Array,
    rows: RowSampling,
    seen: Seen | None = None,
    allowed_BW: jax.Array | None = None,
    split: VocabSplit | None = None,
) -> jax.Array:
    """The distribution each row draws its next token from (float32 ``[B, V]``; traced):
    penalties, then the token mask, then temperature, top-k and top-p, as
    :func:`~jaxpar.engine._sampling.select_rows` applies them; a greedy row's is one-hot
    at its argmax."""
    split = split or VocabSplit()
    logits_BV = split.constrain(logits_BV.astype(jnp.float32))
    if seen is not None:
        logits_BV = split.constrain(penalize(logits_BV, seen, rows))
    if allowed_BW is not None:
        logits_BV = split.constrain(allow_only(logits_BV, allowed_BW))
    vocab = logits_BV.shape[-1]
    greedy_BV = jax.nn.one_hot(jnp.argmax(logits_BV, -1), vocab, dtype=jnp.float32)
    sampled_B = rows.temperature_B > 0
    temperature_B1 = jnp.where(sampled_B, rows.temperature_B, 1.0)[:, None]
    scaled_BV = logits_BV / temperature_B1
    keep_BV = jax.lax.cond(
        jnp.any((rows.top_k_B > 0) | (rows.top_p_B < 1.0)),
        lambda: kept(scaled_BV, rows, split),
        lambda: ~jnp.isnan(scaled_BV),
    )
    probs_BV = jax.nn.softmax(jnp.where(keep_BV, scaled_BV, -jnp.inf), axis=-1)
    return jnp.where(sampled_B[:, None], probs_BV, greedy_BV)


def _draw(key: jax.Array, probs_V: jax.Array) -> jax.Array:
    """One token from ``probs_V`` (zeros never drawn)."""
    logp_V = jnp.where(probs_V > 0, jnp.log(jnp.maximum(probs_V, 1e-38)), -jnp.inf)
    return jnp.argmax(logp_V + jax.random.gumbel(key, probs_V.shape)).astype(jnp.int32)


def accept_or_resample(
    p_BV: jax.Array, draft_B: jax.Array, keys_B: jax.Array, q_BV: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling of one drafted position per row (traced).

    Draft ``draft_B`` is accepted with probability ``min(1, p(d) / q(d))`` (``q_BV`` None:
    a point mass on the draft, so ``p(d)``); otherwise the row's token is drawn from the
    normalised residual ``max(p - q, 0)``. Returns (accepted ``[B]`` bool, the token
    emitted: the draft where accepted, the residual's draw elsewhere)."""
    p_d = jnp.take_along_axis(p_BV, draft_B[:, None], -1)[:, 0]
    if q_BV is None:
        q_BV = jax.nn.one_hot(draft_B, p_BV.shape[-1], dtype=p_BV.dtype)
    q_d = jnp.take_along_axis(q_BV, draft_B[:, None], -1)[:, 0]
    ratio = jnp.where(q_d > 0, p_d / jnp.where(q_d > 0, q_d, 1.0), 0.0)

    def one(key, ratio, p_V, q_V):
        k_accept, k_draw = jax.random.split(key)
        accepted = jax.random.uniform(k_accept) < ratio
        residual_V = jnp.maximum(p_V - q_V, 0.0)
        residual_V = jnp.where(residual_V.sum() > 0, residual_V, p_V)
        return accepted, _draw(k_draw, residual_V)

    accepted_B, resampled_B = jax.vmap(one)(keys_B, ratio, p_BV, q_BV)
    return accepted_B, jnp.where(accepted_B, draft_B, resampled_B)


def position_keys(rows: RowSampling, step_B: jax.Array) -> jax.Array:
    """Each row's key at its sampling step ``step_B`` (as :func:`select_rows` keys it)."""

    def key(key_data, step, row):
        return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(key_data), step), row)

    return jax.vmap(key)(rows.key_B, step_B, rows.row_B)


def speculative_tokens(
    logits_BTV: jax.Array,
    drafts_BK: jax.Array,
    n_drafts_B: jax.Array,
    rows: RowSampling,
    step_B: jax.Array,
    seen: Seen | None = None,
    allowed_BW: jax.Array | None = None,
    split: VocabSplit | None = None,
    q_BKV: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, Seen | None]:
    """The tokens a verification emits per row (traced).

    ``logits_BTV``: the target's logits at the ``T = K + 1`` fed positions; row b's first
    ``n_drafts_B[b]`` drafts count (the rest are padding, never accepted). Position j
    samples at step ``step_B + j``, its penalties counting the drafts before it, and the
    grammar mask ``allowed_BW`` applies at position 0 (rows with a grammar draft
    nothing). Returns (tokens ``[B, T]``: the accepted drafts then one token drawn from the
    target (the residual after a rejection, or a bonus token when every draft was
    accepted), ``-1`` after it; the count emitted ``[B]``, 1 to ``n_drafts + 1``; the
    penalties' counts after the emitted tokens)."""
    b, t, _ = logits_BTV.shape
    going_B = jnp.ones(b, bool)  # every draft so far accepted
    out, count_B = [], jnp.zeros(b, jnp.int32)
    seen_j = seen
    for j in range(t):
        p_BV = target_probs(logits_BTV[:, j], rows, seen_j, allowed_BW if j == 0 else None, split)
        keys_B = position_keys(rows, step_B + j)
        if j < t - 1:
            q = None if q_BKV is None else q_BKV[:, j]
            accepted_B, token_B = accept_or_resample(p_BV, drafts_BK[:, j], keys_B, q)
            accepted_B = accepted_B & (j < n_drafts_B)
            bonus_B = jax.vmap(_draw)(keys_B, p_BV)  # no draft here: drawn from p
            token_B = jnp.where(j < n_drafts_B, token_B, bonus_B)
        else:
            accepted_B = jnp.zeros(b, bool)
            token_B = jax.vmap(_draw)(keys_B, p_BV)
        out.append(jnp.where(going_B, token_B, -1))
        count_B = count_B + going_B.astype(jnp.int32)
        if seen_j is not None:
            seen_j = seen_j.add(token_B, going_B)
        going_B = going_B & accepted_B
    return jnp.stack(out, axis=1), count_B, seen_j


def _write_positions(pool: Any, new: Any, page_RT: jax.Array, slot_RT: jax.Array) -> Any:
    """Row r's new K or V at position t into global page ``page_RT`` slot ``slot_RT``
    (pages ``>= A`` dropped): per layer ``[K, A, Z, H] <- [R, T, K, H]``, or stacked."""
    if isinstance(pool, tuple):
        return tuple(
            kv_map(
                lambda p, x: p.at[:, page_RT, slot_RT].set(x.transpose(2, 0, 1, 3), mode="drop"),
                layer,
                as_stored(x, layer),
            )
            for layer, x in zip(pool, new, strict=True)
        )
    return kv_map(
        lambda p, x: p.at[:, :, page_RT, slot_RT].set(x.transpose(0, 3, 1, 2, 4), mode="drop"),
        pool,
        as_stored(new, pool),
    )


class VerifySteps:
    """Compiles and runs the verification step over one :class:`~._slots.SlotSteps`'
    decode rows (its layout, pages and row views). One compile per (block-table width,
    rows computed, K)."""

    def __init__(self, slot_steps):
        if slot_steps.groups is not None:
            raise ConfigError(
                "speculative decoding: models with KV groups (sliding-window or mixed "
                "attention layers) are not supported yet; serve without "
                "--speculative-config"
            )
        self.ss = slot_steps
        row = slot_steps.steps.layouts.tokens_B
        self.drafts_layout = NamedSharding(row.mesh, PartitionSpec(*row.spec, None))

    def _verify(self, params, slots, release_B, pages_RN, drafts_BK, n_drafts_B, allowed_BW):
        ss = self.ss
        steps = ss.steps
        with steps.context(DECODE), count_dropped() as drops:
            take, put = ss._row_views(pages_RN.shape[0])
            active_B = slots.active_B & ~release_B
            lengths_B = jnp.where(active_B, slots.lengths_B, 0)
            tokens_B = jnp.where(active_B, slots.tokens_B, 0)
            t = drafts_BK.shape[1] + 1
            active_R = take(active_B) & (take(lengths_B) + t <= ss.pool.max_seq_len)
            start_R = jnp.where(active_R, take(lengths_B), 0)
            n_drafts_R = jnp.where(active_R, take(n_drafts_B), 0)
            drafts_RK = take(drafts_BK)
            tokens_RT = jnp.concatenate([take(tokens_B)[:, None], drafts_RK], axis=1)
            dtype = ss.model_config.dtype
            ctx_k, ctx_v = (read_pages(pool, pages_RN, dtype) for pool in (slots.k, slots.v))
            lengths_R = jnp.full_like(start_R, t)
            model = steps.model(params)
            logits_RTV, k_new, v_new = model.prefill(
                tokens_RT, lengths_R, all_logits=True, context=(ctx_k, ctx_v, start_R)
            )
            logits_RTV = mask_padded(logits_RTV, steps.vocab_size)
            z = ss.pool.page_size
            pos_RT = start_R[:, None] + jnp.arange(t, dtype=jnp.int32)
            page_RT = jnp.take_along_axis(pages_RN, pos_RT // z, axis=1, mode="clip")
            page_RT = jnp.where(active_R[:, None], page_RT, ss.pool.pages)
            slot_RT = pos_RT % z
            k_pool = _write_positions(slots.k, k_new, page_RT, slot_RT)
            v_pool = _write_positions(slots.v, v_new, page_RT, slot_RT)
            sampling_R = jax.tree.map(take, slots.sampling).live(active_R)
            step_R = take(slots.step_B)
            seen_R = jax.tree.map(take, slots.seen)
            split = steps.vocab_split(DECODE)
            out_RT, count_R, seen_R = speculative_tokens(
                logits_RTV, drafts_RK, n_drafts_R, sampling_R, step_R, seen_R,
                take(allowed_BW), split,
            )  # fmt: skip
            count_R = jnp.where(active_R, count_R, 0)
            out_RT = jnp.where(active_R[:, None], out_RT, -1)
            last_R = jnp.take_along_axis(out_RT, jnp.maximum(count_R - 1, 0)[:, None], 1)[:, 0]
            logprobs = []
            for j in range(t):
                chosen_R = jnp.maximum(out_RT[:, j], 0)
                lp = Logprobs.for_rows(logits_RTV[:, j], chosen_R, sampling_R.logprobs_B, split)
                zeros = Logprobs.zeros(tokens_B.shape, logits_RTV.shape[-1])
                logprobs.append(jax.tree.map(put, zeros, lp))
            new_slots = slots.replace(
                k=k_pool,
                v=v_pool,
                lengths_B=put(lengths_B, jnp.where(active_R, start_R + count_R, 0)),
                tokens_B=put(tokens_B, jnp.where(active_R, last_R, 0)),
                active_B=put(active_B, active_R),
                step_B=put(slots.step_B, step_R + count_R),
                seen=jax.tree.map(put, slots.seen, seen_R),
            )
            drawn_BT = put(jnp.full((tokens_B.shape[0], t), -1, jnp.int32), out_RT)
            out = (new_slots, drawn_BT, tuple(logprobs))
            return (*out, total_dropped(drops)) if steps.counts_drops else out

    def _program(self, params, slots, release, pages, drafts, n_drafts, allowed):
        ss = self.ss
        rep = ss.steps.layouts.replicated
        return ss.steps.compile(
            "spec_verify",
            (pages.shape, drafts.shape, ss._pool_key),
            self._verify,
            (
                ss.steps.params_in,
                ss.layout,
                ss.layout.active_B,
                rep,
                self.drafts_layout,
                ss.layout.active_B,
                ss.mask_layout,
            ),
            ss.steps.with_drops((ss.layout, rep, rep)),
            (params, slots, release, pages, drafts, n_drafts, allowed),
            donate_argnums=(1,),
        )

    def verify(
        self,
        params,
        slots,
        release_B: np.ndarray,
        pages_RN: np.ndarray,
        drafts_BK: np.ndarray,
        n_drafts_B: np.ndarray,
        allowed: jax.Array,
    ):
        """Donates ``slots``: one verification step over the rows ``pages_RN`` covers (the
        first ``R / shards`` of every batch shard, as :meth:`SlotSteps.table_rows` orders
        them; *global* page ids, ``>= A`` where a row holds none), each feeding its next
        token and its first ``n_drafts_B`` drafts of ``drafts_BK``. Returns the new slots,
        the tokens emitted ``[B, K + 1]`` (``-1`` past each row's count), their logprobs
        (one :class:`Logprobs` per position) and the dropped MoE assignments (or None)."""
        ss = self.ss
        release = put_global(np.asarray(release_B, bool), ss.layout.active_B)
        pages = put_global(np.asarray(pages_RN, np.int32), ss.steps.layouts.replicated)
        drafts = put_global(np.asarray(drafts_BK, np.int32), self.drafts_layout)
        n_drafts = put_global(np.asarray(n_drafts_B, np.int32), ss.layout.active_B)
        args = (params, slots, release, pages, drafts, n_drafts, allowed)
        out = self._program(*args)(*args)
        return out if ss.steps.counts_drops else (*out, None)
