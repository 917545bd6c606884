"""The command line, in-process (tests already have 8 simulated CPU devices)."""

from __future__ import annotations

from pathlib import Path

import pytest

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


# --- serve's prefill flags ------------------------------------------------------------------

CHAT = str(Path(__file__).parent / "fixtures" / "llama_chat")


def _serve_args(*flags: str):
    from jaxpar.cli import _parser

    return _parser().parse_args(["serve", "--hf", CHAT, "--max-seq-len", "32", *flags])


def test_serve_prefill_flags_reach_the_batcher():
    """``--no-prefix-caching`` and ``--max-prefill-tokens`` reach the batcher, disaggregated
    too; without them prefix caching is on (colocated) and the batcher picks the budget."""
    from rich.console import Console

    from jaxpar.cli._serve import _prefill_note, build_batcher

    quiet = Console(quiet=True)
    default = build_batcher(_serve_args(), quiet)
    assert default.prefix_caching is True
    assert isinstance(default.max_prefill_tokens, int) and default.max_prefill_tokens >= 1
    assert _prefill_note(default).endswith("prefix caching on")
    disaggregated = build_batcher(_serve_args("--tp", "4", "--prefill", "sp=4"), quiet)
    assert disaggregated.prefix_caching  # in the prefill devices' own pages
    assert disaggregated.prefill_cache.pages is not disaggregated.pages
    flags = ("--no-prefix-caching", "--max-prefill-tokens", "8")
    for layout in [(), ("--tp", "4", "--prefill", "sp=4")]:
        batcher = build_batcher(_serve_args(*flags, *layout), quiet)
        assert batcher.disaggregated == bool(layout)
        assert (batcher.prefix_caching, batcher.max_prefill_tokens) == (False, 8)
        assert _prefill_note(batcher) == "prefill <= 8 tokens at a time, prefix caching off"


def test_serve_refuses_max_prefill_tokens_below_1(capsys):
    for value in ("0", "-4"):
        assert main(["serve", "--hf", CHAT, "--max-prefill-tokens", value]) == 2
        out = " ".join(capsys.readouterr().out.split())
        assert f"--max-prefill-tokens must be >= 1, got {value}" in out


def test_serve_help_names_the_prefill_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--no-prefix-caching" in out and "--max-prefill-tokens N" in out
