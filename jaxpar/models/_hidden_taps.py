"""The target's hidden states that a speculative head reads, from a prefill over context.

EAGLE-3 heads read the residual stream at three layers of the target (low, middle, high:
``eagle_aux_hidden_state_layer_ids``, or vLLM's default ``(2, L // 2, L - 3)``); DeepSeek's
multi-token-prediction layers read the target's last hidden state after its final norm.
:class:`HiddenTaps` names which; :func:`prefill_with_taps` is
:meth:`Decoder.prefill <jaxpar.models.Decoder.prefill>`'s pass over cached context
(every position's logits) that also returns them, concatenated per position. It is a
function of its own so that the plain prefill and decode programs stay as they are: only
a verification step that asks for taps traces it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.models._attention import Context
from jaxpar.models._moe_stats import count_dropped


@dataclasses.dataclass(frozen=True)
class HiddenTaps:
    """Which hidden states a head reads.

    Attributes:
        layers: residual streams at the *input* of these layers (vLLM's convention:
            ``hidden_states + residual`` before layer ``i``); ``n_layers`` names the last
            layer's output (before the final norm).
        final: also the last hidden state after the final norm (what DeepSeek's MTP
            layers take as the previous hidden state).
    """

    layers: tuple[int, ...] = ()
    final: bool = False

    def check(self, n_layers: int, where: str) -> None:
        """Raises :class:`ConfigError` (naming ``where``) for a layer the model lacks."""
        bad = [i for i in self.layers if not 0 <= i <= n_layers]
        if bad or not (self.layers or self.final):
            raise ConfigError(
                f"{where}: hidden-state layers {list(self.layers)} must be in [0, {n_layers}] "
                f"(the target has {n_layers} layers) and at least one must be read"
            )

    def width(self, d_model: int) -> int:
        """Features per position: ``d_model`` per tap."""
        return d_model * (len(self.layers) + int(self.final))


def prefill_with_taps(model, tokens_BT, lengths_B, context, taps: HiddenTaps):
    """``model.prefill(tokens_BT, lengths_B, all_logits=True, context=context)`` (a
    :class:`~jaxpar.models.Decoder`, unpipelined, no ring attention: the verification
    step's pass) plus the tapped hidden states ``[B, T, F]`` (float32, in ``taps``'s
    order, the final-normed one last). Returns (logits, k, v, features)."""
    b, t = tokens_BT.shape
    ctx_k, ctx_v, start_B = context
    start_B = start_B.astype(jnp.int32)
    lengths_B = lengths_B.astype(jnp.int32)
    pos_BT = jnp.arange(t, dtype=jnp.int32)[None, :] + start_B[:, None]
    x_BTD = model.embed(tokens_BT, pos_BT)
    n_layers = model.config.n_layers
    if model.scanned:
        x_BTD, k, v, inputs_LBTD = _scan_taps(model, x_BTD, pos_BT, lengths_B, context)
        streams = [inputs_LBTD[i] if i < n_layers else x_BTD for i in taps.layers]
    else:
        inputs, ks, vs = [], [], []
        for i, layer in enumerate(model.layers):
            inputs.append(x_BTD)
            ctx = Context(ctx_k[i], ctx_v[i], start_B)
            x_BTD, k_BTKH, v_BTKH = layer.prefill(x_BTD, pos_BT, lengths_B, ctx, i)
            ks.append(k_BTKH)
            vs.append(v_BTKH)
        k, v = tuple(ks), tuple(vs)
        streams = [inputs[i] if i < n_layers else x_BTD for i in taps.layers]
    if taps.final:
        streams.append(model.final_norm(x_BTD))
    features_BTF = jnp.concatenate([s.astype(jnp.float32) for s in streams], axis=-1)
    return model.logits(x_BTD), k, v, features_BTF


def _scan_taps(model, x_BTD, pos_BT, lengths_B, context):
    """The stacked layers under ``lax.scan``, each layer's input kept (``[L, B, T, D]``)."""
    graphdef, layers_state = nnx.split(model.layers)
    start_B = context[2].astype(jnp.int32)

    def body(x_BTD, xs):
        layer_state, kv, i = xs
        ctx = Context(kv[0], kv[1], start_B)
        with count_dropped() as drops:
            y_BTD, k_BTKH, v_BTKH = nnx.merge(graphdef, layer_state).prefill(
                x_BTD, pos_BT, lengths_B, ctx, i
            )
        return y_BTD, (k_BTKH, v_BTKH, x_BTD, model._layer_drops(drops))

    layer_ids = jnp.arange(model.config.n_layers, dtype=jnp.int32)
    xs = (layers_state, (context[0], context[1]), layer_ids)
    x_BTD, (k_L, v_L, inputs_LBTD, dropped_L) = jax.lax.scan(body, x_BTD, xs)
    model._record(dropped_L)
    return x_BTD, k_L, v_L, inputs_LBTD
