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
matmul should have read the quantized bytes and scaled its output. Its operand may be a
cast alone of the buffer (XLA:CPU widens fp8 to f16 in a fusion of its own, then
multiplies that): an operand is sized as the buffer it casts, so the widened copy does
not hide the buffer behind other bytes.

A move counts only when it moves a buffer the program was given (an entry parameter,
followed through casts, moves, in-place updates, loop state and dequantizes): a copy of
a computed activation is no copy of a weight or of the cache, whatever its size (a tp
shard of the KV scales ``[8, 1, 64, 1]`` has the element count and bytes of ``[8, 64]``
f32 activations).
"""

from __future__ import annotations

import re
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


def _cast_fusion(module: HloModuleText, instr: Instruction) -> bool:
    """A fusion of casts (and structure) alone: XLA widening a whole buffer."""
    bodies = [module.computations.get(c, {}) for c in callees(instr)]
    ops = {i.opcode for body in bodies for i in body.values()}
    return bool(bodies) and "convert" in ops and ops <= CASTS | _STRUCTURAL


def _in_place_update(module: HloModuleText, instr: Instruction) -> bool:
    """A fusion writing into a buffer in place (a cache write: scatter, update-slice)."""
    bodies = [module.computations.get(c, {}) for c in callees(instr)]
    return any(i.opcode in _UPDATES for body in bodies for i in body.values())


#: Ops whose output is (part of, or all of, maybe cast) their largest operand's buffer.
_SAME_BUFFER = MOVES | CASTS | {"bitcast", "reshape", "dynamic-update-slice", "scatter"}
_UPDATES = frozenset({"dynamic-update-slice", "scatter"})
_GTE_INDEX = re.compile(r"index=(\d+)")


class _Provenance:
    """Which instructions hold (part of) a buffer the program was given, as opposed to
    something it computed: followed back to an entry parameter through moves, casts,
    in-place updates, dequantizes, tuples and while-loop state."""

    def __init__(self, module: HloModuleText):
        self.module = module
        self.memo: dict[tuple[str, str, int | None], bool] = {}
        # A while body's (and condition's) parameter is its loop's operand.
        self.loop_of: dict[str, tuple[str, Instruction]] = {}
        for comp, body in module.computations.items():
            for instr in body.values():
                if instr.opcode == "while":
                    for callee in callees(instr):
                        self.loop_of[callee] = (comp, instr)

    def given(self, comp: str, name: str, index: int | None = None, depth: int = 0) -> bool:
        """Whether ``name`` in ``comp`` (its tuple element ``index``) is a given buffer."""
        key = (comp, name, index)
        if key not in self.memo:
            self.memo[key] = False  # cycles (loop state) resolve to "computed"
            self.memo[key] = depth < 64 and self._given(comp, name, index, depth + 1)
        return self.memo[key]

    def _given(self, comp: str, name: str, index: int | None, depth: int) -> bool:
        instr = self.module.computations.get(comp, {}).get(name)
        if instr is None:
            return False
        op = instr.opcode
        if op == "parameter":
            if comp == self.module.entry:
                return True
            if comp in self.loop_of:
                caller, loop = self.loop_of[comp]
                return self.given(caller, loop.operands[0], index, depth)
            return False
        if op == "get-tuple-element":
            found = _GTE_INDEX.search(instr.attrs)
            k = int(found.group(1)) if found else None
            return self.given(comp, instr.operands[0], k, depth)
        if op == "tuple":
            if index is None or index >= len(instr.operands):
                return False
            return self.given(comp, instr.operands[index], None, depth)
        if op == "while":
            return self.given(comp, instr.operands[0], index, depth)
        through = op in _SAME_BUFFER or (
            op == "fusion"
            and (
                _pure_move_fusion(self.module, instr)
                or _dequantize_fusion(self.module, instr)
                or _cast_fusion(self.module, instr)
                or _in_place_update(self.module, instr)
            )
        )
        if not through or not instr.operands:
            return False
        return any(self.given(comp, o, None, depth) for o in self.largest(instr))

    def largest(self, instr: Instruction) -> list[str]:
        """The operands with the most elements (the buffer, not indices or scales)."""
        comp, sizes = instr.computation, {}
        for o in instr.operands:
            shape = self.module.shape_of(comp, o)
            sizes[o] = _elements(shape) if shape is not None else -1
        most = max(sizes.values())
        return [o for o, n in sizes.items() if n == most]

    def stored(self, comp: str, name: str) -> list[Shape]:
        """``name``'s shape and each shape of the same buffer it came from through casts
        alone and in-place updates (XLA:CPU updates an fp8 cache in f16: fp8 -> f16 ->
        scatter -> fp8), the buffer as stored among them."""
        shapes: list[Shape] = []
        instr = self.module.computations.get(comp, {}).get(name)
        while instr is not None and len(shapes) < 8:
            shapes.append(instr.shape)
            fusion = instr.opcode == "fusion"
            cast = instr.opcode == "convert" or (fusion and _cast_fusion(self.module, instr))
            update = instr.opcode in _UPDATES or (fusion and _in_place_update(self.module, instr))
            if not (cast or update) or not instr.operands:
                break
            source = self.module.computations.get(comp, {}).get(instr.operands[0])
            if source is None or _elements(source.shape) != _elements(instr.shape):
                break
            instr = source
        return shapes


def _elements(shape: Shape) -> int:
    return sum(prod(a.dims) for a in flatten_shape(shape))


#: A buffer that counts: its bytes, or (element count, bytes) to also require the move to
#: have as many elements (so that an activation of the same bytes by chance does not count).
Buffer = int | tuple[int, int]


def _matches(
    module: HloModuleText,
    instr: Instruction,
    wanted: set[tuple[int | None, int]],
    provenance: _Provenance,
) -> bool:
    """The output is one of the buffers, or a whole (maybe cast) copy of an operand that
    is (same element count, the buffer's bytes as stored), and what it moves is a buffer
    the program was given (not a computed activation)."""
    elements = _elements(instr.shape)
    nbytes = sum(a.nbytes for a in flatten_shape(instr.shape))
    sized = {b for e, b in wanted if e is None or e == elements}
    comp = instr.computation
    # By its output's size: what it moves is its largest operand (not a norm's scale).
    if nbytes in sized and any(provenance.given(comp, o) for o in provenance.largest(instr)):
        return True
    for name in instr.operands:
        if any(
            _elements(shape) == elements and sum(a.nbytes for a in flatten_shape(shape)) in sized
            for shape in provenance.stored(comp, name)
        ) and provenance.given(comp, name):
            return True
    return False


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
    provenance = _Provenance(module)
    found = []
    for comp, context in loop_contexts(module).items():
        if comp in fused:
            continue
        for instr in module.computations[comp].values():
            if not _is_move(module, instr):
                continue
            if _matches(module, instr, wanted, provenance):
                nbytes = sum(a.nbytes for a in flatten_shape(instr.shape))
                runs = context.trip_count or 1
                found.append(Movement(instr.name, instr.opcode, nbytes, runs))
    return found
