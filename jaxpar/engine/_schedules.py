"""What a step runs inside, per strategy: the plain model, or the pipeline schedule.

:class:`~jaxpar.engine._steps.Steps` writes every entry point once and calls one of these
for the traced body. Both offer the same methods; the pipelined one (``pp > 1``) runs the
schedules of :mod:`jaxpar.engine._pipeline` and keeps what leaves the last stage
stage-major (``[P, ...]`` on ``pp``, meaningful at ``P - 1``): tokens chained from step to
step reach stage 0 by a collective-permute (``roll``) at the start of the next program, and
:meth:`Pipelined.host_batch` reads the last stage's row on the host, so no program moves
data across stages any other way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.engine import _pipeline as pipeline
from jaxpar.engine._pipeline_stages import Stages
from jaxpar.engine._placement import put_global, to_host
from jaxpar.engine._sampling import Sampling, select
from jaxpar.engine._vocab import VocabSplit, mask_padded
from jaxpar.models import Decoder, KVCache
from jaxpar.spec import Module, Phase

DECODE, EMBEDDING = Phase.DECODE, Module.EMBEDDING


@dataclasses.dataclass(frozen=True)
class Pick:
    """How a step picks tokens: :func:`select` over the true vocabulary (padded ids masked)."""

    key: jax.Array
    sampling: Sampling
    vocab_size: int
    #: How the logits are split over the vocabulary (unpipelined; whole inside a stage).
    split: VocabSplit = VocabSplit()

    def __call__(self, logits_BV: jax.Array) -> jax.Array:
        logits_BV = mask_padded(logits_BV, self.vocab_size)
        return select(logits_BV, self.key, self.sampling, self.split)


@dataclasses.dataclass(frozen=True)
class Unpipelined:
    """The model's own prefill and decode (``pp = 1``); results are ``[B, ...]``."""

    def prefill(self, model: Decoder, tokens_BT, lengths_B, all_logits: bool, context=None):
        return model.prefill(tokens_BT, lengths_B, all_logits=all_logits, context=context)

    def first_tokens(self, logits_BV: jax.Array, pick: Pick) -> jax.Array:
        return pick(logits_BV)

    def decode(self, model: Decoder, cache: KVCache, tokens_B: jax.Array):
        return model.decode(tokens_B, cache)

    def decode_tokens(self, model: Decoder, cache: KVCache, tokens_B: jax.Array, pick: Pick):
        logits_BV, cache = model.decode(tokens_B, cache)
        return pick(logits_BV), cache

    def all_done(self, done_B: jax.Array) -> jax.Array:
        return jnp.all(done_B)

    def host_batch(self, x: jax.Array) -> np.ndarray:
        return to_host(x)

    def to_batch(self, x: jax.Array) -> jax.Array:
        return x


def group_sampler(
    key: jax.Array, sampling: Sampling, groups: int, vocab: int
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """``(logits [Bg, V], g) -> tokens [Bg]`` for group ``g``, as unpipelined ``select`` draws.

    Random draws depend on a row's place in the whole batch (partitionable threefry over
    ``[B, V]``), so a sampled group is placed into a ``[B, V]`` array before drawing: the
    tokens then equal the unpipelined ones for the same seed. Greedy needs no such care.
    """

    def sample(logits_BgV: jax.Array, g: jax.Array) -> jax.Array:
        if sampling.greedy or groups == 1:
            return select(logits_BgV, key, sampling)
        bg = logits_BgV.shape[0]
        full_BgGV = jnp.zeros((bg, groups, vocab), logits_BgV.dtype).at[:, g].set(logits_BgV)
        tokens_BgG = select(full_BgGV.reshape(bg * groups, vocab), key, sampling)
        return tokens_BgG.reshape(bg, groups)[:, g]

    return sample


@dataclasses.dataclass(frozen=True)
class Pipelined:
    """GPipe prefill and group-filled decode over ``stages``; results are ``[P, B, ...]``."""

    stages: Stages
    microbatches: int
    groups: int

    def prefill(self, model: Decoder, tokens_BT, lengths_B, all_logits: bool, context=None):
        return pipeline.prefill(
            model,
            tokens_BT,
            lengths_B,
            self.stages,
            microbatches=self.microbatches,
            all_logits=all_logits,
            context=context,
        )

    def first_tokens(self, logits_PBV: jax.Array, pick: Pick) -> jax.Array:
        # Every stage samples its own row of logits; stage P-1's row is the real one.
        return self.stages.map(lambda _, logits_BV: pick(logits_BV))(logits_PBV)

    def _step(self, model, cache, tokens_PB, emit, emitted, emitted_axes):
        """One pipelined decode step; row 0 of ``tokens_PB`` holds the tokens to append."""
        return pipeline.decode(
            model,
            cache,
            tokens_PB,
            self.stages,
            groups=self.groups,
            emit=emit,
            emitted=emitted,
            emitted_axes=emitted_axes,
        )

    def decode(self, model: Decoder, cache: KVCache, tokens_B: jax.Array):
        """Tokens ``[B]`` replicated over ``pp``; logits ``[P, B, V]`` out."""
        p, b = self.stages.count, tokens_B.shape[0]
        tokens_PB = self.stages.constrain(
            jnp.broadcast_to(tokens_B, (p, b)), ("batch",), EMBEDDING, DECODE
        )
        vocab = model.config.vocab_size
        emitted = jax.ShapeDtypeStruct((b // self.groups, vocab), jnp.float32)
        return self._step(model, cache, tokens_PB, lambda lg, g: lg, emitted, ("batch", "vocab"))

    def decode_tokens(self, model: Decoder, cache: KVCache, tokens_PB: jax.Array, pick: Pick):
        """Chained step: ``tokens_PB`` as the last stage left them (row P-1)."""
        b = tokens_PB.shape[1]
        sample = group_sampler(pick.key, pick.sampling, self.groups, model.config.vocab_size)

        def emit(logits_BgV, g):
            return sample(mask_padded(logits_BgV, pick.vocab_size), g)

        emitted = jax.ShapeDtypeStruct((b // self.groups,), jnp.int32)
        # The roll is the one collective-permute that brings them to stage 0.
        return self._step(model, cache, jnp.roll(tokens_PB, 1, axis=0), emit, emitted, ("batch",))

    def all_done(self, done_PB: jax.Array) -> jax.Array:
        # Only the last stage's row is real. Reducing it is the loop's one scalar all-reduce
        # (the unpipelined loop reduces over the batch axes the same way).
        p = done_PB.shape[0]
        last_P1 = (jnp.arange(p) == p - 1)[:, None]
        return jnp.all(done_PB | ~last_P1)

    def host_batch(self, x_P: jax.Array) -> np.ndarray:
        """The last stage's row of a stage-major result, read to the host.

        Only the shards held by last-stage devices are transferred (each distinct one once);
        a result spread over other processes is gathered whole first.
        """
        last = self.stages.count - 1
        if not x_P.is_fully_addressable:
            return to_host(x_P)[last]
        out = np.empty(x_P.shape[1:], x_P.dtype)
        seen = set()
        for shard in x_P.addressable_shards:
            rows = range(*shard.index[0].indices(x_P.shape[0]))
            where = tuple((s.start, s.stop) for s in shard.index[1:])
            if last in rows and where not in seen:
                seen.add(where)
                out[shard.index[1:]] = np.asarray(shard.data)[rows.index(last)]
        return out

    def to_batch(self, x_P: jax.Array) -> jax.Array:
        """The last stage's row as an array laid out like the unpipelined result."""
        target = NamedSharding(self.stages.mesh, PartitionSpec(*x_P.sharding.spec[1:]))
        return put_global(self.host_batch(x_P), target)
