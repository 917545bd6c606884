"""Log-probabilities of chosen tokens and their most likely alternatives, on the device.

Logprobs are of the distribution the model gives: ``log_softmax`` of the logits over the
true vocabulary, before penalties, temperature, top-k and top-p (vLLM's default "raw"
logprobs). A step computes them for its rows where some row asks (``lax.cond``): the
chosen token's logprob and the :data:`MAX_TOP_LOGPROBS` most likely tokens, a compiled
constant that the host slices to what each request asked for; rows that do not ask cost
a masked gather, and the host reads the arrays back only when some row asked.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.engine._vocab import VocabSplit

#: The most alternatives a request can ask for (OpenAI's bound), and what a step computes.
MAX_TOP_LOGPROBS = 20
#: What an impossible token's logprob is reported as (JSON has no infinity), as vLLM does.
FLOOR = -9999.0


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob and the most likely tokens at its position, most likely first
    (as many as the request asked for)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@flax.struct.dataclass
class Logprobs:
    """Device arrays with any leading shape ``x``: the chosen tokens' logprobs ``[x]``, the
    ids and logprobs of the most likely tokens ``[x, K]``."""

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array

    @classmethod
    def of(
        cls, logits_xV: jax.Array, chosen_x: jax.Array, split: VocabSplit | None = None
    ) -> Logprobs:
        """Of ``logits_xV`` (padded ids at ``-inf``) for tokens ``chosen_x`` (traced).

        ``split``: how ``[B, V]`` logits are split over the vocabulary: the most likely
        tokens are then each shard's own first, merged (an exchange of ``[B, shards, K]``,
        not of the vocabulary); the log-sum-exp is a per-row reduction."""
        lp_xV = jax.nn.log_softmax(logits_xV.astype(jnp.float32), axis=-1)
        # A one-hot select, not take_along_axis: that gather makes XLA's SPMD partitioner
        # abort (a CHECK) inside a pipeline stage's pp-manual shard_map with dp and tp > 1.
        # Exact: every other entry adds 0.
        at_V = jnp.arange(lp_xV.shape[-1]) == chosen_x[..., None]
        chosen = jnp.sum(jnp.where(at_V, lp_xV, 0.0), axis=-1)
        k = min(MAX_TOP_LOGPROBS, lp_xV.shape[-1])
        if split is not None and lp_xV.ndim == 2:
            top, top_ids = split.top_k(lp_xV, k)
        else:
            top, top_ids = jax.lax.top_k(lp_xV, k)
        return cls(chosen, top_ids.astype(jnp.int32), top)

    @classmethod
    def zeros(cls, shape: tuple[int, ...], vocab: int) -> Logprobs:
        k = min(MAX_TOP_LOGPROBS, vocab)
        return cls(
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, k), jnp.int32),
            jnp.zeros((*shape, k), jnp.float32),
        )

    @classmethod
    def for_rows(
        cls,
        logits_BV: jax.Array,
        chosen_B: jax.Array,
        wants_B: jax.Array,
        split: VocabSplit | None = None,
    ) -> Logprobs:
        """:meth:`of` where some row ``wants_B`` them, else zeros (traced)."""

        def none() -> Logprobs:
            zeros = cls.zeros(chosen_B.shape, logits_BV.shape[-1])
            # Typed as the logits vary (inside a pipeline stage: over ``pp``), as ``of``'s are.
            varying = tuple(sorted(jax.typeof(logits_BV).manual_axis_type.varying))
            if not varying:
                return zeros
            return jax.tree.map(lambda z: jax.lax.pcast(z, varying, to="varying"), zeros)

        return jax.lax.cond(jnp.any(wants_B), lambda: cls.of(logits_BV, chosen_B, split), none)

    def host(self) -> Logprobs:
        """The same as NumPy arrays (one device-to-host read)."""
        return jax.tree.map(np.asarray, jax.device_get(self))

    def entry(self, index, token: int, n: int) -> TokenLogprob:
        """Host arrays' entry at ``index`` for ``token``, with the ``n`` most likely."""
        top = [
            (int(i), _finite(lp))
            for i, lp in zip(self.top_ids[index][:n], self.top[index][:n], strict=True)
        ]
        return TokenLogprob(int(token), _finite(self.chosen[index]), tuple(top))


def _finite(logprob) -> float:
    return max(float(logprob), FLOOR)
