"""Ring attention for prefill under sequence parallelism, in a load-balanced token order.

Under ``sp`` each device holds ``T / sp`` of a prompt's tokens. The gather path
(:func:`~jaxpar.models._attention_ops.prefill_attention`) all-gathers K and V, so every
device holds the whole prompt's keys and an f32 score block ``[T / sp, T]`` per head.
Here the local K/V block instead travels around the ``sp`` ring: ``sp - 1``
``ppermute`` steps, each device attending its own queries to the block it holds with
flash-style online softmax (f32 running max, sum and output), so a device holds two K/V
blocks (the one it reads and the one arriving) and a score block of ``[T / sp, T / 2sp]``.

**Load balance (zigzag order).** With contiguous chunks, causal attention gives the last
device every key and the first almost none, and a ring runs at its slowest device's pace.
The prompt is cut into ``2 sp`` half-chunks and device ``j`` holds half-chunks ``j`` and
``2 sp - 1 - j`` (a head and a tail). Then, at every step but the first, each device does
exactly half a block of work, with no mask to build beyond padding and windows: if the
arriving block came from a device ``i < j``, every local query sees the block's first
half-chunk and none of its second; if ``i > j``, only the local tail queries see it, and
all of it. :func:`to_zigzag` puts a sequence-split array into that order (two
``ppermute`` of half the local block) and :func:`from_zigzag` takes it back. The decoder
reorders the token ids once at its input (positions are computed, not moved), runs every
layer in zigzag order (all other layers act per token), returns each layer's K/V to the
natural order for the cache, and picks the last token's hidden state by its zigzag slot.

Windows (Gemma's sliding layers, static or traced) and soft caps act on each score as on
the gather path; GPT-OSS's sinks join the final denominator. Padding keys
(``position >= length``) are masked; padding queries give finite, unused outputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.models._attention_kernels import MASKED, key_mask, local_kv_heads
from jaxpar.spec import Module, active_mesh_axes, logical_shard_map

#: K/V and queries stay split over the sequence on the ring path (no gather).
RING_KV_AXES = ("batch", "seq", "kv_heads", "head_dim")
_Q_AXES = ("batch", "seq", "heads", "head_dim")


def ring_fits(tokens: int, sp: int) -> bool:
    """Whether ``tokens`` padded positions cut into ``2 sp`` equal half-chunks."""
    return sp > 1 and tokens % (2 * sp) == 0


def zigzag_positions(tokens: int, sp: int) -> np.ndarray:
    """The original position held at each slot of the zigzag order, ``[T]`` int32:
    device ``j``'s slots hold half-chunks ``j`` then ``2 sp - 1 - j``."""
    half = tokens // (2 * sp)
    order = [h for j in range(sp) for h in (j, 2 * sp - 1 - j)]
    return np.concatenate([np.arange(h * half, (h + 1) * half) for h in order]).astype(np.int32)


def zigzag_slots(tokens: int, sp: int) -> np.ndarray:
    """The inverse of :func:`zigzag_positions`: the slot of each original position."""
    return np.argsort(zigzag_positions(tokens, sp)).astype(np.int32)


def _half_dest(h: int, sp: int) -> int:
    """The device whose zigzag slots hold half-chunk ``h``."""
    return h if h < sp else 2 * sp - 1 - h


def _reorder(x: jax.Array, axes: tuple[str | None, ...], forward: bool) -> jax.Array:
    """``x`` (split over the sequence along ``axes.index("seq")`` or ``"cache_seq"``)
    moved into (``forward``) or out of the zigzag order: two ``ppermute`` of half the local
    block, one carrying the even half-chunks and one the odd (each device sends one of
    each and receives one of each, so both are permutations)."""
    dim = axes.index("seq") if "seq" in axes else axes.index("cache_seq")
    ring = active_mesh_axes(axes[dim], Module.ATTENTION)

    def body(x_local: jax.Array) -> jax.Array:
        sp = jax.lax.axis_size(ring)
        me = jax.lax.axis_index(ring)
        half = x_local.shape[dim] // 2
        first, second = jnp.split(x_local, [half], axis=dim)
        even_first = me % 2 == 0
        if forward:  # natural -> zigzag: half-chunk 2i and 2i + 1 leave device i
            evens = [(i, _half_dest(2 * i, sp)) for i in range(sp)]
            odds = [(i, _half_dest(2 * i + 1, sp)) for i in range(sp)]
            got_even = jax.lax.ppermute(first, ring, evens)
            got_odd = jax.lax.ppermute(second, ring, odds)
            # Device j's head slot holds half-chunk j: even when j is.
            head = jnp.where(even_first, got_even, got_odd)
            tail = jnp.where(even_first, got_odd, got_even)
            return jnp.concatenate([head, tail], axis=dim)
        # zigzag -> natural: device j holds half-chunks j and 2sp-1-j (one even, one odd).
        even_part = jnp.where(even_first, first, second)
        odd_part = jnp.where(even_first, second, first)
        evens = [(j, (j if j % 2 == 0 else 2 * sp - 1 - j) // 2) for j in range(sp)]
        odds = [(j, (2 * sp - 1 - j if j % 2 == 0 else j) // 2) for j in range(sp)]
        got_even = jax.lax.ppermute(even_part, ring, evens)
        got_odd = jax.lax.ppermute(odd_part, ring, odds)
        return jnp.concatenate([got_even, got_odd], axis=dim)

    return logical_shard_map(body, in_axes=(axes,), out_axes=axes, module=Module.ATTENTION)(x)


def to_zigzag(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """``x``, split over the sequence (logical ``axes``), in the zigzag order."""
    return _reorder(x, tuple(axes), forward=True)


def from_zigzag(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """``x`` in zigzag order back in the natural order (:func:`to_zigzag`'s inverse)."""
    return _reorder(x, tuple(axes), forward=False)


def _slot_positions(device: jax.Array, sp: int, chunk: int) -> jax.Array:
    """Positions ``[chunk]`` of the zigzag slots of ``device`` (traced index)."""
    half = chunk // 2
    ar = jnp.arange(half, dtype=jnp.int32)
    return jnp.concatenate([device * half + ar, (2 * sp - 1 - device) * half + ar])


def _block(q_BKGTH, q_pos_T, k_BSKH, v_BSKH, k_pos_S, lengths_B, window, scale, softcap):
    """Softmax statistics of queries over one key block: (max ``[B,K,G,T]``, sum, unnormalised
    output ``[B,K,G,T,H]``), all f32; rows that see no key give (MASKED, 0, 0)."""
    b, t = q_BKGTH.shape[0], q_BKGTH.shape[3]
    s_BKGTS = jnp.einsum(
        "BKGTH,BSKH->BKGTS", q_BKGTH, k_BSKH.astype(q_BKGTH.dtype),
        preferred_element_type=jnp.float32,
    ) * scale  # fmt: skip
    if softcap is not None:
        s_BKGTS = jnp.tanh(s_BKGTS / softcap) * softcap
    valid_BS = k_pos_S[None, :] < lengths_B[:, None]
    mask_BTS = key_mask(jnp.broadcast_to(q_pos_T, (b, t)), k_pos_S, valid_BS, window)
    mask_B11TS = mask_BTS[:, None, None]
    s_BKGTS = jnp.where(mask_B11TS, s_BKGTS, MASKED)
    m_BKGT = jnp.max(s_BKGTS, axis=-1)
    p_BKGTS = jnp.where(mask_B11TS, jnp.exp(s_BKGTS - m_BKGT[..., None]), 0.0)
    l_BKGT = jnp.sum(p_BKGTS, axis=-1)
    o_BKGTH = jnp.einsum(
        "BKGTS,BSKH->BKGTH", p_BKGTS.astype(v_BSKH.dtype), v_BSKH,
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    return m_BKGT, l_BKGT, o_BKGTH


#: Queries and keys per tile inside a ring step: a step's ``[T / sp, T / 2 sp]`` scores are
#: taken tile by tile (keys scanned with online softmax, query tiles mapped), so no score
#: block larger than ``[heads, Q_TILE, K_TILE]`` f32 is held, at any prompt length.
Q_TILE = 1024
K_TILE = 512


def _tiled_block(q_BKGTH, q_pos_T, k_BSKH, v_BSKH, k_pos_S, **kw):
    """:func:`_block` taken in tiles of :data:`Q_TILE` queries and :data:`K_TILE` keys
    (where they divide; whole otherwise): the same statistics, bounded temporaries."""
    b, kh, g, t, h = q_BKGTH.shape
    s = k_BSKH.shape[1]
    if t > Q_TILE and t % Q_TILE == 0:
        n = t // Q_TILE
        q_nBKGTH = q_BKGTH.reshape(b, kh, g, n, Q_TILE, h).transpose(3, 0, 1, 2, 4, 5)
        pos_nT = q_pos_T.reshape(n, Q_TILE)

        def one(xs):
            return _tiled_block(xs[0], xs[1], k_BSKH, v_BSKH, k_pos_S, **kw)

        m_n, l_n, o_n = jax.lax.map(one, (q_nBKGTH, pos_nT))
        m_BKGT = m_n.transpose(1, 2, 3, 0, 4).reshape(b, kh, g, t)
        l_BKGT = l_n.transpose(1, 2, 3, 0, 4).reshape(b, kh, g, t)
        o_BKGTH = o_n.transpose(1, 2, 3, 0, 4, 5).reshape(b, kh, g, t, h)
        return m_BKGT, l_BKGT, o_BKGTH
    if s > K_TILE and s % K_TILE == 0:
        n = s // K_TILE
        k_nBSKH = k_BSKH.reshape(b, n, K_TILE, *k_BSKH.shape[2:]).swapaxes(0, 1)
        v_nBSKH = v_BSKH.reshape(b, n, K_TILE, *v_BSKH.shape[2:]).swapaxes(0, 1)
        pos_nS = k_pos_S.reshape(n, K_TILE)
        init = (
            jnp.full((b, kh, g, t), MASKED, jnp.float32),
            jnp.zeros((b, kh, g, t), jnp.float32),
            jnp.zeros((b, kh, g, t, h), jnp.float32),
        )

        def step(acc, xs):
            return _merge(acc, _block(q_BKGTH, q_pos_T, *xs, **kw)), None

        acc, _ = jax.lax.scan(step, init, (k_nBSKH, v_nBSKH, pos_nS))
        return acc
    return _block(q_BKGTH, q_pos_T, k_BSKH, v_BSKH, k_pos_S, **kw)


def _merge(acc, blk):
    """Two partial softmaxes over disjoint keys, as one (the online-softmax update)."""
    m0, l0, o0 = acc
    m1, l1, o1 = blk
    m = jnp.maximum(m0, m1)
    a, b = jnp.exp(m0 - m), jnp.exp(m1 - m)
    return m, a * l0 + b * l1, a[..., None] * o0 + b[..., None] * o1


def _ring_body(
    q_BTNH, k_BTKH, v_BTKH, lengths_B, head_ids_N, *extra,
    ring, group, scale, softcap, window, traced_window, has_sinks,
):  # fmt: skip
    sinks_N = extra[0] if has_sinks else None
    if traced_window:
        window = extra[-1]
    sp = jax.lax.axis_size(ring)
    me = jax.lax.axis_index(ring)
    b, c, n, h = q_BTNH.shape
    half = c // 2
    k_BTKH, v_BTKH = local_kv_heads(k_BTKH, v_BTKH, n, group, head_ids_N)
    kh = k_BTKH.shape[2]
    q_BKGTH = q_BTNH.reshape(b, c, kh, n // kh, h).transpose(0, 2, 3, 1, 4)
    q_pos_T = _slot_positions(me, sp, c)
    block = functools.partial(
        _tiled_block, lengths_B=lengths_B, window=window, scale=scale, softcap=softcap
    )
    # Diagonal step: the device's own block, causally masked.
    acc = block(q_BKGTH, q_pos_T, k_BTKH, v_BTKH, q_pos_T)
    kv = (k_BTKH, v_BTKH)
    shift = [(i, (i + 1) % sp) for i in range(sp)]
    for step in range(1, sp):
        kv = jax.lax.ppermute(kv, ring, shift)
        src = (me - step) % sp
        k_pos_S = _slot_positions(src, sp, c)

        def earlier(acc, kv, k_pos_S=k_pos_S):
            # Every local query sees the source's head half-chunk, none of its tail.
            k_BSKH, v_BSKH = kv[0][:, :half], kv[1][:, :half]
            return _merge(acc, block(q_BKGTH, q_pos_T, k_BSKH, v_BSKH, k_pos_S[:half]))

        def later(acc, kv, k_pos_S=k_pos_S):
            # Only the local tail queries see the block, all of it.
            q_tail = q_BKGTH[:, :, :, half:]
            tail = _merge(
                tuple(x[:, :, :, half:] for x in acc),
                block(q_tail, q_pos_T[half:], kv[0], kv[1], k_pos_S),
            )
            return tuple(
                jnp.concatenate([x[:, :, :, :half], y], axis=3)
                for x, y in zip(acc, tail, strict=True)
            )

        acc = jax.lax.cond(src < me, earlier, later, acc, kv)
    m_BKGT, l_BKGT, o_BKGTH = acc
    if sinks_N is not None:  # a key whose value is zero, in every row's denominator
        sink_1KG1 = sinks_N.astype(jnp.float32).reshape(1, kh, n // kh, 1)
        m_new = jnp.maximum(m_BKGT, sink_1KG1)
        a = jnp.exp(m_BKGT - m_new)
        l_BKGT = a * l_BKGT + jnp.exp(sink_1KG1 - m_new)
        o_BKGTH = a[..., None] * o_BKGTH
    out_BKGTH = o_BKGTH / jnp.where(l_BKGT > 0, l_BKGT, 1.0)[..., None]
    return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(b, c, n, h).astype(q_BTNH.dtype)


def ring_prefill_attention(
    q_BTNH: jax.Array,
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    *,
    lengths_B: jax.Array,
    window: int | jax.Array | None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks_N: jax.Array | None = None,
) -> jax.Array:
    """Causal prefill attention of a prompt laid out in zigzag order over ``sp`` (see the
    module docstring), by ring: the result of
    :func:`~jaxpar.models._attention_ops.prefill_attention` over the same tokens, in the
    same (zigzag) order.

    Args:
        q_BTNH: Queries, the sequence in zigzag order and split over ``sp``.
        k_BTKH: Keys of the same tokens, in the same order; v_BTKH likewise.
        lengths_B: Real tokens per row (positions ``>= length`` are padding).
        window: Sliding window (None, an int, or a traced int32 for stacked layers).
        scale: Score scale; None: ``1/sqrt(H)``.
        softcap: Gemma 2's score soft cap, or None.
        sinks_N: GPT-OSS's per-head sink logits, or None.

    Returns:
        out_BTNH in q's dtype, zigzag order.
    """
    b, t, n, h = q_BTNH.shape
    ring = active_mesh_axes("seq", Module.ATTENTION)
    traced_window = window is not None and not isinstance(window, int)
    body = functools.partial(
        _ring_body,
        ring=ring,
        group=n // k_BTKH.shape[2],
        scale=h**-0.5 if scale is None else scale,
        softcap=softcap,
        window=None if traced_window else window,
        traced_window=traced_window,
        has_sinks=sinks_N is not None,
    )
    args = [q_BTNH, k_BTKH, v_BTKH, lengths_B, jnp.arange(n, dtype=jnp.int32)]
    in_axes: list = [_Q_AXES, RING_KV_AXES, RING_KV_AXES, ("batch",), ("heads",)]
    if sinks_N is not None:
        args.append(sinks_N)
        in_axes.append(("heads",))
    if traced_window:
        args.append(jnp.asarray(window, jnp.int32))
        in_axes.append(None)
    sharded = logical_shard_map(body, in_axes=in_axes, out_axes=_Q_AXES, module=Module.ATTENTION)
    return sharded(*args)
