"""Where each jaxpar parameter comes from in a Hugging Face checkpoint, and slice reads.

A :class:`Recipe` says how one parameter (a leaf of ``nnx.state(Decoder(config))``) is
assembled: which tensors (a name template over layers and experts), which sub-range of a
fused tensor, how each tensor dimension factors into view dimensions, and how those are
transposed into ours. That is enough to read any rectangular slice of the parameter while
touching only the rows of the checkpoint it needs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from jaxpar.models._config import ModelConfig

Path = tuple[str, ...]
#: Reads ``name[slices]`` from the checkpoint as a numpy array.
Reader = Callable[[str, tuple[slice, ...]], np.ndarray]
_STACK_KEYS = ("layer", "expert")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one parameter is built from checkpoint tensors.

    Attributes:
        name: Tensor name, with ``{layer}`` / ``{expert}`` for stacked dimensions.
        stack: Sizes of the leading stacked dimensions (layers, then experts).
        hf_shape: Full shape of each checkpoint tensor.
        split: For each checkpoint dimension (after ``select``), its view dimensions.
        perm: Transpose from view dimensions to the parameter's per-tensor dimensions
            (those left after ``take``).
        select: (dim, start, stop) of a fused tensor that this parameter takes.
        take: (view dim, index): this parameter is one entry of that view dimension, which
            it drops (GPT-OSS's gate and up columns interleaved in one tensor: the last
            dimension viewed as ``(F, 2)``, gate at index 0, up at 1).
    """

    name: str
    stack: tuple[int, ...]
    hf_shape: tuple[int, ...]
    split: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    select: tuple[int, int, int] | None = None
    keys: tuple[str, ...] = _STACK_KEYS  # what the stacked dims are called in ``name``
    take: tuple[int, int] | None = None

    def _kept(self) -> list[int]:
        """The view dimensions the parameter keeps (all but ``take``'s)."""
        n_view = sum(len(group) for group in self.split)
        return [v for v in range(n_view) if self.take is None or v != self.take[0]]

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the assembled parameter."""
        view = [d for group in self.split for d in group]
        kept = [view[v] for v in self._kept()]
        return (*self.stack, *(kept[p] for p in self.perm))

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor this parameter reads, with its expected shape."""
        names = (self._name(i) for i in itertools.product(*map(range, self.stack)))
        return dict.fromkeys(names, self.hf_shape)

    def _name(self, stack_index: Sequence[int]) -> str:
        return self.name.format(**dict(zip(self.keys, stack_index, strict=False)))

    def layer(self, i: int) -> Recipe:
        """The recipe of layer ``i`` alone (the leading stacked dim taken away)."""
        assert self.keys[0] == "layer", self
        name = self.name.replace("{layer}", str(i))
        return dataclasses.replace(self, name=name, stack=self.stack[1:], keys=self.keys[1:])

    def read(self, index: tuple[slice, ...], reader: Reader) -> np.ndarray:
        """Reads ``param[index]`` (unit-step slices), touching only the needed rows."""
        n_stack = len(self.stack)
        full = (*self.stack, *self.shape[n_stack:])
        bounds = [range(*s.indices(n)) for s, n in zip(index, full, strict=True)]
        kept = self._kept()
        view_ranges = [range(0)] * (len(kept) + (self.take is not None))
        for j, v in enumerate(kept):
            view_ranges[v] = bounds[n_stack + self.perm.index(j)]
        if self.take is not None:
            view_ranges[self.take[0]] = range(self.take[1], self.take[1] + 1)
        hf_slices, view, in_memory, v = [], [], [], 0
        for dim, group in enumerate(self.split):
            lead, rest = view_ranges[v], view_ranges[v + 1 : v + len(group)]
            inner = math.prod(group[1:])
            offset = self.select[1] if self.select and self.select[0] == dim else 0
            # Read whole inner blocks of the leading view dim; trim the rest in memory.
            hf_slices.append(slice(offset + lead.start * inner, offset + lead.stop * inner))
            view += [len(lead), *group[1:]]
            in_memory += [slice(None)] + [slice(r.start, r.stop) for r in rest]
            v += len(group)

        def assemble(arr: np.ndarray) -> np.ndarray:
            arr = arr.reshape(view)[tuple(in_memory)]
            if self.take is not None:
                arr = arr[(slice(None),) * self.take[0] + (0,)]
            return arr.transpose(self.perm)

        blocks = [
            assemble(reader(self._name(i), tuple(hf_slices)))
            for i in itertools.product(*bounds[:n_stack])
        ]
        out = np.stack(blocks) if blocks else np.zeros((0,))
        return out.reshape([len(b) for b in bounds])


@dataclasses.dataclass(frozen=True)
class Fused:
    """A parameter that joins several checkpoint tensors along a new dimension.

    Example: our K/V kernel ``[D, 2, K, H]`` from ``k_proj`` and ``v_proj``, so one matmul
    reads both. ``axis`` counts the parameter's dimensions after the stacked ones.
    """

    parts: tuple[Recipe, ...]
    axis: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the assembled parameter."""
        part = self.parts[0].shape
        at = len(self.parts[0].stack) + self.axis
        return (*part[:at], len(self.parts), *part[at:])

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor this parameter reads, with its expected shape."""
        return {name: shape for part in self.parts for name, shape in part.tensors().items()}

    def layer(self, i: int) -> Fused:
        """The recipe of layer ``i`` alone."""
        return Fused(tuple(part.layer(i) for part in self.parts), self.axis)

    def read(self, index: tuple[slice, ...], reader: Reader) -> np.ndarray:
        """Reads ``param[index]``: the selected parts, each read as its own slice."""
        at = len(self.parts[0].stack) + self.axis
        rest = (*index[:at], *index[at + 1 :])
        chosen = range(*index[at].indices(len(self.parts)))
        return np.stack([self.parts[j].read(rest, reader) for j in chosen], axis=at)


@dataclasses.dataclass(frozen=True)
class Repeated:
    """A parameter whose dimension ``axis`` (stacked dims included) holds each entry of
    ``inner``'s ``replicas`` times, adjacent: a run's K/V heads from a checkpoint's (rule
    kv-head-replicas). A slice reads only the checkpoint heads it covers."""

    inner: Recipe | Fused
    axis: int
    replicas: int

    @property
    def shape(self) -> tuple[int, ...]:
        out = list(self.inner.shape)
        out[self.axis] *= self.replicas
        return tuple(out)

    def tensors(self) -> dict[str, tuple[int, ...]]:
        return self.inner.tensors()

    def read(self, index: tuple[slice, ...], reader: Reader) -> np.ndarray:
        """Reads ``param[index]``: the checkpoint heads under the slice, each repeated."""
        r = self.replicas
        start, stop, _ = index[self.axis].indices(self.shape[self.axis])
        first, last = start // r, (stop - 1) // r + 1 if stop > start else start // r
        inner = (*index[: self.axis], slice(first, last), *index[self.axis + 1 :])
        heads = np.repeat(self.inner.read(inner, reader), r, axis=self.axis)
        take = [slice(None)] * heads.ndim
        take[self.axis] = slice(start - first * r, stop - first * r)
        return heads[tuple(take)]


def per_layer(recipes: dict[Path, Recipe | Fused], n_layers: int) -> dict[Path, Recipe | Fused]:
    """Recipes for ``layer_loop="unrolled"``: ``("layers", *rest)`` -> ``("layers", i, *rest)``."""
    out: dict[Path, Recipe | Fused] = {}
    for path, recipe in recipes.items():
        if path[0] != "layers":
            out[path] = recipe
            continue
        for i in range(n_layers):
            out[("layers", i, *path[1:])] = recipe.layer(i)
    return out


Dims = tuple[int, ...]
#: (dim, start, stop, full size of dim): the part of a fused tensor a parameter takes.
Select = tuple[int, int, int, int]


def _linear(name: str, out_dims: Dims, in_dims: Dims, stack: Dims) -> Recipe:
    """A torch ``Linear`` weight [out, in] -> ours [*in_dims, *out_dims]."""
    n_out = len(out_dims)
    perm = (*range(n_out, n_out + len(in_dims)), *range(n_out))
    shape = (math.prod(out_dims), math.prod(in_dims))
    return Recipe(name, stack, shape, (out_dims, in_dims), perm)


def _plain(
    name: str, dims_per_axis: tuple[Dims, ...], stack: Dims, select: Select | None = None
) -> Recipe:
    """A tensor already in our order (GPT-2 Conv1D, vectors, embeddings), maybe reshaped."""
    shape = tuple(math.prod(g) for g in dims_per_axis)
    if select:
        shape = tuple(select[3] if d == select[0] else s for d, s in enumerate(shape))
    perm = tuple(range(sum(len(g) for g in dims_per_axis)))
    return Recipe(name, stack, shape, dims_per_axis, perm, select and select[:3])


#: Where a checkpoint keeps its experts (see :func:`llama_recipes`).
MOE_LAYOUTS = ("fused", "legacy", "per_expert", "gpt_oss")


def llama_recipes(c: ModelConfig, moe_layout: str | None) -> dict[Path, Recipe | Fused]:
    """Recipes for Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, Mixtral and Qwen3-MoE.

    ``moe_layout`` (MoE only) says where the experts are: ``"fused"`` (transformers 5.x's
    ``mlp.experts.gate_up_proj`` / ``down_proj``, either family), ``"legacy"`` (Mixtral's
    ``block_sparse_moe.experts.{j}.w1/w3/w2``) or ``"per_expert"`` (Qwen3-MoE on the Hub:
    ``mlp.experts.{j}.gate_proj/up_proj/down_proj``).
    """
    d, n, k, h, v = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size
    st, lay = (c.n_layers,), "model.layers.{layer}."
    r: dict[Path, Recipe | Fused] = {
        ("embed", "token_table"): _plain("model.embed_tokens.weight", ((v,), (d,)), ()),
        ("final_norm", "scale"): _plain("model.norm.weight", ((d,),), ()),
        ("layers", "attn_norm", "scale"): _plain(lay + "input_layernorm.weight", ((d,),), st),
        # Gemma's post_attention_layernorm follows attention (our post_attn_norm); its
        # pre_feedforward_layernorm is what Llama's post_attention_layernorm is.
        ("layers", "ffn_norm", "scale"): _plain(
            lay
            + ("pre_feedforward" if c.norms.sandwich else "post_attention")
            + "_layernorm.weight",
            ((d,),),
            st,
        ),
        ("layers", "attn", "q_kernel"): _linear(lay + "self_attn.q_proj.weight", (n, h), (d,), st),
        ("layers", "attn", "kv_kernel"): Fused(
            tuple(_linear(lay + f"self_attn.{x}_proj.weight", (k, h), (d,), st) for x in "kv"), 1
        ),
        ("layers", "attn", "o_kernel"): _linear(lay + "self_attn.o_proj.weight", (d,), (n, h), st),
    }
    if c.norms.sandwich:
        for ours, theirs in (
            ("post_attn_norm", "post_attention"),
            ("post_ffn_norm", "post_feedforward"),
        ):
            r[("layers", ours, "scale")] = _plain(lay + f"{theirs}_layernorm.weight", ((d,),), st)
    if c.attention.qkv_bias:
        r[("layers", "attn", "q_bias")] = _plain(lay + "self_attn.q_proj.bias", ((n, h),), st)
        r[("layers", "attn", "kv_bias")] = Fused(
            tuple(_plain(lay + f"self_attn.{x}_proj.bias", ((k, h),), st) for x in "kv"), 0
        )
    if c.attention.out_bias:
        r[("layers", "attn", "o_bias")] = _plain(lay + "self_attn.o_proj.bias", ((d,),), st)
    if c.attention.sinks:
        r[("layers", "attn", "sinks")] = _plain(lay + "self_attn.sinks", ((n,),), st)
    if c.norms.qk:
        for x in "qk":
            r[("layers", "attn", f"{x}_norm", "scale")] = _plain(
                lay + f"self_attn.{x}_norm.weight", ((h,),), st
            )
    if not c.embed.tied:
        r[("lm_head", "kernel")] = _linear("lm_head.weight", (v,), (d,), ())
    r.update(_ffn_recipes(c, lay) if not c.is_moe else _expert_recipes(c, moe_layout, lay))
    return r


def _ffn_recipes(c: ModelConfig, lay: str, d_ff: int | None = None) -> dict[Path, Recipe | Fused]:
    """The dense SwiGLU MLP: gate and up joined into our ``[D, 2, F]`` kernel (``d_ff``:
    another width than ``c.d_ff``: DeepSeek's dense layers and shared experts)."""
    d, f, st = c.d_model, d_ff or c.d_ff, (c.n_layers,)
    r: dict[Path, Recipe | Fused] = {
        ("layers", "ffn", "gate_up_kernel"): Fused(
            tuple(_linear(lay + f"mlp.{x}_proj.weight", (f,), (d,), st) for x in ("gate", "up")), 1
        ),
        ("layers", "ffn", "down_kernel"): _linear(lay + "mlp.down_proj.weight", (d,), (f,), st),
    }
    if c.ffn.bias:
        r[("layers", "ffn", "gate_up_bias")] = Fused(
            tuple(_plain(lay + f"mlp.{x}_proj.bias", ((f,),), st) for x in ("gate", "up")), 0
        )
        r[("layers", "ffn", "down_bias")] = _plain(lay + "mlp.down_proj.bias", ((d,),), st)
    return r


#: Per-expert layouts: (module, gate, up, down) names of ``{module}experts.{j}.{x}.weight``.
_PER_EXPERT_NAMES = {
    "legacy": ("block_sparse_moe.", "w1", "w3", "w2"),
    "per_expert": ("mlp.", "gate_proj", "up_proj", "down_proj"),
}


def _expert_recipes(c: ModelConfig, moe_layout: str | None, lay: str) -> dict[Path, Recipe]:
    """The router ``[D, E]`` and the stacked experts gate/up ``[E, D, F]``, down ``[E, F, D]``."""
    d, f, e, st = c.d_model, c.d_ff, c.n_experts, (c.n_layers,)
    if moe_layout == "gpt_oss":
        return _gpt_oss_expert_recipes(c, lay)
    if moe_layout in _PER_EXPERT_NAMES:
        module, gate, up, down = _PER_EXPERT_NAMES[moe_layout]
        moe, ste = lay + module, (c.n_layers, e)
        r: dict[Path, Recipe] = {
            ("layers", "ffn", "router", "kernel"): _linear(moe + "gate.weight", (e,), (d,), st)
        }
        for ours, theirs in (("gate", gate), ("up", up)):
            r[("layers", "ffn", "experts", f"{ours}_kernel")] = _linear(
                moe + f"experts.{{expert}}.{theirs}.weight", (f,), (d,), ste
            )
        r[("layers", "ffn", "experts", "down_kernel")] = _linear(
            moe + f"experts.{{expert}}.{down}.weight", (d,), (f,), ste
        )
        return r
    assert moe_layout == "fused", moe_layout
    # transformers 5.x: gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F].
    r = {("layers", "ffn", "router", "kernel"): _linear(lay + "mlp.gate.weight", (e,), (d,), st)}
    for i, ours in enumerate(("gate", "up")):
        r[("layers", "ffn", "experts", f"{ours}_kernel")] = Recipe(
            name=lay + "mlp.experts.gate_up_proj",
            stack=st,
            hf_shape=(e, 2 * f, d),
            split=((e,), (f,), (d,)),
            perm=(0, 2, 1),
            select=(1, i * f, (i + 1) * f),
        )
    r[("layers", "ffn", "experts", "down_kernel")] = Recipe(
        name=lay + "mlp.experts.down_proj",
        stack=st,
        hf_shape=(e, d, f),
        split=((e,), (d,), (f,)),
        perm=(0, 2, 1),
    )
    return r


def _gpt_oss_expert_recipes(c: ModelConfig, lay: str) -> dict[Path, Recipe]:
    """GPT-OSS's biased router and experts (``mlp.router``, ``mlp.experts``).

    Its experts are stored ``[in, out]``: ``gate_up_proj [E, D, 2F]`` with gate and up
    *interleaved* (column ``2j`` is gate column j, ``2j + 1`` up column j: transformers'
    ``gate_up[..., ::2]`` / ``[..., 1::2]``), its bias ``[E, 2F]`` alike, ``down_proj
    [E, F, D]`` and its bias ``[E, D]``. An MXFP4 checkpoint's ``*_blocks``/``*_scales``
    are read as these float tensors (:mod:`._hf_mxfp4`).
    """
    d, f, e, st = c.d_model, c.d_ff, c.n_experts, (c.n_layers,)
    moe = lay + "mlp."
    r: dict[Path, Recipe] = {
        ("layers", "ffn", "router", "kernel"): _linear(moe + "router.weight", (e,), (d,), st),
        ("layers", "ffn", "router", "bias"): _plain(moe + "router.bias", ((e,),), st),
    }
    for i, ours in enumerate(("gate", "up")):
        r[("layers", "ffn", "experts", f"{ours}_kernel")] = Recipe(
            name=moe + "experts.gate_up_proj",
            stack=st,
            hf_shape=(e, d, 2 * f),
            split=((e,), (d,), (f, 2)),
            perm=(0, 1, 2),
            take=(3, i),
        )
        r[("layers", "ffn", "experts", f"{ours}_bias")] = Recipe(
            name=moe + "experts.gate_up_proj_bias",
            stack=st,
            hf_shape=(e, 2 * f),
            split=((e,), (f, 2)),
            perm=(0, 1),
            take=(2, i),
        )
    r[("layers", "ffn", "experts", "down_kernel")] = _plain(
        moe + "experts.down_proj", ((e,), (f,), (d,)), st
    )
    r[("layers", "ffn", "experts", "down_bias")] = _plain(
        moe + "experts.down_proj_bias", ((e,), (d,)), st
    )
    return r


def gpt2_recipes(c: ModelConfig, prefix: str) -> dict[Path, Recipe | Fused]:
    """Recipes for GPT-2 (Conv1D weights are [in, out]; q/k/v fused in ``c_attn``)."""
    d, n, h, f, v = c.d_model, c.n_heads, c.head_dim, c.d_ff, c.vocab_size
    st, lay = (c.n_layers,), prefix + "h.{layer}."
    r: dict[Path, Recipe | Fused] = {
        ("embed", "token_table"): _plain(prefix + "wte.weight", ((v,), (d,)), ()),
        ("embed", "position_table"): _plain(
            prefix + "wpe.weight", ((c.max_position_embeddings,), (d,)), ()
        ),
        ("layers", "attn", "o_kernel"): _plain(lay + "attn.c_proj.weight", ((n, h), (d,)), st),
        ("layers", "attn", "o_bias"): _plain(lay + "attn.c_proj.bias", ((d,),), st),
        ("layers", "ffn", "up_kernel"): _plain(lay + "mlp.c_fc.weight", ((d,), (f,)), st),
        ("layers", "ffn", "up_bias"): _plain(lay + "mlp.c_fc.bias", ((f,),), st),
        ("layers", "ffn", "down_kernel"): _plain(lay + "mlp.c_proj.weight", ((f,), (d,)), st),
        ("layers", "ffn", "down_bias"): _plain(lay + "mlp.c_proj.bias", ((d,),), st),
    }
    for ours, theirs, where in (
        ("attn_norm", "ln_1", lay),
        ("ffn_norm", "ln_2", lay),
        ("final_norm", "ln_f", prefix),
    ):
        stack = st if where == lay else ()
        head = ("layers", ours) if stack else (ours,)
        r[(*head, "scale")] = _plain(where + f"{theirs}.weight", ((d,),), stack)
        r[(*head, "bias")] = _plain(where + f"{theirs}.bias", ((d,),), stack)
    # c_attn [D, 3D] holds q, k, v columns in that order: q is the first D, k/v the rest.
    w, b = lay + "attn.c_attn.weight", lay + "attn.c_attn.bias"
    r[("layers", "attn", "q_kernel")] = _plain(w, ((d,), (n, h)), st, (1, 0, d, 3 * d))
    r[("layers", "attn", "q_bias")] = _plain(b, ((n, h),), st, (0, 0, d, 3 * d))
    r[("layers", "attn", "kv_kernel")] = _plain(w, ((d,), (2, n, h)), st, (1, d, 3 * d, 3 * d))
    r[("layers", "attn", "kv_bias")] = _plain(b, ((2, n, h),), st, (0, d, 3 * d, 3 * d))
    if not c.embed.tied:
        r[("lm_head", "kernel")] = _linear("lm_head.weight", (v,), (d,), ())
    return r


def deepseek_recipes(c: ModelConfig, moe_layout: str | None) -> dict[Path, Recipe | Fused]:
    """Recipes for DeepSeek-V3, per layer (``("layers", i, ...)``: its layers differ, dense
    first, MoE after, and it runs unrolled).

    Multi-head latent attention keeps the checkpoint's projections, transposed:
    ``q_a_proj`` / ``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa`` ``[R + P, D]``,
    ``kv_b_proj`` ``[N * (Dn + Dv), R]`` viewed per head, ``o_proj``. MoE layers add the
    router's ``e_score_correction_bias`` and ``shared_experts``; the experts are the Hub's
    per-expert tensors or transformers 5.x's fused ones (``moe_layout``).
    """
    d, n, v, r = c.d_model, c.n_heads, c.vocab_size, c.mla.kv_lora_rank
    qk, p, st = (
        c.mla.qk_nope_head_dim + c.mla.qk_rope_head_dim,
        c.mla.qk_rope_head_dim,
        (c.n_layers,),
    )
    lay = "model.layers.{layer}."
    att = lay + "self_attn."
    stacked: dict[Path, Recipe | Fused] = {
        ("layers", "attn_norm", "scale"): _plain(lay + "input_layernorm.weight", ((d,),), st),
        ("layers", "ffn_norm", "scale"): _plain(
            lay + "post_attention_layernorm.weight", ((d,),), st
        ),
        ("layers", "attn", "kv_a_kernel"): _linear(
            att + "kv_a_proj_with_mqa.weight", (r + p,), (d,), st
        ),
        ("layers", "attn", "kv_a_norm", "scale"): _plain(
            att + "kv_a_layernorm.weight", ((r,),), st
        ),
        ("layers", "attn", "kv_b_kernel"): _linear(
            att + "kv_b_proj.weight", (n, c.mla.qk_nope_head_dim + c.mla.v_head_dim), (r,), st
        ),
        ("layers", "attn", "o_kernel"): _linear(
            att + "o_proj.weight", (d,), (n, c.mla.v_head_dim), st
        ),
    }
    if c.mla.q_lora_rank is None:
        stacked[("layers", "attn", "q_kernel")] = _linear(att + "q_proj.weight", (n, qk), (d,), st)
    else:
        rq = c.mla.q_lora_rank
        stacked[("layers", "attn", "q_a_kernel")] = _linear(
            att + "q_a_proj.weight", (rq,), (d,), st
        )
        stacked[("layers", "attn", "q_a_norm", "scale")] = _plain(
            att + "q_a_layernorm.weight", ((rq,),), st
        )
        stacked[("layers", "attn", "q_kernel")] = _linear(
            att + "q_b_proj.weight", (n, qk), (rq,), st
        )
    dense = _ffn_recipes(c, lay, d_ff=c.moe.dense_d_ff)
    moe: dict[Path, Recipe | Fused] = dict(_expert_recipes(c, moe_layout, lay))
    moe[("layers", "ffn", "router", "bias")] = _plain(
        lay + "mlp.gate.e_score_correction_bias", ((c.n_experts,),), st
    )
    if c.moe.shared_d_ff:
        shared = _ffn_recipes(c, lay + "mlp.shared_experts.", d_ff=c.moe.shared_d_ff)
        for path, recipe in shared.items():
            fixed = _rename(recipe, lay + "mlp.shared_experts.mlp.", lay + "mlp.shared_experts.")
            moe[("layers", "ffn", "shared", *path[2:])] = fixed
    r_out: dict[Path, Recipe | Fused] = {
        ("embed", "token_table"): _plain("model.embed_tokens.weight", ((v,), (d,)), ()),
        ("final_norm", "scale"): _plain("model.norm.weight", ((d,),), ()),
    }
    if not c.embed.tied:
        r_out[("lm_head", "kernel")] = _linear("lm_head.weight", (v,), (d,), ())
    for i in range(c.n_layers):
        ffn = moe if c.layer_is_moe(i) else dense
        for path, recipe in {**stacked, **ffn}.items():
            r_out[("layers", i, *path[1:])] = recipe.layer(i)
    return r_out


def _rename(recipe: Recipe | Fused, old: str, new: str) -> Recipe | Fused:
    """The recipe reading tensors named with ``old`` replaced by ``new``."""
    if isinstance(recipe, Fused):
        return Fused(tuple(_rename(part, old, new) for part in recipe.parts), recipe.axis)
    return dataclasses.replace(recipe, name=recipe.name.replace(old, new))
