"""Speculative decoding: its configuration, the n-gram proposer, and the cost model.

:class:`SpeculativeConfig` takes vLLM's ``--speculative-config`` keys (``method``,
``num_speculative_tokens``, ``prompt_lookup_min`` / ``prompt_lookup_max``, ``model``,
``disable_by_batch_size``) and checks them before anything compiles. The method built
is ``ngram``: prompt lookup (Saxena, 2023), which drafts the tokens that followed the
latest earlier occurrence of the request's last ``n`` tokens in its own prompt and
output (:func:`ngram_propose`), no extra weights. ``eagle3`` (an EAGLE-3 head
checkpoint, ``model``) and ``mtp`` (DeepSeek-V3's multi-token-prediction layers, in the
checkpoint ``model`` names, the target's own by default) draft with a head over the
target's hidden states (:mod:`jaxpar.engine._spec_heads`). ``draft_model`` is refused by
name.

:class:`CostModel` decides per step whether speculating pays: it keeps the measured
wall time of a plain decode step and of a verification step per number of rows computed,
and the running acceptance rate, and speculates only when the expected tokens per
second of a verification (the accepted drafts plus one per row) beat a plain step's. At
saturation a verification of ``K + 1`` positions per row costs about ``K + 1`` plain
steps while acceptance stays below that, so speculation switches itself off.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxpar.errors import ConfigError

#: Methods built, and those named by the issue and vLLM that are not (refused by name).
METHODS = ("ngram", "eagle3", "mtp")
NOT_BUILT = ("draft_model", "eagle", "medusa", "mlp_speculator", "deepseek_mtp")
#: The keys :meth:`SpeculativeConfig.parse` takes (vLLM's, plus jaxpar's ``adaptive``).
KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "disable_by_batch_size",
    "adaptive",
)
#: vLLM's n-gram window when neither bound is given.
DEFAULT_LOOKUP = 5
#: The most drafted tokens per step a configuration may ask for.
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How a batcher speculates.

    Attributes:
        method: ``"ngram"`` (prompt lookup), ``"eagle3"`` or ``"mtp"`` (a head).
        num_speculative_tokens: tokens drafted per row per step (``K``).
        prompt_lookup_min / prompt_lookup_max: the n-gram lengths tried, longest first.
        disable_by_batch_size: no speculation while at least this many requests run
            (vLLM's key; None: no such limit).
        adaptive: the cost model may turn speculation off for a step (:class:`CostModel`).
        model: the head's checkpoint directory (``eagle3``: the head; ``mtp``: the
            checkpoint with the MTP layers); None for ``ngram``.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    disable_by_batch_size: int | None = None
    adaptive: bool = True
    model: str | None = None

    def __post_init__(self) -> None:
        _check_method(self.method)
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"speculative config: num_speculative_tokens must be an int in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            n = getattr(self, key)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ConfigError(f"speculative config: {key} must be an int >= 1, got {n!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative config: prompt_lookup_min={self.prompt_lookup_min} must be at "
                f"most prompt_lookup_max={self.prompt_lookup_max}"
            )
        d = self.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ConfigError(
                f"speculative config: disable_by_batch_size must be an int >= 1, got {d!r}"
            )
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative config: adaptive must be a bool, got {self.adaptive!r}")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ConfigError(f"speculative config: model must be a path, got {self.model!r}")
        if self.method == "eagle3" and self.model is None:
            raise ConfigError(
                "speculative config: method 'eagle3' needs 'model', the EAGLE-3 head's "
                "checkpoint directory"
            )

    @classmethod
    def parse(cls, spec: str | Mapping[str, Any] | SpeculativeConfig | None):
        """A config from vLLM's JSON (a string or a mapping); None stays None.

        Raises:
            ConfigError: bad JSON, an unknown key, a bad value, or a method not built.
        """
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(spec, Mapping):
            raise ConfigError(
                f"speculative config must be a JSON object, got {type(spec).__name__}"
            )
        unknown = sorted(set(spec) - set(KEYS))
        if unknown:
            raise ConfigError(
                f"speculative config: unknown key(s) {unknown}; legal keys: {list(KEYS)}"
            )
        fields = dict(spec)
        method = fields.get("method")
        if method is None:
            raise ConfigError(f"speculative config: 'method' is required (one of {list(METHODS)})")
        _check_method(method)
        if "model" in fields and method == "ngram":
            raise ConfigError(
                "speculative config: 'model' names a draft or head checkpoint; method "
                "'ngram' takes none"
            )
        if "num_speculative_tokens" not in fields:
            raise ConfigError("speculative config: 'num_speculative_tokens' is required")
        return cls(**_lookup_bounds(fields))


def _check_method(method: Any) -> None:
    if method in NOT_BUILT:
        raise ConfigError(
            f"speculative config: method {method!r} is not built yet in jaxpar; the methods "
            f"built are {list(METHODS)}"
        )
    if method not in METHODS:
        raise ConfigError(f"speculative config: unknown method {method!r}; legal: {list(METHODS)}")


def _lookup_bounds(fields: dict) -> dict:
    """vLLM's n-gram bounds: one given sets the other; neither: both 5."""
    lo, hi = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = DEFAULT_LOOKUP
    return {**fields, "prompt_lookup_min": hi if lo is None else lo,
            "prompt_lookup_max": lo if hi is None else hi}  # fmt: skip


def ngram_propose(context: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` drafted tokens for ``context`` (the request's prompt and output): for
    ``n`` from ``n_max`` down to ``n_min``, the tokens that followed the latest earlier
    occurrence of the last ``n`` tokens; none if no such ``n``-gram recurs."""
    ids = np.asarray(context, np.int64)
    size = ids.shape[0]
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = ids[size - n :]
        # Windows that start at 0 .. size - n - 1 (the suffix itself excluded).
        windows = np.lib.stride_tricks.sliding_window_view(ids[: size - 1], n)
        hits = np.nonzero((windows == suffix).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + k].tolist()
    return []


@dataclasses.dataclass
class SpecStats:
    """Counters since start, under vLLM's names (``vllm:spec_decode_*``)."""

    num_drafts: int = 0  # rows that had drafts, summed over verification steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    verify_steps: int = 0
    plain_steps: int = 0  # decode steps run without speculation while it was on
    chosen_k: int = 0  # the K the last step chose (0: speculation off)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per drafted row per verification (accepted drafts + 1), vLLM's."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class CostModel:
    """Measured step times and acceptance, and the choice they make (see the module).

    Times are exponential moving averages per number of rows computed: a plain decode
    step's (the decode loop's interval between two steps without speculation) and a
    verification's (dispatch to tokens read). Unmeasured, speculation is tried; when off,
    it is tried again every :attr:`RETRY` steps so that a change of load is noticed.
    """

    RETRY = 32
    DECAY = 0.8

    def __init__(self, k: int, adaptive: bool):
        self.k, self.adaptive = k, adaptive
        self.plain_s: dict[int, float] = {}
        self.verify_s: dict[int, float] = {}
        #: Running fraction of drafted tokens accepted.
        self.acceptance = 0.7
        self._off_streak = 0
        #: The last :meth:`worth_drafting` is a retry: verify whatever the model says.
        self.exploring = False

    def _ema(self, table: dict[int, float], rows: int, seconds: float) -> None:
        old = table.get(rows)
        table[rows] = seconds if old is None else self.DECAY * old + (1 - self.DECAY) * seconds

    def plain(self, rows: int, seconds: float) -> None:
        self._ema(self.plain_s, rows, seconds)

    def verified(self, rows: int, seconds: float, drafted: int, accepted: int) -> None:
        self._ema(self.verify_s, rows, seconds)
        if drafted:
            rate = accepted / drafted
            self.acceptance = self.DECAY * self.acceptance + (1 - self.DECAY) * rate

    def expected_tokens(self, drafts: Sequence[int]) -> float:
        """Expected tokens a verification emits over rows with ``drafts`` drafted tokens
        each, at the running acceptance rate (each draft accepted independently)."""
        a = min(self.acceptance, 0.999)
        return float(sum((1 - a ** (n + 1)) / (1 - a) for n in drafts))

    def pays(self, rows: int, drafts: Sequence[int]) -> bool:
        """Whether a verification of ``drafts`` (drafted tokens per live row) over ``rows``
        rows computed is expected to emit tokens faster than a plain step (unmeasured:
        yes, to measure it)."""
        if not any(drafts):
            return False
        if not self.adaptive:
            return True
        plain, verify = self.plain_s.get(rows), self.verify_s.get(rows)
        if plain is None or verify is None:
            return True
        return self.expected_tokens(drafts) / verify > len(drafts) / plain

    def worth_drafting(self, rows: int, live: int) -> bool:
        """Whether drafting for ``live`` rows could pay at all (every row drafting ``k``);
        while it cannot, every :attr:`RETRY` turns it is tried anyway, so that a change
        of load or acceptance is noticed."""
        self.exploring = False
        if self.pays(rows, [self.k] * live):
            self._off_streak = 0
            return True
        self._off_streak += 1
        if self._off_streak >= self.RETRY:
            self._off_streak, self.exploring = 0, True
            return True
        return False
