"""A served request and the stream of its tokens, handed between threads."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

from jaxpar.engine._grammar import Grammar, Matcher
from jaxpar.engine._logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from jaxpar.engine._sampling import Sampling
from jaxpar.errors import GrammarError, ShapeError

#: Why a request ended: a stop token, ``max_tokens``, a ``cancel()`` (a client went away,
#: a stop string matched), the batcher shutting down, or an error in a step.
FINISH_REASONS = ("stop", "length", "cancelled", "shutdown", "error")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """What a client asks for: a prompt's token ids and how to continue it.

    ``logprobs``: None, or each new token's logprob with that many most likely
    alternatives (0 to :data:`~jaxpar.engine._logprobs.MAX_TOP_LOGPROBS`).
    ``grammar``: structured output (:meth:`Grammars.compile
    <jaxpar.engine._grammar.Grammars.compile>`): every token drawn keeps the text matching
    it, and the request ends (``"stop"``) when the grammar can take no more.
    """

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling = Sampling()
    seed: int = 0
    stop_tokens: frozenset[int] = frozenset()
    logprobs: int | None = None
    grammar: Grammar | None = None


def new_request(
    prompt: Sequence[int],
    *,
    max_tokens: int,
    vocab_size: int,
    sampling: Sampling | None = None,
    seed: int = 0,
    stop_tokens: Sequence[int] = (),
    logprobs: int | None = None,
    grammar: Grammar | None = None,
) -> Request:
    """A :class:`Request` from a client's values (the prompt already checked); its grammar
    must be compiled for the model's ``vocab_size`` ids.

    Raises:
        GrammarError: a grammar compiled for another vocabulary.
        ShapeError: ``logprobs`` outside ``[0, MAX_TOP_LOGPROBS]``.
    """
    if grammar is not None and grammar.vocab_size != vocab_size:
        raise GrammarError(
            f"the grammar was compiled for a vocabulary of {grammar.vocab_size} ids; this "
            f"model's has {vocab_size}: compile it with Grammars(tokenizer, {vocab_size}, "
            "eos_ids)"
        )
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise ShapeError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
    return Request(
        prompt=tuple(int(t) for t in prompt),
        max_tokens=max_tokens,
        sampling=sampling or Sampling(),
        seed=int(seed),
        stop_tokens=frozenset(int(t) for t in stop_tokens),
        logprobs=logprobs,
        grammar=grammar,
    )


class RequestStream:
    """The tokens of one request as the batcher draws them; safe across threads.

    Iterate it (``for token in stream``, blocking) or ``async for token in stream`` from
    an event loop; both end when the request finishes. :meth:`cancel` frees its slot.
    The stop token, when one ends the request, is the last token. A request that asked
    for logprobs has one :class:`TokenLogprob` per token (:attr:`logprobs`).
    """

    def __init__(
        self, request_id: int, request: Request, on_finish: Callable[[], None] | None = None
    ):
        self.id = request_id
        self.request = request
        self.submitted_at = time.perf_counter()
        self.token_times: list[float] = []  # perf_counter() when each token reached the host
        #: perf_counter() when a prefill first took it from the queue (None: still queued).
        self.scheduled_at: float | None = None
        #: Prompt tokens whose K/V came from the prefix cache (set before the first token).
        self.cached_tokens = 0
        self._tokens: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._finish_reason: str | None = None
        self._finishing = False  # finish() has begun (it runs once)
        self._cancel_reason: str | None = None
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        #: Called once when the request finishes, before anyone waiting on it wakes (the
        #: batcher counts it there, so a client that saw its result sees it counted).
        self._on_finish = on_finish
        self._wakers: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        #: Where the request is in its grammar (None: no grammar); the batcher's to use.
        self.matcher: Matcher | None = (
            None if request.grammar is None else request.grammar.matcher()
        )

    # --- what consumers read ---------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        with self._cond:
            return list(self._tokens)

    @property
    def context(self) -> list[int]:
        """The tokens its K/V pages hold once prefilled: its prompt, and the tokens it drew
        before a preemption (it is prefilled again with them)."""
        return [*self.request.prompt, *self.tokens]

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """Each token's logprob so far (empty unless the request asked for them)."""
        with self._cond:
            return list(self._logprobs)

    @property
    def finish_reason(self) -> str | None:
        return self._finish_reason

    @property
    def done(self) -> bool:
        return self._finish_reason is not None

    @property
    def error(self) -> BaseException | None:
        """The exception that ended the request (``finish_reason == "error"``)."""
        return self._error

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_reason is not None

    def cancel(self, reason: str = "cancelled") -> None:
        """Ends the request at the batcher's next step and frees its slot (idempotent).

        ``reason`` becomes the finish reason (``"stop"`` when a stop string matched).
        """
        if reason not in FINISH_REASONS:
            raise ValueError(f"reason must be one of {FINISH_REASONS}, got {reason!r}")
        if self._cancel_reason is None:
            self._cancel_reason = reason

    def result(self, timeout: float | None = None) -> list[int]:
        """Blocks until the request finishes; its tokens.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.id} not finished after {timeout} s")
            return list(self._tokens)

    def __iter__(self) -> Iterator[int]:
        seen = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda n=seen: len(self._tokens) > n or self.done)
                new, done = self._tokens[seen:], self.done
            seen += len(new)
            yield from new
            if done:
                return

    async def __aiter__(self) -> AsyncIterator[int]:
        waker = (asyncio.get_running_loop(), asyncio.Event())
        with self._cond:
            self._wakers.add(waker)
        seen = 0
        try:
            while True:
                waker[1].clear()
                with self._cond:
                    new, done = self._tokens[seen:], self.done
                seen += len(new)
                for token in new:
                    yield token
                if done:
                    return
                await waker[1].wait()
        finally:
            with self._cond:
                self._wakers.discard(waker)

    # --- what the batcher writes -----------------------------------------------------

    @property
    def cancel_reason(self) -> str | None:
        return self._cancel_reason

    def emit(self, token: int, logprob: TokenLogprob | None = None) -> str | None:
        """Appends a token (and its logprob, when the request asked for them); returns the
        finish reason if it ends the request: a stop token, or a grammar that takes no
        more tokens (``"stop"``), ``max_tokens`` (``"length"``), or a token its grammar
        refused (``"error"``: the mask should have made that impossible)."""
        now = time.perf_counter()
        request = self.request
        with self._cond:
            if logprob is not None:
                self._logprobs.append(logprob)
            self._tokens.append(token)
            self.token_times.append(now)
            n = len(self._tokens)
        matcher = self.matcher
        if matcher is not None and not matcher.consume(token):
            error = GrammarError(f"token {token} broke the request's grammar: {matcher.error}")
            self.finish("error", error)
            return "error"
        if token in request.stop_tokens or (matcher is not None and matcher.done):
            reason = "stop"
        elif n >= request.max_tokens:
            reason = "length"
        else:
            reason = None
        if reason is None:
            self._wake()
        else:
            self.finish(reason)
        return reason

    def finish(self, reason: str, error: BaseException | None = None) -> None:
        with self._cond:
            first, self._finishing = not self._finishing, True
        if not first:
            return
        if self._on_finish is not None:  # counted before anyone can see it done
            self._on_finish()
        with self._cond:
            self._finish_reason = reason
            self._error = error
        self._wake()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
            wakers = list(self._wakers)
        for loop, event in wakers:
            # A closed loop's consumer is gone: nothing to wake.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)
