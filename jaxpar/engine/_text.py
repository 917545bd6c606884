"""Text in and out of a checkpoint directory, as Hugging Face ``transformers`` does it.

* ``tokenizer.json``: prompts are encoded with ``add_special_tokens=True``, so the
  tokenizer's post-processor adds what the model expects (a BOS for Llama 3, nothing for
  GPT-2); ids that map to the unknown token are reported.
* ``generation_config.json`` (over ``config.json``): EOS ids (generation stops at them by
  default), BOS and pad ids, and the default sampling (``do_sample``, ``temperature``,
  ``top_k``, ``top_p``).
* ``tokenizer_config.json`` (or ``chat_template.jinja``): the chat template, rendered with
  jinja2 in a sandbox like ``apply_chat_template`` (``messages``, ``add_generation_prompt``,
  ``tools``, the special tokens such as ``bos_token``, ``raise_exception``, ``strftime_now``); the
  rendered text already holds its special tokens, so it is encoded without the
  post-processor's.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

from jaxpar.engine._sampling import Sampling
from jaxpar.errors import ConfigError

# transformers' GenerationConfig defaults, used where do_sample is true and a key is absent.
_HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """What a checkpoint directory says about generation (empty for a preset)."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    sampling: Sampling = Sampling()
    sources: tuple[str, ...] = ()  # the files they were read from
    eos_source: str | None = None  # the file the EOS ids came from


@dataclasses.dataclass(frozen=True)
class Encoded:
    """One prompt's ids, and the pieces of its text that became the unknown token."""

    ids: list[int]
    unknown: list[str]


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _ids(value: Any, path: Path, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ConfigError(f"{path}: {key} must be a token id or a list of them, got {value!r}")
    return tuple(values)


def generation_defaults(directory: str | Path) -> GenerationDefaults:
    """EOS, BOS, pad and default sampling of a checkpoint directory.

    ``generation_config.json`` wins over ``config.json`` key by key, as in transformers.

    Raises:
        ConfigError: an unreadable file or a malformed value (naming file and key).
    """
    directory = Path(directory)
    merged: dict[str, tuple[Any, Path]] = {}
    sources = []
    for name in ("config.json", "generation_config.json"):
        data = _read_json(directory / name)
        if data is None:
            continue
        sources.append(name)
        for key, value in data.items():
            if value is not None or key not in merged:
                merged[key] = (value, directory / name)

    def ids(key: str) -> tuple[int, ...]:
        value, path = merged.get(key, (None, directory))
        return _ids(value, path, key)

    def one(key: str) -> int | None:
        found = ids(key)
        return found[0] if found else None

    sampling = Sampling()
    do_sample, path = merged.get("do_sample", (False, directory))
    if do_sample:
        knobs = {
            k: merged.get(k, (default, path))[0] for k, default in _HF_SAMPLING_DEFAULTS.items()
        }
        try:
            top_k = int(knobs["top_k"] or 0)  # 0 or null: no top-k
            top_p = float(1.0 if knobs["top_p"] is None else knobs["top_p"])  # 1.0: no nucleus
            sampling = Sampling(
                temperature=float(knobs["temperature"]),
                top_k=top_k or None,
                top_p=top_p if top_p < 1.0 else None,
            )
        except (TypeError, ValueError, ConfigError) as e:
            raise ConfigError(f"{path}: sampling defaults: {e}") from e
    return GenerationDefaults(
        eos_token_ids=ids("eos_token_id"),
        bos_token_id=one("bos_token_id"),
        pad_token_id=one("pad_token_id"),
        sampling=sampling,
        sources=tuple(sources),
        eos_source=merged["eos_token_id"][1].name if "eos_token_id" in merged else None,
    )


def load_tokenizer(directory: str | Path):
    """The directory's ``tokenizer.json`` as a ``tokenizers.Tokenizer``, or None."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises its own exception types
        raise ConfigError(f"{path}: cannot read tokenizer: {e}") from e


def _unknown_id(tokenizer) -> int | None:
    model = json.loads(tokenizer.to_str()).get("model", {})
    if model.get("unk_id") is not None:  # Unigram
        return int(model["unk_id"])
    if model.get("unk_token"):  # WordLevel, WordPiece, BPE without byte fallback
        return tokenizer.token_to_id(model["unk_token"])
    return None


def encode(tokenizer, text: str, *, add_special_tokens: bool = True) -> Encoded:
    """Ids of ``text`` (with the post-processor's special tokens unless told otherwise)."""
    encoding = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    unk = _unknown_id(tokenizer)
    unknown = [
        text[start:end] or tokenizer.id_to_token(i)
        for i, (start, end), special in zip(
            encoding.ids, encoding.offsets, encoding.special_tokens_mask, strict=True
        )
        if unk is not None and i == unk and not special
    ]
    return Encoded(list(encoding.ids), unknown)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template and the special tokens it may use."""

    template: str
    special_tokens: dict[str, str]
    source: str

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}]``; an
        assistant's may hold ``tool_calls``, and ``tool`` messages answer them), and the
        ``tools`` offered (OpenAI's ``{"type": "function", "function": {...}}`` each), as
        ``transformers``' ``apply_chat_template`` hands them to the template.

        Raises:
            ConfigError: the template is invalid or calls ``raise_exception``.
        """
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                x,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            return env.from_string(self.template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ConfigError(f"chat template of {self.source}: {e}") from e


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "__type": "AddedToken", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def chat_template(directory: str | Path, tokenizer, defaults: GenerationDefaults) -> ChatTemplate:
    """The chat template of ``tokenizer_config.json`` (or ``chat_template.jinja``).

    Special tokens come from ``tokenizer_config.json``, else from the BOS/EOS ids of
    :func:`generation_defaults` through the tokenizer.

    Raises:
        ConfigError: no chat template in the directory.
    """
    directory = Path(directory)
    config_path = directory / "tokenizer_config.json"
    config = _read_json(config_path) or {}
    template, source = config.get("chat_template"), str(config_path)
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not template and (directory / "chat_template.jinja").is_file():
        source = str(directory / "chat_template.jinja")
        template = (directory / "chat_template.jinja").read_text()
    if not isinstance(template, str) or not template:
        raise ConfigError(
            f"{directory}: no chat template (neither tokenizer_config.json's 'chat_template' "
            "nor chat_template.jinja); run without --chat to use the prompt as it is"
        )
    special = {k: t for k, v in config.items() if k.endswith("_token") and (t := _token_text(v))}
    for key, token_id in (
        ("bos_token", defaults.bos_token_id),
        ("eos_token", (defaults.eos_token_ids or (None,))[0]),
    ):
        known = key not in special and token_id is not None and tokenizer is not None
        if known and (token := tokenizer.id_to_token(token_id)) is not None:
            special[key] = token
    special.setdefault("bos_token", "")
    special.setdefault("eos_token", "")
    return ChatTemplate(template, special, source)


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A checkpoint directory's text side, as ``transformers`` reads it: ``tokenizer.json``,
    the generation defaults (EOS ids, sampling) and the chat template.

    ``Tokenizer.from_dir(path)``; ``encode`` / ``decode`` text, and
    ``apply_chat_template(messages)`` renders and encodes a conversation.
    """

    directory: Path
    tokenizer: Any  # tokenizers.Tokenizer
    defaults: GenerationDefaults
    template: ChatTemplate | None  # None: the directory has no chat template

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        """Reads the directory's tokenizer, generation defaults and chat template.

        Raises:
            ConfigError: no (readable) ``tokenizer.json``.
        """
        directory = Path(directory)
        tokenizer = load_tokenizer(directory)
        if tokenizer is None:
            raise ConfigError(f"{directory / 'tokenizer.json'}: missing (text needs a tokenizer)")
        defaults = generation_defaults(directory)
        try:
            template = chat_template(directory, tokenizer, defaults)
        except ConfigError:
            template = None
        return cls(directory, tokenizer, defaults, template)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.defaults.eos_token_ids

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with the special tokens the model expects (e.g. BOS)."""
        return encode(self.tokenizer, text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (EOS and other special tokens left out by default)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
    ) -> list[int] | str:
        """``messages`` rendered by the chat template: token ids, or the text.

        Raises:
            ConfigError: the directory has no chat template.
        """
        if self.template is None:
            raise ConfigError(f"{self.directory}: no chat template; encode plain text instead")
        text = self.template.render(messages, add_generation_prompt=add_generation_prompt)
        # The rendered text holds its special tokens already.
        return self.encode(text, add_special_tokens=False) if tokenize else text
