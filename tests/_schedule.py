"""The order the suite's files start in: the long ones first.

``scripts/test.sh`` spreads files over xdist workers (``--dist loadfile``), handing the
next file to whichever worker is free, in collection order. In alphabetical order the
longest files (``test_pod_compile.py``, the ``test_serve*.py`` servers) come last, and one
worker ends the run alone on them while the other has finished. Started first, they run
beside the many short files, which then fill the other worker's time: the run ends when
the shorter pile does, not a long file later.

The long files are known by the markers (pyproject.toml) that all their tests carry: those
compiling real model shapes for TPU slices (``pod``), then those marked ``slow``, then those
that start servers or other processes or compile for accelerators (``server``, ``accel``);
a file with one such test among ordinary ones stays in its place. Within a rank, and within
a file, the collection order is kept; every xdist worker computes the same order, as xdist
requires.
"""

from __future__ import annotations

#: Markers of long files, longest first.
RANKS = ("pod", "slow", "server", "accel")


def _rank(item) -> int:
    names = {mark.name for mark in item.iter_markers()}
    return next((i for i, name in enumerate(RANKS) if name in names), len(RANKS))


def long_files_first(items: list) -> None:
    """Reorders ``items`` in place: files by the rank all their tests share, stably."""
    rank: dict[str, int] = {}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        path = item.nodeid.split("::", 1)[0]
        rank[path] = max(rank.get(path, 0), _rank(item))
        first.setdefault(path, index)
    items.sort(key=lambda item: (rank[p := item.nodeid.split("::", 1)[0]], first[p]))
