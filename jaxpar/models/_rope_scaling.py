"""RoPE frequency scalings a checkpoint may name: Llama 3's, YaRN, linear and dynamic NTK."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from jaxpar.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
    """Llama 3.x RoPE frequency scaling (Hugging Face ``rope_type: "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.low_freq_factor <= 0:
            raise ConfigError(f"rope.scaling: factors must be positive, got {self}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                "rope.scaling: high_freq_factor must exceed low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ConfigError("rope.scaling: original_max_position_embeddings must be positive")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> Llama3RopeScaling:
        """Builds the scaling from a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict."""
        kind = m.get("rope_type", m.get("type", "llama3"))
        if kind != "llama3":
            raise ConfigError(f"rope_scaling type {kind!r} is not supported; legal: 'llama3'")
        try:
            return cls(
                factor=float(m["factor"]),
                low_freq_factor=float(m["low_freq_factor"]),
                high_freq_factor=float(m["high_freq_factor"]),
                original_max_position_embeddings=int(m["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ConfigError(f"rope_scaling of type 'llama3' lacks key {e.args[0]!r}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnRopeScaling:
    """YaRN RoPE scaling (Hugging Face ``rope_type: "yarn"``; GPT-OSS, DeepSeek-V3, Qwen).

    Planes that rotate more than ``beta_fast`` times over the original context keep their
    frequency (extrapolation), planes that rotate less than ``beta_slow`` times are divided
    by ``factor`` (interpolation), with a linear ramp in between; cos and sin are then
    multiplied by :attr:`attention_factor` (the paper's softmax temperature, folded into
    q and k). DeepSeek-V3 additionally scales its softmax by ``mscale(factor,
    mscale_all_dim) ** 2``: that is the model's, not the rotation's.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    #: Explicit cos/sin multiplier; None: derived from ``factor`` (and ``mscale`` /
    #: ``mscale_all_dim`` when both are given).
    attention_factor_override: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    #: Whether the correction range is rounded outwards to whole planes (GPT-OSS: False).
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ConfigError(f"rope.scaling (yarn): factor must be >= 1, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError("rope.scaling (yarn): original_max_position_embeddings must be > 0")
        if self.beta_fast <= 0 or self.beta_slow <= 0:
            raise ConfigError(
                f"rope.scaling (yarn): beta_fast={self.beta_fast} and beta_slow={self.beta_slow} "
                "must be positive"
            )
        if self.attention_factor_override is not None and self.attention_factor_override <= 0:
            raise ConfigError("rope.scaling (yarn): attention_factor must be positive")

    @staticmethod
    def mscale_of(factor: float, mscale: float = 1.0) -> float:
        """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    @property
    def attention_factor(self) -> float:
        """The multiplier of cos and sin."""
        if self.attention_factor_override is not None:
            return self.attention_factor_override
        if self.mscale and self.mscale_all_dim:
            return self.mscale_of(self.factor, self.mscale) / self.mscale_of(
                self.factor, self.mscale_all_dim
            )
        return self.mscale_of(self.factor)

    @classmethod
    def from_mapping(
        cls, m: Mapping[str, Any], max_position_embeddings: int | None = None
    ) -> YarnRopeScaling:
        """Builds the scaling from a Hugging Face ``rope_scaling`` dict; a missing
        ``original_max_position_embeddings`` is ``max_position_embeddings`` (as transformers
        standardises it)."""
        original = m.get("original_max_position_embeddings") or max_position_embeddings
        if original is None:
            raise ConfigError(
                "rope_scaling of type 'yarn' lacks 'original_max_position_embeddings'"
            )
        factor = m.get("factor")
        if factor is None:  # transformers: the ratio of the two context lengths
            if max_position_embeddings is None:
                raise ConfigError("rope_scaling of type 'yarn' lacks 'factor'")
            factor = max_position_embeddings / original
        optional = {
            "attention_factor_override": m.get("attention_factor"),
            "mscale": m.get("mscale"),
            "mscale_all_dim": m.get("mscale_all_dim"),
        }
        return cls(
            factor=float(factor),
            original_max_position_embeddings=int(original),
            # transformers treats 0 / None as the defaults (``or``).
            beta_fast=float(m.get("beta_fast") or 32.0),
            beta_slow=float(m.get("beta_slow") or 1.0),
            truncate=bool(m.get("truncate", True)),
            **{k: None if v is None else float(v) for k, v in optional.items()},
        )


def _factor(m: Mapping[str, Any], kind: str) -> float:
    if m.get("factor") is None:
        raise ConfigError(f"rope_scaling of type {kind!r} lacks key 'factor'")
    return float(m["factor"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearRopeScaling:
    """Linear position interpolation (Hugging Face ``rope_type: "linear"``): every
    inverse frequency divided by ``factor``, i.e. positions ``p`` rotate as ``p / factor``
    (long-context Llama 2 fine-tunes such as LongChat and Vicuna-16k)."""

    factor: float

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ConfigError(f"rope.scaling (linear): factor must be positive, got {self.factor}")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> LinearRopeScaling:
        """Builds the scaling from a Hugging Face ``rope_scaling`` dict."""
        return cls(factor=_factor(m, "linear"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicRopeScaling:
    """Dynamic NTK scaling (Hugging Face ``rope_type: "dynamic"``): plain RoPE up to the
    original context; a sequence of ``L`` positions past it rotates on the base
    ``theta * (factor * L / original - (factor - 1)) ** (H / (H - 2))``.

    ``L`` is what transformers' ``dynamic_rope_update`` takes for a sequence run alone:
    the longest it has been so far (its last position + 1 in the step, as it only grows),
    so each key keeps the rotation of the step that wrote it into the cache. jaxpar
    takes ``L`` per row (its own length), not over the batch: a row's result does not
    depend on its batch-mates. Chunked prefill rotates each chunk's keys on the base of
    that chunk's end, as transformers does when fed the prompt in pieces.
    """

    factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ConfigError(f"rope.scaling (dynamic): factor must be positive, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError(
                "rope.scaling (dynamic): original_max_position_embeddings must be > 0"
            )

    @classmethod
    def from_mapping(
        cls, m: Mapping[str, Any], max_position_embeddings: int | None = None
    ) -> DynamicRopeScaling:
        """Builds the scaling from a Hugging Face ``rope_scaling`` dict; the original
        context is its ``original_max_position_embeddings``, else the config's
        ``max_position_embeddings`` (what transformers' dynamic NTK divides by)."""
        original = m.get("original_max_position_embeddings") or max_position_embeddings
        if original is None:
            raise ConfigError(
                "rope_scaling of type 'dynamic' needs the model's max_position_embeddings "
                "(or 'original_max_position_embeddings')"
            )
        return cls(factor=_factor(m, "dynamic"), original_max_position_embeddings=int(original))


#: The RoPE frequency scalings a :class:`RopeConfig` can carry.
RopeScaling = Llama3RopeScaling | YarnRopeScaling | LinearRopeScaling | DynamicRopeScaling
ROPE_SCALINGS: dict[str, type] = {
    "llama3": Llama3RopeScaling,
    "yarn": YarnRopeScaling,
    "linear": LinearRopeScaling,
    "dynamic": DynamicRopeScaling,
}


def rope_scaling_from_mapping(
    m: Mapping[str, Any], max_position_embeddings: int | None = None
) -> RopeScaling:
    """The scaling a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict names.

    Raises:
        ConfigError: an unknown ``rope_type`` (listing the legal ones) or a missing key.
    """
    kind = m.get("rope_type", m.get("type", "llama3"))
    if kind not in ROPE_SCALINGS:
        raise ConfigError(
            f"rope_scaling type {kind!r} is not supported; legal: "
            + ", ".join(map(repr, ROPE_SCALINGS))
        )
    if kind == "yarn":
        return YarnRopeScaling.from_mapping(m, max_position_embeddings)
    if kind == "dynamic":
        return DynamicRopeScaling.from_mapping(m, max_position_embeddings)
    if kind == "linear":
        return LinearRopeScaling.from_mapping(m)
    return Llama3RopeScaling.from_mapping(m)
