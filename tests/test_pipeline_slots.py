"""The pipelined serving step's schedule arithmetic: groups per step, the bubble it pays.

:class:`~jaxpar.engine._pipeline_slots.SlotPipeline` splits a step's rows into decode
groups that divide every batch shard's rows, and counts each step's stage-iterations and
the idle ones (fill and drain, and groups without a live row) for ``/metrics``. The
served tokens themselves are checked against one device in ``tests/test_serve_pipeline.py``
and ``tests/test_paged_serving.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxpar.engine._pipeline_slots import SlotPipeline, bubble_fraction


@dataclasses.dataclass(frozen=True)
class _Stages:
    count: int


def _pipeline(stages: int, groups: int, shards: int = 1) -> SlotPipeline:
    return SlotPipeline(_Stages(stages), groups, shards)


@pytest.mark.parametrize(
    "rows, shards, groups, expected",
    [(8, 1, 8, 8), (4, 1, 8, 4), (1, 1, 8, 1), (12, 1, 8, 6), (8, 2, 8, 4), (16, 2, 4, 4)],
)
def test_groups_divide_each_shards_rows(rows, shards, groups, expected):
    got = _pipeline(2, groups, shards).groups_for(rows)
    assert got == expected and (rows // shards) % got == 0


def test_a_full_step_idles_only_the_fill_and_drain():
    pipe = _pipeline(2, 4)
    total, idle = pipe.stage_iterations(np.ones(8, bool), 8)
    assert total == 2 * (4 + 1)
    assert idle / total == pytest.approx(bubble_fraction(2, 4)) == pytest.approx(0.2)


def test_groups_without_a_live_row_count_as_idle():
    """Rows 0 and 4 live (group 0 of 4, rows r % 4): three groups run on placeholders."""
    pipe = _pipeline(2, 4)
    live = np.zeros(8, bool)
    live[[0, 4]] = True
    total, idle = pipe.stage_iterations(live, 8)
    assert (total, idle) == (10, 10 - 2 * 1)


def test_only_the_computed_rows_of_each_shard_count():
    """Two shards of 8 rows, a step over the first 4 of each: group g is computed row
    r % 4 == g, and a live row past the computed ones is not in the step."""
    pipe = _pipeline(2, 4, shards=2)
    live = np.zeros(16, bool)
    live[[1, 8 + 2, 7]] = True  # row 7 is past shard 0's first 4: not computed
    total, idle = pipe.stage_iterations(live, 8)
    # Computed rows: shard 0's 0..3 (r = 0..3), shard 1's 8..11 (r = 4..7); with 8 rows
    # and 4 per shard, G = 4: live computed r = 1 and r = 6 -> groups 1 and 2.
    assert pipe.groups_for(8) == 4
    assert (total, idle) == (10, 10 - 2 * 2)
