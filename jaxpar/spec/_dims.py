"""The few model sizes the spec layer needs, without depending on any model code."""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable


@runtime_checkable
class ModelDims(Protocol):
    """What the validator reads off a model configuration.

    jaxpar's own ``ModelConfig`` satisfies it; users who bring their own Flax model can pass
    any object with these attributes (or a :class:`Dims`).
    """

    @property
    def vocab_size(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def d_ff(self) -> int: ...
    @property
    def n_experts(self) -> int: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dims:
    """Plain-data :class:`ModelDims` for users without a jaxpar ``ModelConfig``."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    n_experts: int = 0

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0


def model_field(model: object, path: str, default: object = None) -> object:
    """A grouped setting of a model, ``path`` dotted as jaxpar's ``ModelConfig`` groups it
    (``"moe.first_dense_layers"``), or ``default`` where the model has none (a :class:`Dims`
    or a user's own :class:`ModelDims` names only the sizes) or it is unset (None)."""
    value = model
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return default
    return value
