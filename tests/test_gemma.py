"""Gemma 2 and Gemma 3 (text) sharded, pipelined and served equal transformers.

The fixtures (``scripts/make_hf_fixtures.py``) have 4 layers with a 4-token window on
some of them (Gemma 2: layers 0 and 2; Gemma 3: layers 0-2), shorter than the 7- and
11-token prompts; Gemma 2's attention and final soft caps bind. One-device equality with
transformers is ``test_hf_fixtures.py``; here every strategy must give the same prefill
logits (1e-4) and the same 16 greedy tokens, and the continuous batcher over the paged
cache (chunked prefill and prefix hits: prefill with context, paged decode) must give
every request its offline tokens.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from jaxpar import ParallelConfig
from jaxpar.cli import main
from jaxpar.engine import ContinuousBatcher, InferenceEngine, Sampling
from jaxpar.engine._kv_budget import KVBudget
from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.models import (
    AttentionConfig,
    EmbedConfig,
    ExecutionOptions,
    FfnConfig,
    ModelRun,
    NormConfig,
    RopeConfig,
    WindowConfig,
    load_hf_checkpoint,
)
from jaxpar.models._hf_config import config_from_hf
from tests._engine_util import check_matches_hf
from tests._tiers import sweep

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
PAGE = 4


# The fast tier runs Gemma 2 with sp and Gemma 3 pipelined (tests/_tiers.py).
FAST_SHARDED = {("gemma2", ParallelConfig(sp=2, tp=2)), ("gemma3_text", ParallelConfig(pp=2, tp=2))}


@pytest.mark.parametrize(
    ("name", "parallel"),
    sweep(
        [
            # 2 kv heads < tp=4: one per device (each held twice); soft caps, windows per shard.
            ("gemma2", ParallelConfig(tp=4)),
            # Queries split over sp in prefill: each shard's window reaches into the other's keys.
            ("gemma2", ParallelConfig(sp=2, tp=2)),
            ("gemma3_text", ParallelConfig(dp=2, tp=4)),
            # Stacked layers under the pipeline: each stage picks its layers' windows and RoPE
            # bases from the model-wide index (Gemma 3's stages hold [s, s] and [s, global]:
            # a stage-local index would give stage 1 the wrong kinds; Gemma 2's alternation
            # could not tell). Soft caps in the contiguous decode: test_hf_fixtures.
            ("gemma3_text", ParallelConfig(pp=2, tp=2)),
        ],
        lambda case: case in FAST_SHARDED,
    ),
    ids=str,
)
def test_sharded_gemma_matches_transformers(name, parallel):
    check_matches_hf(FIXTURES / name, parallel)


def _requests(vocab: int) -> list[dict]:
    """A 9-token prefix shared by most prompts (two full pages cached for later ones),
    all longer than the window, one longer than an 8-token chunk (sampled), two greedy."""
    rng = np.random.default_rng(5)
    system = rng.integers(3, vocab, 9).tolist()
    out = []
    for i, (suffix, n) in enumerate([(2, 10), (13, 6), (6, 8)]):
        prompt = system + rng.integers(3, vocab, suffix).tolist()
        sampling = Sampling(temperature=0.8, top_k=20) if i == 1 else Sampling()
        out.append(dict(prompt=prompt, max_tokens=n, sampling=sampling, seed=i))
    return out


@pytest.mark.sweep
def test_served_over_pages_equals_offline():
    """Chunked prefill and prefix hits (prefill with context) and paged decode under the
    continuous batcher, for Gemma 2 with stacked layers (soft caps, and windows as traced
    values): each greedy row's tokens are the argmaxes of one whole-sequence prefill (no
    cache at all: the path checked against transformers), the sampled row's tokens its
    offline ``generate``'s. (Static windows in paged decode: the sharded tests' generate.)"""
    scan = ExecutionOptions(layer_loop="scan")
    config, params = load_hf_checkpoint(FIXTURES / "gemma2", options=scan)
    engine = InferenceEngine(
        config, params, ParallelConfig(), max_batch=4, max_seq_len=40, options=scan
    )
    budget = KVBudget(page_size=PAGE, tokens=160)
    batcher = ContinuousBatcher(engine, prefill_batch=2, kv_budget=budget, max_prefill_tokens=8)
    requests = _requests(config.vocab_size)
    with batcher:
        first = batcher.submit(**requests[0])
        got = [first.result(timeout=120)]
        streams = [batcher.submit(**r) for r in requests[1:]]
        got += [s.result(timeout=120) for s in streams]
    assert batcher.stats.prompt_tokens_cached > 0  # later prompts continued cached pages
    assert batcher.stats.prefill_chunks >= 1  # the 22-token prompt came in chunks
    sampled = requests[1]  # the long prompt: a prefix hit, then the rest in chunks
    offline = engine.generate(
        [sampled["prompt"]], sampled["max_tokens"], sampling=sampled["sampling"], seed=1
    )
    assert got[1] == offline.tokens[0]
    greedy = [
        (r["prompt"], t)
        for r, t in zip(requests, got, strict=True)
        if r["sampling"].temperature == 0
    ]
    padded, lengths = engine.pad_prompts([p + t[:-1] for p, t in greedy])
    logits = np.asarray(engine.prefill_logits(padded, lengths))
    for row, (prompt, tokens) in enumerate(greedy):
        assert (
            logits[row, len(prompt) - 1 : len(prompt) - 1 + len(tokens)].argmax(-1).tolist()
            == tokens
        )


def _hf_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def test_config_mapping():
    g2 = config_from_hf(_hf_config("gemma2"), source="gemma2")
    assert g2.arch == "gemma2" and g2.window.layers == (True, False, True, False)
    assert (g2.attention.softcap, g2.embed.logit_softcap, g2.window.size) == (1.0, 6.0, 4)
    assert g2.attention.scale == pytest.approx(24**-0.5) and g2.head_dim == 12
    assert g2.rope.local_theta is None and not g2.norms.qk and g2.embed.tied
    g3 = config_from_hf(_hf_config("gemma3_text"), source="gemma3")
    assert g3.arch == "gemma3" and g3.window.layers == (True, True, True, False)
    assert (g3.rope.theta, g3.rope.local_theta, g3.rope.linear_factor) == (1e4, 100.0, 2.0)
    assert g3.norms.qk and g3.attention.softcap is None and g3.embed.logit_softcap is None
    # Older Hub files: rope_local_base_freq, rope_scaling and sliding_window_pattern.
    old = {k: v for k, v in _hf_config("gemma3_text").items() if k not in ("layer_types",)}
    old.pop("rope_parameters")
    old.update(
        num_hidden_layers=6,
        sliding_window_pattern=3,
        rope_theta=5e5,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    g3_old = config_from_hf(old, source="old")
    assert g3_old.window.layers == (True, True, False, True, True, False)
    assert (g3_old.rope.theta, g3_old.rope.local_theta, g3_old.rope.linear_factor) == (
        5e5,
        1e4,
        8.0,
    )


@pytest.mark.parametrize(
    ("name", "change", "field"),
    [
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation"),
        ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types"),
        ("gemma2", {"sliding_window": None}, "sliding_window"),
        (
            "gemma3_text",
            {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}},
            "yarn",
        ),
        (
            "gemma3_text",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default"},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                }
            },
            "sliding_attention",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_unsupported_options_are_refused_naming_the_field(name, change, field):
    with pytest.raises(CheckpointError, match=field):
        config_from_hf({**_hf_config(name), **change}, source=name)


def test_prequantized_gemma_is_refused():
    """Pre-quantized fp8 loads are checked for the Llama family only."""
    qc = json.loads((FIXTURES / "llama_fp8_channel" / "config.json").read_text())
    hf = {**_hf_config("gemma2"), "quantization_config": qc["quantization_config"]}
    with pytest.raises(CheckpointError, match="pre-quantized .* Gemma checkpoint"):
        config_from_hf(hf, source="gemma2")


def test_soft_capping_refuses_named_kernels():
    """No fused kernel soft-caps scores: naming one with a soft cap is refused up front."""
    base = config_from_hf(_hf_config("gemma2"), source="gemma2")
    named = (("prefill_attention", "cudnn"), ("decode_attention", "pallas_gpu"))
    for name, kernel in (*named, ("paged_attention", "pallas_tpu")):
        with pytest.raises(ConfigError, match=f"{name}='{kernel}' cannot soft-cap"):
            ModelRun(base, ExecutionOptions(**{name: kernel}))
    ExecutionOptions(prefill_attention="xla").check(base)
    # "auto" resolves to XLA for a soft-capped model, on any platform.
    on_gpu = ExecutionOptions().resolve(dataclasses.replace(base, dtype="bfloat16"), "gpu")
    assert {on_gpu.prefill_attention, on_gpu.decode_attention, on_gpu.paged_attention} == {"xla"}


@pytest.mark.sweep
def test_explain_names_soft_caps_windows_and_norms(capsys):
    """``jaxpar explain`` compiles a Gemma 2 strategy: no collective above the minimum
    (soft caps and norms are elementwise, each on its own shard), and the execution says
    what Gemma adds."""
    argv = ["explain", "--hf", str(FIXTURES / "gemma2"), "--sp", "2", "--tp", "2", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    for phase in ("prefill", "decode"):
        report = data["phases"][phase]["collectives"]
        assert report["exceptions"] == {} and report["ratio_explained"] <= 1.05
        text = " | ".join(s["text"] for s in data["phases"][phase]["execution"])
        assert "token lookup x sqrt(d_model)" in text
        assert "soft-capped at 1, XLA path), 4-token sliding window on 2 of the layers" in text
        assert "post-attention norm" in text and "post-FFN norm" in text
        assert "soft-capped at 6" in text


@pytest.mark.sweep
def test_plan_and_explain_on_hub_shapes(capsys):
    """Real-sized shapes (config.json only): Gemma 2 9B planned on 8 H100s, Gemma 3 1B
    explained without compiling (4 of its 26 layers global, 22 sliding)."""
    gemma2_9b = str(FIXTURES.parent / "configs" / "gemma-2-9b")
    args = ["plan", "--hf", gemma2_9b, "--devices", "8", "--hardware", "h100", "--json"]
    assert main([*args, "--batch", "8", "--prompt-len", "16", "--gen-len", "16"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["plans"] and "--hf" in plan["command"]
    gemma3_1b = str(FIXTURES.parent / "configs" / "gemma-3-1b")
    assert main(["explain", "--hf", gemma3_1b, "--tp", "1", "--no-compile", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    text = " | ".join(s["text"] for s in data["phases"]["decode"]["execution"])
    assert "512-token sliding window on 22 of the layers" in text
    assert "per-head q/k norms" in text


@pytest.mark.sweep
def test_gemma3_on_interpreted_kernels_equals_xla():
    """Gemma 3 has no soft cap, so its unrolled layers run the fused kernels with static
    per-layer windows and its query_pre_attn_scalar folded into q: the splash prefill and
    the GPU decode kernel (interpreted on CPU) equal the XLA path, tp=2, f32. Prompts of
    77-120 tokens against a 16-token window on 3 of 4 layers."""
    from jaxpar.models import init_params, interpret_kernels
    from tests.test_kernels_in_engine import _config, _run

    gemma = dict(
        arch="gemma3",
        ffn=FfnConfig(activation="gelu_tanh"),
        norms=NormConfig(qk=True, offset=True, sandwich=True),
        embed=EmbedConfig(scale=True),
        attention=AttentionConfig(scale=24**-0.5),
        window=WindowConfig(size=16, layers=(True, True, True, False)),
        rope=RopeConfig(local_theta=100.0, linear_factor=2.0),
    )
    kernels = _config(
        "float32", gemma, prefill_attention="pallas_tpu", decode_attention="pallas_gpu"
    )
    xla = kernels.with_options(prefill_attention="xla", decode_attention="xla")
    params = init_params(xla, seed=0)
    reference = _run(xla, params, "tp=2")
    with interpret_kernels():
        got = _run(kernels, params, "tp=2")
    np.testing.assert_allclose(got, reference, atol=1e-4, rtol=0)
