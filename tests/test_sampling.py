"""Sampling draws from the distribution it names: top_k=1 and top_p -> 0 are greedy, and
over many seeds the frequencies match softmax(logits / T) restricted to the top-k / nucleus
(chi-square test; the critical value is computed from JAX's chi-square CDF)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.engine import Sampling
from jaxpar.engine._sampling import select
from jaxpar.spec import ParallelConfig
from tests._engine_util import PROMPTS, engine
from tests._tiers import sweep

ALPHA = 1e-4  # false-alarm rate of each chi-square test (the seeds are fixed anyway)
# Two rows of 10 logits: spread out, no near-ties at the top-k or nucleus boundaries.
LOGITS_BV = np.array(
    [
        [2.0, 1.5, 1.1, 0.6, 0.2, -0.3, -0.9, -1.4, -2.0, -3.0],
        [-1.0, 0.4, 3.0, 0.0, 1.7, -2.5, 0.9, -0.5, 2.2, -1.8],
    ],
    np.float32,
)
N_SEEDS, ROWS = 500, 32  # each logits row is tiled ROWS times: 16,000 draws per row


def expected(logits_V: np.ndarray, sampling: Sampling) -> np.ndarray:
    """softmax(logits / T), restricted to the top-k ids and then to the nucleus, renormalised."""
    z = logits_V.astype(np.float64) / sampling.temperature
    order = np.argsort(-z)
    keep = np.zeros(z.size, bool)
    keep[order[: sampling.top_k or z.size]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if sampling.top_p is not None:  # smallest prefix (by probability) whose mass reaches top_p
        before = np.cumsum(p[order]) - p[order]
        nucleus = order[before < sampling.top_p]
        p = np.where(np.isin(np.arange(z.size), nucleus), p, 0.0)
        p /= p.sum()
    return p


@functools.cache
def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """The (1 - alpha) quantile of chi-square(df): the first point of a fine grid where
    jax.scipy's CDF reaches 1 - alpha."""
    grid = np.linspace(0.0, 10.0 * df + 100.0, 20_001, dtype=np.float32)
    cdf = np.asarray(jax.scipy.stats.chi2.cdf(grid, df))
    return float(grid[np.argmax(cdf >= 1 - alpha)])


def chi2_statistic(counts: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the ids with p > 0, and its degrees of freedom."""
    support = p > 0
    n = counts.sum()
    stat = float(((counts[support] - n * p[support]) ** 2 / (n * p[support])).sum())
    return stat, int(support.sum()) - 1


@functools.cache
def draws(sampling: Sampling) -> np.ndarray:
    """Token counts [2, V] over N_SEEDS seeds x ROWS copies of each logits row."""
    logits = jnp.asarray(np.repeat(LOGITS_BV, ROWS, axis=0))
    keys = jax.vmap(jax.random.key)(jnp.arange(N_SEEDS))
    tokens_SB = np.asarray(jax.jit(jax.vmap(lambda k: select(logits, k, sampling)))(keys))
    v = LOGITS_BV.shape[1]
    rows = tokens_SB.reshape(N_SEEDS, 2, ROWS).transpose(1, 0, 2).reshape(2, -1)
    return np.stack([np.bincount(r, minlength=v) for r in rows])


def test_chi2_critical_values():
    # Textbook values of the 0.999 quantile.
    assert chi2_critical(1, 1e-3) == pytest.approx(10.828, abs=1e-2)
    assert chi2_critical(9, 1e-3) == pytest.approx(27.877, abs=1e-2)


@pytest.mark.parametrize(
    "sampling",
    # The fast tier's point: temperature, top-k and top-p together.
    sweep(
        [
            Sampling(temperature=0.7),
            Sampling(temperature=1.3, top_k=4),
            Sampling(temperature=0.8, top_p=0.8),
            Sampling(temperature=1.5, top_k=6, top_p=0.9),
        ],
        lambda s: s.top_k is not None and s.top_p is not None,
    ),
    ids=str,
)
def test_frequencies_match_the_restricted_softmax(sampling):
    counts = draws(sampling)
    for row, logits_V in enumerate(LOGITS_BV):
        p = expected(logits_V, sampling)
        assert not counts[row][p == 0].any(), (counts[row], p)  # nothing outside the set
        stat, df = chi2_statistic(counts[row], p)
        assert df >= 1 and stat < chi2_critical(df), (row, stat, df, counts[row], p)
        # The test has power: the same draws reject the untempered, unrestricted softmax.
        wrong = np.exp(logits_V - logits_V.max())
        wrong = np.where(p > 0, wrong, 0) / np.where(p > 0, wrong, 0).sum()
        if not np.allclose(wrong, p, atol=1e-3):
            assert chi2_statistic(counts[row], wrong)[0] > chi2_critical(df)


@pytest.mark.parametrize(
    "sampling", [Sampling(temperature=0.9, top_k=1), Sampling(temperature=1.5, top_p=1e-6)], ids=str
)
def test_top_k_1_and_tiny_top_p_are_greedy_in_select(sampling):
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(32, 50)).astype(np.float32))
    greedy = np.asarray(select(logits, jax.random.key(0), Sampling()))
    for seed in range(5):
        np.testing.assert_array_equal(
            np.asarray(select(logits, jax.random.key(seed), sampling)), greedy
        )


@pytest.fixture(scope="module")
def eng():
    return engine("tiny-dense", ParallelConfig(tp=2), max_batch=8, max_seq_len=32)


# Through the engine (tp=2): the fast tier checks ``select`` above, and samples through the
# engine in tests/test_engine_inputs.py and others.
@pytest.mark.sweep
@pytest.mark.parametrize(
    "sampling", [Sampling(temperature=0.9, top_k=1), Sampling(temperature=1.5, top_p=1e-6)], ids=str
)
def test_top_k_1_and_tiny_top_p_generate_the_greedy_tokens(eng, sampling):
    greedy = eng.generate(PROMPTS, 8).tokens
    assert eng.generate(PROMPTS, 8, sampling=sampling, seed=11).tokens == greedy


# --- vocab-parallel: sharded thresholds and draws equal the sort-based definition --------

VOCAB = 4096  # wide enough that 64 candidates per shard are far fewer than V


def _reference(logits_BV, rows, keys_B):
    """The sort-based definition (numpy): temperature, top-k (ties at the k-th kept),
    top-p over the sorted top-k mass, then argmax of kept logits + the row's Gumbel noise."""
    out = []
    for b, logits_V in enumerate(np.asarray(logits_BV, np.float32)):
        t = float(rows.temperature_B[b])
        if t == 0:
            out.append(int(np.argmax(logits_V)))
            continue
        z = (logits_V / np.float32(t)).astype(np.float32)
        s = -np.sort(-z)
        k = int(rows.top_k_B[b]) or z.size
        kth = s[min(k, z.size) - 1]
        z = np.where(z < kth, -np.inf, z)
        s = np.where(s < kth, -np.inf, s)
        p = float(rows.top_p_B[b])
        if p < 1:
            e = np.exp((s - s[0]).astype(np.float64))
            probs = e / e.sum()
            before = np.cumsum(probs) - probs
            cutoff = s[before < p].min()
            z = np.where(z < cutoff, -np.inf, z)
        noise = np.asarray(jax.random.gumbel(keys_B[b], (z.size,)))
        out.append(int(np.argmax(z + noise)))
    return np.array(out)


def _row_keys(rows, step_B):
    def key(data, step, row):
        return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(data), step), row)

    return jax.vmap(key)(jnp.asarray(rows.key_B), jnp.asarray(step_B), jnp.asarray(rows.row_B))


VOCAB_PARALLEL_ROWS = [
    Sampling(temperature=0.7),  # pure temperature: Gumbel-max per shard, no threshold
    Sampling(temperature=1.3, top_k=4),
    Sampling(temperature=0.8, top_p=0.9),
    Sampling(temperature=1.5, top_k=200, top_p=0.95),  # k > candidates: radix select
    Sampling(temperature=2.0, top_p=0.99),  # a nucleus wider than the candidates
    Sampling(temperature=1.0, top_k=1000),
    Sampling(),  # greedy
    Sampling(temperature=0.5, top_k=64, top_p=0.5),
]


@pytest.mark.parametrize("shards", sweep([1, 2, 4, 8], lambda n: n == 4))
def test_vocab_parallel_draws_equal_the_sort_based_definition(shards):
    """Every row's token, over 1-8 vocab shards, equals the numpy sort-based draw with the
    same noise (top-k beyond the candidates and wide nuclei included; -inf ids never)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from jaxpar.engine._sampling import RowSampling, select_rows
    from jaxpar.engine._vocab import VocabSplit

    rng = np.random.default_rng(0)
    b = len(VOCAB_PARALLEL_ROWS)
    logits = (rng.normal(size=(b, VOCAB)) * 3).astype(np.float32)
    logits[1, :100] = -np.inf  # a grammar's or padding's masked ids
    mesh = jax.make_mesh(
        (shards,), ("tp",), devices=jax.devices()[:shards], axis_types=(AxisType.Auto,)
    )
    layout = NamedSharding(mesh, PartitionSpec(None, "tp"))
    split = VocabSplit.of(layout)
    assert split.shards == shards
    draw = jax.jit(
        lambda lg, r, s: select_rows(lg, r, s, split=split), in_shardings=(layout, None, None)
    )
    placed = jax.device_put(logits, layout)
    for seed in range(3):
        rows = RowSampling.rows(VOCAB_PARALLEL_ROWS, [seed * 10 + i for i in range(b)])
        rows = rows.replace(row_B=np.arange(b, dtype=np.int32))
        step_B = np.arange(b, dtype=np.int32) * 3 + seed
        got = np.asarray(draw(placed, rows, step_B))
        want = _reference(logits, rows, _row_keys(rows, step_B))
        np.testing.assert_array_equal(got, want)
        assert got[1] >= 100
