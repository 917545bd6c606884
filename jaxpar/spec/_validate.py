"""``validate``: checks a strategy against the tables and named rules, before any compile.

Every check is one named rule of ``sharding_specs/rules.toml``. All violations are
collected and raised together as one :class:`IllegalStrategyError` whose lines each name the
rule, module, primitive and phase, the offending sizes, and what would be legal; each broken
rule is then cited once, by its file and key under ``sharding_specs/``. On success the
returned :class:`Plan` says which primitive splits which module on which mesh axis in each
phase.
"""

from __future__ import annotations

import dataclasses
import math

from jaxpar.errors import IllegalStrategyError
from jaxpar.spec._config import ParallelConfig
from jaxpar.spec._dims import ModelDims, model_field
from jaxpar.spec._enums import Module, Phase, Primitive, Status
from jaxpar.spec._rules import SPLITTING, mesh_axes
from jaxpar.spec._tables import SpecTable, spec_table

_TOKEN_DIMS = ("seq", "cache_seq")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Violation:
    rule: str
    module: Module | None
    primitive: Primitive | None
    phase: Phase | None
    message: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Assignment:
    """One cell of the plan: what ``primitive`` does to ``module`` in ``phase``."""

    phase: Phase
    module: Module
    primitive: Primitive
    degree: int
    status: Status
    splits: tuple[str, ...]  # logical dims split over the primitive's mesh axis
    row: str
    sync: str
    source: str


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated strategy: per phase and module, which logical dims each mesh axis splits."""

    config: ParallelConfig
    assignments: tuple[Assignment, ...]

    def for_phase(self, phase: Phase | str) -> tuple[Assignment, ...]:
        phase = Phase.coerce(phase)
        return tuple(a for a in self.assignments if a.phase is phase)


def modules_of(model: ModelDims) -> tuple[Module, ...]:
    """The modules a model has: MoE layers replace the dense FFN, which a MoE model keeps
    for its dense first layers or shared experts (DeepSeek-V3)."""
    if model.n_experts <= 0:
        return (Module.EMBEDDING, Module.ATTENTION, Module.FFN, Module.LM_HEAD)
    dense = model_field(model, "moe.first_dense_layers", 0) or model_field(
        model, "moe.shared_d_ff", 0
    )
    ffn = (Module.FFN, Module.MOE) if dense else (Module.MOE,)
    return (Module.EMBEDDING, Module.ATTENTION, *ffn, Module.LM_HEAD)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class _Collector:
    def __init__(self, table: SpecTable):
        self.table = table
        self.found: list[Violation] = []

    def add(self, rule_id, problem, legal, module=None, primitive=None, phase=None) -> None:
        where = "/".join(str(x) for x in (module, primitive, phase) if x is not None)
        self.table.rule(rule_id)  # an unknown id is a bug here, not a user error
        message = f"[{rule_id}] {where + ': ' if where else ''}{problem}. Legal: {legal}"
        self.found.append(
            Violation(
                rule=rule_id, module=module, primitive=primitive, phase=phase, message=message
            )
        )


def _check_int4_groups(model: ModelDims, tp: int, checks, out: _Collector) -> None:
    """int4 (a run's ``int4_group``, rows per scale group): a down projection's scales have
    one row per group of its ``d_ff`` rows, split over tp with them, so the groups must
    divide over tp too (one group is per channel and replicated)."""
    group = getattr(model, "int4_group", None)
    if not group:
        return
    for module, name, size in checks:
        if name not in ("d_ff", "moe.dense_d_ff", "moe.shared_d_ff"):
            continue
        groups = size // min(group, size)
        if groups > 1 and groups % tp:
            legal = [d for d in _divisors(groups) if size % d == 0]
            out.add(
                "tp-decomposable",
                f"int4 groups of {group} rows: {name}={size} has {groups} groups, which "
                f"do not divide over tp={tp} (their scales split with the rows)",
                f"tp in {legal}, or quantize int8/fp8 (per output channel)",
                module,
                Primitive.TP,
            )


def validate(
    model: ModelDims,
    config: ParallelConfig,
    *,
    n_devices: int | None = None,
    batch: int | None = None,
    max_seq_len: int | None = None,
    table: SpecTable | None = None,
) -> Plan:
    """Checks ``config`` for ``model`` in both phases against every validator rule.

    Args:
        model: model sizes (a jaxpar ``ModelConfig`` or any :class:`ModelDims`).
        config: the parallel degrees.
        n_devices: devices in the mesh; the product of the degrees must equal it.
        batch: sequences per step; must divide over the axes that split batch in each phase.
        max_seq_len: KV cache length; must divide over ``sp`` (prompt tokens in prefill).
        table: the specification tables (default: the packaged ``sharding_specs``).

    Returns:
        The :class:`Plan` of the validated strategy.

    Raises:
        IllegalStrategyError: listing every violated rule.
    """
    table = (table or spec_table()).for_model(model)
    out = _Collector(table)
    _check_tables(model, config, table, out)
    _check_sizes(model, config, out)
    _check_shapes(
        model, config, table, out, n_devices=n_devices, batch=batch, max_seq_len=max_seq_len
    )
    if out.found:
        lines = "\n  ".join(v.message for v in out.found)
        rules = dict.fromkeys(v.rule for v in out.found)  # each broken rule cited once
        cited = "\n  ".join(table.rule(r).cite() for r in rules)
        raise IllegalStrategyError(
            f"strategy {config} is illegal for this model ({len(out.found)} violation(s)):\n  "
            f"{lines}\nViolates:\n  {cited}",
            out.found,
        )
    return _plan(model, config, table)


def _check_shapes(
    model: ModelDims,
    config: ParallelConfig,
    table: SpecTable,
    out: _Collector,
    *,
    n_devices: int | None,
    batch: int | None,
    max_seq_len: int | None,
) -> None:
    """Rules about the mesh, the pipeline groups, the batch and the cache length."""
    if n_devices is not None and config.size != n_devices:
        out.add(
            "devices-product",
            f"degrees {config} multiply to {config.size} but the mesh has {n_devices} devices",
            f"degrees whose product is {n_devices}",
        )
    if 1 < config.decode_groups < config.pp:
        out.add(
            "pp-no-decode-overlap",
            f"decode_groups={config.decode_groups} < pp={config.pp}: to keep {config.pp} stages "
            "busy a group would enter stage 0 for step t+1 before its step t left the last stage",
            f"decode_groups=1 (stages take turns) or decode_groups >= {config.pp}",
            Module.ATTENTION,
            Primitive.PP,
            Phase.DECODE,
        )
    if batch is not None:
        for phase in Phase:
            axes, groups, split = _batch_split(model, config, phase, table)
            if batch % split:
                over = " x ".join([*axes, *(["groups"] if groups > 1 else [])]) or "nothing"
                out.add(
                    "dp-batch-split",
                    f"batch {batch} does not divide over {over} = {split} "
                    f"(the axes that carry batch in {phase}, times its pipeline groups)",
                    f"a batch that is a multiple of {split}",
                    phase=phase,
                    primitive=Primitive.DP,
                )
    if max_seq_len is not None and max_seq_len % config.sp:
        out.add(
            "sp-prefill-tokens",
            f"max_seq_len {max_seq_len} does not divide into sp={config.sp} token partitions",
            f"max_seq_len a multiple of {config.sp}",
            primitive=Primitive.SP,
            phase=Phase.PREFILL,
        )


def _batch_split(
    model: ModelDims, config: ParallelConfig, phase: Phase, table: SpecTable
) -> tuple[tuple[str, ...], int, int]:
    """(mesh axes carrying batch, pipeline groups, their product) in ``phase``."""
    axes = mesh_axes(Module.ATTENTION, phase, config, dims=model, table=table)["batch"]
    groups = config.microbatches if phase is Phase.PREFILL else config.decode_groups
    return axes, groups, math.prod(config.degree(a) for a in axes) * groups


def batch_multiple(model: ModelDims, config: ParallelConfig, table: SpecTable | None = None) -> int:
    """The smallest batch that divides over the axes carrying batch in both phases.

    Every legal ``batch`` is a multiple of it (rule ``dp-batch-split``); e.g. 2 for
    ``ep=2, tp=4``, 8 for ``dp=2, sp=2, ep=2``.
    """
    table = (table or spec_table()).for_model(model)
    return math.lcm(*(_batch_split(model, config, phase, table)[2] for phase in Phase))


def _check_tables(
    model: ModelDims, config: ParallelConfig, table: SpecTable, out: _Collector
) -> None:
    """Rules about what the (possibly user-edited) tables make the axes split."""
    for phase in Phase:
        for module in modules_of(model):
            axes = mesh_axes(module, phase, config, dims=model, table=table)
            if phase is Phase.DECODE:
                _check_decode_axes(axes, module, config, out)
            for dim in (*_TOKEN_DIMS, "layers"):
                if "tp" in axes[dim]:
                    out.add(
                        "tp-no-temporal-depth",
                        f"the tables make tp={config.tp} split {dim!r}",
                        "tp splits heads, kv_heads, mlp, vocab or embed only",
                        module,
                        Primitive.TP,
                        phase,
                    )
            if module in (Module.EMBEDDING, Module.LM_HEAD) and config.ep > 1:
                _check_ep_embedding(axes, module, phase, config, table, out)
            variant = getattr(model, "attention_variant", None)
            if module is Module.ATTENTION and variant is not None and axes["kv_heads"]:
                out.add(
                    "latent-cache-no-heads",
                    f"the [variant.{variant}] rows make {list(axes['kv_heads'])} split "
                    "'kv_heads', but its cache holds one latent per token and no head axis",
                    "kv_heads split by no primitive (tp splits the query heads after the cache)",
                    module,
                    Primitive.coerce(axes["kv_heads"][0]),
                    phase,
                )


def _check_decode_axes(axes, module: Module, config: ParallelConfig, out: _Collector) -> None:
    """Decode splits no token dimension over sp, and the KV cache not along its sequence."""
    for dim in _TOKEN_DIMS:
        if "sp" in axes[dim]:
            out.add(
                "sp-not-across-decode",
                f"the tables make sp={config.sp} split {dim!r}",
                "sp status 'not_allowed' in decode; sp then carries batch",
                module,
                Primitive.SP,
                Phase.DECODE,
            )
        elif axes[dim] and dim == "cache_seq":
            out.add(
                "kv-contiguous-decode",
                f"the decode KV cache would be split along its sequence over {axes[dim]}",
                "no mesh axis on cache_seq in decode",
                module,
                Primitive.coerce(axes[dim][0]),
                Phase.DECODE,
            )


def _check_ep_embedding(axes, module, phase, config, table, out: _Collector) -> None:
    """ep splits no embedding or LM head parameter dimension."""
    param_dims = [d for d in ("vocab", "embed", "positions") if "ep" in axes[d]]
    if param_dims:
        out.add(
            "ep-not-embedding",
            f"the tables make ep={config.ep} split {param_dims} (status "
            f"{table.status(module, 'ep', phase)})",
            "ep status 'rarely_applicable' for embedding and lm_head; ep then carries batch",
            module,
            Primitive.EP,
            phase,
        )


def _check_sizes(model: ModelDims, config: ParallelConfig, out: _Collector) -> None:
    """Divisibility: each split dimension must decompose exactly over its degree."""
    tp, ep, pp = config.tp, config.ep, config.pp
    if ep > 1 and model.n_experts == 0:
        out.add(
            "ep-needs-moe",
            f"ep={ep} but the model is dense (no MoE layer)",
            "ep=1 for dense models; fold those devices into dp or tp",
            Module.FFN,
            Primitive.EP,
        )
    elif model.n_experts and model.n_experts % ep:
        out.add(
            "ep-divides-experts",
            f"{model.n_experts} experts do not divide over ep={ep}",
            f"ep in {_divisors(model.n_experts)}",
            Module.MOE,
            Primitive.EP,
        )
    if tp > 1:
        checks = [
            (Module.ATTENTION, "heads", model.n_heads),
            (Module.MOE if model.n_experts else Module.FFN, "d_ff", model.d_ff),
            (Module.LM_HEAD, "vocab_size", model.vocab_size),
        ]
        # DeepSeek-V3's dense first layers and shared experts split their width like an FFN.
        for name in ("moe.dense_d_ff", "moe.shared_d_ff"):
            if model_field(model, name, 0):
                checks.append((Module.FFN, name, model_field(model, name)))
        legal = _divisors(math.gcd(*(size for _, _, size in checks)))
        for module, name, size in checks:
            if size % tp:
                out.add(
                    "tp-decomposable",
                    f"{name}={size} does not divide over tp={tp}",
                    f"tp in {legal}",
                    module,
                    Primitive.TP,
                )
        _check_int4_groups(model, tp, checks, out)
        kv = model.n_kv_heads
        if kv % tp and tp % kv:
            out.add(
                "tp-decomposable",
                f"n_kv_heads={kv} neither divides over tp={tp} nor divides it (K/V heads split "
                "over tp when tp divides them; when tp is a multiple of them each head is held "
                "by the tp/n_kv_heads devices that read it: rule kv-head-replicas)",
                f"tp a divisor or a multiple of {kv} ({_divisors_and_multiples(kv, tp)})",
                Module.ATTENTION,
                Primitive.TP,
            )
    if model.n_layers % pp:
        out.add(
            "pp-divides-layers",
            f"{model.n_layers} layers do not divide into pp={pp} stages",
            f"pp in {_divisors(model.n_layers)}",
            Module.ATTENTION,
            Primitive.PP,
        )


def _divisors_and_multiples(kv: int, tp: int) -> str:
    """The tp degrees up to about ``tp`` that split or group ``kv`` K/V heads."""
    near = sorted({*_divisors(kv), *range(kv, 2 * max(tp, kv) + 1, kv)})
    return "tp in " + ", ".join(map(str, near))


def _plan(model: ModelDims, config: ParallelConfig, table: SpecTable) -> Plan:
    assignments = []
    for phase in Phase:
        for module in modules_of(model):
            axes = mesh_axes(module, phase, config, dims=model, table=table)
            for primitive in Primitive:
                entry = table.entry(module, primitive)
                splits = tuple(
                    dim
                    for dim, on in axes.items()
                    if primitive.value in on and (dim != "expert_batch" or module is Module.MOE)
                )
                assignments.append(
                    Assignment(
                        phase=phase,
                        module=module,
                        primitive=primitive,
                        degree=config.degree(primitive),
                        status=entry.status[phase],
                        splits=splits,
                        row=entry.row,
                        sync=entry.sync if entry.status[phase] in SPLITTING else "",
                        source=entry.source,
                    )
                )
    return Plan(config, tuple(assignments))
