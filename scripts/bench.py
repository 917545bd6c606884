#!/usr/bin/env python
"""jaxpar benchmarks: collective bytes vs the analytic minimum, memory, compile time, speed.

CPU sections run on 8 simulated CPU devices (set up here, before JAX starts); the TPU
section compiles for a compile-only TPU v5e topology (libtpu, no TPU) beside them::

    python scripts/bench.py [--quick] [--out bench_out/bench.json] [--gpu]
    python scripts/bench.py --gpu-only        # on a machine with a GPU and jax[cuda]

Prints Markdown tables and writes everything as JSON. ``--gpu`` adds the GPU section in a
subprocess when ``nvidia-smi`` sees a GPU (the CPU sections keep their CPU-only JAX).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# (preset, strategy): TP, TP+SP, SP, DP, mixes, GQA with replicated K/V heads, EP, EP+TP,
# PP.
MATRIX: list[tuple[str, str]] = [
    ("tiny-dense", "tp=8"),
    ("tiny-dense", "sp=2,tp=4"),
    ("tiny-dense", "sp=8"),
    ("tiny-dense", "dp=8"),
    ("tiny-dense", "dp=4,tp=2"),
    ("tiny-dense", "dp=2,sp=2,tp=2"),
    ("tiny-gqa", "dp=2,tp=4"),
    ("tiny-dense", "pp=2,tp=4"),
    ("tiny-dense", "pp=2,dp=2,tp=2,microbatches=2,decode_groups=2"),
    ("tiny-moe", "ep=8"),
    ("tiny-moe", "ep=2,tp=4"),
    ("tiny-moe", "tp=8"),
    ("tiny-moe", "dp=8"),
    ("tiny-moe", "dp=2,ep=2,tp=2"),
    ("tiny-moe", "sp=2,ep=4"),
    ("tiny-moe", "pp=2,ep=4"),
    # Capacity mode (moe_capacity_factor=1.25): within 1.3x of the routed minimum where
    # a device's tokens x top_k / ep is large enough for ceil() to round up little.
    ("tiny-moe:cf=1.25", "ep=4,tp=2"),
]
QUICK = [
    ("tiny-dense", "tp=8"),
    ("tiny-dense", "dp=2,sp=2,tp=2"),
    ("tiny-dense", "pp=2,tp=4"),
    ("tiny-moe", "ep=8"),
    ("tiny-moe", "dp=2,ep=2,tp=2"),
]
BATCH, PROMPT_LEN, MAX_SEQ_LEN = 8, 16, 64

# TPU section: (preset, strategy, model overrides), each compiled for TPU v5e (compile-only
# v5e:2x4 topology) and, the same config, for the simulated CPU devices. The config is
# bfloat16 at kernel-friendly sizes (head_dim 128, 256-token prompts: whole splash blocks),
# as tests/test_accelerator_compile.py compiles it (from this list); tiny-gqa's 2 kv heads
# are each held by 2 devices at tp=4 (one head per device).
TPU_MATRIX: list[tuple[str, str, dict]] = [
    ("tiny-gqa", "", {}),
    ("tiny-gqa", "tp=2", {}),
    ("tiny-gqa", "dp=2,tp=2", {}),
    ("tiny-gqa", "sp=2,tp=2", {}),
    ("tiny-gqa", "pp=2,tp=2", {}),
    ("tiny-gqa", "tp=4", {}),
    ("tiny-gqa", "tp=2", {"window": {"size": 64}}),
    ("tiny-moe", "ep=2", {}),
    ("tiny-moe", "dp=2,ep=2,tp=2", {}),
]
TPU_QUICK = [
    ("tiny-gqa", "", {}),
    ("tiny-gqa", "tp=2", {}),
    ("tiny-gqa", "pp=2,tp=2", {}),
    ("tiny-moe", "dp=2,ep=2,tp=2", {}),
]
TPU_TOPOLOGY, TPU_BATCH, TPU_SEQ = "v5e:2x4", 8, 256
ROOT = Path(__file__).resolve().parent.parent

# Compiled bytes above the minimum, per (preset, strategy, phase): {cause: bytes}. Causes
# are jaxpar.inspect.CAUSES; measured on XLA:CPU (jax 0.10.2). tests/test_bench_collectives.py
# asserts these exactly, so a regression -- or a fix -- shows.
DOCUMENTED: dict[tuple[str, str, str], dict[str, int]] = {
    ("tiny-dense", "pp=2,tp=4", "prefill"): {"pp-bubble": 163840},
    ("tiny-dense", "pp=2,tp=4", "decode"): {"pp-bubble": 10240},
    ("tiny-dense", "pp=2,dp=2,tp=2,microbatches=2,decode_groups=2", "prefill"): {
        "pp-bubble": 40960
    },
    ("tiny-dense", "pp=2,dp=2,tp=2,microbatches=2,decode_groups=2", "decode"): {"pp-bubble": 2560},
    ("tiny-moe", "ep=8", "prefill"): {"moe-dispatch-buffer": 196864},
    ("tiny-moe", "ep=8", "decode"): {"moe-dispatch-buffer": 12544},
    ("tiny-moe", "ep=2,tp=4", "prefill"): {"moe-dispatch-buffer": 262304},
    ("tiny-moe", "ep=2,tp=4", "decode"): {"moe-dispatch-buffer": 16544},
    ("tiny-moe", "dp=2,ep=2,tp=2", "prefill"): {"moe-dispatch-buffer": 131232},
    ("tiny-moe", "dp=2,ep=2,tp=2", "decode"): {"moe-dispatch-buffer": 8352},
    ("tiny-moe", "sp=2,ep=4", "prefill"): {"moe-dispatch-buffer": 196800},
    ("tiny-moe", "sp=2,ep=4", "decode"): {"moe-dispatch-buffer": 12480},
    ("tiny-moe", "pp=2,ep=4", "prefill"): {"moe-dispatch-buffer": 458944, "pp-bubble": 8192},
    ("tiny-moe", "pp=2,ep=4", "decode"): {"moe-dispatch-buffer": 28864, "pp-bubble": 512},
    ("tiny-moe:cf=1.25", "ep=4,tp=2", "prefill"): {"moe-dispatch-buffer": 32960},
    ("tiny-moe:cf=1.25", "ep=4,tp=2", "decode"): {"moe-dispatch-buffer": 8384},
}

# Peak HBM bandwidth (B/s) and dense bf16 FLOP/s, by a substring of jax's device_kind.
PEAKS = {
    "H200": (4.8e12, 989e12),
    "H100 PCIe": (2.0e12, 756e12),
    "H100": (3.35e12, 989e12),
    "A100-SXM4-80GB": (2.039e12, 312e12),
    "A100": (1.555e12, 312e12),
}


def strategy_kind(strategy: str) -> str:
    """``"TP+SP"``-style label of the active primitives."""
    order = ("dp", "pp", "sp", "ep", "tp")
    active = [a for a in order if f"{a}=" in strategy]
    return "+".join(a.upper() for a in active)


# --- collectives and memory -----------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One matrix entry: its engine and per-phase reports."""

    preset: str
    strategy: str
    engine: Any = None
    reports: dict[str, Any] = dataclasses.field(default_factory=dict)
    compiled: dict[str, Any] = dataclasses.field(default_factory=dict)


def model_of(name: str, get_preset: Any) -> Any:
    """A preset, or ``"<preset>:cf=<factor>"``: the preset run with that MoE capacity
    factor (a ``ModelRun``)."""
    from jaxpar.models import ExecutionOptions, ModelRun

    base, _, option = name.partition(":cf=")
    config = get_preset(base)
    if option:
        config = ModelRun(config, ExecutionOptions(moe_capacity_factor=float(option)))
    return config


def build_case(preset: str, strategy: str, params_cache: dict | None = None) -> Case:
    """Builds the engine of a matrix entry and compiles both phases against the model."""
    import jax

    from jaxpar.engine import InferenceEngine
    from jaxpar.inspect import phase_report
    from jaxpar.models import init_params
    from jaxpar.models import preset as get_preset
    from jaxpar.spec import ParallelConfig, make_mesh

    config, parallel = model_of(preset, get_preset), ParallelConfig.parse(strategy)
    params_cache = {} if params_cache is None else params_cache
    if preset not in params_cache:
        params_cache[preset] = init_params(config)
    case = Case(preset, strategy)
    case.engine = InferenceEngine(
        config,
        params_cache[preset],
        parallel,
        max_batch=BATCH,
        max_seq_len=MAX_SEQ_LEN,
        mesh=make_mesh(parallel, jax.devices()[: parallel.size]),
    )
    for phase in ("prefill", "decode"):
        report, compiled = phase_report(
            case.engine, phase, prompt_len=PROMPT_LEN, label=f"{preset} {strategy}"
        )
        case.reports[phase], case.compiled[phase] = report, compiled
    return case


def memory_ideal(case: Case) -> int:
    """Decode arguments if every tensor were split over all devices that could split it.

    Parameters over tp and pp (expert weights over ep too); the KV cache over every
    device. Replicated norms and the router show as a ratio above 1, and so do K/V heads
    fewer than tp: the ideal splits the checkpoint's heads, while each device holds one
    whole head (its group's copy: rule kv-head-replicas).
    """
    import jax

    eng, p = case.engine, case.engine.parallel_config
    replicas = eng.run.kv_head_replicas  # the run's K/V tensors hold each head this often
    ideal = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(eng.params)[0]:
        key = jax.tree_util.keystr(path)
        split = p.tp * p.pp * (p.ep if "experts" in key else 1)
        split *= replicas if "['kv_" in key else 1
        ideal += leaf.nbytes / split
    c = eng.model_config
    cache = 2 * c.n_layers * BATCH * MAX_SEQ_LEN * c.n_kv_heads * c.head_dim * c.dtype.itemsize
    return int(ideal + cache / p.size + 2 * 4 * BATCH / (p.dp * p.sp * p.ep))  # + tokens, lengths


def collectives_section(matrix: list[tuple[str, str]]) -> tuple[list[dict], list[dict]]:
    """Compiled bytes vs minimum, and per-device memory vs ideal, for every matrix entry."""
    params_cache: dict = {}
    rows, memory = [], []
    for preset, strategy in matrix:
        start = time.perf_counter()
        case = build_case(preset, strategy, params_cache)
        for phase, rep in case.reports.items():
            base = {
                "preset": preset,
                "strategy": strategy,
                "kind": strategy_kind(strategy),
                "phase": phase,
            }
            rows.append(
                {
                    **base,
                    "status": "ok",
                    **rep.to_dict(),
                    "documented": DOCUMENTED.get((preset, strategy, phase), {}),
                }
            )
        measured = case.compiled["decode"].memory_analysis().argument_size_in_bytes
        ideal = memory_ideal(case)
        memory.append(
            {
                "preset": preset,
                "strategy": strategy,
                "measured_bytes": measured,
                "ideal_bytes": ideal,
                "ratio": round(measured / ideal, 4),
            }
        )
        print(f"  {preset} {strategy}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return rows, memory


def served_section(matrix: list[tuple[str, str]]) -> list[dict]:
    """The programs ``jaxpar serve`` runs (paged decode step with its sampler, prefill
    with and without cached context, first tokens, insert), compiled from abstract
    parameters, against the analytic minimum, with their memory per device. Unpipelined
    entries only (serving runs pp=1)."""
    import jax

    from jaxpar.engine import AbstractEngine
    from jaxpar.inspect import serving_report
    from jaxpar.models import preset as get_preset
    from jaxpar.spec import ParallelConfig, make_mesh

    rows = []
    for preset, strategy in matrix:
        parallel = ParallelConfig.parse(strategy)
        if parallel.pp > 1:
            continue
        start = time.perf_counter()
        eng = AbstractEngine.build(
            model_of(preset, get_preset),
            parallel,
            max_batch=BATCH,
            max_seq_len=MAX_SEQ_LEN,
            mesh=make_mesh(parallel, jax.devices()[: parallel.size]),
        )
        for r in serving_report(eng, prompt_len=PROMPT_LEN, label=f"{preset} {strategy}"):
            rows.append({"preset": preset, "strategy": strategy, **r.to_dict()})
        print(f"  served {preset} {strategy}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return rows


# --- compile time ---------------------------------------------------------------------


def compile_section(layer_counts: tuple[int, ...], strategy: str = "dp=2,sp=2,tp=2") -> list[dict]:
    """Prefill and decode compile seconds of tiny-dense with more and more layers."""
    import jax

    from jaxpar.engine import InferenceEngine
    from jaxpar.inspect import compile_step
    from jaxpar.models import init_params, preset
    from jaxpar.spec import ParallelConfig, make_mesh

    parallel, out = ParallelConfig.parse(strategy), []
    for n in layer_counts:
        config = dataclasses.replace(preset("tiny-dense"), n_layers=n)
        eng = InferenceEngine(
            config,
            init_params(config),
            parallel,
            max_batch=BATCH,
            max_seq_len=MAX_SEQ_LEN,
            mesh=make_mesh(parallel, jax.devices()[: parallel.size]),
        )
        row = {"n_layers": n, "strategy": strategy}
        for phase in ("prefill", "decode"):
            start = time.perf_counter()
            compile_step(eng, phase, prompt_len=PROMPT_LEN)
            row[f"{phase}_s"] = round(time.perf_counter() - start, 3)
        out.append(row)
    return out


# --- decode speed against a plain-JAX reference -----------------------------------------


def reference_decode(
    w: dict, k_LBSKH, v_LBSKH, lengths_B, tokens_B, *, n_heads: int, theta: float, eps: float
):
    """One llama-style decode step in plain jnp (no jaxpar layer): logits and the cache.

    Its own cache, stacked [L, B, S, K, H], and its own separate q/k/v and gate/up weights.
    """
    import jax
    import jax.numpy as jnp

    b, (n_layers, _, s, kh, h) = tokens_B.shape[0], k_LBSKH.shape
    pos = lengths_B
    inv = 1.0 / theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)
    ang = pos[:, None].astype(jnp.float32) * inv
    cos, sin = jnp.cos(jnp.concatenate([ang, ang], -1)), jnp.sin(jnp.concatenate([ang, ang], -1))

    def rope(x):  # x [B, heads, H], rotate-half
        x1, x2 = jnp.split(x, 2, -1)
        return x * cos[:, None] + jnp.concatenate([-x2, x1], -1) * sin[:, None]

    def rms(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale

    x = w["embed"][tokens_B]
    rows = jnp.arange(b)
    valid = (jnp.arange(s)[None, :] <= pos[:, None])[:, None, None, :]
    for i in range(n_layers):
        y = rms(x, w["attn_norm"][i])
        q = rope(jnp.einsum("bd,dnh->bnh", y, w["q"][i]))
        k = rope(jnp.einsum("bd,dkh->bkh", y, w["k"][i]))
        v = jnp.einsum("bd,dkh->bkh", y, w["v"][i])
        k_LBSKH = k_LBSKH.at[i, rows, pos].set(k)
        v_LBSKH = v_LBSKH.at[i, rows, pos].set(v)
        scores = (
            jnp.einsum("bkgh,bskh->bkgs", q.reshape(b, kh, n_heads // kh, h), k_LBSKH[i]) * h**-0.5
        )
        p = jax.nn.softmax(jnp.where(valid, scores, -1e30), axis=-1)
        o = jnp.einsum("bkgs,bskh->bkgh", p, v_LBSKH[i]).reshape(b, n_heads, h)
        x = x + jnp.einsum("bnh,nhd->bd", o, w["o"][i])
        y = rms(x, w["ffn_norm"][i])
        x = x + (jax.nn.silu(y @ w["gate"][i]) * (y @ w["up"][i])) @ w["down"][i]
    return rms(x, w["final_norm"]) @ w["lm_head"], k_LBSKH, v_LBSKH


def _weights(config, params) -> dict:
    """The reference decoder's weights, from jaxpar's parameters stacked [L, ...]."""
    from flax import nnx

    from jaxpar.models import with_layer_loop

    stacked = with_layer_loop(config, params, "scan")
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(stacked)}
    names = {
        "embed": "embed.token_table",
        "attn_norm": "layers.attn_norm.scale",
        "q": "layers.attn.q_kernel",
        "o": "layers.attn.o_kernel",
        "ffn_norm": "layers.ffn_norm.scale",
        "down": "layers.ffn.down_kernel",
        "final_norm": "final_norm.scale",
        "lm_head": "lm_head.kernel",
    }
    w = {k: flat[v] for k, v in names.items()}
    kv, gate_up = flat["layers.attn.kv_kernel"], flat["layers.ffn.gate_up_kernel"]
    w["k"], w["v"] = kv[:, :, 0], kv[:, :, 1]  # [L, D, 2, K, H] -> two [L, D, K, H]
    w["gate"], w["up"] = gate_up[:, :, 0], gate_up[:, :, 1]
    return w


def time_decode(
    config,
    *,
    batch: int,
    max_seq_len: int,
    prompt_len: int,
    steps: int,
    repeats: int,
    devices=None,
    reference: bool = True,
) -> dict:
    """Median seconds per decode step of jaxpar (and the reference), same weights and cache."""

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.engine import InferenceEngine
    from jaxpar.models import init_params
    from jaxpar.spec import ParallelConfig, make_mesh

    devices = devices or jax.devices()[:1]
    params = init_params(config)
    eng = InferenceEngine(
        config,
        params,
        ParallelConfig(),
        max_batch=batch,
        max_seq_len=max_seq_len,
        mesh=make_mesh(ParallelConfig(), devices),
    )
    rng = np.random.default_rng(0)
    tokens_BT = rng.integers(0, config.vocab_size, (batch, prompt_len)).astype(np.int32)
    lengths_B = np.full(batch, prompt_len, np.int32)
    _, cache0, first = eng.prefill(tokens_BT, lengths_B)  # compiles prefill and handoff
    tokens_dev = jax.device_put(tokens_BT, eng.layouts.tokens_BT)
    lengths_dev = jax.device_put(lengths_B, eng.layouts.lengths_prefill_B)
    prefill_times = []
    for _ in range(3):  # the compiled prefill step alone (no handoff, no sampling)
        start = time.perf_counter()
        jax.block_until_ready(eng.steps.prefill(eng.params, tokens_dev, lengths_dev))
        prefill_times.append(time.perf_counter() - start)
    prefill_s = statistics.median(prefill_times)
    contenders = {"jaxpar": lambda c, t: eng.steps.decode(eng.params, c, t)}
    starts = {"jaxpar": lambda: jax.tree.map(jnp.copy, cache0)}
    if reference:
        contenders["reference"], starts["reference"] = _reference(config, params, devices, cache0)
    out: dict[str, Any] = {
        "batch": batch,
        "max_seq_len": max_seq_len,
        "prompt_len": prompt_len,
        "steps": steps,
        "repeats": repeats,
        "prefill_s": prefill_s,
    }
    check = {}
    for name, step in contenders.items():  # compile, and check the two agree
        check[name] = np.asarray(step(starts[name](), first)[0])
    if reference:
        out["max_abs_logit_diff"] = float(np.max(np.abs(check["jaxpar"] - check["reference"])))
    times = _interleaved_times(contenders, starts, first, steps, repeats)
    for name, values in times.items():
        out[f"{name}_step_s"] = statistics.median(values)
        out[f"{name}_tokens_per_s"] = batch / statistics.median(values)
    if reference:
        out["ratio"] = out["jaxpar_step_s"] / out["reference_step_s"]
    out["engine"], out["params"] = eng, params
    return out


def _reference(config, params, devices, cache0):
    """The reference decode step and its start cache (the same cache, as the reference
    stores it: stacked [L, B, S, K, H], built once, not timed)."""
    import functools

    import jax
    import jax.numpy as jnp

    w = jax.device_put(_weights(config, params), devices[0])
    ref = jax.jit(
        functools.partial(
            reference_decode,
            n_heads=config.n_heads,
            theta=config.rope.theta,
            eps=config.norms.eps,
        ),
        donate_argnums=(1, 2),
    )

    def ref_step(c, t):  # c: the reference's own (k, v, lengths)
        logits, k, v = ref(w, c[0], c[1], c[2], t)
        return logits, (k, v, c[2] + 1)

    def stacked(layers):
        return jnp.stack([x.transpose(0, 2, 1, 3) for x in layers])

    return ref_step, lambda: (stacked(cache0.k), stacked(cache0.v), cache0.lengths_B)


def _interleaved_times(contenders, starts, first, steps: int, repeats: int) -> dict:
    """Seconds per step of each contender, ``repeats`` times, interleaved so both see the
    same machine load."""
    import jax

    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, step in contenders.items():
            cache, tokens = starts[name](), first
            jax.block_until_ready(cache)
            start = time.perf_counter()
            for _ in range(steps):
                logits, cache = step(cache, tokens)
            logits.block_until_ready()
            times[name].append((time.perf_counter() - start) / steps)
    return times


def decode_section(quick: bool) -> dict:
    """jaxpar vs the plain-JAX reference on one CPU device, same run, median of repeats."""
    from jaxpar.models import preset

    config = dataclasses.replace(
        preset("tiny-dense"),
        d_model=256,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        d_ff=768,
        vocab_size=2048,
    )
    res = time_decode(
        config,
        batch=8,
        max_seq_len=256,
        prompt_len=64,
        steps=16 if quick else 48,
        repeats=3 if quick else 7,
    )
    res.pop("engine"), res.pop("params")
    return {
        "model": "tiny-dense widened: d_model 256, 8 heads (4 kv), d_ff 768, vocab 2048, 4 layers",
        **res,
    }


# --- GPU --------------------------------------------------------------------------------


def gpu_section(model: str = "llama-1b", devices: list | None = None, quick: bool = False) -> dict:
    """On one GPU (bf16 weights): decode ms/step and fraction of peak HBM bandwidth at
    batch 1, 16, 64 and context 512, 4096; prefill MFU at 8k and 32k tokens; compile
    seconds for 16, 32 and 80 layers, unrolled and scanned.

    ``devices`` overrides the GPU lookup (to exercise this code on a CPU with ``quick``).
    """
    import jax

    from jaxpar.models import preset

    gpus = devices or [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        return {"skipped": "no GPU visible to JAX"}
    kind = gpus[0].device_kind
    peak_bw, peak_flops = next((v for k, v in PEAKS.items() if k in kind), (None, None))
    config = preset(model)
    steps = 4 if quick else 32
    decode_rows, prefill_rows = [], []
    shapes = [(1, 16), (4, 16)] if quick else [(b, c) for c in (512, 4096) for b in (1, 16, 64)]
    for batch, context in shapes:
        res = time_decode(
            config,
            batch=batch,
            max_seq_len=context + steps + 8,
            prompt_len=context,
            steps=steps,
            repeats=3 if quick else 5,
            devices=gpus[:1],
            reference=False,
        )
        eng, params = res.pop("engine"), res.pop("params")
        param_bytes = sum(x.nbytes for x in jax.tree.leaves(eng.params))
        mid = context + steps // 2  # KV positions in use, averaged over the timed steps
        kv_bytes = (
            2
            * config.n_layers
            * batch
            * mid
            * config.n_kv_heads
            * config.head_dim
            * config.dtype.itemsize
        )
        bandwidth = (param_bytes + kv_bytes) / res["jaxpar_step_s"]
        decode_rows.append(
            {
                "batch": batch,
                "context": context,
                "decode_ms": 1e3 * res["jaxpar_step_s"],
                "bytes_per_step": param_bytes + kv_bytes,
                "floor_ms": peak_bw and 1e3 * (param_bytes + kv_bytes) / peak_bw,
                "hbm_fraction": peak_bw and bandwidth / peak_bw,
            }
        )
        n_params = sum(x.size for x in jax.tree.leaves(params))
        flops = 2 * n_params * batch * context  # prefill of this shape, matmul FLOPs
        prefill_rows.append(
            {
                "batch": batch,
                "prompt_len": context,
                "tokens": batch * context,
                "prefill_ms": 1e3 * res["prefill_s"],
                "mfu": peak_flops and flops / res["prefill_s"] / peak_flops,
            }
        )
        del eng, params
    return {
        "device_kind": kind,
        "jax": jax.__version__,
        "model": model,
        "dtype": str(config.dtype),
        "peak_hbm_bytes_per_s": peak_bw,
        "peak_bf16_flops": peak_flops,
        "decode": decode_rows,
        "prefill": prefill_rows,
        "peer": torch_peer(model, shapes, steps),
        "compile": gpu_compile_seconds(model, (2, 4) if quick else (16, 32, 80), gpus[:1]),
        "note": "decode: median ms/step over timed steps; prefill: the compiled step, median of "
        "3; MFU counts 2*params*tokens (attention FLOPs left out)",
    }


def torch_peer(model: str, shapes: list[tuple[int, int]], steps: int) -> dict:
    """transformers + torch on the same shapes (``scripts/bench_torch_peer.py``), in its own
    process so the two frameworks do not share the GPU's memory; skipped without torch."""
    import importlib.util

    if not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        return {"skipped": "torch or transformers not importable"}
    argv = [
        sys.executable,
        str(Path(__file__).with_name("bench_torch_peer.py")),
        "--model",
        model,
        "--shapes",
        ",".join(f"{b}x{p}" for b, p in shapes),
        "--steps",
        str(steps),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return {"skipped": "peer run failed: " + done.stderr.strip().splitlines()[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def gpu_compile_seconds(model: str, layer_counts: tuple[int, ...], devices: list) -> list[dict]:
    """Prefill and decode compile seconds by depth, for each layer loop (shapes only)."""

    from jaxpar.engine import AbstractEngine
    from jaxpar.inspect import compile_step
    from jaxpar.models import ExecutionOptions, ModelRun, preset
    from jaxpar.spec import ParallelConfig, make_mesh

    rows = []
    for n in layer_counts:
        for loop in ("unrolled", "scan"):
            config = ModelRun(
                dataclasses.replace(preset(model), n_layers=n), ExecutionOptions(layer_loop=loop)
            )
            one = ParallelConfig()
            mesh = make_mesh(one, devices[:1])
            eng = AbstractEngine.build(config, one, max_batch=16, max_seq_len=1024, mesh=mesh)
            row = {"n_layers": n, "layer_loop": loop}
            for phase in ("prefill", "decode"):
                start = time.perf_counter()
                compile_step(eng, phase, prompt_len=512)
                row[f"{phase}_compile_s"] = round(time.perf_counter() - start, 2)
            rows.append(row)
    return rows


# --- TPU: compiled for a compile-only v5e topology, next to the same config on CPU --------


def tpu_config(preset_name: str, **overrides: Any) -> Any:
    """``preset_name`` in bfloat16 at the TPU section's sizes (d_model 256, head_dim 128), as
    a ``ModelRun``: overrides naming an ``ExecutionOptions`` field (``decode_attention``)
    go to the options, the others to the architecture."""
    from jaxpar.models import ExecutionOptions, ModelRun, preset

    names = {f.name for f in dataclasses.fields(ExecutionOptions)}
    config = dataclasses.replace(
        preset(preset_name),
        dtype="bfloat16",
        param_dtype="bfloat16",
        d_model=256,
        head_dim=128,
        max_position_embeddings=512,
        **{k: v for k, v in overrides.items() if k not in names},
    )
    return ModelRun(config, ExecutionOptions(**{k: v for k, v in overrides.items() if k in names}))


def libtpu() -> tuple[str | None, str | None]:
    """(path, version) of the libtpu to load: the running venv's ``accel/tpu`` (installed by
    scripts/_accelerators.sh), else None for ``tpu_devices``' own search
    (``$TPU_LIBRARY_PATH``, then the ``libtpu`` package)."""
    import importlib.metadata as md

    accel = Path(sys.prefix) / "accel" / "tpu"  # the running venv's
    so = accel / "libtpu" / "libtpu.so"
    if so.is_file():
        dist = next(iter(md.distributions(name="libtpu", path=[str(accel)])), None)
        return str(so), dist.version if dist else None
    try:
        return None, md.version("libtpu")
    except md.PackageNotFoundError:
        return None, None


def _label(preset_name: str, overrides: dict) -> str:
    """``tiny-gqa window=64``: a group given as a mapping of one field reads as the group."""
    words = [
        f"{k}={next(iter(v.values()))}" if isinstance(v, dict) and len(v) == 1 else f"{k}={v}"
        for k, v in overrides.items()
    ]
    return " ".join([preset_name, *words])


def splash_expected(engine: Any) -> int:
    """Splash calls a TPU prefill holds: one per layer in the text (one loop body when the
    layers are stacked), times one per query offset under sp. TPU decode runs XLA (none)."""
    c = engine.run
    layers = c.n_layers if c.layer_loop == "unrolled" else 1
    return layers * engine.parallel_config.sp


def _compiled_row(engine: Any, phase: str) -> dict:
    """Memory, collectives vs minimum, kernel calls and compile seconds of one step."""
    from jaxpar.inspect import kernel_calls, phase_report

    start = time.perf_counter()
    report, compiled = phase_report(engine, phase, prompt_len=TPU_SEQ)
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    rep = report.to_dict()
    return {
        "compile_s": round(seconds, 2),
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        **{k: rep[k] for k in ("compiled_bytes", "minimum_bytes", "ratio", "exceptions")},
        "trip_counts_known": rep["trip_counts_known"],
        "moe_exchange": rep["moe_exchange"],
        "kernel_calls": kernel_calls(compiled),
        "splash_expected": splash_expected(engine) if phase == "prefill" else 0,
    }


def tpu_section(matrix: list[tuple[str, str, dict]], library_path: str | None = None) -> dict:
    """Each entry compiled for TPU v5e (compile-only topology) and for CPU, same config.

    Nothing runs: ``AbstractEngine`` steps are compiled for abstract parameters. Returns
    ``{"skipped": why}`` when libtpu cannot be loaded.
    """
    import jax

    from jaxpar.engine import AbstractEngine
    from jaxpar.errors import ConfigError
    from jaxpar.inspect import tpu_devices
    from jaxpar.spec import ParallelConfig, make_mesh

    path, version = libtpu() if library_path is None else (library_path, None)
    try:
        tpus = tpu_devices(TPU_TOPOLOGY, library_path=path)
    except (ConfigError, RuntimeError, OSError, ImportError) as e:
        why = (
            f'no libtpu: install it (scripts/_accelerators.sh, or pip install "jax[tpu]=='
            f'{jax.__version__}"): {str(e).splitlines()[0][:200]}'
        )
        return {"skipped": why}
    out: dict[str, Any] = {
        "topology": TPU_TOPOLOGY,
        "device_kind": tpus[0].device_kind,
        "libtpu": version,
        "libtpu_path": path,
        "jax": jax.__version__,
        "batch": TPU_BATCH,
        "prompt_len": TPU_SEQ,
        "max_seq_len": TPU_SEQ,
        "rows": [],
    }
    for preset_name, strategy, overrides in matrix:
        start = time.perf_counter()
        config, parallel = tpu_config(preset_name, **overrides), ParallelConfig.parse(strategy)
        for platform, devices in (("tpu", tpus), ("cpu", jax.devices())):
            engine = AbstractEngine.build(
                config,
                parallel,
                max_batch=TPU_BATCH,
                max_seq_len=TPU_SEQ,
                mesh=make_mesh(parallel, devices=devices[: parallel.size]),
            )
            for phase in ("prefill", "decode"):
                out["rows"].append(
                    {
                        "model": _label(preset_name, overrides),
                        "preset": preset_name,
                        "overrides": overrides,
                        "strategy": strategy,
                        "kind": strategy_kind(strategy) or "-",
                        "platform": platform,
                        "phase": phase,
                        "n_layers": config.n_layers,
                        **_compiled_row(engine, phase),
                    }
                )
        label = f"{_label(preset_name, overrides)} {strategy or '1 device'}"
        print(f"  tpu {label}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return out


# --- output -------------------------------------------------------------------------------


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def _ratio(r: float | str | None) -> str:
    return f"{r:.2f}" if isinstance(r, float) else str(r or "-")


def markdown(results: dict) -> str:
    """The README tables."""
    from jaxpar.inspect import CAUSES

    out = []
    if "served" in results:
        out += [
            "### Served programs: collective bytes per device, compiled / analytic minimum",
            "",
            f"rows {BATCH}, new tokens {PROMPT_LEN} (prefill programs, insert; {PROMPT_LEN} "
            f"cached with context), pool of {BATCH} x {MAX_SEQ_LEN} tokens, float32, 8 "
            "simulated CPU devices. The minimum of a sampling program includes the "
            "vocab-parallel sampler's O(B x k) exchange.",
            "",
            "| model | strategy | program | compiled / min | ratio | above (bytes) | peak B |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in results["served"]:
            c = r["collectives"]
            above = ", ".join(f"{k} {v:,}" for k, v in c["exceptions"].items()) or "-"
            out.append(
                f"| {r['preset']} | {r['strategy']} | {r['program']} | "
                f"{c['compiled_bytes']:,} / {c['minimum_bytes']:,} | {_ratio(c['ratio'])} | "
                f"{above} | {r['memory']['peak']:,} |"
            )
        out.append("")
    if "collectives" in results:
        out += [
            "### Collective bytes per device per step: compiled / analytic minimum",
            "",
            f"batch {BATCH}, prompt {PROMPT_LEN} (prefill), cache {MAX_SEQ_LEN}, float32, "
            "8 simulated CPU devices. Exceptions: bytes above the minimum, by cause.",
            "",
            "| model | strategy | kind | prefill compiled / min | ratio | decode compiled / min "
            "| ratio | exceptions (bytes) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        by = {(r["preset"], r["strategy"], r["phase"]): r for r in results["collectives"]}
        for preset, strategy in dict.fromkeys(
            (r["preset"], r["strategy"]) for r in results["collectives"]
        ):
            p, d = by[preset, strategy, "prefill"], by[preset, strategy, "decode"]
            exc = (
                "; ".join(
                    f"{ph}: " + ", ".join(f"{k} {v:,}" for k, v in r["exceptions"].items())
                    for ph, r in (("prefill", p), ("decode", d))
                    if r["exceptions"]
                )
                or "-"
            )
            out.append(
                f"| {preset} | {strategy} | {p['kind']} | {p['compiled_bytes']:,} / "
                f"{p['minimum_bytes']:,} | {_ratio(p['ratio'])} | {d['compiled_bytes']:,} / "
                f"{d['minimum_bytes']:,} | {_ratio(d['ratio'])} | {exc} |"
            )
        seen = {k for r in results["collectives"] for k in r.get("exceptions", {})}
        out += ["", "| cause | why |", "|---|---|"] + [
            f"| {k} | {CAUSES[k]} |" for k in sorted(seen)
        ]
    if "memory" in results:
        out += [
            "",
            "### Per-device decode arguments (params + KV cache): measured / ideal",
            "",
            "| model | strategy | measured bytes | ideal bytes | ratio |",
            "|---|---|---|---|---|",
        ]
        out += [
            f"| {m['preset']} | {m['strategy']} | {m['measured_bytes']:,} | {m['ideal_bytes']:,} | "
            f"{m['ratio']:.2f} |"
            for m in results["memory"]
        ]
    if "compile_time" in results:
        out += [
            "",
            f"### Compile time (tiny-dense, {results['compile_time'][0]['strategy']}, seconds)",
            "",
            "| layers | prefill | decode |",
            "|---|---|---|",
        ]
        out += [
            f"| {r['n_layers']} | {r['prefill_s']:.2f} | {r['decode_s']:.2f} |"
            for r in results["compile_time"]
        ]
    if "decode" in results:
        d = results["decode"]
        out += [
            "",
            "### Decode step on one CPU device: jaxpar vs a plain-JAX reference",
            "",
            f"{d['model']}; batch {d['batch']}, cache {d['max_seq_len']}, {d['steps']} steps, "
            f"median of {d['repeats']}; max |logit diff| {d['max_abs_logit_diff']:.1e}",
            "",
            "| | ms / step | tokens/s |",
            "|---|---|---|",
            f"| jaxpar | {1e3 * d['jaxpar_step_s']:.3f} | {d['jaxpar_tokens_per_s']:,.0f} |",
            f"| reference | {1e3 * d['reference_step_s']:.3f} | {d['reference_tokens_per_s']:,.0f} |",
            f"| ratio (jaxpar / reference) | {d['ratio']:.2f} | |",
        ]
    if "tpu" in results:
        out += ["", "### TPU v5e: compiled on a CPU host, next to the same config on CPU", ""]
        out += tpu_markdown(results["tpu"])
    if "gpu" in results:
        out += ["", "### GPU", "", *gpu_markdown(results["gpu"])]
    return "\n".join(out)


def _mib(row: dict) -> str:
    return " / ".join(
        f"{row[k] / 2**20:.2f}" for k in ("argument_bytes", "output_bytes", "temp_bytes")
    )


def _exceptions(row: dict) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in row["exceptions"].items()) or "-"


def tpu_markdown(t: dict) -> list[str]:
    """The TPU section's table: each step compiled for TPU and for CPU, same config."""
    if "skipped" in t:
        return [f"skipped: {t['skipped']}"]
    out = [
        f"Compiled for {t['device_kind']} ({t['topology']} compile-only topology, libtpu "
        f"{t['libtpu'] or 'unknown'}, jax {t['jax']}) on a CPU host: nothing ran on a TPU. "
        "The same model and step compiled for the 8 simulated CPU devices beside it. Model: "
        f"the preset in bfloat16, d_model 256, head_dim 128; batch {t['batch']}, prompt "
        f"{t['prompt_len']} (prefill), cache {t['max_seq_len']}. Memory per device from "
        "`memory_analysis()` (MiB: arguments / outputs / temporaries); collectives in bytes "
        "per device per step, compiled / analytic minimum; splash: fused-attention kernel "
        "calls / one per layer (per query offset under sp; one loop body under pp); a2a: "
        "ragged all-to-alls.",
        "",
        "| model | strategy | phase | TPU memory | CPU memory | TPU collectives | TPU ratio "
        "| CPU ratio | above the minimum: TPU; CPU | splash | a2a | compile s TPU / CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["model"], r["strategy"], r["phase"], r["platform"]): r for r in t["rows"]}
    for model, strategy, phase in dict.fromkeys(
        (r["model"], r["strategy"], r["phase"]) for r in t["rows"]
    ):
        tpu, cpu = by[model, strategy, phase, "tpu"], by[model, strategy, phase, "cpu"]
        trips = "" if tpu["trip_counts_known"] else " (loop trips unknown)"
        calls = tpu["kernel_calls"]
        out.append(
            f"| {model} | {strategy or '1 device'} | {phase} | {_mib(tpu)} | {_mib(cpu)} | "
            f"{tpu['compiled_bytes']:,} / {tpu['minimum_bytes']:,}{trips} | "
            f"{_ratio(tpu['ratio'])} | {_ratio(cpu['ratio'])} | {_exceptions(tpu)}; "
            f"{_exceptions(cpu)} | {calls['splash']} / {tpu['splash_expected']} | "
            f"{calls['ragged_all_to_all']} | {tpu['compile_s']:.1f} / {cpu['compile_s']:.1f} |"
        )
    return out


def gpu_markdown(g: dict) -> list[str]:
    """The GPU section's tables."""
    if "skipped" in g:
        return [f"skipped: {g['skipped']}"]
    out = [
        f"{g['device_kind']}, jax {g['jax']}, {g['model']} {g['dtype']}",
        "",
        "| decode batch | context | ms / step | floor ms (bytes / peak) | HBM fraction |",
        "|---|---|---|---|---|",
    ]
    out += [
        f"| {r['batch']} | {r['context']} | {r['decode_ms']:.3f} | {_fmt(r['floor_ms'])} | "
        f"{_fmt(r['hbm_fraction'])} |"
        for r in g["decode"]
    ]
    out += ["", "| prefill tokens | batch x prompt | ms | MFU |", "|---|---|---|---|"]
    out += [
        f"| {r['tokens']} | {r['batch']} x {r['prompt_len']} | {r['prefill_ms']:.2f} | "
        f"{_fmt(r['mfu'])} |"
        for r in g["prefill"]
    ]
    peer = g.get("peer", {"skipped": "not run"})
    if "skipped" in peer:
        out += ["", f"transformers + torch peer: skipped ({peer['skipped']})"]
    else:
        out += [
            "",
            f"Peer: {peer['peer']} (torch {peer['torch']}, transformers {peer['transformers']})",
            "",
            "| batch x prompt | decode ms: jaxpar | peer | peer / jaxpar | prefill ms: jaxpar "
            "| peer |",
            "|---|---|---|---|---|---|",
        ]
        for mine, theirs in zip(g["decode"], peer["rows"], strict=True):
            pre = next(
                r
                for r in g["prefill"]
                if (r["batch"], r["prompt_len"]) == (theirs["batch"], theirs["prompt_len"])
            )
            out.append(
                f"| {theirs['batch']} x {theirs['prompt_len']} | {mine['decode_ms']:.3f} | "
                f"{theirs['decode_ms']:.3f} | {theirs['decode_ms'] / mine['decode_ms']:.2f} | "
                f"{pre['prefill_ms']:.2f} | {theirs['prefill_ms']:.2f} |"
            )
    out += [
        "",
        "| layers | layer loop | prefill compile s | decode compile s |",
        "|---|---|---|---|",
    ]
    out += [
        f"| {r['n_layers']} | {r['layer_loop']} | {r['prefill_compile_s']} | "
        f"{r['decode_compile_s']} |"
        for r in g["compile"]
    ]
    return out


def documented_literal(rows: list[dict]) -> str:
    """The measured exceptions in ``DOCUMENTED``'s form, to paste after a deliberate change."""
    lines = ["DOCUMENTED: dict[tuple[str, str, str], dict[str, int]] = {"]
    for r in rows:
        if r.get("exceptions"):
            causes = dict(sorted(r["exceptions"].items()))
            lines.append(f"    ({r['preset']!r}, {r['strategy']!r}, {r['phase']!r}): {causes!r},")
    return "\n".join([*lines, "}"]).replace("'", '"')


def _cpu_env(devices: int = 8) -> None:
    """8 simulated CPU devices; must run before JAX is imported."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={devices}".strip()
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller matrix, fewer repeats")
    parser.add_argument("--out", type=Path, default=Path("bench_out/bench.json"))
    parser.add_argument(
        "--sections",
        default="collectives,served,compile,decode,quant,pipeline,serving,lockstep,tpu",
        help="comma-separated sections: collectives, served (the programs `jaxpar serve` "
        "runs: collectives vs minimum, memory), compile, decode, quant (quantized "
        "weights vs bf16), pipeline, serving, lockstep (serving across 2 processes), tpu "
        "(compiled for TPU v5e on this CPU host, with libtpu)",
    )
    parser.add_argument(
        "--gpu", action="store_true", help="also run the GPU section if a GPU exists"
    )
    parser.add_argument(
        "--gpu-only", action="store_true", help="only the GPU section, in this process"
    )
    parser.add_argument("--gpu-model", default="llama-1b")
    parser.add_argument(
        "--print-documented",
        action="store_true",
        help="print the measured exceptions as a DOCUMENTED literal (to update it)",
    )
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.gpu_only:
        results = {"gpu": gpu_section(args.gpu_model, quick=args.quick)}
    else:
        _cpu_env()
        import jax

        results: dict[str, Any] = {
            "env": {
                "jax": jax.__version__,
                "devices": jax.device_count(),
                "platform": jax.devices()[0].platform,
                "date": time.strftime("%Y-%m-%d %H:%M"),
            }
        }
        _cpu_sections(args, results)
        if args.gpu:
            results["gpu"] = _gpu_subprocess(args)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    print(markdown(results))
    _print_subprocess_sections(results)
    print(f"\nJSON: {args.out}", file=sys.stderr)
    return 0


def _collective_sections(args: argparse.Namespace, results: dict, sections: list[str]) -> None:
    """The offline steps' and the served programs' collectives against the minimum."""
    matrix = QUICK if args.quick else MATRIX
    if "collectives" in sections:
        results["collectives"], results["memory"] = collectives_section(matrix)
        if args.print_documented:
            print(documented_literal(results["collectives"]))
    if "served" in sections:
        results["served"] = served_section(matrix)


def _cpu_sections(args: argparse.Namespace, results: dict) -> None:
    """The sections ``--sections`` names, into ``results``."""
    sections = args.sections.split(",")
    _collective_sections(args, results, sections)
    if "compile" in sections:
        results["compile_time"] = compile_section((1, 4) if args.quick else (1, 4, 16, 32))
    if "decode" in sections:
        results["decode"] = decode_section(args.quick)
    if "quant" in sections:
        from bench_quant import quant_section

        results["quant"] = quant_section(args.quick)
    if "pipeline" in sections:
        results["pipeline"] = _pipeline_subprocess(args.quick)
    if "serving" in sections:
        from bench_serving import serving_section

        results["serving"] = serving_section(args.quick)
    if "lockstep" in sections:
        results["lockstep"] = _script_subprocess("bench_lockstep.py", [])
    if "tpu" in sections:
        results["tpu"] = _tpu_noted(args.quick)


def _tpu_noted(quick: bool) -> dict:
    """The TPU section; a one-line note when libtpu is missing (the JSON says so too)."""
    result = tpu_section(TPU_QUICK if quick else TPU_MATRIX)
    if "skipped" in result:
        print(f"TPU section skipped: {result['skipped']}", file=sys.stderr)
    return result


def _print_subprocess_sections(results: dict) -> None:
    """The sections that bring their own Markdown: pipeline, serving."""
    if "pipeline" in results:
        print("\n### Pipeline: prefill bubble vs (p-1)/(m+p-1), decode groups\n")
        print(results["pipeline"])
    if "quant" in results:
        from bench_quant import markdown as quant_markdown

        print("\n### Quantized weights vs bf16: decode step bytes and CPU time\n")
        print(quant_markdown(results["quant"]))
    if "lockstep" in results:
        print("\n### Serving across 2 processes: process 0's messages against the step\n")
        print(results["lockstep"])
    if "serving" in results:
        from bench_serving import markdown as serving_markdown

        print("\n### Serving: continuous vs static batching, Poisson arrivals\n")
        print(serving_markdown(results["serving"]))


def _script_subprocess(script: str, argv: list[str]) -> str:
    """scripts/SCRIPT in its own process (its own device count); its Markdown table (the
    lines of its output that are one)."""
    command = [sys.executable, str(Path(__file__).with_name(script)), *argv]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        return f"{script} failed: {done.stderr[-500:]}"
    return "\n".join(line for line in done.stdout.splitlines() if line.startswith("|"))


def _pipeline_subprocess(quick: bool) -> str:
    """scripts/bench_pipeline.py in its own process: it needs its own device count."""
    argv = [sys.executable, str(Path(__file__).with_name("bench_pipeline.py"))]
    argv += ["--batch", "16", "--repeats", "2"] if quick else ["--batch", "32"]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    return (
        done.stdout.strip()
        if done.returncode == 0
        else f"pipeline bench failed: {done.stderr[-500:]}"
    )


def _gpu_subprocess(args: argparse.Namespace) -> dict:
    if shutil.which("nvidia-smi") is None:
        return {"skipped": "no nvidia-smi: no GPU on this machine"}
    out = args.out.with_name(args.out.stem + "_gpu.json")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    done = subprocess.run(
        [sys.executable, __file__, "--gpu-only", "--gpu-model", args.gpu_model, "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    return (
        json.loads(out.read_text())["gpu"]
        if done.returncode == 0
        else {"skipped": "GPU run failed"}
    )


if __name__ == "__main__":
    sys.exit(main())
