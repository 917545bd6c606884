"""Speculative decoding with heads over the target's hidden states: ``eagle3`` and ``mtp``.

The heads are made by ``scripts/make_spec_heads.py`` at test time, with random weights:
an EAGLE-3 head for the tiny Llama the batching tests use (three tapped layers, a draft
vocabulary half the target's, mapped by ``d2t``), and the DeepSeek-V3 fixture with one
MTP layer added. Random heads propose tokens the target rarely accepts, which is what
losslessness needs checked: greedy speculation emits plain greedy's tokens, token for
token, on one device (a small pool: rows preempted, their drafts and tapped states
dropped; prefix hits; chunked prefill) and under tp2 (``eagle3``) and ep2.tp2 (``mtp``).
A head whose proposals are the target's own next tokens (the real head's drafts
replaced, so the head, its taps and the verification all still run) is accepted in
full: acceptance length ``K + 1``. A checkpoint without MTP layers and a head made for
another target are refused by name.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import ConfigError, ParallelConfig
from jaxpar.engine import ContinuousBatcher, InferenceEngine
from jaxpar.engine._kv_budget import KVBudget
from jaxpar.models import load_hf_checkpoint
from jaxpar.spec import make_mesh
from tests._tiers import sweep
from tests.test_batching import CONFIG
from tests.test_speculative import PAGE, _check, _expected, _requests, _serve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from make_spec_heads import add_mtp_layer, make_eagle3_head  # noqa: E402

K = 3
DEEPSEEK = Path(__file__).parent / "fixtures" / "hf" / "deepseek_v3"


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("eagle3")
    sizes = dict(d_model=CONFIG.d_model, vocab=CONFIG.vocab_size, n_layers=CONFIG.n_layers)
    return str(make_eagle3_head(out, **sizes))


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory) -> str:
    return str(add_mtp_layer(DEEPSEEK, tmp_path_factory.mktemp("mtp")))


def _spec(method: str, model: str) -> dict:
    return {"method": method, "num_speculative_tokens": K, "model": model, "adaptive": False}


def _small(parallel: ParallelConfig, tokens: int) -> dict:
    """One device: a pool small enough to preempt, prefill in chunks of two rows."""
    if parallel.size > 1:
        return dict(kv_budget=KVBudget(page_size=PAGE, tokens=256 * parallel.dp))
    budget = KVBudget(page_size=PAGE, tokens=tokens)
    return dict(kv_budget=budget, prefill_batch=2, max_prefill_tokens=8)


@pytest.mark.parametrize(
    "parallel",
    sweep([ParallelConfig(), ParallelConfig(tp=2)], lambda p: p.size == 1),
    ids=["single-small-pool", "tp2"],
)
def test_eagle3_greedy_equals_plain_greedy(parallel, eagle_dir):
    """The n-gram tests' requests (prefix hits, penalties, logprobs), drafted by a random
    EAGLE-3 head."""
    engine, runs = _expected(parallel)
    batcher = ContinuousBatcher(
        engine, speculative=_spec("eagle3", eagle_dir), **_small(parallel, 56)
    )
    streams, got = _serve(batcher, _requests())
    _check(streams, got, runs)
    spec = batcher.spec_stats
    assert spec.verify_steps > 0 and spec.num_drafts > 0  # the head drafted
    assert batcher.stats.prefix_hits > 0
    assert batcher.stats.preemptions > 0 or parallel.size > 1


def test_a_head_proposing_the_target_tokens_is_accepted_in_full(eagle_dir):
    """The head runs (window, taps, K steps) and its drafts are then replaced by the
    target's own next tokens: every verification accepts all K (acceptance length
    K + 1). 14 tokens: the first from the prefill, one verified alone (its state
    tapped), then three verifications of K + 1."""
    engine, runs = _expected(ParallelConfig())
    request, want = _requests()[0], runs[0].tokens[0]
    assert request["max_tokens"] == 2 + 3 * (K + 1) == len(want)
    small = _small(ParallelConfig(), 56)  # the programs of the test above
    batcher = ContinuousBatcher(engine, speculative=_spec("eagle3", eagle_dir), **small)
    heads = batcher.core.speculation.proposer
    head_drafts = heads.drafts

    def right_drafts(wanted, owners, lengths):
        out = head_drafts(wanted, owners, lengths)
        for row, drafted in out.items():
            if drafted:
                done = len(owners[row].tokens)
                out[row] = want[done : done + len(drafted)]
        return out

    heads.drafts = right_drafts
    with batcher:
        got = batcher.submit(**request).result(timeout=300)
    assert got == want
    spec = batcher.spec_stats
    assert spec.num_drafts == 3 and spec.mean_acceptance_length == K + 1
    assert spec.accepted_per_pos == [spec.num_drafts] * K


def _deepseek_engine(parallel: ParallelConfig, path: str, **kw) -> InferenceEngine:
    config, params = load_hf_checkpoint(path)
    mesh = make_mesh(parallel, jax.devices()[: parallel.size])
    return InferenceEngine(config, params, parallel, max_batch=4, max_seq_len=40, mesh=mesh, **kw)


@pytest.mark.parametrize(
    "parallel",
    sweep([ParallelConfig(), ParallelConfig(ep=2, tp=2)], lambda p: p.size == 1),
    ids=["single-small-pool", "ep2-tp2"],
)
def test_mtp_greedy_equals_plain_greedy(parallel, mtp_dir):
    """DeepSeek-V3 (latent attention, MoE) drafting with its MTP layer (its own block:
    latent attention and experts, on one device). Plain greedy is read off one prefill of
    each whole sequence: every token the argmax after those before it."""
    engine = _deepseek_engine(parallel, mtp_dir, speculative=_spec("mtp", mtp_dir))
    rng = np.random.default_rng(5)
    system = rng.integers(3, 256, 8).tolist()
    prompts = [system + rng.integers(3, 256, n).tolist() for n in (3, 9, 5)]
    batcher = ContinuousBatcher(engine, **_small(parallel, 32))
    with batcher:
        got = [batcher.submit(prompt=prompts[0], max_tokens=8).result(timeout=300)]
        streams = [batcher.submit(prompt=p, max_tokens=8) for p in prompts[1:]]
        got += [s.result(timeout=300) for s in streams]
    # Greedy: each token is the argmax after the ones before it (one prefill of each
    # whole sequence, the path test_deepseek.py checks against transformers).
    padded, lengths = engine.pad_prompts([p + t[:-1] for p, t in zip(prompts, got, strict=True)])
    logits = np.asarray(engine.prefill_logits(padded, lengths))
    for row, (prompt, tokens) in enumerate(zip(prompts, got, strict=True)):
        start = len(prompt) - 1
        assert len(tokens) == 8
        assert logits[row, start : start + len(tokens)].argmax(-1).tolist() == tokens
    assert batcher.spec_stats.num_drafts > 0
    assert batcher.stats.prefix_hits > 0
    assert batcher.stats.preemptions > 0 or parallel.size > 1


def test_heads_that_do_not_fit_are_refused_by_name(tmp_path):
    """A DeepSeek-V3 export without MTP tensors (transformers drops them), and an
    EAGLE-3 head made for another vocabulary; and eagle3 without a head."""
    engine = _deepseek_engine(ParallelConfig(), str(DEEPSEEK))
    with pytest.raises(ConfigError, match="no multi-token-prediction layer"):
        ContinuousBatcher(engine, speculative=_spec("mtp", str(DEEPSEEK)))
    head = make_eagle3_head(tmp_path, d_model=CONFIG.d_model, vocab=128, n_layers=4)
    with pytest.raises(ConfigError, match="vocabulary 128"):
        ContinuousBatcher(_expected(ParallelConfig())[0], speculative=_spec("eagle3", str(head)))
    with pytest.raises(ConfigError, match="'model'"):
        ContinuousBatcher(engine, speculative={"method": "eagle3", "num_speculative_tokens": 2})


def test_taps_are_the_layer_inputs_and_the_final_state():
    """prefill_with_taps over cached context: the logits and K/V of the plain prefill
    over context, and the taps: layer 0's input is the embedding, layer L's the last
    output, ``final`` its normed form; stacked layers (scan) tap the same states."""
    from flax import nnx

    from jaxpar.models import (
        ExecutionOptions,
        ModelRun,
        abstract_model,
        init_params,
        with_layer_loop,
    )
    from jaxpar.models._hidden_taps import HiddenTaps, prefill_with_taps

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 9)), jnp.int32)
    taps = HiddenTaps((0, 2, CONFIG.n_layers), final=True)
    features = {}
    for loop in ("unrolled", "scan"):
        run = ModelRun(CONFIG, ExecutionOptions(layer_loop=loop))
        params = with_layer_loop(run, init_params(CONFIG), loop)  # the same weights
        model = nnx.merge(nnx.split(abstract_model(run))[0], params)
        _, k, v = model.prefill(tokens[:, :6], jnp.asarray([6, 6]))  # the cached context
        context = (k, v, jnp.asarray([6, 4]))  # row 1 continues after 4 of them
        new, lengths = tokens[:, 6:], jnp.asarray([3, 3])
        want = model.prefill(new, lengths, all_logits=True, context=context)
        got = prefill_with_taps(model, new, lengths, context, taps)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got[:3]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
        pos = jnp.arange(3)[None, :] + context[2][:, None]
        d = CONFIG.d_model
        np.testing.assert_allclose(got[3][..., :d], model.embed(new, pos), atol=1e-6)
        last, final = got[3][..., 2 * d : 3 * d], got[3][..., 3 * d :]
        np.testing.assert_allclose(final, model.final_norm(last), atol=1e-5)
        np.testing.assert_allclose(
            model.logits(last), want[0], atol=1e-4
        )  # layer L's tap is the last output
        features[loop] = np.asarray(got[3])
    np.testing.assert_allclose(features["scan"], features["unrolled"], atol=1e-5)
