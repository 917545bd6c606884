"""Speculative decoding: its configuration, the n-gram proposer, and the cost model.

:class:`SpeculativeConfig` takes vLLM's ``--speculative-config`` keys (``method``,
``num_speculative_tokens``, ``prompt_lookup_min`` / ``prompt_lookup_max``, ``model``,
``disable_by_batch_size``) and checks them before anything compiles. The methods
built are ``ngram``: prompt lookup (Saxena, 2023), which drafts the tokens that followed
the latest earlier occurrence of the request's last ``n`` tokens in its own prompt and
output (:func:`ngram_propose`), no extra weights; ``draft_model``: a smaller checkpoint
with the target's vocabulary (``model``: its directory) drafts autoregressively
(:mod:`jaxpar.engine._spec_draft`); ``eagle3`` (an EAGLE-3 head checkpoint, ``model``)
and ``mtp`` (DeepSeek-V3's multi-token-prediction layers, in the checkpoint ``model``
names, the target's own by default) draft with a head over the target's hidden states
(:mod:`jaxpar.engine._spec_heads`). All sit behind the proposer interface of
:mod:`jaxpar.engine._spec_propose`.

:class:`CostModel` chooses per step how many tokens to draft (``0 .. K``; 0: speculation
off): it keeps the measured wall time of a plain decode step and of a verification step
per number of rows computed and drafted tokens, the time a draft model takes per drafted
position, and the running acceptance rate of the batch and of each request, and picks
the ``K`` whose expected tokens per second (the accepted drafts plus one per row) is
highest. At saturation a verification of ``K + 1`` positions per row costs about ``K + 1``
plain steps while acceptance stays below that, so speculation switches itself off.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.errors import ConfigError

#: Methods built, and those named by the issue and vLLM that are not (refused by name).
METHODS = ("ngram", "draft_model", "eagle3", "mtp")
NOT_BUILT = ("eagle", "medusa", "mlp_speculator", "deepseek_mtp")
#: Methods that read a checkpoint (``model``): required, except ``mtp``'s (None: the
#: target's own checkpoint, which :func:`~jaxpar.engine._load.engine_from_hf` sets).
WITH_MODEL = ("draft_model", "eagle3", "mtp")
#: What each method's ``model`` names.
MODEL_WHAT = {
    "draft_model": "the draft checkpoint's directory",
    "eagle3": "the EAGLE-3 head's checkpoint directory",
    "mtp": "the DeepSeek-V3 checkpoint directory that carries its MTP layers",
}
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
        method: ``"ngram"`` (prompt lookup), ``"draft_model"``, ``"eagle3"`` or ``"mtp"``
            (a head).
        num_speculative_tokens: tokens drafted per row per step (``K``).
        prompt_lookup_min / prompt_lookup_max: the n-gram lengths tried, longest first.
        disable_by_batch_size: no speculation while at least this many requests run
            (vLLM's key; None: no such limit).
        adaptive: the cost model chooses each step's ``K`` (0 .. ``num_speculative_tokens``;
            :class:`CostModel`); off: every step drafts ``num_speculative_tokens``.
        model: the checkpoint directory the method reads (``draft_model``: the draft
            model, a Hugging Face checkpoint with the target's vocabulary; ``eagle3``: the
            head; ``mtp``: the checkpoint with the MTP layers, None: the target's); None
            for ``ngram``.
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
        _check_model(self.method, self.model)
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


def _check_model(method: str, model: Any) -> None:
    if method not in WITH_MODEL:
        if model is not None:
            raise ConfigError(
                f"speculative config: 'model' names a draft or head checkpoint; method "
                f"{method!r} takes none"
            )
        return
    if model is None and method == "mtp":
        return  # the target's own checkpoint
    if not isinstance(model, (str, os.PathLike)):
        raise ConfigError(
            f"speculative config: method {method!r} needs 'model': {MODEL_WHAT[method]}, "
            f"got {model!r}"
        )
    if not (Path(model) / "config.json").is_file():
        raise ConfigError(
            f"speculative config: 'model' {str(model)!r} is not a checkpoint directory "
            f"(no config.json there)"
        )


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
    """Counters since start, under vLLM's names (``vllm:spec_decode_*``), and what the cost
    model chose."""

    num_drafts: int = 0  # rows that had drafts, summed over verification steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    verify_steps: int = 0
    plain_steps: int = 0  # decode steps run without speculation while it was on
    chosen_k: int = 0  # the K the last step chose (0: speculation off)
    #: Steps per K chosen (index 0: plain steps while speculation was on).
    steps_by_k: list[int] = dataclasses.field(default_factory=list)
    #: Drafted tokens per drafting row in the last verification (rows' own K, mean).
    row_k_mean: float = 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per drafted row per verification (accepted drafts + 1), vLLM's."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def chose(self, k: int) -> None:
        """A step ran with ``k`` drafted tokens per row at most (0: a plain step)."""
        self.chosen_k = k
        if len(self.steps_by_k) <= k:
            self.steps_by_k.extend([0] * (k + 1 - len(self.steps_by_k)))
        self.steps_by_k[k] += 1


def k_choices(k: int) -> tuple[int, ...]:
    """The drafted-token counts a step may choose: 0, the powers of two below ``k``, and
    ``k`` (each a verification program of its own, so few)."""
    out, j = [0], 1
    while j < k:
        out.append(j)
        j *= 2
    return (*out, k)


class CostModel:
    """Measured step times and acceptance, and the ``K`` they choose (see the module).

    Times are exponential moving averages per number of rows computed: a plain decode
    step's (the decode loop's interval between two steps without speculation), a
    verification's per ``K`` verified (dispatch to tokens read), and a draft model's per
    drafted position. A verification of a ``K`` not measured yet is estimated from the
    nearest measured one, as the plain step plus a cost per drafted position. Acceptance
    is kept for the batch and per request: a request whose drafts are seldom accepted
    drafts fewer (:meth:`row_cap`). Unmeasured, speculation is tried at full ``K``; when
    off, it is tried again every :attr:`RETRY` steps so that a change of load is noticed.
    """

    RETRY = 32
    DECAY = 0.8
    #: A request drafts its ``j``-th token only while its acceptance ``a`` has
    #: ``a ** j`` (the chance that token is reached and kept) at least this.
    ROW_FLOOR = 0.1

    def __init__(self, k: int, adaptive: bool):
        self.k, self.adaptive = k, adaptive
        self.choices = k_choices(k)
        self.plain_s: dict[int, float] = {}
        self.verify_s: dict[tuple[int, int], float] = {}
        self.draft_s: dict[int, float] = {}  # per drafted position (a draft model)
        #: Running fraction of drafted tokens accepted (the batch's, and per request).
        self.acceptance = 0.7
        self.rows: dict[object, float] = {}
        self._off_streak = 0
        #: The last choice is a retry: verify whatever the model says.
        self.exploring = False

    def _ema(self, table: dict, key, seconds: float) -> None:
        old = table.get(key)
        table[key] = seconds if old is None else self.DECAY * old + (1 - self.DECAY) * seconds

    def plain(self, rows: int, seconds: float) -> None:
        self._ema(self.plain_s, rows, seconds)

    def verified(
        self, rows: int, seconds: float, drafted: int, accepted: int, k: int | None = None
    ) -> None:
        """A verification of ``k`` (default the configured ``K``) drafted tokens per row
        over ``rows`` rows took ``seconds``; ``accepted`` of ``drafted`` kept."""
        self._ema(self.verify_s, (rows, self.k if k is None else k), seconds)
        if drafted:
            rate = accepted / drafted
            self.acceptance = self.DECAY * self.acceptance + (1 - self.DECAY) * rate

    def drafted(self, rows: int, seconds: float, positions: int) -> None:
        """A draft model drafted ``positions`` tokens per row over ``rows`` rows."""
        if positions:
            self._ema(self.draft_s, rows, seconds / positions)

    def row_verified(self, key: object, drafted: int, accepted: int) -> None:
        """Request ``key`` had ``accepted`` of its ``drafted`` tokens kept."""
        if drafted:
            old = self.rows.get(key, self.acceptance)
            self.rows[key] = self.DECAY * old + (1 - self.DECAY) * accepted / drafted

    def forget(self, key: object) -> None:
        self.rows.pop(key, None)

    def row_cap(self, key: object) -> int:
        """The most tokens request ``key`` drafts (1 .. ``K``; the whole ``K`` when the cost
        model is off): its ``j``-th while ``a ** j >= ROW_FLOOR``."""
        if not self.adaptive:
            return self.k
        a = self.rows.get(key, self.acceptance)
        cap = 1
        while cap < self.k and a ** (cap + 1) >= self.ROW_FLOOR:
            cap += 1
        return cap

    def expected_tokens(self, drafts: Sequence[int], rates: Sequence[float] | None = None) -> float:
        """Expected tokens a verification emits over rows with ``drafts`` drafted tokens
        each, at the running acceptance rate (or each row's ``rates``; each draft
        accepted independently)."""
        rates = [self.acceptance] * len(drafts) if rates is None else rates
        total = 0.0
        for n, a in zip(drafts, rates, strict=True):
            a = min(a, 0.999)
            total += (1 - a ** (n + 1)) / (1 - a)
        return total

    def verify_time(self, rows: int, k: int) -> float | None:
        """A verification of ``k`` drafts per row over ``rows`` rows (drafting included):
        measured, else estimated from the nearest measured ``K`` (None: nothing to go by)."""
        plain = self.plain_s.get(rows)
        measured = {j: t for (r, j), t in self.verify_s.items() if r == rows}
        draft = self.draft_s.get(rows, 0.0) * k
        if k in measured:
            return measured[k] + draft
        if plain is None or not measured:
            return None
        near = min(measured, key=lambda j: abs(j - k))
        per_position = max(measured[near] - plain, 0.0) / near
        return plain + per_position * k + draft

    def pays(self, rows: int, drafts: Sequence[int], rates: Sequence[float] | None = None) -> bool:
        """Whether a verification of ``drafts`` (drafted tokens per live row) over ``rows``
        rows computed is expected to emit tokens faster than a plain step (unmeasured:
        yes, to measure it)."""
        if not any(drafts):
            return False
        if not self.adaptive:
            return True
        plain, verify = self.plain_s.get(rows), self.verify_time(rows, max(drafts))
        if plain is None or verify is None:
            return True
        return self.expected_tokens(drafts, rates) / verify > len(drafts) / plain

    def best(self, rows: int, caps: Sequence[int], rates: Sequence[float] | None = None) -> int:
        """The choice of :attr:`choices` with the most expected tokens per second for live
        rows that may draft ``caps`` tokens each (0: a plain step; the cost model off: the
        full ``K``). Unmeasured, whichever is not measured yet: a verification of the full
        ``K`` first, then a plain step (a proposer that always drafts would otherwise
        never let one run)."""
        if not any(caps):
            return 0
        if not self.adaptive:
            return self.k
        plain = self.plain_s.get(rows)
        if not any(r == rows for r, _ in self.verify_s):
            return self.k
        if plain is None:  # verification measured, a plain step not: measure one
            return 0
        best, best_rate = 0, len(caps) / plain
        for k in self.choices[1:]:
            drafts = [min(k, c) for c in caps]
            rate = self.expected_tokens(drafts, rates) / self.verify_time(rows, k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def choose(self, rows: int, caps: Sequence[int], rates: Sequence[float] | None = None) -> int:
        """:meth:`best`, and while it is 0, every :attr:`RETRY` turns the full ``K`` anyway
        (:attr:`exploring`), so that a change of load or acceptance is noticed."""
        self.exploring = False
        if not any(caps):
            return 0
        best = self.best(rows, caps, rates)
        if best:
            self._off_streak = 0
            return best
        self._off_streak += 1
        if self._off_streak >= self.RETRY:
            self._off_streak, self.exploring = 0, True
            return self.k
        return 0

    def worth_drafting(self, rows: int, live: int) -> bool:
        """Whether drafting for ``live`` rows could pay at all (every row drafting ``K``;
        :meth:`choose` with those caps is not 0)."""
        return self.choose(rows, [self.k] * live) > 0
