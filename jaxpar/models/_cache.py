"""The KV cache: a pytree of keys/values (per layer, or stacked) and per-row lengths."""

from __future__ import annotations

from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import CacheOverflowError, ShapeError
from jaxpar.models._config import ModelConfig
from jaxpar.models._kv_quant import QuantKV, as_stored, empty_kv, kv_axes, kv_map, quantize_kv
from jaxpar.models._run import ModelRun
from jaxpar.spec import Module, constrain


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
# Operand [B, K, S, H], indices [B, 1] = (position,), updates [B, K, H].
_ROW_SCATTER = jax.lax.ScatterDimensionNumbers(
    update_window_dims=(1, 2),
    inserted_window_dims=(2,),
    scatter_dims_to_operand_dims=(2,),
    operand_batching_dims=(0,),
    scatter_indices_batching_dims=(0,),
)

#: One layer's keys or values as decode stores and reads them: [B, K, S, H].
LAYER_KV_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")
#: Every layer's keys or values in one stacked array: [L, B, S, K, H] (``layer_loop="scan"``
#: and pipeline stages, which split the leading layer dim over ``pp``).
STACKED_KV_AXES = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")
#: Keys or values of one layer as prefill produces them: [B, T, K, H].
PREFILL_KV_AXES = ("batch", "cache_seq", "kv_heads", "head_dim")


def constrain_kv(x: Any, axes: tuple[str | None, ...], module: Module) -> Any:
    """``constrain`` of a cache tensor: a float array, or a quantized one's values and
    scales (the scales' last dim unnamed, see :func:`~jaxpar.models._kv_quant.kv_axes`)."""
    if not isinstance(x, QuantKV):
        return constrain(x, axes, module)
    return x.replace(
        values=constrain(x.values, axes, module),
        scale=constrain(x.scale, (*axes[:-1], None), module),
    )


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer plus tokens cached per row.

    Two storage forms, chosen by the model's ``layer_loop``:

    * per layer (``"unrolled"``): ``k`` and ``v`` are tuples of L arrays ``[B, K, S, H]``.
      Decode attention contracts over S for each (B, K), so this is the order it reads:
      no step transposes the cache, and no layer's slice is copied out of a stack.
    * stacked (``"scan"``, pipeline stages): one array ``[L, B, S, K, H]`` each, carried
      through the layer scan; :meth:`layer` returns the layer viewed as ``[B, K, S, H]``.

    Positions >= ``lengths_B[b]`` hold stale data and are masked; decode writes the new
    token of row b at position ``lengths_B[b]`` then increments it.

    With ``config.kv_cache_dtype`` each array is a :class:`~jaxpar.models.QuantKV`
    (values and per-token, per-kv-head scales, the same layout with ``head_dim`` 1):
    written quantized, read as stored (the attention dequantizes).
    """

    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array
    lengths_B: jax.Array

    KV_AXES: ClassVar[tuple[str, ...]] = STACKED_KV_AXES
    LENGTHS_AXES: ClassVar[tuple[str, ...]] = ("batch",)

    @property
    def stacked(self) -> bool:
        """Whether layers live in one ``[L, B, S, K, H]`` array (else a tuple per layer)."""
        return not isinstance(self.k, tuple)

    @property
    def max_seq_len(self) -> int:
        """Cache capacity S."""
        return (self.k if self.stacked else self.k[0]).shape[2]  # [L,B,S,K,H] / [B,K,S,H]

    @classmethod
    def logical_axes(cls, config: ModelConfig | ModelRun) -> KVCache:
        """A KVCache-shaped pytree of logical axis tuples (for building shardings)."""
        config = ModelRun.of(config)
        mode = config.kv_cache_dtype
        if config.layer_loop == "scan":
            kv: Any = kv_axes(STACKED_KV_AXES, mode)
        else:
            kv = (kv_axes(LAYER_KV_AXES, mode),) * config.n_layers
        return cls(k=kv, v=kv, lengths_B=cls.LENGTHS_AXES)

    @classmethod
    def empty(cls, config: ModelConfig | ModelRun, batch: int, max_seq_len: int) -> KVCache:
        """A zero cache with all lengths 0 (compute dtype, or the run's ``kv_cache_dtype``),
        in the run's storage form."""
        config = ModelRun.of(config)
        lengths_B = jnp.zeros((batch,), jnp.int32)
        k = config.n_kv_heads
        mode = config.kv_cache_dtype
        # Keys and values may differ in width (MLA: the RoPE key and the latent).
        hk, hv = config.cache_kv_dims
        if config.layer_loop == "scan":

            def stacked(h: int) -> Any:
                return empty_kv((config.n_layers, batch, max_seq_len, k, h), config.dtype, mode)

            return cls(k=stacked(hk), v=stacked(hv), lengths_B=lengths_B)

        def layers(h: int) -> tuple[Any, ...]:
            shape = (batch, k, max_seq_len, h)
            return tuple(empty_kv(shape, config.dtype, mode) for _ in range(config.n_layers))

        return cls(k=layers(hk), v=layers(hv), lengths_B=lengths_B)

    @classmethod
    def abstract(cls, config: ModelConfig | ModelRun, batch: int, max_seq_len: int) -> KVCache:
        """Shapes and dtypes of a cache, without allocating."""
        return jax.eval_shape(lambda: cls.empty(config, batch, max_seq_len))

    @classmethod
    def from_prefill(
        cls,
        k: Any,
        v: Any,
        lengths_B: jax.Array,
        max_seq_len: int,
        kv_cache_dtype: str | None = None,
    ) -> KVCache:
        """Pads prefill K/V to a cache of S = ``max_seq_len`` positions (quantized first
        with ``kv_cache_dtype``).

        Takes what :meth:`Decoder.prefill` returns: tuples of per-layer ``[B, T, K, H]``
        (stored as ``[B, K, S, H]``, the one transpose happening here, at the handoff) or
        stacked ``[L, B, T, K, H]`` (kept stacked). Jit-able (``max_seq_len`` static).
        Lengths are checked here when concrete.

        Raises:
            CacheOverflowError: The prompt is longer than ``max_seq_len``.
            ShapeError: k and v disagree, or lengths do not match the batch.
        """
        per_layer = isinstance(k, tuple | list)
        k_shapes = [x.shape for x in k] if per_layer else [k.shape]
        v_shapes = [x.shape for x in v] if isinstance(v, tuple | list) else [v.shape]
        want_rank = 4 if per_layer else 5
        # Keys and values agree in every dim but their width (MLA's differ).
        same = [a[:-1] for a in k_shapes] == [a[:-1] for a in v_shapes]
        if not same or any(len(s) != want_rank for s in k_shapes) or not k_shapes:
            form = "per-layer [B, T, K, H]" if per_layer else "[L, B, T, K, H]"
            raise ShapeError(
                f"prefill k {k_shapes} and v {v_shapes} must be matching {form} arrays"
            )
        b, t = k_shapes[0][-4], k_shapes[0][-3]
        if lengths_B.shape != (b,):
            raise ShapeError(f"lengths shape {lengths_B.shape} != (batch={b},)")
        if t > max_seq_len:
            raise CacheOverflowError(
                f"prompt of {t} positions does not fit max_seq_len="
                f"{max_seq_len}; raise max_seq_len or shorten the prompt"
            )
        if not isinstance(lengths_B, jax.core.Tracer):
            check_room(lengths_B, 0, max_seq_len)
        lengths_B = lengths_B.astype(jnp.int32)
        if not per_layer:
            pad = ((0, 0), (0, 0), (0, max_seq_len - t), (0, 0), (0, 0))

            def store_stacked(x_LBTKH: jax.Array) -> Any:
                x = kv_map(lambda a: jnp.pad(a, pad), quantize_kv(x_LBTKH, kv_cache_dtype))
                return constrain_kv(x, STACKED_KV_AXES, Module.ATTENTION)

            return cls(k=store_stacked(k), v=store_stacked(v), lengths_B=lengths_B)

        def store(x_BTKH: jax.Array) -> Any:
            def move(a_BTKH: jax.Array) -> jax.Array:
                a_BKTH = a_BTKH.transpose(0, 2, 1, 3)
                return jnp.pad(a_BKTH, ((0, 0), (0, 0), (0, max_seq_len - t), (0, 0)))

            x_BKSH = kv_map(move, quantize_kv(x_BTKH, kv_cache_dtype))
            return constrain_kv(x_BKSH, LAYER_KV_AXES, Module.ATTENTION)

        return cls(k=tuple(map(store, k)), v=tuple(map(store, v)), lengths_B=lengths_B)

    def check_room(self, n_new: int = 1) -> None:
        """:func:`check_room` on this cache's lengths (a device-to-host read)."""
        check_room(self.lengths_B, n_new, self.max_seq_len)

    def write_layer(
        self, layer: int | jax.Array, k_new_BKH: jax.Array, v_new_BKH: jax.Array
    ) -> KVCache:
        """Writes layer ``layer``'s new token of row b at position ``lengths_B[b]``.

        Lengths are unchanged: call :meth:`advance` once all layers are written. The
        cache is updated in place (it is donated, or carried by the layer scan).
        ``layer`` is a Python int for the per-layer form, an int or traced index when stacked.
        """
        if self.stacked:

            def write(cache_LBSKH: Any, new_BKH: jax.Array) -> Any:
                return kv_map(
                    lambda c, n: write_token(c, layer, self.lengths_B, n),
                    cache_LBSKH,
                    as_stored(new_BKH, cache_LBSKH),
                )

            return self.replace(k=write(self.k, k_new_BKH), v=write(self.v, v_new_BKH))

        def write_row(cache_BKSH: Any, new_BKH: jax.Array) -> Any:
            return kv_map(
                lambda c, n: write_row_token(c, self.lengths_B, n),
                cache_BKSH,
                as_stored(new_BKH, cache_BKSH),
            )

        k_BKSH = write_row(self.k[layer], k_new_BKH)
        v_BKSH = write_row(self.v[layer], v_new_BKH)
        # A barrier between the write and its readers: with a size-1 dim (one row or one kv
        # head per device) XLA otherwise fuses the write into each reader's reshape and
        # gives every copy of that fusion a buffer of its own: whole-cache copies per step.
        # (The decode attention's cache contractions are reductions for the same reason.)
        k_BKSH, v_BKSH = jax.lax.optimization_barrier((k_BKSH, v_BKSH))

        def put(layers: tuple[jax.Array, ...], x: jax.Array) -> tuple[jax.Array, ...]:
            return (*layers[:layer], x, *layers[layer + 1 :])

        return self.replace(k=put(self.k, k_BKSH), v=put(self.v, v_BKSH))

    def layer(self, layer: int | jax.Array) -> tuple[Any, Any]:
        """Keys and values ``[B, K, S, H]`` of one layer (read after :meth:`write_layer`),
        as stored (quantized ones as :class:`~jaxpar.models.QuantKV`)."""
        if self.stacked:

            def view(x: Any) -> Any:
                return kv_map(lambda a: a[layer].transpose(0, 2, 1, 3), x)

            return view(self.k), view(self.v)
        return self.k[layer], self.v[layer]

    def advance(self) -> KVCache:
        """Lengths + 1, after every layer wrote this step's token."""
        return self.replace(lengths_B=self.lengths_B + 1)


def write_row_token(cache_BKSH: jax.Array, pos_B: jax.Array, new_BKH: jax.Array) -> jax.Array:
    """Writes row b's new token at position ``pos_B[b]`` of one layer's cache [B, K, S, H].

    A scatter with the batch as a batching dimension, like :func:`write_token`: local to
    the batch shards, in place, no transpose.
    """
    return jax.lax.scatter(
        cache_BKSH,
        pos_B[:, None],
        new_BKH.astype(cache_BKSH.dtype),
        _ROW_SCATTER,
        indices_are_sorted=True,
        unique_indices=True,
        mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )


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
