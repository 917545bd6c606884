"""KV heads by groups: how many copies of each KV head a strategy runs (rule kv-head-replicas).

With grouped-query attention, query head ``n`` of ``N`` reads KV head ``n // (N / K)``. When
``tp`` splits the ``N`` query heads into more shards than there are KV heads (``tp > K``), a
shard's query heads all read one KV head, and ``tp / K`` shards read the same one. As vLLM
does, the run then holds each KV head ``tp / K`` times, the copies adjacent (run head ``j`` is
checkpoint head ``j // (tp / K)``): ``tp`` *run* KV heads, so ``kv_heads`` splits over ``tp``
like any divisible count and every device holds exactly the one head its query heads read,
replicated only within its group of ``tp / K`` devices rather than on every device. Query
head ``n`` reads run head ``n // (N / tp)``, which is checkpoint head ``n // (N / K)``: the
same numbers. The K/V kernels (and biases, and their quantization scales) are expanded once,
where the parameters are loaded or placed; the cache, the paged pool, the prefill K/V and
the attention kernels then see an ordinary ``tp``-divisible head count.

Multi-head latent attention (``attention_variant`` ``"mla"``) caches one latent per token
with no head axis: it has no replicas (rule latent-cache-no-heads). A count ``tp`` neither
divides nor is a multiple of stays refused by the validator (rule tp-decomposable).
"""

from __future__ import annotations

from jaxpar.spec._config import ParallelConfig
from jaxpar.spec._dims import ModelDims

RULE = "kv-head-replicas"


def kv_head_replicas(config: ParallelConfig, dims: ModelDims) -> int:
    """Copies of each of ``dims``' KV heads a run under ``config`` holds: ``tp / K`` when
    ``tp`` is a multiple of the ``K = dims.n_kv_heads`` heads and larger (each device then
    holds one head), else 1 (``tp`` divides ``K``, ``tp == 1``, MLA, or a count the validator
    refuses)."""
    k, tp = dims.n_kv_heads, config.tp
    if getattr(dims, "attention_variant", None) is not None:
        return 1
    if tp > k and tp % k == 0:
        return tp // k
    return 1
