"""The one exception hierarchy of jaxpar.

Every error jaxpar raises on bad input derives from :class:`JaxparError` and is raised
before anything is traced or compiled. Messages name what is wrong, where, which rule of
the specification forbids it, and what would be legal.
"""

from __future__ import annotations


class JaxparError(Exception):
    """Base class of every error jaxpar raises on purpose."""


class SpecFileError(JaxparError):
    """A file under ``sharding_specs/`` is malformed (names file and key)."""


class IllegalStrategyError(JaxparError):
    """A parallel strategy breaks a rule of the specification tables.

    ``violations`` lists each broken rule (``rule``, ``module``, ``primitive``, ``phase``,
    ``message``) when the validator raised it.
    """

    def __init__(self, message: str, violations: tuple | list = ()) -> None:
        super().__init__(message)
        self.violations = tuple(violations)

    @property
    def rules(self) -> tuple[str, ...]:
        return tuple(v.rule for v in self.violations)


class ShapeError(JaxparError):
    """A size does not divide, or an input has the wrong shape, dtype or range."""


class MeshError(JaxparError):
    """The device mesh cannot be built for the requested degrees."""


class ConfigError(JaxparError):
    """A model or engine configuration is inconsistent."""


class CheckpointError(JaxparError):
    """A checkpoint is unsupported, incomplete, mis-shaped or corrupt."""


class CacheOverflowError(ShapeError):
    """A write to the KV cache would go past ``max_seq_len``."""


class GrammarError(JaxparError):
    """A structured-output constraint (JSON schema, regex, choice, grammar) is invalid, or
    cannot be used with this tokenizer or request."""


class QueueFullError(JaxparError):
    """A serving engine refused a request: its queue is full or it is shutting down."""


class DistributedError(JaxparError):
    """Multi-process start-up or communication failed."""


class PeerLostError(DistributedError):
    """Another process of the job died or became unreachable while this one needed it."""


class InfeasiblePlanError(JaxparError):
    """No legal strategy fits the request on the devices given (``jaxpar plan``).

    ``min_devices`` is the smallest device count on which one would fit (None when none up to
    the search limit does).
    """

    def __init__(self, message: str, min_devices: int | None = None) -> None:
        super().__init__(message)
        self.min_devices = min_devices
