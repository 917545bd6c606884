#!/usr/bin/env python3
"""Build ``tests/fixtures/rope_scalings.npz``: RoPE cos/sin of the ``linear`` and
``dynamic`` (NTK) scalings at positions past the original context, the oracle of
``tests/test_rope_scalings.py``.

The numbers follow transformers' ``modeling_rope_utils`` step for step, in numpy with
torch's dtypes (float32 tensors, Python-float scalars), written out here independently of
jaxpar's implementation (:mod:`jaxpar.models._rope`):

* ``_compute_linear_scaling_rope_parameters``: the default inverse frequencies
  ``1 / base ** (arange(0, dim, 2) / dim)`` divided by ``factor``;
* ``_compute_dynamic_ntk_parameters`` with ``seq_len = max(seq_len, max_position_embeddings)``:
  ``base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))``,
  which ``dynamic_rope_update`` calls with ``seq_len = max(position_ids) + 1`` once a
  sequence grows past the original context (below it the default frequencies stand);
* the rotary forward: ``freqs = inv_freq x positions``, ``emb = cat(freqs, freqs)``,
  ``cos = emb.cos() * attention_scaling`` (1 for both), likewise ``sin``.

transformers itself needs torch, which this project's environment does not install (see
DESIGN §6 and ``scripts/make_hf_fixtures.py``): with ``--check-transformers`` in an
environment that has both, the script also asserts that transformers'
``ROPE_INIT_FUNCTIONS`` give the same inverse frequencies (1e-6 relative). ::

    python scripts/make_rope_fixture.py            # writes tests/fixtures/rope_scalings.npz
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "rope_scalings.npz"
HEAD_DIM, THETA, ORIGINAL = 16, 10000.0, 32
POSITIONS = np.arange(0, 160, 3, dtype=np.int64)  # the original context is 32
CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}
#: Sequence lengths dynamic NTK is evaluated at: within the original context, at it, past it.
DYNAMIC_LENGTHS = (20, 32, 33, 50, 160)


def default_inv_freq(base: float, dim: int) -> np.ndarray:
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(base) ** exponent)).astype(np.float32)


def linear_inv_freq(factor: float) -> np.ndarray:
    return (default_inv_freq(THETA, HEAD_DIM) / np.float32(factor)).astype(np.float32)


def dynamic_inv_freq(factor: float, seq_len: int) -> np.ndarray:
    seq_len = max(seq_len, ORIGINAL)
    base = THETA * ((factor * seq_len / ORIGINAL) - (factor - 1)) ** (HEAD_DIM / (HEAD_DIM - 2))
    return default_inv_freq(base, HEAD_DIM)


def cos_sin(inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    freqs = POSITIONS.astype(np.float32)[:, None] * inv_freq[None, :].astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def build() -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {
        "positions": POSITIONS.astype(np.int32),
        "head_dim": np.int32(HEAD_DIM),
        "theta": np.float32(THETA),
        "original": np.int32(ORIGINAL),
        "linear_factor": np.float32(CASES["linear"]["factor"]),
        "dynamic_factor": np.float32(CASES["dynamic"]["factor"]),
        "dynamic_lengths": np.asarray(DYNAMIC_LENGTHS, np.int32),
    }
    inv = linear_inv_freq(CASES["linear"]["factor"])
    out["linear_inv_freq"] = inv
    out["linear_cos"], out["linear_sin"] = cos_sin(inv)
    for n in DYNAMIC_LENGTHS:
        inv = dynamic_inv_freq(CASES["dynamic"]["factor"], n)
        out[f"dynamic_{n}_inv_freq"] = inv
        out[f"dynamic_{n}_cos"], out[f"dynamic_{n}_sin"] = cos_sin(inv)
    return out


def check_transformers(arrays: dict[str, np.ndarray]) -> None:
    """transformers' own ``ROPE_INIT_FUNCTIONS`` against the arrays (needs torch)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for kind, scaling in CASES.items():
        config = LlamaConfig(
            hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
            max_position_embeddings=ORIGINAL, rope_theta=THETA, rope_scaling=dict(scaling),
        )  # fmt: skip
        lengths = DYNAMIC_LENGTHS if kind == "dynamic" else (None,)
        for n in lengths:
            inv, _ = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=n)
            key = f"dynamic_{n}_inv_freq" if kind == "dynamic" else "linear_inv_freq"
            np.testing.assert_allclose(inv.numpy(), arrays[key], rtol=1e-6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check-transformers", action="store_true")
    args = ap.parse_args()
    arrays = build()
    if args.check_transformers:
        check_transformers(arrays)
    np.savez(args.out, **arrays)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
