"""Pipeline-parallel schedules inside one SPMD program: GPipe prefill, group-filled decode.

Each iteration every stage runs its layers (:meth:`Stages.map`) on what its slot of a
stage-major activation buffer ``[P, ...]`` holds, then ``jnp.roll(buf, 1, axis=0)`` (one
collective-permute on ``pp``) moves every stage's output on to the next stage; stage 0
takes the next microbatch or decode group from the embedding instead.

SPMD means every stage runs every iteration: a stage with nothing to do (a bubble) computes
on a placeholder and its results are dropped. Everything that leaves the last stage (logits,
sampled tokens) stays in stage-major buffers too, written by every stage but meaningful only
at index ``P - 1``: the host reads that row, so no program needs a collective other than the
activation-sized permutes to cross stages.

Microbatch ``m`` of ``M`` (and decode group ``g`` of ``G``) is the batch rows ``b`` with
``b % M == m``: ``B -> [B / M, M]`` keeps the batch sharding on the major dim, and picking
a microbatch indexes the unsharded minor one, locally.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.engine._pipeline_cache import GroupCacheView
from jaxpar.engine._pipeline_stages import Stages, stage_layer
from jaxpar.models._cache import KVCache
from jaxpar.models._decoder import Decoder
from jaxpar.spec import Module, Phase

PREFILL, DECODE = Phase.PREFILL, Phase.DECODE
ATTENTION, EMBEDDING, LM_HEAD = Module.ATTENTION, Module.EMBEDDING, Module.LM_HEAD
BTD = ("batch", "seq", "embed")
# A stage's prefill K/V with the microbatch index after the batch rows.
STAGE_KV_AXES = (None, "batch", None, "cache_seq", "kv_heads", "head_dim")


def _slot(index: jax.Array, count: int) -> tuple[jax.Array | int, jax.Array]:
    """(index clipped into range for reading, index for writing: ``count`` = dropped).

    With one slot the read index is the constant 0, which XLA folds into plain slices.
    """
    valid = (index >= 0) & (index < count)
    read = 0 if count == 1 else jnp.clip(index, 0, count - 1)
    return read, jnp.where(valid, index, count)


def prefill(
    model: Decoder,
    tokens_BT: jax.Array,
    lengths_B: jax.Array,
    stages: Stages,
    *,
    microbatches: int,
    all_logits: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GPipe prefill: ``M`` microbatches through ``P`` stages in ``M + P - 1`` iterations.

    At iteration ``i`` stage ``s`` runs microbatch ``i - s`` (fill, steady state, drain).

    Returns:
        (logits ``[P, B, V]`` (``[P, B, T, V]`` if ``all_logits``), meaningful at stage
        ``P - 1``; k and v ``[L, B, T, K, H]`` in the prefill layout, layers over ``pp``).
    """
    cfg, p, m_count = model.config, stages.count, microbatches
    b, t = tokens_BT.shape
    bm, lp = b // m_count, cfg.n_layers // p
    lengths_BmM = lengths_B.astype(jnp.int32).reshape(bm, m_count)
    pos_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    pos_BmT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (bm, t))
    graphdef, state_P = stages.split_layers(model)

    # The embedding runs once per stage, like its weights replicated over pp, inside the
    # stage map so no op of it can involve another stage; stage 0 injects one microbatch
    # per iteration.
    def embed(_, tokens_BT):
        return model.embed(tokens_BT, pos_BT).reshape(bm, m_count, t, cfg.d_model)

    tokens_PBT = stages.constrain(
        jnp.broadcast_to(tokens_BT, (p, b, t)), ("batch", "seq"), EMBEDDING, PREFILL
    )
    x_PBmMTD = stages.map(embed)(tokens_PBT)

    def run_stage(s, state_Lp, x_BmTD, x_emb_BmMTD, k_buf, v_buf, i):
        read, write = _slot(i - s, m_count)
        x_BmTD = jnp.where(s == 0, x_emb_BmMTD[:, jnp.minimum(i, m_count - 1)], x_BmTD)
        lengths_Bm = lengths_BmM[:, read]

        def layer(j, carry):
            x_BmTD, k_buf, v_buf = carry
            x_BmTD, k_BmTKH, v_BmTKH = nnx.merge(graphdef, stage_layer(state_Lp, j)).prefill(
                x_BmTD, pos_BmT, lengths_Bm
            )
            k_buf = k_buf.at[j, :, write].set(k_BmTKH, mode="drop")
            v_buf = v_buf.at[j, :, write].set(v_BmTKH, mode="drop")
            return x_BmTD, k_buf, v_buf

        return jax.lax.fori_loop(0, lp, layer, (x_BmTD, k_buf, v_buf))

    def head(s, x_BmTD, logits_buf, i):
        read, write = _slot(i - s, m_count)
        if not all_logits:
            # A one-hot select, not an index: take_along_axis makes XLA's SPMD partitioner
            # abort (a CHECK in ExpandDeviceGroupsWithIota) inside the pp-manual shard_map
            # with sp > 1 (jax 0.10.2), and x[arange(B), lengths - 1] gathers across the
            # batch shards. The select needs only the minimal all-reduce over sp.
            last_Bm1 = (lengths_BmM[:, read] - 1)[:, None]
            at_last_BmT = jnp.arange(x_BmTD.shape[1])[None, :] == last_Bm1
            x_BmTD = jnp.sum(jnp.where(at_last_BmT[..., None], x_BmTD, 0), axis=1)  # -> x_BmD
        return logits_buf.at[:, write].set(model.logits(x_BmTD), mode="drop")

    def iteration(carry, i):
        buf_PBmTD, k_buf, v_buf, logits_buf = carry
        buf_PBmTD, k_buf, v_buf = stages.map(lambda *a: run_stage(*a, i=i))(
            state_P, buf_PBmTD, x_PBmMTD, k_buf, v_buf
        )
        # Only iterations where the last stage finishes a microbatch pay for the LM head.
        logits_buf = jax.lax.cond(
            i >= p - 1,
            lambda: stages.map(lambda *a: head(*a, i=i))(buf_PBmTD, logits_buf),
            lambda: logits_buf,
        )
        return (jnp.roll(buf_PBmTD, 1, axis=0), k_buf, v_buf, logits_buf), None

    kv_shape = (p, lp, bm, m_count, t, cfg.n_kv_heads, cfg.head_dim)
    kv_zeros = stages.constrain(jnp.zeros(kv_shape, cfg.dtype), STAGE_KV_AXES, ATTENTION, PREFILL)
    logits_axes = ("batch", None, "seq", "vocab") if all_logits else ("batch", None, "vocab")
    logits_shape = (p, bm, m_count, *((t,) if all_logits else ()), cfg.vocab_size)
    init = (
        stages.constrain(jnp.zeros((p, bm, t, cfg.d_model), cfg.dtype), BTD, ATTENTION, PREFILL),
        kv_zeros,
        kv_zeros,
        stages.constrain(jnp.zeros(logits_shape, jnp.float32), logits_axes, LM_HEAD, PREFILL),
    )
    steps = jnp.arange(m_count + p - 1, dtype=jnp.int32)
    (_, k_buf, v_buf, logits_buf), _ = jax.lax.scan(iteration, init, steps)
    # [P, Lp] -> L and [B/M, M] -> B are both local: the sharded dim stays the major one.
    kv_LBTKH = (cfg.n_layers, b, t, cfg.n_kv_heads, cfg.head_dim)
    logits = logits_buf.reshape(p, b, *logits_shape[3:])
    return logits, k_buf.reshape(kv_LBTKH), v_buf.reshape(kv_LBTKH)


def decode(
    model: Decoder,
    cache: KVCache,
    tokens_PB: jax.Array,
    stages: Stages,
    *,
    groups: int,
    emit: Callable[[jax.Array, jax.Array], jax.Array],
    emitted: jax.ShapeDtypeStruct,
    emitted_axes: tuple[str | None, ...],
) -> tuple[jax.Array, KVCache]:
    """One decode step: ``G`` groups of sequences through ``P`` stages, ``G + P - 1`` iterations.

    At iteration ``i`` stage ``s`` runs group ``i - s``; a group's token leaves the last
    stage before the step ends, so step t+1 of a sequence never starts before step t is done.

    Args:
        model: the decoder (merged inside the traced function).
        cache: decode-layout cache, stacked ``[L, B, S, K, H]``, layers over ``pp``.
        tokens_PB: stage-major tokens; row 0 holds the tokens to append (stage 0 embeds).
        stages: the pipeline.
        groups: G; group g is the rows ``b % G == g``.
        emit: ``(logits [Bg, V], g) -> [Bg, ...]``: what the last stage hands back per group
            (the logits themselves, or sampled tokens).
        emitted: shape and dtype of one group's ``emit`` result.
        emitted_axes: its logical axes (in the LM head module).

    Returns:
        (``[P, B, ...]`` emitted values, meaningful at stage ``P - 1``; the cache with the
        token written and lengths + 1).
    """
    cfg, p, g_count = model.config, stages.count, groups
    b, lp = tokens_PB.shape[1], cfg.n_layers // p
    bg = b // g_count
    pos_BgG = cache.lengths_B.reshape(bg, g_count)
    graphdef, state_P = stages.split_layers(model)

    # Each stage embeds its own row of tokens (only stage 0's is real), so no stage needs
    # tokens that another holds.
    def embed(_, tokens_B):
        return model.embed(tokens_B[:, None], cache.lengths_B[:, None])

    x_PBgG1D = stages.map(embed)(tokens_PB).reshape(p, bg, g_count, 1, cfg.d_model)

    def run_stage(s, state_Lp, x_Bg1D, x_emb_BgG1D, k_LpBSKH, v_LpBSKH, i):
        read, write = _slot(i - s, g_count)
        x_Bg1D = jnp.where(s == 0, x_emb_BgG1D[:, read], x_Bg1D)
        pos_Bg = pos_BgG[:, read]
        view = GroupCacheView.open(
            k_LpBSKH, v_LpBSKH, read, g_count, cache.lengths_B, write < g_count
        )

        def layer(j, carry):
            x_Bg1D, view = carry
            return nnx.merge(graphdef, stage_layer(state_Lp, j)).decode(x_Bg1D, pos_Bg, j, view)

        x_Bg1D, view = jax.lax.fori_loop(0, lp, layer, (x_Bg1D, view))
        return x_Bg1D, view.k_LBSKH, view.v_LBSKH

    def head(s, x_Bg1D, out, i):
        read, write = _slot(i - s, g_count)
        return out.at[:, write].set(emit(model.logits(x_Bg1D[:, 0]), read), mode="drop")

    def iteration(carry, i):
        buf_PBg1D, k, v, out = carry
        buf_PBg1D, k, v = stages.map(lambda *a: run_stage(*a, i=i))(
            state_P, buf_PBg1D, x_PBgG1D, k, v
        )
        out = jax.lax.cond(
            i >= p - 1,
            lambda: stages.map(lambda *a: head(*a, i=i))(buf_PBg1D, out),
            lambda: out,
        )
        return (jnp.roll(buf_PBg1D, 1, axis=0), k, v, out), None

    def stage_major(x_LBSKH: jax.Array) -> jax.Array:
        x_PLpBSKH = x_LBSKH.reshape(p, lp, *x_LBSKH.shape[1:])
        return stages.constrain(x_PLpBSKH, (None, *KVCache.KV_AXES[1:]), ATTENTION, DECODE)

    out_shape = (p, bg, g_count, *emitted.shape[1:])
    out_axes = (emitted_axes[0], None, *emitted_axes[1:])
    init = (
        stages.constrain(jnp.zeros((p, bg, 1, cfg.d_model), cfg.dtype), BTD, ATTENTION, DECODE),
        stage_major(cache.k),
        stage_major(cache.v),
        stages.constrain(jnp.zeros(out_shape, emitted.dtype), out_axes, LM_HEAD, DECODE),
    )
    steps = jnp.arange(g_count + p - 1, dtype=jnp.int32)
    (_, k, v, out), _ = jax.lax.scan(iteration, init, steps)
    cache = cache.replace(k=k.reshape(cache.k.shape), v=v.reshape(cache.v.shape))
    return out.reshape(p, b, *emitted.shape[1:]), cache.advance()


def bubble_fraction(stages: int, microbatches: int) -> float:
    """GPipe's idle share of stage-iterations, ``(P - 1) / (M + P - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


def schedule(stages: int, microbatches: int) -> list[list[int | None]]:
    """Which microbatch each stage runs per iteration (``None``: a bubble).

    ``schedule(P, M)[i][s]`` for ``M + P - 1`` iterations; counting the ``None`` entries
    gives :func:`bubble_fraction` of all stage-iterations.
    """
    return [
        [i - s if 0 <= i - s < microbatches else None for s in range(stages)]
        for i in range(microbatches + stages - 1)
    ]
