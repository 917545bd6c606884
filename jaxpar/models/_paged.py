"""The paged KV cache of decode: a pool of fixed-size pages per layer, a block table per row.

A sequence's keys and values stay logically contiguous (position ``j`` of row ``b`` lives
at slot ``j % page_size`` of page ``block_tables_BN[b, j // page_size]``); only their
storage is paged, so a request holds memory for the tokens it has, not for
``max_seq_len``.

Layout: each layer's keys (and values) are one array ``[K, A, Z, H]`` (kv heads, pages,
positions in a page, head_dim). That is the layout JAX's Pallas paged-attention kernels
read, on GPU (``pallas.ops.gpu.paged_attention``) and TPU (``pallas.ops.tpu.paged_attention``):
kv heads outermost, so a kernel program streams one head's pages, each page one contiguous
``[Z, H]`` tile. Any other order would need a transpose of the pool on every step. Layers
are a tuple of such arrays (``layer_loop="unrolled"``) or one stacked ``[L, K, A, Z, H]``.

Sharding (the spec tables' ``pages`` axis): kv heads over ``tp`` as in the contiguous cache,
and pages over decode's batch axes. Each batch shard owns its sequences and the pages
they use, so ``block_tables_BN`` holds *local* page ids: a shard's rows index its own slice
of the pool, and writes and reads never leave the shard. Local page 0 of every shard is a
scratch page no sequence owns: free rows (length 0, block table of zeros) write there.

KV groups (:mod:`jaxpar.models._kv_groups`): where sliding-window layers mix with full
ones, the pool has ``width`` positions instead of ``L`` layers and the block tables are
``[G, B, N]``, one per group: layer ``l`` reads and writes position ``position_of[l]``
through table ``group_of[l]`` (static for unrolled layers, two small gathers under scan).
Page ids passed to :func:`write_prompts` and :func:`read_pages` are then ``[P, G, N]``.
A model without groups keeps the ``[B, N]`` tables and per-layer pool it always had.

Quantized (``config.kv_cache_dtype``): each pool is a :class:`~jaxpar.models.QuantKV`,
int8/fp8 values ``[K, A, Z, H]`` and float32 scales ``[K, A, Z, 1]`` (one per token per
kv head), the layout the Pallas GPU kernel's scale inputs take (``[K, A, Z]``, a free
reshape). Writes quantize the new keys and values and write values and scales with the
same scatter; :func:`read_pages` dequantizes right after its gather. A shard map given
one spec for a pool passes it for both parts (the scales' last dim, size 1, is never
split: no strategy splits ``head_dim``).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxpar.errors import ShapeError
from jaxpar.models._config import ModelConfig
from jaxpar.models._kv_groups import KVGroups, kv_groups
from jaxpar.models._kv_quant import (
    QuantKV,
    as_stored,
    dequantize_kv,
    empty_kv,
    kv_axes,
    kv_map,
)
from jaxpar.models._run import ModelRun
from jaxpar.spec import Module, logical_shard_map

#: One layer's page pool: [K, A, Z, H].
PAGE_AXES = ("kv_heads", "pages", "page_pos", "head_dim")
#: Every layer's pool in one array: [L, K, A, Z, H].
STACKED_PAGE_AXES = ("layers", *PAGE_AXES)
#: Block tables [B, N]: row b's N page ids (local to its batch shard).
TABLE_AXES = ("batch", None)
#: Block tables of KV groups [G, B, N]: one table per group.
GROUP_TABLE_AXES = (None, *TABLE_AXES)
#: The new token's keys or values of each row: [B, K, H].
ROW_KV_AXES = ("batch", "kv_heads", "head_dim")
#: Local page id of each shard's scratch page (written by free rows, owned by none).
SCRATCH_PAGE = 0


@flax.struct.dataclass
class PagedLayer:
    """One layer's pool and the rows' block tables, as decode attention reads them."""

    k_KAZH: Any  # [K, A, Z, H], or a QuantKV of it
    v_KAZH: Any
    block_tables_BN: jax.Array


@flax.struct.dataclass
class PagedKVCache:
    """Decode's K/V in pages: the pool of every layer, block tables, tokens per row.

    Offers what ``DecoderLayer.decode`` calls on a cache: :meth:`write_layer` (the new
    token of every row, in place) then :meth:`layer` (a :class:`PagedLayer` view), and
    :meth:`advance`. The block tables may be narrower than the longest possible row: a step
    given ``N`` columns reads ``N * page_size`` positions per row, so its cost follows the
    live sequences, not ``max_seq_len``.
    """

    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array
    block_tables_BN: jax.Array  # [B, N], or [G, B, N] with KV groups
    lengths_B: jax.Array
    groups: KVGroups | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    @property
    def _pool(self) -> jax.Array:
        return self.k if self.stacked else self.k[0]

    @property
    def page_size(self) -> int:
        return self._pool.shape[-2]

    @property
    def pages(self) -> int:
        """Pages in the pool (all shards)."""
        return self._pool.shape[-3]

    @property
    def max_seq_len(self) -> int:
        """Positions the block tables address per row."""
        return self.block_tables_BN.shape[-1] * self.page_size

    @classmethod
    def logical_axes(cls, config: ModelConfig | ModelRun) -> PagedKVCache:
        """A PagedKVCache-shaped pytree of logical axis tuples (for building shardings)."""
        config = ModelRun.of(config)
        mode = config.kv_cache_dtype
        stacked = config.layer_loop == "scan"
        groups = kv_groups(config)
        positions = config.n_layers if groups is None else groups.width
        pool: Any = (
            kv_axes(STACKED_PAGE_AXES, mode) if stacked else (kv_axes(PAGE_AXES, mode),) * positions
        )
        tables = TABLE_AXES if groups is None else GROUP_TABLE_AXES
        return cls(k=pool, v=pool, block_tables_BN=tables, lengths_B=("batch",), groups=groups)

    @classmethod
    def empty_pool(
        cls, config: ModelConfig | ModelRun, pages: int, page_size: int, part: str = "k"
    ) -> Any:
        """A zero pool of ``pages`` pages per position (every layer, or with KV groups
        each group's layers; compute dtype, or quantized with the run's
        ``kv_cache_dtype``), in the run's form: of the keys (``part="k"``) or the values
        (``"v"``), whose widths may differ (MLA)."""
        config = ModelRun.of(config)
        width = config.cache_kv_dims[0 if part == "k" else 1]
        shape = (config.n_kv_heads, pages, page_size, width)
        mode = config.kv_cache_dtype
        positions = _positions(config)
        if config.layer_loop == "scan":
            return empty_kv((positions, *shape), config.dtype, mode)
        return tuple(empty_kv(shape, config.dtype, mode) for _ in range(positions))

    @staticmethod
    def pool_bytes(config: ModelConfig | ModelRun, pages: int, page_size: int) -> int:
        """Bytes of the keys and values of ``pages`` pages, every position (all shards):
        values in the stored dtype, plus their scales when quantized."""
        run = ModelRun.of(config)
        return run.cache_bytes_per_token * _positions(run) // run.n_layers * pages * page_size

    def _where(self, layer: int | jax.Array) -> tuple[Any, jax.Array]:
        """Layer ``layer``'s pool index and block tables (its group's, with KV groups)."""
        groups = self.groups
        if groups is None:
            return layer, self.block_tables_BN
        if isinstance(layer, int):
            return groups.position_of[layer], self.block_tables_BN[groups.group_of[layer]]
        position = jnp.asarray(groups.position_of, jnp.int32)[layer]
        group = jnp.asarray(groups.group_of, jnp.int32)[layer]
        return position, self.block_tables_BN[group]

    def write_layer(
        self, layer: int | jax.Array, k_new_BKH: jax.Array, v_new_BKH: jax.Array
    ) -> PagedKVCache:
        """Writes layer ``layer``'s new token of row b at position ``lengths_B[b]``.

        Per batch shard (its rows address its pages): a scatter into the donated pool,
        in place. Lengths are unchanged until :meth:`advance`.
        """
        layer, tables = self._where(layer)
        lengths = self.lengths_B
        if self.stacked:
            write = logical_shard_map(
                _write_stacked,
                in_axes=(STACKED_PAGE_AXES, None, TABLE_AXES, ("batch",), ROW_KV_AXES),
                out_axes=STACKED_PAGE_AXES,
                module=Module.ATTENTION,
            )
            layer_index = jnp.asarray(layer, jnp.int32)
            k = write(self.k, layer_index, tables, lengths, as_stored(k_new_BKH, self.k))
            v = write(self.v, layer_index, tables, lengths, as_stored(v_new_BKH, self.v))
            return self.replace(k=k, v=v)
        write = logical_shard_map(
            _write_layer,
            in_axes=(PAGE_AXES, TABLE_AXES, ("batch",), ROW_KV_AXES),
            out_axes=PAGE_AXES,
            module=Module.ATTENTION,
        )
        k_pool = write(self.k[layer], tables, lengths, as_stored(k_new_BKH, self.k[layer]))
        v_pool = write(self.v[layer], tables, lengths, as_stored(v_new_BKH, self.v[layer]))

        def put(layers: tuple[jax.Array, ...], x: jax.Array) -> tuple[jax.Array, ...]:
            return (*layers[:layer], x, *layers[layer + 1 :])

        return self.replace(k=put(self.k, k_pool), v=put(self.v, v_pool))

    def layer(self, layer: int | jax.Array) -> PagedLayer:
        """Layer ``layer``'s pool and the block tables (read after :meth:`write_layer`)."""
        layer, tables = self._where(layer)
        return PagedLayer(self.k[layer], self.v[layer], tables)

    def advance(self) -> PagedKVCache:
        """Lengths + 1, after every layer wrote this step's token."""
        return self.replace(lengths_B=self.lengths_B + 1)


def _positions(config: ModelConfig) -> int:
    groups = kv_groups(config)
    return config.n_layers if groups is None else groups.width


def _page_slot(z: int, tables_BN: jax.Array, pos_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Row b's (local page, slot) of position ``pos_B[b]``."""
    page_B = jnp.take_along_axis(tables_BN, (pos_B // z)[:, None], axis=1)[:, 0]
    return page_B, pos_B % z


def _write_layer(pool_KAZH, tables_BN, pos_B, new_BKH):
    """One shard: row b's token into slot ``pos % Z`` of its page ``tables[b, pos // Z]``."""
    page_B, slot_B = _page_slot(pool_KAZH.shape[-2], tables_BN, pos_B)
    # The indexed dims are adjacent: the updates are [K, B, H]. (Values and scales alike.)
    return kv_map(
        lambda p, n: p.at[:, page_B, slot_B].set(n.transpose(1, 0, 2)), pool_KAZH, new_BKH
    )


def _write_stacked(pool_LKAZH, layer, tables_BN, pos_B, new_BKH):
    """:func:`_write_layer` into layer ``layer`` of a stacked pool."""
    page_B, slot_B = _page_slot(pool_LKAZH.shape[-2], tables_BN, pos_B)
    # The indexed dims are apart (layer, then page and slot): the updates are [B, K, H].
    return kv_map(lambda p, n: p.at[layer, :, page_B, slot_B].set(n), pool_LKAZH, new_BKH)


def write_prompts(pool: Any, new: Any, pages_PN: jax.Array, groups: KVGroups | None = None) -> Any:
    """:func:`write_layers`, per KV group where there are groups: ``pages_PN`` is then
    ``[P, G, N]``, and each group's layers (``new`` per layer) go to its positions."""
    if groups is None:
        return write_layers(pool, new, pages_PN)
    for group in range(groups.n_groups):
        pool = write_layers(pool, _group_layers(new, groups, group), pages_PN[:, group])
    return pool


def _group_layers(x: Any, groups: KVGroups, group: int) -> Any:
    """Per-layer ``x`` (a tuple, or stacked ``[L, ...]``) at ``group``'s positions."""
    layers = [groups.layer_at(group, j) for j in range(groups.width)]
    if isinstance(x, tuple):
        return tuple(x[layer] for layer in layers)
    return jax.tree.map(lambda a: a[jnp.asarray(layers)], x)


def write_layers(pool: Any, new: Any, pages_PN: jax.Array) -> Any:
    """Writes prefilled K/V into pages: row p's positions ``[0, T)`` into its pages
    (quantized first where the pool is).

    Args:
        pool: a layer tuple of ``[K, A, Z, H]`` or a stacked ``[L, K, A, Z, H]``.
        new: prefill's K or V, per-layer ``[P, T, K, H]`` or stacked ``[L, P, T, K, H]``.
        pages_PN: ``ceil(T / Z)`` *global* page ids per row (shard * pages-per-shard +
            local id); ids ``>= A`` (rows not written, pages past a row's prompt) are dropped.

    Traced in the decode layout: XLA places each page's rows where the page lives.
    """
    stacked = not isinstance(pool, tuple)
    z = (pool if stacked else pool[0]).shape[-2]
    n = pages_PN.shape[1]

    def paged(x_PTKH: jax.Array) -> jax.Array:  # [(L,) P, T, K, H] -> [(L,) K, P, N, Z, H]
        *lead, p, t, k, h = x_PTKH.shape
        if n * z < t:
            raise ShapeError(f"{n} pages of {z} positions cannot hold {t} prefilled tokens")
        x_PTKH = jnp.pad(x_PTKH, [(0, 0)] * len(lead) + [(0, 0), (0, n * z - t), (0, 0), (0, 0)])
        x = x_PTKH.reshape(*lead, p, n, z, k, h)
        return jnp.moveaxis(x, -2, len(lead))

    if stacked:  # [L, K, A, Z, H] <- [L, K, P, N, Z, H]
        return kv_map(
            lambda p, x: p.at[:, :, pages_PN].set(paged(x), mode="drop"),
            pool,
            as_stored(new, pool),
        )
    return tuple(
        kv_map(
            lambda p, x: p.at[:, pages_PN].set(paged(x), mode="drop"), layer, as_stored(x, layer)
        )
        for layer, x in zip(pool, new, strict=True)
    )


def read_pages(
    pool: Any, pages_PN: jax.Array, dtype: Any = None, groups: KVGroups | None = None
) -> Any:
    """:func:`read_layers`, per KV group where there are groups (``pages_PN`` then
    ``[P, G, N]``): each layer read from its position through its group's pages, the
    result per layer (a tuple, or stacked ``[L, ...]``) as without groups."""
    if groups is None:
        return read_layers(pool, pages_PN, dtype)
    reads = [read_layers(pool, pages_PN[:, g], dtype) for g in range(groups.n_groups)]
    layers = [reads[g] if isinstance(reads[g], tuple) else None for g in range(groups.n_groups)]
    per_layer = [
        layers[g][j] if layers[g] is not None else jax.tree.map(lambda a, j=j: a[j], reads[g])
        for g, j in zip(groups.group_of, groups.position_of, strict=True)
    ]
    if isinstance(pool, tuple):
        return tuple(per_layer)
    return jax.tree.map(lambda *a: jnp.stack(a), *per_layer)


def read_layers(pool: Any, pages_PN: jax.Array, dtype: Any = None) -> Any:
    """The K or V of ``N`` pages per row as prefill lays them out: per layer
    ``[P, N * Z, K, H]`` (stacked ``[L, P, N * Z, K, H]``); the inverse of
    :func:`write_prompts`. A quantized pool is dequantized right after the gather, into
    ``dtype`` (default: a float pool's own dtype; a quantized pool needs it).

    ``pages_PN`` are *global* page ids; ids ``>= A`` (rows or columns with no page) read
    zeros. Traced in the decode layout, where the pool's pages split over batch shards:
    XLA gathers each page on the shard that holds it (a masked local gather and a sum
    over shards), so only the pages read move, never the pool.
    """
    stacked = not isinstance(pool, tuple)

    def rows(x: jax.Array) -> jax.Array:  # [(L,) K, P, N, Z, H] -> [(L,) P, N * Z, K, H]
        *lead, k, p, n, z, h = x.shape
        x = jnp.moveaxis(x, len(lead), -2)
        return x.reshape(*lead, p, n * z, k, h)

    def read(layer: Any, index: tuple) -> jax.Array:
        if dtype is None and isinstance(layer, QuantKV):
            raise ValueError("read_pages of a quantized pool needs the dtype to read into")
        x = kv_map(lambda p: rows(p.at[index].get(mode="fill", fill_value=0)), layer)
        return dequantize_kv(x, layer.dtype if dtype is None else dtype)

    if stacked:
        return read(pool, (slice(None), slice(None), pages_PN))
    return tuple(read(layer, (slice(None), pages_PN)) for layer in pool)
