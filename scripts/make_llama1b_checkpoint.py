"""Writes a Llama-3.2-1B-shaped checkpoint with random weights, for cold-start timing.

    .venv/bin/python scripts/make_llama1b_checkpoint.py /tmp/llama1b

The shapes are Llama-3.2-1B's (hidden 2048, 16 layers, 32 query heads, 8 KV heads,
intermediate 8192, vocabulary 128256, tied embeddings, rope scaling "llama3"); the
weights are random (bf16, ~2.5 GB: write it outside the repository). A WordLevel
tokenizer names every id (``t0`` ... ``t128255``; BOS 128000, EOS 128001, as Llama 3's
ids), so any token the random model draws decodes. Deterministic for a given ``--seed``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 2048, 16, 32, 8, 8192, 128256
HEAD_DIM = HIDDEN // HEADS
BOS, EOS = 128000, 128001

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": INTERMEDIATE,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "num_key_value_heads": KV_HEADS,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": VOCAB,
}


def _shapes() -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes ([out, in] for linear layers); no lm_head (tied)."""
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    kv = KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        }
    return shapes


def _tensor(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    if len(shape) == 1:  # norm scales
        return np.ones(shape, ml_dtypes.bfloat16)
    std = 0.02
    return (rng.standard_normal(shape, np.float32) * std).astype(ml_dtypes.bfloat16)


def _tokenizer() -> Tokenizer:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab["<|begin_of_text|>"] = BOS
    vocab["<|end_of_text|>"] = EOS
    del vocab[f"t{BOS}"], vocab[f"t{EOS}"]
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", BOS)]
    )
    return tok


def write(out: Path, seed: int = 0) -> None:
    """Writes config.json, model.safetensors, tokenizer files and generation_config.json."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {name: _tensor(rng, shape) for name, shape in _shapes().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    _tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
        + "\n"
    )
    generation = {"bos_token_id": BOS, "eos_token_id": EOS, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write (outside the repository)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.out, args.seed)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
