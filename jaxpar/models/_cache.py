"""The KV cache: a pytree of per-layer keys/values and per-row lengths."""

from __future__ import annotations

from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import CacheOverflowError, ShapeError
from jaxpar.models._config import ModelConfig
from jaxpar.spec._constrain import constrain
from jaxpar.spec._enums import Module


def check_room(lengths_host: np.ndarray | jax.Array, n_new: int, max_seq_len: int) -> None:
    """Raises before a step that would write past the end of the cache.

    Call on the host before prefill handoff (``n_new`` = prompt length, from 0) or each
    decode step (``n_new`` = 1). The device code never clips or wraps.

    Args:
        lengths_host: Tokens already cached per row.
        n_new: Tokens each row is about to append.
        max_seq_len: Cache capacity S.

    Raises:
        CacheOverflowError: Some row would end past ``max_seq_len``; names the rows.
    """
    lengths = np.asarray(jax.device_get(lengths_host)).reshape(-1)
    over = np.nonzero(lengths + n_new > max_seq_len)[0]
    if over.size:
        rows = ", ".join(f"row {i} (length {lengths[i]})" for i in over[:8])
        more = f" and {over.size - 8} more" if over.size > 8 else ""
        raise CacheOverflowError(
            f"KV cache overflow: appending {n_new} token(s) would exceed max_seq_len="
            f"{max_seq_len} for {rows}{more}; raise max_seq_len or stop these rows"
        )


# Operand [L, B, S, K, H], indices [B, 2] = (layer, position), updates [B, K, H].
_LAYER_ROW_SCATTER = jax.lax.ScatterDimensionNumbers(
    update_window_dims=(1, 2),
    inserted_window_dims=(0, 2),
    scatter_dims_to_operand_dims=(0, 2),
    operand_batching_dims=(1,),
    scatter_indices_batching_dims=(0,),
)


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer, [L, B, S, K, H], plus tokens cached per row.

    Positions >= ``lengths_B[b]`` hold stale data and are masked; decode writes the new
    token of row b at position ``lengths_B[b]`` then increments it.
    """

    k_LBSKH: jax.Array
    v_LBSKH: jax.Array
    lengths_B: jax.Array

    KV_AXES: ClassVar[tuple[str, ...]] = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")
    LENGTHS_AXES: ClassVar[tuple[str, ...]] = ("batch",)

    @property
    def max_seq_len(self) -> int:
        """Cache capacity S."""
        return self.k_LBSKH.shape[2]

    @classmethod
    def logical_axes(cls) -> KVCache:
        """A KVCache-shaped pytree of logical axis tuples (for building shardings)."""
        return cls(k_LBSKH=cls.KV_AXES, v_LBSKH=cls.KV_AXES, lengths_B=cls.LENGTHS_AXES)

    @classmethod
    def empty(cls, config: ModelConfig, batch: int, max_seq_len: int) -> KVCache:
        """A zero cache with all lengths 0 (compute dtype)."""
        shape = (config.n_layers, batch, max_seq_len, config.n_kv_heads, config.head_dim)
        zeros = jnp.zeros(shape, config.dtype)
        return cls(k_LBSKH=zeros, v_LBSKH=zeros, lengths_B=jnp.zeros((batch,), jnp.int32))

    @classmethod
    def abstract(cls, config: ModelConfig, batch: int, max_seq_len: int) -> KVCache:
        """Shapes and dtypes of a cache, without allocating."""
        return jax.eval_shape(lambda: cls.empty(config, batch, max_seq_len))

    @classmethod
    def from_prefill(
        cls, k_LBTKH: jax.Array, v_LBTKH: jax.Array, lengths_B: jax.Array, max_seq_len: int
    ) -> KVCache:
        """Pads prefill K/V [L, B, T, K, H] to a cache of S = ``max_seq_len`` positions.

        Jit-able (``max_seq_len`` static). Lengths are checked here when concrete.

        Raises:
            CacheOverflowError: The prompt is longer than ``max_seq_len``.
            ShapeError: k and v disagree, or lengths do not match the batch.
        """
        if k_LBTKH.shape != v_LBTKH.shape or k_LBTKH.ndim != 5:
            raise ShapeError(
                f"prefill k {k_LBTKH.shape} and v {v_LBTKH.shape} must be equal "
                "[L, B, T, K, H] arrays"
            )
        _, b, t, _, _ = k_LBTKH.shape
        if lengths_B.shape != (b,):
            raise ShapeError(f"lengths shape {lengths_B.shape} != (batch={b},)")
        if t > max_seq_len:
            raise CacheOverflowError(
                f"prompt of {t} positions does not fit max_seq_len="
                f"{max_seq_len}; raise max_seq_len or shorten the prompt"
            )
        if not isinstance(lengths_B, jax.core.Tracer):
            check_room(lengths_B, 0, max_seq_len)
        pad = ((0, 0), (0, 0), (0, max_seq_len - t), (0, 0), (0, 0))
        k = constrain(jnp.pad(k_LBTKH, pad), cls.KV_AXES, Module.ATTENTION)
        v = constrain(jnp.pad(v_LBTKH, pad), cls.KV_AXES, Module.ATTENTION)
        return cls(k_LBSKH=k, v_LBSKH=v, lengths_B=lengths_B.astype(jnp.int32))

    def check_room(self, n_new: int = 1) -> None:
        """:func:`check_room` on this cache's lengths (a device-to-host read)."""
        check_room(self.lengths_B, n_new, self.max_seq_len)

    def write_layer(self, layer: jax.Array, k_new_BKH: jax.Array, v_new_BKH: jax.Array) -> KVCache:
        """Writes layer ``layer``'s new token of row b at position ``lengths_B[b]``.

        Lengths are unchanged: call :meth:`advance` once all layers are written. Used
        inside the decode scan, where the cache is carried and updated in place.
        """
        def write(cache_LBSKH: jax.Array, new_BKH: jax.Array) -> jax.Array:
            return write_token(cache_LBSKH, layer, self.lengths_B, new_BKH)

        return self.replace(
            k_LBSKH=write(self.k_LBSKH, k_new_BKH), v_LBSKH=write(self.v_LBSKH, v_new_BKH)
        )

    def layer(self, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, S, K, H] of one layer (read after :meth:`write_layer`)."""
        return self.k_LBSKH[layer], self.v_LBSKH[layer]

    def advance(self) -> KVCache:
        """Lengths + 1, after every layer wrote this step's token."""
        return self.replace(lengths_B=self.lengths_B + 1)


def write_token(
    cache_LBSKH: jax.Array,
    layer: jax.Array,
    pos_B: jax.Array,
    new_BKH: jax.Array,
    *,
    drop_out_of_range: bool = False,
) -> jax.Array:
    """Writes row b's new token at (``layer``, ``pos_B[b]``) of a cache [L, B, S, K, H].

    A scatter with the batch as a batching dimension: it partitions along the sharded
    batch with no collective, updates a carried cache in place, and needs no transpose (a
    vmapped ``dynamic_update_slice`` over axis 1 does; an index scatter makes XLA gather).
    With ``drop_out_of_range`` a position >= S skips that row (pipeline groups, bubbles).
    """
    index_B2 = jnp.stack([jnp.full_like(pos_B, layer), pos_B], axis=-1)
    mode = jax.lax.GatherScatterMode
    return jax.lax.scatter(
        cache_LBSKH,
        index_B2,
        new_BKH.astype(cache_LBSKH.dtype),
        _LAYER_ROW_SCATTER,
        indices_are_sorted=True,
        unique_indices=True,
        mode=mode.FILL_OR_DROP if drop_out_of_range else mode.PROMISE_IN_BOUNDS,
    )
