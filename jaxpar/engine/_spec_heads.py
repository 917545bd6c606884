"""Speculative proposers that read the target's hidden states: ``eagle3`` and ``mtp``.

A head (:class:`~jaxpar.models._eagle3.Eagle3Head`, :class:`~jaxpar.models._mtp.MtpHead`)
drafts from pairs of (the target's hidden state at position ``p``, the token at ``p +
1``). The verification step taps those states (:mod:`jaxpar.models._hidden_taps`) at
every position it keeps, so :class:`HeadProposer` keeps, per row, the pairs of its
latest :data:`WINDOW` verified positions on the host. Each drafting turn runs one
program on one device: the head's layer over each row's window (its attention context),
then ``K`` steps, each feeding back the head's own hidden state and its argmax token
(the head's K/V appended in place). The drafted tokens are the head's argmax; the
verification treats them as point proposals, so sampled rows stay exact (see
:mod:`jaxpar.engine._spec_verify`) and greedy rows emit plain greedy tokens whatever
the head's weights.

Differences from vLLM's and SGLang's drafters, both about the head's context only (the
output is the target's either way): the head attends to the last :data:`WINDOW` verified
positions rather than to the whole sequence, and positions that a plain decode step or
the prefill produced carry no tapped state. A row without a state for its latest
position (just prefilled, or after plain steps) drafts nothing for one turn: the
verification then feeds its next token alone, which taps the state it needs (it is
"hungry"). Drafting runs on the scheduling process only: the drafts are host inputs of
the recorded verification, which the other processes replay.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.engine._spec_propose import Ask, Proposal
from jaxpar.errors import ConfigError
from jaxpar.models import Context, HiddenTaps, load_eagle3, load_mtp

#: Methods whose proposer is a head over the target's hidden states.
HEAD_METHODS = ("eagle3", "mtp")
#: Verified positions a row's head attends to.
WINDOW = 32
#: The fewest rows a drafting program computes.
MIN_ROWS = 8
#: Heads loaded per engine, by (method, checkpoint): batchers of one engine share a head
#: (and its compiled drafting programs).
_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class _Row:
    """A row's verified (token, tapped state) pairs: entry ``j`` pairs the state at
    position ``start + j`` with the token at ``start + j + 1``."""

    stream: object
    start: int
    tokens: list[int]
    features: list[np.ndarray]

    @property
    def end(self) -> int:
        """The position after the last entry's: the row's cached length when current."""
        return self.start + len(self.tokens)


def _write(buffer_BC, new_BT, at_B):
    """``new_BT`` written into ``buffer_BC`` at each row's ``at_B`` (axis 1)."""
    return jax.vmap(lambda b, n, i: jax.lax.dynamic_update_slice_in_dim(b, n, i, 0))(
        buffer_BC, new_BT, at_B
    )


@functools.partial(jax.jit, static_argnums=(0, 1))
def _draft(head, k: int, params, tokens_BW, features_BWF, pos_BW, n_B):
    """``k`` argmax tokens per row from ``head`` (see the module); one program per head,
    ``k`` and batch bucket."""
    e_BWD = head.embed(params, tokens_BW)
    h_BWD, k_w, v_w = head.block(
        params, e_BWD, head.feature(params, features_BWF), pos_BW, n_B, None
    )

    def pad(x):
        return jnp.pad(x, [(0, 0), (0, k)] + [(0, 0)] * (x.ndim - 2))

    keys, values = pad(k_w), pad(v_w)
    last_B1 = (n_B - 1)[:, None]
    h_BD = jnp.take_along_axis(h_BWD, last_B1[:, :, None], axis=1)[:, 0]
    pos_B = jnp.take_along_axis(pos_BW, last_B1, axis=1)[:, 0]
    ones_B = jnp.ones_like(n_B)
    out = []
    for j in range(k):
        token_B = head.draft(params, h_BD)
        out.append(token_B)
        if j == k - 1:
            break
        e_B1D = head.embed(params, token_B[:, None])
        pos_B1 = (pos_B + 1 + j)[:, None]
        ctx = Context(keys, values, n_B + j)
        h_B1D, k_new, v_new = head.block(params, e_B1D, h_BD[:, None], pos_B1, ones_B, ctx)
        keys, values = _write(keys, k_new, n_B + j), _write(values, v_new, n_B + j)
        h_BD = h_B1D[:, 0]
    return jnp.stack(out, axis=1)


class HeadProposer:
    """Drafts for a batcher's rows with a head (see the module); ``slots``: the batcher's
    rows (the most a drafting program computes). A
    :class:`~jaxpar.engine._spec_propose.Proposer`: its drafts are argmax tokens (point
    masses, no ``q``); the speculative step also hands it each verification's tapped
    states (:meth:`observe`)."""

    def __init__(self, head, k: int, slots: int):
        self.head, self.k, self.slots = head, k, slots
        self.taps: HiddenTaps = head.taps
        self._rows: dict[int, _Row] = {}
        #: The last :meth:`drafts` left a row without a state for its latest position.
        self.hungry = False

    def observe(self, row: int, stream, start: int, tokens, features_TF: np.ndarray) -> None:
        """A verification kept ``len(tokens)`` positions of ``row`` from ``start`` on and
        emitted ``tokens``: the state at ``start + j`` pairs with ``tokens[j]``."""
        state = self._rows.get(row)
        if state is None or state.stream is not stream or state.end != start:
            state = self._rows[row] = _Row(stream, start, [], [])
        state.tokens.extend(int(t) for t in tokens)
        state.features.extend(features_TF[: len(tokens)])
        drop = len(state.tokens) - WINDOW
        if drop > 0:
            del state.tokens[:drop], state.features[:drop]
            state.start += drop

    def propose(self, asks: list[Ask], cache) -> Proposal:
        """Drafts for ``asks`` (each row's ``k`` at most; :meth:`drafts`)."""
        owners = {a.row: a.stream for a in asks}
        lengths = {a.row: a.length for a in asks}
        wanted = {a.row: a.k for a in asks if a.k}
        return Proposal({a.row: [] for a in asks} | self.drafts(wanted, owners, lengths))

    def verified(self, row: int, length: int) -> None:
        """Nothing: a row's states come with :meth:`observe` (a state that no longer ends
        at the row's length is not drafted from)."""

    def reset(self) -> None:
        self._rows.clear()

    def drafts(self, wanted: dict[int, int], owners: Mapping[int, Any], lengths: Mapping[int, int]):
        """Drafts for the rows of ``wanted`` (row -> most tokens wanted, >= 1) whose state
        is current (it ends at the row's cached length); sets :attr:`hungry` when some
        row's is not. Returns row -> tokens (every row of ``wanted``; ``[]``: none)."""
        for row in [r for r, s in self._rows.items() if owners.get(r) is not s.stream]:
            del self._rows[row]  # the request ended or was preempted
        ready = [r for r in wanted if (s := self._rows.get(r)) is not None and s.end == lengths[r]]
        self.hungry = len(ready) < len(wanted)
        out: dict[int, list[int]] = {r: [] for r in wanted}
        if not ready:
            return out
        # A power of two, at least MIN_ROWS: few programs.
        b = max(len(ready), min(self.slots, max(MIN_ROWS, 1 << (len(ready) - 1).bit_length())))
        width = self._rows[ready[0]].features[0].shape[-1]
        tokens_BW = np.zeros((b, WINDOW), np.int32)
        features_BWF = np.zeros((b, WINDOW, width), np.float32)
        pos_BW = np.zeros((b, WINDOW), np.int32)
        n_B = np.ones(b, np.int32)
        for i, r in enumerate(ready):
            s = self._rows[r]
            n = len(s.tokens)
            tokens_BW[i, :n], features_BWF[i, :n] = s.tokens, np.stack(s.features)
            pos_BW[i, :n] = np.arange(s.start, s.end)
            n_B[i] = n
        drafted_BK = np.asarray(
            _draft(self.head, self.k, self.head.params, tokens_BW, features_BWF, pos_BW, n_B)
        )
        for i, r in enumerate(ready):
            out[r] = drafted_BK[i, : wanted[r]].tolist()
        return out


def load_head(config, engine):
    """The proposer for ``config`` (method ``eagle3`` or ``mtp``) over ``engine``'s model.

    Raises:
        ConfigError: no head checkpoint named, or one that does not fit the target.
    """
    target = engine.model_config
    if config.model is None:
        raise ConfigError(
            f"speculative config: method {config.method!r} needs 'model': "
            + ("the EAGLE-3 head's checkpoint directory" if config.method == "eagle3" else
               "the DeepSeek-V3 checkpoint directory that carries its MTP layers "
               "(engine_from_hf and --hf set it to the model's own)")
        )  # fmt: skip
    if engine.parallel_config.pp > 1:
        raise ConfigError(
            f"speculative config: method {config.method!r} reads the target's hidden states, "
            "which a pipelined (pp > 1) verification does not return yet; use pp=1"
        )
    loaded = _LOADED.setdefault(engine, {})
    key = (config.method, str(Path(config.model).resolve()))
    if key not in loaded:
        if config.method == "mtp":
            loaded[key] = load_mtp(config.model, target)
        else:
            loaded[key] = load_eagle3(config.model, target, lambda: _token_table(engine))
    return HeadProposer(loaded[key], config.num_speculative_tokens, engine.max_batch)


def _token_table(engine) -> np.ndarray:
    """The target's token embedding ``[V, D]`` on the host (for a head without its own)."""
    flat = {tuple(map(str, path)): var for path, var in nnx.to_flat_state(engine.params)}
    table = flat[("embed", "token_table")].get_value()
    if ("embed", "token_table_scale") in flat:
        raise ConfigError(
            "speculative config: the target's embeddings are quantized; give the head its "
            "own embed_tokens.weight"
        )
    if not table.is_fully_addressable:
        raise ConfigError(
            "speculative config: over several processes the head needs its own "
            "embed_tokens.weight (the target's table is not all on this process)"
        )
    return np.asarray(jax.device_get(table), np.float32)
