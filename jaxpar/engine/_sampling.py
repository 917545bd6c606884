"""Next-token selection from (possibly vocab-sharded) logits: greedy, temperature, top-k, top-p."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the next token is chosen. ``temperature=0`` is greedy (argmax).

    Sampling is reproducible: the key of step ``i`` is ``fold_in(PRNGKey(seed), i)`` and
    JAX's partitionable threefry gives the same bits whatever the sharding.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature == 0 and (self.top_k is not None or self.top_p is not None):
            raise ConfigError("top_k / top_p need temperature > 0 (temperature 0 is greedy)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def select(logits_BV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """The next token per row (int32 [B]). Traced inside the decode step."""
    logits_BV = logits_BV.astype(jnp.float32)
    if sampling.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / sampling.temperature
    if sampling.top_k is not None:
        k = min(sampling.top_k, logits_BV.shape[-1])
        kth_B1 = jax.lax.top_k(logits_BV, k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if sampling.top_p is not None:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass
        # before it is still below top_p (the top token always stays).
        before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        kept = jnp.where(before_BV < sampling.top_p, sorted_BV, jnp.inf)
        cutoff_B1 = jnp.min(kept, axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)
    return _gumbel_argmax(key, logits_BV)


def _gumbel_argmax(key: jax.Array, logits_BV: jax.Array) -> jax.Array:
    """A categorical draw per row, as ``jax.random.categorical`` (argmax of logits + Gumbel
    noise), with row ``b``'s noise drawn from ``fold_in(key, b)`` over ``[V]``: the draw for
    token ``v`` depends on neither the batch size nor the vocabulary length, so a vocabulary
    padded for tp (padded ids at -inf) samples the same tokens as the unpadded one."""
    vocab = logits_BV.shape[-1:]
    rows_B = jnp.arange(logits_BV.shape[0], dtype=jnp.int32)
    noise_BV = jax.vmap(lambda b: jax.random.gumbel(jax.random.fold_in(key, b), vocab))(rows_B)
    return jnp.argmax(logits_BV + noise_BV, axis=-1).astype(jnp.int32)
