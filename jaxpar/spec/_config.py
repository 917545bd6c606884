"""``ParallelConfig``: the degree of each of the five primitives."""

from __future__ import annotations

import dataclasses
import math

from jaxpar.errors import ConfigError
from jaxpar.spec._enums import MESH_AXES, Primitive

_FIELDS = (*MESH_AXES, "microbatches", "decode_groups")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Degrees of data, pipeline, sequence, expert and tensor parallelism.

    Each primitive owns the mesh axis of the same name; the mesh is laid out outermost to
    innermost as ``dp, pp, sp, ep, tp`` so TP lands on the fastest links. A degree of 1
    switches a primitive off.
    """

    dp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1
    tp: int = 1
    #: Prefill microbatches pipelined through the ``pp`` stages (GPipe fill, steady, drain).
    microbatches: int = 1
    #: Independent groups of sequences that fill the decode pipeline. 1 = one group walks
    #: the stages in order; ``>= pp`` keeps every stage busy without overlapping a
    #: sequence's consecutive steps.
    decode_groups: int = 1

    def __post_init__(self) -> None:
        for name in (*MESH_AXES, "microbatches", "decode_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ParallelConfig.{name} must be an int >= 1, got {value!r}")
        if self.pp == 1 and (self.microbatches > 1 or self.decode_groups > 1):
            raise ConfigError(
                f"microbatches={self.microbatches}, decode_groups={self.decode_groups} schedule a "
                "pipeline, but pp=1; set pp > 1 or leave both at 1"
            )

    def degree(self, primitive: Primitive | str) -> int:
        return getattr(self, Primitive.coerce(primitive).value)

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in axis order ``dp, pp, sp, ep, tp``."""
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    @property
    def size(self) -> int:
        """Number of devices the strategy needs."""
        return math.prod(self.shape)

    def active(self) -> tuple[str, ...]:
        """Mesh axes with degree > 1."""
        return tuple(axis for axis in MESH_AXES if getattr(self, axis) > 1)

    def __str__(self) -> str:
        parts = [f"{axis}={getattr(self, axis)}" for axis in self.active()]
        parts += [
            f"{k}={getattr(self, k)}"
            for k in ("microbatches", "decode_groups")
            if getattr(self, k) > 1
        ]
        return ",".join(parts) or "single-device"

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        """Parses ``"dp=2,tp=4"`` (the CLI form); empty or ``single-device`` is all ones."""
        text = text.strip()
        if text in ("", "single-device"):
            return cls()
        degrees = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in _FIELDS or not value.strip().isdigit():
                raise ConfigError(
                    f"cannot parse {part!r} in {text!r}; expected e.g. 'dp=2,tp=4' with keys "
                    f"{', '.join(_FIELDS)}"
                )
            degrees[key] = int(value)
        return cls(**degrees)
