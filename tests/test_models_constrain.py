"""Which logical axes the model constrains its activations to (traced, nothing compiled)."""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxpar.models import (
    ExecutionOptions,
    KVCache,
    _attention,
    _cache,
    _layers,
    _moe,
    abstract_model,
    preset,
)
from jaxpar.spec._enums import LOGICAL_AXES

LEGAL = set(LOGICAL_AXES) | {"expert_batch", None}


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Replaces ``constrain`` in every model module by a recorder of (module, axes)."""
    calls: Counter = Counter()

    def record(x: jax.Array, axes, module):
        assert len(axes) == x.ndim, (axes, x.shape)
        assert set(axes) <= LEGAL, axes
        calls[(str(module), tuple(axes))] += 1
        return x

    for mod in (_attention, _cache, _layers, _moe):
        monkeypatch.setattr(mod, "constrain", record)
    return calls


def _trace(name: str, layer_loop: str | None = None) -> None:
    """Abstractly evaluates prefill, the cache handoff and one decode step."""
    options = ExecutionOptions(layer_loop=layer_loop or "unrolled")
    graphdef, state = nnx.split(abstract_model(preset(name), options))

    def run(state, tokens_BT, lengths_B):
        model = nnx.merge(graphdef, state)
        _, k, v = model.prefill(tokens_BT, lengths_B)
        cache = KVCache.from_prefill(k, v, lengths_B, 16)
        return model.decode(tokens_BT[:, 0], cache)

    jax.eval_shape(run, state, jnp.ones((2, 8), jnp.int32), jnp.full((2,), 8, jnp.int32))


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
def test_attention_and_cache_axes(recorded: Counter, layer_loop: str) -> None:
    _trace("tiny-gqa", layer_loop)
    # The decode cache: per layer [B, K, S, H], or stacked [L, B, S, K, H] (scan).
    cache_axes = (
        ("batch", "kv_heads", "cache_seq", "head_dim")
        if layer_loop == "unrolled"
        else ("layers", "batch", "cache_seq", "kv_heads", "head_dim")
    )
    want = {
        ("embedding", ("batch", "seq", "embed")),
        ("attention", ("batch", "seq", "embed")),
        ("attention", ("batch", "seq", "heads", "head_dim")),
        # Prefill scores see every key position; the cache copy is sharded like the cache.
        ("attention", ("batch", None, "kv_heads", "head_dim")),
        ("attention", ("batch", "cache_seq", "kv_heads", "head_dim")),
        ("attention", cache_axes),
        ("ffn", ("batch", "seq", "embed")),
        ("ffn", ("batch", "seq", "mlp")),
        ("lm_head", ("batch", "embed")),
        ("lm_head", ("batch", "vocab")),
    }
    assert want <= set(recorded), want - set(recorded)


def test_moe_token_axes(recorded: Counter) -> None:
    """The MoE constrains only its token activations; the dispatch runs per device inside
    a shard_map (its buffers are local, ``tests/test_models_moe.py``)."""
    _trace("tiny-moe")
    moe = {axes for module, axes in recorded if module == "moe"}
    assert moe == {("batch", "seq", "embed")}
    assert not any(module == "ffn" for module, _ in recorded)
