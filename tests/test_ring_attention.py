"""Ring attention in sp prefill (``ExecutionOptions.sp_attention``) against the gather path.

* The op: :func:`ring_prefill_attention` over a zigzag-ordered prompt equals the exact XLA
  prefill (f32, 1e-5) under sp=2 and sp=4 with tp, with windows (static and traced), soft
  caps, sinks and padding, and with its tiles cut small so the tiled loops run.
* The model: an engine with the ring gives transformers' logits (1e-4) and greedy tokens
  (the fixtures' oracle, which the one-device and gather paths meet in test_gemma.py) on
  Gemma 2 (sliding window and soft caps) under sp2.tp2 and dp2.sp2, with prompts of odd
  lengths padded; Gemma 3 (sliding and global layers with their own RoPE bases) under sp4.
* The collectives: the compiled ring prefill moves exactly the analytic minimum of
  ``jaxpar.inspect`` (collective-permutes, no all-gather); the planner counts the ring's
  permutes and its smaller activations.
"""

from __future__ import annotations

import collections
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.engine import AbstractEngine, engine_from_hf
from jaxpar.inspect import communication_model, compile_step, parse_collectives
from jaxpar.models import ExecutionOptions, ModelRun, preset
from jaxpar.models import _ring_attention as ring
from jaxpar.models._attention_ops import prefill_xla
from jaxpar.spec import Dims, ParallelConfig, make_mesh, sharding_context
from tests import _engine_util as util

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
B, N, K, H = 2, 4, 2, 8
RING = ExecutionOptions(sp_attention="ring")


def _dims() -> Dims:
    return Dims(
        vocab_size=32, d_model=N * H, n_layers=1, n_heads=N, n_kv_heads=K, head_dim=H, d_ff=32
    )


@pytest.mark.parametrize(
    "strategy, t, window, softcap, sinks",
    [("sp=2", 12, "traced", None, False), ("sp=4,tp=2", 16, 5, 3.0, True)],
)
def test_ring_op_equals_xla(monkeypatch, strategy, t, window, softcap, sinks):
    monkeypatch.setattr(ring, "Q_TILE", 2)  # the local queries and keys in several tiles
    monkeypatch.setattr(ring, "K_TILE", 2)
    config = ParallelConfig.parse(strategy)
    mesh = make_mesh(config, jax.devices()[: config.size])
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, t, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, t, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, t, K, H)), jnp.float32)
    lengths = jnp.asarray([t, t - 5], jnp.int32)  # the second row padded
    sinks_N = jnp.asarray(rng.standard_normal(N), jnp.float32) if sinks else None
    win = jnp.int32(6) if window == "traced" else window
    sp = config.sp
    order = jnp.asarray(ring.zigzag_positions(t, sp))

    def run(q, k, v):
        with sharding_context(mesh, "prefill", config, _dims()):
            zq, zk, zv = (x[:, order] for x in (q, k, v))
            out = ring.ring_prefill_attention(
                zq, zk, zv, lengths_B=lengths, window=win, softcap=softcap, sinks_N=sinks_N
            )
            return out[:, jnp.asarray(ring.zigzag_slots(t, sp))]

    out = np.asarray(jax.jit(run)(q, k, v))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))
    ref = np.asarray(prefill_xla(q, k, v, pos, lengths, 6 if window == "traced" else window,
                                 None, softcap, sinks_N))  # fmt: skip
    for b, n in enumerate(np.asarray(lengths)):  # padding queries are unspecified
        np.testing.assert_allclose(out[b, :n], ref[b, :n], atol=1e-5, rtol=0)


def test_zigzag_order_round_trips_and_balances():
    t, sp = 16, 4
    pos = ring.zigzag_positions(t, sp)
    assert sorted(pos.tolist()) == list(range(t))
    assert (pos[ring.zigzag_slots(t, sp)] == np.arange(t)).all()
    # Every device holds a head and a tail half-chunk: the same causal work each.
    work = [int(sum(p + 1 for p in pos[j * 4 : (j + 1) * 4])) for j in range(sp)]
    assert len(set(work)) == 1
    config = ParallelConfig(sp=sp)
    mesh = make_mesh(config, jax.devices()[:sp])
    x = jnp.arange(2 * t, dtype=jnp.int32).reshape(2, t)

    def there_and_back(x):
        with sharding_context(mesh, "prefill", config, _dims()):
            z = ring.to_zigzag(x, ("batch", "seq"))
            return z, ring.from_zigzag(z, ("batch", "seq"))

    z, back = jax.jit(there_and_back)(x)
    assert (np.asarray(z) == np.asarray(x)[:, pos]).all()
    assert (np.asarray(back) == np.asarray(x)).all()


@pytest.mark.parametrize(
    "fixture, strategy, decode",
    [("gemma2", "sp=2,tp=2", True), ("gemma2", "dp=2,sp=2", False), ("gemma3_text", "sp=4", True)],
)
def test_ring_engine_matches_transformers(fixture, strategy, decode):
    """Every position's logits (the all-logits program: hidden states back in the natural
    order) within 1e-4 of transformers'; with ``decode``, greedy tokens equal to its first
    4 (the last token picked at its zigzag slot; decode reads the K/V the ring prefill wrote
    to the cache in the natural order)."""
    ref, prompts = util.hf_reference(FIXTURES / fixture)
    assert any(len(p) % 2 for p in prompts)  # odd lengths, padded
    parallel = ParallelConfig.parse(strategy)
    mesh = make_mesh(parallel, jax.devices()[: parallel.size])
    eng = engine_from_hf(FIXTURES / fixture, parallel, max_batch=4, max_seq_len=32, mesh=mesh,
                         options=RING)  # fmt: skip
    tokens, lengths = eng.pad_prompts(prompts)
    logits = np.asarray(eng.prefill_logits(tokens, lengths))
    for i, prompt in enumerate(prompts):
        np.testing.assert_allclose(logits[i, : len(prompt)], ref[f"logits_{i}"], atol=1e-4,
                                   rtol=0, err_msg=f"row {i}")  # fmt: skip
    if decode:
        gen = eng.generate(prompts, 4, stop_tokens=())
        assert gen.tokens == [ref[f"greedy_{i}"][:4].tolist() for i in range(len(prompts))]
    # The program that ran is the ring's: its permutes are written out (shard_map), and no
    # K/V gather constraint is left for the partitioner.
    lowered = eng.steps.lower_prefill(eng.params, tokens, lengths, all_logits=True).as_text()
    assert "collective_permute" in lowered


def _compiled(name: str, strategy: str, t: int, options: ExecutionOptions) -> dict[str, int]:
    parallel = ParallelConfig.parse(strategy)
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.size])
    eng = AbstractEngine.build(
        preset(name), parallel, max_batch=8, max_seq_len=64, mesh=mesh, options=options
    )
    out: collections.Counter[str] = collections.Counter()
    for x in parse_collectives(compile_step(eng, "prefill", prompt_len=t)):
        out[x.kind] += x.bytes * x.trip_count
    return dict(out)


@pytest.mark.parametrize("strategy", ["sp=2,tp=4", "dp=2,sp=4"])
def test_ring_collectives_are_the_analytic_minimum(strategy):
    t = 16
    compiled = _compiled("tiny-gqa", strategy, t, RING)
    run = ModelRun.of(preset("tiny-gqa"), RING)
    model = communication_model(run, ParallelConfig.parse(strategy), "prefill", batch=8,
                                prompt_len=t)  # fmt: skip
    minimum: collections.Counter[str] = collections.Counter()
    for item in model.items:
        minimum[item.kind] += item.bytes
    assert compiled == dict(minimum)
    assert "all-gather" not in compiled
    # The default ("auto") gathers at this length: short prompts keep the all-gather.
    default = communication_model(preset("tiny-gqa"), ParallelConfig.parse(strategy),
                                  "prefill", batch=8, prompt_len=t)  # fmt: skip
    assert {i.kind for i in default.items} >= {"all-gather"}


def test_plan_counts_the_ring():
    from jaxpar.models import RING_MIN_TOKENS
    from jaxpar.plan import load_hardware
    from jaxpar.plan._cost import comm_costs
    from jaxpar.plan._memory import activation_bytes
    from jaxpar.spec import Phase

    config = preset("llama-1b")
    parallel = ParallelConfig(sp=4, tp=2)
    t = 4 * RING_MIN_TOKENS
    hw = load_hardware("tpu-v5e")
    gather = ModelRun.of(config, ExecutionOptions(sp_attention="gather"))
    steps = {c.item.step for c in comm_costs(config, parallel, Phase.PREFILL, hw, batch=1,
                                             prompt_len=t)}  # fmt: skip
    assert "K/V ring" in steps and "K/V gather" not in steps
    steps = {c.item.step for c in comm_costs(gather, parallel, Phase.PREFILL, hw, batch=1,
                                             prompt_len=t)}  # fmt: skip
    assert "K/V gather" in steps and "K/V ring" not in steps
    acts = {
        mode: activation_bytes(
            ModelRun.of(config, ExecutionOptions(sp_attention=mode)),
            parallel,
            Phase.PREFILL,
            1,
            t,
            t,
        )  # fmt: skip
        for mode in ("gather", "ring")
    }
    assert acts["ring"] < acts["gather"] / 4, acts
