"""Every legal strategy for a device count and a workload, and why the others are refused.

A strategy is one set of mesh degrees (dp, pp, sp, ep, tp) with its per-phase settings:
the axes take their per-phase roles from the tables (``sp`` splits prompt tokens in prefill
and carries batch in decode, ...), the prefill pipeline runs ``microbatches`` and the decode
pipeline ``decode_groups``. The validator (:func:`jaxpar.spec.validate`) decides legality;
nothing it refuses is ever proposed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Protocol

from jaxpar.errors import ConfigError, IllegalStrategyError
from jaxpar.models import ModelConfig, ModelRun
from jaxpar.spec import MESH_AXES, ModelDims, ParallelConfig, validate


class Where(Protocol):
    """Where the strategies must be laid out, as far as enumerating them needs to know:
    why a strategy cannot be laid out there (None: it can). A
    :class:`~jaxpar.plan._placement.Placement` (TPU chips of a known slice) is one."""

    def refusal(self, config: ParallelConfig) -> str | None: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """What is served: ``batch`` sequences, ``prompt_len`` prompt and ``gen_len`` new tokens.

    ``prefill_batch`` set: a server (:class:`jaxpar.engine.ContinuousBatcher`) decodes the
    ``batch`` sequences together while it prefills new prompts ``prefill_batch`` at a time
    (:mod:`jaxpar.plan._serving`); unset: the whole batch is prefilled in one step, as
    ``jaxpar run`` does.
    """

    batch: int
    prompt_len: int
    gen_len: int
    prefill_batch: int | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "prompt_len", "gen_len", "prefill_batch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")

    @property
    def serving(self) -> bool:
        return self.prefill_batch is not None

    @property
    def prefill_rows(self) -> int:
        """Prompts one prefill step runs."""
        return self.batch if self.prefill_batch is None else self.prefill_batch

    @property
    def max_seq_len(self) -> int:
        """KV cache length: the prompt and every generated token."""
        return self.prompt_len + self.gen_len

    def scaled(self, factor: int) -> Workload:
        return dataclasses.replace(self, batch=self.batch * factor)


@dataclasses.dataclass(frozen=True)
class Refused:
    """A strategy the validator (or the workload's shapes) refuses, with the first reason."""

    config: ParallelConfig
    rule: str
    reason: str


def factorizations(n: int, k: int = len(MESH_AXES)) -> Iterator[tuple[int, ...]]:
    """Every ordered ``k``-tuple of positive integers whose product is ``n``."""
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in factorizations(n // d, k - 1):
                yield (d, *rest)


def _schedules(pp: int, batch: int) -> Iterator[tuple[int, int]]:
    """(microbatches, decode_groups) tried for ``pp`` stages: 1 or multiples of pp."""
    if pp == 1:
        yield 1, 1
        return
    prefill = [1, *(pp * 2**i for i in range(3) if pp * 2**i <= batch)]
    decode = [1, *(pp * 2**i for i in range(2) if pp * 2**i <= batch)]
    for m in prefill:
        for g in decode:
            yield m, g


def strategies(n_devices: int, batch: int) -> Iterator[ParallelConfig]:
    """Every candidate strategy on ``n_devices`` (legal or not)."""
    for degrees in factorizations(n_devices):
        dims = dict(zip(MESH_AXES, degrees, strict=True))
        for m, g in _schedules(dims["pp"], batch):
            yield ParallelConfig(**dims, microbatches=m, decode_groups=g)


def check(model: ModelDims, config: ParallelConfig, workload: Workload) -> Refused | None:
    """None when ``config`` is legal for the model and workload, else why not."""
    try:
        validate(
            model,
            config,
            n_devices=config.size,
            batch=workload.batch,
            max_seq_len=workload.max_seq_len,
        )
    except IllegalStrategyError as e:
        first = e.violations[0] if e.violations else None
        rule = first.rule if first else "illegal"
        return Refused(config, rule, first.message if first else str(e))
    if config.pp > 1 and (why := _unstackable(model)) is not None:
        return Refused(config, "model", f"pp={config.pp} runs the layers stacked: {why}")
    if workload.prompt_len % config.sp:
        return Refused(
            config,
            "sp-prefill-tokens",
            f"prompt_len {workload.prompt_len} does not divide into sp={config.sp} token shards",
        )
    return None


def _unstackable(model: ModelDims) -> str | None:
    """Why a jaxpar model cannot run stacked layers (pipeline stages), or None: DeepSeek's
    dense and MoE layers differ, MLA's caches are per layer (``ExecutionOptions`` refuses
    ``layer_loop="scan"`` for such a model, with the reason)."""
    if not isinstance(model, (ModelConfig, ModelRun)):
        return None
    run = ModelRun.of(model)
    if run.layer_loop == "scan":
        return None
    try:
        run.with_options(layer_loop="scan")
    except ConfigError as e:
        return str(e)
    return None


def legal_strategies(
    model: ModelDims, n_devices: int, workload: Workload, where: Where | None = None
) -> tuple[list[ParallelConfig], list[Refused]]:
    """(legal, refused) strategies on exactly ``n_devices`` devices; with ``where`` (TPU
    chips of a known slice), also refused: those ``make_mesh`` could not lay out there."""
    legal, refused = [], []
    for config in strategies(n_devices, workload.batch):
        why = check(model, config, workload)
        if why is None and where is not None and (reason := where.refusal(config)):
            why = Refused(config, "topology", reason)
        if why is None:
            legal.append(config)
        else:
            refused.append(why)
    return legal, refused
