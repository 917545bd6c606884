"""Independent oracles for the sampler's shared primitives: penalties, grammar masks with
temperature / top-k / top-p, logprobs, and a preempted request's sampling step.

"Served equals offline" compares one implementation with itself: ``generate`` runs on the
serving core, so a bug in what both share passes every such test. Here each primitive is
checked against a NumPy reference written from the definitions HF and vLLM use, not from
the engine's code:

* **penalties** (vLLM's order, before temperature and the filters): the repetition
  penalty (CTRL's) divides a positive logit by ``r`` and multiplies a negative one by it,
  for every token of the prompt *or* generated so far; ``frequency * count`` and
  ``presence * (count > 0)`` are subtracted for generated tokens only (OpenAI's). The
  prompts here hold the unpenalised argmax, so a repetition penalty that forgets the
  prompt (or a presence penalty that counts it) picks another token;
* **grammar masks** (vLLM and llguidance mask the logits before sampling, and
  :func:`~jaxpar.engine._sampling.select_rows` documents the same): the draw's
  distribution is ``softmax(z / T)`` over *allowed* ∩ *top-k* ∩ *nucleus*, with top-k and
  the nucleus taken of the masked distribution. One row's unmasked top-k holds no allowed
  token: masking after the filters, or a fallback when they keep nothing allowed, changes
  that row's distribution;
* **logprobs** are ``log_softmax`` of the raw logits (before penalties, temperature and
  the filters: vLLM's default, and what :mod:`jaxpar.engine._logprobs` documents);
* **preemption**: a seeded request preempted after it drew several tokens resumes at its
  own sampling step, so its tokens are those of a run that was never preempted.

Frequencies are checked with Pearson's chi-square at ``ALPHA`` (critical values from
``tests.test_sampling.chi2_critical``, which checks itself against textbook values), with
fixed seeds, so every run draws the same tokens; each test also shows that the same
counts reject the distribution a broken sampler would draw from (the test has power).
The draws run at two levels: ``select_rows`` with the :class:`History` the serving core
builds (many thousands of draws), and ``InferenceEngine.generate`` (the serving core: a
prefill's first-token draw for ``max_batch`` copies of one prompt per seed).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import ParallelConfig
from jaxpar.engine import (
    Constraint,
    ContinuousBatcher,
    KVBudget,
    RowSampling,
    Sampling,
    engine_from_hf,
)
from jaxpar.engine._grammar import all_allowed
from jaxpar.engine._penalties import History
from jaxpar.engine._sampling import select_rows
from jaxpar.spec import make_mesh
from tests.test_batching import CONFIG, _engine
from tests.test_sampling import chi2_critical

ALPHA = 1e-4  # false-alarm rate of each chi-square test (the seeds are fixed anyway)
TOL = 1e-5  # logprobs (f32)
CHECKPOINT = Path(__file__).parent / "fixtures" / "llama_bytes"


# --- the NumPy references -------------------------------------------------------------------


def penalized(logits_V, s: Sampling, prompt=(), generated=()) -> np.ndarray:
    """The logits (float64) after ``s``'s penalties: repetition over the prompt and the
    generated tokens, then frequency and presence over the generated tokens."""
    z = np.asarray(logits_V, np.float64)
    counts = np.bincount(np.asarray(generated, np.int64), minlength=z.size)
    seen = (counts > 0) | np.isin(np.arange(z.size), prompt)
    r = s.repetition_penalty
    z = np.where(seen, np.where(z > 0, z / r, z * r), z)
    return z - s.frequency_penalty * counts - s.presence_penalty * (counts > 0)


def probabilities(logits_V, s: Sampling, prompt=(), generated=(), allowed_V=None) -> np.ndarray:
    """The distribution a sampled draw follows: penalties, then the grammar's mask, then
    ``softmax(z / T)`` restricted to the top-k and then to the nucleus (the smallest set
    of most likely tokens whose mass reaches ``top_p``: a token stays when the mass of
    those more likely is below it), renormalised."""
    z = penalized(logits_V, s, prompt, generated)
    if allowed_V is not None:
        z = np.where(allowed_V, z, -np.inf)
    z = z / s.temperature
    order = np.argsort(-z, kind="stable")
    keep = np.isfinite(z)
    if s.top_k:
        keep &= np.isin(np.arange(z.size), order[: s.top_k])
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if s.top_p is not None:
        before = np.cumsum(p[order]) - p[order]
        p = np.where(np.isin(np.arange(z.size), order[before < s.top_p]), p, 0.0)
        p /= p.sum()
    return p


def log_softmax(logits_xV) -> np.ndarray:
    x = np.asarray(logits_xV, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def margins_ok(logits_V, s: Sampling, prompt=(), generated=(), allowed_V=None) -> bool:
    """No near-tie decides the reference's top-k or nucleus: the k-th and (k+1)-th
    processed logits are apart, and no cumulative mass lies within 1e-3 of ``top_p``."""
    z = penalized(logits_V, s, prompt, generated)
    if allowed_V is not None:
        z = np.where(allowed_V, z, -np.inf)
    z = np.sort(z / s.temperature)[::-1]
    finite = z[np.isfinite(z)]
    if s.top_k and s.top_k < finite.size and finite[s.top_k - 1] - finite[s.top_k] < 1e-2:
        return False
    if s.top_p is not None:
        p = np.exp(finite[: s.top_k or None] - finite[0])
        mass = np.cumsum(p / p.sum())
        return bool(np.abs(mass - s.top_p).min() > 1e-3)
    return True


def chi2(counts: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the tokens with ``p > 0``, and its degrees of freedom;
    every expected count must be at least 5 for the chi-square approximation."""
    support = p > 0
    n = counts.sum()
    expected = n * p[support]
    assert expected.min() >= 5, f"too few draws for chi-square: expected counts {expected}"
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def check_frequencies(counts: np.ndarray, p: np.ndarray, wrong: list[np.ndarray]) -> None:
    """``counts`` follow ``p`` (nothing drawn outside its support, chi-square below the
    critical value) and reject each distribution of ``wrong`` (the test has power)."""
    outside = counts[p == 0]
    assert not outside.any(), f"drawn outside the support: {np.nonzero(counts * (p == 0))[0]}"
    stat, df = chi2(counts, p)
    assert df >= 1 and stat < chi2_critical(df, ALPHA), (stat, df, counts, p.round(4))
    for q in wrong:
        assert not np.allclose(q, p, atol=1e-3), "the wrong distribution is the right one"
        if counts[q == 0].any():
            continue  # it could not have drawn these counts at all
        support = q > 0
        n = counts.sum()
        stat = float(((counts[support] - n * q[support]) ** 2 / (n * q[support])).sum())
        assert stat > chi2_critical(int(support.sum()) - 1, ALPHA), (stat, q.round(4))


def bits(mask_W: np.ndarray, vocab: int) -> np.ndarray:
    """A packed mask row as bool [vocab] (bit ``v % 32`` of word ``v // 32``)."""
    return np.unpackbits(mask_W.astype("<i4").view(np.uint8), bitorder="little")[:vocab] == 1


def packed(allowed_BV: np.ndarray) -> np.ndarray:
    """bool [B, V] as llguidance's packed int32 [B, ceil(V / 32)] (the inverse of bits)."""
    b, v = allowed_BV.shape
    padded = np.zeros((b, -(-v // 32) * 32), bool)
    padded[:, :v] = allowed_BV
    return np.packbits(padded, axis=-1, bitorder="little").view("<i4").astype(np.int32)


def test_the_references_against_hand_computed_cases():
    """The references themselves, on cases small enough to work out by hand."""
    s = Sampling(temperature=1.0, repetition_penalty=2.0, frequency_penalty=0.5)
    z = penalized([2.0, -1.0, 1.0, 0.5], s, prompt=[0, 1], generated=[2, 2])
    np.testing.assert_allclose(z, [1.0, -2.0, 1.0 / 2 - 2 * 0.5, 0.5])
    p = probabilities([3.0, 2.0, 1.0, 0.0], Sampling(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [np.e / (np.e + 1), 1 / (np.e + 1), 0, 0])
    # softmax([3, 2, 1, 0]) = [.644, .237, .087, .032]: the nucleus of 0.7 is two tokens.
    p = probabilities([3.0, 2.0, 1.0, 0.0], Sampling(temperature=1.0, top_p=0.7))
    np.testing.assert_allclose(p, [np.e / (np.e + 1), 1 / (np.e + 1), 0, 0])
    # The mask first: top-1 of the allowed tokens, not of all of them.
    allowed = np.array([False, False, True, True])
    p = probabilities([3.0, 2.0, 1.0, 0.0], Sampling(temperature=1.0, top_k=1), allowed_V=allowed)
    np.testing.assert_allclose(p, [0, 0, 1, 0])
    mask = packed(np.array([[True, False] * 20]))
    assert bits(mask[0], 40).tolist() == [True, False] * 20


# --- select_rows with the serving core's History: many draws -----------------------------

V = 24
N_DRAWS = 20_000  # per row: steps 0..N-1 of one seed


@dataclasses.dataclass(frozen=True)
class Case:
    """One row: its sampling, the prompt and generated tokens its penalties see, and the
    tokens its grammar allows (None: all)."""

    name: str
    sampling: Sampling
    prompt: tuple[int, ...] = ()
    generated: tuple[int, ...] = ()
    allowed: tuple[int, ...] | None = None

    def allowed_V(self):
        return None if self.allowed is None else np.isin(np.arange(V), self.allowed)

    def p(self, logits_V, **change) -> np.ndarray:
        case = dataclasses.replace(self, **change)
        return probabilities(logits_V, case.sampling, case.prompt, case.generated, case.allowed_V())


@functools.cache
def row_logits() -> np.ndarray:
    """[V] logits spread from -3 to 3 in a fixed shuffled order: no ties."""
    return np.random.default_rng(5).permutation(np.linspace(-3.0, 3.0, V)).astype(np.float32)


def ranked(i: int) -> int:
    """The token with the ``i``-th largest logit (0: the argmax)."""
    return int(np.argsort(-row_logits())[i])


def _cases() -> list[Case]:
    top = [ranked(i) for i in range(V)]
    return [
        # The prompt holds the argmax: the repetition penalty must push it down.
        Case(
            "repetition-prompt-argmax",
            Sampling(temperature=1.0, top_k=8, repetition_penalty=2.5),
            prompt=(top[0], top[5], top[20]),
            generated=(top[3],),
        ),
        # Frequency and presence see generated tokens only; the prompt's argmax is untouched.
        Case(
            "frequency-presence",
            Sampling(temperature=0.8, top_k=6, frequency_penalty=0.7, presence_penalty=0.5),
            prompt=(top[0], top[4]),
            generated=(top[1], top[1], top[2]),
        ),
        # The unmasked top-3 holds no allowed token.
        Case(
            "mask-top-k-disjoint",
            Sampling(temperature=1.2, top_k=3),
            allowed=tuple(top[8:20]),
        ),
        Case(
            "mask-top-p",
            Sampling(temperature=0.9, top_p=0.75),
            allowed=tuple(top[1:12:2]) + tuple(top[14:18]),
        ),
        Case(
            "mask-top-k-top-p-penalties",
            Sampling(
                temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.8, presence_penalty=0.4
            ),
            prompt=(top[2], top[9]),
            generated=(top[3],),
            allowed=tuple(top[2:16]),
        ),
        Case(
            "mask-temperature",
            Sampling(temperature=1.5),
            allowed=tuple(top[3:9]),
        ),
    ]


def _wrong(case: Case, logits_V: np.ndarray) -> list[np.ndarray]:
    """What a sampler with one of the bugs the issue names would draw from, for ``case``:
    the prompt left out of the repetition penalty; frequency/presence counting the
    prompt; the mask ignored; top-k / top-p taken of the unmasked distribution and then
    masked (with a fallback to every allowed token when they keep none)."""
    s, wrong = case.sampling, []
    if case.allowed is not None:
        wrong.append(case.p(logits_V, allowed=None))
    if s.repetition_penalty != 1.0 and case.prompt:
        wrong.append(case.p(logits_V, prompt=()))
    if (s.frequency_penalty or s.presence_penalty) and case.prompt:
        wrong.append(case.p(logits_V, generated=case.generated + case.prompt))
    if case.allowed is not None and (s.top_k or s.top_p is not None):
        unmasked = case.p(logits_V, allowed=None) > 0
        kept = unmasked & case.allowed_V()
        if kept.any():
            z = penalized(logits_V, s, case.prompt, case.generated) / s.temperature
            q = np.where(kept, np.exp(z - z.max()), 0)
            wrong.append(q / q.sum())
        unfiltered = dataclasses.replace(s, top_k=None, top_p=None)
        wrong.append(dataclasses.replace(case, sampling=unfiltered).p(logits_V))
    return wrong


@functools.cache
def _select_rows_counts() -> np.ndarray:
    """Token counts [cases, V] of ``select_rows`` over N_DRAWS steps, each row's
    penalties from the History the serving core builds (prompt, then drawn tokens)."""
    cases = _cases()
    b = len(cases)
    logits_BV = jnp.asarray(np.tile(row_logits(), (b, 1)))
    rows = RowSampling.rows([c.sampling for c in cases], seeds=[100 + i for i in range(b)])
    history = History.rows(
        [(c.prompt, c.generated) for c in cases], [c.sampling.penalized for c in cases], b, 16
    )
    allowed = np.stack([c.allowed_V() if c.allowed else np.ones(V, bool) for c in cases])
    mask_BW = jnp.asarray(packed(allowed))

    @jax.jit
    def draw(steps_N):
        seen = history.seen(V)
        return jax.vmap(
            lambda step: select_rows(logits_BV, rows, jnp.full(b, step), seen, mask_BW)
        )(steps_N)

    tokens_NB = np.asarray(draw(jnp.arange(N_DRAWS, dtype=jnp.int32)))
    return np.stack([np.bincount(tokens_NB[:, i], minlength=V) for i in range(b)])


@pytest.mark.parametrize("index", range(len(_cases())), ids=[c.name for c in _cases()])
def test_select_rows_frequencies_match_the_reference(index):
    case = _cases()[index]
    logits_V = row_logits()
    assert margins_ok(logits_V, case.sampling, case.prompt, case.generated, case.allowed_V())
    p = case.p(logits_V)
    if case.name == "mask-top-k-disjoint":
        unmasked_top = np.argsort(-logits_V)[: case.sampling.top_k]
        assert not np.isin(unmasked_top, case.allowed).any()
    if case.prompt and case.sampling.repetition_penalty != 1.0:
        assert ranked(0) in case.prompt or ranked(2) in case.prompt
    check_frequencies(_select_rows_counts()[index], p, _wrong(case, logits_V))


# --- the serving core: generate's first-token draws -----------------------------------------

SERVED_ROWS, SERVED_SEEDS = 32, 32  # 1,024 draws per case


#: Every batcher here: 6 pages of 4 tokens (tight enough to preempt), two prompts per
#: prefill; one shape for all, so their programs compile once.
PAGE = 4
BUDGET = KVBudget(page_size=PAGE, tokens=24)


@functools.cache
def tiny_engine():
    """tiny-gqa on one device, 32 rows: a seed draws 32 first tokens of one prompt."""
    return _engine(ParallelConfig(), max_batch=SERVED_ROWS)


def last_logits(engine, prompt) -> np.ndarray:
    tokens_BT, lengths_B = engine.pad_prompts([prompt])
    return np.asarray(engine.prefill_logits(tokens_BT, lengths_B))[0, len(prompt) - 1]


@functools.cache
def prompt_holding_its_argmax(engine=None) -> tuple[int, ...]:
    """A prompt whose next-token argmax is one of its own tokens (found by search over
    seeded prompts, each with the argmax of a shorter one prepended)."""
    engine = engine or tiny_engine()
    rng = np.random.default_rng(0)
    for _ in range(64):
        tail = rng.integers(1, CONFIG.vocab_size, 6).tolist()
        prompt = [int(np.argmax(last_logits(engine, tail))), *tail]
        if int(np.argmax(last_logits(engine, prompt))) in prompt:
            return tuple(prompt)
    raise AssertionError("no prompt found that holds its own next-token argmax")


def served_counts(engine, prompt, sampling: Sampling, grammar=None) -> np.ndarray:
    """First-token counts [V] of ``generate`` over SERVED_SEEDS seeds x max_batch rows."""
    counts = np.zeros(engine.steps.vocab_size, np.int64)
    rows = [list(prompt)] * engine.max_batch
    for seed in range(SERVED_SEEDS):
        out = engine.generate(
            rows, 1, sampling=sampling, seed=seed, stop_tokens=(), grammar=grammar
        )
        counts += np.bincount([t[0] for t in out.tokens], minlength=counts.size)
    return counts


def test_served_repetition_penalty_frequencies_count_the_prompt():
    """Sampled first tokens through the serving core: the prompt holds the argmax, which
    the repetition penalty must push down; left unpenalised it would be drawn far more."""
    engine = tiny_engine()
    prompt = prompt_holding_its_argmax()
    logits_V = last_logits(engine, prompt)
    # The first top-k from 6 whose boundary is no near-tie (a fixed model: always the same).
    s = next(
        s
        for k in (6, 5, 7, 4, 8)
        if margins_ok(
            logits_V, s := Sampling(temperature=1.0, top_k=k, repetition_penalty=2.0), prompt
        )
    )
    p = probabilities(logits_V, s, prompt)
    wrong = probabilities(logits_V, s)  # the penalty blind to the prompt
    assert p[np.argmax(logits_V)] < wrong[np.argmax(logits_V)]
    check_frequencies(served_counts(engine, prompt, s), p, [wrong])


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(repetition_penalty=3.0),
        Sampling(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5),
        Sampling(presence_penalty=2.0, frequency_penalty=2.0),  # the prompt is not counted
    ],
    ids=str,
)
def test_served_greedy_penalties_equal_the_reference_step_by_step(sampling):
    """Greedy with penalties, through ``generate`` and a ContinuousBatcher: each token is
    the argmax of the NumPy-penalised logits of a full prefill of the tokens so far."""
    engine = tiny_engine()
    prompt = list(prompt_holding_its_argmax())
    want: list[int] = []
    for _ in range(6):
        want.append(
            int(np.argmax(penalized(last_logits(engine, prompt + want), sampling, prompt, want)))
        )
    argmax = int(np.argmax(last_logits(engine, prompt)))
    # The repetition penalty moves the first token off the prompt's argmax; presence and
    # frequency alone do not (they count generated tokens only).
    assert (want[0] != argmax) == (sampling.repetition_penalty != 1.0)
    got = engine.generate([prompt], 6, sampling=sampling, stop_tokens=()).tokens[0]
    assert got == want
    with ContinuousBatcher(engine, prefill_batch=2, kv_budget=BUDGET) as batcher:
        assert batcher.submit(prompt, max_tokens=6, sampling=sampling).result(120) == want


# --- grammar masks through the serving core -----------------------------------------------


@functools.cache
def bytes_engine():
    """The byte-level Llama fixture (its tokenizer spells text for a grammar), 32 rows."""
    parallel = ParallelConfig()
    mesh = make_mesh(parallel, jax.devices()[:1])
    return engine_from_hf(CHECKPOINT, parallel, max_batch=SERVED_ROWS, max_seq_len=32, mesh=mesh)


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=1.0, top_k=4),
        Sampling(temperature=1.3, top_k=6, top_p=0.8, repetition_penalty=1.5),
    ],
    ids=str,
)
def test_served_grammar_mask_comes_before_top_k_and_top_p(sampling):
    """A capitalised word after ``"n = "``: no token of the unmasked top-8 is allowed, so
    the draw must follow softmax(z / T) over the allowed tokens' own top-k and nucleus."""
    engine = bytes_engine()
    prompt = list(engine.tokenizer.encode("n = "))
    grammar = engine.grammar(Constraint.regex("[A-Z][a-z]*"))
    vocab = engine.steps.vocab_size
    mask = all_allowed(1, vocab)
    grammar.matcher().fill(mask[0])
    allowed_V = bits(mask[0], vocab)
    logits_V = last_logits(engine, prompt)
    assert not allowed_V[np.argsort(-logits_V)[:8]].any()  # the case the issue names
    assert margins_ok(logits_V, sampling, prompt, (), allowed_V)
    p = probabilities(logits_V, sampling, prompt, (), allowed_V)
    unfiltered = dataclasses.replace(sampling, top_k=None, top_p=None)
    wrong = [probabilities(logits_V, unfiltered, prompt, (), allowed_V)]  # a legal fallback
    check_frequencies(served_counts(engine, prompt, sampling, grammar), p, wrong)


# --- logprobs --------------------------------------------------------------------------------


def teacher_forced_log_softmax(engine, prompt, tokens) -> np.ndarray:
    """log_softmax of the raw logits at each position that drew one of ``tokens``: [n, V]."""
    ids = [*prompt, *tokens]
    tokens_BT, lengths_B = engine.pad_prompts([ids])
    logits = np.asarray(engine.prefill_logits(tokens_BT, lengths_B))[0, : len(ids)]
    return log_softmax(logits[len(prompt) - 1 : len(ids) - 1])


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(),
        Sampling(temperature=0.6, top_k=5),
        Sampling(temperature=1.4, top_p=0.8, repetition_penalty=2.0, frequency_penalty=1.0),
    ],
    ids=str,
)
def test_served_logprobs_are_the_raw_log_softmax(sampling):
    """Each served token's logprob and its 5 most likely alternatives are log_softmax of
    the model's raw logits (teacher-forced), whatever temperature and penalties did to
    the draw; the processed distribution's logprobs differ (the check has power)."""
    engine = tiny_engine()
    prompt = list(prompt_holding_its_argmax())
    with ContinuousBatcher(engine, prefill_batch=2, kv_budget=BUDGET) as batcher:
        stream = batcher.submit(prompt, max_tokens=6, sampling=sampling, seed=4, logprobs=5)
        tokens = stream.result(120)
    lp_NV = teacher_forced_log_softmax(engine, prompt, tokens)
    entries = stream.logprobs
    assert [e.token for e in entries] == tokens
    for i, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
        assert entry.logprob == pytest.approx(lp_NV[i, token], abs=TOL)
        top_ids = [t for t, _ in entry.top]
        assert top_ids == np.argsort(-lp_NV[i], kind="stable")[:5].tolist()
        np.testing.assert_allclose([lp for _, lp in entry.top], lp_NV[i, top_ids], atol=TOL)
    if sampling.penalized or not sampling.greedy:
        logits = np.asarray(engine.prefill_logits(*engine.pad_prompts([prompt + tokens])))[
            0, len(prompt) - 1 : len(prompt) + len(tokens) - 1
        ]
        processed = [
            log_softmax(penalized(logits[i], sampling, prompt, tokens[:i]) / sampling.temperature)
            for i in range(len(tokens))
        ]
        gaps = [abs(processed[i][t] - lp_NV[i, t]) for i, t in enumerate(tokens)]
        assert max(gaps) > 10 * TOL


# --- preemption: a resumed request draws at its own step ------------------------------------


def test_preempted_sampled_request_resumes_at_its_own_step():
    """Two 8-token prompts on 6 pages of 4 tokens: both decode until they need a fourth
    page (each holds three after 4 decode steps), when the later-admitted one, sampled
    and seeded, is preempted, having drawn at least 5 tokens. It can come back only once
    the other (16 tokens, 4 pages) has finished. Its tokens must be those of the same
    request's unpreempted run (``generate``, the serving core with room to spare)."""
    engine = tiny_engine()
    rng = np.random.default_rng(12)
    first, second = (rng.integers(1, CONFIG.vocab_size, 8).tolist() for _ in range(2))
    sampled = Sampling(temperature=1.0)
    requests = [
        dict(prompt=first, max_tokens=8, sampling=Sampling(), seed=0),
        dict(prompt=second, max_tokens=10, sampling=sampled, seed=21),
    ]
    with ContinuousBatcher(engine, prefill_batch=2, kv_budget=BUDGET) as batcher:
        assert batcher.pool.pages_per_shard == BUDGET.tokens // PAGE + 1  # + the scratch page
        streams = [batcher.submit(**r) for r in requests]
        tight = [s.result(120) for s in streams]
        preemptions = batcher.stats.preemptions
    assert preemptions == 1
    # Drawn before it was preempted: the tokens that reached the host before the other
    # request (whose pages it needed back) had finished.
    before = sum(t < streams[0].token_times[-1] for t in streams[1].token_times)
    assert 2 <= before < len(tight[1]), (before, streams[1].token_times, streams[0].token_times)
    offline = engine.generate([second], 10, sampling=sampled, seed=21, stop_tokens=()).tokens[0]
    assert tight[1] == offline
    assert tight[0] == engine.generate([first], 8, stop_tokens=()).tokens[0]
    # The draw depends on the step: another seed draws other tokens (the check has power).
    assert (
        engine.generate([second], 10, sampling=sampled, seed=22, stop_tokens=()).tokens[0]
        != offline
    )
