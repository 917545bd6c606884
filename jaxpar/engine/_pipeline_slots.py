"""The serving decode step through pipeline stages: decode groups over the paged pool.

Continuous batching with ``pp > 1`` keeps the page pool stacked ``[L, K, A, Z, H]`` with
its layers over ``pp``, as the offline stage caches are: each stage holds its own layers'
pages, and a row's pages have the same ids in every stage. One decode step splits the
rows it computes into ``G`` groups (group ``g``: the rows ``r % G == g``, so every batch
shard holds an equal share of each group) and runs :func:`~._pipeline.run_schedule`
over them: at iteration ``i`` stage ``s`` runs group ``i - s`` through its layers, writing
the group's new token into its own pages (:class:`~jaxpar.models.PagedKVCache` over the
stage's ``[Lp, ...]`` block), and hands its activations to the next stage with one
collective-permute. The last stage turns each finished group into logits and draws its
tokens there (the ``draw`` of :meth:`SlotPipeline.step`), so logits never leave it; only the sampled tokens and
their logprobs leave, and the next step embeds them on stage 0.

A stage in a bubble (the fill and the drain, ``P - 1`` of the ``G + P - 1`` iterations)
computes on a placeholder and writes its shard's scratch page, never read:
:func:`bubble_fraction` is the share of stage-iterations a step spends so. The
scheduler never sees a stage: it plans rows and pages, and every step gives every
computed row its next token, exactly as the unpipelined step does.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.engine._pipeline import BTD, run_schedule, stage_slot
from jaxpar.engine._pipeline_stages import Blocks, Stages, stage_layer
from jaxpar.errors import ConfigError
from jaxpar.models import SCRATCH_PAGE, Decoder, ModelConfig, PagedKVCache, kv_groups
from jaxpar.spec import Module, Phase

DECODE = Phase.DECODE
ATTENTION, EMBEDDING, LM_HEAD = Module.ATTENTION, Module.EMBEDDING, Module.LM_HEAD
#: Decode groups per stage when the strategy names none (``decode_groups=1``): with
#: ``G = 2 P`` groups a step idles ``(P - 1) / (3 P - 1)`` of its stage-iterations (pp=2:
#: 20%). More groups idle less but cost more: each group is one more pass of every stage
#: (its weights read again, its LM head and draw run again); on 4 simulated CPU devices
#: pp2.tp2 took 24 ms a step with 4 groups and 62 ms with 8 (``bench_serving --sections pp``).
GROUPS_PER_STAGE = 2


def bubble_fraction(stages: int, groups: int) -> float:
    """Idle share of a step's stage-iterations: ``(P - 1) / (G + P - 1)``."""
    return (stages - 1) / (groups + stages - 1)


def by_group(x_R: jax.Array, groups: int) -> jax.Array:
    """``[R, ...] -> [R / G, G, ...]``: group ``g`` is ``[:, g]`` (a local reshape: the
    batch sharding stays on the major dim)."""
    return x_R.reshape(x_R.shape[0] // groups, groups, *x_R.shape[1:])


def paged_stage(
    s, state_Lp, x_Rg1D, x_emb_RgG1D, k_Lp, v_Lp, *, i, graphdef, pos_RgG, tables_RgGN, lp
):
    """Stage ``s`` at iteration ``i``: its ``lp`` layers on its group's rows, their new
    token written into the stage's own pages (in a bubble: the scratch page)."""
    g_count = pos_RgG.shape[1]
    read, write = stage_slot(i, s, g_count)
    x_Rg1D = jnp.where(s == 0, x_emb_RgG1D[:, read], x_Rg1D)
    busy = write < g_count
    pos_Rg = jnp.where(busy, pos_RgG[:, read], 0)
    tables_RgN = jnp.where(busy, tables_RgGN[:, read], SCRATCH_PAGE)
    cache = PagedKVCache(k=k_Lp, v=v_Lp, block_tables_BN=tables_RgN, lengths_B=pos_Rg)

    def layer(j, carry):
        x_Rg1D, cache = carry
        block = nnx.merge(graphdef, stage_layer(state_Lp, j))
        return block.decode(x_Rg1D, pos_Rg, j, cache, s * lp + j)

    x_Rg1D, cache = jax.lax.fori_loop(0, lp, layer, (x_Rg1D, cache))
    return x_Rg1D, Blocks(cache.k), Blocks(cache.v)


def paged_head(s, x_Rg1D, out, *, i, model: Decoder, groups: int, draw):
    """The last stage's draw for the group stage ``s`` finished at iteration ``i``
    (meaningful at ``P - 1``); ``out`` leaves are ``[Rg, G, ...]``."""
    read, write = stage_slot(i, s, groups)
    got = draw(model.logits(x_Rg1D[:, 0]), read)
    return jax.tree.map(lambda o, y: o.at[:, write].set(y, mode="drop"), out, got)


def paged_decode(
    model: Decoder,
    stages: Stages,
    *,
    groups: int,
    tokens_R: jax.Array,
    pos_R: jax.Array,
    tables_RN: jax.Array,
    k,
    v,
    draw: Callable,
    drawn: object,
):
    """One pipelined decode step over ``R`` rows in ``groups`` groups.

    Args:
        model: the decoder (stacked layers, ``[L, ...]`` over ``pp``).
        stages: the pipeline.
        groups: G (divides the rows of every batch shard).
        tokens_R / pos_R / tables_RN: each row's token, position and block table
            (inactive rows: position 0 and the scratch page).
        k / v: the stacked page pools ``[L, K, A, Z, H]`` (quantized: with scales).
        draw: ``(logits [Rg, V], g) -> pytree of [Rg, ...]``: the tokens (and logprobs)
            of group ``g``, drawn on the last stage.
        drawn: the pytree ``draw`` returns, as ``ShapeDtypeStruct`` s of one group
            (``[Rg, ...]``, rows over the batch axes, the rest whole).

    Returns:
        (``draw``'s pytree over all rows, ``[R, ...]``; the pools with the token written).
    """
    cfg, p = model.config, stages.count
    r, lp = tokens_R.shape[0], cfg.n_layers // p
    rg = r // groups
    graphdef, state_P = stages.split_layers(model)

    def embed(_, tokens_R):
        return model.embed(tokens_R[:, None], pos_R[:, None])

    tokens_PR = stages.constrain(jnp.broadcast_to(tokens_R, (p, r)), ("batch",), EMBEDDING, DECODE)
    x_PRgG1D = stages.map(embed)(tokens_PR).reshape(p, rg, groups, 1, cfg.d_model)

    def zeros(spec: jax.ShapeDtypeStruct) -> jax.Array:
        init = jnp.zeros((p, rg, groups, *spec.shape[1:]), spec.dtype)
        axes = ("batch", None, *(None,) * (len(spec.shape) - 1))
        return stages.constrain(init, axes, LM_HEAD, DECODE)

    out = jax.tree.map(zeros, drawn)
    init = (
        stages.constrain(jnp.zeros((p, rg, 1, cfg.d_model), cfg.dtype), BTD, ATTENTION, DECODE),
        Blocks(k),
        Blocks(v),
        out,
    )
    _, k, v, out = run_schedule(
        stages,
        groups,
        init,
        state_P=state_P,
        x_emb=x_PRgG1D,
        stage_step=functools.partial(
            paged_stage,
            graphdef=graphdef,
            pos_RgG=by_group(pos_R, groups),
            tables_RgGN=by_group(tables_RN, groups),
            lp=lp,
        ),
        head=functools.partial(paged_head, model=model, groups=groups, draw=draw),
    )
    # The last stage's row, on every stage (a broadcast of the tokens, not of logits).
    last = jax.tree.map(lambda x: x[p - 1].reshape(r, *x.shape[3:]), out)
    return last, k.tree, v.tree


@dataclasses.dataclass(frozen=True)
class SlotPipeline:
    """How a serving engine's decode step runs through its pipeline stages.

    Attributes:
        stages: the pipeline.
        groups: the most decode groups a step splits its rows into (fewer when a step
            computes fewer rows per batch shard: :meth:`groups_for`).
        shards: the batch shards (each holds an equal share of every group).
    """

    stages: Stages
    groups: int
    shards: int

    @classmethod
    def of(cls, steps: Any, model_config: ModelConfig, pool: Any) -> SlotPipeline | None:
        """The pipeline of ``steps`` (None unpipelined); refuses what it cannot run."""
        config = steps.config
        if config.pp == 1:
            return None
        if kv_groups(model_config) is not None:
            raise ConfigError(
                f"serving with pp={config.pp} runs models whose layers share one block "
                "table; this model mixes sliding-window and full layers (KV groups): "
                "serve it with pp=1 (fold pp into tp or dp)"
            )
        groups = config.decode_groups if config.decode_groups > 1 else GROUPS_PER_STAGE * config.pp
        return cls(steps.schedule.stages, groups, pool.shards)

    def groups_for(self, rows: int) -> int:
        """The groups of a step over ``rows`` rows: the most, up to :attr:`groups`, that
        divide each batch shard's rows."""
        per = rows // self.shards
        return max(g for g in range(1, min(self.groups, per) + 1) if per % g == 0)

    def stage_iterations(self, live_B: np.ndarray, rows: int) -> tuple[int, int]:
        """A step's stage-iterations over ``rows`` rows (the first ``rows / shards`` of
        each batch shard) and how many of them idle: the fill and drain, and a busy slot
        whose group has no live row (``live_B``: the live rows, all ``B``)."""
        p, g = self.stages.count, self.groups_for(rows)
        live_SL = np.asarray(live_B, bool).reshape(self.shards, -1)[:, : rows // self.shards]
        live_groups = np.zeros(g, bool)
        np.logical_or.at(live_groups, np.arange(rows) % g, live_SL.reshape(-1))
        total = p * (g + p - 1)
        return total, total - p * int(live_groups.sum())

    def step(self, model: Decoder, cache: PagedKVCache, tokens_R: jax.Array, draw, rows):
        """One decode step of ``cache``'s rows (traced): ``draw(logits, *rows)`` picks each
        group's tokens on the last stage from its rows of ``rows`` (a tuple of ``[R, ...]``
        pytrees). Returns ``draw``'s results ``[R, ...]`` and the cache, advanced."""
        r = tokens_R.shape[0]
        g = self.groups_for(r)

        def group_draw(logits_RgV, gi):
            mine = jax.tree.map(lambda x: by_group(x, g)[:, gi], rows)
            return draw(logits_RgV, *mine)

        mine = jax.tree.map(lambda x: jax.ShapeDtypeStruct((r // g, *x.shape[1:]), x.dtype), rows)
        vocab = jax.ShapeDtypeStruct((r // g, model.config.vocab_size), jnp.float32)
        drawn = jax.eval_shape(draw, vocab, *mine)
        out, k, v = paged_decode(
            model,
            self.stages,
            groups=g,
            tokens_R=tokens_R,
            pos_R=cache.lengths_B,
            tables_RN=cache.block_tables_BN,
            k=cache.k,
            v=cache.v,
            draw=group_draw,
            drawn=drawn,
        )
        return *out, cache.replace(k=k, v=v).advance()
