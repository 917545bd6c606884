"""The tables in sharding_specs/ against the seed documents, twice: parametrized from the
TOML, and against an expected table written by hand here from the five seed documents."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest

import jaxpar
from jaxpar.errors import SpecFileError
from jaxpar.spec import Module, Phase, Primitive, Status, load_spec_table, spec_table
from jaxpar.spec._tables import default_spec_dir

A, NA, LO, MOE, RA = (
    Status.ALLOWED,
    Status.NOT_ALLOWED,
    Status.LAYER_ONLY,
    Status.ONLY_IF_MOE,
    Status.RARELY_APPLICABLE,
)

# Phase-specific summary tables of the seeds, copied by hand: (prefill, decode).
# EP on attention and FFN reads "Allowed" in the tables, but both documents say it is
# "only relevant if [the module] is part of an MoE module": the implicit only-if-MoE status.
SEED_STATUS = {
    # 000_d2d896719606b1e7.txt (FFN)
    ("ffn", "tp"): (A, A),
    ("ffn", "sp"): (A, NA),
    ("ffn", "pp"): (A, LO),
    ("ffn", "ep"): (MOE, MOE),
    ("ffn", "dp"): (A, A),
    # 001_30b12e2e23e97b4c.txt (MoE)
    ("moe", "tp"): (A, A),
    ("moe", "sp"): (A, NA),
    ("moe", "pp"): (A, LO),
    ("moe", "ep"): (A, A),
    ("moe", "dp"): (A, A),
    # 002_90151dad3ba803f8.txt (attention)
    ("attention", "tp"): (A, A),
    ("attention", "sp"): (A, NA),
    ("attention", "pp"): (A, LO),
    ("attention", "ep"): (MOE, MOE),
    ("attention", "dp"): (A, A),
    # 003_c9c0cc426eadc135.txt (embedding and LM head share one table)
    ("embedding", "tp"): (A, A),
    ("embedding", "sp"): (A, NA),
    ("embedding", "pp"): (A, LO),
    ("embedding", "ep"): (RA, RA),
    ("embedding", "dp"): (A, A),
    ("lm_head", "tp"): (A, A),
    ("lm_head", "sp"): (A, NA),
    ("lm_head", "pp"): (A, LO),
    ("lm_head", "ep"): (RA, RA),
    ("lm_head", "dp"): (A, A),
}

# Which tensor dimension each primitive may split, from the seeds' prose.
SEED_DIMS = {
    "dp": {"batch"},
    "sp": {"seq", "cache_seq"},  # tokens (and, in attention, the K/V positions)
    "pp": {"layers"},
    "ep": {"experts"},
}
SEED_TP_DIMS = {
    "attention": {"heads", "kv_heads", "embed"},  # heads or hidden (002, 004)
    "ffn": {"mlp", "embed"},  # hidden or intermediate (000)
    "moe": {"mlp"},  # within each expert (001)
    "embedding": {"vocab", "embed"},  # embedding dim (003) or vocab
    "lm_head": {"vocab", "embed"},  # hidden or vocab (003)
}
SEED_SOURCE = {
    "ffn": "000_d2d896719606b1e7.txt",
    "moe": "001_30b12e2e23e97b4c.txt",
    "attention": "002_90151dad3ba803f8.txt",
    "embedding": "003_c9c0cc426eadc135.txt",
    "lm_head": "003_c9c0cc426eadc135.txt",
}


def _toml_rows():
    for path in sorted(default_spec_dir().glob("*.toml")):
        if path.stem == "rules":
            continue
        data = tomllib.loads(path.read_text())
        for primitive in ("dp", "tp", "sp", "pp", "ep"):
            yield pytest.param(data["module"], primitive, data, id=f"{data['module']}-{primitive}")


@pytest.mark.parametrize(("module", "primitive", "data"), list(_toml_rows()))
def test_toml_row_matches_seed(module, primitive, data):
    row = data[primitive]
    assert (Status(row["prefill"]), Status(row["decode"])) == SEED_STATUS[module, primitive]
    assert data["source"] == SEED_SOURCE[module]
    allowed = SEED_TP_DIMS[module] if primitive == "tp" else SEED_DIMS[primitive]
    assert set(row["splits"]) <= allowed
    assert set(row.get("may_split", row["splits"])) <= allowed
    # A primitive that splits nothing in both phases must not claim dimensions.
    if {row["prefill"], row["decode"]} <= {"not_allowed", "rarely_applicable"}:
        assert row["splits"] == []
    assert row["row"].split("|")[0].strip() == primitive.upper()


@pytest.mark.parametrize(("module", "primitive"), list(SEED_STATUS))
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_loaded_status_matches_hand_table(module, primitive, phase):
    expected = SEED_STATUS[module, primitive][phase == "decode"]
    assert spec_table().status(module, primitive, phase) is expected
    assert (
        jaxpar.spec_table().status(Module(module), Primitive(primitive), Phase(phase)) is expected
    )


def test_every_cell_is_covered():
    table = spec_table()
    assert set(table.entries) == {(Module(m), Primitive(p)) for m, p in SEED_STATUS}


def test_sp_decode_not_allowed_anywhere():
    for module in Module:
        assert spec_table().status(module, "sp", "decode") is NA


def test_rules_cite_real_seeds():
    seeds = set(SEED_SOURCE.values()) | {"004_e76e33e621c5ab91.txt"}
    for rule in spec_table().rules.values():
        assert set(rule.sources) <= seeds, rule.id
    # The failure-prone assumptions of every document are encoded as named rules.
    ids = set(spec_table().rules)
    assert {
        "sp-not-across-decode",
        "pp-no-decode-overlap",
        "causal-mask-kept",
        "tp-no-temporal-depth",
        "tp-decomposable",
        "tp-sync-within-layer-and-step",
        "kv-contiguous-decode",
        "numerical-equivalence",
        "dp-batch-split",
    } <= ids


# --- malformed files ---------------------------------------------------------------------


@pytest.fixture
def spec_copy(tmp_path: Path) -> Path:
    out = tmp_path / "specs"
    shutil.copytree(default_spec_dir(), out, ignore=shutil.ignore_patterns("*.md"))
    return out


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize(
    ("file", "old", "new", "named"),
    [
        ("attention.toml", 'decode = "not_allowed"', 'decode = "forbidden"', "sp].decode"),
        ("ffn.toml", "[sp]", "[zp]", "zp"),
        (
            "moe.toml",
            'prefill = "allowed"\ndecode = "allowed"\napplies_to = ["experts"]',
            'prefil = "allowed"\ndecode = "allowed"\napplies_to = ["experts"]',
            "prefil",
        ),
        ("embedding.toml", 'splits = ["vocab"]', 'splits = ["vocabulary"]', "vocabulary"),
        ("lm_head.toml", 'module = "lm_head"', 'module = "head"', "'module'"),
        ("rules.toml", 'enforced_by = "inspect"', 'enforced_by = "nobody"', "enforced_by"),
        ("attention.toml", 'applies_to = ["qkv_proj"', 'applies_to = ["qkv"', "qkv"),
        ("rules.toml", 'follows = "batch"', 'follows = "rows"', "follows"),
        ("rules.toml", 'module = "attention"\nphases', 'module = "cache"\nphases', "cache"),
    ],
)
def test_malformed_file_names_file_and_key(spec_copy, file, old, new, named):
    _edit(spec_copy / file, old, new)
    with pytest.raises(SpecFileError) as err:
        load_spec_table(spec_copy)
    assert file in str(err.value)
    assert named in str(err.value)


def test_missing_row(spec_copy):
    path = spec_copy / "moe.toml"
    text = path.read_text()
    path.write_text(text[: text.index("[ep]")])
    with pytest.raises(SpecFileError, match=r"moe\.toml: missing row \[ep\]"):
        load_spec_table(spec_copy)


def test_missing_module_file_and_bad_toml(spec_copy):
    (spec_copy / "ffn.toml").unlink()
    with pytest.raises(SpecFileError, match=r"ffn\.toml: missing specification file"):
        load_spec_table(spec_copy)
    (spec_copy / "ffn.toml").write_text("module = \n")
    with pytest.raises(SpecFileError, match=r"ffn\.toml: not valid TOML"):
        load_spec_table(spec_copy)


def test_unknown_module_file(spec_copy):
    (spec_copy / "router.toml").write_text('module = "router"\n')
    with pytest.raises(SpecFileError, match="router"):
        load_spec_table(spec_copy)
