"""Sharded engines built straight from HF fixtures match the transformers reference."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.engine._load import engine_from_hf
from jaxpar.errors import IllegalStrategyError
from jaxpar.spec import ParallelConfig, make_mesh

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


@pytest.mark.parametrize(
    ("name", "parallel"),
    [
        ("llama", ParallelConfig(dp=2, tp=4)),  # 2 kv heads < tp=4: K/V heads replicated
        ("mixtral_fused", ParallelConfig(ep=4, tp=2)),
        ("mixtral_legacy", ParallelConfig(sp=2, ep=2, tp=2)),  # MoE groups per sp shard
        ("gpt2", ParallelConfig(sp=2, tp=4)),
    ],
    ids=str,
)
def test_sharded_hf_checkpoint_matches_transformers(name, parallel):
    ref = np.load(FIXTURES / name / "reference.npz")
    n = sum(1 for k in ref.files if k.startswith("tokens_"))
    prompts = [ref[f"tokens_{i}"].tolist() for i in range(n)]
    mesh = make_mesh(parallel, jax.devices()[: parallel.size])
    eng = engine_from_hf(FIXTURES / name, parallel, max_batch=4, max_seq_len=48, mesh=mesh)
    # Loaded in place: weights carry their final shardings straight from the reader.
    q = eng.params["layers"][0]["attn"]["q_kernel"].get_value()  # [D, N, H], one layer
    assert q.sharding.spec[1] == "tp"
    tokens, lengths = eng.pad_prompts(prompts)
    logits = np.asarray(eng.prefill_logits(tokens, lengths))
    for i, prompt in enumerate(prompts):
        np.testing.assert_allclose(logits[i, : len(prompt)], ref[f"logits_{i}"], atol=1e-4, rtol=0)
    gen = eng.generate(prompts, 16, stop_tokens=())  # the fixtures ran with EOS disabled
    assert gen.tokens == [ref[f"greedy_{i}"].tolist() for i in range(n)]
    assert gen.moe_dropped is None  # dropless (MoE or not): nothing to count


def test_illegal_strategy_refused_before_reading_tensors():
    with pytest.raises(IllegalStrategyError, match="heads=4 does not divide over tp=8"):
        engine_from_hf(FIXTURES / "llama", ParallelConfig(tp=8), max_batch=8, max_seq_len=48)
