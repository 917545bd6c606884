"""The host tier of the prefix cache: where evicted pages go, and where hits find them.

A device pool holds a few thousand pages; the host holds a hundred times more. With a host
tier (``kv_offload_gb``), a cached page the device pool evicts (:class:`~jaxpar.engine.
_pages.PageTable`, least recently used first) is copied to host memory instead of being
dropped, and a later prompt whose prefix runs on past its pages still cached on the
device finds the rest here: they are copied back into fresh device pages before its
prefill with context, which then computes only what neither tier held. This is what
vLLM's KV offloading (its CPU ``OffloadingConnector``, and its JAX backend's) and
SGLang's HiCache do.

:class:`HostTier` is the book (plain Python, no JAX: the scheduling process keeps it): a
bounded set of *host slots*, each holding one page of K/V under its prefix key
(:mod:`._prefix`), least recently used first out. It never touches memory itself: it
queues what to move, in order, as :class:`Move` commands (a page's copy out to a slot
when the device pool evicts it; a slot's copy back into a device page when a hit takes
it), and the runner sends them to the executor (:mod:`._host_pages`) before the next
program that could write those pages (the prefill, its insert, the decode step). Device
programs run in the order they are dispatched, so a copy out reads a page before its new
owner writes it, and a copy back lands before the prefill that reads it.

A key stays in the host tier after a hit copies it back: when the device evicts that
page again, nothing moves (the host copy is still good). Slots a hit is about to copy
back are pinned while its row takes its pages (taking pages may evict more pages to the
host, which must not reuse those slots).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Protocol

from jaxpar.errors import ConfigError

#: Move kinds: device page -> host slot, host slot -> device page.
OFFLOAD, RESTORE = "offload", "restore"


class HostEventSink(Protocol):
    """What hears of the host tier's pages (the KV events publisher: vLLM's events with
    ``medium="CPU"``). Called with the batcher's lock held: queue only."""

    def offloaded(self, key: bytes, block_size: int) -> None:
        """The page of ``key`` (``block_size`` tokens) is held in host memory from now on."""

    def dropped(self, key: bytes) -> None:
        """The host copy of ``key`` was evicted."""


@dataclasses.dataclass(frozen=True)
class Move:
    """Pages to copy, in order: ``pages[i]`` (global ids into the device pool) to or from
    ``slots[i]`` (host slots)."""

    kind: str
    pages: tuple[int, ...]
    slots: tuple[int, ...]


class HostTier:
    """The host tier's book: ``capacity`` host slots of one page each.

    Args:
        capacity: pages the host tier holds (:func:`host_pages`).
        page_size: tokens per page (for the hits it counts in tokens).
        page_bytes: bytes of one page (for the bytes it counts moved).
    """

    def __init__(self, capacity: int, page_size: int, page_bytes: int = 0):
        if capacity < 1:
            raise ConfigError(
                f"a host tier of {capacity} pages holds nothing: give kv_offload_gb room "
                "for at least one page, or leave it off"
            )
        self.capacity, self.page_size, self.page_bytes = capacity, page_size, page_bytes
        self._slot_of: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._unused = 0  # slots from here on were never used (no list of a million slots)
        self._pinned: set[int] = set()
        self._moves: list[Move] = []
        #: Where host page events go (None: nowhere).
        self.events: HostEventSink | None = None
        #: Pages copied out to the host, and copied back (counted as they are queued).
        self.offloaded = 0
        self.restored = 0
        #: Device evictions whose page the host already held (nothing moved).
        self.kept = 0
        #: Pages the host tier evicted to make room.
        self.evicted = 0

    def __len__(self) -> int:
        """Pages held."""
        return len(self._slot_of)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    @property
    def hit_tokens(self) -> int:
        """Tokens served from the host tier (pages copied back, in tokens)."""
        return self.restored * self.page_size

    @property
    def offloaded_bytes(self) -> int:
        """Bytes copied from the devices to the host (whole pages)."""
        return self.offloaded * self.page_bytes

    @property
    def restored_bytes(self) -> int:
        """Bytes copied from the host back to the devices."""
        return self.restored * self.page_bytes

    @property
    def usage(self) -> float:
        """Fraction of the host slots holding a page."""
        return len(self) / self.capacity

    # --- what the cache manager asks -------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The slots holding the longest run of ``keys`` from the first."""
        slots = []
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def pin(self, keys: Sequence[bytes]) -> None:
        """Keeps the slots of ``keys`` from eviction until :meth:`unpin` (a hit is taking
        them)."""
        self._pinned.update(self._slot_of[key] for key in keys)

    def unpin(self) -> None:
        self._pinned.clear()

    def spill(self, page: int, key: bytes) -> None:
        """The device pool evicts global page ``page`` holding ``key``: it is copied to a
        host slot (the least recently used one when full; nothing if every slot is
        pinned), unless the host holds ``key`` already."""
        if key in self._slot_of:
            self._slot_of.move_to_end(key)
            self.kept += 1
            return
        slot = self._take()
        if slot is None:
            return
        self._slot_of[key] = slot
        self._queue(OFFLOAD, page, slot)
        self.offloaded += 1
        if self.events is not None:
            self.events.offloaded(key, self.page_size)

    def restore(self, keys: Sequence[bytes], pages: Sequence[int]) -> None:
        """A hit takes ``keys``' host pages: each is copied back into global device page
        ``pages[i]`` (most recently used now)."""
        for key, page in zip(keys, pages, strict=True):
            self._slot_of.move_to_end(key)
            self._queue(RESTORE, page, self._slot_of[key])
            self.restored += 1

    def take_moves(self) -> list[Move]:
        """The copies queued since the last call, in order (consecutive ones of a kind
        merged), and forgets them: the caller dispatches them before anything else."""
        moves, self._moves = self._moves, []
        return moves

    # --- internals -----------------------------------------------------------------------

    def _take(self) -> int | None:
        if self._unused < self.capacity:
            self._unused += 1
            return self._unused - 1
        victim = next((k for k, s in self._slot_of.items() if s not in self._pinned), None)
        if victim is None:
            return None
        slot = self._slot_of.pop(victim)
        self.evicted += 1
        if self.events is not None:
            self.events.dropped(victim)
        return slot

    def _queue(self, kind: str, page: int, slot: int) -> None:
        last = self._moves[-1] if self._moves else None
        if last is not None and last.kind == kind:
            self._moves[-1] = Move(kind, (*last.pages, page), (*last.slots, slot))
        else:
            self._moves.append(Move(kind, (page,), (slot,)))


def host_pages(gb: float, page_bytes: int) -> int:
    """Pages ``gb`` GiB of host memory hold, at ``page_bytes`` per page (this process's
    share of one page, :meth:`~jaxpar.engine._host_pages.HostPages.page_bytes`)."""
    if gb <= 0:
        raise ConfigError(f"kv_offload_gb must be > 0 GiB, got {gb}")
    return int(gb * 2**30) // page_bytes
