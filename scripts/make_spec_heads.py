"""Fixture heads for speculative decoding's ``eagle3`` and ``mtp`` methods.

* ``eagle3``: an EAGLE-3 head directory in the layout vLLM and SGLang load (config.json
  with ``LlamaForCausalLMEagle3``, ``draft_vocab_size`` and
  ``eagle_aux_hidden_state_layer_ids``; ``model.safetensors`` with ``fc``, ``midlayer.*``,
  ``norm``, ``lm_head``, ``d2t`` and ``t2d``) for a target of the given sizes. The draft
  vocabulary is a random subset of the target's (so ``d2t`` maps ids for real).
* ``mtp``: a copy of a DeepSeek-V3 checkpoint with one multi-token-prediction layer
  added under ``model.layers.{L}.`` (``enorm``, ``hnorm``, ``eh_proj``, the block, named as
  the last decoder layer's tensors, and ``shared_head``), in a file of its own.

Random weights: the heads propose nonsense, which is fine for what the tests check
(speculation is lossless whatever the proposals; the full-acceptance test constructs
its proposals). Small enough to make at test time::

    python scripts/make_spec_heads.py eagle3 OUT --d-model 64 --vocab 256 --layers 4
    python scripts/make_spec_heads.py mtp OUT --from tests/fixtures/hf/deepseek_v3
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file


def make_eagle3_head(
    out: str | Path,
    *,
    d_model: int,
    vocab: int,
    n_layers: int,
    seed: int = 0,
    draft_vocab: int | None = None,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    d_ff: int = 96,
) -> Path:
    """Writes a random EAGLE-3 head for a target of ``d_model``, ``vocab`` and
    ``n_layers`` into ``out``; returns ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    draft_vocab = draft_vocab or vocab // 2
    hd = d_model // n_heads
    layers = [1, n_layers // 2, n_layers - 1]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": d_model,
        "intermediate_size": d_ff,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": d_model,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers},
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }

    def linear(n_out: int, n_in: int) -> np.ndarray:
        return rng.normal(0, n_in**-0.5, (n_out, n_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.normal(size=n)).astype(np.float32)

    kept = np.sort(rng.choice(vocab, draft_vocab, replace=False))
    t2d = np.zeros(vocab, bool)
    t2d[kept] = True
    tensors = {
        "fc.weight": linear(d_model, 3 * d_model),
        "midlayer.input_layernorm.weight": norm(d_model),
        "midlayer.hidden_norm.weight": norm(d_model),
        "midlayer.post_attention_layernorm.weight": norm(d_model),
        "midlayer.self_attn.q_proj.weight": linear(n_heads * hd, 2 * d_model),
        "midlayer.self_attn.k_proj.weight": linear(n_kv_heads * hd, 2 * d_model),
        "midlayer.self_attn.v_proj.weight": linear(n_kv_heads * hd, 2 * d_model),
        "midlayer.self_attn.o_proj.weight": linear(d_model, n_heads * hd),
        "midlayer.mlp.gate_proj.weight": linear(d_ff, d_model),
        "midlayer.mlp.up_proj.weight": linear(d_ff, d_model),
        "midlayer.mlp.down_proj.weight": linear(d_model, d_ff),
        "norm.weight": norm(d_model),
        "lm_head.weight": linear(draft_vocab, d_model),
        "d2t": (kept - np.arange(draft_vocab)).astype(np.int64),
        "t2d": t2d,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def add_mtp_layer(source: str | Path, out: str | Path, *, seed: int = 0) -> Path:
    """Copies the DeepSeek-V3 checkpoint ``source`` to ``out`` with one random MTP layer
    added (``num_nextn_predict_layers: 1``); returns ``out``."""
    source, out = Path(source), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    n, d = config["num_hidden_layers"], config["hidden_size"]
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for file in source.glob("*.safetensors"):
        shutil.copyfile(file, out / file.name)
    rng = np.random.default_rng(seed)
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    tensors = {}
    for file in source.glob("*.safetensors"):
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                if name.startswith(last):  # the block: the last layer's kind, perturbed
                    value = f.get_tensor(name)
                    noise = 0.05 * rng.normal(size=value.shape) * (value.std() + 1e-3)
                    tensors[mtp + name[len(last) :]] = (value + noise).astype(value.dtype)
    tensors.update({
        mtp + "enorm.weight": np.ones(d, np.float32),
        mtp + "hnorm.weight": np.ones(d, np.float32),
        mtp + "eh_proj.weight": rng.normal(0, (2 * d) ** -0.5, (d, 2 * d)).astype(np.float32),
        mtp + "shared_head.norm.weight": np.ones(d, np.float32),
        mtp + "shared_head.head.weight": rng.normal(
            0, d**-0.5, (config["vocab_size"], d)
        ).astype(np.float32),
    })  # fmt: skip
    save_file(tensors, str(out / "model-mtp.safetensors"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    eagle = sub.add_parser("eagle3", help="an EAGLE-3 head for a target of these sizes")
    eagle.add_argument("out")
    eagle.add_argument("--d-model", type=int, required=True)
    eagle.add_argument("--vocab", type=int, required=True)
    eagle.add_argument("--layers", type=int, required=True)
    eagle.add_argument("--seed", type=int, default=0)
    mtp = sub.add_parser("mtp", help="a DeepSeek-V3 checkpoint with an MTP layer added")
    mtp.add_argument("out")
    mtp.add_argument("--from", dest="source", required=True)
    mtp.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.kind == "eagle3":
        make_eagle3_head(
            args.out, d_model=args.d_model, vocab=args.vocab, n_layers=args.layers, seed=args.seed
        )
    else:
        add_mtp_layer(args.source, args.out, seed=args.seed)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
