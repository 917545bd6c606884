"""The continuous batcher's device work, driven by host values only.

:class:`ContinuousBatcher` decides (which requests, rows, pages, sampling rows); an
:class:`Executor` dispatches the programs those decisions call for and holds what lives
on the devices: the decode slots (and, disaggregated, the prefill group's own), and the
prefilled batches between their prefill and their insert, by handle. Its *commands*
(:meth:`Executor.prefill`, :meth:`~Executor.insert`, :meth:`~Executor.step`, ...) take
host arrays and ints only, and hand out handles in call order, so running the same
commands in the same order on another process dispatches the same programs on the same
inputs and leaves it in the same device state. That is how a multi-process job serves
(:mod:`jaxpar.engine._lockstep`): process 0 schedules, records each command before it
runs, and every other process replays the record. Its *reads* (:meth:`~Executor.tokens`)
bring a command's replicated outputs to the host; only the scheduling process calls
them (a replaying process keeps no outputs), and in a multi-process job they first send
the commands recorded so far, since the outputs wait for every process's share.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxpar.engine._engine import InferenceEngine
from jaxpar.engine._group_transfer import (
    device_put_all,
    move_tree,
    moves_globally,
    put_tree,
)
from jaxpar.engine._kv_regroup import regroup_kv
from jaxpar.engine._logprobs import Logprobs
from jaxpar.engine._penalties import History
from jaxpar.engine._placement import put_global
from jaxpar.engine._sampling import RowSampling
from jaxpar.engine._slots import FirstTokens, Inserted, KVQuantizer, SlotSteps
from jaxpar.engine._spec_verify import VerifySteps
from jaxpar.models import HiddenTaps

#: The two page pools a batcher's commands name: the decode rows' own, and the prefill
#: group's (disaggregated; colocated, it is the decode pool).
DECODE, PREFILL = "decode", "prefill"


class Recorder:
    """Where commands go before they run (process 0 of a multi-process job)."""

    def record(self, name: str, args: tuple, kwargs: dict) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Returns once what was recorded has been sent (a recorder may send it earlier,
        as :class:`~jaxpar.engine._lockstep.Leader` does); called before a read waits for
        the devices."""
        raise NotImplementedError


def command(method: Callable) -> Callable:
    """A method that changes device state: recorded before it runs, under the lock that
    keeps the recorded order the order of dispatch (the decode and prefill loops of a
    disaggregated batcher both call commands)."""

    @functools.wraps(method)
    def run(self: Executor, *args, **kwargs):
        with self._lock:
            if self.recorder is not None:
                self.recorder.record(method.__name__, args, kwargs)
            return method(self, *args, **kwargs)

    run.is_command = True
    return run


def read(method: Callable) -> Callable:
    """A method that brings outputs to the host: the recorded commands are sent first
    (their programs cannot finish before every process has dispatched them)."""

    @functools.wraps(method)
    def run(self: Executor, *args, **kwargs):
        if not self.keeps_outputs:
            raise RuntimeError("a replaying executor reads nothing back")
        if self.recorder is not None:
            with self._lock:
                self.recorder.flush()
        return method(self, *args, **kwargs)

    return run


@dataclasses.dataclass
class StepOutputs:
    """What one command left to read: tokens ``[rows]``, logprobs, MoE drops (device)."""

    tokens: jax.Array | None
    logprobs: Logprobs | None
    dropped: jax.Array | None


@dataclasses.dataclass(frozen=True)
class HostTokens:
    """A read: tokens, logprobs (None unless asked) and dropped MoE assignments."""

    tokens: np.ndarray
    logprobs: Logprobs | None
    dropped: int


class Executor:
    """Dispatches the batcher's programs and keeps their device state.

    Args:
        engine: decode (its slots and step).
        prefill_engine: prefill (the same engine when colocated).
        slot_steps: the decode rows' programs.
        prefill_slot_steps: the prefill group's own pages' programs (disaggregated only).
        first_tokens: the first-token draw on the prefill devices.
        keeps_outputs: False on a process that replays: outputs are never read there.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        prefill_engine: InferenceEngine,
        slot_steps: SlotSteps,
        prefill_slot_steps: SlotSteps | None,
        first_tokens: FirstTokens,
        *,
        keeps_outputs: bool = True,
    ):
        self.engine = engine
        self.prefill_engine = prefill_engine
        #: A quantized decode cache: prefilled K/V are quantized before they cross (None:
        #: the decode cache holds the prefill's dtype).
        mode = engine.options.kv_cache_dtype
        self.kv_quantizer = None if mode is None else KVQuantizer(prefill_engine.steps, mode)
        self._slot_steps = {DECODE: slot_steps, PREFILL: prefill_slot_steps or slot_steps}
        self._shared = prefill_slot_steps is None  # one pool for prefill and decode
        self.first_tokens = first_tokens
        self.keeps_outputs = keeps_outputs
        self.recorder: Recorder | None = None
        self._lock = threading.RLock()
        self._slots: dict[str, Any] = {}
        self._batches: dict[int, Inserted] = {}
        self._outputs: dict[int, StepOutputs] = {}
        self._handles = 0
        self._tables: jax.Array | None = None
        self._rows_bucket = 0
        #: The prefix cache's host tier's memory (:mod:`._host_pages`; None: no host tier).
        self.host_pages = None
        self._verify = None  # speculative decoding's verification (built on first use)
        self._features: dict[int, Any] = {}  # a verification's tapped hidden states
        #: The prefill group holds none of process 0's devices (disaggregated across
        #: processes): what process 0 reads of a prefill (first tokens, logprobs) moves to
        #: the decode devices first, on every process.
        self._remote_prefill = jax.process_count() > 1 and all(
            d.process_index != 0 for d in prefill_engine.layouts.replicated.mesh.devices.flat
        )

    def _pool(self, side: str) -> str:
        return DECODE if self._shared else side

    def _handle(self) -> int:
        self._handles += 1
        return self._handles

    # --- commands ------------------------------------------------------------------------

    @command
    def start(self) -> None:
        """Every row free and every page zero, on each pool."""
        for side in (DECODE, PREFILL):
            if self._pool(side) not in self._slots:
                self._slots[self._pool(side)] = self._slot_steps[side].empty()

    @command
    def prefill(
        self,
        tokens_PT: np.ndarray,
        lengths_P: np.ndarray,
        *,
        side: str,
        final: bool,
        sampling_P: RowSampling,
        steps_P: np.ndarray,
        history: History | None,
        starts_P: np.ndarray | None = None,
        pages_PN: np.ndarray | None = None,
        allowed_PW: np.ndarray | None = None,
    ) -> int:
        """Prefills ``tokens_PT`` (after the cached context in ``side``'s pages ``pages_PN``
        from ``starts_P`` on, when given) and, when ``final``, draws each row's first token
        (under its token mask ``allowed_PW``: structured output; None: every token
        allowed); returns the batch's handle (its outputs read by :meth:`tokens`)."""
        eng = self.prefill_engine
        lay = eng.layouts
        tokens = put_global(tokens_PT, lay.tokens_BT)
        lengths = put_global(lengths_P, lay.lengths_prefill_B)
        if pages_PN is not None:
            slots = self._slots[self._pool(side)]
            ctx_k, ctx_v = self._slot_steps[side].context(slots, pages_PN, lay.kv_prefill)
            starts = put_global(starts_P, lay.lengths_prefill_B)
            logits_PV, k, v = eng.steps.prefill_context(
                eng.params, tokens, lengths, starts, ctx_k, ctx_v
            )
        else:
            logits_PV, k, v = eng.steps.prefill(eng.params, tokens, lengths)
        dropped = eng.steps.last_dropped.get("prefill") if eng.steps.counts_drops else None
        rows = tokens_PT.shape[0]
        if final:
            history = history or History.empty(rows, self.first_tokens.history_width)
            first_P, logprobs = self.first_tokens(
                logits_PV, sampling_P, steps_P, history, allowed_PW
            )
        else:
            first_P = put_global(np.zeros(rows, np.int32), lay.replicated)
            logprobs = None
        handle = self._handle()
        self._batches[handle] = Inserted(k=k, v=v, lengths_P=lengths, first_P=first_P)
        if final or dropped is not None:
            outputs = self._readable(StepOutputs(first_P, logprobs, dropped))
            if self.keeps_outputs:
                self._outputs[handle] = outputs
        return handle

    def _readable(self, outputs: StepOutputs) -> StepOutputs:
        """A prefill's ``outputs`` where process 0 can read them: as they are, or moved
        to the decode devices (replicated) when the prefill group is on other processes
        (every process moves them: the move is one program over both groups)."""
        if not self._remote_prefill:
            return outputs
        leaves, treedef = jax.tree.flatten((outputs.tokens, outputs.logprobs, outputs.dropped))
        targets = [self.engine.layouts.replicated] * len(leaves)
        return StepOutputs(*jax.tree.unflatten(treedef, move_tree(leaves, targets)))

    @command
    def insert(
        self,
        handle: int,
        slot_P: np.ndarray,
        pages_PN: np.ndarray,
        *,
        side: str,
        steps_P: np.ndarray,
        sampling_P: RowSampling,
        starts_P: np.ndarray,
        history: History | None,
        keep: bool = False,
    ) -> None:
        """Writes batch ``handle`` into ``side``'s rows ``slot_P`` and pages ``pages_PN``
        (see :meth:`SlotSteps.insert`); the batch is dropped unless ``keep``."""
        pool = self._pool(side)
        batch = self._batches[handle] if keep else self._batches.pop(handle)
        self._slots[pool] = self._slot_steps[side].insert(
            self._slots[pool], batch, slot_P, pages_PN, steps_P, sampling_P, starts_P, history
        )

    @command
    def read_back(self, handle: int, pages_PN: np.ndarray, lengths_P: np.ndarray, length: int):
        """Disaggregated: batch ``handle`` becomes its rows' whole K/V from the first token
        on, read back from the prefill group's pages (context and new tokens)."""
        eng = self.prefill_engine
        pool = self._slots[self._pool(PREFILL)]
        k, v = self._slot_steps[PREFILL].context(pool, pages_PN, eng.layouts.kv_prefill, length)
        lengths = put_global(lengths_P, eng.layouts.lengths_prefill_B)
        first_P = self._batches[handle].first_P
        self._batches[handle] = Inserted(k=k, v=v, lengths_P=lengths, first_P=first_P)

    @command
    def transfer(self, handle: int) -> int:
        """Moves batch ``handle`` onto the decode devices (their prefill layout); returns
        the bytes moved."""
        lay, new = self.engine.layouts, self._batches[handle]
        if self.kv_quantizer is not None:  # the K/V cross quantized, with their scales
            new = self.kv_quantizer(new)
        have = self.prefill_engine.run.kv_head_replicas
        want = self.engine.run.kv_head_replicas
        # Several processes: one program over both groups moves device to device.
        move = move_tree if moves_globally() else device_put_all
        rows = (new.lengths_P, new.first_P), (lay.lengths_prefill_B, lay.replicated)
        if have == want:  # one move for K, V and the rows
            kv_rows = (new.k, new.v, *rows[0])
            (k, v, *moved_rows), moved_bytes = put_tree(
                kv_rows, (lay.kv_prefill, lay.kv_prefill, *rows[1]), move
            )
        else:  # another KV-head replica count on each side: the checkpoint's heads cross
            (k, k_bytes), (v, v_bytes) = (
                regroup_kv(x, lay.kv_prefill, have, want, move) for x in (new.k, new.v)
            )
            moved_rows, row_bytes = put_tree(list(rows[0]), list(rows[1]), move)
            moved_bytes = k_bytes + v_bytes + row_bytes
        lengths_P, first_P = moved_rows
        self._batches[handle] = Inserted(k=k, v=v, lengths_P=lengths_P, first_P=first_P)
        return moved_bytes

    @command
    def offload(self, pages: tuple[int, ...], slots: tuple[int, ...], *, side: str) -> None:
        """Copies ``side``'s global pages ``pages`` to host slots ``slots`` (the host tier)."""
        self.host_pages.offload(self._slots[self._pool(side)], pages, slots)

    @command
    def restore(self, slots: tuple[int, ...], pages: tuple[int, ...], *, side: str) -> None:
        """Copies host slots ``slots`` back into ``side``'s global pages ``pages``."""
        pool = self._pool(side)
        self._slots[pool], _ = self.host_pages.restore(self._slots[pool], slots, pages)

    @command
    def drop(self, handle: int) -> None:
        """Forgets batch ``handle`` (it was never inserted, e.g. all its requests ended)."""
        self._batches.pop(handle, None)
        self._outputs.pop(handle, None)

    @command
    def step(
        self,
        release_B: np.ndarray,
        tables_RN: np.ndarray | None,
        allowed_BW: np.ndarray | None = None,
        groups: tuple[tuple[np.ndarray, np.ndarray], ...] | None = None,
    ) -> int:
        """One decode step over the rows: ``release_B`` frees rows first; ``tables_RN``:
        the block tables of the rows to compute (from :meth:`SlotSteps.tables`'s rows;
        None: the last ones again); ``allowed_BW``: the rows' token masks (structured
        output; None: every token allowed, an array placed once); ``groups``: the step
        split by block-table width instead, (rows, tables) per dispatch
        (:meth:`SlotSteps.step_groups`). Returns the step's handle for :meth:`tokens`."""
        steps = self._slot_steps[DECODE]
        if groups is not None:
            slots, next_B, logprobs, dropped = steps.step_groups(
                self.engine.params, self._slots[DECODE], release_B, groups, steps.masks(allowed_BW)
            )
            self._slots[DECODE] = slots
            handle = self._handle()
            if self.keeps_outputs:
                self._outputs[handle] = StepOutputs(next_B, logprobs, dropped)
            return handle
        if tables_RN is not None:
            self._tables = put_global(tables_RN, steps.tables_layout)
        slots, next_B, logprobs, dropped = steps.step(
            self.engine.params,
            self._slots[DECODE],
            release_B,
            self._tables,
            steps.masks(allowed_BW),
        )
        self._slots[DECODE] = slots
        handle = self._handle()
        if self.keeps_outputs:
            self._outputs[handle] = StepOutputs(next_B, logprobs, dropped)
        return handle

    @command
    def verify(
        self,
        release_B: np.ndarray,
        tables_RN: np.ndarray,
        pages_RN: np.ndarray,
        drafts_BK: np.ndarray,
        n_drafts_B: np.ndarray,
        allowed_BW: np.ndarray | None = None,
        q_BKV: np.ndarray | None = None,
        taps: HiddenTaps | None = None,
    ) -> int:
        """Speculative decoding's verification step (:mod:`jaxpar.engine._spec_verify`):
        each row feeds its next token and its first ``n_drafts_B`` drafts of ``drafts_BK``
        over its block tables ``tables_RN`` (the same pages as global ids ``pages_RN``),
        under the token masks ``allowed_BW`` (``[B, W]``, or per position
        ``[B, K + 1, W]``) and, from a draft model, the drafts' distributions ``q_BKV``;
        returns the handle :meth:`spec_tokens` reads (and, with ``taps``, the hidden
        states a speculative head reads: :meth:`spec_features`, read first)."""
        steps = self._slot_steps[DECODE]
        if self._verify is None:
            self._verify = VerifySteps(steps)
        per_position = allowed_BW is not None and np.ndim(allowed_BW) == 3
        allowed = allowed_BW if per_position else steps.masks(allowed_BW)
        slots, tokens_BT, logprobs, dropped, features = self._verify.verify(
            self.engine.params, self._slots[DECODE], release_B, tables_RN, pages_RN, drafts_BK,
            n_drafts_B, allowed, q_BKV, taps,
        )  # fmt: skip
        self._slots[DECODE] = slots
        handle = self._handle()
        if self.keeps_outputs:
            self._outputs[handle] = StepOutputs(tokens_BT, logprobs, dropped)
            if features is not None:
                self._features[handle] = features
        return handle

    @command
    def prime_step(self, rows: int, width: int, *, indexed: bool = False) -> None:
        """Runs the decode step over ``rows`` rows and ``width`` block-table columns once,
        every row released first, and waits for it. Only while no row decodes: then it
        changes nothing but the scratch pages. A compiled program's first run costs more
        than the next (on CPU ~160 ms more for a decode step of SmolLM2-135M shapes:
        208 ms, then 47), which a request's step then never pays. ``indexed``: the
        program of one group of a split step (its rows by id; here all padding)."""
        steps = self._slot_steps[DECODE]
        shape = (rows, width) if steps.groups is None else (steps.groups.n_groups, rows, width)
        tables = put_global(np.zeros(shape, np.int32), steps.tables_layout)
        release_B = np.ones(steps.n_slots, bool)
        rows_R = np.full(rows, -1, np.int32) if indexed else None
        slots, next_B, *_ = steps.step(
            self.engine.params, self._slots[DECODE], release_B, tables, rows_R=rows_R
        )
        self._slots[DECODE] = slots
        jax.block_until_ready(next_B)

    def time_prefill(self, rows: int, length: int, n_pages: int = 0) -> float:
        """Seconds of one prefill of ``[rows, length]`` new tokens (after ``n_pages``
        cached pages of the prefill side, read as scratch: nothing is written), dispatched
        and waited for. Only while idle, in one process: it is not a recorded command. The
        prefill's cost by shape (:class:`~jaxpar.engine._chunk_cost.ChunkCost`)."""
        eng, steps = self.prefill_engine, self._slot_steps[PREFILL]
        lay = eng.layouts
        start = time.perf_counter()
        tokens = put_global(np.zeros((rows, length), np.int32), lay.tokens_BT)
        lengths = put_global(np.full(rows, length, np.int32), lay.lengths_prefill_B)
        if n_pages:
            pages_PN = np.zeros((rows, *steps.pool.ids_shape(n_pages)), np.int32)
            ctx_k, ctx_v = steps.context(self._slots[self._pool(PREFILL)], pages_PN, lay.kv_prefill)
            starts = put_global(np.full(rows, n_pages * steps.pool.page_size, np.int32),
                                lay.lengths_prefill_B)  # fmt: skip
            out = eng.steps.prefill_context(eng.params, tokens, lengths, starts, ctx_k, ctx_v)
        else:
            out = eng.steps.prefill(eng.params, tokens, lengths)
        jax.block_until_ready(out)
        return time.perf_counter() - start

    @command
    def score(self, tokens_BT: np.ndarray, lengths_B: np.ndarray) -> int:
        """Scores padded prompts (each position's next-token logprob, on the prefill
        engine); returns the handle :meth:`scores` reads."""
        logprobs = self.prefill_engine.scorer.dispatch(tokens_BT, lengths_B)
        outputs = self._readable(StepOutputs(None, logprobs, None))
        handle = self._handle()
        if self.keeps_outputs:
            self._outputs[handle] = outputs
        return handle

    # --- reads (the scheduling process only) ---------------------------------------------

    @read
    def scores(self, handle: int) -> Logprobs:
        """A :meth:`score`'s logprobs on the host; forgets them."""
        return self._outputs.pop(handle).logprobs.host()

    @read
    def tokens(self, handle: int, *, logprobs: bool) -> HostTokens:
        """A command's tokens (and logprobs if ``logprobs``) on the host; forgets them."""
        out = self._outputs.pop(handle)
        tokens = np.asarray(jax.device_get(out.tokens))
        host_lp = out.logprobs.host() if logprobs and out.logprobs is not None else None
        dropped = int(out.dropped) if out.dropped is not None else 0
        return HostTokens(tokens, host_lp, dropped)

    @read
    def spec_tokens(self, handle: int, *, logprobs: bool):
        """A :meth:`verify`'s tokens ``[B, K + 1]`` (``-1`` past each row's count), their
        logprobs per position (None unless ``logprobs``) and dropped MoE assignments, on
        the host; forgets them."""
        out = self._outputs.pop(handle)
        tokens = np.asarray(jax.device_get(out.tokens))
        host_lp = [lp.host() for lp in out.logprobs] if logprobs else None
        return tokens, host_lp, int(out.dropped) if out.dropped is not None else 0

    @read
    def spec_features(self, handle: int) -> np.ndarray:
        """A :meth:`verify`'s tapped hidden states ``[B, K + 1, F]`` (float32) on the host;
        forgets them."""
        return np.asarray(jax.device_get(self._features.pop(handle)))

    @read
    def dropped(self, handle: int) -> int:
        """MoE assignments a prefill chunk (no first tokens) dropped; forgets its outputs."""
        out = self._outputs.pop(handle)
        return int(out.dropped) if out.dropped is not None else 0

    @read
    def wait(self, handle: int) -> None:
        """Blocks until batch ``handle`` is on its devices (for timing the transfer)."""
        jax.block_until_ready(self._batches[handle])

    def flush(self) -> None:
        """Sends the recorded commands now (before this process waits idle: the others
        must dispatch what it dispatched, or its collectives would wait for them)."""
        if self.recorder is not None:
            with self._lock:
                self.recorder.flush()

    def batch_shape(self, handle: int) -> tuple[int, int]:
        """(rows, tokens) of batch ``handle``'s K/V (shapes only: no device work)."""
        batch = self._batches[handle]
        return batch.lengths_P.shape[0], jax.tree.leaves(batch.k)[0].shape[-3]

    def replay(self, name: str, args: tuple, kwargs: dict) -> None:
        """Runs one recorded command (on a replaying process)."""
        method = getattr(type(self), name, None)
        if not getattr(method, "is_command", False):
            raise ValueError(f"{name!r} is not an executor command")
        method(self, *args, **kwargs)
