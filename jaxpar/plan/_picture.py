"""A picture of a plan (PNG or SVG, matplotlib): the mesh with each axis's role per phase,
and per decoder layer the collectives with their predicted bytes and times."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.plan._planner import Planning
from jaxpar.plan._prediction import Prediction
from jaxpar.plan._summary import axis_roles, per_layer, phase_config
from jaxpar.spec import MESH_AXES, ParallelConfig, Phase

_COLORS = {"dp": "#4c72b0", "pp": "#dd8452", "sp": "#55a868", "ep": "#c44e52", "tp": "#8172b3"}


def _grid(config: ParallelConfig) -> tuple[int, int, list[tuple[int, ...]]]:
    """Rows x columns of the device grid (outer axes down, inner axes across) and each
    device's coordinates in mesh order."""
    shape, n = config.shape, config.size
    coords = [
        tuple(i // math.prod(shape[k + 1 :]) % shape[k] for k in range(len(shape)))
        for i in range(n)
    ]
    cols = 1  # innermost axes across, until the grid is about square
    for degree in reversed(shape):
        if cols * cols >= n:
            break
        cols *= degree
    return n // cols, cols, coords


def _draw_mesh(ax: Any, pred: Prediction, domain: int) -> None:
    config = pred.config
    rows, cols, coords = _grid(config)
    for i, coord in enumerate(coords):
        r, c = divmod(i, cols)
        host = i // domain
        ax.add_patch(
            _rect((c, rows - 1 - r), "#f2f2f2" if host % 2 == 0 else "#dcdcdc", edge="#555555")
        )
        label = "\n".join(f"{a}{coord[k]}" for k, a in enumerate(MESH_AXES) if config.degree(a) > 1)
        ax.text(c + 0.5, rows - 0.5 - r, f"{i}\n{label}", ha="center", va="center", fontsize=6)
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(
        f"{'decode ' if pred.prefill_config else ''}mesh {config} ({config.size} devices; "
        f"shading: fast-link domains of {domain})",
        fontsize=8,
    )


def _rect(xy: tuple[float, float], color: str, edge: str) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle(xy, 1, 1, facecolor=color, edgecolor=edge, linewidth=0.8)


def _draw_roles(ax: Any, model: Any, pred: Prediction) -> None:
    ax.axis("off")
    lines = []
    for phase in Phase:
        roles = axis_roles(model, pred, phase)
        config = phase_config(pred, phase)
        lines.append((f"{phase.value} ({config}):", "black"))
        for axis, text in roles.items():
            lines.append((f"  {axis}={config.degree(axis)}  {text}", _COLORS[axis]))
        if not roles:
            lines.append(("  one device: nothing split", "black"))
    for i, (text, color) in enumerate(lines):
        ax.text(0, 1 - i * 0.075, text, color=color, fontsize=7, va="top", family="monospace")
    ax.set_title("what each mesh axis splits, per phase", fontsize=8)


def _draw_layer(ax: Any, pred: Prediction, phase: Phase, layers: int) -> None:
    cost = pred.prefill if phase is Phase.PREFILL else pred.decode
    rows = per_layer(cost, layers)
    if not rows:
        ax.text(0.5, 0.5, "no collective in a layer", ha="center", va="center", fontsize=8)
        ax.axis("off")
    else:
        names = [f"{r['step']}\n{r['kind']} over {r['axes']} ({r['link']})" for r in rows]
        times = [r["seconds_per_layer"] * 1e6 for r in rows]
        colors = [_COLORS[r["axes"].split(",")[-1]] for r in rows]
        ax.barh(range(len(rows)), times, color=colors)
        ax.set_yticks(range(len(rows)), names, fontsize=6)
        ax.invert_yaxis()
        for i, r in enumerate(rows):
            ax.text(
                times[i],
                i,
                f" {r['bytes_per_layer'] / 1e6:.3g} MB, {times[i]:.3g} us",
                va="center",
                fontsize=6,
            )
        ax.set_xlabel("predicted time per layer (us)", fontsize=7)
        ax.tick_params(axis="x", labelsize=6)
    ax.set_title(
        f"{phase.value}: collectives per layer; step {cost.seconds * 1e3:.3g} ms "
        f"({cost.bound}-bound)",
        fontsize=8,
    )


def draw_plan(model: Any, planning: Planning, path: str | Path) -> Path:
    """Draws the best plan of ``planning`` to ``path`` (``.png`` or ``.svg``)."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ConfigError(f"--picture {path}: give a .png or .svg file")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pred = planning.best
    layers = model.n_layers // pred.config.pp
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    _draw_mesh(axes[0][0], pred, planning.hardware.domain(pred.devices))
    _draw_roles(axes[0][1], model, pred)
    _draw_layer(axes[1][0], pred, Phase.PREFILL, layers)
    _draw_layer(axes[1][1], pred, Phase.DECODE, layers)
    w = pred.workload  # the chosen batch (throughput grows the requested one)
    asked = planning.workload.batch
    batch = f"batch {w.batch}" + (f" (asked {asked})" if w.batch != asked else "")
    if w.serving:
        batch += f", prefill batch {w.prefill_rows}"
    fig.suptitle(
        f"jaxpar plan: {model.arch}, {pred.devices} x {planning.hardware.name}, {batch}, "
        f"prompt {w.prompt_len}, {w.gen_len} new tokens ({planning.objective}): {pred.label}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
