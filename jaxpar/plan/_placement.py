"""Where a strategy's chips sit on a TPU slice: only strategies that lay out are planned.

:func:`jaxpar.spec.make_mesh` orders TPU chips from the slice's torus (tp, then ep, sp, pp,
dp on ICI neighbours; only dp and pp across slices). A :class:`Placement` lays a strategy
out the same way on stand-in chips of the slice shape the hardware file names for the device
count (``slices``, or ``--topology``), so the planner refuses what ``make_mesh`` would refuse
and prints what each axis spans. Off TPU, or for a slice size the file does not know, there
is no placement and nothing is checked.
"""

from __future__ import annotations

import dataclasses
import functools

from jaxpar.errors import MeshError
from jaxpar.plan._hardware import Hardware
from jaxpar.plan._prediction import Prediction
from jaxpar.spec import AxisLayout, ParallelConfig, layout_text, slice_layout


@dataclasses.dataclass(frozen=True)
class Placement:
    """Chips ``[first, first + count)`` of ``n_slices`` slices of ``slice_shape`` (stand-in
    chips numbered x fastest, as a slice numbers them), of ``device_kind``."""

    device_kind: str
    slice_shape: tuple[int, ...]
    n_slices: int = 1
    first: int = 0

    def layout(self, config: ParallelConfig) -> tuple[AxisLayout, ...]:
        """What each axis of ``config`` spans.

        Raises:
            MeshError: ``make_mesh`` could not lay ``config`` out here.
        """
        return _layout(config.shape, self.device_kind, self.slice_shape, self.n_slices, self.first)

    def refusal(self, config: ParallelConfig) -> str | None:
        """Why ``config`` cannot be laid out here, or None."""
        try:
            self.layout(config)
        except MeshError as e:
            return str(e)
        return None

    def describe(self, config: ParallelConfig) -> str:
        """One line: ``"tp=8 over x(4)·y(2 of 4), split, contiguous"`` per axis."""
        return layout_text(self.layout(config)) or ""

    @property
    def slice_name(self) -> str:
        shape = "x".join(map(str, self.slice_shape))
        return shape if self.n_slices == 1 else f"{self.n_slices} x {shape}"


def placement(hardware: Hardware, devices: int, first: int = 0) -> Placement | None:
    """The placement of the chips from ``first`` on, of a cluster of ``devices`` chips of
    ``hardware``; None off TPU or for an unknown slice size."""
    topology = hardware.slice_topology(devices)
    if topology is None or hardware.device_kind is None:
        return None
    shape, n_slices = topology
    return Placement(hardware.device_kind, shape, n_slices, first)


def with_layout(pred: Prediction, hardware: Hardware, devices: int) -> Prediction:
    """``pred`` with what each axis spans on the chips (decode group first, a disaggregated
    prefill group after it); unchanged off TPU."""
    where = placement(hardware, devices)
    if where is None:
        return pred
    layout = where.describe(pred.config)
    if pred.prefill_config is None:
        return dataclasses.replace(pred, layout=layout)
    after = dataclasses.replace(where, first=pred.config.size)
    return dataclasses.replace(
        pred, layout=layout, prefill_layout=after.describe(pred.prefill_config)
    )


@functools.lru_cache(maxsize=4096)
def _layout(
    shape: tuple[int, ...],
    device_kind: str,
    slice_shape: tuple[int, ...],
    n_slices: int,
    first: int,
) -> tuple[AxisLayout, ...]:
    return slice_layout(shape, device_kind, slice_shape, n_slices, first)
