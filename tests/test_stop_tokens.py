"""Stop tokens: several at once, one that is the first generated token, in the pipelined loop
and while streaming. Each row ends at its first stop token (kept), other rows go on."""

from __future__ import annotations

import functools

import pytest

from jaxpar.spec import ParallelConfig
from tests._engine_util import NEW_TOKENS, PROMPTS, engine, reference

PC = ParallelConfig


def cut(tokens: list[int], stops: set[int]) -> list[int]:
    """``tokens`` up to and including the first stop token."""
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


@functools.cache
def _engine(parallel: ParallelConfig):
    return engine("tiny-dense", parallel)


def stop_sets() -> dict[str, set[int]]:
    """Stops picked from the unstopped greedy run of the shared prompts."""
    full = reference("tiny-dense")[1]
    first = full[0][0]  # row 0 stops on its very first token
    later = next(t for t in full[2][3:] if t != first and t not in full[2][:3])
    return {"first-token": {first}, "several": {first, later, full[4][-1]}}


@pytest.mark.parametrize("parallel", [PC(), PC(pp=2, tp=2)], ids=str)
@pytest.mark.parametrize("which", ["first-token", "several"])
def test_fused_loop_stops_each_row_at_its_first_stop(parallel, which):
    full = reference("tiny-dense")[1]
    stops = stop_sets()[which]
    got = _engine(parallel).generate(PROMPTS, NEW_TOKENS, stop_tokens=sorted(stops)).tokens
    want = [cut(row, stops) for row in full]
    assert got == want
    assert got[0] == [full[0][0]]  # a stop token as the first generated token ends the row
    assert sum(len(w) < NEW_TOKENS for w in want) >= (1 if which == "first-token" else 2)


@pytest.mark.parametrize("parallel", [PC(), PC(pp=2, tp=2)], ids=str)
def test_streaming_with_stops(parallel):
    """The callback sees each row's tokens until its stop, then -1; the streamed result
    equals the fused loop's, and streaming ends once every row has stopped."""
    full = reference("tiny-dense")[1]
    stops = stop_sets()["several"]
    seen: list[list[int]] = []
    eng = _engine(parallel)
    streamed = eng.generate(
        PROMPTS,
        NEW_TOKENS,
        stop_tokens=sorted(stops),
        callback=lambda step, tokens_B: seen.append(tokens_B.tolist()),
    )
    want = [cut(row, stops) for row in full]
    assert streamed.tokens == want
    for i, row in enumerate(want):
        column = [step[i] for step in seen]
        assert column[: len(row)] == row and set(column[len(row) :]) <= {-1}
    assert all(step[len(PROMPTS) :] == [-1] * (8 - len(PROMPTS)) for step in seen)  # padding rows
    assert len(seen) == max(len(row) for row in want)


def test_streaming_ends_when_every_row_stops():
    full = reference("tiny-dense")[1]
    stops = {row[1] for row in full}  # every row stops by its second token
    seen = []
    got = (
        _engine(PC())
        .generate(
            PROMPTS, NEW_TOKENS, stop_tokens=sorted(stops), callback=lambda s, t: seen.append(s)
        )
        .tokens
    )
    assert got == [cut(row, stops) for row in full] and max(map(len, got)) <= 2
    assert seen == list(range(max(map(len, got))))


def test_pipelined_loop_takes_the_token_count_at_run_time():
    """One pipelined decode-loop program serves every max_new_tokens (item 9 for pp)."""
    eng = _engine(PC(pp=2, tp=2))
    full = reference("tiny-dense")[1]
    programs = []
    for n in (NEW_TOKENS, 5, NEW_TOKENS - 1):
        assert eng.generate(PROMPTS, n).tokens == [row[:n] for row in full]
        programs.append([key for key in eng.steps._compiled if key[0] == "decode_loop"])
    assert len(programs[0]) >= 1 and programs[0] == programs[-1]
