"""Analytic model of the communication jaxpar's design needs, per phase and strategy.

:func:`communication_model` lists, for one (model, strategy, phase), every collective the
design cannot avoid, with the parser's byte convention (:attr:`Collective.bytes`): the full
logical tensor each participating device holds, e.g. the reduced local ``[B_l, T_l, D]``
of an all-reduce. Local sizes come from the spec layer (:func:`jaxpar.spec.mesh_axes`),
so the model follows the tables, not a hard-coded layout. Per decoder layer, with ``B_l``
and ``T_l`` the batch rows and tokens one device holds:

* TP: an all-reduce of ``[B_l, T_l, D]`` after the row-parallel attention output
  projection and one after the FFN down projection; one more after the vocab-parallel
  embedding lookup. The vocab-parallel LM head needs none.
* SP (prefill): K and V all-gathered over ``sp`` (``[B_l, T, K_l, H]`` each) so causal
  attention sees every earlier token. Where the run chooses ring attention for the prompt
  length (:func:`jaxpar.models.sp_prefill_attention`), the local K/V block instead moves
  ``sp - 1`` times around the ring (collective-permutes of ``[B_l, T_l, K_l, H]``, K and
  V each), each layer's K/V go back to the cache's order (two permutes of half the block,
  K and V each) and the token ids into the zigzag order once (two of half ``[B_l, T_l]``
  int32): per layer ``2 sp`` blocks of ``T_l`` tokens, the all-gather's bytes, but never
  more than two blocks held at once. jaxpar's SP is its own mesh axis (tokens over ``sp``,
  heads over ``tp``), not Megatron-style SP sharing the TP devices, so there is no
  all-gather/reduce-scatter pair around the blocks: the TP all-reduces simply run on the
  ``T/sp`` local tokens. Prefill then sums each sequence's last hidden state over ``sp``
  (``[B_l, D]``) for the logits.
* EP (MoE): the routed-token minimum, written from what routing needs, not from how
  jaxpar dispatches: each of the ``n_l`` tokens a device holds goes to ``top_k`` experts
  and comes back, so dispatch and combine each move ``top_k x n_l`` rows of ``D``
  (``(ep - 1) / ep`` of them leave the device; the parser counts an all-to-all's whole
  local buffer, so compiled and minimum are compared on that same footing). TP inside the
  experts leaves partial sums of the down projection; the weighted combine is linear, so
  they need one all-reduce of the ``[n_l, D]`` combined output, as a dense FFN (the
  ``top_k x n_l`` routed rows would be top_k times more). A
  capacity factor adds one all-reduce of the step's drop count (an int32). What a padded
  dispatch moves beyond that is the named cause ``moe-dispatch-buffer``.
* PP: one collective-permute of ``[B_mb_l, T_l, D]`` per stage boundary per microbatch
  (per device: each stage forwards each microbatch once); layers per device are ``L / pp``.
* DP: nothing. Decode: nothing whose size scales with the parameters.

The serving programs (``program=``, :data:`jaxpar.engine.SERVING_PROGRAMS`) add:

* ``serve_prefill_context``: the K/V gather over ``sp`` covers the ``context_len`` cached
  positions too;
* ``serve_decode`` and ``first_tokens`` (which samples): the vocab-parallel sampler's
  exchanges, O(B x k) and nothing of size V (:func:`sampling_items`);
* ``insert``: the handoff of prefilled K/V into the decode pool: where prefill splits
  tokens over ``sp``, every device gathers the new rows' K/V (a row's pages lie on one
  decode shard, decided at run time). ``first_tokens`` and ``insert`` run no layers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxpar.spec import (
    MESH_AXES,
    ModelDims,
    Module,
    ParallelConfig,
    Phase,
    mesh_axes,
    model_field,
)

Key = tuple[str, tuple[str, ...], str | None]


@dataclasses.dataclass(frozen=True)
class Expected:
    """One collective the design needs.

    Attributes:
        kind: collective kind as the parser names it (``all-reduce``, ``all-to-all``, ...).
        axes: mesh axes it runs over, in mesh order.
        module: the module scope it is attributed to (None: outside every scope).
        step: a short name of the step, e.g. ``"attention out-proj"``.
        shape: the per-device logical tensor of one execution (parser convention).
        itemsize: bytes per element.
        count: executions per program run.
        why: the reason, in the design's terms.
    """

    kind: str
    axes: tuple[str, ...]
    module: str | None
    step: str
    shape: tuple[int, ...]
    itemsize: int
    count: int
    why: str

    @property
    def key(self) -> Key:
        """``(kind, axes, module)``, the grouping of :func:`jaxpar.inspect.summarize`."""
        return (self.kind, self.axes, self.module)

    @property
    def bytes_each(self) -> int:
        """Bytes of one execution."""
        return math.prod(self.shape) * self.itemsize

    @property
    def bytes(self) -> int:
        """Bytes over all ``count`` executions."""
        return self.bytes_each * self.count

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "kind": self.kind,
            "axes": list(self.axes),
            "module": self.module,
            "step": self.step,
            "shape": list(self.shape),
            "itemsize": self.itemsize,
            "count": self.count,
            "bytes_each": self.bytes_each,
            "bytes": self.bytes,
            "why": self.why,
        }


@dataclasses.dataclass(frozen=True)
class CommModel:
    """The analytic minimum of one (strategy, phase)."""

    phase: Phase
    config: ParallelConfig
    items: tuple[Expected, ...]
    notes: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        """Bytes over all items."""
        return sum(item.bytes for item in self.items)

    def by_key(self) -> dict[Key, list[Expected]]:
        """Items grouped by ``(kind, axes, module)``."""
        out: dict[Key, list[Expected]] = {}
        for item in self.items:
            out.setdefault(item.key, []).append(item)
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "phase": self.phase.value,
            "strategy": str(self.config),
            "items": [item.to_dict() for item in self.items],
            "total_bytes": self.total_bytes,
            "notes": list(self.notes),
        }


def _split(axes: Sequence[str], config: ParallelConfig) -> int:
    return math.prod(config.degree(a) for a in axes)


def _local(size: int, axes: Sequence[str], config: ParallelConfig, what: str) -> int:
    parts = _split(axes, config)
    if size % parts:
        raise ValueError(f"{what}={size} does not divide over {tuple(axes)} ({parts} ways)")
    return size // parts


def _ordered(axes: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted(set(axes), key=MESH_AXES.index))


@dataclasses.dataclass(frozen=True)
class _Step:
    """One (model, strategy, phase) step, and the items and notes its modules add."""

    model: ModelDims
    config: ParallelConfig
    phase: Phase
    batch: int  # rows per pipeline microbatch (decode: group), the whole batch without pp
    tokens: int  # per sequence in this step
    count: int  # per-layer collectives per step: layers per device x microbatches
    groups: int
    itemsize: int
    context: int = 0  # cached positions before the new tokens (prefill with context)
    items: list[Expected] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def axes(self, module: Module) -> Mapping[str, tuple[str, ...]]:
        return mesh_axes(module, self.phase, self.config, dims=self.model)

    def rows(self, ax: Mapping[str, tuple[str, ...]]) -> tuple[int, int]:
        """(batch rows, tokens) one device holds under ``ax``."""
        return (
            _local(self.batch, ax["batch"], self.config, "batch"),
            _local(self.tokens, ax["seq"], self.config, "tokens"),
        )

    def add(self, kind, axes, module, step, shape, count, why, itemsize=None) -> None:
        if axes and count:  # no mesh axis (degree 1), no collective
            size = itemsize or self.itemsize
            item = Expected(kind, _ordered(axes), module, step, tuple(shape), size, count, why)
            self.items.append(item)


def _kv_heads_of_run(model: ModelDims, config: ParallelConfig) -> ModelDims:
    """A jaxpar model as the engine runs it under ``config``: with its KV-head replicas
    (rule kv-head-replicas: one head per device when tp is a multiple of the heads), so
    that the K/V an sp gather moves are one device's heads. Other dims hold their heads."""
    from jaxpar.models import ModelConfig, ModelRun

    if isinstance(model, (ModelConfig, ModelRun)):
        run = ModelRun.of(model).with_kv_heads_for(config)
        return model if run.kv_head_replicas == 1 else run
    return model


def communication_model(
    model: ModelDims,
    config: ParallelConfig,
    phase: Phase | str,
    *,
    batch: int,
    prompt_len: int,
    itemsize: int | None = None,
    program: str | None = None,
    context_len: int = 0,
) -> CommModel:
    """The collectives jaxpar's design needs for one step of ``phase``.

    Args:
        model: model sizes; a jaxpar ``ModelConfig`` also gives ``dtype`` (and runs
            dropless), a ``ModelRun`` its options' ``moe_capacity_factor`` and
            ``expert_capacity``.
        config: the parallel degrees.
        phase: prefill (``prompt_len`` padded tokens per sequence) or decode (one).
        batch: sequences per step (the engine's ``max_batch``).
        prompt_len: padded prompt length T of the prefill step.
        itemsize: bytes per activation element; default from ``model.dtype``.
        program: a serving program (``"serve_decode"``, ``"serve_prefill"``,
            ``"serve_prefill_context"``, ``"first_tokens"``, ``"insert"``) of ``phase``;
            None: the offline step of ``phase``. ``batch`` is then the program's rows.
        context_len: cached positions before the new tokens (``serve_prefill_context``).

    Returns:
        A :class:`CommModel` whose items use the parser's byte convention.
    """
    phase = Phase.coerce(phase)
    prefill = phase is Phase.PREFILL
    model = _kv_heads_of_run(model, config)
    # Pipeline: each device runs its stage's layers; the batch goes through in groups.
    groups = (config.microbatches if prefill else config.decode_groups) if config.pp > 1 else 1
    step = _Step(
        model,
        config,
        phase,
        batch=batch // groups,
        tokens=prompt_len if prefill or program == "insert" else 1,
        count=model.n_layers // config.pp * groups,
        groups=groups,
        itemsize=itemsize or np.dtype(getattr(model, "dtype", "float32")).itemsize,
        context=context_len if program == "serve_prefill_context" else 0,
    )
    if program in ("first_tokens", "insert"):  # no layers: the draw, or the handoff
        (sampling_items if program == "first_tokens" else _handoff)(step)
        return CommModel(phase, config, tuple(step.items), tuple(step.notes))
    _layers(step)
    if program == "serve_decode":
        sampling_items(step)
    if not step.items:
        step.notes.append(
            "No collective is needed: every device holds whole sequences and whole "
            "weights for its share of the work."
        )
    return CommModel(phase, config, tuple(step.items), tuple(step.notes))


def _layers(step: _Step) -> None:
    """The model's own collectives: embedding, layers, head, pipeline."""
    model = step.model
    _embedding(step)
    _attention(step)
    if model.n_experts:
        # DeepSeek: the first layers dense; shared experts a dense FFN in every MoE layer.
        # The shared expert's partial sums are added to the routed experts' before their
        # one reduction where both split their intermediate over the same axes: its own
        # all-reduce is needed only where they do not.
        dense = model_field(model, "moe.first_dense_layers", 0)
        moe_layers = model.n_layers - dense
        _moe(step, step.count * moe_layers // model.n_layers)
        shared_apart = step.axes(Module.MOE)["mlp"] != step.axes(Module.FFN)["mlp"]
        shared = model_field(model, "moe.shared_d_ff", 0) and shared_apart
        ffn_layers = dense + (moe_layers if shared else 0)
        _ffn(step, step.count * ffn_layers // model.n_layers)
    else:
        _ffn(step, step.count)
    _lm_head(step)
    _pipeline(step)


def _embedding(step: _Step) -> None:
    emb = step.axes(Module.EMBEDDING)
    b_l, t_l = step.rows(emb)
    step.add(
        "all-reduce",
        emb["vocab"],
        "embedding",
        "embedding lookup",
        (b_l, t_l, step.model.d_model),
        step.groups,
        "vocab-parallel table: each shard contributes the rows of its vocab range",
    )


def _attention(step: _Step) -> None:
    model, att = step.model, step.axes(Module.ATTENTION)
    b_l, t_l = step.rows(att)
    step.add(
        "all-reduce",
        att["heads"],
        "attention",
        "attention out-proj",
        (b_l, t_l, model.d_model),
        step.count,
        "row-parallel output projection: partial sums over the head shards",
    )
    kv_l = _local(model.n_kv_heads, att["kv_heads"], step.config, "n_kv_heads")
    if _rings(step, att):
        _ring_items(step, att, b_l, t_l, kv_l)
        return
    step.add(
        "all-gather",
        att["seq"],
        "attention",
        "K/V gather",
        (b_l, step.tokens + step.context, kv_l, model.head_dim),
        2 * step.count,
        "causal attention: every query needs the K and V of all earlier "
        "tokens, which other sp shards computed (one gather for K, one for V)",
    )
    if att["seq"] and att["heads"]:
        step.notes.append(
            "TP+SP: tokens are split over sp and heads over tp on separate mesh axes, so "
            "the TP all-reduces run on the T/sp local tokens; Megatron-style SP on the tp "
            "devices would swap each all-reduce for a reduce-scatter + all-gather pair "
            "moving the same bytes."
        )


def _rings(step: _Step, att: Mapping[str, tuple[str, ...]]) -> bool:
    """Whether the step's prefill attention runs by ring: the run's ``sp_attention``
    option (a bare config: the defaults) for its sp degree and prompt length; never with
    cached context, under a pipeline (its stages gather) or for MLA."""
    from jaxpar.models import RING_MIN_TOKENS, sp_prefill_attention

    if step.phase is not Phase.PREFILL or step.context or step.config.pp > 1 or not att["seq"]:
        return False
    if model_field(step.model, "mla.kv_lora_rank") is not None:
        return False
    options = getattr(step.model, "options", None)
    choice = getattr(options, "sp_attention", "auto")
    min_tokens = getattr(options, "ring_min_tokens", RING_MIN_TOKENS)
    sp = _split(att["seq"], step.config)
    return sp_prefill_attention(choice, sp, step.tokens, min_tokens) == "ring"


def _ring_items(step: _Step, att: Mapping[str, tuple[str, ...]], b_l, t_l, kv_l) -> None:
    """Ring attention's permutes (see the module docstring)."""
    sp, h = _split(att["seq"], step.config), step.model.head_dim
    step.add(
        "collective-permute",
        att["seq"],
        "attention",
        "K/V ring",
        (b_l, t_l, kv_l, h),
        2 * (sp - 1) * step.count,
        "ring attention: each device's K and V block visits every other sp shard "
        "(sp - 1 steps), attended there with online softmax",
    )
    step.add(
        "collective-permute",
        att["seq"],
        "attention",
        "K/V to cache order",
        (b_l, t_l // 2, kv_l, h),
        4 * step.count,
        "the prompt runs in the ring's load-balanced (zigzag) token order; each layer's "
        "K and V go back to the cache's order (two half blocks each)",
    )
    step.add(
        "collective-permute",
        att["seq"],
        "attention",
        "tokens to zigzag order",
        (b_l, t_l // 2),
        2 * step.groups,
        "token ids into the ring's zigzag order, once per step (two half blocks)",
        itemsize=4,
    )


def _ffn(step: _Step, count: int) -> None:
    """``count``: the FFN blocks' runs per step (a MoE model's dense layers and shared
    experts; every layer of a dense model)."""
    ffn = step.axes(Module.FFN)
    b_l, t_l = step.rows(ffn)
    step.add(
        "all-reduce",
        ffn["mlp"],
        "ffn",
        "FFN down-proj",
        (b_l, t_l, step.model.d_model),
        count,
        "row-parallel second linear: partial sums over the intermediate shards",
    )


def _lm_head(step: _Step) -> None:
    lm = step.axes(Module.LM_HEAD)
    if step.phase is Phase.PREFILL:
        b_l = _local(step.batch, lm["batch"], step.config, "batch")
        step.add(
            "all-reduce",
            lm["seq"],
            None,
            "last-position select",
            (b_l, step.model.d_model),
            step.groups,
            "each sequence's last prompt token lives on one sp shard; the logits are "
            "replicated over sp, so the selected rows are summed over sp",
        )
    if lm["vocab"]:
        step.notes.append(
            "LM head: logits stay vocab-parallel over "
            f"{','.join(lm['vocab'])}; sampling reduces across the shards (no gather)."
        )


def _pipeline(step: _Step) -> None:
    if step.config.pp == 1:
        return
    b_l, t_l = step.rows(step.axes(Module.ATTENTION))
    step.add(
        "collective-permute",
        ("pp",),
        None,
        "stage boundary",
        (b_l, t_l, step.model.d_model),
        step.groups,
        "each stage hands every microbatch (decode: group) on to the next stage once",
    )
    step.notes.append(
        "PP: per device, one permute per microbatch; an SPMD GPipe schedule runs "
        "M + pp - 1 iterations on every stage, so bubbles multiply what runs inside "
        "the pipeline by (M + pp - 1) / M."
    )


def sampling_items(step: _Step) -> None:
    """The vocab-parallel sampler's exchanges (:mod:`jaxpar.engine._filters`), per device,
    over the LM head's vocab shards ``S``, for the ``b`` rows a device holds: ``C``
    threshold candidates and ``K`` top-logprob candidates per shard (values; the
    logprobs' ids too), each argmax's per-shard maxima (value and id; greedy and drawn),
    and per-row sums: the radix selects' 2 x 32 rounds (only in steps that need them),
    the top-p normaliser and log-softmax's max, sum and chosen logprob. Rows' results
    then reach every device (tokens and logprobs are replicated outputs): ``B x (2K+1)``
    over the batch axes. All O(B x k); none of them of size V."""
    from jaxpar.engine import MAX_TOP_LOGPROBS
    from jaxpar.engine import SAMPLING_CANDIDATES as CANDIDATES
    from jaxpar.engine import SAMPLING_RADIX_ROUNDS as RADIX_ROUNDS

    lm = step.axes(Module.LM_HEAD)
    shards = _split(lm["vocab"], step.config)
    b_l = _local(step.batch, lm["batch"], step.config, "batch")
    vocab = -(-step.model.vocab_size // step.config.tp) * step.config.tp  # padded for tp
    per = vocab // shards
    c, k = min(CANDIDATES, per), min(MAX_TOP_LOGPROBS, vocab, per)
    why = "vocab-parallel sampling: each vocab shard's candidates, merged (no [B, V] gather)"
    step.add("all-gather", lm["vocab"], None, "sampling: candidates", (b_l, shards * c), 1, why, 4)
    step.add("all-gather", lm["vocab"], None, "logprobs: candidates", (b_l, shards * k), 2, why, 4)
    step.add(
        "all-gather",
        lm["vocab"],
        None,
        "argmax: shard maxima",
        (b_l, shards),
        4,
        "greedy and drawn tokens: each shard's maximum and its id, then the largest",
        4,
    )
    step.add(
        "all-reduce",
        lm["vocab"],
        None,
        "sampling: per-row sums",
        (b_l,),
        2 * RADIX_ROUNDS + 4,
        "radix-select rounds (2 x 32, when a row's top-k or nucleus is wider than the "
        "candidates), the top-p normaliser, log-softmax's max and sum, the chosen logprob",
        4,
    )
    if lm["batch"] and step.batch > b_l:
        step.add(
            "all-gather",
            lm["batch"],
            None,
            "results to every device",
            (step.batch, 2 * k + 1),
            1,
            "tokens and logprobs leave the step replicated (the host reads them)",
            4,
        )
    step.notes.append(
        f"Sampling: {shards} vocab shard(s) exchange {c} threshold and {k} logprob "
        "candidates per row; no step gathers the vocabulary."
    )


def _handoff(step: _Step) -> None:
    """The insert: prefill's K/V of the new rows into the decode pool."""
    model = step.model
    att = mesh_axes(Module.ATTENTION, Phase.PREFILL, step.config, dims=model)
    kv_l = _local(model.n_kv_heads, att["kv_heads"], step.config, "n_kv_heads")
    widths = getattr(model, "cache_kv_dims", (model.head_dim, model.head_dim))
    for name, width in zip(("K", "V"), widths, strict=True):
        step.add(
            "all-gather",
            (*att["batch"], *att["seq"]),
            None,
            f"handoff: {name} of the new rows",
            (step.batch, step.tokens, kv_l, width),
            model.n_layers,
            "prefill splits the new rows over its batch axes and their tokens over sp; the "
            "decode shard holding a row's pages, decided at run time, needs all of them, so "
            "each device gathers every new row (a data-dependent send would move 1/shards)",
        )


def moe_routed_rows(model: ModelDims, tokens: int) -> int:
    """Rows one device must send to the experts (and get back): ``top_k x tokens``."""
    return model.moe.top_k * tokens


def _moe(step: _Step, count: int) -> None:
    """MoE layers (``count`` runs per step) at the routed-token minimum: ep all-to-alls,
    expert TP all-reduce."""
    model, ax = step.model, step.axes(Module.MOE)
    b_l, t_l = step.rows(ax)
    rows = moe_routed_rows(model, b_l * t_l)
    d = model.d_model
    step.add(
        "all-to-all",
        ax["experts"],
        "moe",
        "dispatch + combine",
        (rows, d),
        2 * count,
        f"each of the {b_l * t_l} tokens on a device goes to top_k={model.moe.top_k} experts and "
        "back: top_k x tokens rows each way, (ep-1)/ep of them to other expert peers",
    )
    step.add(
        "all-reduce",
        ax["mlp"],
        "moe",
        "expert down-proj",
        (b_l * t_l, d),
        count,
        "row-parallel second linear inside each expert: its partial sums, combined per "
        "token (a linear map), are reduced once per token, as a dense FFN's",
    )
    factor = getattr(model, "moe_capacity_factor", None)
    peers = _split(ax["experts"], step.config)
    cap = None
    if hasattr(model, "expert_capacity"):  # a jaxpar ModelRun: its capacity factor's C
        cap = model.expert_capacity(b_l * t_l, peers)
    elif model_field(model, "moe.top_k"):  # a bare ModelConfig runs dropless: min(k, E_l) per token
        cap = b_l * t_l * min(model.moe.top_k, model.n_experts // peers)
    if cap is not None:
        step.notes.append(
            f"MoE: a device's {b_l * t_l} tokens are one dispatch group; "
            + (
                f"capacity factor {factor}: at most C={cap} rows to each of {peers} expert "
                "peer(s), assignments past it dropped and counted per step "
                "(Generation.moe_dropped)"
                if factor is not None
                else f"dropless: padded blocks hold C={cap} rows per expert peer, the ragged "
                "path (GPU/TPU) sends only the routed rows"
            )
        )
    if factor is not None:
        step.add(
            "all-reduce",
            (*ax["batch"], *ax["seq"]),
            None,
            "MoE drop count",
            (),
            step.groups,
            "capacity mode: the step's dropped assignments, summed over the token shards",
            itemsize=4,
        )


def execution_steps(config: Any, model: CommModel) -> list[dict[str, str]]:
    """The sequence of compute and communication steps of one phase, per section.

    Sections are the embedding, the layer block (run once per layer: a Python loop over
    per-layer weights, or a scan over stacked ones) and the head; each communication step names its collective, mesh axes and per-device shape.

    Args:
        config: a jaxpar ``ModelConfig`` (``positional``, ``is_moe``, ``top_k``, ...).
        model: :func:`communication_model` of the same config, strategy and phase.
    """
    comm = {
        item.step: f"{item.kind} over {','.join(item.axes)} of {'x'.join(map(str, item.shape))} "
        f"({item.bytes_each:,} B)"
        for item in model.items
    }
    prefill = model.phase is Phase.PREFILL
    stacked = getattr(config, "layer_loop", "unrolled") == "scan" or model.config.pp > 1
    loop = "scan" if stacked else "unrolled"
    layer = f"layer x{config.n_layers // model.config.pp} ({loop})"
    out: list[dict[str, str]] = []

    def step(section: str, text: str, *comm_steps: str) -> None:
        out.append({"section": section, "kind": "compute", "text": text})
        for name in comm_steps:
            what = name.split(":")[-1]  # "label:model step" shows the step under a label
            if what in comm:
                out.append(
                    {
                        "section": section,
                        "kind": "comm",
                        "text": f"{name.split(':')[0]}: {comm[what]}",
                    }
                )

    step(
        "embedding",
        "token lookup"
        + (" x sqrt(d_model)" if model_field(config, "embed.scale", False) else "")
        + (" + learned positions" if config.positional == "learned" else ""),
        "embedding lookup",
    )
    qk_norm = " + per-head q/k norms" if model_field(config, "norms.qk", False) else ""
    step(
        layer,
        "attention norm; Q/K/V projections"
        + qk_norm
        + (" + RoPE" if config.positional == "rope" else ""),
        "K/V gather",
    )
    step(
        layer,
        ("causal scores over the prompt" if prefill else "scores over the KV cache")
        + _attention_variant(config)
        + ", softmax, weighted V; output projection",
        "attention out-proj",
    )
    sandwich = model_field(config, "norms.sandwich", False)
    step(layer, ("post-attention norm; " if sandwich else "") + "residual add; FFN norm")
    if config.is_moe:
        renorm = (
            "" if model_field(config, "moe.norm_topk_prob", True) else " (weights not renormalised)"
        )
        biased = " (biased logits)" if model_field(config, "moe.router_bias", False) else ""
        if model_field(config, "moe.router", "softmax") == "sigmoid_grouped":
            renorm += (
                f" of sigmoid scores + correction bias within the best {config.moe.topk_groups}"
                f" of {config.moe.groups} expert groups, weights x {config.moe.routed_scaling_factor:g}"
            )
        if model_field(config, "moe.first_dense_layers", 0):
            step(
                layer,
                f"the first {config.moe.first_dense_layers} layer(s): a dense FFN in place of the "
                "MoE below",
                "FFN down-proj",
            )
        step(
            layer,
            f"router top-{config.moe.top_k}{biased}{renorm}; sort this device's assignments by expert",
            "dispatch:dispatch + combine",
        )
        step(
            layer,
            f"local experts: grouped gate/up (column-parallel), {_expert_glu(config)}, down "
            "(row-parallel)",
            "expert down-proj",
            "combine:dispatch + combine",
        )
        if model_field(config, "moe.shared_d_ff", 0):
            step(
                layer,
                "shared experts: a dense SwiGLU on every token (column-, then row-parallel), "
                "added to the routed sum",
                "FFN down-proj",
            )
        step(layer, "weighted sum of each token's expert outputs; residual add")
    else:
        step(
            layer,
            "FFN first linear(s) (column-parallel), activation, second linear (row-parallel)",
            "FFN down-proj",
        )
        step(layer, ("post-FFN norm; " if sandwich else "") + "residual add")
    if "stage boundary" in comm:
        step(layer, "end of a pipeline stage", "stage boundary")
    step(
        "head",
        "final norm" + ("; select each sequence's last position" if prefill else ""),
        "last-position select",
    )
    step(
        "head",
        ("LM head: vocab-parallel logits" if model.config.tp > 1 else "LM head: logits")
        + (
            f", soft-capped at {config.embed.logit_softcap:g}"
            if model_field(config, "embed.logit_softcap")
            else ""
        ),
        "next tokens to stage 0",
    )
    return out


def _expert_glu(config: Any) -> str:
    """The experts' gating: SwiGLU, or GPT-OSS's clamped one with biases."""
    limit = model_field(config, "moe.swiglu_limit")
    text = (
        "SwiGLU"
        if limit is None
        else (f"clamped SwiGLU (limit {limit:g}, alpha {config.moe.swiglu_alpha:g})")
    )
    if model_field(config, "ffn.bias", False):
        text += " with expert biases (down bias added on one tp rank)"
    return text


def _attention_variant(config: Any) -> str:
    """What a model's attention adds to plain causal scores: soft cap, sinks, sliding
    windows."""
    text = ""
    if model_field(config, "mla.kv_lora_rank") is not None:
        text += (
            f" (multi-head latent attention, absorbed: each head's query projected into the "
            f"{config.mla.kv_lora_rank}-wide latent; scores over the cached latent and "
            f"{config.mla.qk_rope_head_dim}-wide RoPE key, no heads; values expanded after)"
        )
    if model_field(config, "attention.softcap"):
        text += f" (soft-capped at {config.attention.softcap:g}, XLA path)"
    if model_field(config, "attention.sinks", False):
        text += " (a learned sink logit per head in each softmax denominator, XLA path)"
    window = model_field(config, "window.size")
    if window:
        slides = getattr(config, "layer_slides", lambda _: True)
        sliding = sum(slides(i) for i in range(config.n_layers))
        where = "every layer" if sliding == config.n_layers else f"{sliding} of the layers"
        text += f", {window}-token sliding window on {where}"
    return text
