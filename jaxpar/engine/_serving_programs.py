"""The programs ``jaxpar serve`` runs, lowered from shapes alone (for inspection).

A server does not run the contiguous-cache decode step :meth:`AbstractEngine.lower`
names ``"decode"``: it runs the paged slot step (:class:`~jaxpar.engine._slots.SlotSteps`),
prefill in row and token buckets, prefill with cached context (chunks, prefix hits), the
first tokens' draw and the insert of prefilled K/V into pages. :class:`ServingPrograms`
builds the same objects the server builds (a page pool sized for the engine's
``max_batch x max_seq_len`` tokens, the slot steps over it) over abstract parameters and
lowers each of them, so ``explain``, ``jaxpar.inspect``, ``plan --compile`` and the
benchmarks can compare what serves with the analytic minimum.

Programs (:data:`SERVING_PROGRAMS`, each with the phase whose layout it runs in):

* ``serve_decode``: one paged decode step over ``rows`` rows (default every row), block
  tables as wide as a row's pages, sampling and logprobs included;
* ``serve_prefill``: prefill of ``[rows, prompt_len]`` tokens (a row and token bucket);
* ``serve_prefill_context``: the same continuing ``context_len`` cached positions;
* ``first_tokens``: the draw of each prefilled row's first token (sampling on the
  prefill devices);
* ``insert``: the handoff: prefilled K/V of ``rows`` requests written into their pages.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxpar.engine._kv_budget import PAGE_SIZE, KVBudget, size_pool
from jaxpar.engine._slots import FirstTokens, Inserted, SlotSteps
from jaxpar.engine._steps import Steps
from jaxpar.errors import ConfigError
from jaxpar.spec import Phase

#: The serving programs, and the phase whose layouts (and analytic minimum) each runs in.
SERVING_PROGRAMS: dict[str, Phase] = {
    "serve_decode": Phase.DECODE,
    "serve_prefill": Phase.PREFILL,
    "serve_prefill_context": Phase.PREFILL,
    "first_tokens": Phase.PREFILL,
    "insert": Phase.DECODE,
}


def program_phase(program: str | Phase) -> Phase:
    """The phase of ``program``: a :class:`Phase` (or its name) or a serving program."""
    if isinstance(program, str) and program in SERVING_PROGRAMS:
        return SERVING_PROGRAMS[program]
    return Phase.coerce(program)


class ServingPrograms:
    """Lowers an abstract engine's serving programs (nothing is allocated).

    Args:
        steps: the engine's steps (pipelined too: the decode step through the stages,
            :mod:`jaxpar.engine._pipeline_slots`); their mesh, strategy, run and
            ``max_seq_len`` are the engine's.
        params: the parameters the programs take by default (the abstract ones).
        max_batch: rows of a program by default; the pool holds ``max_batch x
            max_seq_len`` tokens.
        page_size: tokens per KV page (the server's default).
    """

    def __init__(self, steps: Steps, params: Any, max_batch: int, page_size: int = PAGE_SIZE):
        self.steps, self.params, self.max_batch = steps, params, max_batch
        self.pool = size_pool(
            KVBudget(page_size=page_size, tokens=max_batch * steps.max_seq_len),
            config=steps.config,
            mesh=steps.mesh,
            dims=steps.dims,
            rows=max_batch,
            max_seq_len=steps.max_seq_len,
        )
        self.slots = SlotSteps(steps, steps.dims, self.pool)
        self.first = FirstTokens(steps)

    def lower(
        self,
        program: str,
        *,
        prompt_len: int,
        rows: int | None = None,
        context_len: int | None = None,
        params: Any = None,
    ) -> Any:
        """The ``jax.stages.Lowered`` ``program`` (one of :data:`SERVING_PROGRAMS`).

        Args:
            program: which program.
            prompt_len: new tokens per row of the prefill programs (and of the insert).
            rows: rows of the program (default the engine's ``max_batch``).
            context_len: cached positions before the new tokens (``serve_prefill_context``;
                default ``prompt_len``, rounded up to whole pages).
            params: placed parameters (default the abstract ones).
        """
        if program not in SERVING_PROGRAMS:
            raise ConfigError(
                f"unknown serving program {program!r}; one of {', '.join(SERVING_PROGRAMS)}"
            )
        params = self.params if params is None else params
        rows = rows or self.max_batch
        if program == "serve_decode":
            return self.slots.compile_step(params, self.pool.pages_per_row, rows, lower=True)
        if program == "serve_prefill_context":
            z = self.pool.page_size
            context = -(-(context_len or prompt_len) // z) * z
            return self.steps.compile_prefill_context(params, rows, prompt_len, context, lower=True)
        prefill = self._prefill(params, rows, prompt_len)
        logits, k, v = prefill.out_info[:3]
        if program == "serve_prefill":
            return prefill
        if program == "first_tokens":
            return self.first.compile(logits, lower=True)
        row_ints = jax.ShapeDtypeStruct((rows,), np.int32)
        return self.slots.compile_insert(Inserted(k, v, row_ints, row_ints), lower=True)

    def _prefill(self, params: Any, rows: int, length: int) -> Any:
        lay = self.steps.layouts
        tokens = jax.ShapeDtypeStruct((rows, length), np.int32, sharding=lay.tokens_BT)
        lengths = jax.ShapeDtypeStruct((rows,), np.int32, sharding=lay.lengths_prefill_B)
        return self.steps.lower_prefill(params, tokens, lengths)
