"""Decode rows grouped by block-table width: a short row does not read a long row's width.

On the XLA paged path a decode step reads, for every row it computes, as many KV
positions as its block table is wide: a power of two above the longest live row. One
long row then makes every row read its length (measured on the serving benchmarks: 55%
of the positions a step read lay past the rows' ends). :class:`DecodeGrouping` decides,
per step and without devices, whether to split the rows into two dispatches, the short
rows at their own width and the long ones at theirs, when that costs less than one
dispatch at the longest width by the :class:`StepCost` model (a fixed cost per dispatch,
one per row computed and one per KV position read, fitted from measured step times).

A split step is a :class:`DecodeGroup` per dispatch: the rows it computes, in row order
per batch shard (each shard's rows are its own: nothing crosses shards), and its width.
:func:`group_rows` and :func:`group_tables` turn one into the step's inputs.

A group's program (a step over rows chosen by id, per row bucket and width) is not the
unsplit step's. :meth:`DecodeGrouping.programs` lists those a split the policy can choose
would run (the warm-up compiles them), and with ``ready`` set the policy splits only when
both groups' programs are ready (the batcher's: compiled, and run once while idle): a
split never compiles, nor pays a program's slower first run, while the streams wait.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxpar.errors import ConfigError

#: The share of a decode step's modelled time a split must save to be taken.
MIN_SAVING = 0.2


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A decode dispatch's time: ``dispatch_ms + row_ms * rows + position_us * 1e-3 *
    rows * width_tokens`` (rows computed, padding included; each reads its table's width).

    The defaults are fitted (least squares) to the served decode step of SmolLM2-135M
    shapes (f32, one CPU device, 2 cores shared with other jobs, load ~6) at 1, 4, 8 and
    16 rows and widths of 128, 512 and 2,048 tokens (16 rows at 2,048 left out: 2.0 s, an
    outlier of cache effects; residuals within 25 ms elsewhere, 84 ms at 16 rows x 512),
    recorded in ``scripts/docs/pages/benchmarks.md``.
    """

    dispatch_ms: float = 61.0
    row_ms: float = 8.8
    position_us: float = 15.7

    def __post_init__(self) -> None:
        for name in ("dispatch_ms", "row_ms", "position_us"):
            if getattr(self, name) < 0:
                raise ConfigError(f"StepCost.{name} must be >= 0, got {getattr(self, name)}")

    def of(self, rows: int, width_tokens: int) -> float:
        """Milliseconds of one dispatch over ``rows`` rows of ``width_tokens`` positions."""
        return self.dispatch_ms + self.row_ms * rows + 1e-3 * self.position_us * rows * width_tokens


@dataclasses.dataclass(frozen=True)
class DecodeGroup:
    """One dispatch of a split decode step.

    Attributes:
        rows: the live rows it computes (global row ids, ascending).
        width: its block-table columns.
        computed: the rows its program computes per batch shard (its bucket: the most
            any shard holds of ``rows``, padded as a step's rows are).
    """

    rows: tuple[int, ...]
    width: int
    computed: int


class DecodeGrouping:
    """The policy: one dispatch at the longest row's width, or two by width.

    Args:
        cost: the dispatch cost model.
        rows: decode rows in all; ``shards``: batch shards (each holds ``rows / shards``
            consecutive rows).
        page_size: tokens per page.
        width: block-table columns a step reads for rows of up to ``tokens`` tokens
            (the cache's, a power of two).
        bucket: the rows a program computes per shard for ``need`` rows there (the
            step's row buckets).
        ready: ``ready(computed, width)``: a group's program over ``computed`` rows per
            shard at ``width`` columns is compiled (None: take any split).
        min_saving: the share of the unsplit step's modelled time a split must save
            (default :data:`MIN_SAVING`): the second dispatch's host time and the model's
            error are not in the model, and a split that barely pays is not worth its
            programs (with 256-token rows, none is listed).
    """

    def __init__(
        self,
        cost: StepCost,
        *,
        rows: int,
        shards: int,
        page_size: int,
        width: Callable[[int], int],
        bucket: Callable[[int], int],
        ready: Callable[[int, int], bool] | None = None,
        min_saving: float | None = None,
    ):
        if shards < 1 or rows % shards:
            raise ConfigError(f"{rows} decode rows do not split into {shards} batch shards")
        self.cost = cost
        self.per, self.shards, self.page_size = rows // shards, shards, page_size
        self.width, self.bucket, self.ready = width, bucket, ready
        #: The share of the unsplit step's time a split may cost (1 - ``min_saving``).
        self.keep = 1.0 - (MIN_SAVING if min_saving is None else min_saving)
        if not 0.0 < self.keep <= 1.0:
            raise ConfigError(f"min_saving must be in [0, 1), got {min_saving}")

    def _computed(self, rows: Sequence[int]) -> int:
        counts = np.bincount(np.asarray(rows, int) // self.per, minlength=self.shards)
        return self.bucket(int(counts.max()))

    def _ms(self, computed: int, width: int) -> float:
        return self.cost.of(computed * self.shards, width * self.page_size)

    def single(self, live: Sequence[bool], lengths: Sequence[int]) -> tuple[int, int]:
        """(rows per shard, width) of the one dispatch a step takes unsplit: every shard's
        rows up to its last live one, at the longest row's width."""
        idx = np.nonzero(live)[0]
        need = int((idx % self.per).max()) + 1
        longest = max(lengths[i] for i in idx) + 1
        return self.bucket(need), self.width(longest)

    def groups(
        self, live: Sequence[bool], lengths: Sequence[int]
    ) -> tuple[DecodeGroup, ...] | None:
        """The step's dispatches when two cost less than one by ``min_saving`` (short rows
        first), else None. ``lengths[i]``: tokens row ``i`` holds before the step."""
        idx = [i for i, b in enumerate(live) if b]
        if len(idx) < 2:
            return None
        widths = {i: self.width(lengths[i] + 1) for i in idx}
        top = max(widths.values())
        best, plan = self.keep * self._ms(*self.single(live, lengths)), None
        for w in sorted(set(widths.values()) - {top}):
            short = [i for i in idx if widths[i] <= w]
            long = [i for i in idx if widths[i] > w]
            a, b = self._computed(short), self._computed(long)
            ms = self._ms(a, w) + self._ms(b, top)
            if self.ready is not None and not (self.ready(a, w) and self.ready(b, top)):
                continue  # its programs would compile while the streams wait
            if ms < best:
                best = ms
                plan = (DecodeGroup(tuple(short), w, a), DecodeGroup(tuple(long), top, b))
        return plan

    def programs(self, widths: Sequence[int]) -> list[tuple[int, int]]:
        """(rows computed per shard, width) of every group program a split this policy
        chooses can run, for steps at block-table ``widths`` (the cache's): a short group
        at ``w`` and a long one at ``top > w`` are listed when, for some count of short
        and long rows in a shard (or, with several batch shards, each kind's most in
        shards of their own), two dispatches save ``min_saving`` of one over those rows
        held contiguously (rows are taken lowest first; a split that pays only because
        freed rows left holes may find its programs not compiled, and then the step runs
        whole). Ascending."""
        widths = sorted(set(widths))
        per = self.per
        # (short rows, long rows, rows the unsplit step computes) in the fullest shards:
        # both kinds in one shard, or (several shards) each kind's most in another.
        counts = [(s, n, s + n) for s in range(1, per) for n in range(1, per - s + 1)]
        if self.shards > 1:
            counts += [(s, n, max(s, n)) for s in range(1, per + 1) for n in range(1, per + 1)]
        out: set[tuple[int, int]] = set()
        for j, top in enumerate(widths):
            for w in widths[:j]:
                for n_short, n_long, n_single in counts:
                    a, b = self.bucket(n_short), self.bucket(n_long)
                    single = self.keep * self._ms(self.bucket(n_single), top)
                    if self._ms(a, w) + self._ms(b, top) < single:
                        out |= {(a, w), (b, top)}
        return sorted(out)


def group_rows(group: DecodeGroup, rows: int, shards: int) -> np.ndarray:
    """``int32 [computed * shards]``: the rows a group's program computes, each shard's
    in its own span, padded with ``-1`` (computes nothing, writes nothing)."""
    per = rows // shards
    out = np.full((shards, group.computed), -1, np.int32)
    for s in range(shards):
        mine = [r for r in group.rows if r // per == s]
        out[s, : len(mine)] = mine
    return out.reshape(-1)


def group_tables(tables_BN: np.ndarray, rows_R: np.ndarray) -> np.ndarray:
    """The block tables (``[B, N]``, or ``[G, B, N]`` with KV groups) of ``rows_R``'s rows
    (padding rows: page 0, never read)."""
    out = tables_BN[..., np.maximum(rows_R, 0), :]
    out[..., rows_R < 0, :] = 0
    return np.ascontiguousarray(out, np.int32)
