"""The ``workloads`` section of ``scripts/bench_serving.py`` (``scripts/_bench_workloads.py``,
``scripts/_bench_profile.py``): its figures come from the client's records and the
server's counters, and its quickest form runs against a real ``jaxpar serve``."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import _bench_profile as profile  # noqa: E402
import _bench_served as served  # noqa: E402
import _bench_workloads as workloads  # noqa: E402


def _completion(sent: float, times: list[float]) -> served.Completion:
    c = served.Completion(4, sent=sent, token_times=times)
    c.usage = {"completion_tokens": len(times)}
    return c


def test_figures_from_client_records():
    runs = [
        _completion(0.0, [0.5, 0.6, 0.7, 0.8]),  # TTFT 0.5, TPOT 0.1
        _completion(1.0, [1.2, 1.5, 1.8, 2.1]),  # TTFT 0.2, TPOT 0.3
    ]
    s = workloads.summarize(runs, max_tokens=4)
    assert s["complete"] == 2 and s["output_tokens"] == 8 == s["usage_tokens"]
    assert s["seconds"] == pytest.approx(2.1)
    assert s["output_tokens_per_s"] == pytest.approx(8 / 2.1)
    assert s["ttft_p50_ms"] == pytest.approx(350.0)
    assert s["tpot_p50_ms"] == pytest.approx(200.0)
    assert s["itl_p99_ms"] == pytest.approx(1e3 * np.percentile([0.1] * 3 + [0.3] * 3, 99))
    short = workloads.summarize(runs, max_tokens=5)
    assert short["complete"] == 0  # neither got 5 tokens


def test_poisson_prompts_share_their_prefix():
    work = workloads.Poisson(5, 2.0, (3, 6), 8, shared=10)
    arrivals, prompts = work.prompts(vocab=100, seed=1)
    assert arrivals[0] == 0 and np.all(np.diff(arrivals) > 0)
    assert all(p[:10] == prompts[0][:10] and 13 <= len(p) <= 16 for p in prompts)
    assert all(0 < t < 100 for p in prompts for t in p)


def test_breakdown_from_counters():
    text = "\n".join(
        [
            "# TYPE jaxpar:generation_tokens_total counter",
            'jaxpar:generation_tokens_total{model_name="bench"} 90.0',
            'jaxpar:request_success_total{finished_reason="stop",model_name="bench"} 4.0',
            'jaxpar:request_success_total{finished_reason="length",model_name="bench"} 6.0',
            'jaxpar:steps_total{model_name="bench",phase="decode"} 20.0',
            'jaxpar:steps_total{model_name="bench",phase="prefill"} 3.0',
            'jaxpar:step_tokens_total{model_name="bench",phase="decode"} 80.0',
            'jaxpar:step_tokens_computed_total{model_name="bench",phase="decode"} 100.0',
            'jaxpar:step_tokens_total{model_name="bench",phase="prefill"} 48.0',
            'jaxpar:step_tokens_computed_total{model_name="bench",phase="prefill"} 64.0',
            'jaxpar:kv_positions_read_total{model_name="bench",phase="decode"} 400.0',
            'jaxpar:kv_positions_live_total{model_name="bench",phase="decode"} 300.0',
        ]
    )
    parsed = profile.parse_phases(text)
    assert parsed["jaxpar:request_success_total"] == 10.0
    assert parsed["jaxpar:steps_total{decode}"] == 20.0
    assert parsed["jaxpar:steps_total{prefill}"] == 3.0
    counters = {"decode_steps": 20, "decode_seconds": 5.0, "prefill_seconds": 1.5}
    b = profile.breakdown({**parsed, **counters, "insert_seconds": 0.5}, wall_s=8.0)
    assert b["useful_rows_per_step"] == pytest.approx((90 - 10) / 20)
    assert b["decode_s"] == pytest.approx(3.0) and b["decode_ms_per_step"] == pytest.approx(150)
    assert b["outside_loop_s"] == pytest.approx(3.0)
    assert b["decode_padded_rows"] == pytest.approx(0.2)
    assert b["decode_kv_past_rows"] == pytest.approx(0.25)
    assert b["prefill_padded_tokens"] == pytest.approx(0.25)


@pytest.mark.server
def test_quick_workloads_against_jaxpar_serve(tmp_path):
    res = workloads.workloads_section(tmp_path, workloads.TINY, quick=True)
    works, jaxpar = workloads.QUICK, res["jaxpar"]
    for name in ("saturated", "light", "prefix"):
        m, work = jaxpar[name], getattr(works, name)
        assert m["requests"] == m["sent"] == work.requests
        assert m["complete"] == work.requests  # every request got all its tokens
        assert m["output_tokens"] == m["usage_tokens"] == work.requests * work.max_tokens
        for key in ("output_tokens_per_s", "ttft_p50_ms", "tpot_p50_ms", "itl_p99_ms"):
            assert np.isfinite(m[key]) and m[key] > 0, (name, key, m[key])
        p = m["profile"]
        assert p["decode_steps"] >= work.max_tokens - 1 and p["decode_s"] > 0
        assert p["prefill_s"] > 0 and p["prompt_tokens_computed"] > 0
        assert 0 < p["useful_rows_per_step"] <= work.requests
    long = jaxpar["long"]
    assert long["requests"] == works.long.streams and long["long_tokens"] == 8
    assert long["itl_p99_ms"] > 0 and long["tpot_p50_ms"] > 0 and long["long_ttft_ms"] > 0
    # Shared prefix: the server computed fewer prompt tokens than it was sent.
    prefix = works.prefix
    sent = sum(len(p) for p in prefix.prompts(workloads.TINY.vocab_size, seed=42)[1])
    assert jaxpar["prefix"]["profile"]["prompt_tokens_computed"] < sent
    assert "| saturated | output tok/s |" in workloads.markdown(res)
