"""``jaxpar demo`` (issue 11: items 1, 4, 5, 10)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import jaxpar
from jaxpar import ParallelConfig
from jaxpar.cli import _parser, main
from jaxpar.cli._common import model_config
from jaxpar.cli._compare import ERROR_FACTOR, compare_exact, compare_to_float32
from jaxpar.cli._demo import demo_strategy

HF_LLAMA = str(Path(__file__).parent / "fixtures" / "hf" / "llama")


def _strategy(*argv: str, n_devices: int = 8) -> ParallelConfig:
    args = _parser().parse_args(["demo", *argv])
    return demo_strategy(args, model_config(args), n_devices)


@pytest.mark.sweep  # a variant: a pipelined demo (the fast tier's demo: the default below)
def test_pp_demo_runs(capsys):
    # Item 1: the plan table of a pp strategy (pp is layer_only in decode) used to crash rich.
    code = main(
        ["demo", "--model", "tiny-dense", "--pp", "2", "--tp", "4", "--max-new-tokens", "3"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "layers (layer_only)" in out
    assert "OK: all 8 sequences match the single-device run token for token" in out


def test_degrees_given_replace_the_defaults():
    # Item 4: one degree on the command line replaces the whole default strategy.
    assert _strategy("--model", "tiny-dense", "--tp", "8") == ParallelConfig(tp=8)
    assert _strategy("--model", "tiny-moe", "--ep", "8") == ParallelConfig(ep=8)
    assert _strategy("--model", "tiny-moe", "--pp", "2", "--tp", "4") == ParallelConfig(pp=2, tp=4)


def test_default_strategy_fits_the_model_and_the_devices():
    moe, dense = _strategy("--model", "tiny-moe"), _strategy("--model", "tiny-dense")
    assert moe == ParallelConfig(sp=2, ep=2, tp=2)
    assert dense.ep == 1 and dense.size == 8  # a dense model's default has no ep
    assert _strategy("--hf", HF_LLAMA).ep == 1
    for n_devices in (1, 2, 4):
        for argv in (("--model", "tiny-moe"), ("--model", "tiny-dense"), ("--hf", HF_LLAMA)):
            chosen = _strategy(*argv, n_devices=n_devices)
            assert chosen.size <= n_devices
            args = _parser().parse_args(["demo", *argv])
            jaxpar.validate(
                model_config(args), chosen, n_devices=chosen.size, batch=8, max_seq_len=64
            )


def test_demo_of_a_dense_checkpoint_by_default(capsys):
    code = main(["demo", "--hf", HF_LLAMA, "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"strategy dp=2,sp=2,tp=2 \(default\)", out), out


def test_demo_help_lists_presets_and_default_degrees(capsys):
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["demo", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    from jaxpar.models import PRESETS

    for name in PRESETS:
        assert name in text
    assert "MoE models: sp=2,ep=2,tp=2" in text and "dense models (no ep): dp=2,sp=2,tp=2" in text
    assert "--dtype" in text


# --- item 5: lower precision --------------------------------------------------------------


def _logits(rng, steps=4, rows=3, vocab=16):
    return rng.normal(size=(steps, rows, vocab)).astype(np.float32)


def test_float32_demands_identical_tokens():
    same = compare_exact([[1, 2], [3, 4]], [[1, 2], [3, 4]])
    assert same.ok and same.rows_identical == 2
    flipped = compare_exact([[1, 2], [3, 5]], [[1, 2], [3, 4]])
    assert not flipped.ok and flipped.divergences == ((1, 1, None),)


def test_low_precision_passes_a_near_tie_and_fails_a_wrong_result():
    rng = np.random.default_rng(0)
    exact = _logits(rng)
    single = exact + rng.normal(scale=1e-2, size=exact.shape).astype(np.float32)  # rounding
    sharded = exact + rng.normal(scale=1.5e-2, size=exact.shape).astype(np.float32)
    reference = [list(map(int, exact[:, r].argmax(-1))) for r in range(3)]
    tokens = [list(t) for t in reference]
    tokens[1][2] = int(np.argsort(single[2, 1])[-2])  # a flip to the runner-up token
    near_tie = compare_to_float32(tokens, reference, sharded, single, exact)
    assert near_tie.ok, near_tie
    assert near_tie.rows_identical == 2 and [d[:2] for d in near_tie.divergences] == [(1, 2)]
    gap = single[2, 1, reference[1][2]] - single[2, 1, tokens[1][2]]
    assert near_tie.divergences[0][2] == pytest.approx(gap)
    wrong = exact + rng.normal(scale=ERROR_FACTOR * 2e-2, size=exact.shape).astype(np.float32)
    assert not compare_to_float32(reference, reference, wrong, single, exact).ok


@pytest.mark.sweep  # a variant: bf16 (its tolerance rule stays, above)
def test_bf16_demo_reports_tolerance_and_token_agreement(capsys):
    code = main(
        [
            "demo",
            "--model",
            "tiny-dense",
            "--dtype",
            "bfloat16",
            "--tp",
            "2",
            "--max-new-tokens",
            "4",
        ]
    )
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0, out
    assert re.search(r"tokens: \d of 8 sequences identical to the single-device run", out)
    assert f"tolerance: ratio <= {ERROR_FACTOR:g}" in out
    assert "OK (bfloat16)" in out and "MISMATCH" not in out
