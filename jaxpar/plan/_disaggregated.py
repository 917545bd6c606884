"""Disaggregated plans: decode on the first devices, prefill on the rest, K/V moved once.

The serving work runs them (``ContinuousBatcher(prefill_engine=...)``; ``jaxpar explain
--prefill STRATEGY``): both groups run unpipelined strategies, prefill overlaps decode.
"""

from __future__ import annotations

import dataclasses

from jaxpar.models import ModelConfig, ModelRun
from jaxpar.plan._enumerate import Workload, check, legal_strategies
from jaxpar.plan._hardware import Hardware
from jaxpar.plan._placement import placement
from jaxpar.plan._prediction import Prediction, predict
from jaxpar.plan._serving import NO_BOUNDS, Bounds, prefill_batches, prefill_workload
from jaxpar.spec import Phase, batch_multiple

MAX_BATCH_GROWTH = 64


def kv_transfer_bytes(model: ModelConfig, workload: Workload) -> int:
    """What one prefilled batch sends to the decode group: K and V of every layer
    ``[B, T, K, H]`` (MLA: its latent and RoPE key, no heads; quantized with their scales
    under ``kv_cache_dtype``: they cross as the cache stores them), and each row's prompt
    length and first token (int32); ``B`` is the prefill batch when serving."""
    b, t = workload.prefill_rows, workload.prompt_len
    return b * t * ModelRun.of(model).cache_bytes_per_token + 2 * b * 4


def _best_group(
    model, hardware, count, workload, budget, phase, serving=False, where=None
) -> Prediction | None:
    """The unpipelined legal strategy on ``count`` devices with the fastest ``phase`` step
    that fits what that group holds (prefill: weights and prompt K/V; decode: weights and
    the KV cache; a serving decode group's activations are those of its own steps, the
    prefill ones counted at its smallest batch), and lays out on its chips (``where``)."""
    best = None
    for config in legal_strategies(model, count, workload, where)[0]:
        if config.pp > 1:  # disaggregated groups run unpipelined strategies
            continue
        w = workload
        if serving:
            w = dataclasses.replace(workload, prefill_batch=batch_multiple(model, config))
        pred = predict(model, config, w, hardware, budget=budget)
        mem = pred.memory.prefill_total if phase is Phase.PREFILL else pred.memory.decode_total
        cost = pred.prefill if phase is Phase.PREFILL else pred.decode
        if mem <= budget and (best is None or cost.seconds < best[0]):
            best = (cost.seconds, pred)
    return best and best[1]


def disaggregated_plans(
    model: ModelConfig,
    hardware: Hardware,
    devices: int,
    workload: Workload,
    budget: int,
    *,
    grow: bool = False,
    serving: bool = False,
    bounds: Bounds = NO_BOUNDS,
    cluster: int | None = None,
) -> list[Prediction]:
    """For each split of ``devices`` into a decode group (first) and a prefill group (after
    it), the best strategy of each group (on TPU: of those that lay out on its chips) and
    the K/V transfer between them; with ``grow``
    (throughput), at the largest batch (x 2^k, up to x64) both groups still fit.

    Serving: the prefill group prefills a few prompts at a time (the largest batch up to 4
    per batch shard that meets ``bounds``), its strategy the one that prefills the most
    prompts per second; the pair must meet ``bounds``.

    The transfer runs over the fast link when both groups sit in one fast-link domain, else
    over the slow one, spread over the smaller group's devices. On TPU the groups are the
    first ``devices`` chips of a ``cluster`` (default ``devices``) in slice order.
    """
    out = []
    for decode_devices in range(1, devices):
        where = (
            placement(hardware, cluster or devices),
            placement(hardware, cluster or devices, decode_devices),
        )
        best = None
        factor = 1
        while factor <= (MAX_BATCH_GROWTH if grow else 1):
            grown = workload.scaled(factor)
            if serving:
                pair = _serving_pair(
                    model, hardware, decode_devices, devices, grown, budget, bounds, where
                )
            else:
                pair = _pair(model, hardware, decode_devices, devices, grown, budget, where)
            if pair is None:
                break
            best, factor = pair, factor * 2
        if best is not None:
            out.append(best)
    return out


def _join(dec, pre, hardware, decode_devices, devices, workload, model) -> Prediction:
    """Decode group ``dec`` with prefill group ``pre``, and the K/V transfer between them."""
    prefill_devices = devices - decode_devices
    link = hardware.fast_link if devices <= hardware.domain(devices) else hardware.slow_link
    size = kv_transfer_bytes(model, workload)
    seconds = size / (min(decode_devices, prefill_devices) * link.bytes_per_s)
    return dataclasses.replace(
        dec,
        workload=workload,
        prefill=pre.prefill,
        prefill_config=pre.config,
        prefill_memory=pre.memory,
        transfer_bytes=size,
        transfer_s=seconds + link.latency_s,
    )


def _pair(model, hardware, decode_devices, devices, workload, budget, where) -> Prediction | None:
    prefill_devices = devices - decode_devices
    dec = _best_group(
        model,
        hardware,
        decode_devices,
        workload,
        budget,
        Phase.DECODE,
        where=where[0],
    )
    pre = _best_group(
        model,
        hardware,
        prefill_devices,
        workload,
        budget,
        Phase.PREFILL,
        where=where[1],
    )
    if dec is None or pre is None:
        return None
    return _join(dec, pre, hardware, decode_devices, devices, workload, model)


def _serving_pair(
    model, hardware, decode_devices, devices, workload, budget, bounds, where
) -> Prediction | None:
    dec = _best_group(
        model,
        hardware,
        decode_devices,
        workload,
        budget,
        Phase.DECODE,
        True,
        where=where[0],
    )
    if dec is None:
        return None
    best = None
    for config in legal_strategies(model, devices - decode_devices, workload, where[1])[0]:
        if config.pp > 1:
            continue
        for rows in prefill_batches(model, config, workload.batch):
            alone = Workload(batch=rows, prompt_len=workload.prompt_len, gen_len=workload.gen_len)
            if check(model, config, alone) is not None:
                continue
            pre = predict(model, config, alone, hardware, budget=budget)
            if pre.memory.prefill_total > budget:
                continue
            served = prefill_workload(workload, rows)
            pair = _join(dec, pre, hardware, decode_devices, devices, served, model)
            if bounds.met(pair) and (best is None or pair.tokens_per_s > best.tokens_per_s):
                best = pair
    return best
