"""The fast tier's share of a sweep (``scripts/test.sh --fast``).

A sweep runs one check over many strategies (or kernels, checkpoints, presets). The fast
tier keeps a few of its points, the ones that between them take the paths the sweep covers
(each axis at least once, the model kinds it holds); :func:`sweep` marks the rest
``sweep``, which the fast tier deselects and the full tier runs. Nothing is skipped: every
point still runs in the full tier, and the fast tier's deselection is counted in pytest's
summary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
from _pytest.mark.structures import ParameterSet


def sweep(points: Iterable, fast: Callable[[object], bool], *, one_argument: bool = False) -> list:
    """``points`` for ``pytest.mark.parametrize``, those ``fast`` rejects marked ``sweep``.

    A point is a tuple of values for several argument names, or one value for one
    (``one_argument``: the parametrize names one argument, and a tuple is its value), or a
    ``pytest.param`` (its marks and id kept). ``fast`` sees the point's value: the tuple
    for several names."""
    out = []
    for point in points:
        if isinstance(point, ParameterSet):
            values, marks, id_ = point.values, list(point.marks), point.id
        elif one_argument or not isinstance(point, tuple):
            values, marks, id_ = (point,), [], None
        else:
            values, marks, id_ = point, [], None
        if fast(values if len(values) > 1 else values[0]):
            out.append(point)
        else:
            out.append(pytest.param(*values, marks=[*marks, pytest.mark.sweep], id=id_))
    return out
