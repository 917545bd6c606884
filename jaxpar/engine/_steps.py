"""The jit-compiled step functions, each with explicit per-phase shardings.

* ``prefill``: whole prompts in the prefill layout (tokens may be split over ``sp``);
* ``handoff``: pads the prefill K/V to ``max_seq_len`` and reshards it once into the decode
  layout, and picks each sequence's first new token;
* ``decode``: one token per sequence, cache donated and updated in place;
* ``decode_select``: a decode step that also picks the next tokens;
* ``decode_loop``: many decode steps inside one ``lax.while_loop``, so the host does not
  dispatch every token.

Each entry point is written once, for every strategy: the shardings come from
:class:`~jaxpar.engine._layouts.Layouts`, the traced body from a schedule
(:mod:`jaxpar.engine._schedules`: the plain model, or the pipeline when ``pp > 1``). Model
code only names logical axes; the ``sharding_context`` around each traced body turns them
into this phase's ``PartitionSpec``s.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxpar.engine._layouts import Layouts
from jaxpar.engine._pipeline_stages import Stages
from jaxpar.engine._placement import put_global
from jaxpar.engine._sampling import Sampling
from jaxpar.engine._schedules import Pick, Pipelined, Unpipelined
from jaxpar.engine._vocab import VocabSplit
from jaxpar.models import KVCache, count_dropped, total_dropped
from jaxpar.spec import ModelDims, ParallelConfig, Phase, sharding_context

PREFILL, DECODE = Phase.PREFILL, Phase.DECODE


def schedule_for(mesh: Mesh, config: ParallelConfig, dims: ModelDims) -> Unpipelined | Pipelined:
    """The traced bodies of this strategy: pipelined when ``pp > 1``."""
    if config.pp == 1:
        return Unpipelined()
    return Pipelined(Stages(mesh, config, dims), config.microbatches, config.decode_groups)


class Steps:
    """Builds, compiles (ahead of time, timed) and caches the step functions."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        layouts: Layouts,
        mesh: Mesh,
        config: ParallelConfig,
        dims: ModelDims,
        max_seq_len: int,
        *,
        vocab_size: int | None = None,
        platform: str | None = None,
    ):
        """``dims`` may have a padded vocabulary; ``vocab_size`` is the true one (default:
        ``dims.vocab_size``): ids from it up are never chosen. ``platform`` (default: the
        mesh's) is what the steps are traced and lowered for; naming another platform than
        the mesh's makes them lowerable only (:meth:`lower_prefill`, :meth:`lower_decode`)."""
        self.graphdef = graphdef
        self.vocab_size = dims.vocab_size if vocab_size is None else vocab_size
        self.layouts = layouts
        self.mesh = mesh
        self.config = config
        self.dims = dims
        self.max_seq_len = max_seq_len
        self.platform = platform
        self.schedule = schedule_for(mesh, config, dims)
        self.compile_seconds: dict[str, float] = {}
        self._compiled: dict[tuple, Any] = {}
        #: When the last compile ended (``time.monotonic``; 0: none yet).
        self.compiled_at = 0.0
        #: Programs being compiled now (by a warm-up thread or a step's first call): a
        #: second caller waits for that compile instead of compiling the program again.
        self._building: dict[tuple, threading.Event] = {}
        self._lock = threading.Lock()
        #: Tracing and lowering run one at a time (they hold the GIL anyway); XLA's
        #: compiles run outside it, in parallel across warm-up threads.
        self._lowering = threading.RLock()
        #: Capacity-limited MoE: every step returns its dropped assignments as one more
        #: output, which the entry points below strip off and keep in ``last_dropped``
        #: (``prefill``/``decode``/``decode_step``: an int32 scalar; ``decode_loop``: one
        #: per step, ``[max_seq_len]``). Dropless programs have no such output.
        self.counts_drops = getattr(dims, "moe_capacity_factor", None) is not None
        self.last_dropped: dict[str, jax.Array] = {}
        #: Where the parameters lie: ``None`` for their shardings in the default layout;
        #: for a pipeline on TPU, the formats (sharding + layout) its steps read them in
        #: (:func:`~jaxpar.engine._param_formats.decode_param_formats`).
        self.param_formats: Any = None

    @property
    def params_in(self) -> Any:
        """What every step takes its parameters as: :attr:`param_formats` where set, else
        the parameters' shardings."""
        return self.layouts.params if self.param_formats is None else self.param_formats

    # --- traced bodies -------------------------------------------------------------------

    # The public surface a program built outside this class uses (the serving core's
    # slot steps, prompt scoring): the model over parameters, a phase's sharding context,
    # the compile cache, the drop-count output, lowering for the target platform.

    def model(self, params):
        """The model over ``params`` (``nnx.merge`` with this engine's graph); traced."""
        return nnx.merge(self.graphdef, params)

    def context(self, phase: Phase):
        """The sharding context a traced body of ``phase`` runs in, where logical axes
        become that phase's partition specs on this mesh."""
        return sharding_context(self.mesh, phase, self.config, self.dims, platform=self.platform)

    def lower(self, jitted, *args):
        """``jitted`` lowered for :attr:`platform` (the mesh's own when not named)."""
        if self.platform is None:
            return jitted.lower(*args)
        target = "cuda" if self.platform == "gpu" else self.platform
        return jitted.trace(*args).lower(lowering_platforms=(target,))

    def vocab_split(self, phase: Phase) -> VocabSplit:
        """How this strategy's logits of ``phase`` are split over the vocabulary (whole
        when pipelined: a stage samples inside its own ``shard_map``)."""
        if self.config.pp > 1:
            return VocabSplit()
        lay = self.layouts
        return VocabSplit.of(lay.logits_prefill if phase is PREFILL else lay.logits)

    def _pick(self, key: jax.Array, sampling: Sampling, phase: Phase = DECODE) -> Pick:
        return Pick(key, sampling, self.vocab_size, self.vocab_split(phase))

    def _counted(self, out: tuple, drops: list) -> tuple:
        return (*out, total_dropped(drops)) if self.counts_drops else out

    def _strip(self, name: str, out: tuple) -> tuple:
        if self.counts_drops:
            self.last_dropped[name] = out[-1]
            return out[:-1]
        return out

    def with_drops(self, shardings: tuple) -> tuple:
        """A program's output shardings, with the drop count's (replicated) appended when
        the steps count MoE drops (:attr:`counts_drops`)."""
        return (*shardings, self.layouts.replicated) if self.counts_drops else shardings

    def _prefill(self, params, tokens_BT, lengths_B, all_logits=False):
        with self.context(PREFILL), count_dropped() as drops:
            out = self.schedule.prefill(self.model(params), tokens_BT, lengths_B, all_logits)
            return self._counted(out, drops)

    def _prefill_context(self, params, tokens_BT, lengths_B, start_B, ctx_k, ctx_v):
        with self.context(PREFILL), count_dropped() as drops:
            context = (ctx_k, ctx_v, start_B)
            out = self.schedule.prefill(self.model(params), tokens_BT, lengths_B, False, context)
            return self._counted(out, drops)

    def _handoff(self, k, v, lengths_B, logits, key, sampling):
        with self.context(DECODE):
            mode = getattr(self.dims, "kv_cache_dtype", None)
            cache = KVCache.from_prefill(k, v, lengths_B, self.max_seq_len, mode)
            pick = self._pick(jax.random.fold_in(key, 0), sampling, PREFILL)
            return cache, self.schedule.first_tokens(logits, pick)

    def _decode(self, params, cache, tokens_B):
        with self.context(DECODE), count_dropped() as drops:
            return self._counted(self.schedule.decode(self.model(params), cache, tokens_B), drops)

    def _decode_select(self, params, cache, tokens, key, step, sampling):
        with self.context(DECODE), count_dropped() as drops:
            pick = self._pick(jax.random.fold_in(key, step), sampling)
            out = self.schedule.decode_tokens(self.model(params), cache, tokens, pick)
            return self._counted(out, drops)

    def _decode_loop(self, params, cache, first, done_B, key, stop_S, n_new, sampling):
        # n_new is a traced scalar: the output has room for the most tokens any prompt can
        # get (max_seq_len), so one program serves every max_new_tokens. ``first`` is
        # [B] (or stage-major [P, B]), and so are the carried tokens and done flags.
        out = jnp.full((*first.shape, self.max_seq_len), -1, jnp.int32).at[..., 0].set(first)
        done = done_B | jnp.isin(first, stop_S)
        dropped_N = jnp.zeros((self.max_seq_len,), jnp.int32)  # per step (step 0: prefill's)

        def cond(carry):
            i, _, _, done, _, _ = carry
            return (i < n_new) & ~self.schedule.all_done(done)

        def body(carry):
            i, tokens, cache, done, out, dropped_N = carry
            tokens, cache, *dropped = self._decode_select(params, cache, tokens, key, i, sampling)
            if dropped:
                dropped_N = dropped_N.at[i].set(dropped[0])
            out = out.at[..., i].set(jnp.where(done, -1, tokens))
            done = done | jnp.isin(tokens, stop_S)
            return i + 1, tokens, cache, done, out, dropped_N

        init = (jnp.int32(1), first, cache, done, out, dropped_N)
        _, _, cache, _, out, dropped_N = jax.lax.while_loop(cond, body, init)
        return (out, cache, dropped_N) if self.counts_drops else (out, cache)

    # --- compiled entry points -----------------------------------------------------------

    def _aot(self, name: str, key: tuple, jitted, args):
        """Compiles ``jitted`` for ``args`` once per ``(name, *key)``, timing the compile.

        Thread-safe: while one thread compiles a program, another that needs it waits for
        it (a request never compiles a program a warm-up thread is compiling)."""
        cache_key = (name, *key)
        compiled = self._compiled.get(cache_key)
        if compiled is not None:
            return compiled
        with self._lock:
            compiled = self._compiled.get(cache_key)
            building = self._building.get(cache_key)
            if compiled is None and building is None:
                building = self._building[cache_key] = threading.Event()
                mine = True
            else:
                mine = False
        if compiled is not None:
            return compiled
        if not mine:
            building.wait()
            # Compiled by the other thread, or it failed: then compile here (and fail here).
            return self._aot(name, key, jitted, args)
        try:
            start = time.perf_counter()
            with self._lowering:
                lowered = jitted.lower(*args)
            compiled = lowered.compile()
            with self._lock:
                self._compiled[cache_key] = compiled
                self.compile_seconds[name] = time.perf_counter() - start
        finally:
            with self._lock:
                del self._building[cache_key]
                self.compiled_at = time.monotonic()
            building.set()
        return compiled

    @property
    def compiling(self) -> bool:
        """A program is being compiled now (a step waiting for it is not stuck)."""
        return bool(self._building)

    def compiled_count(self) -> int:
        """Programs compiled (or loaded from the persistent cache) so far."""
        return len(self._compiled)

    def compile(self, name: str, key: tuple, fn, in_shardings, out_shardings, args, **jit_kw):
        """:meth:`_aot` of ``jax.jit(fn, ...)``; a compiled program is looked up before
        anything is built (building a ``jax.jit`` wrapper per call parses the shardings of
        every parameter: most of a decode step's host time)."""
        compiled = self._compiled.get((name, *key))
        if compiled is not None:
            return compiled
        jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, **jit_kw)
        return self._aot(name, key, jitted, args)

    def compile_or_lower(self, lower: bool, name, key, fn, in_shardings, out_shardings, args, **kw):
        """:meth:`compile`, or with ``lower`` the same program's ``jax.stages.Lowered``
        for :attr:`platform` (for inspection: nothing is compiled or cached)."""
        if not lower:
            return self.compile(name, key, fn, in_shardings, out_shardings, args, **kw)
        jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, **kw)
        return self.lower(jitted, *args)

    def lower_prefill(self, params, tokens_BT, lengths_B, *, all_logits: bool = False):
        """The ``jax.stages.Lowered`` prefill for these shapes (for inspection)."""
        return self.lower(self._jit_prefill(all_logits), params, tokens_BT, lengths_B)

    def _jit_prefill(self, all_logits: bool):
        lay = self.layouts
        logits = lay.logits_prefill_all if all_logits else lay.logits_prefill
        return jax.jit(
            lambda p, t, n: self._prefill(p, t, n, all_logits),
            in_shardings=(self.params_in, lay.tokens_BT, lay.lengths_prefill_B),
            out_shardings=self.with_drops((logits, lay.kv_prefill, lay.kv_prefill)),
        )

    def compile_prefill(self, params, rows: int, length: int) -> Any:
        """Compiles the prefill of ``[rows, length]`` prompts ahead of its first call;
        returns its outputs' shapes (``ShapeDtypeStruct`` trees)."""
        info = self.compiled_prefill(params, rows, length).out_info
        return info[:-1] if self.counts_drops else info  # as :meth:`prefill` returns them

    def compiled_prefill(self, params, rows: int, length: int) -> Any:
        """The compiled prefill of ``[rows, length]`` prompts (compiled once, then the same
        program :meth:`prefill` runs), for inspection."""
        lay = self.layouts
        tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=lay.tokens_BT)
        lengths = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=lay.lengths_prefill_B)
        args = (params, tokens, lengths)
        return self._aot("prefill", ((rows, length), False), self._jit_prefill(False), args)

    def prefill(self, params, tokens_BT, lengths_B, *, all_logits: bool = False):
        args = (params, tokens_BT, lengths_B)
        jitted = self._jit_prefill(all_logits)
        out = self._aot("prefill", (tokens_BT.shape, all_logits), jitted, args)(*args)
        return self._strip("prefill", out)

    def _prefill_context_program(self, args, lower: bool = False):
        lay = self.layouts
        tokens, ctx_k = args[1], args[4]
        return self.compile_or_lower(
            lower,
            "prefill_context",
            (tokens.shape, jax.tree.leaves(ctx_k)[0].shape),
            self._prefill_context,
            (self.params_in, lay.tokens_BT, *(lay.lengths_prefill_B,) * 2, *(lay.kv_prefill,) * 2),
            self.with_drops((lay.logits_prefill, lay.kv_prefill, lay.kv_prefill)),
            args,
        )

    def prefill_context(self, params, tokens_BT, lengths_B, start_B, ctx_k, ctx_v):
        """Prefill of new tokens that continue cached ones (``Decoder.prefill``'s
        ``context``): row b's ``lengths_B[b]`` tokens at positions ``start_B[b] + 0..T-1``
        attend to its ``start_B[b]`` cached keys in ``ctx_k``/``ctx_v`` (prefill layout,
        ``[B, C, K, H]`` per layer) too. One compile per (rows, T, C).

        Returns:
            (logits at each row's last new token, the new tokens' k, v), as :meth:`prefill`.
        """
        args = (params, tokens_BT, lengths_B, start_B, ctx_k, ctx_v)
        return self._strip("prefill", self._prefill_context_program(args)(*args))

    def compile_prefill_context(
        self, params, rows: int, length: int, context: int, *, lower: bool = False
    ) -> Any:
        """Compiles :meth:`prefill_context` for ``[rows, length]`` new tokens over
        ``context`` cached positions ahead of its first call (``lower``: returns the
        ``jax.stages.Lowered`` program instead, compiling nothing)."""
        lay = self.layouts

        def spec(shape, dtype, sharding):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        d = self.dims

        def context_kv(width: int):  # keys and values may differ in width (MLA)
            shape = (rows, context, d.n_kv_heads, width)
            if d.layer_loop == "scan":
                return spec((d.n_layers, *shape), d.dtype, lay.kv_prefill)
            return tuple(spec(shape, d.dtype, s) for s in lay.kv_prefill)

        k, v = (context_kv(w) for w in d.cache_kv_dims)
        lengths = spec((rows,), jnp.int32, lay.lengths_prefill_B)
        tokens = spec((rows, length), jnp.int32, lay.tokens_BT)
        return self._prefill_context_program((params, tokens, lengths, lengths, k, v), lower)

    def handoff(self, k, v, lengths_B, logits, key, sampling: Sampling):
        lay = self.layouts
        compiled = self.compile(
            "handoff",
            (jax.tree.map(jnp.shape, k), sampling),
            lambda k, v, n, lg, key: self._handoff(k, v, n, lg, key, sampling),
            (
                lay.kv_prefill,
                lay.kv_prefill,
                lay.lengths_prefill_B,
                lay.logits_prefill,
                lay.replicated,
            ),
            (lay.cache, lay.next_tokens),
            (k, v, lengths_B, logits, key),
        )
        return compiled(k, v, lengths_B, logits, key)

    def jit_decode(self, params_in: Any = None):
        """The jitted decode step; ``params_in``: the parameters' formats or shardings
        (default :attr:`params_in`)."""
        lay = self.layouts
        return jax.jit(
            self._decode,
            in_shardings=(
                self.params_in if params_in is None else params_in,
                lay.cache,
                lay.tokens_B,
            ),
            out_shardings=self.with_drops((lay.logits, lay.cache)),
            donate_argnums=(1,),
        )

    def lower_decode(self, params, cache, tokens_B):
        """The ``jax.stages.Lowered`` decode step for these shapes (for inspection)."""
        return self.lower(self.jit_decode(), params, cache, tokens_B)

    def decode(self, params, cache, tokens_B):
        """One decode step over ``cache``; one compile per shape of the cache and tokens."""
        args = (params, cache, tokens_B)
        shapes = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves((cache, tokens_B)))
        compiled = self._aot("decode", shapes, self.jit_decode(), args)
        return self._strip("decode", compiled(*args))

    def decode_select(self, params, cache, tokens, key, step, sampling: Sampling):
        """A decode step that picks the next tokens from the previous step's ``tokens``."""
        lay = self.layouts
        compiled = self.compile(
            "decode_step",
            (sampling,),
            lambda p, c, t, k, s: self._decode_select(p, c, t, k, s, sampling),
            (self.params_in, lay.cache, lay.next_tokens, lay.replicated, lay.replicated),
            self.with_drops((lay.next_tokens, lay.cache)),
            (params, cache, tokens, key, step),
            donate_argnums=(1,),
        )
        return self._strip("decode_step", compiled(params, cache, tokens, key, step))

    def decode_loop(self, params, cache, first, done_B, key, stop_S, n_new, sampling):
        """Up to ``n_new`` tokens per row (``[B, max_seq_len]``, -1 past the end).

        ``n_new`` is a runtime argument: one compile per sampling mode and stop-list size.
        """
        lay = self.layouts
        n_new = put_global(np.asarray(n_new, np.int32), lay.replicated)
        r = lay.replicated
        compiled = self.compile(
            "decode_loop",
            (sampling, stop_S.shape),
            lambda p, c, f, d, k, s, n: self._decode_loop(p, c, f, d, k, s, n, sampling),
            (self.params_in, lay.cache, lay.next_tokens, lay.tokens_B, r, r, r),
            self.with_drops((lay.out_tokens, lay.cache)),
            (params, cache, first, done_B, key, stop_S, n_new),
            donate_argnums=(1,),
        )
        out = compiled(params, cache, first, done_B, key, stop_S, n_new)
        return self._strip("decode_loop", out)

    # --- results as callers see them -----------------------------------------------------

    def to_batch(self, x: jax.Array) -> jax.Array:
        """A step's result as callers see it (pipelined steps drop their stage dim here)."""
        return self.schedule.to_batch(x)

    def host_batch(self, x: jax.Array) -> np.ndarray:
        """A step's result on the host, on every process (the last stage's row if pipelined)."""
        return self.schedule.host_batch(x)
