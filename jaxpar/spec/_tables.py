"""Loads the specification tables (``sharding_specs/*.toml``) and checks them.

The files are the single source of legality: which primitive may split which module in
which phase, along which logical dimension, and the named rules the validator enforces.
Loading is strict: anything unknown or missing is a :class:`SpecFileError` naming the file
and the key, so a typo can never silently widen what is legal.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxpar.errors import SpecFileError
from jaxpar.spec._enums import LOGICAL_AXES, Module, Phase, Primitive, Status

_ENTRY_KEYS = {"prefill", "decode", "applies_to", "splits", "may_split", "sync", "row", "placement"}
_ENTRY_REQUIRED = {"prefill", "decode", "applies_to", "splits", "sync", "row"}
_RULE_KEYS = {"id", "text", "sources", "section", "enforced_by"}
_ROLE_KEYS = {"axis", "phases", "carries", "when", "why"}
_FOLLOWS_KEYS = {"axis", "follows", "module", "phases", "why"}
_ENFORCERS = {"validator", "model", "inspect", "tests"}
_PLACEMENTS = {"first_stage", "last_stage"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
    """One row of a module's phase-specific summary table."""

    module: Module
    primitive: Primitive
    status: Mapping[Phase, Status]
    applies_to: tuple[str, ...]
    splits: tuple[str, ...]
    may_split: tuple[str, ...]
    sync: str
    row: str
    source: str
    placement: str | None = None
    #: The attention variant this row is for (``[variant.<name>.<primitive>]``), or None.
    variant: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """A named rule of the specification, with where it comes from and who enforces it."""

    id: str
    text: str
    sources: tuple[str, ...]
    section: str
    enforced_by: str
    file: str = "sharding_specs/rules.toml"  # where the rule is written, as users see it

    def cite(self) -> str:
        """``rule "id" (file, [[rule]] id = "id"): "text"``: names the file and key, not the
        seed documents (users have the tables, not the seeds)."""
        return f'rule "{self.id}" ({self.file}, [[rule]] id = "{self.id}"): "{self.text}"'


@dataclasses.dataclass(frozen=True, kw_only=True)
class Role:
    """What a mesh axis carries where its primitive does not split a module's tokens."""

    axis: Primitive
    phases: tuple[Phase, ...]
    carries: str
    when: str
    why: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Follows:
    """A logical axis split exactly as another in one module's phases (a paged cache's
    ``pages`` as its ``batch``)."""

    axis: str
    follows: str
    module: Module
    phases: tuple[Phase, ...]
    why: str


@dataclasses.dataclass(frozen=True, eq=False)  # identity hash: tables key caches
class SpecTable:
    """All tables and rules, queryable by (module, primitive, phase)."""

    entries: Mapping[tuple[Module, Primitive], Entry]
    rules: Mapping[str, Rule]
    roles: tuple[Role, ...]
    directory: Path
    follows: tuple[Follows, ...] = ()
    #: Rows that replace a module's rows for models of one variant (``[variant.mla.tp]`` in
    #: ``attention.toml``: multi-head latent attention), by variant name.
    variants: Mapping[str, Mapping[tuple[Module, Primitive], Entry]] = dataclasses.field(
        default_factory=dict
    )
    #: The variant whose rows are already in ``entries`` (a table from :meth:`for_model`).
    applied: str | None = None

    def for_model(self, dims: Any) -> SpecTable:
        """The tables as they apply to ``dims``: its variant's rows in place of the module's
        own (``dims.attention_variant``, e.g. ``"mla"``), else these tables unchanged.

        Raises:
            SpecFileError: the model names a variant the tables have no rows for.
        """
        name = getattr(dims, "attention_variant", None)
        if name is None or name == self.applied:
            return self
        if name not in self.variants:
            raise SpecFileError(
                f"{self.directory}: the model's attention variant {name!r} has no rows "
                f"([variant.{name}.<primitive>]); variants in the tables: {sorted(self.variants)}"
            )
        return _with_variant(self, name)

    def entry(self, module: Module | str, primitive: Primitive | str) -> Entry:
        return self.entries[Module.coerce(module), Primitive.coerce(primitive)]

    def status(
        self, module: Module | str, primitive: Primitive | str, phase: Phase | str
    ) -> Status:
        """The table's status, e.g. ``status("attention", "sp", "decode")`` is NOT_ALLOWED."""
        return self.entry(module, primitive).status[Phase.coerce(phase)]

    def rule(self, rule_id: str) -> Rule:
        return self.rules[rule_id]


@functools.cache
def default_spec_dir() -> Path:
    """``sharding_specs/`` of a source checkout, else the copy packaged in the wheel (found
    once: every lookup of the tables asks, tens of thousands of times in one plan)."""
    checkout = Path(__file__).resolve().parents[2] / "sharding_specs"
    if checkout.is_dir():
        return checkout
    return Path(str(importlib.resources.files("jaxpar._sharding_specs")))


@functools.cache
def _with_variant(table: SpecTable, name: str) -> SpecTable:
    """``table`` with variant ``name``'s rows in place (cached: tables key other caches)."""
    entries = {**table.entries, **table.variants[name]}
    return dataclasses.replace(table, entries=entries, applied=name)


@functools.cache
def _cached(directory: Path) -> SpecTable:
    return load_spec_table(directory)


def spec_table(directory: str | Path | None = None) -> SpecTable:
    """The specification tables (loaded once per directory and checked)."""
    return _cached(Path(directory) if directory else default_spec_dir())


def load_spec_table(directory: str | Path) -> SpecTable:
    """Loads and checks every table in ``directory``; raises SpecFileError on any defect."""
    directory = Path(directory)
    entries: dict[tuple[Module, Primitive], Entry] = {}
    variants: dict[str, dict[tuple[Module, Primitive], Entry]] = {}
    for module in Module:
        path = directory / f"{module.value}.toml"
        entries.update(_load_module(path, module))
        for name, rows in _load_variants(path, module).items():
            variants.setdefault(name, {}).update(rows)
    rules, roles, follows = _load_rules(
        directory / "rules.toml", _display(directory) + "/rules.toml"
    )
    extra = {p.stem for p in directory.glob("*.toml")} - {m.value for m in Module} - {"rules"}
    if extra:
        raise SpecFileError(
            f"{directory}: unknown table file(s) {sorted(extra)}; modules are "
            f"{[m.value for m in Module]} plus rules.toml"
        )
    return SpecTable(
        entries=entries,
        rules=rules,
        roles=roles,
        directory=directory,
        follows=follows,
        variants=variants,
    )


def _display(directory: Path) -> str:
    """How messages name the tables' directory: ``sharding_specs`` for the packaged tables."""
    return (
        "sharding_specs" if directory.resolve() == default_spec_dir().resolve() else str(directory)
    )


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise SpecFileError(f"{path}: missing specification file")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise SpecFileError(f"{path}: not valid TOML: {e}") from e


def _words(path: Path, key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecFileError(f"{path}: key {key!r} must be a list of strings, got {value!r}")
    return tuple(value)


def _text(path: Path, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise SpecFileError(f"{path}: key {key!r} must be a non-empty string, got {value!r}")
    return value


def _load_module(path: Path, module: Module) -> dict[tuple[Module, Primitive], Entry]:
    data = _read(path)
    if data.get("module") != module.value:
        raise SpecFileError(
            f"{path}: key 'module' must be {module.value!r}, got {data.get('module')!r}"
        )
    source = _text(path, "source", data.get("source"))
    components = _words(path, "components", data.get("components"))
    unknown = set(data) - {"module", "source", "components", "variant"}
    unknown -= {p.value for p in Primitive}
    if unknown:
        raise SpecFileError(
            f"{path}: unknown key(s) {sorted(unknown)}; primitives are {[p.value for p in Primitive]}"
        )
    out = {}
    for primitive in Primitive:
        key = primitive.value
        row = data.get(key)
        if not isinstance(row, dict):
            raise SpecFileError(f"{path}: missing row [{key}] (every primitive needs a row)")
        out[module, primitive] = _entry(path, module, primitive, row, source, components)
    return out


def _load_variants(path: Path, module: Module) -> dict[str, dict[tuple[Module, Primitive], Entry]]:
    """``[variant.<name>]`` of a module file: its own ``components`` and a full row per
    primitive (``[variant.<name>.<primitive>]``), which replace the module's rows for models
    of that variant (:meth:`SpecTable.for_model`)."""
    data = _read(path)
    out: dict[str, dict[tuple[Module, Primitive], Entry]] = {}
    for name, raw in (data.get("variant") or {}).items():
        where = f"{path}: [variant.{name}]"
        if not isinstance(raw, dict):
            raise SpecFileError(f"{where}: must be a table")
        if unknown := set(raw) - {"components", "why"} - {p.value for p in Primitive}:
            raise SpecFileError(f"{where}: unknown key(s) {sorted(unknown)}")
        _text(path, f"variant.{name}.why", raw.get("why"))
        components = _words(path, f"variant.{name}.components", raw.get("components"))
        rows = {}
        for primitive in Primitive:
            row = raw.get(primitive.value)
            if not isinstance(row, dict):
                raise SpecFileError(
                    f"{where}: missing row [variant.{name}.{primitive.value}] (a variant "
                    "needs a row for every primitive)"
                )
            source = _text(path, "source", data.get("source"))
            entry = _entry(path, module, primitive, row, source, components)
            rows[module, primitive] = dataclasses.replace(entry, variant=name)
        out[name] = rows
    return out


def _entry(
    path: Path,
    module: Module,
    primitive: Primitive,
    row: dict[str, Any],
    source: str,
    components: tuple[str, ...],
) -> Entry:
    where = f"{path}: [{primitive.value}]"
    if unknown := set(row) - _ENTRY_KEYS:
        raise SpecFileError(
            f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(_ENTRY_KEYS)}"
        )
    if missing := _ENTRY_REQUIRED - set(row):
        raise SpecFileError(f"{where}: missing key(s) {sorted(missing)}")
    status = {}
    for phase in Phase:
        word = row[phase.value]
        try:
            status[phase] = Status(word)
        except ValueError:
            raise SpecFileError(
                f"{where}.{phase.value}: unknown status {word!r}; "
                f"legal: {[s.value for s in Status]}"
            ) from None
    applies_to = _words(path, f"{primitive.value}.applies_to", row["applies_to"])
    if bad := set(applies_to) - set(components):
        raise SpecFileError(
            f"{where}.applies_to: unknown sub-component(s) {sorted(bad)}; "
            f"the module's components are {list(components)}"
        )
    splits = _words(path, f"{primitive.value}.splits", row["splits"])
    may_split = _words(path, f"{primitive.value}.may_split", row.get("may_split", list(splits)))
    for key, dims in (("splits", splits), ("may_split", may_split)):
        if bad := set(dims) - set(LOGICAL_AXES):
            raise SpecFileError(
                f"{where}.{key}: unknown logical axis {sorted(bad)}; legal: {list(LOGICAL_AXES)}"
            )
    if not set(splits) <= set(may_split):
        raise SpecFileError(
            f"{where}.splits: {list(splits)} not within may_split {list(may_split)}"
        )
    placement = row.get("placement")
    if placement is not None and placement not in _PLACEMENTS:
        raise SpecFileError(f"{where}.placement: {placement!r} not in {sorted(_PLACEMENTS)}")
    return Entry(
        module=module,
        primitive=primitive,
        status=status,
        applies_to=applies_to,
        splits=splits,
        may_split=may_split,
        sync=_text(path, f"{primitive.value}.sync", row["sync"]),
        row=_text(path, f"{primitive.value}.row", row["row"]),
        source=source,
        placement=placement,
    )


def _load_rules(
    path: Path, shown: str
) -> tuple[dict[str, Rule], tuple[Role, ...], tuple[Follows, ...]]:
    data = _read(path)
    if unknown := set(data) - {"rule", "role", "follows"}:
        raise SpecFileError(
            f"{path}: unknown key(s) {sorted(unknown)}; known: ['follows', 'role', 'rule']"
        )
    rules: dict[str, Rule] = {}
    for i, raw in enumerate(data.get("rule", [])):
        rule = _load_rule(path, shown, f"{path}: rule[{i}]", raw)
        if rule.id in rules:
            raise SpecFileError(f"{path}: rule[{i}].id: duplicate rule id {rule.id!r}")
        rules[rule.id] = rule
    roles = [_load_role(f"{path}: role[{i}]", raw) for i, raw in enumerate(data.get("role", []))]
    follows = [
        _load_follows(f"{path}: follows[{i}]", raw) for i, raw in enumerate(data.get("follows", []))
    ]
    return rules, tuple(roles), tuple(follows)


def _load_rule(path: Path, shown: str, where: str, raw: dict[str, Any]) -> Rule:
    if unknown := set(raw) - _RULE_KEYS:
        raise SpecFileError(f"{where}: unknown key(s) {sorted(unknown)}")
    if missing := _RULE_KEYS - set(raw):
        raise SpecFileError(f"{where}: missing key(s) {sorted(missing)}")
    if raw["enforced_by"] not in _ENFORCERS:
        raise SpecFileError(
            f"{where}.enforced_by: {raw['enforced_by']!r} not in {sorted(_ENFORCERS)}"
        )
    return Rule(
        id=_text(path, "id", raw["id"]),
        text=_text(path, "text", raw["text"]),
        sources=_words(path, "sources", raw["sources"]),
        section=_text(path, "section", raw["section"]),
        enforced_by=raw["enforced_by"],
        file=shown,
    )


def _load_role(where: str, raw: dict[str, Any]) -> Role:
    if set(raw) != _ROLE_KEYS:
        raise SpecFileError(f"{where}: keys must be {sorted(_ROLE_KEYS)}, got {sorted(raw)}")
    try:
        axis = Primitive(raw["axis"])
        phases = tuple(Phase(p) for p in raw["phases"])
    except ValueError as e:
        raise SpecFileError(f"{where}: {e}") from None
    if raw["carries"] not in LOGICAL_AXES:
        raise SpecFileError(f"{where}.carries: unknown logical axis {raw['carries']!r}")
    if raw["when"] not in {"always", "not_allowed"}:
        raise SpecFileError(f"{where}.when: {raw['when']!r} not in ['always', 'not_allowed']")
    return Role(axis=axis, phases=phases, carries=raw["carries"], when=raw["when"], why=raw["why"])


def _load_follows(where: str, raw: dict[str, Any]) -> Follows:
    if set(raw) != _FOLLOWS_KEYS:
        raise SpecFileError(f"{where}: keys must be {sorted(_FOLLOWS_KEYS)}, got {sorted(raw)}")
    for key in ("axis", "follows"):
        if raw[key] not in LOGICAL_AXES:
            raise SpecFileError(f"{where}.{key}: unknown logical axis {raw[key]!r}")
    try:
        module = Module(raw["module"])
        phases = tuple(Phase(p) for p in raw["phases"])
    except ValueError as e:
        raise SpecFileError(f"{where}: {e}") from None
    return Follows(
        axis=raw["axis"], follows=raw["follows"], module=module, phases=phases, why=raw["why"]
    )
