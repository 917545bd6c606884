"""An EAGLE-3 draft head (Li et al., 2025), in the checkpoint layout vLLM and SGLang load.

A head directory holds ``config.json`` (a Llama config, ``architectures``
``LlamaForCausalLMEagle3``, with ``draft_vocab_size``, optionally ``target_hidden_size``,
``eagle_aux_hidden_state_layer_ids`` at the top level or in ``eagle_config``, and
``norm_before_residual``) and safetensors weights:

* ``fc.weight`` ``[H, 3 * H_target]``: the three tapped target hidden states to one;
* ``midlayer.*`` (or ``layers.0.*``): one Llama decoder layer whose attention reads the
  normed token embedding and the normed hidden state side by side (``q/k/v_proj``
  ``[., 2H]``), with ``input_layernorm``, ``hidden_norm``, ``post_attention_layernorm``
  and a SwiGLU ``mlp``;
* ``norm.weight``, ``lm_head.weight`` ``[V_draft, H]``;
* ``d2t`` ``[V_draft]``: draft id ``i`` is target id ``i + d2t[i]`` (absent: the same
  vocabulary); ``t2d`` is not needed and ignored;
* ``embed_tokens.weight`` when the head has its own, else the target's embedding.

A ``model.`` prefix on every name is accepted. The head's forward is vLLM's
``Eagle3LlamaForCausalLM``: ``h = fc(taps)``; the layer's residual is ``h`` (or the
normed ``h`` with ``norm_before_residual``); it returns the pre-norm hidden state, which
feeds the next drafting step, and the logits are ``lm_head(norm(h))``. The layer's RoPE
is the head config's (``rope_theta``, ``rope_scaling``). Parameters are float32 on one
device. Safetensors only: a ``pytorch_model.bin`` head must be converted first.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.models._attention import Context
from jaxpar.models._config import ModelConfig
from jaxpar.models._hf_config import _rope
from jaxpar.models._hidden_taps import HiddenTaps
from jaxpar.models._rope import apply_rope, rope_inv_freq

#: The architectures a head's config.json may name.
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")


def rms_norm(x_xD: jax.Array, w_D: jax.Array, eps: float) -> jax.Array:
    """Llama's RMSNorm in float32."""
    x = x_xD.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w_D


def default_aux_layers(n_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 taps for a Llama target: low, middle, high."""
    return (2, n_layers // 2, n_layers - 3)


def causal_attention(q_BTNH, k_BTKH, v_BTKH, pos_BT, lengths_B, context: Context | None):
    """Grouped-query attention of ``T`` new tokens over ``context`` (row b's first
    ``start_B[b]`` entries, all earlier) and themselves (causal, the first ``lengths_B``
    real); float32."""
    b, t, n, h = q_BTNH.shape
    kv = k_BTKH.shape[2]
    new_T = jnp.arange(t)
    valid_BS = (new_T[None, :] < lengths_B[:, None])[:, None, :] & (
        pos_BT[:, None, :] <= pos_BT[:, :, None]
    )  # [B, T, S]
    keys, values = k_BTKH, v_BTKH
    if context is not None:
        c = context.k_BCKH.shape[1]
        ctx_B1C = (jnp.arange(c)[None, :] < context.start_B[:, None])[:, None, :]
        valid_BS = jnp.concatenate([jnp.broadcast_to(ctx_B1C, (b, t, c)), valid_BS], axis=-1)
        keys = jnp.concatenate([context.k_BCKH, k_BTKH], axis=1)
        values = jnp.concatenate([context.v_BCKH, v_BTKH], axis=1)
    q_BTKGH = q_BTNH.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, keys) * (h**-0.5)
    scores = jnp.where(valid_BS[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(jnp.isnan(probs), 0.0, probs)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, values)
    return out.reshape(b, t, n * h)


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle3Head:
    """A loaded EAGLE-3 head (see the module): static shapes and its parameters."""

    taps: HiddenTaps
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    norm_before_residual: bool
    inv_freq: np.ndarray
    params: dict[str, Any]

    def feature(self, params, features_BTF: jax.Array) -> jax.Array:
        """The target's tapped states ``[B, T, 3 H_t]`` -> the layer's hidden input."""
        return features_BTF @ params["fc"]

    def embed(self, params, tokens_BT: jax.Array) -> jax.Array:
        return jnp.take(params["embed"], tokens_BT, axis=0).astype(jnp.float32)

    def block(self, params, e_BTD, h_BTD, pos_BT, lengths_B, context: Context | None):
        """The midlayer over new tokens (embeddings ``e``, hidden inputs ``h``): returns
        (pre-norm hidden ``[B, T, H]``, their keys, values)."""
        p = params["layer"]
        b, t, _ = e_BTD.shape
        hd, n, kv = self.head_dim, self.n_heads, self.n_kv_heads
        e = rms_norm(e_BTD, p["input_layernorm"], self.eps)
        normed = rms_norm(h_BTD, p["hidden_norm"], self.eps)
        residual = normed if self.norm_before_residual else h_BTD
        x = jnp.concatenate([e, normed], axis=-1)
        q = apply_rope((x @ p["q_proj"]).reshape(b, t, n, hd), pos_BT, self.inv_freq)
        k = apply_rope((x @ p["k_proj"]).reshape(b, t, kv, hd), pos_BT, self.inv_freq)
        v = (x @ p["v_proj"]).reshape(b, t, kv, hd)
        attn = causal_attention(q, k, v, pos_BT, lengths_B, context) @ p["o_proj"]
        residual = residual + attn
        x = rms_norm(residual, p["post_attention_layernorm"], self.eps)
        mlp = (jax.nn.silu(x @ p["gate_proj"]) * (x @ p["up_proj"])) @ p["down_proj"]
        return residual + mlp, k, v

    def draft(self, params, h_BD: jax.Array) -> jax.Array:
        """The head's argmax at each row, as a target token id."""
        logits_BV = rms_norm(h_BD, params["norm"], self.eps) @ params["lm_head"]
        best_B = jnp.argmax(logits_BV, axis=-1)
        return (best_B + params["d2t"][best_B]).astype(jnp.int32)


_LAYER = {
    "input_layernorm": "input_layernorm.weight",
    "hidden_norm": "hidden_norm.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}


def read_tensors(root: Path, where: str) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors files under ``root`` (names without a leading
    ``model.``)."""
    files = sorted(root.glob("*.safetensors"))
    if not files:
        other = [f.name for f in root.glob("*.bin")] + [f.name for f in root.glob("*.pt")]
        hint = f" ({other[0]}: convert it to safetensors first)" if other else ""
        raise CheckpointError(f"{where}: no *.safetensors files in {root}{hint}")
    out = {}
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    out[name.removeprefix("model.")] = f.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{where}: unreadable safetensors file {file}: {e}") from None
    return out


def _config(root: Path, where: str) -> dict[str, Any]:
    try:
        return json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: cannot read {root / 'config.json'}: {e}") from None


def load_eagle3(path: str | Path, target: ModelConfig, target_embed: Callable) -> Eagle3Head:
    """The head in ``path`` for ``target`` (whose token table ``target_embed()`` ``[V, D]``
    it uses when it has none), its parameters on the default device.

    Raises:
        ConfigError: a config that does not fit the target (hidden size, vocabulary, tapped
            layers) or is not an EAGLE-3 head.
        CheckpointError: missing or mis-shaped tensors.
    """
    root = Path(path)
    where = f"speculative config: eagle3 head {root}"
    hf = _config(root, where)
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{where}: architecture {arch!r} is not an EAGLE-3 head; legal: "
                          f"{list(ARCHITECTURES)}")  # fmt: skip
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError(f"{where}: only a SiLU head without biases is supported")
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    kv, hd = hf.get("num_key_value_heads", n), hf.get("head_dim") or d // n
    target_d = hf.get("target_hidden_size", d)
    vocab, draft_vocab = hf["vocab_size"], hf.get("draft_vocab_size") or hf["vocab_size"]
    if target_d != target.d_model or vocab != target.vocab_size:
        raise ConfigError(
            f"{where}: made for a target with hidden size {target_d} and vocabulary {vocab}; "
            f"this target has {target.d_model} and {target.vocab_size}"
        )
    eagle = hf.get("eagle_config") or {}
    layers = hf.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    taps = HiddenTaps(tuple(layers or default_aux_layers(target.n_layers)))
    taps.check(target.n_layers, where)
    theta, scaling = _rope(hf, str(root / "config.json"))
    tensors = read_tensors(root, where)
    layer_prefix = "midlayer." if any(k.startswith("midlayer.") for k in tensors) else "layers.0."
    want = {
        "fc": ("fc.weight", (d, taps.width(target_d))),
        "norm": ("norm.weight", (d,)),
        "lm_head": ("lm_head.weight", (draft_vocab, d)),
    }
    q_in = 2 * d
    shapes = {
        "input_layernorm": (d,), "hidden_norm": (d,), "post_attention_layernorm": (d,),
        "q_proj": (n * hd, q_in), "k_proj": (kv * hd, q_in), "v_proj": (kv * hd, q_in),
        "o_proj": (d, n * hd), "gate_proj": (hf["intermediate_size"], d),
        "up_proj": (hf["intermediate_size"], d), "down_proj": (d, hf["intermediate_size"]),
    }  # fmt: skip
    for key, name in _LAYER.items():
        want[f"layer.{key}"] = (layer_prefix + name, shapes[key])
    params: dict[str, Any] = {"layer": {}}
    for key, (name, shape) in want.items():
        arr = tensors.get(name)
        if arr is None or tuple(arr.shape) != shape:
            got = "missing" if arr is None else f"shape {tuple(arr.shape)}"
            raise CheckpointError(f"{where}: tensor {name!r} {got}; expected shape {shape}")
        arr = np.asarray(arr, np.float32)
        arr = arr.T if arr.ndim == 2 else arr  # torch Linear [out, in] -> x @ W
        if key.startswith("layer."):
            params["layer"][key[6:]] = jnp.asarray(arr)
        else:
            params[key] = jnp.asarray(arr)
    d2t = tensors.get("d2t")
    d2t = np.zeros(draft_vocab, np.int64) if d2t is None else np.asarray(d2t, np.int64)
    mapped = np.arange(draft_vocab) + d2t if d2t.shape == (draft_vocab,) else None
    if mapped is None or not ((mapped >= 0) & (mapped < vocab)).all():
        raise CheckpointError(f"{where}: d2t must map {draft_vocab} draft ids into [0, {vocab})")
    params["d2t"] = jnp.asarray(d2t, jnp.int32)
    embed = tensors.get("embed_tokens.weight")
    params["embed"] = jnp.asarray(
        np.asarray(target_embed() if embed is None else embed, np.float32)[:vocab]
    )
    return Eagle3Head(
        taps=taps,
        n_heads=n,
        n_kv_heads=kv,
        head_dim=hd,
        eps=float(hf.get("rms_norm_eps", 1e-5)),
        norm_before_residual=bool(hf.get("norm_before_residual", False)),
        inv_freq=rope_inv_freq(hd, theta, scaling),
        params=params,
    )
