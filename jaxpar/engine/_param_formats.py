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

So the parameters are stored the way the decode step reads them: it is lowered once with
every parameter layout left to the compiler (``Layout.AUTO``), its choice is kept for the
stacked layers (row-major for the rest), and every step is compiled against those layouts
(the engine places the parameters so). Decode, which runs every token, then copies
nothing. Prefill's many-token matmuls want the query and key/value kernels with ``D``
minor and copy the stage's stacked ones once per prefill step (about 8% of the parameter
bytes at Llama-3-70B widths). Storing them in prefill's layout instead (tried) moved that
copy into decode at full depth: at 80 layers (``pp=2,tp=8``) every decode step copied
0.8 GiB and held 3.9 GiB of temporaries, against none with decode's layouts. XLA:CPU has
no tiled layouts: this is TPU only.
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
    jitted = steps.jit_decode(params_in=auto)
    cache = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        KVCache.abstract(steps.dims, batch, steps.max_seq_len),
        lay.cache,
    )
    tokens = jax.ShapeDtypeStruct((batch,), np.int32, sharding=lay.tokens_B)
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    compiled = steps.lower(jitted, shapes, cache, tokens).compile()
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
