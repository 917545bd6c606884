"""Between HTTP and the batcher: prompts to token ids, requests to streams, tokens to text.

:class:`Service` checks a request before anything is queued (each refusal a 400 naming
its field), submits it to the :class:`~jaxpar.engine.ContinuousBatcher`, and turns the
stream of tokens into text deltas (:class:`~jaxpar.server._detokenize.TextStream`).
A prompt's own log-likelihoods (``echo`` with ``logprobs``) come from a prefill with every
position's logits on the prefill engine (:meth:`InferenceEngine.prompt_logprobs`), in a
thread, outside the batcher: they take no decode row. Structured output (``response_format``,
``guided_*``) is compiled for the checkpoint's tokenizer once per request, before anything
is queued (:class:`~jaxpar.engine.Grammars`): an invalid schema, regex or grammar is a 400
naming its field.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import dataclasses
import functools
import itertools
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from prometheus_client.utils import floatToGoString

from jaxpar.engine import (
    Constraint,
    ContinuousBatcher,
    Grammar,
    Grammars,
    Request,
    RequestStream,
    Sampling,
    TokenLogprob,
    merge_sampling,
)
from jaxpar.errors import ConfigError, GrammarError, PeerLostError, QueueFullError, ShapeError
from jaxpar.server._detokenize import TextStream
from jaxpar.server._errors import APIError, bad_request
from jaxpar.server._harmony import render_chat as render_harmony
from jaxpar.server._protocol import MAX_CHOICES, ChatRequest, CompletionRequest, _Generate
from jaxpar.server._tools import (
    ChatOutput,
    Spelling,
    ToolPlan,
    ToolSettings,
    check_tools,
    reasoned_lark,
    tool_lark,
)

#: Seconds a client is told to wait (``Retry-After``) when the queue is full.
RETRY_AFTER_S = 1
#: The finish reasons ``request_success`` counts, as vLLM's does: a stop token or string,
#: ``max_tokens``, and ``abort`` (its client went away or cancelled it before its end).
SUCCESS_REASONS = ("stop", "length", "abort")
#: Bucket bounds (seconds) of :attr:`ServiceStats.max_token_gap`: 1 ms to 60 s.
TOKEN_GAP_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
#: vLLM's bucket bounds (seconds) of its time-to-first-token histogram.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
#: vLLM's bucket bounds (seconds) of its inter-token latency and time per output token.
TOKEN_LATENCY_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
#: vLLM's bucket bounds (seconds) of its request latency histograms (end to end).
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedModel:
    """What the server needs from a checkpoint besides the engine.

    Args:
        name: the ``model`` clients must name.
        tokenizer: a ``tokenizers.Tokenizer`` (``encode(text).ids``, ``decode(ids)``), or
            None: prompts must then be token ids, and completions carry no text.
        render_chat: messages -> prompt text (the checkpoint's chat template), or None.
        stop_token_ids: ids that end a request (the checkpoint's EOS).
        sampling: the checkpoint's default sampling, for fields a request leaves out.
        tools: the tool-call and reasoning parsers (:class:`~._tools.ToolSettings`);
            ``render_chat`` then takes ``tools=`` too.
    """

    name: str
    tokenizer: Any = None
    render_chat: Callable[..., str] | None = None
    stop_token_ids: tuple[int, ...] = ()
    sampling: Sampling = Sampling()
    tools: ToolSettings = ToolSettings()

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def decode_marked(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` with special tokens spelled out (a parser reads markers
        such as harmony's ``<|channel|>`` that are special tokens)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def special_tokens(self) -> dict[str, int]:
        """The tokenizer's special tokens, text -> id (empty without a tokenizer)."""
        added = getattr(self.tokenizer, "get_added_tokens_decoder", None)
        if added is None:
            return {}
        return {t.content: i for i, t in added().items() if t.special}

    def token_name(self, token: int) -> str:
        """A token's text alone (special tokens spelled out); ``token_id:N`` without a
        tokenizer, as vLLM names them."""
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)


@dataclasses.dataclass
class Echo:
    """A prompt as its choice echoes it (``echo``): its text, and its tokens' logprobs
    (None for the first token) when the request asked for logprobs."""

    text: str
    logprobs: list[TokenLogprob | None] | None = None


@dataclasses.dataclass
class Job:
    """One submitted request and what has come of it.

    ``top``: alternatives per token when it asked for logprobs (None: it did not).
    """

    id: str
    prompt: list[int]
    stream: RequestStream
    text: TextStream
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    top: int | None = None
    echo: Echo | None = None
    #: A chat choice's reasoning and tool-call parser (None: its text is its content).
    output: ChatOutput | None = None

    def logprobs(self, start: int, end: int) -> list[TokenLogprob]:
        """The logprobs of its tokens ``start:end`` (empty unless it asked)."""
        return self.stream.logprobs[start:end] if self.top is not None else []

    def usage(self) -> dict[str, int]:
        n_prompt, n_new = len(self.prompt), len(self.tokens)
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_new,
            "total_tokens": n_prompt + n_new,
        }


class Histogram:
    """Observations counted into buckets, as Prometheus counts them (a value equal to a
    bound falls in that bound's bucket); only grows."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        #: The bounds as Prometheus's ``le`` labels spell them (made once, read per scrape).
        self.labels = (*map(floatToGoString, self.bounds), "+Inf")
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket; the last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[int]:
        """Observations <= each bound, then all of them (Prometheus's ``le`` buckets)."""
        return list(itertools.accumulate(self.counts))


def max_gap(times: Sequence[float]) -> float | None:
    """The longest wait between two consecutive ``times``; None for fewer than two."""
    if len(times) < 2:
        return None
    return max(later - earlier for earlier, later in itertools.pairwise(times))


@dataclasses.dataclass
class ServiceStats:
    """Counters since start over the requests a :class:`Service` followed (they only grow).

    The token counts add up the ``usage`` of every request, finished or not, as its tokens
    arrive: a prompt counts once its first token is there (it was prefilled).
    """

    prompt_tokens: int = 0
    generation_tokens: int = 0
    #: Requests that finished with each of :data:`SUCCESS_REASONS`.
    succeeded: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    #: Per request followed to its end with at least two tokens (whatever ended it): the
    #: longest wait between two of its tokens reaching the host, in seconds.
    max_token_gap: Histogram = dataclasses.field(
        default_factory=lambda: Histogram(TOKEN_GAP_BUCKETS_S)
    )
    #: Per request that delivered a token: from its submission to its first token
    #: reaching the host.
    time_to_first_token: Histogram = dataclasses.field(
        default_factory=lambda: Histogram(TTFT_BUCKETS_S)
    )
    #: Every wait between two consecutive tokens a request delivered (one observation
    #: per gap).
    inter_token_latency: Histogram = dataclasses.field(
        default_factory=lambda: Histogram(TOKEN_LATENCY_BUCKETS_S)
    )
    #: Per request that delivered a token: from its submission to its last token.
    e2e_request_latency: Histogram = dataclasses.field(
        default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS_S)
    )
    #: Per request that delivered a token: from its submission until a prefill first
    #: took it from the queue (vLLM's queue time).
    request_queue_time: Histogram = dataclasses.field(
        default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS_S)
    )


class Service:
    """Checks, submits and follows requests for one served model."""

    def __init__(
        self, batcher: ContinuousBatcher, model: ServedModel, scorer=None, efficiency=None
    ):
        """``scorer``: prompts, alternatives -> each prompt's token logprobs (default: the
        batcher's :meth:`~jaxpar.engine.ContinuousBatcher.prompt_logprobs`).
        ``efficiency``: an :class:`~jaxpar.server._efficiency.Efficiency` for the
        efficiency metrics (profiled once warmed up), or None: not reported."""
        self.batcher = batcher
        self.model = model
        self._scorer = scorer
        self.efficiency = efficiency
        self.stats = ServiceStats()
        self.started = int(time.time())
        self.ready = False  # set once warmed up
        self.warmup_error: BaseException | None = None
        self.closing = False

    @functools.cached_property
    def grammars(self) -> Grammars | GrammarError:
        """Structured output's compiler for this checkpoint's tokenizer, or why there is
        none (built once, on first use: about a second for a large vocabulary)."""
        vocab = self.batcher.engine.steps.vocab_size
        try:
            return Grammars(self.model.tokenizer, vocab, self.model.stop_token_ids)
        except GrammarError as e:
            return e

    def grammar(self, body: _Generate, plan: ToolPlan | None = None) -> Grammar | None:
        """The request's structured output compiled (None: plain text): its
        ``response_format`` or ``guided_*`` field, or the grammar of its tools
        (``plan``), after the reasoning when the server has a reasoning parser.

        Raises:
            APIError: 400 naming the field: two constraints at once, a missing schema, an
                invalid schema, regex or grammar, or a model without a tokenizer.
        """
        asked = _constraints(body)
        if isinstance(body, ChatRequest):
            asked = self._chat_constraints(body, asked, plan)
        if not asked:
            return None
        if len(asked) > 1:
            names = " and ".join(name for name, _ in asked)
            raise bad_request(
                f"{names}: give one structured-output constraint per request", asked[1][0]
            )
        param, constraint = asked[0]
        if self.model.tokenizer is None:
            raise bad_request(
                f"{param}: model {self.model.name!r} has no tokenizer; structured output needs one",
                param,
            )
        try:
            grammars = self.grammars
            if isinstance(grammars, GrammarError):
                raise GrammarError(str(grammars))  # a fresh one: the cached keeps no traceback
            return grammars.compile(constraint)
        except GrammarError as e:
            raise bad_request(f"{param}: {e}", param) from e

    def _chat_constraints(
        self, body: ChatRequest, asked: list[tuple[str, Constraint]], plan: ToolPlan | None
    ) -> list[tuple[str, Constraint]]:
        """A chat request's constraints once its tools and the reasoning are counted."""
        settings = self.model.tools
        calls = None
        if plan is not None and self.model.tokenizer is not None:
            calls = tool_lark(plan, settings, self.spelling)
        if calls is not None:
            if asked:
                param = asked[0][0]
                raise bad_request(
                    f"{param}: cannot be combined with tool calls (tool_choice "
                    f"{plan.choice!r}); leave one out, or set tool_choice to 'none'",
                    param,
                )
            return [("tools", Constraint.grammar(calls))]
        if len(asked) == 1 and settings.reasoning_grammar is not None:
            param, constraint = asked[0]
            if self.model.tokenizer is not None:
                lark = reasoned_lark(constraint, settings, self.spelling, param)
                return [(param, Constraint.grammar(lark))]
        return asked

    @functools.cached_property
    def spelling(self) -> Spelling:
        """Fixed text for this tokenizer's grammars (its special tokens as tokens)."""
        return Spelling(self.model.special_tokens())

    def chat_plan(self, body: ChatRequest) -> ToolPlan | None:
        """The request's tools checked (None: it offers none); 400s name the field."""
        if body.tools and self.model.tokenizer is None:
            raise bad_request(
                f"tools: model {self.model.name!r} has no tokenizer; tool calls need one",
                "tools",
            )

        def compile_schema(constraint: Constraint) -> None:
            grammars = self.grammars
            if isinstance(grammars, GrammarError):
                raise GrammarError(str(grammars))
            grammars.compile(constraint)

        return check_tools(body, self.model.tools, compile_schema)

    # --- prompts -------------------------------------------------------------------------

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        """The request's prompts: one, or each of a list (text or token ids)."""
        return [self._one_prompt(p) for p in self._prompt_items(body)]

    def _prompt_items(self, body: CompletionRequest) -> list[str | list[int]]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) * body.n > MAX_CHOICES:
                raise bad_request(
                    f"prompt: {len(prompt)} prompts x n={body.n} choices; at most "
                    f"{MAX_CHOICES} choices per request",
                    "prompt",
                )
            return list(prompt)
        return [prompt]

    def echo_texts(self, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """The prompts as ``echo`` returns them: as given, or decoded from token ids."""
        items = self._prompt_items(body)
        return [
            item if isinstance(item, str) else self.model.decode(ids)
            for item, ids in zip(items, prompts, strict=True)
        ]

    def _one_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if not prompt:
                raise bad_request("prompt: empty; give text or at least one token id", "prompt")
            return list(prompt)
        if not prompt:
            raise bad_request("prompt: empty; give text or at least one token id", "prompt")
        return self._encode(prompt, "prompt", special=True)

    def chat_prompt(self, body: ChatRequest, plan: ToolPlan | None = None) -> list[int]:
        """The request's messages (and ``plan``'s tools) rendered and encoded: by the
        chat template, or for GPT-OSS by ``openai-harmony``."""
        if self.model.tools.harmony:
            return self._harmony_prompt(body, plan)
        if self.model.render_chat is None:
            raise bad_request(
                f"model {self.model.name!r} has no chat template; use /v1/completions",
                "messages",
                "no_chat_template",
            )
        if not body.messages:
            raise bad_request("messages: empty; give at least one message", "messages")
        extra = {} if plan is None else {"tools": [t.as_template_tool() for t in plan.tools]}
        try:
            text = self.model.render_chat(body.rendered_messages(), **extra)
        except ConfigError as e:
            raise bad_request(f"messages: {e}", "messages") from e
        return self._encode(text, "messages", special=False)  # the template has them

    def _harmony_prompt(self, body: ChatRequest, plan: ToolPlan | None) -> list[int]:
        if not body.messages:
            raise bad_request("messages: empty; give at least one message", "messages")
        tools = None if plan is None else [t.as_template_tool() for t in plan.tools]
        try:
            return render_harmony(body.rendered_messages(), tools, body.reasoning_effort)
        except ConfigError as e:
            raise bad_request(f"{e}", str(e).split(":")[0]) from e

    def _encode(self, text: str, param: str, *, special: bool) -> list[int]:
        if self.model.tokenizer is None:
            raise bad_request(
                f"{param}: model {self.model.name!r} has no tokenizer; give token ids", param
            )
        return list(self.model.tokenizer.encode(text, add_special_tokens=special).ids)

    # --- submitting ------------------------------------------------------------------------

    def check_model(self, body: _Generate) -> None:
        if body.model != self.model.name:
            raise APIError(
                400,
                f"model {body.model!r} is not served here; this server serves {self.model.name!r}",
                param="model",
                code="model_not_found",
            )
        unsupported = body.unsupported()
        if unsupported is not None:
            raise bad_request(
                f"{unsupported}: not supported by this server; leave it out",
                unsupported,
                "unsupported",
            )
        if isinstance(body, ChatRequest) and body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs: needs logprobs: true", "top_logprobs")

    def submit(
        self,
        body: _Generate,
        prompts: list[list[int]],
        *,
        param: str,
        echoes: list[str] | None = None,
        plan: ToolPlan | None = None,
    ) -> list[Job]:
        """Queues ``body.n`` choices of each of ``prompts``, checked first; choice ``i`` of a
        prompt samples with ``seed + i``. All are queued or none (a refusal cancels the ones
        already queued). ``echoes``: each prompt's text, when its choices echo it (a
        choice of ``max_tokens`` 0 is not queued: it is its echo alone). ``plan``: a chat
        request's tools (:meth:`chat_plan`); its choices' answers are parsed for calls
        and reasoning (:class:`~._tools.ChatOutput`).

        Raises:
            APIError: 400 (a bad field), 429 (queue full), 503 (warming up, shutting
                down, or the batcher failed).
        """
        self.check_available()
        limits = [self._max_tokens(body, prompt, param) for prompt in prompts]
        grammar = self.grammar(body, plan)
        parsed = isinstance(body, ChatRequest) and ChatOutput(self.model.tools, plan).active
        seed = secrets.randbelow(2**31) if body.seed is None else body.seed
        texts = echoes or [None] * len(prompts)
        jobs: list[Job] = []
        try:
            for prompt, max_tokens, text in zip(prompts, limits, texts, strict=True):
                for i in range(body.n):
                    seed_i = (seed + i) % 2**32
                    job = self._submit_one(
                        body, prompt, max_tokens, seed_i, param, grammar, marked=parsed
                    )
                    job.echo = None if text is None else Echo(text)
                    if parsed:
                        job.output = ChatOutput(self.model.tools, plan)
                    jobs.append(job)
        except APIError:
            for job in jobs:
                job.stream.cancel()
            raise
        return jobs

    async def score_echoes(self, jobs: list[Job]) -> None:
        """Fills in the prompt logprobs of the echoing jobs that asked for logprobs (one
        scoring per distinct prompt, in a thread)."""
        wanted = [j for j in jobs if j.echo is not None and j.top is not None]
        if not wanted:
            return
        prompts = list({tuple(j.prompt): None for j in wanted})
        top = max(j.top for j in wanted)
        scorer = self._scorer or self.batcher.prompt_logprobs
        try:
            scored = await asyncio.to_thread(scorer, [list(p) for p in prompts], top)
        except (ConfigError, ShapeError) as e:
            raise bad_request(f"prompt: {e}", "prompt") from e
        by_prompt = dict(zip(prompts, scored, strict=True))
        for job in wanted:
            job.echo.logprobs = by_prompt[tuple(job.prompt)]

    def _submit_one(
        self,
        body: _Generate,
        prompt: list[int],
        max_tokens: int,
        seed: int,
        param: str,
        grammar: Grammar | None = None,
        *,
        marked: bool = False,
    ) -> Job:
        stop_ids = () if body.ignore_eos else self.model.stop_token_ids
        top = body.top_logprobs_asked
        decode = self.model.decode_marked if marked else self.model.decode
        text = TextStream(decode, body.stop_strings(), skip=stop_ids)
        if max_tokens == 0:  # the echo alone: nothing to generate
            stream = RequestStream(-1, Request(prompt=tuple(prompt), max_tokens=0))
            stream.finish("length")
            return Job(id=uuid.uuid4().hex[:24], prompt=prompt, stream=stream, text=text, top=top)
        extra = {} if top is None else {"logprobs": top}
        if grammar is not None:
            extra["grammar"] = grammar
        try:
            stream = self.batcher.submit(
                prompt,
                max_tokens=max_tokens,
                sampling=self.sampling(body),
                seed=seed,
                stop_tokens=stop_ids,
                **extra,
            )
        except QueueFullError as e:
            if self.closing or self.batcher.failure is not None:
                raise APIError(503, str(e), retry_after=RETRY_AFTER_S) from e
            raise APIError(429, str(e), code="queue_full", retry_after=RETRY_AFTER_S) from e
        except ShapeError as e:
            raise bad_request(f"{param}: {e}", param) from e
        return Job(id=uuid.uuid4().hex[:24], prompt=prompt, stream=stream, text=text, top=top)

    def check_available(self) -> None:
        if isinstance(self.batcher.failure, PeerLostError):  # a multi-process job lost one
            raise APIError(503, str(self.batcher.failure), code="process_lost")
        if self.batcher.failure is not None:
            raise APIError(503, f"the engine failed: {self.batcher.failure!r}", retry_after=60)
        if self.warmup_error is not None:
            raise APIError(503, f"warmup failed: {self.warmup_error!r}", retry_after=60)
        if self.closing:
            raise APIError(503, "the server is shutting down", retry_after=RETRY_AFTER_S)
        if not self.ready:
            raise APIError(503, "the server is warming up", retry_after=RETRY_AFTER_S)

    def _max_tokens(self, body: _Generate, prompt: list[int], param: str) -> int:
        limit = self.batcher.max_prompt_len
        if len(prompt) > limit:
            raise bad_request(
                f"{param}: {len(prompt)} tokens, more than this server's max_seq_len={limit}",
                param,
                "context_length_exceeded",
            )
        fits = self.batcher.admission.room(len(prompt))
        wanted = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if wanted is None:
            return fits
        if wanted == 0:
            if not getattr(body, "echo", False):
                raise bad_request(
                    "max_tokens=0: generates nothing; allowed with echo only (the prompt's "
                    "log-likelihoods)",
                    "max_tokens",
                )
            return 0
        if wanted > fits:
            name = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
            raise bad_request(
                f"{name}={wanted}: the prompt ({len(prompt)} tokens) leaves room for at most "
                f"{fits} new tokens (max_seq_len={self.batcher.max_seq_len})",
                name,
                "context_length_exceeded",
            )
        return wanted

    def sampling(self, body: _Generate) -> Sampling:
        """The request's sampling; fields it leaves out take the checkpoint's defaults."""
        fields = {"temperature": body.temperature, "top_k": body.top_k, "top_p": body.top_p}
        try:  # the rule jaxpar run applies to its flags (one admission path)
            return merge_sampling(self.model.sampling, **fields, **body.penalties())
        except ConfigError as e:
            raise bad_request(str(e), "temperature") from e

    # --- following -------------------------------------------------------------------------

    async def pieces(
        self, job: Job, *, partial: bool = False
    ) -> AsyncIterator[tuple[str, list[int]]]:
        """(text delta, its new token ids) as tokens arrive; sets ``job.finish_reason``.

        Leaving early (the client went away) cancels the request, freeing its slot.
        ``partial`` (a stream, whose tokens are already sent): a request the server's
        shutdown ended finishes with reason ``"shutdown"`` instead of raising.

        Raises:
            APIError: 503 when the server shut down first (unless ``partial``), 500 when
                a step failed.
        """
        sent, counted = 0, False
        try:
            async for token in job.stream:
                if not job.tokens:
                    self.stats.prompt_tokens += len(job.prompt)
                job.tokens.append(token)
                self.stats.generation_tokens += 1
                delta = job.text.feed(token)
                if delta:
                    yield delta, job.tokens[sent:]
                    sent = len(job.tokens)
                if job.text.stopped:
                    job.stream.cancel("stop")
                    break
            tail = job.text.finish()
            if tail or sent < len(job.tokens):
                yield tail, job.tokens[sent:]
            shutdown = partial and job.stream.finish_reason == "shutdown"
            if job.text.stopped:
                job.finish_reason = "stop"
            else:
                job.finish_reason = "shutdown" if shutdown else _outcome(job.stream)
            if not shutdown:  # a stream the shutdown cut did not succeed
                self.stats.succeeded[job.finish_reason] += 1
                counted = True
        finally:
            if not counted and _aborted(job.stream):
                self.stats.succeeded["abort"] += 1
            if not job.stream.done:
                job.stream.cancel()
            self._observe_latency(job)

    def _observe_latency(self, job: Job) -> None:
        """Counts the times of the tokens ``job`` delivered (not those the batcher drew
        after a stop string or a cancel): its first token, its gaps, its end."""
        times = job.stream.token_times[: len(job.tokens)]
        if not times:
            return
        stats, submitted = self.stats, job.stream.submitted_at
        stats.time_to_first_token.observe(times[0] - submitted)
        stats.e2e_request_latency.observe(times[-1] - submitted)
        if job.stream.scheduled_at is not None:
            stats.request_queue_time.observe(job.stream.scheduled_at - submitted)
        for earlier, later in itertools.pairwise(times):
            stats.inter_token_latency.observe(later - earlier)
        gap = max_gap(times)
        if gap is not None:
            stats.max_token_gap.observe(gap)


def _constraints(body: _Generate) -> list[tuple[str, Constraint]]:
    """The structured-output constraints a request asks for, with their fields."""
    asked: list[tuple[str, Constraint]] = []
    form = body.response_format
    if form is not None and form.type == "json_object":
        asked.append(("response_format", Constraint.json_object()))
    elif form is not None and form.type == "json_schema":
        if form.json_schema is None or form.json_schema.json_schema is None:
            raise bad_request(
                'response_format.json_schema.schema: missing; give {"name": ..., "schema": '
                '{...}} (or use {"type": "json_object"} for any JSON object)',
                "response_format.json_schema.schema",
                "missing",
            )
        asked.append(("response_format", Constraint.json_schema(form.json_schema.json_schema)))
    if body.guided_json is not None:
        asked.append(("guided_json", Constraint.json_schema(body.guided_json)))
    if body.guided_regex is not None:
        asked.append(("guided_regex", Constraint.regex(body.guided_regex)))
    if body.guided_choice is not None:
        asked.append(("guided_choice", Constraint.choice(body.guided_choice)))
    if body.guided_grammar is not None:
        asked.append(("guided_grammar", Constraint.grammar(body.guided_grammar)))
    return asked


def _aborted(stream: RequestStream) -> bool:
    """The client left before ``stream`` ended (it stopped reading, or the disconnect
    watcher cancelled it): vLLM's ``abort``; not a shutdown, an error or a refusal."""
    return not stream.done or stream.finish_reason == "cancelled"


def _outcome(stream: RequestStream) -> str:
    reason = stream.finish_reason
    if reason in ("stop", "length"):
        return reason
    if reason == "error" and isinstance(stream.error, PeerLostError):
        raise APIError(503, str(stream.error), code="process_lost")
    if reason == "error":
        raise APIError(500, f"generation failed: {stream.error!r}", code="engine_error")
    raise APIError(503, f"request ended early ({reason})", retry_after=RETRY_AFTER_S)
