"""Hardware as data: one TOML per device kind (``jaxpar/plan/hardware/*.toml``), overridable.

A :class:`Hardware` holds what the cost model needs of one device: peak FLOP/s per dtype,
HBM capacity and bandwidth, and two links: the fast one inside a domain of
``domain_size`` devices (NVLink inside a GPU host, ICI inside a TPU slice) and the slow one
between domains (the cluster network, or DCN between TPU slices). :meth:`Hardware.link`
places a collective over mesh axes on the links it crosses, by the mesh order
``dp, pp, sp, ep, tp`` (tp innermost, on consecutive devices).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.spec import MESH_AXES, ParallelConfig

KINDS = ("tpu-v5e", "tpu-v5p", "tpu-v6e", "h100", "h200", "a100", "cpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
    """A link as one collective sees it: bandwidth per device (GB/s) and latency per hop."""

    name: str
    gbps: float
    latency_us: float

    def __post_init__(self) -> None:
        if self.gbps <= 0 or self.latency_us < 0:
            raise ConfigError(f"link {self.name}: gbps must be > 0 and latency_us >= 0")

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """One device kind (figures per device) and the links between devices."""

    name: str
    source: str
    peak_tflops: Mapping[str, float]
    hbm_gib: float
    hbm_gbps: float
    domain_size: int
    fast_link: Link
    slow_link: Link
    per_host: int | None = None  # devices per fast-link domain in use (--hosts); None: full
    #: TPU: ``jax.Device.device_kind`` of the chip and the torus shape of a slice of each
    #: chip count (Cloud TPU's slice shapes), from which :mod:`jaxpar.plan._placement` lays
    #: a strategy out as :func:`jaxpar.spec.make_mesh` would. None / empty off TPU.
    device_kind: str | None = None
    slices: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    topology: tuple[int, ...] | None = None  # a slice's shape given by hand (--topology)

    def __post_init__(self) -> None:
        if self.hbm_gib <= 0 or self.hbm_gbps <= 0 or self.domain_size < 1:
            raise ConfigError(f"hardware {self.name}: hbm_gib, hbm_gbps, domain_size must be > 0")
        if any(v <= 0 for v in self.peak_tflops.values()):
            raise ConfigError(f"hardware {self.name}: every peak_tflops must be > 0")

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (float32, bfloat16, float16)."""
        if dtype not in self.peak_tflops:
            raise ConfigError(
                f"hardware {self.name} has no peak_tflops for {dtype}; "
                f"give one with --hw peak_tflops.{dtype}=..."
            )
        return self.peak_tflops[dtype] * 1e12

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gib * 2**30)

    @property
    def platform(self) -> str:
        """The JAX platform of this kind (``"tpu"``, ``"cpu"``, else ``"cuda"``): what the
        options' ``"auto"`` kernels resolve for."""
        if self.device_kind is not None or self.name.startswith("tpu"):
            return "tpu"
        return "cpu" if self.name == "cpu" else "cuda"

    def domain(self, n_devices: int) -> int:
        """Devices per fast-link domain for an ``n_devices`` mesh."""
        return min(self.per_host or self.domain_size, n_devices)

    def with_hosts(self, devices: int, hosts: int | None) -> Hardware:
        """``devices`` spread evenly over ``hosts`` fast-link domains (``--hosts``)."""
        if hosts is None:
            return self
        if hosts < 1 or devices % hosts:
            raise ConfigError(f"{devices} devices do not split evenly over {hosts} hosts")
        per_host = devices // hosts
        if per_host > self.domain_size:
            raise ConfigError(
                f"{per_host} devices per host exceed {self.name}'s fast-link domain of "
                f"{self.domain_size} ({self.fast_link.name}); use more hosts"
            )
        return dataclasses.replace(self, per_host=per_host)

    def slice_topology(self, n_devices: int) -> tuple[tuple[int, ...], int] | None:
        """(one slice's torus shape, slices) of ``n_devices`` TPU chips in slices of the fast
        domain's size; None off TPU or where no slice of that size is known."""
        if self.device_kind is None:
            return None
        per = math.prod(self.topology) if self.topology else self.domain(n_devices)
        shape = self.topology or self.slices.get(per) or self._box(per)
        if shape is None or n_devices % per:
            return None
        return tuple(shape), n_devices // per

    def _box(self, chips: int) -> tuple[int, ...] | None:
        """A slice size the file does not name (part of a slice, ``--hosts``): the most
        nearly cubic box of ``chips`` in the torus's dimensions, x the shortest."""
        ndim = len(next(iter(self.slices.values()), ()))
        if ndim == 0:
            return None
        shape = []
        for left in range(ndim, 0, -1):
            side = max(d for d in range(1, chips + 1) if chips % d == 0 and d**left <= chips)
            shape.append(side)
            chips //= side
        return tuple(shape)

    def with_topology(self, topology: str | None, devices: int) -> Hardware:
        """A slice's torus given by hand (``--topology 4x4``, ``4x4x4``) for ``devices`` chips
        in whole slices: each slice is one fast-link domain."""
        if topology is None:
            return self
        if self.device_kind is None:
            raise ConfigError(f"--topology {topology}: {self.name} is not a TPU")
        try:
            shape = tuple(int(x) for x in topology.lower().split("x"))
        except ValueError:
            raise ConfigError(f"--topology {topology!r}: expected AxB or AxBxC") from None
        if not 1 <= len(shape) <= 3 or min(shape) < 1:
            raise ConfigError(f"--topology {topology!r}: expected AxB or AxBxC")
        if devices % math.prod(shape):
            raise ConfigError(
                f"--topology {topology}: {devices} devices are not whole slices of "
                f"{math.prod(shape)} chips"
            )
        return dataclasses.replace(self, topology=shape, per_host=math.prod(shape))

    def link(self, axes: Sequence[str], config: ParallelConfig) -> Link:
        """The slowest link a collective over ``axes`` crosses.

        Devices are numbered in mesh order (tp fastest); a group over ``axes`` spans from
        its innermost axis's stride to its outermost axis's stride x degree. Inside one
        domain it runs on the fast link, else on the slow one.
        """
        domain = self.domain(config.size)
        strides = {}
        stride = 1
        for axis in reversed(MESH_AXES):
            strides[axis] = stride
            stride *= config.degree(axis)
        outer = max(axes, key=MESH_AXES.index)
        span = strides[outer] * config.degree(outer)
        return self.fast_link if span <= domain else self.slow_link

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def hardware_file(kind: str) -> Path:
    """The packaged TOML of ``kind``, or ``kind`` itself when it is a path to a TOML file."""
    path = Path(kind)
    if path.suffix == ".toml" and path.is_file():
        return path
    if kind not in KINDS:
        raise ConfigError(f"unknown hardware {kind!r}; kinds: {', '.join(KINDS)} (or a .toml file)")
    return Path(str(importlib.resources.files("jaxpar.plan") / "hardware" / f"{kind}.toml"))


def load_hardware(kind: str, overrides: Sequence[str] = ()) -> Hardware:
    """Reads a device kind's TOML, then applies ``KEY=VALUE`` overrides (``--hw``).

    Keys are the TOML's, dotted into tables: ``hbm_gib=24``, ``peak_tflops.bfloat16=900``,
    ``fast_link.gbps=400``, ``slow_link.latency_us=8``.
    """
    path = hardware_file(kind)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: cannot read hardware description: {e}") from e
    for text in overrides:
        _override(data, text)
    try:
        return Hardware(
            name=data["name"],
            source=data["source"],
            peak_tflops=dict(data["peak_tflops"]),
            hbm_gib=float(data["hbm_gib"]),
            hbm_gbps=float(data["hbm_gbps"]),
            domain_size=int(data["domain_size"]),
            fast_link=Link(**data["fast_link"]),
            slow_link=Link(**data["slow_link"]),
            device_kind=data.get("device_kind"),
            slices={int(k): _shape(v) for k, v in data.get("slices", {}).items()},
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: bad hardware description ({e})") from e


def _shape(text: str) -> tuple[int, ...]:
    """``"4x4"`` -> ``(4, 4)``."""
    return tuple(int(x) for x in text.split("x"))


def _override(data: dict[str, Any], text: str) -> None:
    key, sep, value = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"--hw {text!r}: expected KEY=VALUE, e.g. hbm_gib=24")
    node = data
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            raise ConfigError(f"--hw {text!r}: {part!r} is not a table of the hardware file")
        node = node[part]
    if parts[-1] not in node:
        raise ConfigError(f"--hw {text!r}: unknown key; known here: {', '.join(node)}")
    old = node[parts[-1]]
    try:
        node[parts[-1]] = value.strip() if isinstance(old, str) else type(old)(value)
    except ValueError:
        raise ConfigError(f"--hw {text!r}: {value!r} is not a {type(old).__name__}") from None
    if isinstance(old, float | int) and not math.isfinite(float(node[parts[-1]])):
        raise ConfigError(f"--hw {text!r}: not a finite number")


#: Substrings of ``jax.Device.device_kind`` (lower-cased) -> a kind of :data:`KINDS`; the
#: first that matches wins, so the more specific come first. None: a variant whose
#: figures differ from the file's (H100 PCIe and NVL: other HBM bandwidth and FLOP/s).
DEVICE_KINDS: tuple[tuple[str, str | None], ...] = (
    ("h100 pcie", None),
    ("h100 nvl", None),
    ("h200", "h200"),
    ("h100", "h100"),
    ("a100", "a100"),
    ("v6 lite", "tpu-v6e"),
    ("v6e", "tpu-v6e"),
    ("v5 lite", "tpu-v5e"),
    ("v5e", "tpu-v5e"),
    ("v5p", "tpu-v5p"),
    ("tpu v5", "tpu-v5p"),
)


def device_hardware(platform: str, device_kind: str) -> str | None:
    """The hardware kind of a JAX device (``platform``, ``device_kind``): ``cpu`` for any
    CPU, else the :data:`DEVICE_KINDS` entry its kind names; None when none does."""
    if platform == "cpu":
        return "cpu"
    kind = device_kind.lower()
    return next((name for part, name in DEVICE_KINDS if part in kind), None)
