"""Speculative decoding's ``draft_model`` method: a smaller checkpoint drafts the tokens.

:func:`load_draft` reads the draft checkpoint (``model`` of the
:class:`~jaxpar.engine._speculative.SpeculativeConfig`) after checking that it shares the
target's vocabulary (its size, and the token strings where both have a
``tokenizer.json``): a :class:`~jaxpar.errors.ConfigError` otherwise, before anything
compiles. It runs as an engine of its own, with its own strategy: tensor parallel over
the first devices of the target's mesh (the target's ``tp`` where the draft's shapes allow
it, else one device).

:class:`DraftModelProposer` keeps the draft's own paged KV cache: one page per page of the
target's pool, addressed by the target's *global* page ids, so the draft's pages are
allocated, freed, shared and evicted with the target's rows by the target's page table and
nothing is booked twice. Per row it remembers how many positions of the row's pages hold
the draft's K/V for the row's current context (for this admission of the request: a
preempted request comes back as a new admission and is recomputed, as is a prefix hit,
whose shared pages the draft may never have written). Each speculative step it first
catches the row up (the context the draft has not seen, one forward pass with context over
its pages, as chunked prefill runs) and then feeds back each drafted token, ``k``
positions in all; after the verification the row's draft length is cut to what the target
kept (rolled back by length only, as the target's pages are).

Each drafted token is drawn from the draft's logits through the same penalties (counting
the drafts before it), grammar mask (the request's grammar advanced along the drafts),
temperature, top-k and top-p as the target's
(:func:`~jaxpar.engine._spec_verify.target_probs`); that distribution is the ``q`` the
rejection sampler uses. The draft draws with its own keys (the request's seed and step,
folded with :data:`DRAFT_SALT`), independent of the verification's.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.engine._penalties import Seen
from jaxpar.engine._sampling_params import RowSampling
from jaxpar.engine._spec_propose import Ask, GrammarWalk, Proposal
from jaxpar.engine._spec_verify import _draw, position_keys, target_probs
from jaxpar.engine._speculative import SpeculativeConfig
from jaxpar.engine._vocab import mask_padded
from jaxpar.errors import ConfigError, IllegalStrategyError
from jaxpar.models import PagedKVCache, read_pages
from jaxpar.spec import ParallelConfig, Phase, make_mesh

#: Folded into a row's key for the draft's draws (the verification uses the bare key).
DRAFT_SALT = 0x0D7AF7


def check_vocab(model: str | Path, target) -> None:
    """Refuses a draft checkpoint whose vocabulary is not the target engine's.

    Raises:
        ConfigError: another vocabulary size, or (both with a ``tokenizer.json``) another
            token for some id.
    """
    import json

    from jaxpar.engine._text import load_tokenizer

    path = Path(model)
    hf = json.loads((path / "config.json").read_text())
    want = target.model_config.vocab_size
    got = hf.get("vocab_size", hf.get("text_config", {}).get("vocab_size"))
    if got != want:
        raise ConfigError(
            f"speculative config: draft model {str(path)!r} has a vocabulary of {got} "
            f"tokens, the target {want}; a draft model must share the target's tokenizer"
        )
    mine = target.tokenizer.tokenizer if target.tokenizer is not None else None
    theirs = load_tokenizer(path)
    if mine is not None and theirs is not None and mine.get_vocab() != theirs.get_vocab():
        raise ConfigError(
            f"speculative config: draft model {str(path)!r}: its tokenizer.json maps tokens "
            f"to other ids than the target's; a draft model must share the target's tokenizer"
        )


def load_draft(model: str | Path, target):
    """The draft checkpoint as an engine on the target's first devices (see the module)."""
    from jaxpar.engine._load import engine_from_hf

    check_vocab(model, target)
    devices = list(target.devices)
    for tp in dict.fromkeys((target.parallel_config.tp, 1)):
        parallel = ParallelConfig(tp=tp)
        try:
            return engine_from_hf(
                model, parallel, max_batch=target.max_batch, max_seq_len=target.max_seq_len,
                mesh=make_mesh(parallel, devices[:tp]), dtype=target.options.dtype,
            )  # fmt: skip
        except IllegalStrategyError:
            if tp == 1:
                raise
    raise AssertionError("unreachable")


#: Context tokens a row catches up on per pass (a pass is a program of this many
#: positions per row, or of one once every row has caught up: two compiles per shape).
CATCH_UP = 16


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _write(pool: Any, new: Any, pages_RT: jax.Array, slots_RT: jax.Array) -> Any:
    """``new`` (per layer ``[R, T, K, H]``, or stacked ``[L, R, T, K, H]``) into ``pool``
    (per layer ``[K, A, Z, H]``, or stacked) at page ``pages_RT``, slot ``slots_RT`` (pages
    ``>= A``: dropped)."""
    if isinstance(pool, tuple):
        return tuple(
            p.at[:, pages_RT, slots_RT].set(n.transpose(2, 0, 1, 3).astype(p.dtype), mode="drop")
            for p, n in zip(pool, new, strict=True)
        )
    value = new.transpose(0, 3, 1, 2, 4).astype(pool.dtype)
    return pool.at[:, :, pages_RT, slots_RT].set(value, mode="drop")


class DraftModelProposer:
    """Drafts with a draft checkpoint over its own paged cache (see the module)."""

    def __init__(self, config: SpeculativeConfig, core):
        if jax.process_count() > 1:
            raise ConfigError(
                "speculative config: method 'draft_model' runs in one process; a "
                "multi-process job takes method 'ngram'"
            )
        self.core = core
        target = core.runner.engine
        self.engine = load_draft(config.model, target)
        self.vocab = target.model_config.vocab_size
        self.target_vocab = target.program.run.vocab_size  # padded for tp: q's width
        pool = core.cache.pool
        self.pages, self.page_size = pool.pages, pool.page_size
        run = self.engine.program.run
        self.dtype = run.dtype
        empty = functools.partial(PagedKVCache.empty_pool, run, self.pages, self.page_size)
        rep = self.engine.layouts.replicated
        self.pool_k = jax.device_put(empty("k"), rep)
        self.pool_v = jax.device_put(empty("v"), rep)
        #: Row -> (admission, positions whose draft K/V its pages hold).
        self.held: dict[int, tuple[int, int]] = {}
        self._step = jax.jit(self._forward, donate_argnums=(1, 2))
        #: Seconds the last :meth:`propose` took and the positions it drafted (None: it
        #: compiled a program, so its time says nothing).
        self.last: tuple[float, int] | None = None
        self._shapes: set[tuple] = set()

    def reset(self) -> None:
        self.held.clear()

    def verified(self, row: int, length: int) -> None:
        admission, held = self.held.get(row, (None, 0))
        if admission is not None:
            self.held[row] = (admission, min(held, length))

    # --- the program ---------------------------------------------------------------------

    def _forward(self, params, pool_k, pool_v, pages_RN, tokens_RT, start_R, n_R, rows, step_R,
                 seen, allowed_RW):  # fmt: skip
        """Feeds ``n_R`` tokens per row at ``start_R`` over the row's pages ``pages_RN``,
        writes their K/V, and draws the next token from the last one's logits. Returns
        the pools, the tokens ``[R]`` and their distributions ``q`` ``[R, V]``."""
        steps = self.engine.steps
        with steps.context(Phase.DECODE):
            ctx = tuple(read_pages(pool, pages_RN, self.dtype) for pool in (pool_k, pool_v))
            model = steps.model(params)
            logits_RV, k_new, v_new = model.prefill(tokens_RT, n_R, context=(*ctx, start_R))
            logits_RV = mask_padded(logits_RV, steps.vocab_size)[:, : self.vocab]
            q_RV = target_probs(logits_RV, rows, seen, allowed_RW)
            salted = rows.replace(
                key_B=jax.vmap(
                    lambda k: jax.random.key_data(
                        jax.random.fold_in(jax.random.wrap_key_data(k), DRAFT_SALT)
                    )
                )(rows.key_B)
            )
            token_R = jax.vmap(_draw)(position_keys(salted, step_R), q_RV)
            t = tokens_RT.shape[1]
            pos_RT = start_R[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
            column_RT = jnp.minimum(pos_RT // self.page_size, pages_RN.shape[1] - 1)
            pages_RT = jnp.take_along_axis(pages_RN, column_RT, 1)
            pages_RT = jnp.where(jnp.arange(t)[None] < n_R[:, None], pages_RT, self.pages)
            slots_RT = pos_RT % self.page_size
            pool_k = _write(pool_k, k_new, pages_RT, slots_RT)
            pool_v = _write(pool_v, v_new, pages_RT, slots_RT)
            return pool_k, pool_v, token_R, q_RV

    # --- drafting ------------------------------------------------------------------------

    def propose(self, asks: list[Ask], cache) -> Proposal:
        start = time.perf_counter()
        asks = [a for a in asks if a.k > 0]
        if not asks:
            return Proposal({})
        r, k = _bucket(len(asks)), max(a.k for a in asks)
        pages_RN = self._pages(asks, k, r, cache)
        samplings = [a.stream.request.sampling for a in asks]
        pad = r - len(asks)
        rows = RowSampling.rows(
            samplings + [samplings[0]] * pad, [a.stream.request.seed for a in asks] + [0] * pad
        )
        penalized = any(s.penalized for s in samplings)
        walks = [
            None if a.stream.matcher is None else GrammarWalk(a.stream.matcher, self.vocab)
            for a in asks
        ]
        run = _Run(asks, [self._held(a) for a in asks])
        compiled = False  # some program ran for the first time (compiled)
        try:
            while True:
                tokens_RT, start_R, n_R, live = run.feeds(r)
                if not live:
                    break
                pages_j = pages_RN.copy()
                pages_j[[i for i in range(r) if i not in live]] = self.pages  # no writes
                step_R = np.zeros(r, np.int32)
                step_R[: len(asks)] = [
                    len(a.stream.tokens) + len(d) for a, d in zip(asks, run.drafts, strict=True)
                ]
                seen = self._seen(asks, run.drafts, r) if penalized else None
                allowed = _masks(walks, live, r, self.vocab)
                shape = (r, tokens_RT.shape[1], pages_RN.shape[1], seen is None, allowed is None)
                compiled = compiled or shape not in self._shapes
                self._shapes.add(shape)
                self.pool_k, self.pool_v, token_R, q_RV = self._step(
                    self.engine.params, self.pool_k, self.pool_v, pages_j, tokens_RT, start_R,
                    n_R, rows, step_R, seen, allowed,
                )  # fmt: skip
                run.take(live, n_R, np.asarray(token_R), np.asarray(q_RV), allowed, walks)
        finally:
            for w in walks:
                if w is not None:
                    w.close()
        out_q = {}
        for i, a in enumerate(asks):
            self.held[a.row] = (a.admission, run.next[i])
            if run.drafts[i]:
                q_KV = np.zeros((len(run.drafts[i]), self.target_vocab), np.float32)
                q_KV[:, : self.vocab] = np.stack(run.q[i])
                out_q[a.row] = q_KV
        self.last = None if compiled else (time.perf_counter() - start, k)
        return Proposal({a.row: run.drafts[i] for i, a in enumerate(asks)}, out_q)

    def _held(self, ask: Ask) -> int:
        """Positions of the row's pages that hold the draft's K/V for its context."""
        admission, n = self.held.get(ask.row, (None, 0))
        return min(n, ask.length) if admission == ask.admission else 0

    def _pages(self, asks: list[Ask], k: int, r: int, cache) -> np.ndarray:
        """Each row's global page ids for ``length + k + 1`` tokens (``>= A`` past them)."""
        width = cache.width(max(a.length for a in asks) + k + 1)
        pages_RN = np.full((r, width), self.pages, np.int32)
        for i, a in enumerate(asks):
            n = min(cache.pool.pages_for(a.length + k + 1), width)
            pages_RN[i, :n] = cache.global_ids(a.row, n)
        return pages_RN

    def _seen(self, asks: list[Ask], drafts: list[list[int]], r: int) -> Seen:
        """Each row's penalty counts: its output and the drafts so far; its prompt."""
        counts = np.zeros((r, self.vocab), np.int32)
        prompt = np.zeros((r, self.vocab), bool)
        for i, a in enumerate(asks):
            out = [*a.stream.tokens, *drafts[i]]
            np.add.at(counts[i], np.asarray(out, np.int64), 1)
            prompt[i, np.asarray(a.stream.request.prompt, np.int64)] = True
        return Seen(counts, prompt)


def _masks(walks: list[GrammarWalk | None], live: list[int], r: int, vocab: int):
    """The grammar masks of the rows feeding now (None: no row has a grammar)."""
    if all(w is None for w in walks):
        return None
    allowed_RW = np.full((r, -(-vocab // 32)), -1, np.int32)
    for i in live:
        if walks[i] is not None and not walks[i].stopped:
            allowed_RW[i] = walks[i].mask()
    return allowed_RW


class _Run:
    """One :meth:`DraftModelProposer.propose`'s rows: what each feeds in each pass, and
    what each drafted. A row first catches up (the context the draft has not seen, ending
    with the token the row feeds next, :data:`CATCH_UP` tokens a pass), then feeds back
    each draft; a pass feeds every row that has something to feed."""

    def __init__(self, asks: list[Ask], held: list[int]):
        self.asks = asks
        self.next = list(held)  # per row: the next position to feed (= positions held)
        self.drafts: list[list[int]] = [[] for _ in asks]
        self.q: list[list[np.ndarray]] = [[] for _ in asks]
        self.stopped = [False] * len(asks)  # a grammar refused or ended the drafts

    def _feed(self, i: int) -> list[int]:
        a, at = self.asks[i], self.next[i]
        if at <= a.length:
            return a.context[at : min(at + CATCH_UP, a.length + 1)]
        if self.stopped[i] or len(self.drafts[i]) >= a.k:
            return []
        return self.drafts[i][-1:]

    def feeds(self, r: int):
        """The next pass's inputs (tokens, start, count per row; ``T``: 1, or
        :data:`CATCH_UP` while some row catches up) and the rows it feeds (none: done)."""
        feeds = [self._feed(i) for i in range(len(self.asks))]
        live = [i for i, f in enumerate(feeds) if f]
        t = 1 if all(len(f) <= 1 for f in feeds) else CATCH_UP
        tokens_RT = np.zeros((r, t), np.int32)
        start_R = np.zeros(r, np.int32)
        n_R = np.ones(r, np.int32)
        for i in live:
            tokens_RT[i, : len(feeds[i])] = feeds[i]
            start_R[i], n_R[i] = self.next[i], len(feeds[i])
        return tokens_RT, start_R, n_R, live

    def take(self, live, n_R, token_R, q_RV, allowed_RW, walks) -> None:
        """A pass's draws: a row that fed its context's last token or a draft drafts the
        token drawn, past its grammar (one it refuses, or after its end, stops it)."""
        for i in live:
            self.next[i] += int(n_R[i])
            if self.next[i] <= self.asks[i].length:
                continue  # still catching up
            w = walks[i]
            token = int(token_R[i])
            if w is not None and (w.stopped or not GrammarWalk.allows(allowed_RW[i], token)):
                self.stopped[i] = True
                continue
            if w is not None:
                w.advance(token)
            self.drafts[i].append(token)
            self.q[i].append(q_RV[i])
