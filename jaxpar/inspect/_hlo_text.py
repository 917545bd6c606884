"""Low-level reading of XLA HLO module text: shapes, instructions, computations, loops.

This is a small, permissive reader for the text that ``Compiled.as_text()`` prints. It
is not a full HLO parser: it splits each instruction into result shape, opcode,
operand names and the raw attribute text, and leaves attribute meaning to its callers.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod

# Bits per element of every XLA primitive type we may meet; sub-byte types are packed.
_FIXED_BITS = {"pred": 8, "token": 0, "c64": 64, "c128": 128}
_DTYPE_RE = re.compile(r"^(?:bf|f|s|u)(\d+)")

# Compiled text prints "%name (params) -> result {"; pre-optimisation text "name {".
_HEADER_RE = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*")
_ARRAY_RE = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\](?:\{[^}]*\})?")
_CALLEE_RE = re.compile(
    r"(?:^|[\s,])(?:to_apply|calls|body|condition|true_computation|false_computation"
    r"|branch_computations|called_computations)=(?P<val>\{[^}]*\}|%?[\w.\-]+)"
)
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


def dtype_bits(dtype: str) -> int:
    """Bits per element of an HLO primitive type name such as ``bf16`` or ``f8e4m3fn``.

    Raises:
        ValueError: the name is not a known HLO element type.
    """
    if dtype in _FIXED_BITS:
        return _FIXED_BITS[dtype]
    match = _DTYPE_RE.match(dtype)
    if match is None:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return int(match.group(1))


@dataclass(frozen=True)
class ArrayShape:
    """One array in an HLO shape: element type and (upper-bound) dimensions."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of a dense buffer of this shape (sub-byte types rounded up)."""
        return (prod(self.dims) * dtype_bits(self.dtype) + 7) // 8

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


# A parsed shape: one array, or a (possibly nested) tuple of shapes.
Shape = ArrayShape | tuple["Shape", ...]


def parse_shape(text: str) -> Shape:
    """Parse an HLO shape such as ``f32[4,8]{1,0}`` or ``(f32[2], (s32[], u32[]))``."""
    shape, rest = _parse_shape_at(text.strip())
    if rest.strip():
        raise ValueError(f"trailing text after HLO shape: {rest!r}")
    return shape


def _parse_shape_at(text: str) -> tuple[Shape, str]:
    if text.startswith("("):
        elements: list[Shape] = []
        rest = text[1:].lstrip()
        while not rest.startswith(")"):
            element, rest = _parse_shape_at(rest)
            elements.append(element)
            rest = rest.lstrip().removeprefix(",").lstrip()
        return tuple(elements), rest[1:]
    match = _ARRAY_RE.match(text)
    if match is None:
        raise ValueError(f"cannot read an HLO shape from {text[:40]!r}")
    # Dynamic dimensions print as "<=N"; the bound is what a buffer is sized for.
    dims = tuple(int(d.strip().lstrip("<=")) for d in match["dims"].split(",") if d.strip())
    return ArrayShape(match["dtype"], dims), text[match.end() :]


def flatten_shape(shape: Shape) -> list[ArrayShape]:
    """The arrays of a shape in order, tuples flattened depth-first."""
    if isinstance(shape, ArrayShape):
        return [shape]
    return [array for element in shape for array in flatten_shape(element)]


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction line, split into its parts."""

    name: str
    shape: Shape
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    computation: str


@dataclass(frozen=True)
class HloModuleText:
    """The instructions of an HLO module text, grouped by computation."""

    name: str
    entry: str
    num_partitions: int | None
    computations: dict[str, dict[str, Instruction]]

    def shape_of(self, computation: str, name: str) -> Shape | None:
        """Result shape of instruction ``name`` inside ``computation``, if it exists."""
        instr = self.computations.get(computation, {}).get(name)
        return None if instr is None else instr.shape


def _closing(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced parentheses in {text[start : start + 60]!r}")


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        if char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if "".join(current).strip():
        parts.append("".join(current))
    return parts


def parse_instruction(line: str, computation: str) -> Instruction | None:
    """Split one instruction line; ``None`` for lines that are not instructions."""
    # Long tuple shapes carry "/*index=5*/" markers every five elements (e.g. the state
    # of a while loop over layers): drop them, or the shape does not parse.
    line = _COMMENT_RE.sub("", line)
    head = _INSTR_RE.match(line)
    if head is None:
        return None
    body = line[head.end() :]
    # A tuple shape contains spaces, so find its end by bracket matching.
    end = _closing(body, 0) + 1 if body.startswith("(") else body.find(" ")
    try:
        shape = parse_shape(body[:end])
    except ValueError:
        return None
    match = re.match(r"\s*([\w\-]+)\(", body[end:])
    if match is None:
        return None
    open_at = end + match.end() - 1
    close_at = _closing(body, open_at)
    # Operands may print as "%x" or, with operand shapes on, as "f32[4] %x".
    operands = tuple(
        part.split()[-1].lstrip("%") for part in _split_top_level(body[open_at + 1 : close_at])
    )
    return Instruction(
        name=head["name"],
        shape=shape,
        opcode=match.group(1),
        operands=operands,
        attrs=body[close_at + 1 :],
        computation=computation,
    )


def _open_brackets(line: str) -> int:
    """Brackets ``({[`` left open at the end of ``line``, outside double-quoted strings."""
    opened = sum(line.count(c) for c in "({[") - sum(line.count(c) for c in ")}]")
    if opened == 0:
        return 0
    depth, quoted, escaped = 0, False, False
    for char in line:
        if quoted:
            escaped, quoted = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            quoted = True
        elif char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
    return depth


def _logical_lines(text: str) -> Iterator[str]:
    """The text's lines, an instruction printed over several lines joined into one.

    TPU custom calls print ``frontend_attributes={kernel_metadata={...}}`` with newlines
    inside: the continuation lines start at column 0 (one with ``}}``), where a reader
    line by line would take them for the end of the computation.
    """
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith(" ") and _INSTR_RE.match(line):
            while _open_brackets(line) > 0 and (more := next(lines, None)) is not None:
                line = f"{line} {more}"
        yield line


def parse_module(text: str) -> HloModuleText:
    """Read every computation and instruction of an HLO module text."""
    name, entry, num_partitions = "", "", None
    computations: dict[str, dict[str, Instruction]] = {}
    current: str | None = None
    for line in _logical_lines(text):
        if line.startswith("HloModule"):
            name = line.split()[1].rstrip(",")
            found = re.search(r"num_partitions=(\d+)", line)
            num_partitions = int(found.group(1)) if found else None
            continue
        header = _HEADER_RE.match(line)
        if header is not None and not line.startswith(" "):
            current = header["name"]
            computations[current] = {}
            if line.startswith("ENTRY"):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            instr = parse_instruction(line, current)
            if instr is not None:
                computations[current][instr.name] = instr
    return HloModuleText(name, entry, num_partitions, computations)


def callees(instr: Instruction) -> list[str]:
    """Names of the computations an instruction calls (body, to_apply, calls, ...)."""
    names: list[str] = []
    for match in _CALLEE_RE.finditer(instr.attrs):
        names += [n.strip().lstrip("%") for n in match["val"].strip("{}").split(",") if n.strip()]
    return names


def known_trip_count(instr: Instruction) -> int | None:
    """The ``known_trip_count`` XLA printed in a while op's backend_config, if any."""
    found = _TRIP_RE.search(instr.attrs)
    if found is not None:
        return int(found.group(1))
    config = re.search(r"backend_config=(\{.*\})", instr.attrs)
    if config is None:
        return None
    try:  # Some printers quote the JSON or order keys differently; try a real parse.
        value = json.loads(config.group(1))
    except ValueError:
        return None
    count = value.get("known_trip_count", {}).get("n") if isinstance(value, dict) else None
    return int(count) if count is not None else None


def _constant(module: HloModuleText, computation: str, name: str) -> int | None:
    """The integer ``name`` holds, if it is a scalar constant (through copies, bitcasts)."""
    instr = module.computations.get(computation, {}).get(name)
    while instr is not None and instr.opcode in ("copy", "bitcast", "convert") and instr.operands:
        instr = module.computations[computation].get(instr.operands[0])
    if instr is None or instr.opcode != "constant" or len(instr.operands) != 1:
        return None
    try:
        return int(instr.operands[0])
    except ValueError:
        return None


def counted_trip_count(module: HloModuleText, computation: str, instr: Instruction) -> int | None:
    """Trips of a counted while loop whose backend_config names none (compiled TPU HLO).

    Reads ``i < N`` in the condition (``compare(get-tuple-element(p), index=k),
    constant(N)), direction=LT``) and the start of element ``k`` in the loop's initial
    tuple, a constant ``S``: ``N - S`` trips, the counter stepping by one as jax's loops
    (``fori_loop``, ``scan``) do. None for any other form.
    """
    found = re.search(r"condition=%?([\w.\-]+)", instr.attrs)
    cond = found.group(1) if found else ""
    body = module.computations.get(cond, {})
    init = module.computations.get(computation, {}).get(instr.operands[0] if instr.operands else "")
    if init is None or init.opcode != "tuple":
        return None
    for compare in body.values():
        if compare.opcode != "compare" or "direction=LT" not in compare.attrs:
            continue
        counter = body.get(compare.operands[0])
        limit = _constant(module, cond, compare.operands[1])
        index = re.search(r"index=(\d+)", counter.attrs) if counter is not None else None
        if counter is None or counter.opcode != "get-tuple-element" or limit is None or not index:
            continue
        k = int(index.group(1))
        start = _constant(module, computation, init.operands[k]) if k < len(init.operands) else None
        if start is not None and limit >= start:
            return limit - start
    return None


@dataclass(frozen=True)
class LoopContext:
    """How often a computation runs per execution of the module.

    Attributes:
        in_loop: the computation is (transitively) the body or condition of a while op.
        trip_count: executions per module run: the product of the known trip counts
            of the enclosing while loops, 1 outside loops, None if any is unknown.
        in_branch: the computation is (transitively) a branch of a conditional: it runs
            only when that branch is taken (e.g. sampling, which greedy steps skip).
    """

    in_loop: bool
    trip_count: int | None
    in_branch: bool = False


def loop_contexts(module: HloModuleText) -> dict[str, LoopContext]:
    """The loop context of every computation reachable from the entry computation.

    A computation reached along several call paths keeps the first context found in
    breadth-first order from the entry; XLA clones bodies per call site in practice.
    """
    contexts = {module.entry: LoopContext(False, 1)}
    queue = deque([module.entry])
    while queue:
        comp = queue.popleft()
        outer = contexts[comp]
        for instr in module.computations.get(comp, {}).values():
            inner = outer
            if instr.opcode == "while":
                trip = known_trip_count(instr)
                if trip is None:
                    trip = counted_trip_count(module, comp, instr)
                count = (
                    None if trip is None or outer.trip_count is None else outer.trip_count * trip
                )
                inner = LoopContext(True, count, outer.in_branch)
            elif instr.opcode == "conditional":
                inner = LoopContext(outer.in_loop, outer.trip_count, True)
            for callee in callees(instr):
                if callee in module.computations and callee not in contexts:
                    contexts[callee] = inner
                    queue.append(callee)
    return contexts
