"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, responses, models, health,
metrics.

``GET /health`` is readiness, ``GET /live`` liveness (:mod:`jaxpar.server._health`).

``stream: true`` answers with server-sent events in OpenAI's chunk format, ended by
``data: [DONE]``. A client that goes away (mid-stream or while waiting for a whole
completion) has its request cancelled, which frees its decode slot at the next step.
Logprobs come with the tokens they are of, in each chunk (:mod:`jaxpar.server._logprobs`);
an echoed prompt comes first, in the first chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jaxpar.server import _errors
from jaxpar.server._chat_output import finish_output, output_chunks, output_finish_reason
from jaxpar.server._errors import APIError
from jaxpar.server._health import DEFAULT_STALL_S, live, not_ready
from jaxpar.server._logprobs import ChoiceLogprobs, merge
from jaxpar.server._metrics import metrics_registry
from jaxpar.server._protocol import ChatRequest, CompletionRequest, _Generate
from jaxpar.server._responses import routes as responses_routes
from jaxpar.server._service import Job, Service

log = logging.getLogger("uvicorn.error")  # uvicorn configures its handlers

#: How often a waiting request checks whether its client is still there (seconds).
DISCONNECT_POLL_S = 0.2


class _Format:
    """How one endpoint spells its responses and stream chunks."""

    def __init__(self, kind: str, id_prefix: str, chat: bool):
        self.kind, self.id_prefix, self.chat = kind, id_prefix, chat

    def head(self, job: Job, model: str, obj: str, choices: list) -> dict[str, Any]:
        """The envelope; a request's choices share its first job's id and time."""
        return {
            "id": f"{self.id_prefix}{job.id}",
            "object": obj,
            "created": job.created,
            "model": model,
            "choices": choices,
        }

    def logprobs(self, job: Job, service: Service) -> ChoiceLogprobs | None:
        """A choice's logprobs, to be added to as its tokens come (None: not asked for)."""
        if job.top is None:
            return None
        model = service.model
        return ChoiceLogprobs(model.token_name, model.decode, job.top, chat=self.chat)

    def echoed(self, job: Job, logprobs: ChoiceLogprobs | None) -> tuple[str, dict | None]:
        """An echoing choice's prompt text and its tokens' logprobs ("" and None if it
        does not echo); the completion's tokens then start a new text."""
        if job.echo is None:
            return "", None
        if logprobs is None or job.echo.logprobs is None:
            return job.echo.text, None
        prompt = logprobs.add(job.prompt, job.echo.logprobs)
        logprobs.restart(len(job.echo.text))
        return job.echo.text, prompt

    def whole(self, jobs: list[Job], service: Service, texts: list[str], body: _Generate) -> dict:
        choices = []
        for index, (job, text) in enumerate(zip(jobs, texts, strict=True)):
            logprobs = self.logprobs(job, service)
            echo, prompt_lp = self.echoed(job, logprobs)
            text = echo + text
            choice: dict[str, Any] = {
                "index": index,
                "logprobs": None,
                "finish_reason": job.finish_reason,
            }
            if logprobs is not None:
                new = logprobs.add(job.tokens, job.logprobs(0, len(job.tokens)))
                choice["logprobs"] = merge([prompt_lp, new]) if prompt_lp else new
            if self.chat and job.output is not None:  # reasoning and tool calls read out
                choice["message"] = finish_output(job, text)
                choice["finish_reason"] = job.finish_reason
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if body.return_token_ids:
                choice |= {"prompt_token_ids": job.prompt, "token_ids": job.tokens}
            choices.append(choice)
        name = service.model.name
        return self.head(jobs[0], name, self.kind, choices) | {"usage": _usage(jobs, body)}

    def chunk(
        self,
        job: Job,
        index: int,
        model: str,
        text: str | None,
        ids: list[int],
        finish,
        logprobs: dict | None = None,
        delta: dict | None = None,
    ) -> dict:
        """One stream chunk of choice ``index``: ``text`` (or a chat ``delta`` as it is)."""
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if self.chat and delta is not None:
            choice["delta"] = delta
        elif self.chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        if ids:
            choice["token_ids"] = ids
        return self.head(job, model, self.chunk_kind, [choice])

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else self.kind


COMPLETIONS = _Format("text_completion", "cmpl-", chat=False)
CHAT = _Format("chat.completion", "chatcmpl-", chat=True)


def _usage(jobs: list[Job], body: _Generate) -> dict[str, Any]:
    """Each prompt counted once, as its first choice saw it (its ``n`` choices share it),
    and every choice's tokens. ``prompt_tokens_details.cached_tokens``, as OpenAI reports
    it: of those prompt tokens, the ones whose K/V came from the prefix cache."""
    firsts = jobs[:: body.n]
    prompt = sum(len(job.prompt) for job in firsts)
    cached = sum(job.stream.cached_tokens for job in firsts)
    new = sum(len(job.tokens) for job in jobs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": new,
        "total_tokens": prompt + new,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _data(payload: dict | str) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n"


async def _watch_disconnect(request: Request, jobs: list[Job]) -> None:
    while not all(job.stream.done for job in jobs):
        if await request.is_disconnected():
            for job in jobs:
                job.stream.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _choice_chunks(
    service: Service, job: Job, index: int, body: _Generate, fmt: _Format, out: asyncio.Queue
) -> None:
    """One choice's stream chunks into ``out`` (its role or echoed prompt first, its
    finish last), each with its tokens' logprobs when asked for."""
    name = service.model.name
    logprobs = fmt.logprobs(job, service)
    if fmt.chat:
        first = fmt.chunk(job, index, name, "", [], None)
        first["choices"][0]["delta"]["role"] = "assistant"
        await out.put(first)
    elif job.echo is not None:
        echo, prompt_lp = fmt.echoed(job, logprobs)
        await out.put(fmt.chunk(job, index, name, echo, [], None, prompt_lp))
    seen = 0
    async for text, ids in service.pieces(job, partial=True):
        lp = None
        if logprobs is not None:
            lp = logprobs.add(ids, job.logprobs(seen, seen + len(ids)))
        seen += len(ids)
        if job.output is not None:
            events = job.output.feed(text, ids)
            ids = ids if body.return_token_ids else []
            for chunk in output_chunks(fmt, job, index, name, events, ids, lp):
                await out.put(chunk)
            continue
        ids = ids if body.return_token_ids else []
        await out.put(fmt.chunk(job, index, name, text, ids, None, lp))
    if job.output is not None:
        for chunk in output_chunks(fmt, job, index, name, job.output.finish(), [], None):
            await out.put(chunk)
        job.finish_reason = output_finish_reason(job)
    await out.put(fmt.chunk(job, index, name, None if fmt.chat else "", [], job.finish_reason))


async def _events(
    service: Service, jobs: list[Job], body: _Generate, fmt: _Format, request: Request
) -> AsyncIterator[str]:
    """Server-sent events: every choice's chunks as they come (each names its index),
    then the usage if asked for, then ``[DONE]``."""
    watcher = asyncio.create_task(_watch_disconnect(request, jobs))
    out: asyncio.Queue = asyncio.Queue()
    tasks = [
        asyncio.create_task(_choice_chunks(service, job, i, body, fmt, out))
        for i, job in enumerate(jobs)
    ]
    try:
        try:
            while any(not t.done() for t in tasks) or not out.empty():
                getter = asyncio.ensure_future(out.get())
                running = [t for t in tasks if not t.done()]
                await asyncio.wait([getter, *running], return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield _data(getter.result())
                else:
                    getter.cancel()
                failed = [t for t in tasks if t.done() and t.exception() is not None]
                if failed:
                    raise failed[0].exception()
            if body.stream_options is not None and body.stream_options.include_usage:
                head = fmt.head(jobs[0], service.model.name, fmt.chunk_kind, [])
                yield _data(head | {"usage": _usage(jobs, body)})
        except APIError as e:  # the status line is sent: report it in the stream
            yield _data(e.body())
        yield _data("[DONE]")
    finally:
        watcher.cancel()
        for task in tasks:
            task.cancel()
        for job in jobs:
            if not job.stream.done:
                job.stream.cancel()


async def _text(service: Service, job: Job) -> str:
    return "".join([piece async for piece, _ in service.pieces(job)])


async def _answer(
    service: Service, jobs: list[Job], body: _Generate, fmt: _Format, request: Request
) -> Any:
    if body.stream:
        return StreamingResponse(
            _events(service, jobs, body, fmt, request),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    watcher = asyncio.create_task(_watch_disconnect(request, jobs))
    try:
        texts = await asyncio.gather(*(_text(service, job) for job in jobs))
    finally:
        watcher.cancel()
        for job in jobs:
            if not job.stream.done:
                job.stream.cancel()
    return fmt.whole(jobs, service, list(texts), body)


def create_app(
    service: Service,
    *,
    warmup: Callable[[], object] | None = None,
    drain_timeout: float = 30.0,
    stall_timeout: float = DEFAULT_STALL_S,
) -> FastAPI:
    """The app serving ``service``.

    Args:
        service: the model and its batcher (started by the app, closed on shutdown).
        warmup: run in a daemon thread after start-up (compiles); ``/health`` says 200
            only after it returns. A shutdown does not wait for it (the batcher's close
            stops what has not started compiling).
        drain_timeout: on shutdown, seconds queued and running requests get to finish
            before they are cancelled.
        stall_timeout: seconds the decode loop may have work without finishing a step
            before ``GET /live`` (and ``/health``) answer 503 (:mod:`._health`).
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        service.batcher.start()
        warming = asyncio.create_task(_warm(service, warmup))
        yield
        service.closing = True
        await asyncio.to_thread(service.batcher.close, drain=True, timeout=drain_timeout)
        if not warming.done():  # still compiling: nothing is left to serve, do not wait
            warming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await warming

    app = FastAPI(title="jaxpar", lifespan=lifespan)
    _errors.install(app)
    _routes(app, service, stall_timeout)
    return app


async def _warm(service: Service, warmup: Callable[[], object] | None) -> None:
    try:
        if warmup is not None:
            started = time.perf_counter()
            await _in_daemon_thread(warmup)
            log.info("warmed up in %.1f s", time.perf_counter() - started)
        service.ready = True
    except Exception as e:  # noqa: BLE001 - reported by /health, the server stays up
        service.warmup_error = e
        log.exception("warmup failed")


async def _in_daemon_thread(fn: Callable[[], object]) -> object:
    """``fn()`` in a daemon thread (``asyncio.to_thread``'s threads are joined at exit, so
    a warm-up still compiling would keep a stopped server from exiting)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not done.done():
            (done.set_result if ok else done.set_exception)(value)

    def run() -> None:
        try:
            ok, value = True, fn()
        except Exception as e:  # noqa: BLE001 - handed to the awaiting task
            ok, value = False, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=run, name="warmup", daemon=True).start()
    return await done


def _health(batcher) -> dict[str, Any]:
    """``GET /health``'s body once the server serves."""
    status = {"status": "ok", "slots": batcher.slots, "active": batcher.active}
    status |= {"queued": batcher.queued, "stats": vars(batcher.stats)}
    warming = getattr(batcher, "warming", None)
    if warming is not None:  # lazy: buckets may still compile in the background
        status["warmup"] = {"compiled": warming.done, "buckets": warming.total}
    lockstep = batcher.lockstep_stats()
    if lockstep is not None:  # several processes: what process 0 sent the others
        status["lockstep"] = lockstep
    return status


def _routes(app: FastAPI, service: Service, stall_timeout: float = DEFAULT_STALL_S) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        """Readiness: 200 only when a request can be served now."""
        problem = not_ready(service, stall_timeout)
        if problem is not None:
            return JSONResponse({"status": problem}, status_code=503)
        return JSONResponse(_health(service.batcher))

    @app.get("/live")
    async def liveness() -> JSONResponse:
        """Liveness: 503 only when a restart is what helps (:mod:`._health`)."""
        status, body = live(service, stall_timeout)
        return JSONResponse(body, status_code=status)

    registry = metrics_registry(service)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format, read from the batcher now (200 even while warming up)."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(service)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != service.model.name:
            raise APIError(404, f"model {model_id!r} is not served here", param="model")
        return _model_card(service)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        service.check_model(body)
        jobs = await _submit_completions(service, body)
        return await _answer(service, jobs, body, COMPLETIONS, request)

    responses_routes(app, service)  # POST /v1/responses (:mod:`._responses`)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        service.check_model(body)
        plan = service.chat_plan(body)  # tools: checked before anything queues
        prompt = service.chat_prompt(body, plan)
        jobs = service.submit(body, [prompt], param="messages", plan=plan)
        return await _answer(service, jobs, body, CHAT, request)


async def _submit_completions(service: Service, body: CompletionRequest) -> list[Job]:
    """Queues a completion's choices; echoing ones that ask for logprobs get their prompt's
    (computed before the answer starts)."""
    prompts = service.completion_prompts(body)
    echoes = service.echo_texts(body, prompts) if body.echo else None
    jobs = service.submit(body, prompts, param="prompt", echoes=echoes)
    try:
        await service.score_echoes(jobs)
    except BaseException:
        for job in jobs:
            job.stream.cancel()
        raise
    return jobs


def _model_card(service: Service) -> dict[str, Any]:
    return {
        "id": service.model.name,
        "object": "model",
        "created": service.started,
        "owned_by": "jaxpar",
        "max_model_len": service.batcher.engine.max_seq_len,
    }
