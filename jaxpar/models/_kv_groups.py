"""KV groups of the paged cache: which layers share a block table, and where they lie.

A model that mixes sliding-window layers with full-attention ones (Gemma 2/3, GPT-OSS)
keeps a different set of pages per layer kind: a full layer needs every page of a
sequence, a window layer only the pages its window reaches, so the two cannot share one
block table. As vLLM's hybrid cache manager does, the layers fall into *groups* of
``width`` layers of one kind, each group with its own block table per row; the pool has
``width`` *positions* (per-layer arrays ``[K, A, Z, H]``, or one stacked
``[width, K, A, Z, H]``), and a page id ``p`` of group ``g`` names page ``p`` of every
position, position ``j`` holding the K/V of group ``g``'s ``j``-th layer. All groups draw
their pages from one free list, so memory moves between the layer kinds as rows need it:
the window groups' rows give pages back as they grow, the full group's keep theirs.

``width`` is the count of the rarer kind (a group of the other kind may have positions
no layer uses: Gemma 3's 22 sliding layers of 26 with 4 global ones are 6 window groups of
4 positions, the last with 2 layers; its unused positions are written and never read).

Models whose layers are all of one kind have no groups (None): their one table and
``n_layers`` positions are the cache as it always was, compiled the same.
"""

from __future__ import annotations

import dataclasses
import math

from jaxpar.models._config import ModelConfig


@dataclasses.dataclass(frozen=True)
class KVGroups:
    """Static: each layer's group and position, each group's window, the positions.

    Attributes:
        group_of: per layer, its group.
        position_of: per layer, its position in the pool (its index within its group).
        windows: per group, the sliding window of its layers (None: full attention).
        width: positions of the pool (layers per group).
    """

    group_of: tuple[int, ...]
    position_of: tuple[int, ...]
    windows: tuple[int | None, ...]
    width: int

    @property
    def n_groups(self) -> int:
        return len(self.windows)

    def layer_at(self, group: int, position: int) -> int:
        """The layer at ``position`` of ``group``; a position the group leaves unused
        names the group's first layer (its data is written there, never read)."""
        layers = [
            layer
            for layer, (g, j) in enumerate(zip(self.group_of, self.position_of, strict=True))
            if g == group and j == position
        ]
        if layers:
            return layers[0]
        return next(layer for layer, g in enumerate(self.group_of) if g == group)


def kv_groups(config: ModelConfig) -> KVGroups | None:
    """The groups of ``config``'s layers, or None where every layer is of one kind."""
    window = config.window.size
    if window is None:
        return None
    slides = [config.layer_slides(i) for i in range(config.n_layers)]
    full = [i for i, s in enumerate(slides) if not s]
    sliding = [i for i, s in enumerate(slides) if s]
    if not full or not sliding:
        return None
    width = min(len(full), len(sliding))
    group_of, position_of = [0] * config.n_layers, [0] * config.n_layers
    windows: list[int | None] = []
    for kind, layers in ((None, full), (window, sliding)):
        for chunk in range(math.ceil(len(layers) / width)):
            for j, layer in enumerate(layers[chunk * width : (chunk + 1) * width]):
                group_of[layer], position_of[layer] = len(windows), j
            windows.append(kind)
    return KVGroups(tuple(group_of), tuple(position_of), tuple(windows), width)


def kv_positions(config: ModelConfig) -> int:
    """Positions of the paged pool: layers per group, or every layer without groups."""
    groups = kv_groups(config)
    return config.n_layers if groups is None else groups.width


def kv_windows(config: ModelConfig) -> tuple[int | None, ...]:
    """Per block table of a row, the window whose pages it gives back (None: keeps every
    page): one per group, or the one table of a model without groups (its window when
    every layer slides)."""
    groups = kv_groups(config)
    if groups is not None:
        return groups.windows
    every = all(config.layer_slides(i) for i in range(config.n_layers))
    return (config.window.size if every else None,)
