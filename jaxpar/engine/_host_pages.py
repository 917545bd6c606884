"""The host tier's memory: pages of K/V copied out of the device pool and back.

:class:`HostPages` holds the pages the host tier's book (:class:`~jaxpar.engine.
_host_tier.HostTier`) keeps, one host array per slot, and runs its two copies as the
executor's commands (:mod:`._executor`), so a multi-process job runs them on every
process: each process copies, holds and restores only its own devices' shards of a
page (its kv heads), nothing crosses between hosts.

A page is packed into one ``uint8 [K, bytes]`` array: every layer's keys and values of
the page (and their scales, for a quantized pool) for each kv head, bit for bit, so a
page copied back is exactly the page copied out. It lives in the backend's
``pinned_host`` memory (page-locked host memory that the devices copy to and from
without staging; TPU, GPU and CPU have it), else ``unpinned_host``, else the device's
own memory (a backend with no host memory kind: on CPU that is host memory anyway).

Both copies are dispatched, not waited for: the copy out is a gather program then a
``device_put`` to host memory, the copy back a ``device_put`` to the devices then a
scatter program into the (donated) pool; device programs run in dispatch order, so the
prefill that reads restored pages sees them. One compile per power-of-two count of pages.
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


def host_memory_kind(device: jax.Device) -> str | None:
    """The memory kind host pages live in on ``device``'s backend (None: the device's
    default memory)."""
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in HOST_KINDS if k in kinds), None)


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


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

    def _pack_program(self, slots, ids):
        lay, rep = self.slot_steps.layout, self.steps.layouts.replicated
        n = ids.shape[0]
        return self.steps.compile(
            "host_pack",
            (n, self.slot_steps._pool_key),
            self._pack,
            (lay.k, lay.v, rep),
            (self.page_layout,) * n,
            (slots.k, slots.v, ids),
        )

    def _unpack_program(self, slots, pages, ids):
        lay, rep = self.slot_steps.layout, self.steps.layouts.replicated
        m = ids.shape[0]
        return self.steps.compile(
            "host_unpack",
            (m, self.slot_steps._pool_key),
            self._unpack,
            (lay.k, lay.v, (self.page_layout,) * m, rep),
            (lay.k, lay.v),
            (slots.k, slots.v, pages, ids),
            donate_argnums=(0, 1),
        )

    # --- the copies ----------------------------------------------------------------------

    def offload(self, slots, pages: tuple[int, ...], host_slots: tuple[int, ...]) -> int:
        """Copies global pages ``pages`` of the pool in ``slots`` to ``host_slots`` (a slot
        named twice keeps the later page); returns the bytes moved (whole pages)."""
        n = len(pages)
        ids = np.zeros(_bucket(n), np.int32)  # padding reads the scratch page, unused
        ids[:n] = pages
        ids = put_global(ids, self.steps.layouts.replicated)
        packed = self._pack_program(slots, ids)(slots.k, slots.v, ids)
        moved = jax.device_put(packed[:n], self.host_layout)
        for slot, page in zip(host_slots, moved, strict=True):
            self._host[slot] = page
        return n * self.page_bytes

    def restore(self, slots, host_slots: tuple[int, ...], pages: tuple[int, ...]):
        """``slots`` with ``host_slots``' pages written into global pages ``pages``
        (donates its pool); returns it and the bytes moved."""
        m, pool = len(pages), self.slot_steps.pool
        held = [self._host[s] for s in host_slots]
        held += [held[0]] * (_bucket(m) - m)
        ids = np.full(_bucket(m), pool.pages, np.int32)  # padding pages are dropped
        ids[:m] = pages
        ids = put_global(ids, self.steps.layouts.replicated)
        on_device = jax.device_put(tuple(held), self.page_layout)
        k, v = self._unpack_program(slots, on_device, ids)(slots.k, slots.v, on_device, ids)
        return slots.replace(k=k, v=v), m * self.page_bytes


def attach_host_tier(gb: float, cache, slot_steps, executor) -> HostTier:
    """A host tier of ``gb`` GiB (of this process's host memory) for the prefix cache of
    ``cache`` (the pool ``slot_steps`` runs, the caching one), its memory held by
    ``executor`` (on every process: it runs the copies as commands)."""
    pages = HostPages(slot_steps)
    capacity = host_pages(gb, pages.process_bytes())
    tier = HostTier(capacity, slot_steps.pool.page_size, pages.page_bytes)
    cache.attach_host(tier)
    executor.host_pages = pages
    return tier
