"""Pure data movement in a compiled program: copies, transposes and slices of big buffers.

On an accelerator a decode step is bound by the bytes it reads, so every copy of a weight
or of a layer's KV cache costs as much as the matmul or attention that reads it. These ops
are visible in the compiled HLO on any backend (CPU included), which makes them testable
without an accelerator: :func:`data_movement` lists them with how often they run per step.

A move may carry a dtype cast fused into it (a bf16 cache transposed into f32): it still
copies the whole buffer, though its output bytes are not the buffer's, so a move also
counts when an operand of the same element count has one of the sizes. A cast alone is
not counted: XLA:CPU widens bf16 (and int8, fp8, int4) matmul operands to f32 that way,
where an accelerator fuses the cast into the matmul.

A dequantization is counted: a fusion that casts a whole buffer and multiplies it (by
its scales), writing the dequantized weight (``w_q.astype(f32) * scale``) where the
matmul should have read the quantized bytes and scaled its output.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from math import prod
from typing import Protocol

from jaxpar.inspect._hlo_text import (
    HloModuleText,
    Instruction,
    Shape,
    callees,
    flatten_shape,
    loop_contexts,
    parse_module,
)

#: Opcodes that only move data.
MOVES = frozenset({"copy", "transpose", "slice", "dynamic-slice"})
#: What a fusion of moves may also do to each element: change its type.
CASTS = frozenset({"convert"})
#: What a dequantizing fusion does besides casting: scale (a multiply, a broadcast scale).
DEQUANTIZE = frozenset({"multiply", "broadcast"})
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
    """A fusion of moves, possibly with casts, and nothing else (no arithmetic)."""
    bodies = [module.computations.get(c, {}) for c in callees(instr)]
    ops = {i.opcode for body in bodies for i in body.values()}
    return bool(bodies) and bool(ops & MOVES) and ops <= MOVES | CASTS | _STRUCTURAL


def _dequantize_fusion(module: HloModuleText, instr: Instruction) -> bool:
    """A fusion of casts and multiplies (and structure) alone: a whole-buffer dequantize
    when its operand is a buffer (checked by size, as for moves)."""
    bodies = [module.computations.get(c, {}) for c in callees(instr)]
    ops = {i.opcode for body in bodies for i in body.values()}
    return (
        bool(bodies) and {"convert", "multiply"} <= ops and ops <= CASTS | DEQUANTIZE | _STRUCTURAL
    )


def _is_move(module: HloModuleText, instr: Instruction) -> bool:
    """A move opcode, or a fusion of moves (and casts), or a dequantizing fusion."""
    return instr.opcode in MOVES or (
        instr.opcode == "fusion"
        and (_pure_move_fusion(module, instr) or _dequantize_fusion(module, instr))
    )


def _elements(shape: Shape) -> int:
    return sum(prod(a.dims) for a in flatten_shape(shape))


#: A buffer that counts: its bytes, or (element count, bytes) to also require the move to
#: have as many elements (so that an activation of the same bytes by chance does not count).
Buffer = int | tuple[int, int]


def _matches(
    module: HloModuleText, instr: Instruction, wanted: set[tuple[int | None, int]]
) -> bool:
    """The output is one of the buffers, or a whole (maybe cast) copy of an operand that
    is: same element count, the buffer's bytes."""
    elements = _elements(instr.shape)
    nbytes = sum(a.nbytes for a in flatten_shape(instr.shape))
    sized = {b for e, b in wanted if e is None or e == elements}
    if nbytes in sized:
        return True
    operands = (module.shape_of(instr.computation, name) for name in instr.operands)
    return any(
        shape is not None
        and _elements(shape) == elements
        and sum(a.nbytes for a in flatten_shape(shape)) in sized
        for shape in operands
    )


def data_movement(program: str | _HasText, sizes: Iterable[Buffer]) -> list[Movement]:
    """Copies, transposes, slices and fusions made only of them (casts allowed), and
    dequantizing fusions (casts and multiplies), of one of the buffers' sizes, or whole
    copies of an operand of one of them.

    Args:
        program: a compiled program (``jax.stages.Compiled``) or its HLO text.
        sizes: the buffers that count (e.g. each weight and each layer's cache per device),
            as bytes or as (element count, bytes): of a move's output or of the operand it
            copies whole (same element count, maybe cast); other moves (activations) are
            left out.

    Returns:
        The matching ops of every computation reachable from the entry, with ``runs`` =
        executions per program run (the trip counts of enclosing loops; 1 if unknown).
    """
    text = program if isinstance(program, str) else program.as_text()
    module = parse_module(text)
    wanted = {(None, b) if isinstance(b, int) else (b[0], b[1]) for b in sizes}
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
            if not _is_move(module, instr):
                continue
            if _matches(module, instr, wanted):
                nbytes = sum(a.nbytes for a in flatten_shape(instr.shape))
                runs = context.trip_count or 1
                found.append(Movement(instr.name, instr.opcode, nbytes, runs))
    return found
