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
* EP: every token is routed to top_k experts and back: the routed minimum is
  2 x L x top_k x b x t x D. jaxpar's dispatch is dense (GShard): a [G, E, C, D] buffer with
  dropless capacity C = t per group (a sequence) goes to the experts' devices and back, so
  the all-to-alls move 2 x L x b x E x t x D = E / top_k times the routed minimum. That is
  what the implementation must move, asserted exactly.
* EP + TP: the experts' down-projection is row-parallel over tp: one all-reduce per layer of
  the experts' slots on a device, (E / ep) x (B / dp) x t x D (after the all-to-all a device
  holds its experts' slots of every group of its dp shard).
"""

from __future__ import annotations

import collections
import functools

import pytest

from jaxpar.inspect import communication_model, compile_step, parse_collectives
from jaxpar.models import preset
from jaxpar.spec import ParallelConfig
from tests._engine_util import engine

F32 = 4
B, T = 8, 16

CASES = [
    ("tiny-dense", "tp=8"),
    ("tiny-dense", "sp=2,tp=4"),
    ("tiny-dense", "dp=4,tp=2"),
    ("tiny-dense", "dp=2,sp=2,tp=2"),
    ("tiny-moe", "ep=8"),
    ("tiny-moe", "ep=2,tp=4"),
    ("tiny-moe", "dp=2,ep=2,tp=2"),
]


def degrees(strategy: str) -> dict[str, int]:
    out = {"dp": 1, "sp": 1, "ep": 1, "tp": 1}
    out.update({k: int(v) for k, v in (part.split("=") for part in strategy.split(","))})
    return out


def minimum(name: str, strategy: str, phase: str) -> dict[str, int]:
    """Bytes per collective kind that one step must move, per device (see the module doc)."""
    c = preset(name)
    deg = degrees(strategy)
    dp, sp, ep, tp = deg["dp"], deg["sp"], deg["ep"], deg["tp"]
    prefill = phase == "prefill"
    L, D, E = c.n_layers, c.d_model, c.n_experts
    t = T if prefill else 1
    # Batch rows per device outside the experts: dp always; ep too (dense modules have no
    # experts to split); sp in decode (one token per sequence leaves nothing to split).
    b = B // (dp * ep * (1 if prefill else sp))
    t_local = t // sp if prefill else t
    out: collections.Counter[str] = collections.Counter()
    if tp > 1:
        row_parallel = 1 if E else 2  # attention out-proj (+ dense FFN down-proj)
        out["all-reduce"] += (row_parallel * L + 1) * b * t_local * D * F32
    if prefill and sp > 1:
        k_local = c.n_kv_heads // tp if c.n_kv_heads % tp == 0 else c.n_kv_heads
        out["all-gather"] += 2 * L * b * T * k_local * c.head_dim * F32
        out["all-reduce"] += b * D * F32
    if E and ep > 1:
        routed = 2 * L * c.top_k * b * t * D * F32
        dense_dispatch = 2 * L * b * E * t * D * F32
        assert dense_dispatch == routed * E // c.top_k
        out["all-to-all"] += dense_dispatch
    if E and tp > 1:
        out["all-reduce"] += L * (E // ep) * (B // dp) * t * D * F32
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
def _engine(name: str, strategy: str):
    return engine(name, ParallelConfig.parse(strategy), max_batch=B, max_seq_len=64)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize(("name", "strategy"), CASES, ids=lambda x: x)
def test_compiled_collectives_equal_the_first_principles_minimum(name, strategy, phase):
    want = minimum(name, strategy, phase)
    assert want and all(v > 0 for v in want.values())
    assert compiled_bytes(name, strategy, phase) == want


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize(("name", "strategy"), CASES, ids=lambda x: x)
def test_inspect_model_agrees_with_the_first_principles_minimum(name, strategy, phase):
    model = communication_model(
        preset(name), ParallelConfig.parse(strategy), phase, batch=B, prompt_len=T
    )
    assert model.total_bytes == sum(minimum(name, strategy, phase).values())
