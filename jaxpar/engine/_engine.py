"""``InferenceEngine``: validated, placed once, separate prefill and decode programs."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxpar.engine._abstract import AbstractEngine, run_form
from jaxpar.engine._admission import Admission
from jaxpar.engine._grammar import Constraint, Grammar, Grammars
from jaxpar.engine._logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from jaxpar.engine._offline import OfflineCore, decode_offline
from jaxpar.engine._placement import logical_axes_of, place, put_global
from jaxpar.engine._sampling import Sampling
from jaxpar.engine._scoring import PromptScorer
from jaxpar.engine._speculative import SpeculativeConfig
from jaxpar.engine._text import GenerationDefaults, Tokenizer
from jaxpar.engine._vocab import pad_vocab_params, true_vocab
from jaxpar.errors import ConfigError, ShapeError
from jaxpar.models import (
    ExecutionOptions,
    KVCache,
    ModelConfig,
    ModelRun,
    abstract_model,
    held_quantization,
    params_quantization,
    quantize_params,
    repeat_kv_heads,
    with_layer_loop,
)
from jaxpar.spec import ParallelConfig, Plan


@dataclasses.dataclass(frozen=True)
class Generation:
    """What :meth:`InferenceEngine.generate` returns."""

    tokens: list[list[int]]  # new tokens per prompt (up to and including a stop token)
    prefill_seconds: float
    decode_seconds: float
    prompt_tokens: int
    new_tokens: int
    #: Capacity-limited MoE only (None when dropless: nothing can drop): the (token, expert)
    #: assignments dropped for capacity, summed over layers and devices, per step:
    #: ``[prefill, decode step 1, ...]``. Padding rows route too and count.
    moe_dropped: tuple[int, ...] | None = None
    #: Per prompt, each new token's logprob and most likely alternatives (``generate``'s
    #: ``logprobs``; None when not asked for).
    logprobs: list[list[TokenLogprob]] | None = None

    @property
    def moe_dropped_total(self) -> int | None:
        """All dropped assignments of this generation (None when dropless)."""
        return None if self.moe_dropped is None else sum(self.moe_dropped)

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else math.nan

    @property
    def decode_tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds else math.nan


def prepare_params(run: ModelRun, params: nnx.State) -> tuple[ModelRun, nnx.State]:
    """The run with what the parameters already are, and the parameters in the form the
    engine runs: quantized as ``run.quantize`` asks (parameters quantized already say their
    mode, which the run takes), in the run's layer form (a pipelined engine restacks
    per-layer parameters once, here), in ``run.options.dtype`` when given.

    Args:
        run: the run form (:func:`~jaxpar.engine._abstract.run_form`): the layer form,
            padded vocabulary and KV-head replicas the strategy calls for.
        params: the parameters as given: the checkpoint's vocabulary and KV heads.

    Raises:
        ConfigError: parameters quantized in another mode than ``run.quantize``.
    """
    holds = held_quantization(params)
    held, wanted = holds["quantize"], run.options.quantize
    if held is not None and wanted not in (None, held):
        raise ConfigError(
            f"the parameters are quantized ({held}) but options.quantize="
            f"{wanted!r}: pass float parameters to quantize them, or "
            f"quantize={held!r} (or None) for these"
        )
    if held is not None and run.options.quantize_embeddings and not holds["quantize_embeddings"]:
        raise ConfigError(
            "options.quantize_embeddings=True, but the parameters are quantized with a float "
            "embedding and LM head: pass float parameters to quantize them all"
        )
    as_given = dataclasses.replace(run, padded_vocab=None, kv_head_replicas=1)
    if held is None and wanted is not None:
        params = quantize_params(as_given, params, wanted)
        holds = {"quantize": wanted, "quantize_embeddings": run.options.quantize_embeddings}
    run = run.with_options(**holds)
    params = with_layer_loop(run.config, params, run.layer_loop)
    if run.options.dtype is not None:
        params = _cast_floats(params, abstract_model(as_given.with_options(**holds)))
    return run, params


def _cast_floats(params: nnx.State, model: Any) -> nnx.State:
    """Float parameters in the dtype the run's model holds them in (``options.dtype``),
    converted where they lie; quantized values and their scales are left alone."""
    wanted = dict(nnx.to_flat_state(nnx.state(model)))
    loaded = []
    for path, var in nnx.to_flat_state(params):
        value, want = var.get_value(), wanted[path].get_value().dtype if path in wanted else None
        # jnp's floating includes bfloat16 and the fp8 types (numpy's does not).
        floating = want is not None and jnp.issubdtype(value.dtype, jnp.floating)
        if floating and jnp.dtype(value.dtype) != jnp.dtype(want):
            value = value.astype(want)
        loaded.append((path, var.replace(value)))
    return nnx.from_flat_state(loaded)


class InferenceEngine:
    """Sharded inference for one model under one parallel strategy.

    Validates the strategy against the specification tables first (nothing compiles for an
    illegal one), places the parameters once in their shardings (identical in both phases),
    and compiles separate prefill and decode programs whose in/out shardings come from the
    spec layer for their phase.

    Args:
        model_config: the model: its architecture, as the checkpoint says (kept as given:
            :attr:`model_config` is this object), or a run of it (a
            :class:`~jaxpar.models.ModelRun`: its config, and its options unless
            ``options`` are given).
        params: its parameters (``nnx.State`` as from ``init_params`` or
            ``load_hf_checkpoint``); host or device arrays.
        parallel_config: degrees of dp, pp, sp, ep, tp (default: one device).
        max_batch: sequences per step; prompts are padded up to it.
        max_seq_len: KV cache length per sequence (prompt + new tokens - 1: the last new
            token is returned, never cached).
        mesh: a mesh with axes ``dp, pp, sp, ep, tp``; default ``default_mesh(parallel_config)``:
            the first devices the strategy needs (every device under ``jax.distributed``).
        options: how this engine runs the model (:class:`~jaxpar.models.ExecutionOptions`:
            attention kernels, layer form, MoE exchange and capacity, quantization, KV cache
            storage, dtype); its ``"auto"`` values are resolved once, for the mesh's devices
            (:attr:`options` holds the result). Parameters are taken in any layer form
            and converted to the one the engine runs; with ``dtype`` set, float
            parameters are converted to it.
        quantize: same as ``options.quantize``: weight-only quantization applied here to
            float parameters (None, "int8", "fp8", "int4"; see :mod:`jaxpar.models._quant`):
            the attention and dense-FFN kernels become low-precision values with float32
            scales, sharded as their kernels. Parameters already quantized (e.g.
            ``init_params`` under quantized options, a pre-quantized checkpoint) are taken
            as they are.
        kv_cache_dtype: same as ``options.kv_cache_dtype``: the KV cache's storage (None:
            the compute dtype; "int8" or "fp8"; see :mod:`jaxpar.models._kv_quant`): one
            float32 scale per token per kv head, quantized where K/V are written, read by
            the XLA attention paths and the Pallas GPU paged kernel; about half a bf16
            cache's bytes, so twice the tokens fit. Unpipelined strategies (``pp == 1``).
        speculative: speculative decoding for the continuous batchers that serve this
            engine (:class:`~jaxpar.engine._speculative.SpeculativeConfig`, or vLLM's
            ``--speculative-config`` JSON keys); checked here, before anything compiles.
    """

    def __init__(
        self,
        model_config: ModelConfig | ModelRun,
        params: nnx.State,
        parallel_config: ParallelConfig | None = None,
        *,
        max_batch: int,
        max_seq_len: int,
        mesh: Mesh | None = None,
        options: ExecutionOptions | None = None,
        quantize: str | None = None,
        kv_cache_dtype: str | None = None,
        speculative: SpeculativeConfig | str | dict | None = None,
    ):
        #: Speculative decoding for the batchers serving this engine (None: off).
        self.speculative = SpeculativeConfig.parse(speculative)
        config = parallel_config or ParallelConfig()
        options = (ModelRun.split(model_config, options)[1] or ExecutionOptions()).merged(
            quantize=quantize, kv_cache_dtype=kv_cache_dtype
        )
        # The run form, once (a run form given, as engine_from_hf gives one, is kept): the
        # options checked in the layer form the strategy runs (pipeline stages stack the
        # layers) before any parameter is touched, the padded vocabulary, the KV-head
        # replicas. Handed down as it is from here on.
        run = run_form(model_config, config, options)
        model_config = run.config
        _check_quantize_backend(run.options.quantize or params_quantization(params))
        model_config.check_max_seq_len(max_seq_len)  # learned position tables end somewhere
        run, params = prepare_params(run, params)
        # Validated and laid out from shapes; a vocabulary tp does not divide is padded
        # (see _vocab): the engine runs the padded model, and everything callers see has
        # the true vocabulary.
        self.program = AbstractEngine.build(
            run, config, max_batch=max_batch, max_seq_len=max_seq_len, mesh=mesh
        )
        self.plan: Plan = self.program.plan
        self.mesh = self.program.mesh
        #: The devices it runs on (without ``mesh=``, the first ``parallel_config.size``).
        self.devices: tuple[jax.Device, ...] = tuple(
            sorted(self.mesh.devices.flat, key=lambda d: d.id)
        )
        #: The model as given (the checkpoint's config); never rewritten.
        self.model_config: ModelConfig = model_config
        #: How it runs: the options with every "auto" resolved for the mesh's devices.
        self.options: ExecutionOptions = self.program.options
        self.parallel_config = config
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len

        # tp a multiple of the KV heads: each head repeated for its group of devices (rule
        # kv-head-replicas), then placed one head per device. Parameters come with the
        # checkpoint's heads, or expanded already (engine_from_hf reads them so).
        as_given = dataclasses.replace(run, padded_vocab=None, kv_head_replicas=1)
        axes = logical_axes_of(nnx.state(abstract_model(as_given)))
        params = repeat_kv_heads(params, axes, model_config.n_kv_heads, run.kv_head_replicas)
        _check_params(
            nnx.state(abstract_model(dataclasses.replace(run, padded_vocab=None))), params
        )
        if run.padded_vocab is not None:
            params = pad_vocab_params(params, axes, run.vocab_size)
        self.layouts = self.program.layouts
        self.steps = self.program.steps
        self.params = jax.tree.map(place, params, self.layouts.params)
        if self.steps.param_formats is not None:  # a pipeline on TPU: its steps' layouts
            self.params = jax.device_put(self.params, self.steps.param_formats)
        self._core = None  # the serving core of generate (built on first use)
        self._scorer = None  # prompt_logprobs' program (built on first use)
        #: EOS ids and default sampling of ``generate`` (a checkpoint's, from engine_from_hf).
        self.generation_defaults = GenerationDefaults()
        #: The checkpoint's text side (engine_from_hf, when it has a tokenizer.json).
        self.tokenizer: Tokenizer | None = None
        self._grammars: Grammars | None = None  # structured output's compiler (first use)

    @property
    def run(self) -> ModelRun:
        """The model as this engine runs it: :attr:`model_config` under :attr:`options`,
        the vocabulary padded for tp (:attr:`AbstractEngine.run`)."""
        return self.program.run

    def lower(self, phase: str, *, prompt_len: int) -> Any:
        """The ``jax.stages.Lowered`` prefill or decode step over this engine's parameters
        (see :meth:`AbstractEngine.lower`)."""
        return self.program.lower(phase, prompt_len=prompt_len, params=self.params)

    # --- inputs ------------------------------------------------------------------------

    def _check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ShapeError("prompts must be a non-empty list of token-id lists")
        if len(prompts) > self.max_batch:
            raise ShapeError(
                f"{len(prompts)} prompts exceed the engine's max_batch={self.max_batch}; "
                "split them into batches or build the engine with a larger max_batch"
            )
        for i, prompt in enumerate(prompts):
            self.admission.check(
                prompt, max_new_tokens, name=f"prompt {i}", tokens_name="max_new_tokens"
            )

    @property
    def admission(self) -> Admission:
        """What a request may ask of this engine (:mod:`jaxpar.engine._admission`)."""
        return Admission(self.model_config.vocab_size, self.max_seq_len)

    def bucket(self, longest: int) -> int:
        """Padded prompt length: a power of two >= 8, a multiple of sp, <= max_seq_len.

        Few distinct lengths keep the number of prefill compilations small.
        """
        return prompt_bucket(longest, self.parallel_config.sp, self.max_seq_len)

    def pad_prompts(self, prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Right-pads prompts into ``tokens [max_batch, T]`` and ``lengths [max_batch]``.

        Rows past ``len(prompts)`` hold a one-token dummy prompt (they are never returned).

        Raises:
            ShapeError: more prompts than ``max_batch``, or a prompt that is empty, not 1-D
                integers, or holds an id outside the vocabulary (an embedding lookup past
                the table would give NaN logits, not an error).
        """
        if len(prompts) > self.max_batch:
            raise ShapeError(f"{len(prompts)} prompts exceed max_batch={self.max_batch}")
        ids = [self.admission.token_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        lengths = np.ones(self.max_batch, np.int32)
        lengths[: len(ids)] = [len(p) for p in ids]
        tokens = np.zeros((self.max_batch, self.bucket(int(lengths.max()))), np.int32)
        for i, prompt in enumerate(ids):
            tokens[i, : len(prompt)] = prompt
        return tokens, lengths

    # --- steps -------------------------------------------------------------------------

    def prefill(
        self,
        tokens_BT: np.ndarray,
        lengths_B: np.ndarray,
        *,
        seed: int = 0,
        sampling: Sampling | None = None,
    ) -> tuple[jax.Array, KVCache, jax.Array]:
        """Prefill, then the one handoff into the decode layout.

        Returns the last-position logits ``[B, V]``, the cache in the decode layout, and
        each sequence's first new token.
        """
        logits_BV, cache, first_B = self._prefill(tokens_BT, lengths_B, seed, sampling)
        logits_BV = true_vocab(self.steps.to_batch(logits_BV), self.model_config.vocab_size)
        return logits_BV, cache, self.steps.to_batch(first_B)

    def _prefill(
        self, tokens_BT: np.ndarray, lengths_B: np.ndarray, seed: int, sampling: Sampling | None
    ) -> tuple[jax.Array, KVCache, jax.Array]:
        """:meth:`prefill` with the steps' own results (stage-major when pipelined)."""
        lay = self.layouts
        tokens = put_global(np.asarray(tokens_BT, np.int32), lay.tokens_BT)
        lengths = put_global(np.asarray(lengths_B, np.int32), lay.lengths_prefill_B)
        logits_BV, k, v = self.steps.prefill(self.params, tokens, lengths)
        key = put_global(np.asarray(jax.random.key_data(jax.random.key(seed))), lay.replicated)
        cache, first_B = self.steps.handoff(
            k, v, lengths, logits_BV, jax.random.wrap_key_data(key), sampling or Sampling()
        )
        return logits_BV, cache, first_B

    def prefill_logits(self, tokens_BT: np.ndarray, lengths_B: np.ndarray) -> jax.Array:
        """Logits at every prompt position, ``[B, T, V]`` (for checks against references)."""
        lay = self.layouts
        tokens = put_global(np.asarray(tokens_BT, np.int32), lay.tokens_BT)
        lengths = put_global(np.asarray(lengths_B, np.int32), lay.lengths_prefill_B)
        logits = self.steps.prefill(self.params, tokens, lengths, all_logits=True)[0]
        return true_vocab(self.steps.to_batch(logits), self.model_config.vocab_size)

    def prompt_logprobs(
        self, prompts: Sequence[Sequence[int]], top: int = 0, *, run=None
    ) -> list[list[TokenLogprob | None]]:
        """Each prompt token's logprob given the tokens before it (None for the first), with
        the ``top`` most likely tokens at its position (0 to ``MAX_TOP_LOGPROBS``): a
        prefill with every position's logits, reduced on the devices
        (:mod:`jaxpar.engine._scoring`). Raw logprobs: ``log_softmax`` of the logits.
        ``run``: how a padded batch is scored (see :class:`PromptScorer`)."""
        for start in range(0, len(prompts), self.max_batch):  # scored dp at a time: any count
            self._check_prompts(prompts[start : start + self.max_batch], 1)
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ConfigError(f"top must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        return self.scorer(prompts, top, run)

    @property
    def scorer(self):
        """The :class:`~jaxpar.engine._scoring.PromptScorer` of this engine (built once)."""
        if self._scorer is None:
            self._scorer = PromptScorer(self.steps, self.params, self.bucket)
        return self._scorer

    def decode(self, cache: KVCache, tokens_B: np.ndarray | jax.Array) -> tuple[jax.Array, KVCache]:
        """One decode step (the cache is donated: do not reuse the argument)."""
        cache.check_room(1)
        if not isinstance(tokens_B, jax.Array):
            tokens_B = put_global(np.asarray(tokens_B, np.int32), self.layouts.tokens_B)
        logits, cache = self.steps.decode(self.params, cache, tokens_B)
        return true_vocab(self.steps.to_batch(logits), self.model_config.vocab_size), cache

    # --- generation ----------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        sampling: Sampling | None = None,
        seed: int = 0,
        stop_tokens: Sequence[int] | None = None,
        callback: Callable[[int, np.ndarray], None] | None = None,
        logprobs: int | None = None,
        grammar: Constraint | Grammar | None = None,
    ) -> Generation:
        """Generates up to ``max_new_tokens`` for each prompt.

        Args:
            prompts: token-id lists of different lengths (at most ``max_batch``).
            max_new_tokens: new tokens per prompt, counting the stop token.
            sampling: default: the checkpoint's (``generation_config.json``; engines from
                :func:`engine_from_hf`), else greedy; temperature / top-k / top-p and the
                penalties otherwise.
            seed: sampling seed; the same seed gives bitwise-identical tokens.
            stop_tokens: a sequence finishes after emitting one of these; default the
                checkpoint's EOS ids (none for an engine built from parameters); ``()``
                runs every row to ``max_new_tokens``.
            callback: streaming: called as ``callback(step, tokens_B)`` after every token.
                ``tokens_B`` (int32, all ``max_batch`` rows) holds each row's token of this
                step, or ``-1`` for padding rows and for rows that finished at an earlier step.
            logprobs: each new token's logprob with this many most likely alternatives
                (0 to ``MAX_TOP_LOGPROBS``) in :attr:`Generation.logprobs`: raw, before
                penalties, temperature, top-k and top-p. None: none.
            grammar: structured output for every prompt: a :class:`Constraint` (compiled
                with :meth:`grammar`) or a compiled :class:`Grammar`. Each row draws only
                tokens that keep its text matching, and stops when the grammar ends.

        Unpipelined strategies run the serving core (:mod:`jaxpar.engine._offline`): the
        paged cache, decode step and per-row sampler of :class:`ContinuousBatcher`, one
        dispatched step per token. Pipelined ones (``pp > 1``) run the pipeline schedule's
        contiguous cache, all decode steps in one compiled ``while_loop`` unless streaming.
        """
        self._check_prompts(prompts, max_new_tokens)
        sampling = sampling or self.generation_defaults.sampling
        if stop_tokens is None:
            stop_tokens = self.generation_defaults.eos_token_ids
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ConfigError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
        if isinstance(grammar, Constraint):
            grammar = self.grammar(grammar)
        tokens_BT, lengths_B = self.pad_prompts(prompts)
        n = len(prompts)
        if self.parallel_config.pp == 1:
            return self._generate_on_core(
                tokens_BT,
                lengths_B,
                n,
                max_new_tokens,
                sampling,
                seed,
                stop_tokens,
                callback,
                logprobs,
                grammar,
            )
        if logprobs is not None or sampling.penalized or grammar is not None:
            raise ConfigError(
                "logprobs, penalties and grammars run on the serving core (unpipelined "
                "strategies); "
                f"{self.parallel_config} has pp={self.parallel_config.pp}"
            )
        start = time.perf_counter()
        _, cache, first_B = self._prefill(tokens_BT, lengths_B, seed, sampling)
        first_B.block_until_ready()
        prefill_seconds = time.perf_counter() - start

        lay = self.layouts
        done = np.arange(self.max_batch) >= n
        done_B = put_global(done, lay.tokens_B)
        stop_S = put_global(_stop_list(stop_tokens), lay.replicated)
        key = jax.random.wrap_key_data(
            put_global(np.asarray(jax.random.key_data(jax.random.key(seed))), lay.replicated)
        )
        start = time.perf_counter()
        if callback is None:
            out_BN, cache = self.steps.decode_loop(
                self.params, cache, first_B, done_B, key, stop_S, max_new_tokens, sampling
            )
            out = self.steps.host_batch(out_BN)[:, :max_new_tokens]
        else:
            out = self._stream(
                cache, first_B, done, key, stop_tokens, max_new_tokens, sampling, callback
            )
        decode_seconds = time.perf_counter() - start

        tokens = []
        for row in out[:n]:
            kept = row[row >= 0] if (row < 0).any() else row
            tokens.append([int(t) for t in kept])
        steps_run = max(len(t) for t in tokens)  # the loop stops once every row is done
        dropped = self._dropped(steps_run) if callback is None else self._stream_dropped
        return Generation(
            tokens=tokens,
            prefill_seconds=prefill_seconds,
            decode_seconds=decode_seconds,
            prompt_tokens=int(lengths_B[:n].sum()),
            new_tokens=sum(max(len(t) - 1, 0) for t in tokens),
            moe_dropped=dropped,
        )

    def grammar(self, constraint: Constraint) -> Grammar:
        """``constraint`` (structured output) compiled for the checkpoint's tokenizer and
        EOS ids, for :meth:`ContinuousBatcher.submit
        <jaxpar.engine.ContinuousBatcher.submit>`'s ``grammar``.

        Raises:
            ConfigError: the engine has no tokenizer.
            GrammarError: the constraint is invalid, or llguidance cannot use the tokenizer.
        """
        if self.tokenizer is None:
            raise ConfigError(
                "structured output needs a tokenizer: build the engine with engine_from_hf "
                "from a checkpoint directory that has a tokenizer.json"
            )
        if self._grammars is None:
            self._grammars = Grammars(
                self.tokenizer.tokenizer, self.steps.vocab_size, self.tokenizer.eos_token_ids
            )
        return self._grammars.compile(constraint)

    def generate_text(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[dict[str, str]]],
        max_new_tokens: int,
        **kwargs: Any,
    ) -> list[str]:
        """Text in, text out, through the checkpoint's tokenizer (:attr:`tokenizer`).

        ``prompts``: a string, a list of strings, or a list of conversations (each a list
        of ``{"role", "content"}`` messages, rendered by the chat template). Stops at the
        checkpoint's EOS ids and samples as its ``generation_config.json`` says unless
        ``stop_tokens`` / ``sampling`` (any :meth:`generate` keyword) say otherwise.

        Raises:
            ConfigError: the engine has no tokenizer (build it with :func:`engine_from_hf`
                from a directory with a ``tokenizer.json``), or no chat template for
                conversations.
        """
        if self.tokenizer is None:
            raise ConfigError(
                "generate_text needs a tokenizer: build the engine with engine_from_hf from a "
                "checkpoint directory that has a tokenizer.json"
            )
        items = [prompts] if isinstance(prompts, str) else list(prompts)
        ids = [
            self.tokenizer.encode(p)
            if isinstance(p, str)
            else self.tokenizer.apply_chat_template(list(p))
            for p in items
        ]
        out = self.generate(ids, max_new_tokens, **kwargs)
        return [self.tokenizer.decode(tokens) for tokens in out.tokens]

    def compile_generate(self, prompt_len: int, max_new_tokens: int) -> None:
        """Compiles every decode step a ``generate`` of prompts of up to ``prompt_len``
        tokens and ``max_new_tokens`` new ones runs (unpipelined: one per block-table
        width; the prefill compiles at the first call of each prompt bucket)."""
        if self.parallel_config.pp > 1:
            return
        core = self._offline_core()
        for rows in core.slot_steps.row_buckets():
            for width in core.widths(min(prompt_len + max_new_tokens, self.max_seq_len)):
                core.slot_steps.compile_step(self.params, width, rows)

    def _offline_core(self) -> OfflineCore:
        if self._core is None:
            self._core = OfflineCore.build(self.steps, self.max_batch)
        return self._core

    def _generate_on_core(
        self,
        tokens_BT,
        lengths_B,
        n,
        max_new_tokens,
        sampling,
        seed,
        stop_tokens,
        callback,
        logprobs,
        grammar=None,
    ) -> Generation:
        core = self._offline_core()
        start = time.perf_counter()
        times = []
        decoded = decode_offline(
            core,
            self.params,
            tokens_BT,
            lengths_B,
            n,
            max_new_tokens,
            sampling,
            seed,
            stop_tokens,
            callback,
            on_prefilled=lambda: times.append(time.perf_counter()),
            logprobs=logprobs,
            grammar=grammar,
        )
        end = time.perf_counter()
        tokens = []
        for row in decoded.tokens_BN[:n]:
            tokens.append([int(t) for t in row[row >= 0]])
        return Generation(
            tokens=tokens,
            prefill_seconds=times[0] - start,
            decode_seconds=end - times[0],
            prompt_tokens=int(lengths_B[:n].sum()),
            new_tokens=sum(max(len(t) - 1, 0) for t in tokens),
            moe_dropped=decoded.dropped,
            logprobs=None if decoded.logprobs is None else decoded.logprobs[:n],
        )

    def _dropped(self, steps: int) -> tuple[int, ...] | None:
        """Drops per step of the last prefill and decode loop (None when dropless)."""
        last = self.steps.last_dropped
        if not self.steps.counts_drops:
            return None
        per_step = np.asarray(jax.device_get(last["decode_loop"]))[1:steps]
        return (int(last["prefill"]), *(int(x) for x in per_step))

    def _stream(self, cache, first_B, done, key, stop_tokens, n_new, sampling, callback):
        out = np.full((self.max_batch, n_new), -1, np.int32)
        tokens_B = first_B
        host = self.steps.host_batch(first_B)  # batch may be split over processes
        stop = np.asarray(list(stop_tokens), np.int32)
        counting = self.steps.counts_drops
        dropped = [int(self.steps.last_dropped["prefill"])] if counting else None
        for step in range(n_new):
            if step:
                step_arr = put_global(np.asarray(step, np.int32), self.layouts.replicated)
                tokens_B, cache = self.steps.decode_select(
                    self.params, cache, tokens_B, key, step_arr, sampling
                )
                host = self.steps.host_batch(tokens_B)
                if counting:
                    dropped.append(int(self.steps.last_dropped["decode_step"]))
            out[:, step] = np.where(done, -1, host)
            callback(step, out[:, step].copy())
            done = done | np.isin(host, stop)
            if done.all():
                break
        self._stream_dropped = tuple(dropped) if counting else None
        return out


def _stop_list(stop_tokens: Sequence[int]) -> np.ndarray:
    """Stop tokens padded with -1 (never generated) to a power of two >= 8: few shapes, so
    the decode loop compiles once for any short stop list."""
    stops = [int(t) for t in stop_tokens]
    out = np.full(max(8, 1 << max(len(stops) - 1, 0).bit_length()), -1, np.int32)
    out[: len(stops)] = stops
    return out


def _check_quantize_backend(mode: str | None) -> None:
    """int4 weights need jax >= 0.11: jax 0.10's placement of int4 arrays gives a layout
    its own compiled steps refuse."""
    if mode == "int4" and jax.__version_info__ < (0, 11):
        raise ConfigError(
            f"quantize='int4' needs jax >= 0.11 (this is {jax.__version__}); int8 and fp8 "
            "run on every supported jax"
        )


def _check_params(abstract: nnx.State, params: nnx.State) -> None:
    """Same tree and shapes as the model expects, before anything is placed."""
    want = jax.tree_util.tree_flatten_with_path(abstract)[0]
    got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    got_paths = {jax.tree_util.keystr(p): v for p, v in got.items()}
    for path, leaf in want:
        name = jax.tree_util.keystr(path)
        if name not in got_paths:
            raise ConfigError(f"parameter {name} is missing (expected shape {leaf.shape})")
        shape = np.shape(got_paths[name])
        if tuple(shape) != tuple(leaf.shape):
            raise ConfigError(f"parameter {name} has shape {shape}, the model expects {leaf.shape}")
    extra = set(got_paths) - {jax.tree_util.keystr(p) for p, _ in want}
    if extra:
        raise ConfigError(f"unexpected parameter(s) {sorted(extra)[:5]}")


def prompt_bucket(longest: int, sp: int, max_seq_len: int) -> int:
    """:meth:`InferenceEngine.bucket`: a power of two >= 8, a multiple of ``sp``, at most
    ``max_seq_len`` (the planner pads prompts the same way)."""
    length = max(8, 1 << (longest - 1).bit_length())
    length = -(-length // sp) * sp
    return min(length, max_seq_len)
