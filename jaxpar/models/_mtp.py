"""DeepSeek-V3's multi-token-prediction layer as a draft head.

A DeepSeek-V3 checkpoint with ``num_nextn_predict_layers: n`` stores ``n`` extra layers
after its ``num_hidden_layers`` (``L``) decoder layers, under ``model.layers.{L}.``: the
norms ``enorm`` (of the next token's embedding) and ``hnorm`` (of the target's last
hidden state, after its final norm), ``eh_proj`` ``[D, 2D]`` that joins them, a decoder
block of the model's own kind (latent attention and a mixture of experts, named as the
other layers' tensors), ``shared_head.norm`` and ``shared_head.head`` ``[V, D]``, and
optionally its own ``embed_tokens`` (else the model's). As vLLM runs it
(``DeepSeekMTP``): ``h = block(eh_proj([enorm(embed(t)), hnorm(h_prev)]))``, logits
``head(norm(h))``, and each further drafting step feeds the returned ``h`` back. The
first MTP layer serves every step (vLLM cycles through ``n`` layers; checkpoints ship
one). transformers drops these tensors when it saves a model, so many exports have none:
then :func:`load_mtp` says so.

The block is jaxpar's own :class:`~jaxpar.models._decoder.DecoderLayer` (the model's
attention and MoE code), run unsharded on one device with its parameters read by the
checkpoint import's recipes for layer ``L``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.models._attention import Context
from jaxpar.models._config import ModelConfig
from jaxpar.models._decoder import DecoderLayer
from jaxpar.models._eagle3 import rms_norm
from jaxpar.models._hf import _Checkpoint, _moe_layout
from jaxpar.models._hf_layout import deepseek_recipes
from jaxpar.models._hidden_taps import HiddenTaps
from jaxpar.models._run import ModelRun


@dataclasses.dataclass(frozen=True, eq=False)
class MtpHead:
    """A loaded MTP layer (see the module)."""

    taps: HiddenTaps
    eps: float
    graphdef: Any
    params: dict[str, Any]

    def feature(self, params, features_BTF: jax.Array) -> jax.Array:
        """The target's final-normed hidden state, as it is."""
        return features_BTF

    def embed(self, params, tokens_BT: jax.Array) -> jax.Array:
        return jnp.take(params["embed"], tokens_BT, axis=0).astype(jnp.float32)

    def block(self, params, e_BTD, h_BTD, pos_BT, lengths_B, context: Context | None):
        """The layer over new tokens: returns (hidden ``[B, T, D]``, keys, values)."""
        e_BTD = jnp.where((pos_BT == 0)[..., None], 0.0, e_BTD)  # as vLLM: no token before 0
        x = jnp.concatenate(
            [
                rms_norm(e_BTD, params["enorm"], self.eps),
                rms_norm(h_BTD, params["hnorm"], self.eps),
            ],
            axis=-1,
        )
        x_BTD = (x @ params["eh_proj"]).astype(params["eh_proj"].dtype)
        layer = nnx.merge(self.graphdef, params["block"])
        return layer.prefill(x_BTD, pos_BT, lengths_B.astype(jnp.int32), context, None)

    def draft(self, params, h_BD: jax.Array) -> jax.Array:
        logits_BV = rms_norm(h_BD, params["norm"], self.eps) @ params["head"]
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)


def load_mtp(path: str | Path, target: ModelConfig) -> MtpHead:
    """The first MTP layer of the DeepSeek-V3 checkpoint in ``path`` (``target``: its
    config), float32 on the default device.

    Raises:
        ConfigError: not a DeepSeek-V3 checkpoint, or one without MTP layers (the config's
            ``num_nextn_predict_layers`` is 0, or their tensors are absent).
    """
    root = Path(path)
    where = f"speculative config: mtp from {root}"
    try:
        hf = json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: cannot read config.json: {e}") from None
    if hf.get("model_type") not in ("deepseek_v3", "deepseek_v2") or not target.is_mla:
        raise ConfigError(
            f"{where}: method 'mtp' reads DeepSeek-V3's multi-token-prediction layers; this "
            f"checkpoint is {hf.get('model_type')!r}"
        )
    n_layers = hf["num_hidden_layers"]
    if n_layers != target.n_layers:
        raise ConfigError(f"{where}: the checkpoint has {n_layers} layers, the target "
                          f"{target.n_layers}: not the target's checkpoint")  # fmt: skip
    lay = f"model.layers.{n_layers}."
    with _Checkpoint(root) as ckpt:
        if not hf.get("num_nextn_predict_layers") or lay + "eh_proj.weight" not in ckpt.shapes:
            raise ConfigError(
                f"{where}: the checkpoint carries no multi-token-prediction layer "
                f"(num_nextn_predict_layers={hf.get('num_nextn_predict_layers', 0)}, tensors "
                f"{lay}* {'absent' if lay + 'eh_proj.weight' not in ckpt.shapes else 'present'}; "
                "transformers drops them on save): use the original checkpoint, or another "
                "method"
            )
        run = ModelRun.of(dataclasses.replace(target, dtype="float32", param_dtype="float32"))
        abstract = nnx.eval_shape(lambda: DecoderLayer(run, rngs=nnx.Rngs(0), layer=n_layers))
        graphdef, state = nnx.split(abstract)
        recipes = deepseek_recipes(
            dataclasses.replace(run.config, n_layers=n_layers + 1), _moe_layout(ckpt.shapes)
        )
        read = ckpt.reader(np.float32)
        loaded = []
        for param_path, var in nnx.to_flat_state(state):
            recipe = recipes[("layers", n_layers, *param_path)]
            shape = var.get_value().shape
            value = recipe.read(tuple(slice(None) for _ in shape), read)
            loaded.append((param_path, var.replace(jnp.asarray(value, jnp.float32))))
        d = target.d_model

        def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
            if ckpt.shapes.get(name) != shape:
                got = ckpt.shapes.get(name, "missing")
                raise ConfigError(f"{where}: tensor {name!r} is {got}; expected {shape}")
            return read(name, tuple(slice(None) for _ in shape))

        v = target.vocab_size
        embed_name = lay + "embed_tokens.weight"
        if embed_name not in ckpt.shapes:
            embed_name = "model.embed_tokens.weight"
        params = {
            "block": nnx.from_flat_state(loaded),
            "enorm": jnp.asarray(tensor(lay + "enorm.weight", (d,))),
            "hnorm": jnp.asarray(tensor(lay + "hnorm.weight", (d,))),
            "eh_proj": jnp.asarray(tensor(lay + "eh_proj.weight", (d, 2 * d)).T),
            "norm": jnp.asarray(tensor(lay + "shared_head.norm.weight", (d,))),
            "head": jnp.asarray(tensor(lay + "shared_head.head.weight", (v, d)).T),
            "embed": jnp.asarray(tensor(embed_name, (v, d))),
        }
    return MtpHead(HiddenTaps(final=True), target.norms.eps, graphdef, params)
