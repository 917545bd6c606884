"""A chat choice's parsed answer as OpenAI spells it: the whole ``message`` (with
``reasoning_content`` and ``tool_calls``), or stream chunks whose ``delta`` carries
reasoning, content or a tool call's pieces (its index, id, type and name first, then
fragments of its arguments), and ``finish_reason`` ``"tool_calls"`` when the answer
called a tool."""

from __future__ import annotations

from typing import Any

from jaxpar.server._stream_text import Event


def output_finish_reason(job) -> str | None:
    """``"tool_calls"`` for an answer that called a tool and ended by itself."""
    if job.output.calls and job.finish_reason == "stop":
        return "tool_calls"
    return job.finish_reason


def finish_output(job, text: str) -> dict[str, Any]:
    """The message of a choice whose whole ``text`` is there."""
    output = job.output
    output.feed(text, job.tokens)
    output.finish()
    job.finish_reason = output_finish_reason(job)
    return output.message()


def output_chunks(
    fmt, job, index: int, model: str, events: list[Event], ids: list[int], logprobs
) -> list[dict]:
    """The stream chunks of ``events``; the piece's token ids and logprobs ride on the
    first (on an empty delta when the piece added nothing yet: a parser holds it)."""
    deltas = job.output.deltas(events)
    if not deltas and (ids or logprobs):
        deltas = [{}]
    chunks = []
    for i, delta in enumerate(deltas):
        first = i == 0
        chunks.append(
            fmt.chunk(
                job,
                index,
                model,
                None,
                ids if first else [],
                None,
                logprobs if first else None,
                delta=delta,
            )
        )
    return chunks
