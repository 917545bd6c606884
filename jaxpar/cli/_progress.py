"""Progress lines (rich) for the slow parts: loading, initialising, compiling, decoding."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)


@contextlib.contextmanager
def stage(
    console: Console, description: str, total: int | None = None
) -> Iterator[Callable[..., None]]:
    """A spinner (or a bar of ``total`` steps) with the elapsed time while the body runs.

    Yields ``advance(n=1)``. The finished line stays on screen (``done <description>``), so
    a log shows what took how long.
    """
    columns = [SpinnerColumn(finished_text="[green]done[/]"), TextColumn("{task.description}")]
    if total:
        columns += [BarColumn(), MofNCompleteColumn()]
    columns.append(TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(description, total=total)

        def advance(n: int = 1) -> None:
            progress.advance(task, n)

        yield advance
        progress.update(task, total=total or 1, completed=total or 1)


def tensor_count(config) -> int:
    """How many parameter tensors a model has (the steps of a checkpoint load)."""
    import jax
    from flax import nnx

    from jaxpar.models import abstract_model

    return len(jax.tree.leaves(nnx.state(abstract_model(config))))
