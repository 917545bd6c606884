"""Options and set-up shared by the subcommands."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from jaxpar.errors import ConfigError
from jaxpar.spec import ParallelConfig


def force_cpu_devices(n: int) -> None:
    """Asks for ``n`` simulated devices when running on the CPU (before JAX starts)."""
    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def add_model_args(parser: argparse.ArgumentParser, default_model: str) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help=f"model preset (default {default_model})")
    source.add_argument("--hf", type=Path, default=None, help="Hugging Face checkpoint directory")
    parser.set_defaults(default_model=default_model)


def add_degree_args(parser: argparse.ArgumentParser, defaults: dict[str, int]) -> None:
    for axis in ("dp", "pp", "sp", "ep", "tp"):
        parser.add_argument(f"--{axis}", type=int, default=defaults.get(axis, 1), help=f"{axis} degree")
    parser.add_argument("--microbatches", type=int, default=1, help="prefill pipeline microbatches (pp > 1)")
    parser.add_argument("--decode-groups", type=int, default=1, help="decode pipeline groups (pp > 1)")


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(
        dp=args.dp, pp=args.pp, sp=args.sp, ep=args.ep, tp=args.tp,
        microbatches=args.microbatches, decode_groups=args.decode_groups,
    )


def load_model(args: argparse.Namespace, *, seed: int = 0):
    """(config, params, tokenizer or None) from ``--model`` or ``--hf``."""
    from jaxpar.models import init_params, load_hf_checkpoint, preset

    if args.hf is not None:
        config, params = load_hf_checkpoint(args.hf)
        return config, params, load_tokenizer(args.hf)
    config = preset(args.model or args.default_model)
    return config, init_params(config, seed), None


def load_tokenizer(directory: Path):
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises its own exception types
        raise ConfigError(f"{path}: cannot read tokenizer: {e}") from e


def parse_prompt(text: str, tokenizer) -> list[int]:
    """Token ids from ``"1,2,3"``, or text through the tokenizer when there is one."""
    stripped = text.replace(",", " ").split()
    if stripped and all(tok.lstrip("-").isdigit() for tok in stripped):
        return [int(tok) for tok in stripped]
    if tokenizer is None:
        raise ConfigError(
            f"prompt {text!r} is text but the model has no tokenizer.json; give token ids like '1,2,3'"
        )
    return tokenizer.encode(text).ids
