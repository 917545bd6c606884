"""The host tier's memory: pages of K/V copied out of the device pool and back.

:class:`HostPages` holds the pages the host tier's book (:class:`~jaxpar.engine.
_host_tier.HostTier`) keeps, one host array per slot, and runs its two copies as the
executor's commands (:mod:`._executor`), so a multi-process job runs them on every
process: each process copies, holds and restores only its own devices' shards of a
page. A host page is split over kv heads as the pool is and whole on every batch shard
(the pool's pages split over them), so the book's pages serve any shard.

A page is packed into one ``uint8 [K, bytes]`` array: every layer's keys and values of
the page (and their scales, for a quantized pool) for each kv head, bit for bit, so a
page copied back is exactly the page copied out. It lives in the backend's
``pinned_host`` memory (page-locked host memory that the devices copy to and from
without staging; TPU, GPU and CPU have it), else ``unpinned_host``, else the device's
own memory (a backend with no host memory kind: on CPU that is host memory anyway).

Both copies are dispatched, not waited for: the copy out is a gather program then a
``device_put`` to host memory, the copy back a ``device_put`` to the devices then a
scatter program into the (donated) pool; device programs run in dispatch order, so the
prefill that reads restored pages sees them. Each program moves up to
:data:`PAGES_PER_CALL` pages (more take several calls; fewer are padded), so there are two
programs in all, compiled when the tier is attached, and no request waits for a compile.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.engine._host_tier import HostTier, host_pages
from jaxpar.engine._placement import put_global

#: Host memory kinds, best first (:func:`host_memory_kind`).
HOST_KINDS = ("pinned_host", "unpinned_host")
#: Pages one copy program moves (a request's prefix of 256 tokens in pages of 16).
PAGES_PER_CALL = 16


def host_memory_kind(device: jax.Device) -> str | None:
    """The memory kind host pages live in on ``device``'s backend (None: the device's
    default memory)."""
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in HOST_KINDS if k in kinds), None)


class HostPages:
    """One pool's pages in host memory, by host slot.

    Args:
        slot_steps: the pool's programs (:class:`~jaxpar.engine._slots.SlotSteps`): its
            layout, shape and compile cache.
    """

    def __init__(self, slot_steps):
        self.slot_steps = slot_steps
        self.steps = slot_steps.steps
        shapes = jax.eval_shape(slot_steps._empty)
        self._treedef = jax.tree.structure((shapes.k, shapes.v))
        self._leaves = jax.tree.leaves((shapes.k, shapes.v))
        shardings = jax.tree.leaves((slot_steps.layout.k, slot_steps.layout.v))
        first = shardings[0]
        spec = tuple(first.spec) + (None,) * (self._leaves[0].ndim - len(first.spec))
        heads = spec[self._leaves[0].ndim - 4]  # [(L,) K, A, Z, H]: the kv heads' axes
        #: One packed page: ``[K, bytes]``, split over kv heads as the pool is.
        self.page_layout = NamedSharding(first.mesh, PartitionSpec(heads, None))
        kind = host_memory_kind(first.mesh.devices.flat[0])
        self.memory_kind = kind or first.memory_kind
        self.host_layout = self.page_layout.with_memory_kind(kind) if kind else self.page_layout
        self.kv_heads = self._leaves[0].shape[-4]
        #: Bytes per kv head of one packed page, per leaf (in :func:`jax.tree.leaves` order).
        self._widths = [self._leaf_width(x) for x in self._leaves]
        self._host: dict[int, jax.Array] = {}
        self._padding: jax.Array | None = None

    @staticmethod
    def _leaf_width(x) -> int:
        lead = x.shape[:-4]  # (L,) when stacked
        return math.prod(lead) * x.shape[-2] * x.shape[-1] * np.dtype(x.dtype).itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (every kv head, every layer, keys and values)."""
        return self.kv_heads * sum(self._widths)

    def process_bytes(self) -> int:
        """Bytes of one page in this process's host memory (its devices' shards of it,
        replicas included)."""
        shape = (self.kv_heads, sum(self._widths))
        per = math.prod(self.host_layout.shard_shape(shape))
        return per * len(self.host_layout.addressable_devices)

    @property
    def held(self) -> int:
        """Slots holding a page."""
        return len(self._host)

    # --- programs ------------------------------------------------------------------------

    def _pack(self, k, v, ids_N):
        """``n`` pages of the pool as ``n`` arrays ``uint8 [K, bytes]``."""
        parts = []
        for leaf in jax.tree.leaves((k, v)):
            x = jnp.moveaxis(leaf[..., ids_N, :, :], -3, 0)  # [n, (L,) K, Z, H]
            if x.ndim == 5:  # stacked: [n, L, K, Z, H] -> [n, K, L, Z, H]
                x = jnp.moveaxis(x, 2, 1)
            x = jax.lax.bitcast_convert_type(x, jnp.uint8)
            parts.append(x.reshape(x.shape[0], x.shape[1], -1))
        packed = jnp.concatenate(parts, axis=-1)
        return tuple(packed[i] for i in range(packed.shape[0]))

    def _unpack(self, k, v, pages, ids_M):
        """Writes packed ``pages`` into the pool's pages ``ids_M`` (``>= A``: dropped)."""
        packed = jnp.stack(pages)  # [m, K, bytes]
        leaves, offset = [], 0
        for leaf, width in zip(jax.tree.leaves((k, v)), self._widths, strict=True):
            raw = packed[..., offset : offset + width]
            offset += width
            lead, (z, h) = leaf.shape[:-4], leaf.shape[-2:]
            item = np.dtype(leaf.dtype).itemsize
            shape = (*raw.shape[:2], *lead, z, h) + ((item,) if item > 1 else ())
            x = jax.lax.bitcast_convert_type(raw.reshape(shape), leaf.dtype)  # [m, K, (L,) Z, H]
            # back to the pool's order: [K, m, Z, H], or stacked [L, K, m, Z, H]
            x = jnp.transpose(x, (2, 1, 0, 3, 4)) if lead else jnp.moveaxis(x, 0, 1)
            leaves.append(leaf.at[..., ids_M, :, :].set(x, mode="drop"))
        return jax.tree.unflatten(self._treedef, leaves)

    def _pack_program(self):
        lay, rep = self.slot_steps.layout, self.steps.layouts.replicated
        pool = self.slot_steps.abstract()
        ids = jax.ShapeDtypeStruct((PAGES_PER_CALL,), np.int32, sharding=rep)
        return self.steps.compile(
            "host_pack",
            (PAGES_PER_CALL, self.slot_steps._pool_key),
            self._pack,
            (lay.k, lay.v, rep),
            (self.page_layout,) * PAGES_PER_CALL,
            (pool.k, pool.v, ids),
        )

    def _unpack_program(self):
        lay, rep = self.slot_steps.layout, self.steps.layouts.replicated
        pool = self.slot_steps.abstract()
        ids = jax.ShapeDtypeStruct((PAGES_PER_CALL,), np.int32, sharding=rep)
        page = jax.ShapeDtypeStruct(
            (self.kv_heads, sum(self._widths)), np.uint8, sharding=self.page_layout
        )
        return self.steps.compile(
            "host_unpack",
            (PAGES_PER_CALL, self.slot_steps._pool_key),
            self._unpack,
            (lay.k, lay.v, (self.page_layout,) * PAGES_PER_CALL, rep),
            (lay.k, lay.v),
            (pool.k, pool.v, (page,) * PAGES_PER_CALL, ids),
            donate_argnums=(0, 1),
        )

    def compile(self) -> None:
        """Compiles both copies ahead of their first use."""
        self._pack_program()
        self._unpack_program()

    # --- the copies ----------------------------------------------------------------------

    def offload(self, slots, pages: tuple[int, ...], host_slots: tuple[int, ...]) -> int:
        """Copies global pages ``pages`` of the pool in ``slots`` to ``host_slots`` (a slot
        named twice keeps the later page); returns the bytes moved (whole pages)."""
        program, rep = self._pack_program(), self.steps.layouts.replicated
        for start in range(0, len(pages), PAGES_PER_CALL):
            part = pages[start : start + PAGES_PER_CALL]
            ids = np.zeros(PAGES_PER_CALL, np.int32)  # padding reads the scratch page, unused
            ids[: len(part)] = part
            packed = program(slots.k, slots.v, put_global(ids, rep))
            moved = jax.device_put(packed[: len(part)], self.host_layout)
            for slot, page in zip(host_slots[start : start + len(part)], moved, strict=True):
                self._host[slot] = page
        return len(pages) * self.page_bytes

    def restore(self, slots, host_slots: tuple[int, ...], pages: tuple[int, ...]):
        """``slots`` with ``host_slots``' pages written into global pages ``pages``
        (donates its pool); returns it and the bytes moved."""
        program, rep = self._unpack_program(), self.steps.layouts.replicated
        if self._padding is None:  # a device page for the padding (its writes are dropped)
            shape = (self.kv_heads, sum(self._widths))
            self._padding = put_global(np.zeros(shape, np.uint8), self.page_layout)
        for start in range(0, len(pages), PAGES_PER_CALL):
            part = pages[start : start + PAGES_PER_CALL]
            held = tuple(self._host[s] for s in host_slots[start : start + len(part)])
            on_device = jax.device_put(held, self.page_layout)
            on_device += (self._padding,) * (PAGES_PER_CALL - len(part))
            ids = np.full(PAGES_PER_CALL, self.slot_steps.pool.pages, np.int32)  # >= A: dropped
            ids[: len(part)] = part
            k, v = program(slots.k, slots.v, on_device, put_global(ids, rep))
            slots = slots.replace(k=k, v=v)
        return slots, len(pages) * self.page_bytes


def attach_host_tier(gb: float, cache, slot_steps, executor) -> HostTier:
    """A host tier of ``gb`` GiB (of this process's host memory) for the prefix cache of
    ``cache`` (the pool ``slot_steps`` runs, the caching one), its memory held by
    ``executor`` (on every process: it runs the copies as commands)."""
    pages = HostPages(slot_steps)
    capacity = host_pages(gb, pages.process_bytes())
    tier = HostTier(capacity, slot_steps.pool.page_size, pages.page_bytes)
    cache.attach_host(tier)
    pages.compile()
    executor.host_pages = pages
    return tier
