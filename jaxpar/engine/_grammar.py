"""Structured output: a grammar (JSON schema, regex, choice, Lark/GBNF) that every token of
a request must keep matching, as a per-row token mask the sampler applies.

The grammar engine is `llguidance <https://github.com/guidance-ai/llguidance>`_ (Rust, with
Python bindings), chosen over the other maintained ones because:

* **weight**: one wheel with no Python dependencies (``xgrammar`` requires torch,
  transformers and triton; ``outlines-core`` is as light but does regexes and JSON
  schemas only, compiled to one automaton over the whole vocabulary up front);
* **speed**: it computes each mask lazily from the parser's state (an Earley parser over
  a derivative-based lexer and a token trie), with no per-schema precompilation over the
  vocabulary: its authors give about 50 us per token on a 128k vocabulary (not measured
  here; on the 256-id test tokenizer a schema compiles and masks in well under a
  millisecond);
* **tokenizers**: it reads a ``tokenizers`` JSON (byte-level BPE, SentencePiece-style
  byte fallback, WordLevel) directly, with the checkpoint's EOS ids;
* **maintenance**: it is what vLLM, SGLang (and sglang-jax) and llama.cpp offer as a
  backend, with frequent releases.

The masks are packed bits, ``int32 [B, ceil(V / 32)]`` (bit ``v % 32`` of word
``v // 32`` allows token ``v``), the layout llguidance writes; :func:`allow_only` unpacks
them inside the compiled sampler, so a constrained request changes an input, never a
program. A row without a grammar has every bit set.

A grammar's accepting state allows the checkpoint's EOS ids; when it can take no more
tokens (a JSON document closed, a regex that cannot go on) the request ends there with
finish reason ``"stop"`` (:meth:`Matcher.done`), without drawing an EOS.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import GrammarError

#: Bits per mask word.
WORD_BITS = 32
#: The kinds of :class:`Constraint`.
KINDS = ("json_schema", "regex", "choice", "grammar")
#: JSON schema compile options (a schema's own ``x-guidance`` key overrides them): no
#: whitespace between tokens of the document, so a model cannot pad it forever.
JSON_OPTIONS = {"whitespace_flexible": False}


def mask_words(vocab_size: int) -> int:
    """Words of a packed mask over ``vocab_size`` ids."""
    return -(-vocab_size // WORD_BITS)


def all_allowed(rows: int, vocab_size: int) -> np.ndarray:
    """``int32 [rows, words]`` with every bit set: no constraint."""
    return np.full((rows, mask_words(vocab_size)), -1, np.int32)


def allow_only(logits_BV: jax.Array, allowed_BW: jax.Array) -> jax.Array:
    """``-inf`` at every token whose bit is clear in its row of ``allowed_BW`` (traced).

    Skipped (a ``cond``) when every bit is set, as in a batch with no constrained row.
    """
    b, v = logits_BV.shape
    words = allowed_BW.shape[-1]
    if words * WORD_BITS < v:
        raise GrammarError(f"a mask of {words} words covers {words * WORD_BITS} ids, not {v}")

    def masked(logits_BV):
        shifts_K = jnp.arange(WORD_BITS, dtype=jnp.int32)
        bits_BWK = jnp.right_shift(allowed_BW[:, :, None], shifts_K) & 1
        allowed_BV = bits_BWK.reshape(b, words * WORD_BITS)[:, :v] != 0
        return jnp.where(allowed_BV, logits_BV, -jnp.inf)

    return jax.lax.cond(jnp.all(allowed_BW == -1), lambda x: x, masked, logits_BV)


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What the text of a request must match, before it is compiled for a tokenizer.

    ``kind``: ``"json_schema"`` (``spec``: the schema as JSON text; ``{"type": "object"}``
    is any JSON object), ``"regex"`` (Rust ``regex`` syntax, matched in full),
    ``"choice"`` (``spec``: a JSON list of strings, one of which is the whole text) or
    ``"grammar"`` (a Lark or GBNF grammar, as llguidance reads them).
    """

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"constraint kind must be one of {KINDS}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Constraint:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        return cls("grammar", text)

    def llguidance_grammar(self) -> str:
        """The llguidance grammar of this constraint (not yet checked).

        Raises:
            GrammarError: the spec does not parse (a schema that is not JSON, ...).
        """
        import llguidance

        matcher = llguidance.LLMatcher
        try:
            if self.kind == "json_schema":
                schema = json.loads(self.spec)
                if not isinstance(schema, dict):
                    raise GrammarError(
                        f"invalid json schema: a schema is a JSON object, not "
                        f"{type(schema).__name__}"
                    )
                return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if self.kind == "regex":
                return matcher.grammar_from_regex(self.spec)
            if self.kind == "choice":
                options = json.loads(self.spec)
                if not options or not all(isinstance(o, str) and o for o in options):
                    raise GrammarError("invalid choice: give a non-empty list of non-empty strings")
                return llguidance.grammar_from("choice", options)
            return llguidance.grammar_from("grammar", self.spec)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid {self.kind.replace('_', ' ')}: {e}") from e


class Grammars:
    """Compiles :class:`Constraint` s for one tokenizer and vocabulary.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (or its JSON text), the checkpoint's.
        vocab_size: the model's vocabulary (at least the tokenizer's; ids past the
            tokenizer's are never allowed).
        eos_token_ids: the ids a grammar's accepting state allows (the checkpoint's EOS).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        import llguidance

        if not eos_token_ids:
            raise GrammarError("structured output needs the checkpoint's EOS token id(s)")
        text = tokenizer if isinstance(tokenizer, str) else tokenizer.to_str()
        try:
            self.tokenizer = llguidance.LLTokenizer(
                text, n_vocab=vocab_size, eos_token=[int(t) for t in eos_token_ids]
            )
        except (ValueError, TypeError) as e:
            raise GrammarError(
                f"structured output cannot use this tokenizer (llguidance: {e}); it needs a "
                "tokenizer.json whose decoder spells each token's bytes (byte-level BPE, "
                "SentencePiece byte fallback)"
            ) from e
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    def compile(self, constraint: Constraint) -> Grammar:
        """The constraint checked and compiled for this tokenizer.

        Raises:
            GrammarError: the constraint is invalid (its message says where and why).
        """
        import llguidance

        grammar = constraint.llguidance_grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(f"invalid {constraint.kind.replace('_', ' ')}: {error.strip()}")
        return Grammar(constraint, grammar, self)


@dataclasses.dataclass(frozen=True, eq=False)
class Grammar:
    """A checked :class:`Constraint` for one tokenizer: makes each request's
    :class:`Matcher`."""

    constraint: Constraint
    text: str  # llguidance's grammar
    grammars: Grammars

    @property
    def vocab_size(self) -> int:
        return self.grammars.vocab_size

    def matcher(self) -> Matcher:
        return Matcher(self)


class Matcher:
    """One request's place in its grammar: the mask of its next token, and the tokens it
    drew. Used from one thread at a time (the batcher's)."""

    def __init__(self, grammar: Grammar):
        import llguidance

        self.grammar = grammar
        self._m = llguidance.LLMatcher(grammar.grammars.tokenizer, grammar.text, log_level=0)
        self.words = mask_words(grammar.vocab_size)
        if self._m.is_error():
            raise GrammarError(f"grammar failed to start: {self._m.get_error()}")

    def fill(self, row_W: np.ndarray) -> None:
        """Writes the allowed next tokens into ``row_W`` (``int32``, at least
        :attr:`words` long; its words past them are cleared: padded ids)."""
        row_W[self.words :] = 0
        head = np.ascontiguousarray(row_W[: self.words])
        self._m.unsafe_compute_mask_ptr(head.ctypes.data, head.nbytes)
        row_W[: self.words] = head

    def consume(self, token: int) -> bool:
        """Advances past ``token``; False if the grammar does not allow it."""
        return self._m.consume_token(int(token))

    def rollback(self, n: int) -> None:
        """Undoes the last ``n`` :meth:`consume` (speculative drafts walked through)."""
        self._m.rollback(int(n))

    @property
    def done(self) -> bool:
        """The grammar takes no more tokens (it matched, or it failed: see :attr:`error`)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None if self._m.is_error() else None


def fill_masks(matchers: Sequence[tuple[Matcher, int]], mask_BW: np.ndarray) -> None:
    """Each ``(matcher, row)``'s allowed tokens into ``mask_BW``'s row (others untouched)."""
    for matcher, row in matchers:
        matcher.fill(mask_BW[row])
