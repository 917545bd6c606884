"""GPT-OSS through the harmony format, with OpenAI's ``openai-harmony`` package.

GPT-OSS "should not be used without the harmony format": its prompt is a system message
(the reasoning effort), a developer message (the instructions and the function tools as
harmony's TypeScript-like namespace) and the conversation, each message on its channel;
its answer is messages too, read token by token. A checkpoint that is GPT-OSS
(``model_type`` ``gpt_oss``) with harmony's tokenizer (:func:`uses_harmony`) is served
this way, on ``/v1/chat/completions`` and ``/v1/responses`` alike:

* :func:`render_chat`: an OpenAI chat history (system and developer messages, user
  messages, assistant messages with ``reasoning_content`` and ``tool_calls``, ``tool``
  results) and its tools become the prompt's token ids, rendered by harmony's own
  renderer (which drops the reasoning of finished turns, as the format asks);
* :class:`HarmonyTokenParser`: the answer's token ids go through harmony's
  ``StreamableParser``; the ``analysis`` channel is reasoning, a message to
  ``functions.NAME`` is a call of ``NAME`` (its body the arguments), the ``final``
  channel (and any other) is the content. It hands out the same
  :class:`~jaxpar.server._stream_text.Event` s as the text parsers.

The encoding's vocabulary (``o200k_base``) is a file harmony downloads once, or reads from
the folder ``TIKTOKEN_ENCODINGS_BASE`` names (offline).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from jaxpar.server._stream_text import Event

#: The token that opens a harmony channel (a GPT-OSS tokenizer has it as a special token).
CHANNEL = "<|channel|>"
#: The reasoning efforts harmony's system message takes.
EFFORTS = ("low", "medium", "high")


def uses_harmony(checkpoint: str | Path, tokenizer) -> bool:
    """Whether ``checkpoint`` is served through harmony: a GPT-OSS config and a tokenizer
    with harmony's special tokens (a test model with another tokenizer keeps its chat
    template)."""
    config = Path(checkpoint) / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    has_channel = tokenizer is not None and tokenizer.token_to_id(CHANNEL) is not None
    return model_type == "gpt_oss" and has_channel


@functools.cache
def encoding():
    """harmony's GPT-OSS encoding (loaded once).

    Raises:
        ConfigError: ``openai-harmony`` is not installed, or its vocabulary could not be
            downloaded nor read from ``TIKTOKEN_ENCODINGS_BASE``.
    """
    from jaxpar.errors import ConfigError

    try:
        import openai_harmony as oh
    except ImportError as e:
        raise ConfigError(
            "GPT-OSS is served through the harmony format, which needs the openai-harmony "
            "package: pip install 'jaxpar[harmony]'"
        ) from e
    try:
        return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    except oh.HarmonyError as e:
        raise ConfigError(
            f"openai-harmony could not load GPT-OSS's encoding ({e}); offline, put "
            "o200k_base.tiktoken in a folder and name it in TIKTOKEN_ENCODINGS_BASE"
        ) from e


# --- the prompt ---------------------------------------------------------------------------


def render_chat(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    reasoning_effort: str | None = None,
) -> list[int]:
    """The prompt's token ids: ``messages`` (OpenAI's chat form, as
    :meth:`~._protocol.ChatMessage.rendered` gives them) and ``tools`` (OpenAI's
    function tools) rendered by harmony for the assistant's next message.

    System and developer messages become the developer message's instructions; the
    tools its ``functions`` namespace; ``reasoning_effort`` (default ``medium``) the
    system message's.

    Raises:
        ConfigError: a role harmony has no place for, or a tool result whose call is
            not in the history.
    """
    import openai_harmony as oh

    from jaxpar.errors import ConfigError

    system = oh.SystemContent.new()
    if reasoning_effort is not None:
        system = system.with_reasoning_effort(oh.ReasoningEffort(reasoning_effort.capitalize()))
    instructions = [m["content"] for m in messages if m["role"] in ("system", "developer")]
    out = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
    if instructions or tools:
        developer = oh.DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions("\n\n".join(instructions))
        if tools:
            developer = developer.with_function_tools([_tool(t) for t in tools])
        out.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer))
    names: dict[str, str] = {}  # tool_call_id -> function name
    for i, message in enumerate(messages):
        role = message["role"]
        if role in ("system", "developer"):
            continue
        if role == "user":
            out.append(oh.Message.from_role_and_content(oh.Role.USER, message["content"]))
        elif role == "assistant":
            out += _assistant(oh, message, names)
        elif role == "tool":
            out.append(_tool_result(oh, message, names, i))
        else:
            raise ConfigError(
                f"messages.{i}.role: {role!r}; harmony takes system, developer, user, "
                "assistant and tool messages"
            )
    conversation = oh.Conversation.from_messages(out)
    return list(encoding().render_conversation_for_completion(conversation, oh.Role.ASSISTANT))


def _tool(tool: dict[str, Any]):
    import openai_harmony as oh

    function = tool["function"]
    parameters = function.get("parameters")
    if parameters is not None and not parameters.get("properties"):
        parameters = None  # no arguments: harmony writes ``() => any``
    return oh.ToolDescription.new(
        function["name"], function.get("description") or "", parameters=parameters
    )


def _assistant(oh, message: dict[str, Any], names: dict[str, str]) -> list:
    """An assistant turn as harmony messages: its reasoning (``analysis``), its answer
    (``final``), its calls (``commentary`` to ``functions.NAME``, JSON)."""
    out = []
    if message.get("reasoning_content"):
        text = message["reasoning_content"]
        out.append(
            oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel("analysis")
        )
    if message.get("content"):
        answer = oh.Message.from_role_and_content(oh.Role.ASSISTANT, message["content"])
        out.append(answer.with_channel("final"))
    for call in message.get("tool_calls") or ():
        function = call["function"]
        names[call.get("id") or ""] = function["name"]
        arguments = function["arguments"]
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        sent = (
            oh.Message.from_role_and_content(oh.Role.ASSISTANT, arguments)
            .with_channel("commentary")
            .with_recipient(f"functions.{function['name']}")
            .with_content_type("<|constrain|>json")
        )
        out.append(sent)
    return out


def _tool_result(oh, message: dict[str, Any], names: dict[str, str], i: int):
    """A ``tool`` message as the function's answer to the assistant."""
    from jaxpar.errors import ConfigError

    name = message.get("name") or names.get(message.get("tool_call_id") or "")
    if name is None:
        raise ConfigError(
            f"messages.{i}.tool_call_id: {message.get('tool_call_id')!r} names no call of an "
            "earlier assistant message; harmony needs the function a result answers"
        )
    author = oh.Author.new(oh.Role.TOOL, f"functions.{name}")
    result = oh.Message.from_author_and_content(author, message["content"])
    return result.with_channel("commentary").with_recipient("assistant")


# --- the answer ---------------------------------------------------------------------------


class HarmonyTokenParser:
    """The answer's token ids in, :class:`Event` s out, through harmony's
    ``StreamableParser`` (fed any split, the same events come out).

    A message sent to ``functions.NAME`` is a call (``call`` when its header ends, then
    its body as ``args``); ``analysis`` is ``reasoning``; any other channel is
    ``content``. Tokens harmony cannot parse (a model that left the format) end the
    parsing: their text, and everything after, is content; so is an answer with no
    message in it.
    """

    def __init__(self) -> None:
        import openai_harmony as oh

        self._oh = oh
        self._parser = oh.StreamableParser(encoding(), role=oh.Role.ASSISTANT)
        self._broken: list[int] | None = None  # the tokens since harmony gave up
        self._message = -1  # the message whose header was read (its index)
        self._kind = "content"
        self.calls = 0

    def feed_tokens(self, ids: list[int]) -> list[Event]:
        events: list[Event] = []
        for token in ids:
            if self._broken is not None:
                self._broken.append(token)
                continue
            try:
                self._parser.process(token)
            except self._oh.HarmonyError:
                self._broken = [token]
                continue
            events += self._step()
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._broken is None and self._message < 0:  # no message at all: not harmony
            self._broken = list(self._parser.tokens)
        if self._broken is None:
            try:
                self._parser.process_eos()
            except self._oh.HarmonyError:
                self._broken = []
        if self._broken:
            text = encoding().decode(self._broken)
            events.append(Event("content", text))
            self._broken = []
        if self._kind == "call" and self._message >= 0:
            self.calls += 1
            self._kind = "content"
        return events

    def _step(self) -> list[Event]:
        """Events of the token just processed."""
        parser = self._parser
        events: list[Event] = []
        done = len(parser.messages)
        if self._message < done and self._message >= 0 and self._kind == "call":
            self.calls += 1  # the call's message ended
            self._kind = "content"
        if parser.state != self._oh.StreamState.CONTENT:
            return events
        if self._message != done:  # a new message's body starts
            self._message = done
            self._kind = _kind_of(parser.current_channel, parser.current_recipient)
            if self._kind == "call":
                name = parser.current_recipient.removeprefix("functions.")
                events.append(Event("call", index=self.calls, name=name))
        delta = parser.last_content_delta
        if delta:
            kind = "args" if self._kind == "call" else self._kind
            events.append(Event(kind, delta, index=self.calls))
        return events


def _kind_of(channel: str | None, recipient: str | None) -> str:
    if recipient is not None and recipient.startswith("functions."):
        return "call"
    return "reasoning" if channel == "analysis" else "content"
