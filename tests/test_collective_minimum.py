"""Collective bytes of the compiled prefill and decode steps against a minimum derived here,
from first principles, independently of ``jaxpar.spec`` (which builds the shardings) and of
``jaxpar.inspect``'s own communication model (which is checked against it too).

Bytes follow the parser's convention: the buffer each participating device holds (the reduced
tensor for all-reduce, the gathered result for all-gather, the local buffer for all-to-all),
per device, summed over one step (loops times their trip counts, so it does not matter whether
layers are scanned or stored one by one). f32 throughout: XLA:CPU runs bf16 collectives in f32.

Formulas, for batch B = 8 sequences, prompt T = 16 tokens (prefill) or 1 (decode), L layers,
width D, and the batch rows b and tokens t one device holds:

* TP (row-parallel layers): the attention out-projection and the dense FFN down-projection
  each produce partial sums over the head / intermediate shards: 2 all-reduces of b x t x D
  per layer, plus 1 for the vocab-parallel embedding lookup (each shard holds the rows of its
  vocab range). An MoE layer has no dense FFN: 1 per layer (attention) plus the experts'.
* SP (prefill; tokens split over sp): causal attention needs the K and V of every earlier
  token, held by other shards: all-gather of K and of V, b x T x K_local x H_d per layer; the
  last prompt position lives on one shard: one all-reduce of b x D selects it.
  In decode sp carries batch rows and needs nothing.
* EP (the routed-token minimum): each of the n = b x t tokens a device holds goes to top_k
  experts and back: dispatch and combine each move top_k x n rows of D, of which
  (ep - 1) / ep leave the device. The parser counts an all-to-all's whole local buffer, so
  the minimum is written on that footing: 2 x L x top_k x n x D (the leaving fraction is
  the same for compiled and minimum, so the ratio is too).
* EP + TP: the experts' down-projection is row-parallel over tp, so their outputs are partial
  sums; the weighted combine of a token's experts is linear, so one all-reduce per layer of
  the combined n x D output suffices, as for a dense FFN (reducing the top_k x n routed rows
  would cost top_k times that).
* Capacity mode: one more all-reduce, of the step's int32 drop count, over the token shards.

Without a ragged all-to-all (XLA:CPU), jaxpar's dropless MoE sends each of its ep expert
peers a block of n x min(top_k, E / ep) rows (what one peer can receive at most): the
MoE all-to-alls move ep x min(top_k, E / ep) / top_k times the routed rows,
plus the E int32 row counts per layer; asserted exactly. With a capacity factor of 1.25 the
blocks hold ceil(1.25 x n x top_k / ep) rows, asserted within 1.3x of the routed minimum.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import jax
import pytest
from _pytest.mark.structures import ParameterSet

from jaxpar.engine import AbstractEngine
from jaxpar.inspect import communication_model, compile_step, parse_collectives
from jaxpar.models import ExecutionOptions, ModelRun, preset
from jaxpar.spec import ParallelConfig, make_mesh
from tests._tiers import sweep

F32 = 4
B, T = 8, 16

CASES = [
    ("tiny-dense", "tp=8"),
    ("tiny-dense", "sp=2,tp=4"),
    ("tiny-dense", "dp=4,tp=2"),
    # Version-sensitive (scripts/test.sh runs them on both JAX releases).
    ("tiny-dense", "dp=2,sp=2,tp=2"),
    ("tiny-moe", "ep=8"),
    ("tiny-moe", "ep=2,tp=4"),
    pytest.param("tiny-moe", "dp=2,ep=2,tp=2", marks=pytest.mark.jax_compat),
]


def degrees(strategy: str) -> dict[str, int]:
    out = {"dp": 1, "sp": 1, "ep": 1, "tp": 1}
    out.update({k: int(v) for k, v in (part.split("=") for part in strategy.split(","))})
    return out


def _local(strategy: str, phase: str, batch: int) -> tuple[int, int]:
    """(batch rows, tokens per row) one device holds outside the experts.

    Batch over dp always, over ep too (dense modules have no experts to split), over sp in
    decode (one token per sequence leaves nothing to split); tokens over sp in prefill.
    """
    deg = degrees(strategy)
    prefill = phase == "prefill"
    b = batch // (deg["dp"] * deg["ep"] * (1 if prefill else deg["sp"]))
    return b, (T // deg["sp"] if prefill else 1)


def minimum(
    name: str, strategy: str, phase: str, batch: int = B, capacity: bool = False
) -> dict[str, int]:
    """Bytes per collective kind that one step must move, per device (see the module doc)."""
    c = preset(name)
    deg = degrees(strategy)
    dp, sp, ep, tp = deg["dp"], deg["sp"], deg["ep"], deg["tp"]
    L, D, E = c.n_layers, c.d_model, c.n_experts
    b, t_local = _local(strategy, phase, batch)
    out: collections.Counter[str] = collections.Counter()
    if tp > 1:
        row_parallel = 1 if E else 2  # attention out-proj (+ dense FFN down-proj)
        out["all-reduce"] += (row_parallel * L + 1) * b * t_local * D * F32
    if phase == "prefill" and sp > 1:
        k_local = c.n_kv_heads // tp if c.n_kv_heads % tp == 0 else c.n_kv_heads
        out["all-gather"] += 2 * L * b * T * k_local * c.head_dim * F32
        out["all-reduce"] += b * D * F32
    routed = c.moe.top_k * b * t_local  # rows one device sends to the experts
    if E and ep > 1:
        out["all-to-all"] += 2 * L * routed * D * F32
    if E and tp > 1:
        out["all-reduce"] += L * b * t_local * D * F32
    if E and capacity and dp * sp * ep > 1:
        out["all-reduce"] += 4  # the step's drop count (int32), summed over token shards
    return dict(out)


def padded_dropless_excess(name: str, strategy: str, phase: str) -> dict[str, int]:
    """What the dropless padded dispatch moves beyond the routed minimum (module doc)."""
    c = preset(name)
    ep, L, D = degrees(strategy)["ep"], c.n_layers, c.d_model
    b, t_local = _local(strategy, phase, B)
    n = b * t_local
    rows = ep * n * min(c.moe.top_k, c.n_experts // ep)  # sent and received per device
    excess = (rows - c.moe.top_k * n) * D * F32
    out: collections.Counter[str] = collections.Counter()
    if ep > 1:
        out["all-to-all"] += 2 * L * excess + L * ep * (c.n_experts // ep + 1) * 4  # + counts
    return dict(out)


@functools.cache
def compiled_bytes(name: str, strategy: str, phase: str) -> dict[str, int]:
    eng = _engine(name, strategy)
    out: collections.Counter[str] = collections.Counter()
    for x in parse_collectives(compile_step(eng, phase, prompt_len=T)):
        assert x.trip_count is not None, x
        out[x.kind] += x.bytes * x.trip_count
    return dict(out)


@functools.cache
def _engine(name: str, strategy: str) -> AbstractEngine:
    """Compiled only: the engine's steps over abstract parameters (nothing placed)."""
    parallel = ParallelConfig.parse(strategy)
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.size])
    return AbstractEngine.build(preset(name), parallel, max_batch=B, max_seq_len=64, mesh=mesh)


def _with_phases(cases: list) -> list:
    """Each case once per phase, ``(name, strategy, phase)``, its marks kept."""
    out = []
    for case in cases:
        for phase in ("prefill", "decode"):
            if isinstance(case, ParameterSet):
                out.append(pytest.param(*case.values, phase, marks=case.marks))
            else:
                out.append((*case, phase))
    return out


# The fast tier compiles dp, sp and tp together in prefill, where sp gathers K/V (the
# analytic model below checks every case in both tiers; the capacity test below compiles
# experts split beside dp and tp).
FAST = {("tiny-dense", "dp=2,sp=2,tp=2", "prefill")}


@pytest.mark.parametrize(
    ("name", "strategy", "phase"), sweep(_with_phases(CASES), FAST.__contains__), ids=lambda x: x
)
def test_compiled_collectives_equal_the_first_principles_minimum(name, strategy, phase):
    want = minimum(name, strategy, phase)
    assert want and all(v > 0 for v in want.values())
    if preset(name).n_experts:  # the dropless padded dispatch: its named excess, exactly
        extra = padded_dropless_excess(name, strategy, phase)
        want = {k: v + extra.get(k, 0) for k, v in want.items()}
    assert compiled_bytes(name, strategy, phase) == want


# Capacity mode, batch 64: in decode a device then holds 8 or 16 tokens, so its
# ceil(1.25 x n x top_k / ep) rows per peer round up by little (at batch 8, 2 tokens per
# device on ep=4 round 1.25 rows up to 2: 2x; see the README).
CAPACITY_BATCH = 64
CAPACITY_CASES = ["ep=4,tp=2", "dp=2,ep=2,tp=2", "sp=2,ep=4"]


@functools.cache
def capacity_bytes(strategy: str, phase: str) -> dict[str, int]:
    config = ModelRun(preset("tiny-moe"), ExecutionOptions(moe_capacity_factor=1.25))
    parallel = ParallelConfig.parse(strategy)
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.size])
    eng = AbstractEngine.build(
        config, parallel, max_batch=CAPACITY_BATCH, max_seq_len=64, mesh=mesh
    )
    out: collections.Counter[str] = collections.Counter()
    for x in parse_collectives(compile_step(eng, phase, prompt_len=T)):
        out[x.kind] += x.bytes * x.trip_count
    return dict(out)


@pytest.mark.parametrize(
    ("strategy", "phase"),
    sweep(
        [(s, phase) for s in CAPACITY_CASES for phase in ("prefill", "decode")],
        lambda case: case == ("dp=2,ep=2,tp=2", "decode"),
    ),
)
def test_capacity_mode_is_within_1_3x_of_the_routed_minimum(strategy, phase):
    want = minimum("tiny-moe", strategy, phase, batch=CAPACITY_BATCH, capacity=True)
    got = capacity_bytes(strategy, phase)
    assert set(got) == set(want), (got, want)
    for kind, need in want.items():  # every kind, so no kind hides behind another
        assert need <= got[kind] <= 1.3 * need, (kind, got[kind], need)
    ratio = sum(got.values()) / sum(want.values())
    assert 1.0 < ratio <= 1.3
    # The routed rows alone: 2 all-to-alls of top_k x n rows per layer.
    b, t_local = _local(strategy, phase, CAPACITY_BATCH)
    n = b * t_local
    peers_rows = 4 * math.ceil(1.25 * n * 2 / 4)  # ep=4 peers (ep=2: same total rows)
    if degrees(strategy)["ep"] == 4:
        assert got["all-to-all"] == 2 * 4 * peers_rows * 64 * F32 + 4 * 4 * 3 * 4


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize(("name", "strategy"), CASES, ids=lambda x: x)
def test_inspect_model_agrees_with_the_first_principles_minimum(name, strategy, phase):
    model = communication_model(
        preset(name), ParallelConfig.parse(strategy), phase, batch=B, prompt_len=T
    )
    assert model.total_bytes == sum(minimum(name, strategy, phase).values())


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("strategy", CAPACITY_CASES)
def test_inspect_model_agrees_in_capacity_mode(strategy, phase):
    config = ModelRun(preset("tiny-moe"), ExecutionOptions(moe_capacity_factor=1.25))
    parallel = ParallelConfig.parse(strategy)
    model = communication_model(config, parallel, phase, batch=CAPACITY_BATCH, prompt_len=T)
    want = minimum("tiny-moe", strategy, phase, batch=CAPACITY_BATCH, capacity=True)
    assert model.total_bytes == sum(want.values())


# --- the serving programs (what ``jaxpar serve`` runs) ----------------------------------
#
# The paged decode step samples: the vocab-parallel sampler (jaxpar/engine/_filters.py)
# exchanges, per device holding b rows over S vocab shards, C = 64 threshold candidates and
# K = 20 logprob candidates (values and ids) per shard, each argmax's per-shard maxima
# (value and id, greedy and drawn), per-row sums (2 x 32 radix rounds, the top-p
# normaliser, log-softmax's max, sum, chosen logprob), the rows' tokens and logprobs
# replicated (B x (2K + 1)), [B] ints placing rows and 1-byte branch predicates: O(B x k),
# never B x V
# (a sort of the vocabulary gathers 2 x B x V). A 2048-id vocabulary keeps S x C well
# below V. The insert gathers the new rows' K/V over prefill's batch and sp axes.

WIDE_VOCAB = 2048
SERVE_CASES = [
    ("tiny-dense", "tp=2"),
    ("tiny-dense", "tp=4"),
    ("tiny-dense", "sp=2,tp=4"),
    ("tiny-dense", "dp=4,tp=2"),
    ("tiny-moe", "ep=2,tp=4"),
]


def sampler_bound(strategy: str, batch: int = B, vocab: int = WIDE_VOCAB) -> int:
    """The most the vocab-parallel sampler may exchange per device per step (see above)."""
    deg = degrees(strategy)
    shards = deg["tp"]
    b = batch // (deg["dp"] * deg["ep"] * deg["sp"])  # decode rows per device
    per = vocab // shards
    c, k = min(64, per), min(20, per)
    gathers = b * shards * (c + 2 * k + 4) * F32
    sums = b * (2 * 32 + 4) * F32
    results = batch * (2 * k + 1) * F32 if b < batch else 0
    placement = 2 * batch * F32 + 16  # [B] ints placing rows; 1-byte branch predicates
    return gathers + sums + results + placement


@functools.cache
def _wide_engine(name: str, strategy: str) -> AbstractEngine:
    config = dataclasses.replace(preset(name), vocab_size=WIDE_VOCAB)
    parallel = ParallelConfig.parse(strategy)
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.size])
    return AbstractEngine.build(config, parallel, max_batch=B, max_seq_len=64, mesh=mesh)


def _wide_minimum(name: str, strategy: str, phase: str) -> int:
    """:func:`minimum` (and the dropless padded excess) of the wide-vocabulary model: the
    vocabulary changes none of the layers' collectives."""
    want = minimum(name, strategy, phase)
    if preset(name).n_experts:
        extra = padded_dropless_excess(name, strategy, phase)
        want = {k: v + extra.get(k, 0) for k, v in want.items()}
    return sum(want.values())


@pytest.mark.parametrize(
    ("name", "strategy"),
    sweep(SERVE_CASES, lambda case: case == ("tiny-dense", "sp=2,tp=4")),
    ids=lambda x: x,
)
def test_served_decode_step_is_the_minimum_plus_an_o_b_k_sampling_exchange(name, strategy):
    eng = _wide_engine(name, strategy)
    collectives = parse_collectives(compile_step(eng, "serve_decode", prompt_len=T))
    got = sum(x.bytes * x.trip_count for x in collectives)
    need = _wide_minimum(name, strategy, "decode")
    assert need <= got <= need + sampler_bound(strategy), (got, need)
    # Nothing vocab-sized moves: each collective is well below one device's rows x V.
    rows = B // (degrees(strategy)["dp"] * degrees(strategy)["ep"] * degrees(strategy)["sp"])
    assert max(x.bytes for x in collectives) < rows * WIDE_VOCAB * F32 / 2
    # The inspect model states the same program: the minimum plus the sampler's items.
    model = communication_model(
        eng.run, eng.parallel_config, "decode", batch=B, prompt_len=T, program="serve_decode"
    )
    routed = sum(minimum(name, strategy, "decode").values())  # the model's, with no padding
    assert 0 < model.total_bytes - routed <= sampler_bound(strategy)


@pytest.mark.parametrize("strategy", sweep(["sp=2,tp=4", "dp=4,tp=2"], lambda s: s == "sp=2,tp=4"))
def test_served_prefill_programs_and_insert_against_the_minimum(strategy):
    eng = _wide_engine("tiny-dense", strategy)
    c, deg = preset("tiny-dense"), degrees(strategy)

    def kinds(program: str, **kw) -> dict[str, int]:
        out: collections.Counter[str] = collections.Counter()
        for x in parse_collectives(compile_step(eng, program, prompt_len=T, **kw)):
            out[x.kind] += x.bytes * x.trip_count
        return dict(out)

    assert kinds("serve_prefill") == minimum("tiny-dense", strategy, "prefill")
    # With T cached positions, the K/V gather over sp covers 2T tokens.
    with_context = kinds("serve_prefill_context", context_len=T)
    want = dict(minimum("tiny-dense", strategy, "prefill"))
    k_local = c.n_kv_heads // deg["tp"]
    if deg["sp"] > 1:
        want["all-gather"] = 2 * c.n_layers * B * 2 * T * k_local * c.head_dim * F32
    assert with_context["all-reduce"] == want["all-reduce"]
    # Measured beyond it under sp: each layer gathers (and all-to-alls) the int32
    # positions of the rows' context and new tokens for its mask, [B, 2T] per layer.
    positions = 2 * c.n_layers * B * 2 * T * 4 if deg["sp"] > 1 else 0
    extra = sum(with_context.values()) - sum(want.values())
    assert with_context.get("all-gather", 0) >= want.get("all-gather", 0)
    assert 0 <= extra <= positions, (with_context, want)
    # The handoff: every device gathers the new rows' K/V over prefill's batch and sp axes
    # (plus the rows' lengths and ids: a few hundred bytes).
    kv = 2 * c.n_layers * B * T * k_local * c.head_dim * F32
    assert kv <= sum(kinds("insert").values()) <= kv + 1024
