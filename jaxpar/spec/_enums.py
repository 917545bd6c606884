"""Vocabulary of the specification: phases, modules, primitives, statuses, logical axes."""

from __future__ import annotations

import enum
from typing import TypeVar

from jaxpar.errors import JaxparError

_E = TypeVar("_E", bound=enum.Enum)


class _NamedEnum(enum.Enum):
    """An enum whose members are also accepted as their lower-case names."""

    @classmethod
    def coerce(cls: type[_E], value: _E | str) -> _E:
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        legal = ", ".join(repr(m.value) for m in cls)
        raise JaxparError(f"unknown {cls.__name__.lower()} {value!r}; legal: {legal}")

    def __str__(self) -> str:
        return self.value


class Phase(_NamedEnum):
    """Inference phase: the whole prompt at once, or one token per sequence per step."""

    PREFILL = "prefill"
    DECODE = "decode"


class Module(_NamedEnum):
    """Modules of a decoder-only Transformer that the specification tables cover."""

    EMBEDDING = "embedding"
    ATTENTION = "attention"
    FFN = "ffn"
    MOE = "moe"
    LM_HEAD = "lm_head"


class Primitive(_NamedEnum):
    """The five parallel primitives; each owns one mesh axis of the same name."""

    DP = "dp"
    PP = "pp"
    SP = "sp"
    EP = "ep"
    TP = "tp"


class Status(_NamedEnum):
    """Legality of a primitive on a module in a phase, as the seed tables word it."""

    ALLOWED = "allowed"
    NOT_ALLOWED = "not_allowed"
    LAYER_ONLY = "layer_only"
    ONLY_IF_MOE = "only_if_moe"
    RARELY_APPLICABLE = "rarely_applicable"


#: Mesh axes, outermost to innermost. TP is innermost so it lands on the fastest links.
MESH_AXES: tuple[str, ...] = ("dp", "pp", "sp", "ep", "tp")

#: Logical axis names and their one-letter keys (used in einsum strings and variable names).
LOGICAL_AXES: dict[str, str] = {
    "batch": "B",
    "seq": "T",
    "cache_seq": "S",
    "embed": "D",
    "heads": "N",
    "kv_heads": "K",
    "head_dim": "H",
    "mlp": "F",
    "vocab": "V",
    "experts": "E",
    "expert_batch": "G",
    "capacity": "C",
    "layers": "L",
    "stage": "P",
    "positions": "Q",
    "pages": "A",  # the decode KV cache's page pool (each batch shard owns its pages)
    "page_pos": "Z",  # token positions inside one page
}
