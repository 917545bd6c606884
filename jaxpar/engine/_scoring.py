"""Prompt log-likelihoods: each prompt token's logprob given the tokens before it.

What OpenAI's ``echo`` with ``logprobs`` returns for the prompt, and what evaluation
harnesses (lm-eval-harness's ``loglikelihood``) score answers with. One compiled program
per prompt bucket: a prefill with every position's logits, reduced on the device to the
next token's logprob and the :data:`~jaxpar.engine._logprobs.MAX_TOP_LOGPROBS` most likely
tokens at each position, so only ``[B, T, K]`` arrays come back. It takes no decode row
and no KV pages: nothing is cached. Logprobs are raw, as the decode step's
(:mod:`jaxpar.engine._logprobs`).

The prefill materialises ``[dp, T, V]`` float32 logits on the devices (one prompt per
``dp`` shard at a time), the price of scoring every position.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxpar.engine._logprobs import Logprobs, TokenLogprob
from jaxpar.engine._placement import put_global
from jaxpar.engine._steps import Steps
from jaxpar.engine._vocab import mask_padded
from jaxpar.models import count_dropped
from jaxpar.spec import Phase


class PromptScorer:
    """Scores prompts on one engine's prefill layout; calls are serialised (a lock), so
    concurrent callers (server threads) hold one batch of logits at a time.

    Args:
        steps: the engine's steps (its prefill layout, the programs' cache).
        params: the engine's placed parameters.
        bucket: a prompt length -> the padded length it is scored at (the engine's
            prompt buckets: few programs).
    """

    def __init__(self, steps: Steps, params: Any, bucket: Callable[[int], int]):
        parallel = steps.config
        self.steps, self.params, self.bucket = steps, params, bucket
        # One prompt per batch shard of the prefill (and per microbatch when pipelined).
        self.rows = parallel.dp * (parallel.microbatches if parallel.pp > 1 else 1)
        self._lock = threading.Lock()

    def _score(self, params, tokens_BT, lengths_B):
        steps = self.steps
        with steps.context(Phase.PREFILL), count_dropped():
            model = steps.model(params)
            logits_BTV = steps.schedule.prefill(model, tokens_BT, lengths_B, True)[0]
            if steps.config.pp > 1:  # stage-major: the last stage's logits are the real ones
                logits_BTV = logits_BTV[-1]
            logits_BTV = mask_padded(logits_BTV, steps.vocab_size)
            # Position t predicts token t + 1; the last position predicts nothing here.
            next_BT = jax.numpy.roll(tokens_BT, -1, axis=1)
            return Logprobs.of(logits_BTV, next_BT)

    def _program(self, tokens, lengths):
        steps = self.steps
        lay = steps.layouts
        return steps.compile(
            "prompt_logprobs",
            (tokens.shape,),
            self._score,
            (steps.params_in, lay.tokens_BT, lay.lengths_prefill_B),
            lay.replicated,
            (self.params, tokens, lengths),
        )

    def dispatch(self, tokens_BT: np.ndarray, lengths_B: np.ndarray) -> Logprobs:
        """Dispatches the scoring of ``dp`` padded prompts; the device arrays it returns
        hold each position's next-token logprob and top alternatives."""
        lay = self.steps.layouts
        tokens = put_global(tokens_BT, lay.tokens_BT)
        lengths = put_global(lengths_B, lay.lengths_prefill_B)
        return self._program(tokens, lengths)(self.params, tokens, lengths)

    def __call__(
        self,
        prompts: Sequence[Sequence[int]],
        top: int = 0,
        run: Callable[[np.ndarray, np.ndarray], Logprobs] | None = None,
    ) -> list[list[TokenLogprob | None]]:
        """Per prompt, per token: its logprob given the tokens before it and the ``top``
        most likely tokens there; None for the first token (nothing comes before it).
        ``run``: padded prompts and lengths -> their logprobs on the host (default:
        :meth:`dispatch`, then read; a multi-process server records it first)."""
        run = run or (lambda tokens_BT, lengths_B: self.dispatch(tokens_BT, lengths_B).host())
        out: list[list[TokenLogprob | None]] = []
        for start in range(0, len(prompts), self.rows):
            group = [list(p) for p in prompts[start : start + self.rows]]
            tokens_BT = np.zeros((self.rows, self.bucket(max(map(len, group)))), np.int32)
            lengths_B = np.ones(self.rows, np.int32)
            for i, prompt in enumerate(group):
                tokens_BT[i, : len(prompt)] = prompt
                lengths_B[i] = len(prompt)
            with self._lock:
                host = run(tokens_BT, lengths_B)
            for i, prompt in enumerate(group):
                entries = [host.entry((i, t - 1), prompt[t], top) for t in range(1, len(prompt))]
                out.append([None, *entries])
        return out
