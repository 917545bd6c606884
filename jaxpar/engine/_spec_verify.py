"""Speculative decoding's verification step over the decode slots, and its sampler.

A verification step feeds each row ``K + 1`` tokens, the token it appends next and the
``K`` tokens drafted after it, at positions ``length .. length + K`` after the row's
cached context in its pages: one forward pass of ``K + 1`` positions per row (the
model's prefill with context over the row's pages, gathered as chunked prefill gathers
them), in the decode layout (sequence never split: SP is illegal in decode, and the
step is classified as decode in ``sharding_specs/rules.toml``). It writes the K/V of all
``K + 1`` positions into the row's pages (the decode step's in-place per-shard write) and then keeps only the accepted ones: a
rejected draft is rolled back by the row's length alone (nothing is copied; a later
step overwrites its slots).

Each position's target distribution goes through the same penalties, grammar mask (per
position: the request's grammar advanced along the drafts before it), temperature, top-k
and top-p as a plain decode step's (:func:`target_probs`); then :func:`accept_or_resample`
accepts draft ``d`` with probability ``min(1, p(d) / q(d))`` and otherwise draws from the
normalised residual ``max(p - q, 0)``: the emitted tokens are distributed as the target's
(Leviathan et al., 2023). ``q`` is the draft's distribution where the proposer samples
(a draft model: ``q_BKV``, an input of the step); for a proposer without one (n-gram
lookup) it is a point mass on ``d``. Greedy rows have a one-hot ``p``: a draft is accepted exactly when
it is the argmax, and a rejection emits the argmax, so greedy speculation emits the
tokens of greedy decoding.
"""

from __future__ import annotations

import functools
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
from jaxpar.models import (
    HiddenTaps,
    PagedKVCache,
    count_dropped,
    prefill_with_taps,
    read_pages,
    total_dropped,
)
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
    samples at step ``step_B + j``, its penalties counting the drafts before it, under the
    grammar mask ``allowed_BW`` (``[B, W]``: position 0's; or ``[B, T, W]``: each
    position's). Returns (tokens ``[B, T]``: the accepted drafts then one token drawn from the
    target (the residual after a rejection, or a bonus token when every draft was
    accepted), ``-1`` after it; the count emitted ``[B]``, 1 to ``n_drafts + 1``; the
    penalties' counts after the emitted tokens)."""
    b, t, _ = logits_BTV.shape
    going_B = jnp.ones(b, bool)  # every draft so far accepted
    out, count_B = [], jnp.zeros(b, jnp.int32)
    seen_j = seen
    for j in range(t):
        if allowed_BW is not None and allowed_BW.ndim == 3:
            allowed_j = allowed_BW[:, j]
        else:
            allowed_j = allowed_BW if j == 0 else None
        p_BV = target_probs(logits_BTV[:, j], rows, seen_j, allowed_j, split)
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


def _write_positions(cache: PagedKVCache, k_new: Any, v_new: Any, n_layers: int) -> PagedKVCache:
    """Every layer's new K/V of the ``T`` fed positions, row r's position t at
    ``cache.lengths_B[r] + t``, through the cache's own in-place per-shard write (as a
    decode step writes its token); ``k_new``/``v_new``: per layer ``[R, T, K, H]``, or
    stacked ``[L, R, T, K, H]``."""
    start_R = cache.lengths_B
    t = jax.tree.leaves(k_new)[0].shape[-3]
    for j in range(t):
        cache = cache.replace(lengths_B=start_R + j)
        for layer in range(n_layers):
            k_j, v_j = (x[layer][:, j] for x in (k_new, v_new))
            cache = cache.write_layer(layer, k_j, v_j)
    return cache.replace(lengths_B=start_R)


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
        #: Per-position masks ``[B, T, W]`` and draft distributions ``[B, K, V]``.
        self.row3_layout = NamedSharding(row.mesh, PartitionSpec(*row.spec, None, None))

    def _verify(
        self, params, slots, release_B, tables_RN, pages_RN, drafts_BK, n_drafts_B, allowed_BW,
        q_BKV=None,
        taps: HiddenTaps | None = None,
    ):  # fmt: skip
        """The forward pass and the draw (reads ``slots``, writes nothing): the new K/V,
        where they go, the rows' next state and the tokens emitted (with ``taps``, also the
        target's hidden states a speculative head reads, ``[B, K + 1, F]``, replicated:
        :mod:`jaxpar.models._hidden_taps`). The pool is written
        by :meth:`_commit`, a program of its own: a program that gathers the context from
        the pool and then scatters into it copies the pool (XLA cannot prove the gather
        done before the in-place update), ~20x the cost of the step on CPU."""
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
            context = (ctx_k, ctx_v, start_R)
            if taps is None:
                logits_RTV, k_new, v_new = model.prefill(
                    tokens_RT, lengths_R, all_logits=True, context=context
                )
            else:
                logits_RTV, k_new, v_new, features_RTF = prefill_with_taps(
                    model, tokens_RT, lengths_R, context, taps
                )
            logits_RTV = mask_padded(logits_RTV, steps.vocab_size)
            sampling_R = jax.tree.map(take, slots.sampling).live(active_R)
            step_R = take(slots.step_B)
            seen_R = jax.tree.map(take, slots.seen)
            split = steps.vocab_split(DECODE)
            out_RT, count_R, seen_R = speculative_tokens(
                logits_RTV, drafts_RK, n_drafts_R, sampling_R, step_R, seen_R,
                take(allowed_BW), split, None if q_BKV is None else take(q_BKV),
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
            rows = (
                put(lengths_B, jnp.where(active_R, start_R + count_R, 0)),
                put(tokens_B, jnp.where(active_R, last_R, 0)),
                put(active_B, active_R),
                put(slots.step_B, step_R + count_R),
                jax.tree.map(put, slots.seen, seen_R),
            )
            drawn_BT = put(jnp.full((tokens_B.shape[0], t), -1, jnp.int32), out_RT)
            written = (k_new, v_new, jnp.where(active_R[:, None], tables_RN, 0), start_R)
            out = (written, rows, drawn_BT, tuple(logprobs))
            if taps is not None:
                zeros_BTF = jnp.zeros((tokens_B.shape[0], *features_RTF.shape[1:]), jnp.float32)
                out = (*out, put(zeros_BTF, features_RTF))
            return (*out, total_dropped(drops)) if steps.counts_drops else out

    def _commit(self, slots, written, rows):
        """Writes the fed positions' K/V into the donated pool (inactive rows: their
        shard's scratch page) and the rows' next state."""
        k_new, v_new, tables_RN, start_R = written
        with self.ss.steps.context(DECODE):
            cache = PagedKVCache(k=slots.k, v=slots.v, block_tables_BN=tables_RN, lengths_B=start_R)
            cache = _write_positions(cache, k_new, v_new, self.ss.model_config.n_layers)
            lengths_B, tokens_B, active_B, step_B, seen = rows
            return slots.replace(
                k=cache.k, v=cache.v, lengths_B=lengths_B, tokens_B=tokens_B,
                active_B=active_B, step_B=step_B, seen=seen,
            )  # fmt: skip

    def _layouts(self):
        ss = self.ss
        lay, rep = ss.layout, ss.steps.layouts.replicated
        kv = ss.steps.layouts.kv_prefill
        written = (kv, kv, ss.tables_layout, rep)
        rows = (lay.lengths_B, lay.tokens_B, lay.active_B, lay.step_B, lay.seen)
        return written, rows

    def _program(
        self, params, slots, release, tables, pages, drafts, n_drafts, allowed, q=None, taps=None
    ):  # fmt: skip
        ss = self.ss
        rep = ss.steps.layouts.replicated
        written, rows = self._layouts()
        mask = ss.mask_layout if allowed.ndim == 2 else self.row3_layout
        extra = () if q is None else (self.row3_layout,)
        outs = (written, rows, rep, rep) + ((rep,) if taps is not None else ())
        return ss.steps.compile(
            "spec_verify",
            (pages.shape, drafts.shape, ss._pool_key, allowed.ndim, q is None, taps),
            functools.partial(self._verify, taps=taps),
            (
                ss.steps.params_in,
                ss.layout,
                ss.layout.active_B,
                ss.tables_layout,
                rep,
                self.drafts_layout,
                ss.layout.active_B,
                mask,
                *extra,
            ),
            ss.steps.with_drops(outs),
            (params, slots, release, tables, pages, drafts, n_drafts, allowed)
            + (() if q is None else (q,)),
        )

    def _commit_program(self, slots, written, rows):
        ss = self.ss
        layouts = self._layouts()
        return ss.steps.compile(
            "spec_commit",
            (jax.tree.map(jnp.shape, written), ss._pool_key),
            self._commit,
            (ss.layout, *layouts),
            ss.layout,
            (slots, written, rows),
            donate_argnums=(0,),
        )

    def verify(
        self,
        params,
        slots,
        release_B: np.ndarray,
        tables_RN: np.ndarray,
        pages_RN: np.ndarray,
        drafts_BK: np.ndarray,
        n_drafts_B: np.ndarray,
        allowed: jax.Array | np.ndarray,
        q_BKV: np.ndarray | None = None,
        taps: HiddenTaps | None = None,
    ):
        """Donates ``slots``: one verification step over the rows ``tables_RN`` covers (the
        first ``R / shards`` of every batch shard, as :meth:`SlotSteps.table_rows` orders
        them: the decode step's block tables, written through), whose cached context is
        read through ``pages_RN`` (the same pages as *global* ids, ``>= A`` where a row
        holds none), each feeding its next
        token and its first ``n_drafts_B`` drafts of ``drafts_BK``, under the token masks
        ``allowed`` (placed ``[B, W]``, or per position ``[B, K + 1, W]`` on the host) and,
        for a sampling proposer, its draft distributions ``q_BKV``. Returns the new slots,
        the tokens emitted ``[B, K + 1]`` (``-1`` past each row's count), their logprobs
        (one :class:`Logprobs` per position), the dropped MoE assignments (or None) and,
        with ``taps``, the hidden states a speculative head reads (else None)."""
        ss = self.ss
        release = put_global(np.asarray(release_B, bool), ss.layout.active_B)
        tables = put_global(np.asarray(tables_RN, np.int32), ss.tables_layout)
        pages = put_global(np.asarray(pages_RN, np.int32), ss.steps.layouts.replicated)
        drafts = put_global(np.asarray(drafts_BK, np.int32), self.drafts_layout)
        n_drafts = put_global(np.asarray(n_drafts_B, np.int32), ss.layout.active_B)
        if isinstance(allowed, np.ndarray):  # per-position masks [B, T, W]
            allowed = put_global(np.asarray(allowed, np.int32), self.row3_layout)
        args = (params, slots, release, tables, pages, drafts, n_drafts, allowed)
        if q_BKV is not None:
            args += (put_global(np.asarray(q_BKV, np.float32), self.row3_layout),)
        q = args[8] if q_BKV is not None else None
        program = self._program(*args[:8], q, taps)
        written, rows, drawn_BT, logprobs, *rest = program(*args)
        features = rest.pop(0) if taps is not None else None
        slots = self._commit_program(slots, written, rows)(slots, written, rows)
        return slots, drawn_BT, logprobs, rest[0] if rest else None, features
