"""Every validator rule triggered, and its message naming the rule and what is legal."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

import jaxpar
from jaxpar.errors import IllegalStrategyError
from jaxpar.spec import Dims, ParallelConfig, load_spec_table, spec_table, validate
from jaxpar.spec._tables import default_spec_dir

DENSE = Dims(vocab_size=256, d_model=64, n_layers=4, n_heads=8, n_kv_heads=8, head_dim=8, d_ff=128)
GQA = Dims(vocab_size=256, d_model=64, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=8, d_ff=128)
MOE = Dims(
    vocab_size=256,
    d_model=64,
    n_layers=4,
    n_heads=8,
    n_kv_heads=8,
    head_dim=8,
    d_ff=64,
    n_experts=8,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _LatentDims(Dims):
    """Sizes of a model with multi-head latent attention: one latent "kv head"."""

    attention_variant: str = "mla"


MLA = _LatentDims(
    vocab_size=256, d_model=64, n_layers=4, n_heads=8, n_kv_heads=1, head_dim=24, d_ff=128
)


def _table_with(tmp_path, file, old, new):
    out = tmp_path / "specs"
    shutil.copytree(default_spec_dir(), out)
    path = out / file
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return load_spec_table(out)


def _sp_decode_allowed(tmp_path):
    return _table_with(
        tmp_path,
        "attention.toml",
        '[sp]\nprefill = "allowed"\ndecode = "not_allowed"',
        '[sp]\nprefill = "allowed"\ndecode = "allowed"',
    )


def _dp_splits_cache(tmp_path):
    return _table_with(
        tmp_path, "attention.toml", 'splits = ["batch"]', 'splits = ["batch", "cache_seq"]'
    )


def _tp_splits_tokens(tmp_path):
    return _table_with(
        tmp_path,
        "ffn.toml",
        'may_split = ["mlp", "embed"]\nsplits = ["mlp"]',
        'may_split = ["mlp", "seq"]\nsplits = ["mlp", "seq"]',
    )


def _ep_on_embedding(tmp_path):
    return _table_with(
        tmp_path,
        "embedding.toml",
        '[ep]\nprefill = "rarely_applicable"\ndecode = "rarely_applicable"\napplies_to = []\nsplits = []',
        '[ep]\nprefill = "allowed"\ndecode = "allowed"\napplies_to = ["token_embedding"]\n'
        'splits = ["vocab"]\nmay_split = ["vocab"]',
    )


def _dp_splits_latent(tmp_path):
    return _table_with(
        tmp_path,
        "attention.toml",
        'splits = ["batch"]\nsync = "none: per-sequence independence, each replica keeps its '
        "sequences' latent cache\"",
        'splits = ["batch", "kv_heads"]\nsync = "none: per-sequence independence, each replica '
        "keeps its sequences' latent cache\"",
    )


# rule -> (model, config, validate kwargs, table factory or None, text the message must hold)
TRIGGERS = {
    "sp-not-across-decode": (DENSE, ParallelConfig(sp=2), {}, _sp_decode_allowed, "split 'seq'"),
    "kv-contiguous-decode": (
        DENSE,
        ParallelConfig(dp=2),
        {},
        _dp_splits_cache,
        "sequence over ('dp',)",
    ),
    "pp-no-decode-overlap": (
        DENSE,
        ParallelConfig(pp=4, decode_groups=2),
        {},
        None,
        "decode_groups=2 < pp=4",
    ),
    "ep-needs-moe": (DENSE, ParallelConfig(ep=2), {}, None, "the model is dense"),
    "ep-not-embedding": (MOE, ParallelConfig(ep=2), {}, _ep_on_embedding, "split ['vocab']"),
    "ep-divides-experts": (
        MOE,
        ParallelConfig(ep=3),
        {},
        None,
        "8 experts do not divide over ep=3",
    ),
    "tp-decomposable": (DENSE, ParallelConfig(tp=3), {}, None, "heads=8 does not divide over tp=3"),
    "tp-no-temporal-depth": (DENSE, ParallelConfig(tp=2), {}, _tp_splits_tokens, "split 'seq'"),
    "pp-divides-layers": (
        DENSE,
        ParallelConfig(pp=3),
        {},
        None,
        "4 layers do not divide into pp=3",
    ),
    "dp-batch-split": (
        DENSE,
        ParallelConfig(dp=2, sp=2),
        {"batch": 2},
        None,
        "batch 2 does not divide over dp x sp = 4",
    ),
    "sp-prefill-tokens": (DENSE, ParallelConfig(sp=4), {"max_seq_len": 30}, None, "max_seq_len 30"),
    "devices-product": (DENSE, ParallelConfig(tp=2), {"n_devices": 8}, None, "multiply to 2"),
    # An edited MLA row splitting the latent cache by head (it has none).
    "latent-cache-no-heads": (
        MLA,
        ParallelConfig(dp=2),
        {},
        _dp_splits_latent,
        "[variant.mla] rows make ['dp'] split 'kv_heads'",
    ),
}


def test_every_validator_rule_has_a_trigger():
    enforced = {r.id for r in spec_table().rules.values() if r.enforced_by == "validator"}
    assert enforced == set(TRIGGERS)


@pytest.mark.parametrize("rule", sorted(TRIGGERS))
def test_rule_triggers_with_clear_message(rule, tmp_path):
    model, config, kwargs, make_table, text = TRIGGERS[rule]
    table = make_table(tmp_path) if make_table else None
    with pytest.raises(IllegalStrategyError) as err:
        validate(model, config, table=table, **kwargs)
    message = str(err.value)
    assert rule in err.value.rules
    assert f"[{rule}]" in message and f'rule "{rule}"' in message
    assert text in message
    assert "Legal:" in message
    # Cited by the file and key users have, not by the seed documents (issue 11, item 11).
    shown = "sharding_specs" if table is None else str(table.directory)  # edited tables: their path
    assert f'({shown}/rules.toml, [[rule]] id = "{rule}")' in message
    assert spec_table().rule(rule).text in message
    assert not any(src in message for src in spec_table().rule(rule).sources)


def test_each_broken_rule_is_cited_once():
    # tp=3 breaks tp-decomposable for heads, d_ff, vocab and kv heads: four lines, one citation.
    with pytest.raises(IllegalStrategyError) as err:
        validate(DENSE, ParallelConfig(tp=3, ep=2))
    message = str(err.value)
    assert err.value.rules.count("tp-decomposable") >= 3
    for rule in ("tp-decomposable", "ep-needs-moe"):
        assert message.count(spec_table().rule(rule).text) == 1
        assert message.count(f'rule "{rule}"') == 1
    assert ".txt" not in message


def test_message_names_module_primitive_phase():
    with pytest.raises(IllegalStrategyError) as err:
        validate(DENSE, ParallelConfig(dp=2, sp=2), batch=2)
    assert "dp/decode" in str(err.value)
    with pytest.raises(IllegalStrategyError) as err:
        validate(MOE, ParallelConfig(ep=3))
    assert "moe/ep" in str(err.value) and "ep in [1, 2, 4, 8]" in str(err.value)


def test_all_violations_reported_together():
    with pytest.raises(IllegalStrategyError) as err:
        validate(DENSE, ParallelConfig(ep=2, tp=3, pp=3))
    assert {"ep-needs-moe", "tp-decomposable", "pp-divides-layers"} <= set(err.value.rules)


def test_kv_heads_policy():
    # tp a multiple of n_kv_heads: legal (each head held by its tp/K devices: kv-head-replicas).
    validate(GQA, ParallelConfig(tp=8), n_devices=8)
    odd = Dims(
        vocab_size=240, d_model=48, n_layers=4, n_heads=12, n_kv_heads=3, head_dim=4, d_ff=96
    )
    with pytest.raises(IllegalStrategyError, match="n_kv_heads=3 neither divides"):
        validate(odd, ParallelConfig(tp=2))


def test_legal_strategies_pass_and_plan_describes_them():
    plan = validate(MOE, ParallelConfig(dp=2, ep=2, tp=2), n_devices=8, batch=8, max_seq_len=64)
    cells = {(a.phase.value, a.module.value, a.primitive.value): a for a in plan.assignments}
    # In MoE layers ep splits experts (table) and carries the tokens' batch (role) until the
    # dispatch all-to-all moves them to their experts.
    assert cells["prefill", "moe", "ep"].splits == ("batch", "experts")
    # role: ep carries batch; the paged KV cache's pages follow it ([[follows]])
    assert cells["decode", "attention", "ep"].splits == ("batch", "pages")
    assert cells["decode", "lm_head", "tp"].splits == ("vocab",)
    assert cells["decode", "attention", "sp"].status is jaxpar.Status.NOT_ALLOWED
    validate(DENSE, ParallelConfig(pp=4, decode_groups=4, microbatches=2), batch=8)
    validate(DENSE, ParallelConfig(dp=2, sp=2, tp=2), n_devices=8, batch=4, max_seq_len=64)
