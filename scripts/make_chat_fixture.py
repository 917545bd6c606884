"""Writes ``tests/fixtures/llama_chat/``: the tiny Llama fixture with text-generation files.

    .venv/bin/python scripts/make_chat_fixture.py

Deterministic (same bytes every run); needs only the ``tokenizers`` library. The model is
``tests/fixtures/hf/llama`` (``config.json`` and ``model.safetensors`` are relative symbolic
links to it, so its weights and reference logits stay as they are); next to them this
writes what a real checkpoint carries for generation:

* ``tokenizer.json``: a WordLevel tokenizer of the model's 256 ids (``<unk>`` 0, ``<s>`` 1,
  ``</s>`` 2, chat markers ``<|system|>`` ``<|user|>`` ``<|assistant|>`` ``<|end|>`` 3-6,
  a few English words, then made-up syllables) whose post-processor prepends ``<s>``, as
  Llama's does;
* ``tokenizer_config.json``: the special tokens and a jinja2 chat template that starts
  with ``bos_token`` and refuses unknown roles with ``raise_exception``;
* ``generation_config.json``: BOS 1, EOS ``[2, 6]`` (``</s>`` and ``<|end|>``), pad 0, greedy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "llama_chat"
MODEL = Path("..") / "hf" / "llama"  # relative to OUT
VOCAB_SIZE = 256  # the model's vocabulary

SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = [
    "hello",
    "world",
    "how",
    "are",
    "you",
    "the",
    "a",
    "is",
    "what",
    "name",
    "your",
    "i",
    "am",
    "fine",
    "thanks",
    "?",
    "!",
    ".",
    ",",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant, not ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|> {{ message['content'] }} <|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> Tokenizer:
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = list(WORDS)
    n = 0
    while len(SPECIALS) + len(words) < VOCAB_SIZE:
        hi, lo = divmod(n, len(syllables))
        words.append(syllables[lo] + (syllables[hi - 1] if hi else ""))
        n += 1
    vocab = {tok: idx for idx, tok in enumerate(SPECIALS + words)}
    assert len(vocab) == VOCAB_SIZE
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
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
        {
            "bos_token_id": 1,
            "eos_token_id": [2, 6],
            "pad_token_id": 0,
            "do_sample": False,
        },
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
