"""``POST /v1/responses``: OpenAI's Responses API over the chat path.

A request's ``input`` (text, or a list of items: messages, ``function_call`` and
``function_call_output`` items; ``reasoning`` items are dropped, as chat templates drop
past reasoning), its ``instructions`` (a system message, not carried to the next turn, as
OpenAI does), function ``tools``, ``tool_choice``, ``parallel_tool_calls``,
``max_output_tokens``, sampling and ``text.format`` become a chat request, checked and
run as :mod:`jaxpar.server._tools` runs chat requests (the chat template renders it; a
tool-call or reasoning parser reads the answer). The answer comes back as output items:
``reasoning`` (its text as ``reasoning_text`` content), a ``message`` (``output_text``)
and ``function_call`` items; streamed (``stream: true``) as OpenAI's typed events.

``previous_response_id`` continues a conversation kept in memory: each stored response
keeps its whole history (input and output items as chat messages), in a store bounded
to :data:`STORE_SIZE` responses (the oldest forgotten first; ``store: false`` keeps
nothing). An unknown or forgotten id is a 400 naming the field. GPT-OSS's harmony format
is served through its chat template and the ``openai`` parsers, not ``openai-harmony``.
"""

from __future__ import annotations

import collections
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxpar.server._errors import APIError, bad_request
from jaxpar.server._protocol import ChatRequest
from jaxpar.server._service import Job, Service
from jaxpar.server._stream_text import Event
from jaxpar.server._tools import ChatOutput

#: Responses kept for ``previous_response_id``.
STORE_SIZE = 1024


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    format: TextFormat | None = None


class ReasoningOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    effort: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(BaseModel):
    """The fields of a Responses request this server reads (others are ignored, as
    OpenAI's metadata-like fields: ``metadata``, ``truncation``...); ``reasoning.effort``
    is GPT-OSS's reasoning effort."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**32)
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    text: TextOptions | None = None
    user: str | None = None
    reasoning: ReasoningOptions | None = None


class ResponseStore:
    """Responses by id, with the history that follows each; at most ``size`` kept."""

    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self._kept: collections.OrderedDict[str, tuple[list[dict], dict]] = (
            collections.OrderedDict()
        )

    def put(self, response: dict, history: list[dict]) -> None:
        self._kept[response["id"]] = (history, response)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def history(self, response_id: str) -> list[dict]:
        """The messages a response's conversation holds, its answer included.

        Raises:
            APIError: 400 naming ``previous_response_id`` when it is not kept.
        """
        if response_id not in self._kept:
            raise bad_request(
                f"previous_response_id: {response_id!r} is not a response this server keeps "
                f"(it keeps the last {self.size} stored ones, in memory)",
                "previous_response_id",
                "not_found",
            )
        self._kept.move_to_end(response_id)
        return list(self._kept[response_id][0])

    def get(self, response_id: str) -> dict | None:
        kept = self._kept.get(response_id)
        return None if kept is None else kept[1]


# --- request -> chat ------------------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
                raise bad_request(
                    f"{where}.{i}: only text parts (input_text, output_text) are served",
                    f"{where}.{i}",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise bad_request(f"{where}: give text, or a list of text parts", where)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of a request's ``input`` (calls join the assistant turn they follow).

    Raises:
        APIError: 400 naming the item that is not a message, call or call output.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message" or ("role" in item and "type" not in item):
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"{where}.role: {role!r}; user, system, developer or assistant", f"{where}.role"
                )
            role = "system" if role == "developer" else role
            messages.append(
                {"role": role, "content": _text_of(item.get("content"), f"{where}.content")}
            )
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind != "reasoning":
            raise bad_request(
                f"{where}.type: {kind!r}; served: message, function_call, "
                "function_call_output, reasoning",
                f"{where}.type",
            )
    return messages


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's (``{"type", "function": {...}}``)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools.{i}.type: {tool.get('type')!r}; the only tool type served is 'function'",
                f"tools.{i}.type",
            )
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatRequest:
    """The chat request that runs ``body`` over ``messages``.

    Raises:
        APIError: 400 naming the field a chat request refuses.
    """
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "user": body.user,
        "tools": _chat_tools(body.tools),
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
    }
    form = body.text.format if body.text is not None else None
    if form is not None and form.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif form is not None and form.type == "json_schema":
        schema = {"name": form.name or "output", "schema": form.json_schema, "strict": form.strict}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("list[", "dict[")))
        param = {"max_tokens": "max_output_tokens"}.get(param, param)
        raise bad_request(f"{param}: {first['msg']}", param) from e


# --- answer -> output items ----------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id or _new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id or _new_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _call_item(call: dict[str, Any], status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or _new_id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def output_items(output: ChatOutput | None, text: str, status: str) -> list[dict[str, Any]]:
    """The output items of a finished answer (``output``: its parser, if any)."""
    if output is None:
        return [_message_item(text, status)] if text else []
    items = []
    if output.reasoning:
        items.append(_reasoning_item(output.reasoning))
    content = output.message()["content"]
    if content:
        items.append(_message_item(content, status))
    items += [_call_item(call, status) for call in output.calls]
    return items


def history_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the chat messages that follow them in a conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "message":
            message["content"] += "".join(c["text"] for c in item["content"])
        elif item["type"] == "function_call":
            call = {"name": item["name"], "arguments": item["arguments"]}
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": call}
            )
    return [message]


class _Turn:
    """One Responses request on its way: its chat form, job and envelope."""

    def __init__(self, body: ResponsesRequest, chat: ChatRequest, history: list[dict]):
        self.body, self.chat, self.history = body, chat, history
        self.id = _new_id("resp")
        self.created = int(time.time())

    def envelope(self, status: str, output: list[dict], job: Job | None) -> dict[str, Any]:
        body = self.body
        response: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": body.model,
            "output": output,
            "instructions": body.instructions,
            "previous_response_id": body.previous_response_id,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "store": body.store,
            "text": {"format": {"type": "text"}},
            "error": None,
            "incomplete_details": None,
            "metadata": {},
        }
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if job is not None and job.finish_reason is not None:
            prompt, new = len(job.prompt), len(job.tokens)
            response["usage"] = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": job.stream.cached_tokens},
                "output_tokens": new,
                "total_tokens": prompt + new,
            }
        return response


def _status(job: Job) -> str:
    return "incomplete" if job.finish_reason == "length" else "completed"


def _submit(service: Service, body: ResponsesRequest, store: ResponseStore) -> tuple[_Turn, Job]:
    """Checks ``body`` and queues it; every refusal before anything queues."""
    history = store.history(body.previous_response_id) if body.previous_response_id else []
    history += input_messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat = chat_request(body, system + history)
    service.check_model(chat)
    plan = service.chat_plan(chat)
    prompt = service.chat_prompt(chat, plan)
    (job,) = service.submit(chat, [prompt], param="input", plan=plan)
    return _Turn(body, chat, history), job


def _finish(turn: _Turn, job: Job, output: list[dict], store: ResponseStore) -> dict:
    response = turn.envelope(_status(job), output, job)
    if turn.body.store:
        store.put(response, turn.history + history_of(output))
    return response


async def _whole(service: Service, turn: _Turn, job: Job, store: ResponseStore) -> dict:
    try:
        text = "".join([piece async for piece, _ in service.pieces(job)])
    finally:
        if not job.stream.done:
            job.stream.cancel()
    if job.output is not None:
        job.output.feed(text, job.tokens)
        job.output.finish()
    return _finish(turn, job, output_items(job.output, text, _status(job)), store)


def routes(app: FastAPI, service: Service, store: ResponseStore | None = None) -> None:
    """``POST /v1/responses`` and ``GET /v1/responses/{id}`` (a stored response)."""
    store = store or ResponseStore()

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        turn, job = _submit(service, body, store)
        if body.stream:
            return StreamingResponse(
                _events(service, turn, job, store),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _whole(service, turn, job, store)

    @app.get("/v1/responses/{response_id}")
    async def stored(response_id: str) -> dict:
        response = store.get(response_id)
        if response is None:
            raise APIError(404, f"response {response_id!r} is not kept here", param="response_id")
        return response


# --- streaming ------------------------------------------------------------------------------


class _Items:
    """Turns parser events into Responses stream events, opening and closing items."""

    def __init__(self, turn: _Turn):
        self.turn = turn
        self.items: list[dict[str, Any]] = []  # finished
        self._open: dict[str, Any] | None = None  # {"kind", "id", "text", "call"}
        self.seq = 0

    def _event(self, kind: str, **fields) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _index(self) -> int:
        return len(self.items)

    def feed(self, events: list[Event], calls: list[dict]) -> list[dict]:
        out: list[dict] = []
        for event in events:
            kind = {"content": "message", "reasoning": "reasoning"}.get(event.kind, "call")
            opening = event.kind == "call" or self._open is None or self._open["kind"] != kind
            if opening:
                out += self.close("completed")
                out += self._start(kind, event, calls)
            out += self._delta(event)
        return out

    def _start(self, kind: str, event: Event, calls: list[dict]) -> list[dict]:
        prefix = {"message": "msg", "reasoning": "rs", "call": "fc"}[kind]
        self._open = {"kind": kind, "id": _new_id(prefix), "text": ""}
        index = self._index()
        if kind == "message":
            item = _message_item("", "in_progress", self._open["id"])
            item["content"] = []
            part = {"type": "output_text", "text": "", "annotations": []}
            return [
                self._event("response.output_item.added", output_index=index, item=item),
                self._event(
                    "response.content_part.added",
                    item_id=self._open["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                ),
            ]
        if kind == "reasoning":
            item = _reasoning_item("", self._open["id"])
            item["content"] = []
            return [self._event("response.output_item.added", output_index=index, item=item)]
        self._open["call"] = calls[event.index]
        item = _call_item(calls[event.index], "in_progress", self._open["id"])
        item["arguments"] = ""
        return [self._event("response.output_item.added", output_index=index, item=item)]

    def _delta(self, event: Event) -> list[dict]:
        if event.kind == "call" or not event.text:
            return []
        where = {"item_id": self._open["id"], "output_index": self._index()}
        self._open["text"] += event.text
        if event.kind == "content":
            return [
                self._event(
                    "response.output_text.delta",
                    **where,
                    content_index=0,
                    delta=event.text,
                    logprobs=[],
                )
            ]
        if event.kind == "reasoning":
            return [
                self._event(
                    "response.reasoning_text.delta", **where, content_index=0, delta=event.text
                )
            ]
        return [self._event("response.function_call_arguments.delta", **where, delta=event.text)]

    def close(self, status: str) -> list[dict]:
        """Ends the open item (if any): its done events."""
        if self._open is None:
            return []
        kind, item_id, text = self._open["kind"], self._open["id"], self._open["text"]
        where = {"item_id": item_id, "output_index": self._index()}
        out = []
        if kind == "message":
            item = _message_item(text, status, item_id)
            part = item["content"][0]
            out += [
                self._event("response.output_text.done", **where, content_index=0, text=text),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        elif kind == "reasoning":
            item = _reasoning_item(text, item_id)
            out.append(
                self._event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
        else:
            item = _call_item(self._open["call"], status, item_id)
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(self._event("response.output_item.done", output_index=self._index(), item=item))
        self.items.append(item)
        self._open = None
        return out


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def _events(
    service: Service, turn: _Turn, job: Job, store: ResponseStore
) -> AsyncIterator[str]:
    """The stream: created, in progress, each item's events as its text comes, completed
    (or incomplete); an error after the status line is an ``error`` event."""
    items = _Items(turn)
    output = job.output or ChatOutput(service.model.tools, None)
    start = turn.envelope("in_progress", [], None)
    yield _sse(items._event("response.created", response=start))
    yield _sse(items._event("response.in_progress", response=start))
    try:
        async for text, ids in service.pieces(job, partial=True):
            for event in items.feed(output.feed(text, ids), output.calls):
                yield _sse(event)
        for event in items.feed(output.finish(), output.calls):
            yield _sse(event)
        status = _status(job)
        for event in items.close(status):
            yield _sse(event)
        response = _finish(turn, job, items.items, store)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield _sse(items._event(kind, response=response))
    except APIError as e:
        yield _sse(items._event("error", code=e.code, message=e.message, param=e.param))
    finally:
        if not job.stream.done:
            job.stream.cancel()
