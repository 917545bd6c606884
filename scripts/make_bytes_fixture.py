"""Writes ``tests/fixtures/llama_bytes/``: the tiny Llama fixture with a byte-level tokenizer.

    .venv/bin/python scripts/make_bytes_fixture.py

Deterministic (same bytes every run); needs only the ``tokenizers`` library. The model is
``tests/fixtures/hf/llama`` (``config.json`` and ``model.safetensors`` are relative symbolic
links to it, as ``llama_chat``'s are). ``llama_chat``'s word-level tokenizer cannot spell
JSON (no ``{``, ``"`` or digits, and its decoder joins tokens with spaces), so structured
output is tested with this one, which spells any UTF-8 text a byte at a time:

* ``tokenizer.json``: a byte-level BPE (GPT-2's byte-to-character map, no merges) over the
  model's 256 ids: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, chat markers ``<|user|>``
  ``<|assistant|>`` ``<|end|>`` 3-5, then the bytes ``0x00``-``0xF9`` (the bytes it leaves
  out, ``0xFA``-``0xFF``, never occur in UTF-8); its post-processor prepends ``<s>``;
* ``tokenizer_config.json``: the special tokens and a jinja2 chat template;
* ``generation_config.json``: BOS 1, EOS ``[2, 5]`` (``</s>`` and ``<|end|>``), greedy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "llama_bytes"
MODEL = Path("..") / "hf" / "llama"  # relative to OUT
VOCAB_SIZE = 256  # the model's vocabulary

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_chars() -> list[str]:
    """The character byte-level BPE spells each byte with (index: the byte): printable
    Latin-1 bytes stand for themselves, the others for the characters from U+0100 up, in
    byte order (the map GPT-2 introduced, which ``pre_tokenizers.ByteLevel`` uses)."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[b] = chr(b)
        else:
            chars[b] = chr(0x100 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def build_tokenizer() -> Tokenizer:
    n_bytes = VOCAB_SIZE - len(SPECIALS)
    tokens = SPECIALS + byte_chars()[:n_bytes]
    vocab = {tok: idx for idx, tok in enumerate(tokens)}
    assert len(vocab) == VOCAB_SIZE
    assert set(byte_chars()) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        link = OUT / name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(MODEL / name, link)
    assert json.loads((OUT / "config.json").read_text())["vocab_size"] == VOCAB_SIZE
    build_tokenizer().save(str(OUT / "tokenizer.json"))
    write_json(
        OUT / "tokenizer_config.json",
        {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<unk>",
            "chat_template": CHAT_TEMPLATE,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    write_json(
        OUT / "generation_config.json",
        {"bos_token_id": 1, "eos_token_id": [2, 5], "pad_token_id": 0, "do_sample": False},
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
