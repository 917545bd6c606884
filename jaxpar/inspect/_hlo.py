"""Collectives read back from compiled XLA programs.

:func:`parse_collectives` turns the text of ``jax.jit(f).lower(*args).compile()`` into
:class:`Collective` records. Kinds recorded:

* ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all``,
  ``collective-permute`` -- synchronous forms, as XLA:CPU prints them;
* the asynchronous GPU/TPU pairs ``all-reduce-start``/``-done``,
  ``all-gather-start``/``-done``, ``collective-permute-start``/``-done``,
  ``ragged-all-to-all-start``/``-done`` (libtpu 0.0.50 on): each pair is
  one collective of the base kind, read from the ``-start`` op (``is_async=True``);
  the ``-done`` op is ignored. Collectives that GPU wraps in ``async-start`` (e.g.
  reduce-scatter, all-to-all) are found inside the wrapped computation, once;
* ``send``: GPU pipelining may lower a collective-permute to send/recv pairs. Each
  ``send`` is recorded once, with the payload bytes; ``recv`` (its mirror),
  ``send-done``/``recv-done`` and host transfers (``is_host_transfer=true``) are not.

Byte convention (:attr:`Collective.bytes`): the bytes of the full logical tensor that
each participating device holds for the collective, summed over tuple elements --
the reduced tensor for all-reduce, the gathered result for all-gather, the *input*
(before scattering) for reduce-scatter, the per-device buffer for all-to-all and
collective-permute, the payload for send. For async ``-start`` ops whose result is a
tuple (operand, output[, context...]) only the output part counts. These are buffer
sizes, not wire traffic: a ring all-reduce sends about ``2 (n-1)/n`` times ``bytes``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from jaxpar.inspect._groups import (
    Groups,
    Pairs,
    parse_replica_groups,
    parse_source_target_pairs,
)
from jaxpar.inspect._hlo_text import (
    ArrayShape,
    HloModuleText,
    Instruction,
    LoopContext,
    flatten_shape,
    loop_contexts,
    parse_module,
)

KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",  # bytes: its receive buffer, an upper bound (sizes are runtime data)
    "collective-permute",
    "send",
)
_ASYNC_STARTS = {
    f"{k}-start": k for k in ("all-reduce", "all-gather", "collective-permute", "ragged-all-to-all")
}
_OP_NAME_PREFIX = 'op_name="'
_CHAIN_ID = re.compile(r'chain_id="([^"]*)"')


class _HasText(Protocol):
    def as_text(self) -> str: ...


@dataclass(frozen=True)
class Collective:
    """One collective operation found in a compiled HLO module.

    Attributes:
        kind: one of :data:`KINDS` (async ``-start`` forms report their base kind).
        name: the HLO instruction name.
        computation: name of the enclosing HLO computation.
        shapes: result array shapes (for async starts: the output part only).
        dtypes: element type of each entry of ``shapes``.
        bytes: bytes of the full logical tensor per participating device (see the
            module docstring for the exact per-kind rule).
        replica_groups: device groups as logical ids (positions in the mesh's
            flattened device order); None when not printed (collective-permute, send).
        groups_form: how the groups were printed: "explicit", "iota", "mesh", "none".
        source_target_pairs: (source, target) logical ids for collective-permute/send.
        channel_id: the ``channel_id`` attribute, if printed.
        use_global_device_ids: whether ``use_global_device_ids=true`` was printed.
        op_name: the ``op_name`` metadata (jax named scopes appear in it), if any.
        is_async: read from an async ``-start`` op.
        in_loop: inside a while-loop body or condition (e.g. from ``lax.scan``).
        in_branch: inside a branch of a conditional (``lax.cond``): runs only when that
            branch is taken, though the program text always holds it.
        trip_count: executions per program run: 1 outside loops, the product of the
            enclosing loops' ``known_trip_count`` inside, None if one is unknown.
    """

    kind: str
    name: str
    computation: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    bytes: int
    replica_groups: Groups | None
    groups_form: str
    source_target_pairs: Pairs | None
    channel_id: int | None
    use_global_device_ids: bool
    op_name: str | None
    is_async: bool
    in_loop: bool
    trip_count: int | None
    in_branch: bool = False

    @property
    def total_bytes(self) -> int | None:
        """``bytes`` times ``trip_count``; None when the trip count is unknown."""
        return None if self.trip_count is None else self.bytes * self.trip_count


def _op_name(attrs: str) -> str | None:
    start = attrs.find(_OP_NAME_PREFIX)
    if start < 0:
        return None
    start += len(_OP_NAME_PREFIX)
    end = start
    while end < len(attrs) and attrs[end] != '"':
        end += 2 if attrs[end] == "\\" else 1
    return attrs[start:end].replace('\\"', '"')


def _int_attr(attrs: str, key: str) -> int | None:
    found = re.search(rf"(?:^|[\s,]){key}=(\d+)", attrs)
    return int(found.group(1)) if found else None


def _output_arrays(instr: Instruction, kind: str, is_async: bool) -> list[ArrayShape]:
    shape = instr.shape
    if kind == "send":
        # send returns (payload, u32[] context, token[]): the payload is element 0.
        return flatten_shape(shape[0]) if isinstance(shape, tuple) else []
    if is_async and kind != "all-reduce" and isinstance(shape, tuple):
        # (operand(s), output(s)[, u32[] contexts]): the output is element 1.
        return flatten_shape(shape[1])
    return flatten_shape(shape)


def _operand_bytes(module: HloModuleText, instr: Instruction) -> int | None:
    total = 0
    for operand in instr.operands:
        shape = module.shape_of(instr.computation, operand)
        if shape is None:
            return None
        total += sum(a.nbytes for a in flatten_shape(shape))
    return total


def _collective_kind(instr: Instruction) -> tuple[str, bool] | None:
    if instr.opcode in _ASYNC_STARTS:
        return _ASYNC_STARTS[instr.opcode], True
    if instr.opcode in KINDS and instr.opcode != "send":
        return instr.opcode, False
    if instr.opcode == "send" and "is_host_transfer=true" not in instr.attrs:
        return "send", False
    return None


def _record(
    module: HloModuleText, instr: Instruction, kind: str, is_async: bool, loop: LoopContext
) -> Collective:
    arrays = _output_arrays(instr, kind, is_async)
    groups, form = parse_replica_groups(instr.attrs, module.num_partitions)
    nbytes = sum(a.nbytes for a in arrays)
    if kind == "reduce-scatter":
        # The full logical tensor is the input; fall back to output x group size when
        # an operand's shape is not in the text.
        operand = _operand_bytes(module, instr)
        size = len(groups[0]) if groups else (module.num_partitions or 1)
        nbytes = operand if operand is not None else nbytes * size
    return Collective(
        kind=kind,
        name=instr.name,
        computation=instr.computation,
        shapes=tuple(a.dims for a in arrays),
        dtypes=tuple(a.dtype for a in arrays),
        bytes=nbytes,
        replica_groups=groups,
        groups_form=form,
        source_target_pairs=parse_source_target_pairs(instr.attrs),
        channel_id=_int_attr(instr.attrs, "channel_id"),
        use_global_device_ids="use_global_device_ids=true" in instr.attrs,
        op_name=_op_name(instr.attrs),
        is_async=is_async,
        in_loop=loop.in_loop,
        trip_count=loop.trip_count,
        in_branch=loop.in_branch,
    )


def parse_collectives(hlo: str | _HasText) -> list[Collective]:
    """All collectives of a compiled HLO module, in text order.

    Args:
        hlo: the module text, or an object with ``as_text()`` such as the result of
            ``jax.jit(f).lower(*args).compile()``. Pre-optimisation HLO text
            (``lower(...).as_text(dialect="hlo")``) also reads, but holds only the
            collectives written explicitly (shard_map); the partitioner adds the
            rest during compilation.

    Returns:
        One :class:`Collective` per collective instruction. Computations not
        reachable from the entry (dead code) are skipped; a text without an ENTRY
        computation is read as straight-line code.
    """
    text = hlo if isinstance(hlo, str) else hlo.as_text()
    module = parse_module(text)
    contexts = loop_contexts(module) if module.entry else {}
    found: list[Collective] = []
    chained: set[tuple[str, int | None, str]] = set()
    for comp, instructions in module.computations.items():
        context = contexts.get(comp, None if module.entry else LoopContext(False, 1))
        if context is None:
            continue
        for instr in instructions.values():
            kind = _collective_kind(instr)
            if kind is None:
                continue
            # XLA:TPU splits an async collective into fusions (a start, continuations, a
            # done), each holding the same op with the same channel and chain ids: one
            # collective, counted once.
            chain = _CHAIN_ID.search(instr.attrs)
            if chain is not None:
                key = (kind[0], _int_attr(instr.attrs, "channel_id"), chain.group(1))
                if key in chained:
                    continue
                chained.add(key)
            found.append(_record(module, instr, kind[0], kind[1], context))
    return found
