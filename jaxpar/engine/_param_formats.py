"""Where a pipeline's parameters lie on TPU: in layouts its steps read them in, uncopied.

A pipelined step reads each stage's stacked layer parameters ``[Lp, ...]`` one layer at a
time, inside its schedule's loops. XLA:TPU tiles a stored kernel by its own shape (the
``[D, 2, F]`` gate/up and ``[D, 2, K, H]`` key/value kernels get ``(2, 128)`` tiles, from
their size-2 dim), while the matmul reading one layer wants ``(8, 128)`` tiles over its
other dims (and the heads before ``D`` for the query kernel). Unpipelined, that relayout
of one layer is fused into the matmul; in the pipeline XLA hoists it out of the loops,
as a copy of every stage's whole stacked kernels each step: temporaries that grow with
depth (and, on Llama-3-70B at ``pp=2,tp=8``, past the chip's HBM). The ``[P, Lp, ...]``
stage view is not the cause: reading the ``[Lp, ...]`` blocks as stored copies alike.

So the parameters are stored the way the steps read them: the decode and the prefill step
are each lowered once with every parameter layout left to the compiler (``Layout.AUTO``).
The stacked layers lie as prefill picks them, the rest as decode picks them (row-major),
and every step is compiled against those layouts (the engine places the parameters so).
Prefill's many-token matmuls want the query and key/value kernels with ``D`` minor, decode
wants ``D`` before the head dim; decode then fuses the relayout of the one layer it reads
into its matmul (no copy, its temporaries stay flat), while prefill, given decode's
layout, copied the stage's whole stacked kernels every step. XLA:CPU has no tiled
layouts: this is TPU only.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental.layout import Format, Layout

from jaxpar.models import KVCache


def stores_in_step_layouts(platform: str, pp: int) -> bool:
    """Whether a strategy's parameters lie in its decode step's layouts: pipelines on TPU."""
    return pp > 1 and platform == "tpu"


#: Prompt length prefill's layouts are chosen at (fewer when the cache holds fewer): rows
#: enough that its matmuls are the many-token kind every longer prompt's are.
PREFILL_TOKENS = 256


def step_param_formats(steps: Any, params: Any, batch: int) -> Any:
    """The formats (sharding + layout) the parameters lie in: XLA's choice in the prefill
    step for the stacked layers, in the decode step for the rest (row-major).

    Args:
        steps: the engine's :class:`~jaxpar.engine._steps.Steps`.
        params: the parameters, abstract or placed (only shapes and dtypes are read).
        batch: sequences per step (the cache's rows; prefill's prompts).

    Returns:
        A tree of ``jax.experimental.layout.Format`` like ``params``.
    """
    decode = decode_param_formats(steps, params, batch)
    prefill = _prefill_auto_formats(steps, params, batch)
    return jax.tree_util.tree_map_with_path(
        lambda path, d, p: p if _is_layer(path) and p.layout is not None else d,
        decode,
        prefill,
        is_leaf=lambda x: isinstance(x, Format),
    )


def _prefill_auto_formats(steps: Any, params: Any, batch: int) -> Any:
    lay = steps.layouts
    auto = jax.tree.map(lambda s: Format(Layout.AUTO, s), lay.params)
    jitted = jax.jit(
        lambda p, t, n: steps._prefill(p, t, n),
        in_shardings=(auto, lay.tokens_BT, lay.lengths_prefill_B),
        out_shardings=steps._with_drops((lay.logits_prefill, lay.kv_prefill, lay.kv_prefill)),
    )
    length = min(PREFILL_TOKENS, steps.max_seq_len)
    tokens = jax.ShapeDtypeStruct((batch, length), np.int32, sharding=lay.tokens_BT)
    lengths = jax.ShapeDtypeStruct((batch,), np.int32, sharding=lay.lengths_prefill_B)
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    return steps._lower(jitted, shapes, tokens, lengths).compile().input_formats[0][0]


def _is_layer(path: Any) -> bool:
    return getattr(path[0], "key", None) == "layers"


def decode_param_formats(steps: Any, params: Any, batch: int) -> Any:
    """The formats (sharding + layout) the decode step reads ``params`` in, chosen by XLA
    (row-major outside the stacked layers).

    Args:
        steps: the engine's :class:`~jaxpar.engine._steps.Steps`.
        params: the parameters, abstract or placed (only shapes and dtypes are read).
        batch: sequences per step (the cache's rows).

    Returns:
        A tree of ``jax.experimental.layout.Format`` like ``params``.
    """
    lay = steps.layouts
    auto = jax.tree.map(lambda s: Format(Layout.AUTO, s), lay.params)
    jitted = jax.jit(
        steps._decode,
        in_shardings=(auto, lay.cache, lay.tokens_B),
        out_shardings=steps._with_drops((lay.logits, lay.cache)),
        donate_argnums=(1,),
    )
    cache = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        KVCache.abstract(steps.dims, batch, steps.max_seq_len),
        lay.cache,
    )
    tokens = jax.ShapeDtypeStruct((batch,), np.int32, sharding=lay.tokens_B)
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    compiled = steps._lower(jitted, shapes, cache, tokens).compile()
    return jax.tree_util.tree_map_with_path(_row_major_outside_layers, compiled.input_formats[0][0])


def _row_major_outside_layers(path: Any, chosen: Format) -> Format:
    """The compiler's format for a stacked layer parameter; row-major (the chosen tiling)
    for the others. Picked freely, the LM head came column-major, and a decode step then
    compiled against that fixed layout copied the whole head into row-major for the
    matmul inside the schedule's loop (250 MiB per device per step for Llama-3-70B's at
    tp=8); row-major, no step copies it."""
    if _is_layer(path) or chosen.layout is None:
        return chosen
    layout = chosen.layout
    row_major = Layout(
        major_to_minor=tuple(range(len(layout.major_to_minor))), tiling=layout.tiling
    )
    return Format(row_major, chosen.sharding)
