"""Decoder layer, the decoder with its prefill/decode passes, and functional helpers."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.models._attention import Attention, Context
from jaxpar.models._cache import KVCache
from jaxpar.models._config import ModelConfig
from jaxpar.models._kernel_choice import sp_prefill_attention
from jaxpar.models._kv_heads import repeat_kv_heads, state_axes
from jaxpar.models._layers import BTD, FFN, Embedding, LMHead, make_norm
from jaxpar.models._mla import LatentAttention
from jaxpar.models._moe import MoE
from jaxpar.models._moe_stats import count_dropped, record_dropped, total_dropped
from jaxpar.models._options import ExecutionOptions
from jaxpar.models._quant import (
    SCALE_SUFFIX,
    check_quantize,
    held_quantization,
    params_quantization,
    quantize_array,
    to_stored,
)
from jaxpar.models._ring_attention import from_zigzag, to_zigzag, zigzag_positions, zigzag_slots
from jaxpar.models._run import ModelRun
from jaxpar.spec import Module, Phase, active_degree, active_phase


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x)) (ffn dense or MoE).

    With ``config.norms.sandwich`` (Gemma 2/3) each sub-block's output is normalised again
    before its residual add: x + norm(attn(norm(x))), then x + norm(ffn(norm(x))).
    """

    def __init__(self, config: ModelConfig | ModelRun, *, rngs: nnx.Rngs, layer: int = 0):
        # ``layer``: which layer this is (DeepSeek's first layers are dense, the rest MoE);
        # stacked layers are all alike (the options refuse to stack mixed ones).
        config = ModelRun.of(config)
        self.attn_norm = make_norm(config, rngs=rngs)
        self.attn = (
            LatentAttention(config, rngs=rngs) if config.is_mla else Attention(config, rngs=rngs)
        )
        sandwich = config.norms.sandwich
        self.post_attn_norm = make_norm(config, rngs=rngs) if sandwich else None
        self.ffn_norm = make_norm(config, rngs=rngs)
        if config.layer_is_moe(layer):
            self.ffn = MoE(config, rngs=rngs)
        elif config.is_moe:
            self.ffn = FFN(config, rngs=rngs, d_ff=config.moe.dense_d_ff)
        else:
            self.ffn = FFN(config, rngs=rngs)
        self.post_ffn_norm = make_norm(config, rngs=rngs) if sandwich else None

    def _attn_out(self, y_BxD: jax.Array) -> jax.Array:
        return y_BxD if self.post_attn_norm is None else self.post_attn_norm(y_BxD)

    def _ffn_block(self, x_BxD: jax.Array) -> jax.Array:
        """x + ffn(norm(x)) (the ffn's output normalised again under sandwich norms)."""
        y_BxD = self.ffn(self.ffn_norm(x_BxD))
        return x_BxD + (y_BxD if self.post_ffn_norm is None else self.post_ffn_norm(y_BxD))

    def prefill(
        self,
        x_BTD: jax.Array,
        pos_BT: jax.Array,
        lengths_B: jax.Array,
        context: Context | None = None,
        layer: int | jax.Array | None = None,
        *,
        ring: bool = False,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Returns (x [B,T,D], k [B,T,K,H], v [B,T,K,H]); ``context``: this layer's cached
        keys and values the new tokens continue (see :meth:`Attention.prefill`); ``layer``:
        the model-wide layer index (selects the window and RoPE base where layers differ);
        ``ring``: the tokens are in ring attention's zigzag order (k/v come back natural)."""
        extra = {"ring": True} if ring else {}
        y_BTD, k_BTKH, v_BTKH = self.attn.prefill(
            self.attn_norm(x_BTD), pos_BT, lengths_B, context, layer, **extra
        )
        x_BTD = x_BTD + self._attn_out(y_BTD)
        return self._ffn_block(x_BTD), k_BTKH, v_BTKH

    def decode(
        self,
        x_B1D: jax.Array,
        pos_B: jax.Array,
        layer: int | jax.Array,
        cache: KVCache,
        layer_id: int | jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """One token per row through layer ``layer``: writes its K/V, then attends.

        Writing the new token into the cache before reading the layer's slice is what
        lets XLA update the carried cache in place (read-then-write makes it copy).
        ``cache`` is contiguous (:class:`KVCache`, a pipeline group's view) or paged
        (:class:`PagedKVCache`): anything with ``write_layer``, ``layer`` and ``advance``.

        ``layer`` indexes ``cache``; ``layer_id`` is the model-wide layer index (a pipeline
        stage's cache view counts its own layers from 0), ``layer`` when None.

        Returns:
            (x [B,1,D], the cache with this layer's new token written).
        """
        layer_id = layer if layer_id is None else layer_id
        q_B1NH, k_BKH, v_BKH = self.attn.decode_project(self.attn_norm(x_B1D), pos_B, layer_id)
        cache = cache.write_layer(layer, k_BKH, v_BKH)
        y_B1D = self.attn.decode_attend(q_B1NH, pos_B, cache.layer(layer), layer_id)
        x_B1D = x_B1D + self._attn_out(y_B1D)
        return self._ffn_block(x_B1D), cache


def _stacked_layers(config: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
    """L layers as one module whose parameters carry a leading "layers" axis."""

    @nnx.split_rngs(splits=config.n_layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(config, rngs=rngs)

    return make(rngs)


def _layer_list(config: ModelConfig, rngs: nnx.Rngs) -> nnx.List:
    """L layers, each with parameter arrays of its own (``layer_loop="unrolled"``)."""
    return nnx.List([DecoderLayer(config, rngs=rngs, layer=i) for i in range(config.n_layers)])


class Decoder(nnx.Module):
    """A decoder-only Transformer: embedding, L layers, final norm, LM head.

    The run's ``layer_loop`` (:class:`~jaxpar.models.ExecutionOptions`) picks how the
    layers are stored and run:

    * ``"unrolled"`` (default): a list of layers with their own parameter arrays, run by a
      Python loop. Every matmul reads its weight where it lies: a scan over stacked
      weights makes XLA copy each layer's weights out of the stack on every step (38% of
      a decode step on an H100), and the cache is a tuple of per-layer arrays for the
      same reason. Compile time grows with depth (``scripts/bench.py`` measures it).
    * ``"scan"``: parameters stacked ``[L, ...]`` under ``jax.lax.scan``: compile time flat
      in depth, at the price of those copies. Pipeline stages use this form.

    ``prefill`` and ``decode`` are pure given the module's state: the engine calls
    ``nnx.merge(graphdef, state).prefill(...)`` inside ``jax.jit``.
    """

    def __init__(
        self,
        config: ModelConfig | ModelRun,
        options: ExecutionOptions | None = None,
        *,
        rngs: nnx.Rngs,
    ):
        config = ModelRun.of(config, options)
        self.config = config
        self.embed = Embedding(config, rngs=rngs)
        scanned = config.layer_loop == "scan"
        self.layers = _stacked_layers(config, rngs) if scanned else _layer_list(config, rngs)
        self.final_norm = make_norm(config, rngs=rngs)
        self.lm_head = LMHead(config, rngs=rngs)

    @property
    def scanned(self) -> bool:
        """Whether the layers are stacked and run under ``lax.scan``."""
        return self.config.layer_loop == "scan"

    def logits(self, x_BxD: jax.Array) -> jax.Array:
        """Final norm and LM head: hidden ``[B, (T,) D]`` -> float32 logits ``[B, (T,) V]``,
        soft-capped ``c * tanh(logits / c)`` with ``config.embed.logit_softcap`` (Gemma 2)."""
        tied = self.embed.table() if self.config.embed.tied else None
        logits = self.lm_head(self.final_norm(x_BxD), tied)
        cap = self.config.embed.logit_softcap
        return logits if cap is None else jnp.tanh(logits / cap) * cap

    def prefill(
        self,
        tokens_BT: jax.Array,
        lengths_B: jax.Array,
        *,
        all_logits: bool = False,
        context: tuple[Any, Any, jax.Array] | None = None,
    ) -> tuple[jax.Array, Any, Any]:
        """Runs whole right-padded prompts, or new tokens that continue cached ones.

        Args:
            tokens_BT: Prompt tokens, int32; positions >= lengths_B[b] are padding.
            lengths_B: Real prompt length per row, in [1, T].
            all_logits: Return logits at every position instead of the last real one.
            context: ``(k, v, start_B)``: every layer's cached keys and values (as prefill
                returns them, ``[B, C, K, H]`` per layer or stacked ``[L, B, C, K, H]``)
                of which row b has ``start_B[b]``; the tokens then sit at positions
                ``start_B + 0..T-1`` and attend to the cached keys as well (chunked
                prefill, prefix caching). The result equals a prefill of the whole
                sequence at those positions.

        Returns:
            (logits, k, v): logits float32 [B, V] at position lengths_B - 1, or [B, T, V]
            if ``all_logits``; k and v a tuple of per-layer [B, T, K, H] arrays (stacked
            [L, B, T, K, H] under ``layer_loop="scan"``) of the new tokens. Hand them to
            :meth:`KVCache.from_prefill` to start decoding.
        """
        b, t = tokens_BT.shape
        lengths_B = lengths_B.astype(jnp.int32)
        pos_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        ring = context is None and self._rings(t)
        if ring:  # tokens in zigzag order over sp; positions computed, not moved
            sp = active_degree("seq", Module.ATTENTION)
            with jax.named_scope(Module.ATTENTION.value):
                tokens_BT = to_zigzag(tokens_BT, ("batch", "seq"))
            pos_BT = jnp.broadcast_to(jnp.asarray(zigzag_positions(t, sp)), (b, t))
        if context is not None:
            ctx_k, ctx_v, start_B = context
            start_B = start_B.astype(jnp.int32)
            pos_BT = pos_BT + start_B[:, None]
        x_BTD = self.embed(tokens_BT, pos_BT)
        if self.scanned:
            layer_ctx = None if context is None else (ctx_k, ctx_v, start_B)
            x_BTD, k, v = self._prefill_scan(x_BTD, pos_BT, lengths_B, layer_ctx, ring)
        else:
            ks, vs = [], []
            for i, layer in enumerate(self.layers):
                ctx = None if context is None else Context(ctx_k[i], ctx_v[i], start_B)
                x_BTD, k_BTKH, v_BTKH = layer.prefill(x_BTD, pos_BT, lengths_B, ctx, i, ring=ring)
                ks.append(k_BTKH)
                vs.append(v_BTKH)
            k, v = tuple(ks), tuple(vs)
        if ring and all_logits:
            x_BTD = from_zigzag(x_BTD, BTD)
        if not all_logits:
            # take_along_axis stays local to the batch shards; an advanced index
            # x[arange(B), lengths - 1] makes XLA gather indices and rows across them.
            last_B = lengths_B - 1
            if ring:  # the last token's zigzag slot
                last_B = jnp.asarray(zigzag_slots(t, sp))[last_B]
            last_B11 = last_B[:, None, None]
            x_BTD = jnp.take_along_axis(x_BTD, last_B11, axis=1)[:, 0]  # -> x_BD
        return self.logits(x_BTD), k, v

    def _rings(self, tokens: int) -> bool:
        """Whether a prefill of ``tokens`` padded positions (no context) runs ring
        attention: the run's ``sp_attention`` for the active sp degree
        (:func:`~jaxpar.models._kernel_choice.sp_prefill_attention`); never for MLA."""
        if self.config.is_mla or active_phase() is not Phase.PREFILL:
            return False
        sp = active_degree("seq", Module.ATTENTION)
        run = self.config
        return sp_prefill_attention(run.sp_attention, sp, tokens, run.ring_min_tokens) == "ring"

    def _prefill_scan(self, x_BTD, pos_BT, lengths_B, context=None, ring=False):
        graphdef, layers_state = nnx.split(self.layers)
        # Cached keys and values ride along the scan, one layer per step.
        ctx_xs = None if context is None else (context[0], context[1])

        def body(x_BTD: jax.Array, xs):
            layer_state, kv, i = xs
            ctx = None if kv is None else Context(kv[0], kv[1], context[2])
            with count_dropped() as drops:  # a layer's MoE drops leave the scan as outputs
                x_BTD, k_BTKH, v_BTKH = nnx.merge(graphdef, layer_state).prefill(
                    x_BTD, pos_BT, lengths_B, ctx, i, ring=ring
                )
            return x_BTD, (k_BTKH, v_BTKH, self._layer_drops(drops))

        layer_ids = jnp.arange(self.config.n_layers, dtype=jnp.int32)
        xs = (layers_state, ctx_xs, layer_ids)
        x_BTD, (k_LBTKH, v_LBTKH, dropped_L) = jax.lax.scan(body, x_BTD, xs)
        self._record(dropped_L)
        return x_BTD, k_LBTKH, v_LBTKH

    def _layer_drops(self, drops: list[jax.Array]) -> jax.Array | None:
        return total_dropped(drops) if self.config.moe_capacity_factor is not None else None

    def _record(self, dropped_L: jax.Array | None) -> None:
        if dropped_L is not None:
            record_dropped(dropped_L)

    def decode(self, tokens_B: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Appends one token per row at position ``cache.lengths_B`` and predicts the next.

        Call :meth:`KVCache.check_room` (or :func:`check_room`) on the host first: a full
        row is not detected on device.

        Returns:
            (logits [B, V] float32, the cache with the new token and lengths + 1).
        """
        pos_B = cache.lengths_B
        x_B1D = self.embed(tokens_B[:, None], pos_B[:, None])
        if self.scanned:
            x_B1D, cache = self._decode_scan(x_B1D, pos_B, cache)
        else:
            # Each layer writes its own cache arrays in place (the cache is donated).
            for i, layer in enumerate(self.layers):
                x_B1D, cache = layer.decode(x_B1D, pos_B, i, cache)
        return self.logits(x_B1D[:, 0]), cache.advance()

    def _decode_scan(self, x_B1D: jax.Array, pos_B: jax.Array, cache: KVCache):
        graphdef, layers_state = nnx.split(self.layers)

        # The stacked cache rides in the scan carry; each layer writes its token in place.
        def body(carry: tuple[jax.Array, KVCache], xs: tuple[nnx.State, jax.Array]):
            x_B1D, cache = carry
            layer_state, i = xs
            with count_dropped() as drops:
                out = nnx.merge(graphdef, layer_state).decode(x_B1D, pos_B, i, cache)
            return out, self._layer_drops(drops)

        layer_ids = jnp.arange(self.config.n_layers, dtype=jnp.int32)
        (x_B1D, cache), dropped_L = jax.lax.scan(body, (x_B1D, cache), (layers_state, layer_ids))
        self._record(dropped_L)
        return x_B1D, cache


def init_params(
    config: ModelConfig | ModelRun, seed: int = 0, options: ExecutionOptions | None = None
) -> nnx.State:
    """Random parameters for tests and benchmarks, generated on the host with numpy.

    Each parameter is drawn from its own :class:`Init` metadata with a generator seeded
    by (seed, parameter path): deterministic, independent of devices and sharding, and
    free of random-kernel compilation (which dominates small-model start-up). In the
    run's layer form and dtype; with ``quantize`` set, the float model's parameters
    quantized (:func:`quantize_params`). A run with KV-head replicas gets the checkpoint's
    heads, each repeated (:mod:`jaxpar.models._kv_heads`): the same model as without.
    """
    run = ModelRun.of(config, options)
    if run.kv_head_replicas > 1:
        heads = dataclasses.replace(run, kv_head_replicas=1)
        axes = state_axes(nnx.state(abstract_model(heads)))
        params = init_params(heads, seed)
        return repeat_kv_heads(params, axes, run.config.n_kv_heads, run.kv_head_replicas)
    if run.quantize is not None:
        float_run = run.with_options(quantize=None, quantize_embeddings=False)
        return quantize_params(run, init_params(float_run, seed), run.quantize)
    loaded = []
    for path, var in nnx.to_flat_state(nnx.state(abstract_model(run))):
        want = var.get_value()
        rng = np.random.default_rng([seed, zlib.crc32("/".join(map(str, path)).encode())])
        value = var.get_metadata()["init"].host(rng, want.shape, want.dtype)
        loaded.append((path, var.replace(jnp.asarray(value))))
    return nnx.from_flat_state(loaded)


def init_model(
    config: ModelConfig | ModelRun, seed: int = 0, options: ExecutionOptions | None = None
) -> Decoder:
    """A decoder holding :func:`init_params`."""
    graphdef, _ = nnx.split(abstract_model(config, options))
    return nnx.merge(graphdef, init_params(config, seed, options))


def abstract_model(
    config: ModelConfig | ModelRun, options: ExecutionOptions | None = None
) -> Decoder:
    """The decoder with ShapeDtypeStruct parameters: shapes and logical axes, no memory.

    ``nnx.split(abstract_model(c))`` gives the graphdef to merge real states into;
    ``nnx.update(model, params)`` fills it.
    """
    run = ModelRun.of(config, options)
    return nnx.eval_shape(lambda: Decoder(run, rngs=nnx.Rngs(params=0)))


def params_layer_loop(params: nnx.State) -> str:
    """The layer form parameters are stored in: ``"unrolled"`` (``("layers", i, ...)``
    paths) or ``"scan"`` (stacked ``("layers", ...)`` arrays)."""
    for path, _ in nnx.to_flat_state(params):
        if path[0] == "layers":
            return "unrolled" if isinstance(path[1], int) else "scan"
    raise ConfigError("the parameters have no 'layers': not a jaxpar Decoder's state")


def quantize_params(config: ModelConfig | ModelRun, params: nnx.State, mode: str) -> nnx.State:
    """A float model's parameters quantized (weight-only PTQ): every kernel the quantized
    model stores with a ``_scale`` is quantized where it lies; every other parameter is
    passed through. ``config``: the model (a ``ModelConfig`` or ``ModelRun``, whose
    ``quantize_embeddings`` option quantizes the embedding and LM head too); the
    parameters' layer form is read off them.

    Raises:
        ConfigError: an unknown mode, or parameters that are already quantized.
    """
    check_quantize(mode)
    held = params_quantization(params)
    if held is not None:
        raise ConfigError(f"parameters are already quantized ({held})")
    # ``config``'s options say whether the embedding and LM head are quantized too.
    target = ModelRun.of(config).with_options(quantize=mode, layer_loop=params_layer_loop(params))
    source = dict(nnx.to_flat_state(params))
    wanted = dict(nnx.to_flat_state(nnx.state(abstract_model(target))))
    loaded = []
    for path, var in wanted.items():
        name = str(path[-1])
        if name.endswith(SCALE_SUFFIX) and (*path[:-1], name[: -len(SCALE_SUFFIX)]) in wanted:
            continue  # made with its kernel
        scale_path = (*path[:-1], name + SCALE_SUFFIX)
        value = source[path].get_value()
        if scale_path in wanted:
            scale_var = wanted[scale_path]
            value = to_stored(value, var.get_metadata().get("stored_order"))
            q, s = quantize_array(value, scale_var.get_value().shape, mode)
            loaded += [(path, var.replace(q)), (scale_path, scale_var.replace(s))]
        else:
            loaded.append((path, var.replace(value)))
    return nnx.from_flat_state(loaded)


def with_layer_loop(
    config: ModelConfig | ModelRun, params: nnx.State, layer_loop: str
) -> nnx.State:
    """The same weights with the layers stored the other way (the form they are in is read
    off the parameter tree: :func:`params_layer_loop`).

    ``"unrolled"`` -> ``"scan"`` stacks each layer parameter into ``[L, ...]``; ``"scan"``
    -> ``"unrolled"`` splits them. A one-time copy (when an engine is built), never a
    per-step one. Returns ``params`` unchanged when the form already matches.
    """
    run = ModelRun.of(config)
    if layer_loop == params_layer_loop(params):
        return params
    target = run.with_options(layer_loop=layer_loop, **held_quantization(params))
    source = dict(nnx.to_flat_state(params))
    loaded = []
    for path, var in nnx.to_flat_state(nnx.state(abstract_model(target))):
        if path[0] != "layers":
            value = source[path].get_value()
        elif layer_loop == "scan":  # ("layers", *rest) <- stack of ("layers", i, *rest)
            parts = [source[("layers", i, *path[1:])].get_value() for i in range(run.n_layers)]
            value = jnp.stack(parts)
        else:  # ("layers", i, *rest) <- row i of ("layers", *rest)
            value = source[("layers", *path[2:])].get_value()[path[1]]
        loaded.append((path, var.replace(value)))
    return nnx.from_flat_state(loaded)


def param_logical_axes(
    config: ModelConfig | ModelRun, options: ExecutionOptions | None = None
) -> nnx.State:
    """State of ``PartitionSpec`` of logical axis names, one per parameter."""
    return nnx.get_partition_spec(nnx.state(abstract_model(config, options)))


def prefill(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens_BT: jax.Array,
    lengths_B: jax.Array,
    *,
    all_logits: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Functional :meth:`Decoder.prefill` on ``nnx.split(model)`` parts (jit-able)."""
    return nnx.merge(graphdef, state).prefill(tokens_BT, lengths_B, all_logits=all_logits)


def decode(
    graphdef: nnx.GraphDef, state: nnx.State, tokens_B: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
    """Functional :meth:`Decoder.decode` on ``nnx.split(model)`` parts (jit-able)."""
    return nnx.merge(graphdef, state).decode(tokens_B, cache)
