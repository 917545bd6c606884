"""Decode attention over the paged KV cache (:mod:`jaxpar.models._paged`).

Implementations, chosen by the model's ``decode_attention`` as for the contiguous cache:

- ``"xla"`` (every backend, the reference): each row's pages are gathered from the pool,
  ``[K, B, N * Z, H]``, and attended to with f32 scores and softmax. The gather reads only
  the ``N`` pages of the block tables the step was given, so a step's cost follows its
  live rows; nothing copies the pool.

Every implementation runs per shard inside :func:`jaxpar.spec.logical_shard_map`: block
tables hold page ids local to their batch shard (see ``_paged``), which only the shard's
own slice of the pool resolves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.models._attention_kernels import MASKED, key_mask, kv_replicated
from jaxpar.models._paged import PAGE_AXES, TABLE_AXES, PagedLayer
from jaxpar.spec import Module, logical_shard_map

DECODE_Q_AXES = ("batch", "heads", "head_dim")


def paged_xla(q_BNH, k_KAZH, v_KAZH, tables_BN, lengths_B, head_ids_N, *, group, window):
    """One shard of grouped decode attention over the rows' pages (see the module doc).

    ``lengths_B``: valid keys per row, the new token included (its query sits at
    ``lengths_B - 1``). ``head_ids_N``: this shard's global query-head ids (to find the kv
    head when kv heads are replicated over tp).
    """
    b, n, h = q_BNH.shape
    k_local = k_KAZH.shape[0]
    s = tables_BN.shape[1] * k_KAZH.shape[2]
    if kv_replicated(n, k_local, group):
        # Every local query head reads the one kv head of its group: gather only its pages.
        kv = head_ids_N[0] // group
        k_KBSH = k_KAZH[kv, tables_BN].reshape(1, b, s, h)
        v_KBSH = v_KAZH[kv, tables_BN].reshape(1, b, s, h)
        q_KBGH = q_BNH[None]
    else:
        k_KBSH = k_KAZH[:, tables_BN].reshape(k_local, b, s, h)
        v_KBSH = v_KAZH[:, tables_BN].reshape(k_local, b, s, h)
        q_KBGH = q_BNH.reshape(b, k_local, group, h).transpose(1, 0, 2, 3)
    k_KBSH, v_KBSH = k_KBSH.astype(q_BNH.dtype), v_KBSH.astype(q_BNH.dtype)
    # (K, B) lead both operands, in that order: batched dots with no transpose of the
    # gathered keys and values.
    s_KBGS = jnp.einsum("KBGH,KBSH->KBGS", q_KBGH, k_KBSH, preferred_element_type=jnp.float32)
    s_KBGS = s_KBGS * (h**-0.5)
    k_pos_S = jnp.arange(s, dtype=jnp.int32)
    valid_BS = k_pos_S[None, :] < lengths_B[:, None]
    mask_BS = key_mask((lengths_B - 1)[:, None], k_pos_S, valid_BS, window)[:, 0]
    s_KBGS = jnp.where(mask_BS[None, :, None], s_KBGS, MASKED)
    p_KBGS = jax.nn.softmax(s_KBGS, axis=-1).astype(q_BNH.dtype)
    out_KBGH = jnp.einsum("KBGS,KBSH->KBGH", p_KBGS, v_KBSH, preferred_element_type=jnp.float32)
    return out_KBGH.transpose(1, 0, 2, 3).reshape(b, n, h).astype(q_BNH.dtype)


def paged_decode_attention(
    q_BNH: jax.Array,
    kv: PagedLayer,
    *,
    lengths_B: jax.Array,
    window: int | None,
    impl: str = "auto",
) -> jax.Array:
    """One new query per row over its pages, which already hold its key and value.

    Args:
        q_BNH: The new token's queries.
        kv: The layer's pool ``[K, A, Z, H]`` and the rows' block tables ``[B, N]``.
        lengths_B: Valid keys per row, the new token included.
        window: Sliding-window size, or None.
        impl: The model's ``decode_attention`` choice.

    Returns:
        out_BNH in q's dtype.
    """
    del impl  # every backend runs the XLA gather path
    n = q_BNH.shape[1]
    body = functools.partial(paged_xla, group=n // kv.k_KAZH.shape[0], window=window)
    sharded = logical_shard_map(
        body,
        in_axes=(DECODE_Q_AXES, PAGE_AXES, PAGE_AXES, TABLE_AXES, ("batch",), ("heads",)),
        out_axes=DECODE_Q_AXES,
        module=Module.ATTENTION,
    )
    heads_N = jnp.arange(n, dtype=jnp.int32)
    return sharded(q_BNH, kv.k_KAZH, kv.v_KAZH, kv.block_tables_BN, lengths_B, heads_N)
