"""The served sections of ``scripts/bench_serving.py`` (``scripts/_bench_served.py``): the
checkpoint they write loads and streams a word per token, and their figures are computed
and rendered right from client-side records. The servers themselves run in the benchmark
only (minutes of compiles on a CPU)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.engine import engine_from_hf
from jaxpar.engine._text import load_tokenizer
from jaxpar.models import preset
from jaxpar.spec import ParallelConfig, make_mesh

_spec = importlib.util.spec_from_file_location(
    "jaxpar_bench_served", Path(__file__).resolve().parents[1] / "scripts" / "_bench_served.py"
)
served = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = served
_spec.loader.exec_module(served)


def test_checkpoint_loads_and_each_token_is_a_word(tmp_path):
    config = dataclasses.replace(preset("tiny-gqa"), max_position_embeddings=64)
    path = served.write_checkpoint(tmp_path, config)
    assert served.write_checkpoint(tmp_path, config) == path  # kept: same config
    parallel = ParallelConfig()
    engine = engine_from_hf(
        path, parallel, max_batch=1, max_seq_len=16, mesh=make_mesh(parallel, jax.devices()[:1])
    )
    out = engine.generate([[5, 6, 7]], max_new_tokens=3)
    assert np.all(np.asarray(out.tokens) >= 0) and np.asarray(out.tokens).shape[-1] == 3
    tokenizer = load_tokenizer(path)
    assert tokenizer.decode([3, 4]) == "t3 t4"
    assert tokenizer.get_vocab_size() == config.vocab_size


def test_metrics_text_sums_over_labels():
    text = "\n".join(
        [
            "# HELP jaxpar:prefix_cache_hits_total tokens",
            "# TYPE jaxpar:prefix_cache_hits_total counter",
            'jaxpar:prefix_cache_hits_total{model_name="bench"} 1024.0',
            'jaxpar:prefix_cache_queries_total{model_name="bench"} 1100.0',
            'jaxpar:request_success_total{finished_reason="stop",model_name="bench"} 2.0',
            'jaxpar:request_success_total{finished_reason="length",model_name="bench"} 3.0',
        ]
    )
    assert served.parse_metrics(text) == {
        "jaxpar:prefix_cache_hits_total": 1024.0,
        "jaxpar:prefix_cache_queries_total": 1100.0,
        "jaxpar:request_success_total": 5.0,
    }


def _completion(prompt: int, ttft: float, cached: int | None) -> served.Completion:
    c = served.Completion(prompt, sent=10.0, token_times=[10.0 + ttft + 0.01 * i for i in range(8)])
    details = {} if cached is None else {"prompt_tokens_details": {"cached_tokens": cached}}
    c.usage = {"prompt_tokens": prompt, **details}
    return c


def test_prefix_figures():
    setup = served.PrefixSetup(system=64, requests=3)
    runs = [
        _completion(64 + 20, 0.5, 0),
        _completion(64 + 30, 0.05, 64),
        _completion(64 + 10, 0.04, 64),
    ]
    on = served.summarize_prefix(setup, runs, {"queries": 240.0, "hits": 128.0})
    assert on["cached_tokens"] == 128 and on["suffix_tokens"] == 60
    assert on["rest_computed_over_suffix"] == 1.0  # the hits compute their suffixes alone
    assert on["computed_over_suffix"] == pytest.approx((84 + 30 + 10) / 60)
    assert on["ttft_rest_p50_ms"] == pytest.approx(45.0)
    assert on["hit_rate"] == pytest.approx(128 / 252)
    # Without cached_tokens in the usage, the counters stand in.
    off = served.summarize_prefix(
        setup, [_completion(84, 0.5, None)] * 3, {"queries": 252.0, "hits": 0.0}
    )
    assert off["cached_tokens"] == 0 and off["computed_over_suffix"] == pytest.approx(252 / 60)
    burst = {"wall_s": 1.0, "ttft_p50_ms": 5.0, "cached_tokens": 0}
    res = {
        "setup": {**dataclasses.asdict(setup), "max_seq_len": 256, "model": "m"},
        "systems": {
            "prefix caching": {**on, "burst": burst},
            "no prefix caching": {**off, "burst": burst},
        },
        "hit_over_miss_ttft": on["ttft_rest_p50_ms"] / off["ttft_all_p50_ms"],
        "hit_over_first_ttft": 0.09,
    }
    text = served.prefix_markdown(res)
    assert "TTFT on a hit / on a miss: **0.090**" in text and "goal <= 0.2: **pass**" in text
    assert "on the hits: **1.000** (goal <= 1.1: **pass**)" in text


def test_gap_figures():
    times = [0.0, 0.01, 0.02, 0.03, 0.53, 0.54, 0.55, 0.58, 0.61]  # 500 ms among 10 and 30 ms
    long = served.Completion(4096, sent=0.025, token_times=[0.52, 0.55, 0.58])
    stats = served._gap_stats(served.Completion(8, -0.1, token_times=times), long)
    assert stats["longest_gap_ms_by_phase"] == pytest.approx(
        {"before": 10, "prefill": 500, "long decode": 500, "after": 30}
    )
    assert stats["longest_gap_ms"] == pytest.approx(500)
    assert stats["tpot_p50_ms"] == pytest.approx(10)
    assert stats["steady_tpot_p50_ms"] == pytest.approx(10)  # the gaps up to 0.02
    assert stats["gap_over_tpot"] == pytest.approx(50)
    system = {
        "long_ttft_ms": 900.0,
        "streams": [stats],
        "worst_gap_over_tpot": 50.0,
        "median_gap_over_tpot": 50.0,
        "worst_gap_over_steady_tpot": 50.0,
        "longest_gap_ms": 500.0,
        "longest_gap_ms_by_phase": stats["longest_gap_ms_by_phase"],
        "tpot_p50_ms": 10.0,
        "steady_tpot_p50_ms": 10.0,
    }
    res = {
        "setup": {**dataclasses.asdict(served.CHUNKED), "max_seq_len": 4224},
        "systems": {"chunked": system, "whole": system},
    }
    text = served.chunked_markdown(res)
    assert "| chunked | 900 | 10.0 | 10.0 | 500 | **50.0** | 50.0 | FAIL | 50.0 |" in text
    assert "| whole | 10 | 500 | 500 | 30 |" in text
