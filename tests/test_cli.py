"""The command line, in-process (tests already have 8 simulated CPU devices)."""

from __future__ import annotations

from pathlib import Path

from jaxpar.cli import main

HF_LLAMA = str(Path(__file__).parent / "fixtures" / "hf" / "llama")


def test_demo_prints_plan_tokens_and_match(capsys):
    assert main(["demo", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "prefill: what each mesh axis splits" in out
    assert "decode: what each mesh axis splits" in out
    assert "OK: all 8 sequences match the single-device run" in out


def test_run_hf_with_text_and_ids(capsys):
    code = main(
        [
            "run",
            "--hf",
            HF_LLAMA,
            "--dp",
            "2",
            "--tp",
            "4",
            "--batch",
            "2",
            "--prompt",
            "ba be bi",
            "--prompt",
            "5,6,7",
            "--max-new-tokens",
            "4",
            "--max-seq-len",
            "32",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "'ba be bi' ->" in out
    assert "tokens/s" in out


def test_run_refuses_illegal_strategy_with_message(capsys):
    code = main(["run", "--model", "tiny-dense", "--tp", "3", "--dp", "1", "--prompt", "1,2"])
    out = capsys.readouterr().out
    assert code == 2
    assert "tp-decomposable" in out


def test_text_prompt_without_tokenizer_is_an_error(capsys):
    assert main(["run", "--model", "tiny-dense", "--prompt", "hello there"]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().out
