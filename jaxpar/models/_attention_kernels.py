"""Per-shard bodies of the fused attention paths (cuDNN prefill and decode, Pallas TPU splash,
Pallas GPU decode, Pallas GPU and TPU paged decode, prefill over cached context through TPU
ragged paged attention or cuDNN).

Each body runs inside :func:`jaxpar.spec.logical_shard_map` (or on whole arrays outside a
sharding context) and sees only local shards. What a shard cannot read off its own shapes
comes in as sharded iotas: ``head_ids_N`` (global index of each local query head) and
``seq_ids_T`` (global index of each local query), so no mesh axis is named here.

The Pallas modules are imported lazily and guarded, so this module imports on every install.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import jax
import jax.numpy as jnp

from jaxpar.errors import ConfigError

# Same finite fill as the XLA path and both Pallas kernels (-0.7 * f32 max).
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def key_mask(
    q_pos_BT: jax.Array, k_pos_S: jax.Array, k_valid_BS: jax.Array, window: int | None
) -> jax.Array:
    """Keys each query may see: causal, valid (not padding), inside the window.

    Hugging Face window semantics: key j is visible from query i iff ``i - window < j <= i``.
    ``k_pos_S`` is ``[S]``, or ``[B, S]`` when rows' keys sit at different positions.

    Returns:
        Boolean [B, T, S].
    """
    q_BT1 = q_pos_BT[:, :, None]
    # Key positions shared by every row ([S]) or per row ([B, S]: cached keys, then new).
    k_x1S = k_pos_S[None, None, :] if k_pos_S.ndim == 1 else k_pos_S[:, None, :]
    mask_BTS = (k_x1S <= q_BT1) & k_valid_BS[:, None, :]
    if window is not None:
        mask_BTS &= k_x1S > q_BT1 - window
    return mask_BTS


def kv_replicated(n_local: int, k_local: int, group: int) -> bool:
    """Whether this shard holds every kv head while its query heads lie in one group.

    When tp splits kv_heads with heads, local K/V match the local query heads. When kv heads
    are replicated over tp (``n_kv_heads < tp``, see ``spec._rules._kv_heads_replicated``),
    the shard holds all kv heads and its query heads all read one of them.
    """
    if k_local * group == n_local:
        return False
    if group % n_local:
        raise ConfigError(
            f"{n_local} local query heads with {k_local} local kv heads and group size {group}: "
            "a shard's query heads must cover whole kv groups or lie inside one"
        )
    return True


def local_kv_heads(
    k_BSKH: jax.Array, v_BSKH: jax.Array, n_local: int, group: int, head_ids_N: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """K/V heads this shard's ``n_local`` query heads read (see :func:`kv_replicated`).

    In the replicated case the one kv head is sliced out: an activation-sized slice in
    prefill, never a cache read.
    """
    if not kv_replicated(n_local, k_BSKH.shape[2], group):
        return k_BSKH, v_BSKH
    kv = head_ids_N[0] // group
    take = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=kv, slice_size=1, axis=2)
    return take(k_BSKH), take(v_BSKH)


def spread_to_kv_head(
    q_BNH: jax.Array, k_local: int, group: int, head_ids_N: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Decode queries placed under the one kv head they read, when kv heads are replicated
    over tp (see :func:`kv_replicated`): ``q_BKGH`` with G = the local query heads, zeros
    under every other kv head, and that head's one-hot ``[K]``. The cache is then read
    where it lies (slicing the one head out would copy it each step)."""
    one_hot_K = jnp.arange(k_local) == head_ids_N[0] // group
    q_BKGH = jnp.where(one_hot_K[None, :, None, None], q_BNH[:, None], 0).astype(q_BNH.dtype)
    return q_BKGH, one_hot_K


def from_kv_head(out_BKGH: jax.Array, one_hot_K: jax.Array, dtype) -> jax.Array:
    """The outputs under the one kv head :func:`spread_to_kv_head` chose, ``[B, G, H]``."""
    return jnp.sum(jnp.where(one_hot_K[None, :, None, None], out_BKGH, 0), axis=1).astype(dtype)


def zero_padded_rows(out_BTNH: jax.Array, q_pos_BT: jax.Array, lengths_B: jax.Array) -> jax.Array:
    """Zeros the rows of padding queries: kernels leave them unspecified (possibly NaN,
    which would reach the cache and then, through p @ V, real rows)."""
    valid_BT = q_pos_BT < lengths_B[:, None]
    return jnp.where(valid_BT[:, :, None, None], out_BTNH, jnp.zeros((), out_BTNH.dtype))


# --- cuDNN prefill (GPU) --------------------------------------------------------------------


def prefill_cudnn(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    q_pos_BT,
    lengths_B,
    head_ids_N,
    seq_ids_T,
    *,
    group: int,
    window: int | None,
) -> jax.Array:
    """Local shard of prefill through ``jax.nn.dot_product_attention(implementation="cudnn")``."""
    del seq_ids_T
    k_BSKH, v_BSKH = local_kv_heads(k_BSKH, v_BSKH, q_BTNH.shape[2], group, head_ids_N)
    t, s = q_BTNH.shape[1], k_BSKH.shape[1]
    lengths_B = lengths_B.astype(jnp.int32)
    if t == s:
        # Whole sequence here: cuDNN's own causal + padding + sliding-window masks, no mask
        # tensor. Its causal mask is top-left aligned: it takes q_pos_BT[b, t] == t, the
        # documented precondition (the caller sends only T == S). Lengths are clamped to 1
        # so no row is empty; rows past the real length are zeroed below anyway.
        one_B = jnp.maximum(lengths_B, 1)
        out_BTNH = jax.nn.dot_product_attention(
            q_BTNH,
            k_BSKH,
            v_BSKH,
            is_causal=True,
            query_seq_lengths=one_B,
            key_value_seq_lengths=one_B,
            local_window_size=None if window is None else (window - 1, 0),
            implementation="cudnn",
        )
    else:
        # Queries split over the sequence: this shard's rows start at an offset cuDNN's
        # causal mask cannot express, so the mask comes from the absolute positions.
        # Padding rows attend to themselves so that no row is empty. Costs a [B, 1, T/sp, S]
        # bias (cuDNN adds the mask as one), the size of one head's scores.
        k_pos_S = jnp.arange(s, dtype=jnp.int32)
        mask_BTS = key_mask(q_pos_BT, k_pos_S, k_pos_S[None] < lengths_B[:, None], window)
        mask_BTS |= (q_pos_BT >= lengths_B[:, None])[:, :, None] & (
            k_pos_S[None, None] == q_pos_BT[:, :, None]
        )
        out_BTNH = jax.nn.dot_product_attention(
            q_BTNH, k_BSKH, v_BSKH, mask=mask_BTS[:, None], implementation="cudnn"
        )
    return zero_padded_rows(out_BTNH, q_pos_BT, lengths_B)


# --- cuDNN decode (GPU) ---------------------------------------------------------------------


def decode_cudnn(
    q_BNH, k_BKSH, v_BKSH, lengths_B, head_ids_N, *, group: int, window: int | None
) -> jax.Array:
    """Local shard of decode through cuDNN's fused attention, on the [B,K,S,H] cache as is.

    cuDNN takes q, k and v head-major ("BNTH"): the cache's own layout, so nothing is
    transposed. The public ``jax.nn.dot_product_attention`` accepts token-major inputs
    only (a whole-cache transpose per step), hence JAX's own cuDNN wrapper, which it
    calls. One query per row (``q_seqlen`` 1); the padding mask stops each row at its
    length; a sliding window is a ``[B, 1, 1, S]`` mask (cuDNN's own window is aligned to
    the first query, not to the row's length).

    When kv heads are replicated over tp this shard's query heads all read one kv head
    (:func:`spread_to_kv_head`); cuDNN reads every local kv head's cache then.
    """
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    b, n, h = q_BNH.shape
    k_local, s = k_BKSH.shape[1], k_BKSH.shape[2]
    lengths_B = lengths_B.astype(jnp.int32)
    dtype, one_hot_K = q_BNH.dtype, None
    if kv_replicated(n, k_local, group):
        q_BKGH, one_hot_K = spread_to_kv_head(q_BNH, k_local, group, head_ids_N)
        q_BNH = q_BKGH.reshape(b, k_local * n, h)
    mask = None
    if window is not None:
        k_pos_S = jnp.arange(s, dtype=jnp.int32)
        valid_BS = k_pos_S[None] < lengths_B[:, None]
        mask = key_mask((lengths_B - 1)[:, None], k_pos_S, valid_BS, window)[:, None]
    out_BN1H = cudnn.dot_product_attention(
        q_BNH[:, :, None, :],
        k_BKSH,
        v_BKSH,
        mask=mask,
        q_seqlen=jnp.ones((b,), jnp.int32),
        kv_seqlen=jnp.maximum(lengths_B, 1),
        scale=h**-0.5,
        mask_type=cudnn.MaskType.PADDING,
        qkv_layout="BNTH",
    )
    out_BNH = out_BN1H[:, :, 0, :]
    if one_hot_K is not None:
        return from_kv_head(out_BNH.reshape(b, k_local, n, h), one_hot_K, dtype)
    return out_BNH.astype(dtype)


# --- Pallas TPU splash prefill --------------------------------------------------------------


def _largest_divisor(n: int, choices: tuple[int, ...]) -> int | None:
    return next((c for c in choices if n % c == 0 and c <= n), None)


def splash_blocks(t_local: int, s: int) -> tuple[int, int] | None:
    """(block_q, block_kv) for splash, or None where it cannot run (kv blocks are computed
    in multiples of 128 lanes; q blocks must divide the local queries)."""
    block_q = _largest_divisor(t_local, (512, 256, 128, 64, 32, 16, 8))
    block_kv = _largest_divisor(s, (512, 256, 128))
    return None if block_q is None or block_kv is None else (block_q, block_kv)


@functools.cache
def _splash_kernel(
    n_heads: int, t_local: int, s: int, offset: int, window: int | None, interpret: bool
):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if window is None:
        mask = sm.CausalMask((t_local, s), offset=offset)
    else:
        # LocalMask keeps offset + i - (window - 1) <= j <= offset + i: causal and windowed.
        mask = sm.LocalMask((t_local, s), window_size=(window - 1, 0), offset=offset)
    block_q, block_kv = splash_blocks(t_local, s)
    sizes = sk.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=128)
    # Mask info is built eagerly (concrete arrays, cached across layers and traces).
    with jax.ensure_compile_time_eval():
        return sk.make_splash_mha(
            sm.MultiHeadMask([mask] * n_heads),
            block_sizes=sizes,
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )


def prefill_splash(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    q_pos_BT,
    lengths_B,
    head_ids_N,
    seq_ids_T,
    *,
    group: int,
    window: int | None,
    interpret: bool,
) -> jax.Array:
    """Local shard of prefill through the Pallas TPU splash kernel, vmapped over batch.

    Splash masks are static. Causality and the window come from a mask whose row offset is
    this shard's first query index (``seq_ids_T[0]``); with the queries split over the
    sequence in n shards, one kernel per offset is built and ``lax.switch`` picks this
    shard's. Right padding comes in as segment ids (valid tokens 1, padding 0), so real
    queries never see padding keys and every padding query still sees itself (no empty row).
    """
    k_BSKH, v_BSKH = local_kv_heads(k_BSKH, v_BSKH, q_BTNH.shape[2], group, head_ids_N)
    b, t, n, h = q_BTNH.shape
    s = k_BSKH.shape[1]
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    # Splash takes head-major activations (a transpose of activations, not of a cache) and
    # does not scale: 1/sqrt(H) goes on q.
    q_BNTH = (q_BTNH * jnp.asarray(h**-0.5, q_BTNH.dtype)).transpose(0, 2, 1, 3)
    k_BKSH = k_BSKH.transpose(0, 2, 1, 3)
    v_BKSH = v_BSKH.transpose(0, 2, 1, 3)
    lengths_B = lengths_B.astype(jnp.int32)
    segments = sk.SegmentIds(
        q=(q_pos_BT < lengths_B[:, None]).astype(jnp.int32),
        kv=(jnp.arange(s, dtype=jnp.int32)[None] < lengths_B[:, None]).astype(jnp.int32),
    )

    def run(offset: int) -> jax.Array:
        kernel = _splash_kernel(n, t, s, offset, window, interpret)
        return jax.vmap(kernel)(q_BNTH, k_BKSH, v_BKSH, segment_ids=segments)

    if t == s:
        out_BNTH = run(0)
    else:
        branches = [functools.partial(run, i * t) for i in range(s // t)]
        out_BNTH = jax.lax.switch(seq_ids_T[0] // t, branches)
    return zero_padded_rows(out_BNTH.transpose(0, 2, 1, 3), q_pos_BT, lengths_B)


# --- Pallas GPU decode ----------------------------------------------------------------------


def decode_blocks(s: int) -> tuple[int, int] | None:
    """(k_splits, block_k) for the GPU decode kernel over an S-long cache, or None.

    The kernel needs S divisible by k_splits with at least 16 keys per split, and block_k
    (>= 16) dividing a split. More splits give more programs for small batches.
    """
    for k_splits in (16, 8, 4, 2, 1):
        if s % k_splits == 0 and (s // k_splits) % 16 == 0:
            return k_splits, _largest_divisor(s // k_splits, (128, 64, 32, 16))
    return None


def decode_pallas_gpu(
    q_BNH, k_BKSH, v_BKSH, lengths_B, head_ids_N, *, group: int, window: int | None, interpret: bool
) -> jax.Array:
    """Local shard of decode through ``pallas.ops.gpu.decode_attention``, on [B,K,S,H] as is.

    ``decode_attn_unbatched`` is vmapped over (B, K), the two leading cache axes, so the
    kernel reads the cache where it lies (``decode_attention.gqa`` would swap axes: a copy
    of the whole cache). Each (b, k) reads keys ``[start, length)`` only: ``length`` is the
    row's valid count, ``start = length - window`` for sliding windows.
    """
    from jax.experimental.pallas.ops.gpu import decode_attention as da

    b, n, h = q_BNH.shape
    k_local, s = k_BKSH.shape[1], k_BKSH.shape[2]
    lengths_B = lengths_B.astype(jnp.int32)
    if not kv_replicated(n, k_local, group):
        q_BKGH = q_BNH.reshape(b, k_local, group, h)
        len_BK = jnp.broadcast_to(lengths_B[:, None], (b, k_local))
        one_hot_K = None
    else:
        # kv heads replicated over tp: every kv head gets a program but the others get
        # length 0, so the kernel skips them without reading a byte.
        q_BKGH, one_hot_K = spread_to_kv_head(q_BNH, k_local, group, head_ids_N)
        len_BK = jnp.where(one_hot_K[None], lengths_B[:, None], 0)
    start_BK = None if window is None else jnp.maximum(len_BK - window, 0)
    k_splits, block_k = decode_blocks(s)
    options = dict(
        sm_scale=h**-0.5,
        block_h=16,
        block_k=block_k,
        k_splits=k_splits,
        num_warps=None,
        num_stages=2,
        grid=None,
        interpret=interpret,
        debug=False,
        return_residuals=False,
        normalize_output=True,
    )
    # Pass only what the installed kernel takes (its signature has no defaults and has
    # changed across JAX releases).
    accepted = inspect.signature(da.decode_attn_unbatched).parameters
    inner = functools.partial(
        da.decode_attn_unbatched, **{k: v for k, v in options.items() if k in accepted}
    )
    if start_BK is None:

        def inner_no_start(q, k, v, length):
            return inner(q, k, v, None, length)

        out_BKGH = jax.vmap(jax.vmap(inner_no_start))(q_BKGH, k_BKSH, v_BKSH, len_BK)
    else:
        out_BKGH = jax.vmap(jax.vmap(inner))(q_BKGH, k_BKSH, v_BKSH, start_BK, len_BK)
    # The kernel returns float32 whatever its inputs (it normalises by an f32 sum): cast
    # back, or the residual stream turns f32 from this layer on.
    if one_hot_K is None:
        return out_BKGH.reshape(b, n, h).astype(q_BNH.dtype)
    return from_kv_head(out_BKGH, one_hot_K, q_BNH.dtype)


# --- Pallas paged decode (GPU and TPU) ------------------------------------------------------


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def paged_gpu_blocks(pages_per_row: int, page_size: int, head_dim: int) -> tuple[int, int] | None:
    """(k_splits, pages_per_compute_block) for the GPU paged kernel, or None where it cannot
    run.

    Each program loads ``[pages_per_compute_block, page_size, head_dim]`` keys (and values)
    per step and multiplies them with ``[block_h, head_dim]`` queries. Triton loads only
    power-of-two sized tiles and its dots need every dimension >= 16: page_size and head_dim
    powers of two, head_dim >= 16, a compute block of >= 16 keys. The kernel splits a row's
    pages into ``k_splits`` partitions of whole compute blocks (programs run in parallel,
    then one last flash round). More splits give more programs for small batches; compute
    blocks of at most 128 keys (unless one page is longer).
    """
    if not (_power_of_two(page_size) and _power_of_two(head_dim) and head_dim >= 16):
        return None
    for k_splits in (16, 8, 4, 2, 1):
        if pages_per_row % k_splits:
            continue
        part = pages_per_row // k_splits
        for per_block in (8, 4, 2, 1):
            keys = per_block * page_size
            if part % per_block == 0 and keys >= 16 and (keys <= 128 or per_block == 1):
                return k_splits, per_block
    return None


def paged_gpu_block_h(group: int) -> int:
    """Query heads per GPU program: a multiple of 16 (the kernel requires it; it pads a
    smaller group with zero queries), up to 64, so that a large group reads each page once
    per 64 heads rather than once per 16."""
    return min(64, max(16, 1 << (group - 1).bit_length()))


#: Block-table entries per TPU paged-kernel call. The kernel prefetches its whole table
#: (and the lengths) into SMEM, 1 MiB on v4, v5e, v5p and v6e (measured compiling for
#: each: a table of 2**18 int32 entries overflows it): half of it for the table.
PAGED_TPU_TABLE_ENTRIES = 1 << 17


def paged_tpu_block(pages_per_row: int, page_size: int, head_dim: int, dtype) -> int | None:
    """pages_per_compute_block for the TPU paged kernel, or None where it cannot run.

    Measured by compiling the kernel for a compile-only v5e (libtpu of jax 0.10 and 0.12):
    head_dim must be a multiple of 128 (the queries' block has head_dim on the lanes; 64
    fails to lower), and the dtype bf16 or f32 (the kernel converts K/V to bf16 in VMEM;
    Mosaic fails on f16). Any page size compiles. The kernel requires compute blocks of
    whole pages dividing the row's pages; up to 512 keys per block (two double-buffered
    blocks of K and V live in VMEM). One row's table must fit in SMEM
    (:data:`PAGED_TPU_TABLE_ENTRIES`; more rows are split over several calls).
    """
    if head_dim % 128 or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return None
    if pages_per_row > PAGED_TPU_TABLE_ENTRIES:
        return None
    fits = [p for p in range(1, pages_per_row + 1) if pages_per_row % p == 0]
    return max([p for p in fits if p * page_size <= 512] or [1])


def pages_of_kv_head(
    k_KAZH: jax.Array,
    v_KAZH: jax.Array,
    tables_BN: jax.Array,
    n_local: int,
    group: int,
    head_ids_N: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The pool and block tables as a paged kernel reads them for this shard's query heads.

    When kv heads are replicated over tp (:func:`kv_replicated`) the shard holds the whole
    ``[K, A, Z, H]`` pool but its query heads all read one kv head. The pool is then seen as
    a single kv head of ``K * A`` pages, ``[1, K * A, Z, H]`` (merging the two leading axes:
    a bitcast, no copy, on every backend's layout), and the block tables are moved to that
    head's pages: local page ``p`` of kv head ``kv`` is page ``kv * A + p``. The kernel
    reads exactly the pages it reads for an unreplicated head. The alternatives cost more:
    slicing the head out (``k_KAZH[kv]``) copies a pool-sized operand per layer and step (a
    kernel's operand is materialised), and spreading the queries over every kv head with
    zeros, as the contiguous kernels do, would stream every head's pages: both paged kernels
    take one length per row, not per (row, kv head), so they cannot skip the other heads.
    """
    k_local, pages = k_KAZH.shape[:2]
    if not kv_replicated(n_local, k_local, group):
        return k_KAZH, v_KAZH, tables_BN
    kv = head_ids_N[0] // group

    def one_head(x_KAZH: jax.Array) -> jax.Array:
        return x_KAZH.reshape(1, k_local * pages, *x_KAZH.shape[2:])

    return one_head(k_KAZH), one_head(v_KAZH), tables_BN + kv * pages


def paged_decode_pallas_gpu(
    q_BNH,
    k_KAZH,
    v_KAZH,
    tables_BN,
    lengths_B,
    head_ids_N,
    *,
    group: int,
    blocks: tuple[int, int],
    interpret: bool,
) -> jax.Array:
    """Local shard of paged decode through ``pallas.ops.gpu.paged_attention``.

    The kernel reads ``[K, A, Z, H]`` pages and ``[B, N]`` block tables, the pool's own
    layout: nothing is transposed. A program per (row, kv head, block of query heads, split
    of the row's pages) streams only the pages below the row's length. The kernel does not
    scale the scores: ``1/sqrt(H)`` goes on q.
    """
    from jax.experimental.pallas.ops.gpu import paged_attention as pa

    n, h = q_BNH.shape[1], q_BNH.shape[2]
    # A quantized pool (QuantKV): int8/fp8 pages and their per-token scales, [K, A, Z, 1]
    # seen as the kernel's [K, A, Z] (a bitcast), which scales scores and probabilities.
    k_scale = v_scale = None
    if hasattr(k_KAZH, "scale"):
        k_KAZH, k_scale = k_KAZH.values, k_KAZH.scale[..., 0]
        v_KAZH, v_scale = v_KAZH.values, v_KAZH.scale[..., 0]
        k_scale, v_scale, _ = pages_of_kv_head(k_scale, v_scale, tables_BN, n, group, head_ids_N)
    k_KAZH, v_KAZH, tables_BN = pages_of_kv_head(k_KAZH, v_KAZH, tables_BN, n, group, head_ids_N)
    k_splits, per_block = blocks
    out_BNH = pa.paged_attention(
        q_BNH * jnp.asarray(h**-0.5, q_BNH.dtype),
        k_KAZH,
        v_KAZH,
        tables_BN,
        lengths_B.astype(jnp.int32),
        k_scales_pages=k_scale,
        v_scales_pages=v_scale,
        block_h=paged_gpu_block_h(n // k_KAZH.shape[0]),
        pages_per_compute_block=per_block,
        k_splits=k_splits,
        mask_value=MASKED,
        interpret=interpret,
    )
    return out_BNH.astype(q_BNH.dtype)


def paged_decode_pallas_tpu(
    q_BNH,
    k_KAZH,
    v_KAZH,
    tables_BN,
    lengths_B,
    head_ids_N,
    *,
    group: int,
    pages_per_block: int,
    interpret: bool,
) -> jax.Array:
    """Local shard of paged decode through ``pallas.ops.tpu.paged_attention``.

    Same layout as the GPU kernel (``[K, A, Z, H]`` pages, ``[B, N]`` page indices), read in
    place: the kernel DMAs each compute block of a row's pages from HBM into VMEM (double
    buffered) and stops at the row's length. It does not scale the scores (``1/sqrt(H)``
    goes on q) and converts K and V to bf16 in VMEM whatever their dtype, so f32 pools get
    bf16 keys and values. It prefetches the block tables into SMEM: a batch whose tables do
    not fit is split over several calls (:data:`PAGED_TPU_TABLE_ENTRIES`). The kernel takes
    no ``interpret`` argument: interpret mode is JAX's TPU interpreter context
    (``force_tpu_interpret_mode``) around the call, which simulates the DMAs and semaphores
    on CPU.
    """
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    b, n, h = q_BNH.shape
    k_KAZH, v_KAZH, tables_BN = pages_of_kv_head(k_KAZH, v_KAZH, tables_BN, n, group, head_ids_N)
    q_BNH = q_BNH * jnp.asarray(h**-0.5, q_BNH.dtype)
    lengths_B = lengths_B.astype(jnp.int32)

    def attend(rows: slice) -> jax.Array:
        return paged_attention(
            q_BNH[rows],
            k_KAZH,
            v_KAZH,
            lengths_B[rows],
            tables_BN[rows],
            mask_value=MASKED,
            pages_per_compute_block=pages_per_block,
        )

    # Rows in as few calls as keep each call's block table within SMEM.
    per_call = max(1, PAGED_TPU_TABLE_ENTRIES // tables_BN.shape[1])
    context = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    with context:
        outs = [attend(slice(i, i + per_call)) for i in range(0, b, per_call)]
    out_BNH = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
    return out_BNH.astype(q_BNH.dtype)


# --- Prefill over cached context (TPU ragged paged attention, GPU cuDNN) --------------------


def continued_kv(
    ctx_BCKH: jax.Array, new_BTKH: jax.Array, start_B: jax.Array, length: int | None = None
) -> jax.Array:
    """Each row's keys (or values) as one sequence, ``[B, S, K, H]`` (``S = length``,
    default ``C + T``): its cached ``start_B[b]`` positions, then its new tokens from
    position ``start_B[b]`` on, then zeros.

    The context's positions past a row's start (stale slots of a partly filled page,
    padding) are overwritten by the new tokens or lie past every key the row's queries may
    see. An activation-sized copy of the context, the size of the K/V the kernels read.
    """
    c, t = ctx_BCKH.shape[1], new_BTKH.shape[1]
    s = c + t if length is None else length
    pad = jnp.zeros((ctx_BCKH.shape[0], s - c, *ctx_BCKH.shape[2:]), new_BTKH.dtype)
    buf_BSKH = jnp.concatenate([ctx_BCKH.astype(new_BTKH.dtype), pad], axis=1)

    def place(buf_SKH, new_TKH, start):
        return jax.lax.dynamic_update_slice_in_dim(buf_SKH, new_TKH, start, axis=0)

    return jax.vmap(place)(buf_BSKH, new_BTKH, start_B)


#: Positions per page of the buffer the TPU ragged kernel reads (the kernel's page size,
#: free here: the buffer is built per call, see :func:`context_prefill_ragged_tpu`), and
#: keys per compute block (two double-buffered blocks of K and V live in VMEM).
RAGGED_PAGE_SIZE = 256
RAGGED_BLOCK_KEYS = 512
#: Queries per compute block (the kernel's default for v5e and later).
RAGGED_BLOCK_QUERIES = 32


def ragged_tpu_fits(rows: int, keys: int, head_dim: int, dtype) -> bool:
    """Whether the TPU ragged kernel takes a prefill over context of ``rows`` rows of
    ``keys`` keys each (context and new tokens): head_dim a multiple of 128 (the lanes, as
    for the paged decode kernel), bf16 or f32, and the rows' page tables within SMEM
    (:data:`PAGED_TPU_TABLE_ENTRIES`)."""
    if head_dim % 128 or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return False
    return rows * -(-keys // RAGGED_PAGE_SIZE) <= PAGED_TPU_TABLE_ENTRIES


def context_prefill_ragged_tpu(
    q_BTNH,
    k_BTKH,
    v_BTKH,
    k_ctx_BCKH,
    v_ctx_BCKH,
    start_B,
    lengths_B,
    head_ids_N,
    seq_ids_T,
    *,
    group: int,
    window: int | None,
    scale: float,
    softcap: float | None,
    interpret: bool,
    target=None,
) -> jax.Array:
    """Local shard of prefill over cached context through JAX's TPU ragged paged attention
    (``pallas.ops.tpu.ragged_paged_attention``), which streams K/V blocks through VMEM with
    flash-style f32 accumulators: no ``[T, C + T]`` score block exists.

    The kernel reads one pool ``[pages, page_size, 2K, H]`` with each kv head's K and V
    interleaved, and takes each row's queries to be the last ``q_len`` of its ``kv_len``
    keys. The rows' sequences (:func:`continued_kv`) are laid out as that pool, row b on
    pages ``b * P .. b * P + P - 1``; row b's queries (this shard's ``T`` of them, from
    global query ``seq_ids_T[0]`` on under sp) end at key ``start + seq_ids_T[0] + T``.
    Padding queries see the padding keys before them (finite; zeroed after), which no real
    query sees. Scale, soft cap and window are the kernel's own. The block sizes are
    passed, never looked up: the kernel's table keys on ``jax.devices()``, which a
    compile-only topology does not change.
    """
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as ragged

    b, t, n, h = q_BTNH.shape
    k_ctx_BCKH, v_ctx_BCKH = local_kv_heads(k_ctx_BCKH, v_ctx_BCKH, n, group, head_ids_N)
    k_BTKH, v_BTKH = local_kv_heads(k_BTKH, v_BTKH, n, group, head_ids_N)
    # Every new key (under sp this shard's queries are a slice of them, the keys whole).
    k_local, z = k_BTKH.shape[2], RAGGED_PAGE_SIZE
    pages = -(-(k_ctx_BCKH.shape[1] + k_BTKH.shape[1]) // z)

    def combined(k_BxKH, v_BxKH):  # kv head k's K and V at combined heads 2k and 2k + 1
        return jnp.stack([k_BxKH, v_BxKH], axis=3).reshape(*k_BxKH.shape[:2], 2 * k_local, h)

    # Interleaved before the context is copied into place: one buffer, written once.
    kv_BSXH = continued_kv(
        combined(k_ctx_BCKH, v_ctx_BCKH), combined(k_BTKH, v_BTKH), start_B, pages * z
    )
    kv_pages = kv_BSXH.reshape(b * pages, z, 2 * k_local, h)
    page_ids_BP = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    start_B = start_B.astype(jnp.int32)
    kv_lens_B = start_B + seq_ids_T[0] + t
    cu_q_lens = jnp.arange(b + 1, dtype=jnp.int32) * t
    args = (q_BTNH.reshape(b * t, n, h), kv_pages, kv_lens_B, page_ids_BP, cu_q_lens)
    options = dict(sm_scale=scale, sliding_window=window, soft_cap=softcap, mask_value=MASKED)
    if interpret:
        # JAX's TPU interpreter cannot run this kernel (0.10 and 0.12: it reshapes a VMEM
        # ref, which the interpreter does not model), so interpret mode runs the kernel's
        # contract in XLA (_ragged_reference): what CPU tests check is the layout handed
        # to the kernel; the kernel itself is proven by compiling it for TPU.
        out_XNH = _ragged_reference(*args, t=t, **options)
    else:
        # Mosaic reads the target chip from the current mesh. Under a shard_map that is the
        # sharding context's; a one-device context calls this body outside any, so the
        # caller hands its mesh (``target``): the process's default device may be a CPU
        # (a compile-only TPU topology).
        scope = (
            contextlib.nullcontext() if target is None else jax.sharding.use_abstract_mesh(target)
        )
        with scope:
            out_XNH = ragged.ragged_paged_attention(
                *args,
                jnp.array([b], jnp.int32),
                **options,
                num_kv_pages_per_block=min(pages, max(1, RAGGED_BLOCK_KEYS // z)),
                num_queries_per_block=min(RAGGED_BLOCK_QUERIES, b * t),
            )
    q_pos_BT = jnp.broadcast_to(seq_ids_T[None, :], (b, t))
    return zero_padded_rows(out_XNH.reshape(b, t, n, h), q_pos_BT, lengths_B).astype(q_BTNH.dtype)


def _ragged_reference(
    q_XNH,
    kv_pages,
    kv_lens_B,
    page_ids_BP,
    cu_q_lens,
    *,
    t,
    sm_scale,
    sliding_window,
    soft_cap,
    mask_value,
):
    """What ``ragged_paged_attention`` computes (JAX's ``ref_ragged_paged_attention``,
    vectorised for rows of ``t`` queries each, which that Python loop over rows cannot be
    under ``jit``): row b's keys are its pages' even combined heads, its values the odd
    ones; its queries are the last ``t`` of its ``kv_lens_B[b]`` keys."""
    del cu_q_lens  # rows of t queries each: [0, t, 2t, ...]
    b, x = page_ids_BP.shape[0], kv_pages.shape[2]
    n, h = q_XNH.shape[1:]
    kv_BSXH = kv_pages[page_ids_BP].reshape(b, -1, x, h).astype(jnp.float32)
    k_BSKH, v_BSKH = kv_BSXH[:, :, 0::2], kv_BSXH[:, :, 1::2]
    q_BTKGH = q_XNH.reshape(b, t, x // 2, n * 2 // x, h).astype(jnp.float32)
    s_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH) * sm_scale
    if soft_cap is not None:
        s_BKGTS = soft_cap * jnp.tanh(s_BKGTS / soft_cap)
    q_pos_BT = kv_lens_B[:, None] - t + jnp.arange(t)[None, :]
    k_pos_S = jnp.arange(k_BSKH.shape[1])
    masked_BTS = k_pos_S[None, None, :] > q_pos_BT[:, :, None]
    if sliding_window is not None:
        masked_BTS |= q_pos_BT[:, :, None] - sliding_window >= k_pos_S[None, None, :]
    s_BKGTS = s_BKGTS + jnp.where(masked_BTS, mask_value, 0.0)[:, None, None]
    p_BKGTS = jax.nn.softmax(s_BKGTS, axis=-1)
    out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", p_BKGTS, v_BSKH)
    return out_BTKGH.reshape(b * t, n, h).astype(q_XNH.dtype)


def context_prefill_cudnn(
    q_BTNH,
    k_BTKH,
    v_BTKH,
    k_ctx_BCKH,
    v_ctx_BCKH,
    start_B,
    lengths_B,
    head_ids_N,
    seq_ids_T,
    *,
    group: int,
    window: int | None,
) -> jax.Array:
    """Local shard of prefill over cached context through cuDNN's fused attention.

    The rows' sequences (:func:`continued_kv`) are the keys; the queries sit at
    ``start + seq_ids_T``, and :func:`prefill_cudnn`'s masked path (the one it takes for
    queries at an offset) masks causally by those positions. cuDNN adds the mask as a bias
    ``[B, 1, T, C + T]`` in q's dtype, the size of one head's scores; the scores of every
    head stay in the fused kernel.
    """
    b, t = q_BTNH.shape[:2]
    k_BSKH = continued_kv(k_ctx_BCKH, k_BTKH, start_B)
    v_BSKH = continued_kv(v_ctx_BCKH, v_BTKH, start_B)
    start_B = start_B.astype(jnp.int32)
    q_pos_BT = start_B[:, None] + jnp.broadcast_to(seq_ids_T[None, :], (b, t))
    return prefill_cudnn(
        q_BTNH,
        k_BSKH,
        v_BSKH,
        q_pos_BT,
        start_B + lengths_B.astype(jnp.int32),
        head_ids_N,
        seq_ids_T,
        group=group,
        window=window,
    )
