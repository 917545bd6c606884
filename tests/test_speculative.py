"""Speculative decoding (n-gram prompt lookup): lossless, and its sampler exact.

Greedy: a batcher that verifies drafted tokens emits, token for token, what plain greedy
decoding emits (the offline ``generate`` of each request alone), on one device and under
tp2 and dp2.tp2, with prefix hits, penalties and logprobs in the mix, and with
preemption under a small pool. The cost model is switched off there (``adaptive``
false) so that every step with a draft verifies. Sampled: the rejection sampler's
emitted tokens follow the target distribution (temperature, top-p and a token mask
applied) for a draft distribution far from it, by a chi-square test. Bad configurations
are refused by name before anything compiles. The verification step is a decode step
(``sharding_specs/rules.toml``, rule ``verify-is-decode``): these tests are its check.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxpar import ConfigError, ParallelConfig
from jaxpar.engine import ContinuousBatcher, RowSampling, Sampling
from jaxpar.engine._kv_budget import KVBudget
from jaxpar.engine._spec_verify import accept_or_resample, speculative_tokens, target_probs
from jaxpar.engine._speculative import CostModel, SpeculativeConfig, ngram_propose
from tests._tiers import sweep
from tests.test_batching import CONFIG, PENALTIES, _engine, _offline_run

PAGE = 4
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "adaptive": False}  # fmt: skip


def _requests() -> list[dict]:
    """Prompts that repeat a pattern (so n-grams recur) over a shared 8-token prefix (two
    pages: later requests hit the prefix cache); greedy, one penalised, two with
    logprobs."""
    rng = np.random.default_rng(11)
    system = rng.integers(1, CONFIG.vocab_size, 8).tolist()
    out = []
    for i in range(6):
        pattern = rng.integers(1, CONFIG.vocab_size, 3).tolist()
        sampling = dataclasses.replace(Sampling(), **PENALTIES) if i == 3 else Sampling()
        logprobs = 2 if i in (1, 4) else None
        prompt = system + pattern * 3
        out.append(dict(prompt=prompt, max_tokens=14, sampling=sampling, seed=i, logprobs=logprobs))
    return out


@functools.cache
def _expected(parallel: ParallelConfig):
    engine = _engine(parallel, max_seq_len=48)
    return engine, [_offline_run(engine, r) for r in _requests()]


def _serve(batcher: ContinuousBatcher, requests: list[dict]):
    with batcher:
        first = [batcher.submit(**r) for r in requests[:2]]
        [s.result(timeout=300) for s in first]  # cached before the rest arrive
        streams = first + [batcher.submit(**r) for r in requests[2:]]
        return streams, [s.result(timeout=300) for s in streams]


def _check(streams, got, runs, atol: float = 1e-4) -> None:
    assert got == [run.tokens[0] for run in runs]
    for stream, run in zip(streams, runs, strict=True):
        want = [] if run.logprobs is None else run.logprobs[0]
        assert [e.token for e in stream.logprobs] == [e.token for e in want]
        np.testing.assert_allclose(
            [e.logprob for e in stream.logprobs], [e.logprob for e in want], atol=atol
        )


@pytest.mark.parametrize(
    "parallel",
    sweep(
        [ParallelConfig(), ParallelConfig(tp=2), ParallelConfig(dp=2, tp=2)], lambda p: p.size < 4
    ),
    ids=["single-small-pool", "tp2", "dp2-tp2"],
)
def test_greedy_speculation_equals_plain_greedy(parallel):
    """On one device the pool is small (14 usable pages for four rows): rows are
    preempted (their drafts dropped, recomputed on return) and prefixes evicted."""
    engine, runs = _expected(parallel)
    small = parallel.size == 1
    budget = KVBudget(page_size=PAGE, tokens=56 if small else 256 * parallel.dp)
    batcher = ContinuousBatcher(
        engine, kv_budget=budget, speculative=SPEC,
        **(dict(prefill_batch=2, max_prefill_tokens=8) if small else {}),
    )  # fmt: skip
    streams, got = _serve(batcher, _requests())
    _check(streams, got, runs)
    spec = batcher.spec_stats
    assert spec.verify_steps > 0 and spec.num_accepted_tokens > 0
    assert batcher.stats.prefix_hits > 0
    assert batcher.stats.preemptions > 0 or not small
    # Fewer steps than tokens: accepted drafts saved steps.
    assert batcher.stats.decode_steps < sum(len(g) - 1 for g in got)


def _chi_square(tokens: np.ndarray, probs: np.ndarray) -> float:
    """The p-value of ``tokens`` drawn from ``probs`` (cells of expected count >= 5)."""
    counts = np.bincount(tokens, minlength=probs.size)
    assert counts[probs == 0].sum() == 0  # nothing outside the support
    keep = probs * tokens.size >= 5
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(probs[keep], probs[~keep].sum()) * tokens.size
    observed, expected = observed[expected > 0], expected[expected > 0]
    expected = expected / expected.sum() * observed.sum()
    return stats.chisquare(observed, expected).pvalue


def test_rejection_sampler_emits_the_target_distribution():
    """Target: logits over 16 tokens at temperature 0.7, top-p 0.9, token 3 masked out.
    Draft q: most mass on tokens the target gives little. Accept min(1, p/q), else the
    normalised residual: the emitted tokens' frequencies fit p (chi-square p > 1e-3), and
    so do a point-mass draft's (n-gram lookup)."""
    n, vocab = 40_000, 16
    logits_V = jnp.asarray(np.random.default_rng(0).normal(0, 2, vocab), jnp.float32)
    rows = RowSampling.rows([Sampling(temperature=0.7, top_p=0.9)], [0])
    rows = jax.tree.map(jnp.asarray, rows)
    allowed = np.full((1, 1), -1 & ~(1 << 3), np.int32)  # one 32-bit word: token 3 off
    p_1V = target_probs(logits_V[None], rows, None, jnp.asarray(allowed))
    p_NV = jnp.broadcast_to(p_1V, (n, vocab))
    p_V = np.asarray(p_1V[0], np.float64)
    assert p_V[3] == 0 and (p_V == 0).sum() > 1  # the mask and top-p removed tokens
    q_V = jnp.asarray(np.where(p_V < np.median(p_V), 1.0, 0.05), jnp.float32)
    q_V = q_V / q_V.sum()
    k_draft, k_verify = jax.random.split(jax.random.key(1))
    draft_N = jax.random.categorical(k_draft, jnp.log(q_V), shape=(n,)).astype(jnp.int32)
    keys_N = jax.random.split(k_verify, n)
    q_NV = jnp.broadcast_to(q_V, (n, vocab))
    accepted, tokens = accept_or_resample(p_NV, draft_N, keys_N, q_NV)
    assert 0.05 < float(accepted.mean()) < 0.95  # both branches ran
    assert _chi_square(np.asarray(tokens), p_V) > 1e-3
    point = jnp.full((n,), int(np.argsort(p_V)[-2]), jnp.int32)  # a likely, not the top
    _, tokens = accept_or_resample(p_NV, point, keys_N)
    assert _chi_square(np.asarray(tokens), p_V) > 1e-3


def test_speculative_tokens_greedy_accepts_the_argmax_prefix():
    """Greedy rows: drafts are accepted while they equal each position's argmax; the
    first mismatch emits the argmax; all accepted: the bonus token is the last argmax."""
    rng = np.random.default_rng(2)
    logits_BTV = jnp.asarray(rng.normal(size=(3, 4, 10)), jnp.float32)
    top = np.asarray(jnp.argmax(logits_BTV, -1))
    drafts = np.stack([top[0, :3], [top[1, 0], (top[1, 1] + 1) % 10, 0], top[2, :3]])
    n_drafts = jnp.asarray([3, 3, 1])
    rows = jax.tree.map(jnp.asarray, RowSampling.rows([Sampling()] * 3, [0] * 3))
    out, count, _ = speculative_tokens(
        logits_BTV, jnp.asarray(drafts, jnp.int32), n_drafts, rows, jnp.zeros(3, jnp.int32)
    )
    assert np.asarray(count).tolist() == [4, 2, 2]
    assert np.asarray(out[0]).tolist() == top[0].tolist()
    assert np.asarray(out[1]).tolist() == [top[1, 0], top[1, 1], -1, -1]
    assert np.asarray(out[2]).tolist() == [top[2, 0], top[2, 1], -1, -1]


def test_ngram_proposes_what_followed_the_latest_match():
    context = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert ngram_propose(context, 2, 1, 3) == [7, 5]  # latest earlier "1 2 3"
    assert ngram_propose([4, 5, 6], 2, 1, 3) == []  # nothing recurs
    assert ngram_propose([4, 5, 4], 3, 1, 3) == [5, 4]  # "4" at 0, what follows


@pytest.mark.parametrize(
    "spec,named",
    [
        ('{"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}', "lookahead"),
        ({"method": "draft_model", "num_speculative_tokens": 4, "model": "x"}, "checkpoint"),
        ({"method": "draft_model", "num_speculative_tokens": 4}, "needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 4, "model": "x"}, "takes none"),
        ({"method": "eagle3", "num_speculative_tokens": 4}, "needs 'model'"),
        ({"method": "eagle3", "num_speculative_tokens": 4, "model": "x"}, "checkpoint"),
        ({"method": "mtp", "num_speculative_tokens": 1, "model": 3}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2}, "method"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),  # fmt: skip
        ("{not json", "JSON"),
    ],
)
def test_bad_speculative_configs_are_refused_by_name(spec, named):
    with pytest.raises(ConfigError, match=named):
        SpeculativeConfig.parse(spec)


def test_engine_refuses_a_bad_config_before_compiling():
    before = len(_expected(ParallelConfig())[0].steps._compiled)
    with pytest.raises(ConfigError, match="prompt_lookup_min"):  # set from the max
        _engine(ParallelConfig(), speculative={"method": "ngram", "num_speculative_tokens": 2,
                                               "prompt_lookup_max": 0})  # fmt: skip
    assert len(_expected(ParallelConfig())[0].steps._compiled) == before
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                      "prompt_lookup_max": 3})  # fmt: skip
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)  # vLLM's rule


def test_cost_model_turns_speculation_off_when_verifying_costs_more_than_it_saves():
    """At saturation a verification of K + 1 positions per row costs about K + 1 plain
    steps: with the measured times and acceptance it stops paying, and is retried only
    every RETRY turns; light load (cheap verification) keeps it on."""
    cost = CostModel(k=4, adaptive=True)
    assert cost.pays(16, [4] * 16)  # unmeasured: measure it
    cost.plain(16, 0.10)
    cost.verified(16, 0.50, drafted=64, accepted=16)
    for _ in range(20):
        cost.verified(16, 0.50, drafted=64, accepted=16)  # acceptance -> 0.25
    assert not cost.pays(16, [4] * 16)
    turns = [cost.worth_drafting(16, 16) for _ in range(CostModel.RETRY)]
    assert turns == [False] * (CostModel.RETRY - 1) + [True] and cost.exploring
    cost.plain(1, 0.05)
    cost.verified(1, 0.07, drafted=4, accepted=3)
    assert cost.pays(1, [4]) and not cost.pays(1, [0])  # a row without drafts: plain
    assert CostModel(k=4, adaptive=False).pays(16, [4] * 16)


def test_cli_flag_is_checked_before_anything_loads():
    from jaxpar.cli import _parser
    from jaxpar.cli._common import speculative_config

    for command in (["serve", "--hf", "x"], ["run", "--prompt", "1,2"]):
        args = _parser().parse_args([*command, "--speculative-config", '{"method": "medusa"}'])
        with pytest.raises(ConfigError, match="medusa"):
            speculative_config(args)
        args = _parser().parse_args(command)
        assert speculative_config(args) is None
