"""Sharded engines built straight from HF fixtures match the transformers reference."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.engine import InferenceEngine
from jaxpar.engine._load import engine_from_hf
from jaxpar.errors import IllegalStrategyError
from jaxpar.models import ExecutionOptions, ModelRun, load_hf_checkpoint
from jaxpar.spec import ParallelConfig, make_mesh
from tests._tiers import sweep

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def _prompts(ref) -> list[list[int]]:
    n = sum(1 for k in ref.files if k.startswith("tokens_"))
    return [ref[f"tokens_{i}"].tolist() for i in range(n)]


def _check_prefill(eng, ref, prompts) -> None:
    tokens, lengths = eng.pad_prompts(prompts)
    logits = np.asarray(eng.prefill_logits(tokens, lengths))
    for i, prompt in enumerate(prompts):
        np.testing.assert_allclose(logits[i, : len(prompt)], ref[f"logits_{i}"], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("name", "parallel"),
    sweep(
        [
            ("llama", ParallelConfig(dp=2, tp=4)),  # 2 kv heads < tp=4: each on its 2 devices
            ("mixtral_fused", ParallelConfig(ep=4, tp=2)),
            ("mixtral_legacy", ParallelConfig(sp=2, ep=2, tp=2)),  # MoE groups per sp shard
            ("gpt2", ParallelConfig(sp=2, tp=4)),
            # One query head per device, one kv head each (2 held twice); q/k norms split nowhere.
            ("qwen3", ParallelConfig(dp=2, tp=4)),
            # Qwen2 with use_sliding_window: layer 0 full, layer 1 a 4-token window; prompt
            # tokens over sp (the window reaches into the other shard's keys), heads over tp.
            ("qwen2_window", ParallelConfig(sp=2, tp=2)),
            # Qwen3-MoE: test_qwen3_moe_capacity_mode_* (padded, sp2-ep2-tp2) and
            # test_qwen3_moe_ragged_dispatch_* (ep4-tp2).
        ],
        # The fast tier: a dense model with kv heads replicated, a MoE with experts over ep.
        lambda case: case[0] in ("llama", "mixtral_fused"),
    ),
    ids=str,
)
def test_sharded_hf_checkpoint_matches_transformers(name, parallel):
    ref = np.load(FIXTURES / name / "reference.npz")
    prompts = _prompts(ref)
    mesh = make_mesh(parallel, jax.devices()[: parallel.size])
    eng = engine_from_hf(FIXTURES / name, parallel, max_batch=4, max_seq_len=48, mesh=mesh)
    # Loaded in place: weights carry their final shardings straight from the reader.
    q = eng.params["layers"][0]["attn"]["q_kernel"].get_value()  # [D, N, H], one layer
    assert q.sharding.spec[1] == "tp"
    kv = eng.params["layers"][0]["attn"]["kv_kernel"].get_value()  # [D, 2, K, H]
    heads = eng.model_config.n_kv_heads
    if eng.run.attention_variant is None:  # one run head per device when tp > K, else K/tp
        per_device = max(heads // parallel.tp, 1)
        assert {s.data.shape[2] for s in kv.addressable_shards} == {per_device}
    _check_prefill(eng, ref, prompts)
    gen = eng.generate(prompts, 16, stop_tokens=())  # the fixtures ran with EOS disabled
    assert gen.tokens == [ref[f"greedy_{i}"].tolist() for i in range(len(prompts))]
    assert gen.moe_dropped is None  # dropless (MoE or not): nothing to count


@pytest.mark.sweep
def test_qwen3_moe_capacity_mode_matches_transformers():
    """Qwen3-MoE (fused tensors, norm_topk_prob false) under sp2-ep2-tp2 through the
    capacity path: fixed C rows per expert peer, drops counted. C is below the dropless
    bound in prefill but above what any peer receives here, so nothing drops and the
    tokens are transformers'."""
    ref = np.load(FIXTURES / "qwen3_moe_fused" / "reference.npz")
    prompts = _prompts(ref)
    config, params = load_hf_checkpoint(FIXTURES / "qwen3_moe_fused")
    options = ExecutionOptions(moe_capacity_factor=1.75)
    # ep=2, top-4 of 16: C = ceil(1.75 x 4n / 2) rows per peer, dropless would be 4n.
    assert ModelRun(config, options).expert_capacity(10, peers=2) == 35 < 10 * 4
    parallel = ParallelConfig(sp=2, ep=2, tp=2)
    mesh = make_mesh(parallel, jax.devices()[: parallel.size])
    eng = InferenceEngine(
        config, params, parallel, max_batch=4, max_seq_len=48, mesh=mesh, options=options
    )
    assert eng.options.moe_dispatch == "padded"
    assert eng.model_config is config  # the checkpoint's, not rewritten
    gen = eng.generate(prompts, 16, stop_tokens=())
    assert gen.moe_dropped == (0,) * 16  # counted (a capacity engine), none dropped
    assert gen.tokens == [ref[f"greedy_{i}"].tolist() for i in range(len(prompts))]


def test_qwen3_moe_ragged_dispatch_matches_transformers(monkeypatch):
    """Qwen3-MoE (64 experts top-8, the Hub's per-expert tensors) under ep=4, tp=2 through
    the ragged exchange (routed rows only; 16 experts per peer), dropless. XLA:CPU compiles no
    ragged-all-to-all: the primitive is the emulation that tests/test_models_moe_ragged.py
    checks against its documented semantics."""
    from jaxpar.engine import _moe_probe
    from tests.test_models_moe_ragged import emulated_ragged_all_to_all

    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    monkeypatch.setattr(_moe_probe, "ragged_all_to_all_compiles", lambda device: True)
    ref = np.load(FIXTURES / "qwen3_moe" / "reference.npz")
    prompts = _prompts(ref)
    parallel = ParallelConfig(ep=4, tp=2)
    mesh = make_mesh(parallel, jax.devices()[: parallel.size])
    eng = engine_from_hf(FIXTURES / "qwen3_moe", parallel, max_batch=4, max_seq_len=48, mesh=mesh)
    assert eng.options.moe_dispatch == "ragged"  # "auto", resolved
    experts = eng.params["layers"][0]["ffn"]["experts"]["gate_kernel"].get_value()
    assert experts.sharding.spec[0] == "ep"  # [E, D, F]: each peer read its 16 experts
    # Prefill only: decode runs the same exchange (tests/test_models_moe_ragged.py), and
    # the emulated primitive is slow to compile.
    _check_prefill(eng, ref, prompts)


def test_illegal_strategy_refused_before_reading_tensors():
    with pytest.raises(IllegalStrategyError, match="heads=4 does not divide over tp=8"):
        engine_from_hf(FIXTURES / "llama", ParallelConfig(tp=8), max_batch=8, max_seq_len=48)
