"""Vocabularies that tp does not divide are padded to a multiple of tp (zero rows), the padded
logits are never chosen nor returned, and the sharded run equals one device."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpar.engine import InferenceEngine, Sampling
from jaxpar.engine._load import engine_from_hf
from jaxpar.engine._sampling import select
from jaxpar.engine._vocab import mask_padded, padded_vocab_size
from jaxpar.models import init_params, preset
from jaxpar.spec import ParallelConfig, make_mesh
from tests._prompts import PROMPTS
from tests._tiers import sweep

VOCAB = 389  # prime: every tp > 1 pads
GPT2 = dataclasses.replace(preset("tiny-gpt2"), vocab_size=VOCAB)
PARAMS = init_params(GPT2, seed=0)
TOKENS = [[t % VOCAB for t in p] for p in PROMPTS]
SAMPLED = Sampling(temperature=1.0, top_k=50, top_p=0.95)
PC = ParallelConfig


def _engine(parallel: ParallelConfig) -> InferenceEngine:
    mesh = make_mesh(parallel, jax.devices()[: parallel.size])
    return InferenceEngine(GPT2, PARAMS, parallel, max_batch=8, max_seq_len=64, mesh=mesh)


@functools.cache
def _run(parallel: ParallelConfig):
    eng = _engine(parallel)
    tokens, lengths = eng.pad_prompts(TOKENS)
    logits = np.asarray(eng.prefill(tokens, lengths)[0])
    greedy = eng.generate(TOKENS, 12).tokens
    sampled = eng.generate(TOKENS, 6, sampling=SAMPLED, seed=5).tokens
    return eng, logits, greedy, sampled


def test_padded_size():
    assert [padded_vocab_size(VOCAB, tp) for tp in (1, 2, 4, 8)] == [389, 390, 392, 392]
    assert padded_vocab_size(50257, 8) == 50264


@pytest.mark.parametrize(
    "parallel", sweep([PC(tp=2), PC(tp=4, sp=2), PC(pp=2, tp=2)], PC(tp=2).__eq__), ids=str
)
def test_padded_vocab_matches_one_device(parallel):
    _, ref_logits, ref_greedy, ref_sampled = _run(PC())
    eng, logits, greedy, sampled = _run(parallel)
    padded = padded_vocab_size(VOCAB, parallel.tp)
    (table,) = [
        v
        for path, v in jax.tree_util.tree_flatten_with_path(eng.params)[0]
        if "token_table" in jax.tree_util.keystr(path)
    ]
    assert table.shape[0] == padded > VOCAB and table.sharding.spec[0] == "tp"
    assert not np.asarray(table)[VOCAB:].any()  # zero rows
    assert logits.shape == ref_logits.shape == (8, VOCAB)  # callers see the true vocabulary
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=0)
    assert greedy == ref_greedy
    assert sampled == ref_sampled  # the same seed samples the same tokens
    assert max(max(row) for row in greedy + sampled) < VOCAB


@pytest.mark.parametrize(
    "sampling",
    [Sampling(), Sampling(temperature=1.0), SAMPLED, Sampling(temperature=2.0, top_k=3)],
    ids=str,
)
def test_padded_logits_are_never_chosen(sampling):
    """Padded ids with the largest logits of all still never come out."""
    rng = np.random.default_rng(0)
    logits_BV = jnp.asarray(rng.normal(size=(64, 12)).astype(np.float32))
    logits_BV = logits_BV.at[:, 9:].set(50.0)  # ids 9..11 are padding
    for seed in range(8):
        got = np.asarray(select(mask_padded(logits_BV, 9), jax.random.key(seed), sampling))
        assert got.max() < 9, got


@pytest.mark.sweep  # a variant: the padding itself stays fast in the tp=2 case above
def test_hf_checkpoint_with_a_vocabulary_tp_does_not_divide(tmp_path):
    """The gpt2 fixture cut to 253 tokens loads under tp=4 (vocab loaded whole, then padded
    and split) and equals the same checkpoint on one device."""
    src = Path(__file__).parent / "fixtures" / "hf" / "gpt2"
    dst = tmp_path / "gpt2_253"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["vocab_size"] = 253
    (dst / "config.json").write_text(json.dumps(config))
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        cut = {k: (v[:253] if v.shape[0] == 256 and "wte" in k else v) for k, v in tensors.items()}
        assert any(cut[k].shape != tensors[k].shape for k in tensors)
        save_file(cut, file)
    prompts = [[5, 17, 99, 3, 250], [42, 8, 252]]
    out = {}
    for parallel in (PC(), PC(sp=2, tp=4)):
        mesh = make_mesh(parallel, jax.devices()[: parallel.size])
        eng = engine_from_hf(dst, parallel, max_batch=4, max_seq_len=32, mesh=mesh)
        tokens, lengths = eng.pad_prompts(prompts)
        out[parallel] = (
            np.asarray(eng.prefill_logits(tokens, lengths)),
            eng.generate(prompts, 8, stop_tokens=()).tokens,
        )
    (ref_logits, ref_tokens), (logits, tokens) = out.values()
    assert logits.shape[-1] == 253
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=0)
    assert tokens == ref_tokens
