"""The OpenAI request bodies this server accepts (pydantic, strict types).

``n`` choices per prompt, and a list of prompts in ``/v1/completions``, are separate
requests in the batcher (choice ``i`` of a seeded request samples with ``seed + i``).
``logprobs`` (completions: the number of alternatives; chat: ``logprobs`` and
``top_logprobs``), ``echo`` (completions; with ``max_tokens`` 0: the prompt's
log-likelihoods alone), ``presence_penalty`` and ``frequency_penalty`` are OpenAI's.
Fields OpenAI defines that this server cannot honour (``logit_bias``, ``suffix``, ...)
are refused with a 400 naming the field rather than ignored. Extensions, as
vLLM spells them: ``top_k``, ``repetition_penalty``, ``ignore_eos`` and
``return_token_ids`` (the prompt's and the completion's token ids in each choice).

Structured output (:mod:`jaxpar.engine._grammar`), on both endpoints: OpenAI's
``response_format`` (``{"type": "json_object"}``, or ``{"type": "json_schema",
"json_schema": {"name": ..., "schema": {...}, "strict": ...}}``), or one of vLLM's
``guided_json`` (a schema), ``guided_regex``, ``guided_choice`` (a list of strings) and
``guided_grammar`` (Lark or GBNF). At most one per request.

Tool calling, on chat only (:mod:`jaxpar.server._tools`): ``tools`` (functions with JSON
schema parameters), ``tool_choice`` (``"none"``, ``"auto"``, ``"required"`` or
``{"type": "function", "function": {"name": ...}}``) and ``parallel_tool_calls``; the
history may hold assistant messages with ``tool_calls`` and ``tool`` messages.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxpar.engine import MAX_TOP_LOGPROBS

#: The most choices one request asks for (``n`` x prompts).
MAX_CHOICES = 64

#: Fields accepted only at their "off" value: name -> the values that mean off.
_UNSUPPORTED = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
}


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema. ``strict`` is accepted
    either way: the schema is always enforced, token by token."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or a JSON schema."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class _Generate(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 and 0: no top-k (vLLM)
    seed: int | None = Field(default=None, ge=0, lt=2**32)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    return_token_ids: bool = False
    user: str | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    #: Fields of the other endpoint this one refuses (name -> the values that mean off).
    refused: ClassVar[dict[str, tuple]] = {}

    def unsupported(self) -> str | None:
        """The first field set to something this server does not do, or None."""
        extra = self.model_extra or {}
        for name, off in (_UNSUPPORTED | self.refused).items():
            if name in extra and not any(
                extra[name] == o and type(extra[name]) is type(o) for o in off
            ):
                return name
        return None

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def penalties(self) -> dict[str, float | None]:
        """The penalties as asked for (None: left out, the defaults' apply)."""
        names = ("presence_penalty", "frequency_penalty", "repetition_penalty")
        return {name: getattr(self, name) for name in names}

    @property
    def top_logprobs_asked(self) -> int | None:
        """Alternatives per new token (None: no logprobs)."""
        raise NotImplementedError


class CompletionRequest(_Generate):
    """``POST /v1/completions``: a prompt, or a list of prompts, as text or token ids.

    ``logprobs``: each new token's logprob and this many alternatives; ``echo``: the
    prompt comes back before the completion (with its tokens' logprobs when ``logprobs``
    is given); ``max_tokens`` 0 is allowed with ``echo`` only.
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    refused: ClassVar[dict[str, tuple]] = {  # chat's: say logprobs=N; tools are chat's
        "top_logprobs": (None,),
        "tools": (None, []),
        "tool_choice": (None, "none"),
    }

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    """A call as the history holds it: ``arguments`` is JSON text."""

    model_config = ConfigDict(strict=True, extra="ignore")

    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def rendered(self) -> dict[str, Any]:
        """The message as chat templates take it (as ``transformers`` passes it): a
        call's ``arguments`` as an object where they parse."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _loads(call)},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


def _loads(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: str
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: str
    function: FunctionName


class ChatRequest(_Generate):
    """``POST /v1/chat/completions``: messages rendered with the checkpoint's template.

    ``logprobs``: each new token's logprob, with ``top_logprobs`` alternatives.
    """

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    #: GPT-OSS's reasoning effort (its harmony system message); other models ignore it.
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    refused: ClassVar[dict[str, tuple]] = {"echo": (None, False)}  # completions'

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def rendered_messages(self) -> list[dict[str, Any]]:
        return [m.rendered() for m in self.messages]
