"""Step time of one phase on one device: compute, HBM traffic and collectives.

* Compute: FLOPs of the step on one device / peak FLOP/s for the model's dtype. jaxpar's
  programs are counted as they run: attention over all ``T`` prompt positions (masked, not
  skipped) and over the whole cache in decode; MoE experts on the dense GShard buffer (every
  expert sees ``C`` slots per group, dropless ``C = T``), plus the dispatch/combine einsums.
* Memory: bytes read from HBM / HBM bandwidth: the device's parameters once per pipeline
  iteration, and in decode its whole KV cache.
* Communication: every collective of :func:`jaxpar.inspect.communication_model`, with the
  pipeline's bubbles (an SPMD GPipe schedule runs ``M + pp - 1`` iterations on every stage, so
  what runs inside the pipeline executes ``(M + pp - 1) / M`` times as often as the minimum),
  timed with a ring or tree model on the link its mesh axes cross (:meth:`Hardware.link`).

The step time is ``max(compute, memory) + communication``: collectives are not assumed to
overlap compute (XLA can overlap some; the prediction is then pessimistic).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxpar.inspect import CAUSES, CommModel, Expected, communication_model
from jaxpar.models import ModelConfig, ModelRun
from jaxpar.plan._hardware import Hardware
from jaxpar.spec import ParallelConfig, Phase, model_field


@dataclasses.dataclass(frozen=True)
class CommCost:
    """One collective of a step: what moves, how often, over which link, how long."""

    item: Expected
    executions: int  # per step, pipeline bubbles included
    group: int  # devices taking part
    link: str
    algorithm: str  # ring or tree (the faster)
    seconds: float  # all executions

    @property
    def bytes(self) -> int:
        return self.item.bytes_each * self.executions

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.item.to_dict(),
            "executions": self.executions,
            "bytes": self.bytes,
            "group": self.group,
            "link": self.link,
            "algorithm": self.algorithm,
            "seconds": self.seconds,
        }


@dataclasses.dataclass(frozen=True)
class PhaseCost:
    """Predicted cost of one step of a phase on the busiest device."""

    phase: Phase
    flops: float
    hbm_bytes: float
    compute_s: float
    memory_s: float
    comm: tuple[CommCost, ...]

    @property
    def comm_s(self) -> float:
        return sum(c.seconds for c in self.comm)

    @property
    def comm_bytes(self) -> int:
        return sum(c.bytes for c in self.comm)

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s

    @property
    def bound(self) -> str:
        """What dominates the step: compute, memory or communication."""
        parts = {"compute": self.compute_s, "memory": self.memory_s, "communication": self.comm_s}
        return max(parts, key=parts.__getitem__)

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase.value,
            "seconds": self.seconds,
            "compute_s": self.compute_s,
            "memory_s": self.memory_s,
            "comm_s": self.comm_s,
            "flops": self.flops,
            "hbm_bytes": self.hbm_bytes,
            "comm_bytes": self.comm_bytes,
            "bound": self.bound,
            "collectives": [c.to_dict() for c in self.comm],
        }


def groups_of(config: ParallelConfig, phase: Phase) -> int:
    """Pipeline groups of a phase: prefill microbatches, decode groups (1 without pp)."""
    if config.pp == 1:
        return 1
    return config.microbatches if phase is Phase.PREFILL else config.decode_groups


def bubble(config: ParallelConfig, phase: Phase, steady: bool = False) -> float:
    """Iterations per group of the SPMD pipeline: ``(G + pp - 1) / G``; ``steady``: 1, a
    served pipeline in steady state (continuous batching keeps every stage busy: the
    schedule fills as rows join and leave, so no step pays the fill and drain)."""
    g = groups_of(config, phase)
    return (g + config.pp - 1) / g if config.pp > 1 and not steady else 1.0


def executions(item: Expected, config: ParallelConfig, phase: Phase, steady: bool = False) -> int:
    """Executions per step of ``item``: everything but the embedding runs inside the
    pipeline loop, once per iteration (``G + pp - 1`` of them, not ``G``; ``steady``:
    ``G``, see :func:`bubble`)."""
    if config.pp == 1 or item.module == "embedding" or steady:
        return item.count
    g = groups_of(config, phase)
    return item.count // g * (g + config.pp - 1)


def collective_seconds(kind: str, size: int, n: int, link: Any) -> tuple[float, str]:
    """Time of one collective of ``size`` bytes (parser convention) over ``n`` devices.

    Ring: all-reduce ``2 (n-1)/n S / bw + 2 (n-1) a``; all-gather, reduce-scatter and
    all-to-all ``(n-1)/n S / bw + (n-1) a``; tree all-reduce ``2 S / bw + 2 log2(n) a``
    (used when faster: small messages); collective-permute ``S / bw + a``.
    """
    bw, lat = link.bytes_per_s, link.latency_s
    if kind == "collective-permute":
        return size / bw + lat, "p2p"
    if kind == "all-reduce":
        ring = 2 * (n - 1) / n * size / bw + 2 * (n - 1) * lat
        tree = 2 * size / bw + 2 * math.ceil(math.log2(n)) * lat
        return (ring, "ring") if ring <= tree else (tree, "tree")
    return (n - 1) / n * size / bw + (n - 1) * lat, "ring"


def known_excess(model: ModelConfig, analytic: CommModel) -> list[Expected]:
    """Collectives the compiled program adds to the minimum, from
    :data:`jaxpar.inspect.CAUSES` (the pipeline's bubbles are in :func:`executions`).

    ``moe-dispatch-buffer``: the exchange is padded. A device sends each of its P expert
    peers a block of C rows (:meth:`ModelRun.expert_capacity`), so each all-to-all
    moves ``P x C`` rows where the minimum's ``top_k x n`` are routed, and each layer also
    exchanges its int32 row counts (``[P, E / P + 1]``). The ragged path's receive buffer
    (GPU, TPU) has the dropless size, so the same count holds there.
    """
    out = []
    for item in analytic.items:
        if item.module != "moe" or item.kind != "all-to-all":
            continue
        rows, d = item.shape
        peers = math.prod(analytic.config.degree(a) for a in item.axes)
        cap = ModelRun.of(model).expert_capacity(rows // model.moe.top_k, peers)
        why = CAUSES["moe-dispatch-buffer"]
        out.append(
            Expected(
                "all-to-all", item.axes, "moe", "padded dispatch blocks",
                (peers * cap - rows, d), item.itemsize, item.count, why,
            )
        )  # fmt: skip
        counts = (peers, model.n_experts // peers + 1)
        out.append(
            Expected("all-to-all", item.axes, "moe", "dispatch row counts", counts, 4, item.count // 2, why)
        )  # fmt: skip
    return out


def comm_costs(
    model: ModelConfig,
    config: ParallelConfig,
    phase: Phase,
    hardware: Hardware,
    *,
    batch: int,
    prompt_len: int,
    steady: bool = False,
) -> tuple[CommCost, ...]:
    """Every collective of a step of ``phase``, with bytes and time (``steady``: see
    :func:`bubble`)."""
    analytic = communication_model(model, config, phase, batch=batch, prompt_len=prompt_len)
    extra = known_excess(model, analytic)
    out = []
    for item in (*analytic.items, *extra):
        n = math.prod(config.degree(a) for a in item.axes)
        link = hardware.link(item.axes, config)
        runs = executions(item, config, phase, steady)
        each, algorithm = collective_seconds(item.kind, item.bytes_each, n, link)
        if item.step == "padded dispatch blocks" and ragged_moe(model, hardware):
            # The program's receive buffer has the padded size (what the bytes count), but
            # a ragged all-to-all moves only the routed rows: no time beyond the minimum.
            each, algorithm = 0.0, "ragged"
        out.append(CommCost(item, runs, n, link.name, algorithm, each * runs))
    return tuple(out)


def ragged_moe(model: ModelConfig, hardware: Hardware) -> bool:
    """Whether the MoE exchange runs ragged there: dropless, on a GPU or TPU (the engine
    probes ``ragged_all_to_all`` on its backend; XLA:CPU has none)."""
    run = ModelRun.of(model)  # a bare config runs the default options (dropless, "auto")
    dropless = run.moe_capacity_factor is None
    return dropless and run.moe_dispatch != "padded" and hardware.name != "cpu"


def step_flops(model: ModelConfig, phase: Phase, *, batch: int, prompt_len: int, context: int):
    """FLOPs of one step over the whole batch (all devices), as jaxpar's program runs it."""
    d, h = model.d_model, model.head_dim
    prefill = phase is Phase.PREFILL
    t = prompt_len if prefill else 1
    ctx = prompt_len if prefill else context
    tokens = batch * t
    if model_field(model, "mla.kv_lora_rank") is not None:
        qkvo, scores = _mla_flops(model, ctx)
    else:
        qkvo = 2 * d * (2 * model.n_heads * h + 2 * model.n_kv_heads * h)
        scores = 2 * 2 * model.n_heads * h * ctx
    gated = 3 if model.ffn.gated else 2
    ffn = 2 * d * model.d_ff * gated
    dense_layers = model_field(model, "moe.first_dense_layers", 0)
    if model.n_experts:
        # Router, then each token's top_k experts: the grouped matmul of the ragged path
        # (GPU, TPU) runs the routed rows only (XLA:CPU's padded blocks run more); shared
        # experts (DeepSeek) run every token.
        shared = 2 * d * model_field(model, "moe.shared_d_ff", 0) * gated
        mix = (2 * d * model.n_experts + model.moe.top_k * ffn + shared) * tokens
    else:
        mix = ffn * tokens
    dense = 2 * d * model_field(model, "moe.dense_d_ff", 0) * gated * tokens
    layers = model.n_layers * (qkvo + scores) * tokens
    layers += (model.n_layers - dense_layers) * mix + dense_layers * dense
    head = 2 * d * model.vocab_size * batch  # one position per sequence in both phases
    return float(layers + head)


def _mla_flops(model: ModelConfig, ctx: int) -> tuple[int, int]:
    """Per token: MLA's projections (absorbed: q into the latent, values out of it) and its
    scores and weighted latent over ``ctx`` cached positions."""
    d, n, r, p = model.d_model, model.n_heads, model.mla.kv_lora_rank, model.mla.qk_rope_head_dim
    qk, v = model.mla.qk_nope_head_dim + p, model.mla.v_head_dim
    rq = model.mla.q_lora_rank
    q = 2 * d * n * qk if rq is None else 2 * (d * rq + rq * n * qk)
    proj = q + 2 * d * (r + p) + 2 * n * model.mla.qk_nope_head_dim * r + 2 * n * r * v
    proj += 2 * n * v * d
    return proj, 2 * n * ctx * (r + p) + 2 * n * ctx * r


def phase_cost(
    model: ModelConfig,
    config: ParallelConfig,
    phase: Phase,
    hardware: Hardware,
    *,
    batch: int,
    prompt_len: int,
    max_seq_len: int,
    params_bytes: int,
    cache_bytes: int,
    steady: bool = False,
) -> PhaseCost:
    """Predicted cost of one step of ``phase`` on one device of ``config``; ``steady``: a
    served pipeline's decode in steady state, no fill or drain (:func:`bubble`)."""
    iters = bubble(config, phase, steady)
    total = step_flops(model, phase, batch=batch, prompt_len=prompt_len, context=max_seq_len)
    flops = total / config.size * iters
    # The weights are read once per pipeline iteration; decode reads the whole cache.
    weight_reads = params_bytes * iters * groups_of(config, phase)
    hbm = weight_reads + (cache_bytes if phase is Phase.DECODE else 0)
    dtype = np.dtype(model.dtype).name
    return PhaseCost(
        phase=phase,
        flops=flops,
        hbm_bytes=hbm,
        compute_s=flops / hardware.peak_flops(dtype),
        memory_s=hbm / (hardware.hbm_gbps * 1e9),
        comm=comm_costs(
            model, config, phase, hardware, batch=batch, prompt_len=prompt_len, steady=steady
        ),
    )
