"""vLLM's KV event structs, as a subscriber decodes jaxpar's KV events with them."""

# No ``from __future__ import annotations``: msgspec reads the structs' annotations, and
# these are defined in a function.
import functools
from typing import Any

import msgspec


@functools.cache
def vllm_structs(array_like: bool):
    """vLLM's KV event structs (vllm/distributed/kv_events.py: the batch an array, each
    event tagged with its class name, as an array up to vLLM 0.23 or a map since), with
    the fields it has today: trailing ones jaxpar does not send have defaults. One set of
    classes per encoding (cached), so that ``isinstance`` holds across callers."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(
        msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True
    ):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
