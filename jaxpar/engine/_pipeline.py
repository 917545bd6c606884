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

The pieces are top-level functions, each callable on its own: :func:`stage_slot` (which
microbatch a stage runs at an iteration: fill, steady state, drain), the stage-local steps
:func:`prefill_stage` / :func:`decode_stage` (one stage's layers, layer by layer in
:func:`prefill_layer` / :func:`decode_layer`), the last stage's :func:`prefill_head` /
:func:`decode_head` (with :func:`last_position`), and :func:`pipeline_iteration` /
:func:`run_schedule`, the loop both phases share. :func:`prefill` and :func:`decode`
only set up buffers and bind these.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.engine._pipeline_cache import GroupCacheView
from jaxpar.engine._pipeline_stages import Blocks, Stages, stage_layer
from jaxpar.models import Context, Decoder, KVCache
from jaxpar.spec import Module, Phase

PREFILL, DECODE = Phase.PREFILL, Phase.DECODE
ATTENTION, EMBEDDING, LM_HEAD = Module.ATTENTION, Module.EMBEDDING, Module.LM_HEAD
BTD = ("batch", "seq", "embed")
# A stage's prefill K/V with the microbatch index after the batch rows.
STAGE_KV_AXES = (None, "batch", None, "cache_seq", "kv_heads", "head_dim")

# --- the schedule: which work a stage does at which iteration --------------------------


def stage_slot(i: jax.Array, s: jax.Array, count: int) -> tuple[jax.Array | int, jax.Array]:
    """Microbatch (or group) ``i - s`` of ``count``, run by stage ``s`` at iteration ``i``.

    Returns ``(read, write)``: the index clipped into range for reading, and the index for
    writing, ``count`` (so dropped) while the stage is in a bubble: during the fill
    (``i < s``) and the drain (``i - s >= count``); in the steady state both are ``i - s``.
    With one slot the read index is the constant 0, which XLA folds into plain slices.
    """
    index = i - s
    valid = (index >= 0) & (index < count)
    read = 0 if count == 1 else jnp.clip(index, 0, count - 1)
    return read, jnp.where(valid, index, count)


def pipeline_iteration(carry, i, *, stages: Stages, state_P, x_emb, stage_step, head):
    """Iteration ``i``: every stage runs ``stage_step`` on its slot, the last stage's
    ``head`` reads what it finished, and the roll hands every stage's output to the next.

    ``carry`` is ``(activations [P, ...], k, v, out)``; ``stage_step(s, state, x, x_emb, k,
    v, i=i)`` and ``head(s, x, out, i=i)`` are stage-local (run under :meth:`Stages.map`).
    """
    buf, k, v, out = carry
    buf, k, v = stages.map(functools.partial(stage_step, i=i))(state_P, buf, x_emb, k, v)
    # Only iterations where the last stage finishes a microbatch pay for the LM head.
    out = jax.lax.cond(
        i >= stages.count - 1,
        lambda: stages.map(functools.partial(head, i=i))(buf, out),
        lambda: out,
    )
    return (jnp.roll(buf, 1, axis=0), k, v, out), None


def run_schedule(stages: Stages, count: int, init, **iteration_args):
    """Fill, steady state and drain: ``count + P - 1`` :func:`pipeline_iteration` s."""
    iteration = functools.partial(pipeline_iteration, stages=stages, **iteration_args)
    steps = jnp.arange(count + stages.count - 1, dtype=jnp.int32)
    carry, _ = jax.lax.scan(iteration, init, steps)
    return carry


def last_position(x_BTD: jax.Array, lengths_B: jax.Array) -> jax.Array:
    """Each row's hidden state at its last prompt position, ``[B, D]``.

    A one-hot select, not an index: take_along_axis makes XLA's SPMD partitioner abort (a
    CHECK in ExpandDeviceGroupsWithIota) inside the pp-manual shard_map with sp > 1 (jax
    0.10.2), and x[arange(B), lengths - 1] gathers across the batch shards. The select
    needs only the minimal all-reduce over sp.
    """
    last_B1 = (lengths_B - 1)[:, None]
    at_last_BT = jnp.arange(x_BTD.shape[1])[None, :] == last_B1
    return jnp.sum(jnp.where(at_last_BT[..., None], x_BTD, 0), axis=1)


# --- prefill: stage-local steps ----------------------------------------------------------


def prefill_layer(
    j, carry, *, graphdef, state_Lp, pos_BmT, lengths_Bm, write, first=0, context=None
):
    """Layer ``j`` of a stage on one microbatch; its K/V go to slot ``write``. ``first``:
    the stage's first model-wide layer index (layers may differ: Gemma's windows).
    ``context``: the microbatch's cached ``(k [Lp, Bm, C, K, H], v, start_Bm)`` it
    continues (chunked prefill, prefix hits), or None."""
    x_BmTD, k_buf, v_buf = carry
    layer = nnx.merge(graphdef, stage_layer(state_Lp, j))
    ctx = None
    if context is not None:
        ctx_k, ctx_v, start_Bm = context
        ctx = Context(ctx_k[j], ctx_v[j], start_Bm)
    x_BmTD, k_BmTKH, v_BmTKH = layer.prefill(x_BmTD, pos_BmT, lengths_Bm, ctx, first + j)
    k_buf = k_buf.at[j, :, write].set(k_BmTKH, mode="drop")
    v_buf = v_buf.at[j, :, write].set(v_BmTKH, mode="drop")
    return x_BmTD, k_buf, v_buf


def prefill_stage(
    s, state_Lp, x_BmTD, x_emb_BmMTD, k_buf, v_buf, *, i, graphdef, lengths_BmM, pos_BmMT, lp
):
    """Stage ``s`` at iteration ``i``: its ``lp`` layers on its microbatch (stage 0 takes
    the next one from the embedding). With context, ``k_buf`` and ``v_buf`` come as
    ``(buffer, cached [Lp, B, C, K, H], start_BmM)`` (the cache a stage's own block) and
    go back alike, the cache wrapped in :class:`Blocks` again."""
    m_count = lengths_BmM.shape[1]
    read, write = stage_slot(i, s, m_count)
    x_BmTD = jnp.where(s == 0, x_emb_BmMTD[:, jnp.minimum(i, m_count - 1)], x_BmTD)
    context = None
    if isinstance(k_buf, tuple):  # new tokens continuing cached ones
        (k_buf, ctx_k, start_BmM), (v_buf, ctx_v, _) = k_buf, v_buf

        def rows(x_LpBCKH):  # the microbatch's rows: b % M == read
            lp_, b = x_LpBCKH.shape[:2]
            return x_LpBCKH.reshape(lp_, b // m_count, m_count, *x_LpBCKH.shape[2:])[:, :, read]

        context = (rows(ctx_k), rows(ctx_v), start_BmM[:, read])
    layer = functools.partial(
        prefill_layer,
        graphdef=graphdef,
        state_Lp=state_Lp,
        pos_BmT=pos_BmMT[:, read],
        lengths_Bm=lengths_BmM[:, read],
        write=write,
        first=s * lp,
        context=context,
    )
    x_BmTD, k_buf, v_buf = jax.lax.fori_loop(0, lp, layer, (x_BmTD, k_buf, v_buf))
    if context is None:
        return x_BmTD, k_buf, v_buf
    return x_BmTD, (k_buf, Blocks(ctx_k), start_BmM), (v_buf, Blocks(ctx_v), start_BmM)


def prefill_head(s, x_BmTD, logits_buf, *, i, model: Decoder, lengths_BmM, all_logits: bool):
    """The LM head on what stage ``s`` finished at iteration ``i`` (meaningful at ``P - 1``)."""
    read, write = stage_slot(i, s, lengths_BmM.shape[1])
    if not all_logits:
        x_BmTD = last_position(x_BmTD, lengths_BmM[:, read])  # -> x_BmD
    return logits_buf.at[:, write].set(model.logits(x_BmTD), mode="drop")


def prefill(
    model: Decoder,
    tokens_BT: jax.Array,
    lengths_B: jax.Array,
    stages: Stages,
    *,
    microbatches: int,
    all_logits: bool = False,
    context: tuple | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GPipe prefill: ``M`` microbatches through ``P`` stages in ``M + P - 1`` iterations.

    At iteration ``i`` stage ``s`` runs microbatch ``i - s`` (fill, steady state, drain).
    ``context``: ``(k, v, start_B)``, every layer's cached keys and values ``[L, B, C,
    K, H]`` (layers over ``pp``, as the stacked pool's pages read back) that the tokens
    continue from positions ``start_B`` on (see ``Decoder.prefill``); each stage reads
    its own layers' block.

    Returns:
        (logits ``[P, B, V]`` (``[P, B, T, V]`` if ``all_logits``), meaningful at stage
        ``P - 1``; k and v ``[L, B, T, K, H]`` in the prefill layout, layers over ``pp``).
    """
    cfg, p, m_count = model.config, stages.count, microbatches
    b, t = tokens_BT.shape
    bm, lp = b // m_count, cfg.n_layers // p
    lengths_BmM = lengths_B.astype(jnp.int32).reshape(bm, m_count)
    pos_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if context is not None:
        start_B = context[2].astype(jnp.int32)
        pos_BT = pos_BT + start_B[:, None]
    pos_BmMT = pos_BT.reshape(bm, m_count, t)
    graphdef, state_P = stages.split_layers(model)

    # The embedding runs once per stage, like its weights replicated over pp, inside the
    # stage map so no op of it can involve another stage; stage 0 injects one microbatch
    # per iteration.
    def embed(_, tokens_BT):
        return model.embed(tokens_BT, pos_BT).reshape(bm, m_count, t, cfg.d_model)

    tokens_PBT = stages.constrain(
        jnp.broadcast_to(tokens_BT, (p, b, t)), ("batch", "seq"), EMBEDDING, PREFILL
    )
    kv_shape = (p, lp, bm, m_count, t, cfg.n_kv_heads, cfg.head_dim)
    kv_zeros = stages.constrain(jnp.zeros(kv_shape, cfg.dtype), STAGE_KV_AXES, ATTENTION, PREFILL)
    logits_axes = ("batch", None, "seq", "vocab") if all_logits else ("batch", None, "vocab")
    logits_shape = (p, bm, m_count, *((t,) if all_logits else ()), cfg.vocab_size)
    k_init = v_init = kv_zeros
    if context is not None:  # the cached K/V ride along, each stage's block untouched
        start_PBmM = jnp.broadcast_to(start_B.reshape(bm, m_count), (p, bm, m_count))
        start_PBmM = stages.constrain(start_PBmM, ("batch", None), ATTENTION, PREFILL)
        k_init = (kv_zeros, Blocks(context[0]), start_PBmM)
        v_init = (kv_zeros, Blocks(context[1]), start_PBmM)
    init = (
        stages.constrain(jnp.zeros((p, bm, t, cfg.d_model), cfg.dtype), BTD, ATTENTION, PREFILL),
        k_init,
        v_init,
        stages.constrain(jnp.zeros(logits_shape, jnp.float32), logits_axes, LM_HEAD, PREFILL),
    )
    _, k_buf, v_buf, logits_buf = run_schedule(
        stages,
        m_count,
        init,
        state_P=state_P,
        x_emb=stages.map(embed)(tokens_PBT),
        stage_step=functools.partial(
            prefill_stage, graphdef=graphdef, lengths_BmM=lengths_BmM, pos_BmMT=pos_BmMT, lp=lp
        ),
        head=functools.partial(
            prefill_head, model=model, lengths_BmM=lengths_BmM, all_logits=all_logits
        ),
    )
    if context is not None:
        k_buf, v_buf = k_buf[0], v_buf[0]
    # [P, Lp] -> L and [B/M, M] -> B are both local: the sharded dim stays the major one.
    kv_LBTKH = (cfg.n_layers, b, t, cfg.n_kv_heads, cfg.head_dim)
    logits = logits_buf.reshape(p, b, *logits_shape[3:])
    return logits, k_buf.reshape(kv_LBTKH), v_buf.reshape(kv_LBTKH)


# --- decode: stage-local steps -----------------------------------------------------------


def decode_layer(j, carry, *, graphdef, state_Lp, pos_Bg, first=0):
    """Layer ``j`` of a stage on one group's tokens, writing into the group's cache view
    (model-wide layer ``first + j``)."""
    x_Bg1D, view = carry
    layer = nnx.merge(graphdef, stage_layer(state_Lp, j))
    return layer.decode(x_Bg1D, pos_Bg, j, view, first + j)


def decode_stage(
    s, state_Lp, x_Bg1D, x_emb_BgG1D, k_LpBSKH, v_LpBSKH, *, i, graphdef, lengths_B, pos_BgG, lp
):
    """Stage ``s`` at iteration ``i``: its ``lp`` layers on its group (stage 0 takes the
    next group from the embedding); in a bubble every cache write is dropped. The cache
    comes as the stage's own layer-major block (:class:`Blocks`) and goes back as one."""
    g_count = pos_BgG.shape[1]
    read, write = stage_slot(i, s, g_count)
    x_Bg1D = jnp.where(s == 0, x_emb_BgG1D[:, read], x_Bg1D)
    view = GroupCacheView.open(k_LpBSKH, v_LpBSKH, read, g_count, lengths_B, write < g_count)
    layer = functools.partial(
        decode_layer, graphdef=graphdef, state_Lp=state_Lp, pos_Bg=pos_BgG[:, read], first=s * lp
    )
    x_Bg1D, view = jax.lax.fori_loop(0, lp, layer, (x_Bg1D, view))
    return x_Bg1D, Blocks(view.k_LBSKH), Blocks(view.v_LBSKH)


def decode_head(s, x_Bg1D, out, *, i, model: Decoder, groups: int, emit):
    """``emit`` of the logits of what stage ``s`` finished at iteration ``i``."""
    read, write = stage_slot(i, s, groups)
    return out.at[:, write].set(emit(model.logits(x_Bg1D[:, 0]), read), mode="drop")


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
        cache: decode-layout cache, stacked ``[L, B, S, K, H]``, layers over ``pp`` (with
            ``kv_cache_dtype``: quantized values and their ``[L, B, S, K, 1]`` scales, split
            alike; the handoff quantized the prompt's K/V once, each step quantizes its token).
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
    graphdef, state_P = stages.split_layers(model)

    # Each stage embeds its own row of tokens (only stage 0's is real), so no stage needs
    # tokens that another holds.
    def embed(_, tokens_B):
        return model.embed(tokens_B[:, None], cache.lengths_B[:, None])

    x_PBgG1D = stages.map(embed)(tokens_PB).reshape(p, bg, g_count, 1, cfg.d_model)
    out_shape = (p, bg, g_count, *emitted.shape[1:])
    out_axes = (emitted_axes[0], None, *emitted_axes[1:])
    init = (
        stages.constrain(jnp.zeros((p, bg, 1, cfg.d_model), cfg.dtype), BTD, ATTENTION, DECODE),
        Blocks(cache.k),  # layer-major: each stage's [Lp, ...] block, no reshape
        Blocks(cache.v),
        stages.constrain(jnp.zeros(out_shape, emitted.dtype), out_axes, LM_HEAD, DECODE),
    )
    _, k, v, out = run_schedule(
        stages,
        g_count,
        init,
        state_P=state_P,
        x_emb=x_PBgG1D,
        stage_step=functools.partial(
            decode_stage,
            graphdef=graphdef,
            lengths_B=cache.lengths_B,
            pos_BgG=cache.lengths_B.reshape(bg, g_count),
            lp=lp,
        ),
        head=functools.partial(decode_head, model=model, groups=g_count, emit=emit),
    )
    cache = cache.replace(k=k.tree, v=v.tree)
    return out.reshape(p, b, *emitted.shape[1:]), cache.advance()


# --- what the schedule costs -------------------------------------------------------------


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
