"""DeepSeek-V3 (multi-head latent attention, group-limited MoE) sharded and served equal
transformers.

The fixture (``scripts/make_hf_fixtures.py``: ``deepseek_v3``) has 3 layers: layer 0
dense, layers 1-2 with 8 routed experts (top-4 within the best 2 of 4 groups, sigmoid
scores and a random correction bias, both shown at build time to move the logits) plus 2
shared experts. One-device equality with transformers (both fixtures, YaRN included) is
``test_hf_fixtures.py``; here every strategy the family allows must give the same prefill
logits (1e-4) and the same 16 greedy tokens through the paged serving core, the latent
cache must keep no head axis (replicated over tp), and the continuous batcher (chunked
prefill, prefix hits: prefill over cached latents; paged decode) must give each request
the tokens of one whole-sequence prefill.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar import ParallelConfig
from jaxpar.cli import main
from jaxpar.engine import ContinuousBatcher, InferenceEngine
from jaxpar.engine._kv_budget import KVBudget
from jaxpar.errors import CheckpointError, ConfigError, IllegalStrategyError, SpecFileError
from jaxpar.models import ExecutionOptions, ModelRun, load_hf_checkpoint
from jaxpar.models._hf_config import config_from_hf
from jaxpar.models._paged import PAGE_AXES
from jaxpar.plan._enumerate import Workload, check
from jaxpar.spec import (
    Module,
    Phase,
    load_spec_table,
    make_mesh,
    mesh_axes,
    partition_spec,
    spec_table,
    validate,
)
from jaxpar.spec._tables import default_spec_dir
from tests._engine_util import check_matches_hf
from tests._tiers import sweep

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "deepseek_v3"


def _hf_config() -> dict:
    return json.loads((FIXTURE / "config.json").read_text())


def test_config_mapping():
    """config.json's MLA and MoE fields land where the model reads them; the cache keeps
    the latent and the RoPE key per token and layer, no heads."""
    c = config_from_hf(_hf_config(), source="config.json")
    assert (c.n_kv_heads, c.head_dim, c.cache_kv_dims) == (1, 16 + 8, (8, 16))
    assert (
        ModelRun.of(c).cache_bytes_per_token == 3 * (16 + 8) * 4
    )  # layers x (latent + rope) x f32
    assert (c.moe.first_dense_layers, c.moe.dense_d_ff, c.moe.shared_d_ff, c.d_ff) == (1, 48, 16, 8)
    assert (c.moe.router, c.moe.groups, c.moe.topk_groups) == ("sigmoid_grouped", 4, 2)
    assert c.moe.routed_scaling_factor == 2.5 and c.mla.rope_interleave
    assert c.attention.scale == pytest.approx((8 + 8) ** -0.5)
    assert [c.layer_is_moe(i) for i in range(3)] == [False, True, True]


@pytest.mark.parametrize(
    ("key", "value", "names"),
    [
        ("attention_bias", True, "attention_bias"),
        ("topk_method", "greedy", "topk_method"),
        ("first_k_dense_replace", 3, "first_k_dense_replace"),
        ("n_group", 3, "moe.groups"),
    ],
)
def test_unsupported_settings_refused(key, value, names):
    with pytest.raises(CheckpointError, match=names):
        config_from_hf({**_hf_config(), key: value}, source="config.json")


def test_stacked_layers_refused_naming_the_reason():
    """Dense and MoE layers cannot stack (scan, pipeline stages): refused before compile."""
    c = config_from_hf(_hf_config(), source="config.json")
    with pytest.raises(ConfigError, match="first_dense_layers=1.*layer_loop='unrolled'"):
        ModelRun(c, ExecutionOptions(layer_loop="scan"))
    with pytest.raises(ConfigError, match="first_dense_layers=1.*layer_loop='unrolled'"):
        InferenceEngine(
            c, None, max_batch=2, max_seq_len=16, options=ExecutionOptions(layer_loop="scan")
        )
    with pytest.raises(ConfigError, match="pp=1"):
        InferenceEngine(c, None, ParallelConfig(pp=2), max_batch=2, max_seq_len=16)


def test_mla_refuses_kernels_and_quantization_it_cannot_run():
    c = config_from_hf(_hf_config(), source="config.json")
    with pytest.raises(ConfigError, match="decode_attention='cudnn' cannot attend over MLA"):
        ModelRun(c, ExecutionOptions(decode_attention="cudnn"))
    for options in (ExecutionOptions(quantize="int8"), ExecutionOptions(kv_cache_dtype="fp8")):
        with pytest.raises(ConfigError, match="multi-head latent attention .* leave both None"):
            ModelRun(c, options)


@pytest.mark.parametrize(
    "parallel",
    sweep(
        [
            # Heads over tp, the latent cache replicated (it has no head axis); dp splits rows.
            ParallelConfig(dp=2, tp=4),
            # Prefill tokens over sp (each shard's queries read the gathered latent; sp carries
            # rows in decode); routed experts over ep (group-limited routing per token on its
            # device); heads, the shared experts and the dense layer over tp. One engine for
            # sp·tp and ep·tp: each compile costs ~15-40 s on a loaded 2-core machine.
            ParallelConfig(sp=2, ep=2, tp=2),
        ],
        # The fast tier: the strategy that reaches sp, ep and tp together.
        lambda parallel: parallel.ep > 1,
    ),
    ids=str,
)
def test_sharded_matches_transformers(parallel):
    eng = check_matches_hf(FIXTURE, parallel)
    # The latent pool is split by pages (rows) only, never by tp: no head axis to split.
    spec = partition_spec(
        PAGE_AXES, Module.ATTENTION, Phase.DECODE, parallel, dims=eng.model_config
    )
    assert spec[0] is None and "tp" not in jax.tree.leaves(tuple(spec))


@pytest.mark.sweep
def test_served_over_pages_equals_prefill_argmax():
    """Chunked prefill and prefix hits (attention over cached latents) and paged decode
    under the continuous batcher, tp=2: each request's greedy tokens are the argmaxes of
    one whole-sequence prefill (the path checked against transformers)."""
    config, params = load_hf_checkpoint(FIXTURE)
    parallel = ParallelConfig(tp=2)
    engine = InferenceEngine(
        config,
        params,
        parallel,
        max_batch=4,
        max_seq_len=40,
        mesh=make_mesh(parallel, jax.devices()[:2]),
    )
    budget = KVBudget(page_size=4, tokens=160)
    batcher = ContinuousBatcher(engine, prefill_batch=2, kv_budget=budget, max_prefill_tokens=8)
    rng = np.random.default_rng(3)
    system = rng.integers(3, config.vocab_size, 9).tolist()
    prompts = [system + rng.integers(3, config.vocab_size, n).tolist() for n in (2, 13, 6)]
    with batcher:
        got = [batcher.submit(prompt=prompts[0], max_tokens=8).result(timeout=120)]
        streams = [batcher.submit(prompt=p, max_tokens=8) for p in prompts[1:]]
        got += [s.result(timeout=120) for s in streams]
    assert batcher.stats.prompt_tokens_cached > 0  # later prompts continued cached pages
    assert batcher.stats.prefill_chunks >= 1  # the 22-token prompt came in chunks
    padded, lengths = engine.pad_prompts([p + t[:-1] for p, t in zip(prompts, got, strict=True)])
    logits = np.asarray(engine.prefill_logits(padded, lengths))
    for row, (prompt, tokens) in enumerate(zip(prompts, got, strict=True)):
        start = len(prompt) - 1
        assert logits[row, start : start + len(tokens)].argmax(-1).tolist() == tokens


def test_spec_rows_for_mla(tmp_path):
    """The tables' [variant.mla] rows replace attention's for an MLA model: tp splits the
    query heads alone (never kv_heads: the latent has none), the validator's plan and
    explain show those rows; a variant missing a primitive's row is refused on load."""
    c = config_from_hf(_hf_config(), source="config.json")
    table = spec_table()
    mla = table.for_model(c)
    assert mla.entry("attention", "tp").splits == ("heads",)
    assert "kv_heads" not in mla.entry("attention", "tp").may_split
    assert table.entry("attention", "tp").splits == ("heads", "kv_heads")  # others unchanged
    for phase in Phase:
        axes = mesh_axes(Module.ATTENTION, phase, ParallelConfig(tp=2), dims=c)
        assert (axes["heads"], axes["kv_heads"]) == (("tp",), ())
    plan = validate(c, ParallelConfig(ep=2, tp=2))
    rows = {(a.module.value, a.primitive.value): a.row for a in plan.for_phase("decode")}
    assert rows["attention", "tp"] == mla.entry("attention", "tp").row
    assert "latent replicated" in rows["attention", "tp"]
    assert ("ffn", "tp") in rows  # the dense first layer and the shared experts
    with pytest.raises(IllegalStrategyError, match="heads=4 does not divide over tp=8"):
        validate(c, ParallelConfig(tp=8))
    specs = tmp_path / "specs"
    shutil.copytree(default_spec_dir(), specs)
    text = (specs / "attention.toml").read_text()
    start = text.index("[variant.mla.ep]")
    (specs / "attention.toml").write_text(text[:start])
    with pytest.raises(SpecFileError, match=r"missing row \[variant.mla.ep\]"):
        load_spec_table(specs)


def test_plan_and_explain(capsys):
    """The fixture planned on 6 devices (pp=3 is legal by the tables and the layer count,
    but no pipelined plan is offered: its layers do not stack);
    DeepSeek-V3's published shapes (config.json only) explained without compiling: its
    cache is the latent (512) and RoPE key (64) per token and layer, one "head", split over
    the decode batch shards only."""
    c = config_from_hf(_hf_config(), source="config.json")
    refused = check(c, ParallelConfig(pp=3, tp=2), Workload(batch=8, prompt_len=16, gen_len=8))
    assert refused is not None and "pp=3 runs the layers stacked" in refused.reason
    args = ["plan", "--hf", str(FIXTURE), "--devices", "6", "--hardware", "h100", "--json"]
    assert main([*args, "--batch", "6", "--prompt-len", "12", "--gen-len", "8"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["plans"] and all("pp" not in p["strategy"] for p in plan["plans"])
    shapes = str(FIXTURE.parent.parent / "configs" / "deepseek-v3")
    assert main(["explain", "--hf", shapes, "--ep", "8", "--no-compile", "--json"]) == 0
    tensors = json.loads(capsys.readouterr().out)["phases"]["decode"]["tensors"]
    pools = {t["tensor"].split(";")[0]: t for t in tensors if "page pool" in t["tensor"]}
    rope, latent = pools["KV page pool (MLA RoPE key"], pools["KV page pool (MLA latent"]
    assert (rope["shape"][:2], rope["shape"][-1]) == ([61, 1], 64)
    assert (latent["shape"][:2], latent["shape"][-1]) == ([61, 1], 512)
    assert latent["spec"] == "P(None, None, ep, None, None)"
