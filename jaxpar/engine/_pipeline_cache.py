"""A view of one decode group's rows inside a pipeline stage's KV cache, updated in place.

Inside the pipelined decode step each stage holds its ``Lp = L / P`` layers of the cache,
``[Lp, B, S, K, H]``, and serves one group of sequences per pipeline iteration: group ``g``
is the rows ``b`` with ``b % G == g``. :class:`GroupCacheView` offers the two methods
``DecoderLayer.decode`` calls on a cache (``write_layer`` then ``layer``), addressing the
group's rows of the full stage cache, which the pipeline loops carry and update in place.

The carried cache keeps its ``[Lp, B, S, K, H]`` shape: viewing it as ``[Lp, B/G, G, ...]``
would be a free reshape in principle, but XLA then gives the size-1 dims of some shards
(``G = 1``, or one row per device) a layout of their own and copies the whole cache on the
way in and out of the loop. So the write covers every row of the batch, with the rows of
other groups sent out of range and dropped, and only the read reshapes (one layer's slice).

A quantized cache (``kv_cache_dtype``) holds :class:`~jaxpar.models.QuantKV` keys and
values: the new token is quantized once, as the unpipelined cache does
(:func:`~jaxpar.models.as_stored`), and every write and read applies to the values and to
their scales alike (:func:`~jaxpar.models.kv_map`), so the group and bubble masking drops
a scale exactly where it drops its values, and the read hands attention both as stored.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxpar.models import QuantKV, as_stored, kv_map, write_token


@flax.struct.dataclass
class GroupCacheView:
    """Group ``group``'s rows of one stage's cache ``[Lp, B, S, K, H]``.

    Attributes:
        k_LBSKH: the stage's keys, every row (written in place).
        v_LBSKH: the stage's values, likewise.
        group: which group, an int32 scalar (or the constant 0 when there is one group).
        write_pos_B: where each row's new token goes; ``S`` (out of range, so dropped) for
            rows of other groups, and for every row when the stage is in a pipeline bubble.
        groups: G, the number of groups (static).
    """

    k_LBSKH: jax.Array | QuantKV
    v_LBSKH: jax.Array | QuantKV
    group: jax.Array | int
    write_pos_B: jax.Array
    groups: int = flax.struct.field(pytree_node=False, default=1)

    @classmethod
    def open(
        cls,
        k_LBSKH: jax.Array | QuantKV,
        v_LBSKH: jax.Array | QuantKV,
        group: jax.Array | int,
        groups: int,
        pos_B: jax.Array,
        active: jax.Array,
    ) -> GroupCacheView:
        """The view of ``group``; ``active=False`` (a bubble) makes every write a no-op."""
        in_group_B = (jnp.arange(pos_B.shape[0]) % groups == group) & active
        write_pos_B = jnp.where(in_group_B, pos_B, k_LBSKH.shape[2])
        return cls(k_LBSKH, v_LBSKH, group, write_pos_B, groups)

    def _rows(self, x_B: jax.Array) -> jax.Array:
        """The group's rows ``[B/G, ...]`` of a ``[B, ...]`` array."""
        if self.groups == 1:
            return x_B
        return x_B.reshape(-1, self.groups, *x_B.shape[1:])[:, self.group]

    def _spread(self, x_Bg: jax.Array) -> jax.Array:
        """A group's rows placed at their batch rows ``[B, ...]`` (other rows zero)."""
        if self.groups == 1:
            return x_Bg
        full = jnp.zeros((x_Bg.shape[0], self.groups, *x_Bg.shape[1:]), x_Bg.dtype)
        return full.at[:, self.group].set(x_Bg).reshape(-1, *x_Bg.shape[1:])

    def write_layer(
        self, layer: jax.Array, k_new_BgKH: jax.Array, v_new_BgKH: jax.Array
    ) -> GroupCacheView:
        """Writes layer ``layer``'s new token of each row of the group (see ``KVCache``)."""

        def write_array(cache: jax.Array, new_BgKH: jax.Array) -> jax.Array:
            # Other groups' rows and bubbles carry position S: dropped, not clamped.
            spread_BKH = self._spread(new_BgKH)
            return write_token(cache, layer, self.write_pos_B, spread_BKH, drop_out_of_range=True)

        def write(cache: jax.Array | QuantKV, new_BgKH: jax.Array) -> jax.Array | QuantKV:
            return kv_map(write_array, cache, as_stored(new_BgKH, cache))

        return self.replace(
            k_LBSKH=write(self.k_LBSKH, k_new_BgKH), v_LBSKH=write(self.v_LBSKH, v_new_BgKH)
        )

    def layer(self, layer: jax.Array) -> tuple[jax.Array | QuantKV, jax.Array | QuantKV]:
        """Keys and values ``[Bg, K, S, H]`` of one layer for this group (after writing),
        as stored (quantized ones with their scales ``[Bg, K, S, 1]``).

        Read after :meth:`write_layer`: writing first is what lets XLA keep the carried
        cache in place (reading first makes it copy the whole cache every step).
        """

        def view(x_LBSKH: jax.Array) -> jax.Array:
            return self._rows(x_LBSKH[layer]).transpose(0, 2, 1, 3)

        return kv_map(view, self.k_LBSKH), kv_map(view, self.v_LBSKH)
