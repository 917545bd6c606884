"""Reasoning parsers: the model's reasoning split from its answer, as the text streams.

Named as vLLM's ``--reasoning-parser`` names them:

* ``qwen3``: reasoning is ``<think>...</think>`` at the start of the output; an output
  that does not start with ``<think>`` (thinking switched off) is all answer;
* ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output is
  reasoning up to ``</think>`` (a ``<think>`` the model writes itself is dropped); an
  output that never closes it is all reasoning;
* ``openai``: GPT-OSS's harmony messages, whose ``analysis`` channel is reasoning
  (:class:`~jaxpar.server._tool_parsers.HarmonyParser`).

Each hands out ``reasoning`` and ``content`` :class:`Event` s; the content goes on to the
tool-call parser, if any. :meth:`ReasoningFormat.prefix` is the grammar of the reasoning,
so that a constraint (a tool call, a JSON schema) applies to the answer after it.
"""

from __future__ import annotations

from typing import ClassVar

from jaxpar.server._stream_text import Event, content, cut, reasoning

THINK, END_THINK = "<think>", "</think>"


class _Think:
    """``<think>`` reasoning ``</think>`` answer; whitespace right after ``</think>`` is
    dropped."""

    #: Whether the output starts inside the reasoning (the prompt opened it).
    OPENED: ClassVar[bool]

    def __init__(self) -> None:
        self._mode = "start"  # "start", "reasoning", "gap" (after </think>), "content"
        self._buf = ""

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True)

    def _run(self, *, final: bool) -> list[Event]:
        events: list[Event] = []
        if self._mode == "start":
            head = self._buf.lstrip()
            if head.startswith(THINK):
                self._buf, self._mode = head[len(THINK) :], "reasoning"
            elif not final and THINK.startswith(head):
                return events  # undecided
            else:
                self._mode = "reasoning" if self.OPENED else "content"
        if self._mode == "reasoning":
            before, marker, self._buf = cut(self._buf, (END_THINK,), final=final)
            events += reasoning(before)
            if marker is None:
                return events
            self._mode = "gap"
        if self._mode == "gap":
            self._buf = self._buf.lstrip()
            if not self._buf:
                return events
            self._mode = "content"
        out, self._buf = self._buf, ""
        return events + content(out)


class Qwen3Reasoning(_Think):
    OPENED = False


class DeepSeekR1Reasoning(_Think):
    OPENED = True


class ReasoningFormat:
    """A reasoning parser's name, its incremental parser, and its grammar."""

    name: ClassVar[str]
    parser: ClassVar[type]

    def new_parser(self):
        return self.parser()

    def prefix(self, lit) -> tuple[str, list[str]]:
        """``(expression, rules)``: a Lark expression for the reasoning before the answer
        and the rules it uses; ``lit`` spells a fixed text for the grammar
        (:class:`~jaxpar.server._tools.Spelling`)."""
        raise NotImplementedError


class Qwen3(ReasoningFormat):
    name, parser = "qwen3", Qwen3Reasoning

    def prefix(self, lit) -> tuple[str, list[str]]:
        rules = [
            f"think[lazy]: {lit(THINK)} /(.|\\n)*/ {lit(END_THINK)}",
            "think_gap: /[ \\t\\n]*/",
        ]
        return "(think think_gap)?", rules


class DeepSeekR1(ReasoningFormat):
    name, parser = "deepseek_r1", DeepSeekR1Reasoning

    def prefix(self, lit) -> tuple[str, list[str]]:
        rules = [
            f"think[lazy]: /(.|\\n)*/ {lit(END_THINK)}",
            "think_gap: /[ \\t\\n]*/",
        ]
        return "think think_gap", rules


class Harmony(ReasoningFormat):
    name = "openai"

    @property
    def parser(self):  # the harmony parser reads every channel
        from jaxpar.server._tool_parsers import HarmonyParser

        return HarmonyParser

    def new_parser(self):
        return self.parser()

    def prefix(self, lit) -> tuple[str, list[str]]:
        head = f"{lit('<|channel|>')} {lit('analysis')} {lit('<|message|>')}"
        if lit.special("<|end|>"):  # text cannot hold a special token: no need to be lazy
            rules = [
                f"analysis: {head} ANALYSIS_TEXT {lit('<|end|>')}",
                "ANALYSIS_TEXT: /(.|\\n)*/",
            ]
        else:
            rules = [f"analysis: {head} abody", f"abody[lazy]: /(.|\\n)*/ {lit('<|end|>')}"]
        return f"(analysis {lit('<|start|>')} {lit('assistant')})*", rules


#: The reasoning formats by ``--reasoning-parser`` name.
REASONING: dict[str, ReasoningFormat] = {f.name: f() for f in (Qwen3, DeepSeekR1, Harmony)}
