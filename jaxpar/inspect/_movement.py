"""Pure data movement in a compiled program: copies, transposes and slices of big buffers.

On an accelerator a decode step is bound by the bytes it reads, so every copy of a weight
or of a layer's KV cache costs as much as the matmul or attention that reads it. These ops
are visible in the compiled HLO on any backend (CPU included), which makes them testable
without an accelerator: :func:`data_movement` lists them with how often they run per step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from jaxpar.inspect._hlo_text import (
    HloModuleText,
    Instruction,
    callees,
    flatten_shape,
    loop_contexts,
    parse_module,
)

#: Opcodes that only move data.
MOVES = frozenset({"copy", "transpose", "slice", "dynamic-slice"})
# What else a fusion made only of moves may contain: structure, no arithmetic.
_STRUCTURAL = frozenset(
    {"parameter", "bitcast", "reshape", "constant", "tuple", "get-tuple-element"}
)


class _HasText(Protocol):
    def as_text(self) -> str: ...


@dataclass(frozen=True)
class Movement:
    """One data-movement op: its opcode (or ``fusion``), output bytes and runs per step."""

    name: str
    opcode: str
    nbytes: int
    runs: int

    @property
    def total_bytes(self) -> int:
        """Bytes written per execution of the program."""
        return self.nbytes * self.runs


def _pure_move_fusion(module: HloModuleText, instr: Instruction) -> bool:
    bodies = [module.computations.get(c, {}) for c in callees(instr)]
    ops = {i.opcode for body in bodies for i in body.values()}
    return bool(bodies) and bool(ops & MOVES) and ops <= MOVES | _STRUCTURAL


def data_movement(program: str | _HasText, sizes: Iterable[int]) -> list[Movement]:
    """Copies, transposes, slices and fusions made only of them, of one of ``sizes`` bytes.

    Args:
        program: a compiled program (``jax.stages.Compiled``) or its HLO text.
        sizes: output sizes in bytes that count (e.g. each weight's and each layer's cache
            bytes per device); other moves (activations) are left out.

    Returns:
        The matching ops of every computation reachable from the entry, with ``runs`` =
        executions per program run (the trip counts of enclosing loops; 1 if unknown).
    """
    text = program if isinstance(program, str) else program.as_text()
    module = parse_module(text)
    wanted = set(sizes)
    # Instructions inside fused computations are counted once, as their fusion.
    fused = {
        callee
        for body in module.computations.values()
        for instr in body.values()
        if instr.opcode == "fusion"
        for callee in callees(instr)
    }
    found = []
    for comp, context in loop_contexts(module).items():
        if comp in fused:
            continue
        for instr in module.computations[comp].values():
            pure = instr.opcode in MOVES or (
                instr.opcode == "fusion" and _pure_move_fusion(module, instr)
            )
            nbytes = sum(a.nbytes for a in flatten_shape(instr.shape))
            if pure and nbytes in wanted:
                runs = context.trip_count or 1
                found.append(Movement(instr.name, instr.opcode, nbytes, runs))
    return found
