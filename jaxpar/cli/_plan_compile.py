"""``jaxpar plan --compile``: compile the plans shown for their TPU slice and read their memory.

Compile-only (libtpu's topologies, no TPU needed): each colocated plan's prefill and decode
steps are compiled for the slice the plan names, and ``memory_analysis()`` gives the bytes
per device the program needs (arguments + outputs + temporaries, less what outputs alias
into donated arguments), next to the planner's prediction. This is the figure the planner's
memory model only estimates (XLA's buffer assignment decides the temporaries).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from jaxpar.errors import ConfigError, JaxparError
from jaxpar.plan import Prediction

# Compile-only slice shapes (chips per axis) by chip count; a host holds 2 x 2 chips.
_SLICES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16)}
_CHIPS = {"tpu-v5e": "v5e", "tpu-v6e": "v6e"}


def topology(hardware: str, devices: int) -> str:
    """The compile-only topology (``"v5e:4x4"``) of ``devices`` chips of a TPU kind.

    Raises:
        ConfigError: not a TPU kind with 2-D slices, or no slice of that many chips.
    """
    chip = _CHIPS.get(hardware)
    if chip is None:
        raise ConfigError(
            f"plan --compile compiles for TPU slices of {', '.join(_CHIPS)}; got {hardware!r}"
        )
    if devices not in _SLICES_2D:
        raise ConfigError(
            f"plan --compile: no {chip} slice of {devices} chips; slices: "
            + ", ".join(map(str, _SLICES_2D))
        )
    a, b = _SLICES_2D[devices]
    return f"{chip}:{a}x{b}"


@dataclass(frozen=True)
class Compiled:
    """One plan compiled: bytes per device per phase, predicted (the planner's per-step
    figures) and compiled (None when it did not compile), the error when it did not, and the
    seconds both compiles took."""

    label: str
    predicted_prefill: int
    predicted_decode: int
    prefill: int | None
    decode: int | None
    error: str | None
    seconds: float


def program_bytes(compiled: Any) -> int:
    """Bytes per device a compiled program needs: arguments + outputs + temporaries, less
    the outputs that alias donated arguments (the cache a decode step updates in place)."""
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def compile_plan(model: Any, pred: Prediction, devices: list) -> Compiled:
    """Compiles ``pred``'s prefill and decode steps over ``devices`` (compile-only)."""
    from jaxpar.engine import AbstractEngine
    from jaxpar.spec import make_mesh

    start, w = time.perf_counter(), pred.workload
    try:
        mesh = make_mesh(pred.config, devices=devices[: pred.config.size])
        engine = AbstractEngine.build(
            model, pred.config, max_batch=w.batch, max_seq_len=w.max_seq_len, mesh=mesh
        )
        decode = program_bytes(engine.lower("decode", prompt_len=w.prompt_len).compile())
        prefill = program_bytes(engine.lower("prefill", prompt_len=w.prompt_len).compile())
        error = None
    except (JaxparError, ValueError, RuntimeError) as e:  # XLA reports RESOURCE_EXHAUSTED so
        decode = prefill = None
        error = str(e).splitlines()[0][:160]
    m = pred.memory
    seconds = time.perf_counter() - start
    return Compiled(pred.label, m.prefill_step, m.decode_step, prefill, decode, error, seconds)


def compile_plans(model: Any, plans: list[Prediction], hardware: str, devices: int) -> list:
    """:func:`compile_plan` for each colocated plan of ``plans`` on its TPU slice."""
    from jaxpar.inspect import tpu_devices

    topo = topology(hardware, devices)
    tpu = tpu_devices(topo)
    return [compile_plan(model, p, tpu) for p in plans if not p.disaggregated]


def ratio(compiled: int | None, predicted: int) -> str:
    return "-" if compiled is None else f"{compiled / predicted:.2f}"


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.4g}"


COLUMNS = (
    "plan",
    "prefill GiB: pred / compiled",
    "ratio",
    "decode GiB: pred / compiled",
    "ratio",
    "s",
    "error",
)


def rows(results: list[Compiled]) -> list[tuple[str, ...]]:
    """Table rows (:data:`COLUMNS`): per phase the predicted and compiled GiB and their
    ratio (compiled / predicted), the compile seconds, the compiler's error."""
    return [
        (
            c.label,
            f"{gib(c.predicted_prefill)} / {gib(c.prefill)}",
            ratio(c.prefill, c.predicted_prefill),
            f"{gib(c.predicted_decode)} / {gib(c.decode)}",
            ratio(c.decode, c.predicted_decode),
            f"{c.seconds:.0f}",
            c.error or "",
        )
        for c in results
    ]
