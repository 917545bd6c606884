"""Speculative decoding with a draft model (``method: draft_model``).

The target and draft checkpoints are the tiny random fixtures of ``tests/fixtures/hf``
(``scripts/make_hf_fixtures.py``): a Llama target drafted for by a Qwen2 of the same
vocabulary (random weights: its drafts are almost never accepted, which is what
losslessness must survive), a Mixtral (MoE) target drafted for by a Mistral. Greedy: a
batcher that verifies the draft's tokens emits, token for token, what plain greedy
decoding emits, on one device (a pool small enough that rows are preempted, chunked
prefill) and under ep2.tp2 (an int8 KV cache; the draft tp2), with prefix hits, penalties
and logprobs in the mix. A draft that *is* the target is accepted in full (acceptance length
``K + 1``), greedy and sampled (``n`` = 2 choices of one prompt, with temperature, top-p
and penalties: the draft's ``q`` goes through the target's filters, so ``p / q`` is 1), and
under a grammar (every drafted position masked by the grammar advanced along the drafts).
A draft of another vocabulary is refused before anything compiles. The cost model off
(``adaptive`` false), every step verifies ``K`` drafts.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

from jaxpar import ConfigError, ParallelConfig
from jaxpar.engine import (
    Constraint,
    ContinuousBatcher,
    Grammars,
    KVBudget,
    Sampling,
    engine_from_hf,
    generation_defaults,
    load_tokenizer,
)
from jaxpar.engine._speculative import CostModel
from jaxpar.spec import make_mesh
from tests._serve_util import ROOT
from tests._tiers import sweep
from tests.test_batching import PENALTIES
from tests.test_speculative import _check, _serve
from tests.test_structured import CHECKPOINT as BYTES
from tests.test_structured import SCHEMA, _oracle, _valid

HF = ROOT / "tests" / "fixtures" / "hf"
K = 3


def _spec(draft: str) -> dict:
    return {"method": "draft_model", "num_speculative_tokens": K, "model": str(HF / draft),
            "adaptive": False}  # fmt: skip


@functools.cache
def _target(name: str, parallel: ParallelConfig, kv: str | None = None):
    return engine_from_hf(
        HF / name, parallel, max_batch=4, max_seq_len=48, kv_cache_dtype=kv,
        mesh=make_mesh(parallel, jax.devices()[: parallel.size]),
    )  # fmt: skip


def _requests(vocab: int) -> list[dict]:
    """Four prompts over a shared 8-token prefix (two pages: later ones hit it), greedy,
    one penalised, one with logprobs."""
    rng = np.random.default_rng(5)
    system = rng.integers(3, vocab, 8).tolist()
    out = []
    for i in range(4):
        sampling = dataclasses.replace(Sampling(), **PENALTIES) if i == 2 else Sampling()
        prompt = system + rng.integers(3, vocab, 5).tolist()
        out.append(dict(prompt=prompt, max_tokens=12, sampling=sampling, seed=i,
                        logprobs=2 if i == 1 else None))  # fmt: skip
    return out


def _plain(engine, r: dict):
    return engine.generate([r["prompt"]], r["max_tokens"], sampling=r["sampling"], seed=r["seed"],
                           stop_tokens=(), logprobs=r["logprobs"])  # fmt: skip


CASES = {
    "single-small-pool": ("llama", "qwen2", ParallelConfig(), None),
    "ep2-tp2-moe-int8kv": ("mixtral_fused", "mistral", ParallelConfig(ep=2, tp=2), "int8"),
}


@pytest.mark.parametrize("case", sweep(list(CASES), lambda c: CASES[c][2].size == 1))
def test_greedy_with_a_draft_model_equals_plain_greedy(case):
    """On one device the pool is small (8 pages for four rows of up to 25 tokens):
    rows are preempted (their draft pages recomputed on return) and prefill is chunked.
    With the int8 cache, logprobs agree to 2e-2: a verification attends to its fed
    positions' K/V before they are quantized (as a prefill chunk does), a plain decode
    step to the quantized ones."""
    target, draft, parallel, kv = CASES[case]
    engine = _target(target, parallel, kv)
    requests = _requests(engine.model_config.vocab_size)
    runs = [_plain(engine, r) for r in requests]
    small = parallel.size == 1
    budget = KVBudget(page_size=4, tokens=32 if small else 256)
    batcher = ContinuousBatcher(
        engine, kv_budget=budget, speculative=_spec(draft),
        **(dict(prefill_batch=2, max_prefill_tokens=8) if small else {}),
    )  # fmt: skip
    streams, got = _serve(batcher, requests)
    _check(streams, got, runs, atol=2e-2 if kv else 1e-4)
    spec = batcher.spec_stats
    assert spec.verify_steps > 0 and spec.num_draft_tokens > 0
    assert batcher.stats.prefix_hits > 0
    assert batcher.stats.preemptions > 0 or not small


def test_a_draft_equal_to_the_target_is_accepted_in_full():
    """Greedy rows and two sampled choices of one prompt (seeds 7 and 8, as ``n`` = 2
    asks): every drafted token is accepted, every full draft gives ``K + 1`` tokens; the
    greedy rows are plain greedy's tokens, the two choices differ."""
    engine = _target("llama", ParallelConfig())
    requests = _requests(engine.model_config.vocab_size)[:2]
    sampled = Sampling(temperature=0.8, top_p=0.9, **PENALTIES)
    prompt = requests[0]["prompt"]
    choices = [dict(prompt=prompt, max_tokens=12, sampling=sampled, seed=7 + i) for i in range(2)]
    batcher = ContinuousBatcher(engine, speculative=_spec("llama"))
    streams, got = _serve(batcher, requests + choices)
    _check(streams[:2], got[:2], [_plain(engine, r) for r in requests])
    assert got[2] != got[3] and [len(g) for g in got[2:]] == [12, 12]
    spec = batcher.spec_stats
    assert spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens == spec.num_draft_tokens
    assert spec.accepted_per_pos[K - 1] > 0  # full drafts: K accepted, K + 1 emitted
    assert spec.mean_acceptance_length > 1 + (K - 1)  # near K + 1 (short drafts at the end)


def test_a_grammar_constrains_every_drafted_position():
    """A constrained greedy request (JSON schema) drafted for by the target itself: each
    drafted token was drawn under the grammar's mask at its position, so all are accepted,
    and the output is constrained greedy decoding's (an oracle of full prefills); n-gram
    drafts under the grammar give the same output."""
    parallel = ParallelConfig()
    engine = engine_from_hf(BYTES, parallel, max_batch=4, max_seq_len=64,
                            mesh=make_mesh(parallel, jax.devices()[:1]))  # fmt: skip
    tokenizer = load_tokenizer(BYTES)
    eos = generation_defaults(BYTES).eos_token_ids
    grammar = Grammars(tokenizer, engine.steps.vocab_size, eos).compile(
        Constraint.json_schema(SCHEMA)
    )
    spec = {"method": "draft_model", "num_speculative_tokens": K, "model": str(BYTES),
            "adaptive": False}  # fmt: skip
    prompt = tokenizer.encode("data: ").ids
    with ContinuousBatcher(engine, speculative=spec) as batcher:
        tokens = batcher.submit(prompt, max_tokens=40, stop_tokens=eos, grammar=grammar).result(300)
    want = _oracle(engine, grammar, prompt, 40, eos)
    assert tokens == want
    assert _valid(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)))
    stats = batcher.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    # n-gram drafts under the same grammar: cut where it does not allow them.
    ngram = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
             "prompt_lookup_max": 2, "adaptive": False}  # fmt: skip
    with ContinuousBatcher(engine, speculative=ngram) as batcher:
        tokens = batcher.submit(prompt, max_tokens=40, stop_tokens=eos, grammar=grammar).result(300)
    assert tokens == want
    assert batcher.spec_stats.num_draft_tokens > 0


def test_a_draft_of_another_vocabulary_is_refused_before_compiling():
    engine = _target("llama", ParallelConfig())
    before = engine.steps.compiled_count
    with pytest.raises(ConfigError, match="vocabulary of 128 tokens, the target 256"):
        ContinuousBatcher(engine, speculative=_spec("mistral"))
    assert engine.steps.compiled_count == before


def test_cost_model_chooses_an_intermediate_k():
    """Verification costs a plain step plus a fixed time per drafted position; at an
    acceptance of 0.6 the expected tokens per second peak below the full K, so the model
    chooses it (having measured a verification of the full K and then a plain step); a
    request whose drafts are rarely kept drafts fewer."""
    cost = CostModel(k=8, adaptive=True)
    assert cost.choices == (0, 1, 2, 4, 8)
    assert cost.best(4, [8] * 4) == 8  # unmeasured: the full K, to measure it
    for _ in range(30):
        cost.verified(4, 0.10 + 8 * 0.03, drafted=32, accepted=19, k=8)  # acceptance -> 0.6
    assert cost.best(4, [8] * 4) == 0  # then a plain step, to measure that
    cost.plain(4, 0.10)
    rates = {k: cost.expected_tokens([k] * 4) / cost.verify_time(4, k) for k in cost.choices[1:]}
    best = cost.best(4, [8] * 4)
    assert 0 < best < 8 and rates[best] == max(rates.values())
    assert rates[best] > 4 / 0.10  # beats a plain step
    for _ in range(30):
        cost.row_verified("poor", drafted=4, accepted=0)
    assert cost.row_cap("poor") == 1 and cost.row_cap("new") > 1
