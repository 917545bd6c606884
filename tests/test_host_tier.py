"""The prefix cache's host tier (``kv_offload_gb``): evicted pages kept in host memory.

The book (:class:`HostTier`, plain Python) keeps pages by prefix key, least recently used
out, and queues its copies in order. Served, with a device pool too small for the
prefixes a workload repeats: requests whose prefixes the device evicted find them in the
host tier, have them copied back, and equal their plain runs token for token (the same
batcher without the tier, which hits nothing and prefills every prompt whole; greedy,
f32; one device and tp=2, whose record a second executor replays to the same pool and
host pages, as another process of a multi-process server would). With a quantized pool
of stacked layers (int8 values and their scales, copied bit for bit) host hits equal
device hits. Then what the server exports: metrics and KV events, and the flag.
"""

from __future__ import annotations

import functools
import pickle

import jax
import numpy as np
import pytest

from jaxpar import ConfigError, ParallelConfig
from jaxpar.engine import ContinuousBatcher
from jaxpar.engine._cache import CacheManager
from jaxpar.engine._executor import DECODE, Executor
from jaxpar.engine._host_pages import HostPages, host_memory_kind
from jaxpar.engine._host_tier import OFFLOAD, RESTORE, HostTier, host_pages
from jaxpar.engine._kv_budget import KVBudget
from jaxpar.engine._pages import PagePool, PageTable
from jaxpar.models import ExecutionOptions
from tests.test_batching import CONFIG, _engine
from tests.test_lockstep import Capture

Z = 4  # tokens per page
#: Ten usable pages of four tokens: one request (19-token prompt, 6 new) holds seven.
POOL_TOKENS = 40
NEW = 6


# --- the book ---------------------------------------------------------------------------


class Sink:
    def __init__(self):
        self.news = []

    def offloaded(self, key, block_size):
        self.news.append(("stored", key, block_size))

    def dropped(self, key):
        self.news.append(("dropped", key))


def test_the_book_keeps_pages_least_recently_used_out_and_queues_copies_in_order():
    tier = HostTier(capacity=2, page_size=Z, page_bytes=100)
    tier.events = sink = Sink()
    tier.spill(7, b"a")
    tier.spill(8, b"b")
    assert tier.lookup([b"a", b"b", b"c"]) == [0, 1]
    tier.spill(9, b"a")  # held already: nothing moves, "a" is the most recent now
    assert tier.kept == 1
    tier.pin([b"b"])
    tier.spill(3, b"c")  # full: "b" is the oldest but pinned, so "a" goes
    tier.unpin()
    assert b"a" not in tier and tier.lookup([b"b", b"c"]) == [1, 0]
    tier.restore([b"b"], [5])
    tier.spill(4, b"d")  # "c" is the oldest now ("b" was just used)
    moves = tier.take_moves()
    assert [(m.kind, m.pages, m.slots) for m in moves] == [
        (OFFLOAD, (7, 8, 3), (0, 1, 0)),
        (RESTORE, (5,), (1,)),
        (OFFLOAD, (4,), (0,)),
    ]
    assert tier.take_moves() == []
    assert (tier.offloaded, tier.restored, tier.evicted) == (4, 1, 2)
    assert (tier.hit_tokens, tier.offloaded_bytes, tier.restored_bytes) == (Z, 400, 100)
    assert [n[0] for n in sink.news] == [
        "stored",
        "stored",
        "dropped",
        "stored",
        "dropped",
        "stored",
    ]
    assert sink.news[2] == ("dropped", b"a") and sink.news[0][2] == Z


def test_a_host_tier_with_no_room_or_no_prefix_cache_is_refused():
    with pytest.raises(ConfigError, match="at least one page"):
        HostTier(capacity=host_pages(1e-9, 4096), page_size=Z)
    with pytest.raises(ConfigError, match="> 0 GiB"):
        host_pages(0, 4096)
    pool = PagePool(page_size=Z, pages_per_shard=5, shards=1, rows=1, max_seq_len=16)
    with pytest.raises(ConfigError, match="prefix caching on"):
        CacheManager(PageTable(pool), caching=False).attach_host(HostTier(4, Z))
    windowed = PagePool(Z, 5, 1, 1, 16, windows=(8,))
    with pytest.raises(ConfigError, match="windows"):
        CacheManager(PageTable(windowed), caching=True).attach_host(HostTier(4, Z))


# --- served -----------------------------------------------------------------------------


def _workload() -> list[list[int]]:
    """Three 16-token prefixes (four pages each; twelve in all, for a device pool of
    ten), each asked twice in turn with its own 3-token tail."""
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(1, CONFIG.vocab_size, 16).tolist() for _ in range(3)]
    return [prefixes[i % 3] + rng.integers(1, CONFIG.vocab_size, 3).tolist() for i in range(6)]


@functools.cache
def _served_engine(tp: int, kv: str | None = None, layer_loop: str = "unrolled"):
    options = ExecutionOptions(layer_loop=layer_loop, kv_cache_dtype=kv)
    return _engine(ParallelConfig(tp=tp), layer_loop=layer_loop, max_seq_len=48, options=options)


def _serve(engine, offload_gb, tokens=POOL_TOKENS, recorder=None, speculative=None):
    """Serves the workload one request at a time; returns the batcher and the tokens."""
    batcher = ContinuousBatcher(
        engine, prefill_batch=1, kv_budget=KVBudget(page_size=Z, tokens=tokens),
        kv_offload_gb=offload_gb, speculative=speculative,
    )  # fmt: skip
    batcher.executor.recorder = recorder
    with batcher:
        got = [batcher.submit(p, max_tokens=NEW).result(timeout=120) for p in _workload()]
    batcher.pages.check()
    return batcher, got


@pytest.mark.parametrize("tp", [1, 2], ids=["single", "tp2"])
def test_requests_served_from_host_pages_equal_their_plain_runs(tp):
    engine = _served_engine(tp)
    # The plain runs: the same batcher without the tier, where every prefix was evicted
    # before it came again (twelve pages for ten), so every prompt is prefilled whole.
    without, plain = _serve(engine, None)
    assert without.stats.prefix_hits == 0
    capture = Capture()
    batcher, got = _serve(engine, 0.01, recorder=capture)
    tier = batcher.host_tier
    assert got == plain
    # Every repeat's prefix was evicted from the device (twelve pages for ten) and found
    # whole in the host tier: its four pages copied back, only its tail computed.
    assert tier.restored == 3 * 4 and batcher.stats.prefix_hits == 3 * 16
    assert tier.offloaded > 0 and tier.evicted == 0
    assert tier.restored_bytes == tier.restored * batcher.executor.host_pages.page_bytes
    held = batcher.executor.host_pages._host
    assert all(a.sharding.memory_kind == host_memory_kind(jax.devices()[0]) for a in held.values())

    # Another process replays the record: the same pool and host pages, bit for bit.
    replica = Executor(
        engine, engine, batcher.slot_steps, None, batcher.first_tokens, keeps_outputs=False
    )
    replica.host_pages = HostPages(batcher.slot_steps)
    for record in capture.records:
        replica.replay(*pickle.loads(record))
    names = {pickle.loads(r)[0] for r in capture.records}
    assert {"offload", "restore"} <= names
    pools = [
        jax.device_get((e._slots[DECODE].k, e._slots[DECODE].v))
        for e in (batcher.executor, replica)
    ]
    for a, b in zip(*map(jax.tree.leaves, pools), strict=True):
        np.testing.assert_array_equal(a, b)
    assert held.keys() == replica.host_pages._host.keys()
    for slot, page in held.items():
        np.testing.assert_array_equal(np.asarray(page), np.asarray(replica.host_pages._host[slot]))


def test_speculation_evicting_to_the_host_keeps_requests_exact():
    """A verification takes pages for its drafts, which may evict cached pages to the host
    tier: their copies go out before the verification writes them (n-gram drafts on
    every step, the cost model off), and every request equals its plain run."""
    engine = _served_engine(1)
    _, plain = _serve(engine, None)
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 2, "adaptive": False}  # fmt: skip
    batcher, got = _serve(engine, 0.01, speculative=speculative)
    assert batcher.spec_stats.verify_steps > 0
    assert batcher.host_tier.restored > 0 and batcher.host_tier.offloaded > 0
    assert got == plain


def test_a_quantized_pool_copies_values_and_scales_exactly():
    """int8 pages of stacked layers (one ``[L, K, A, Z, H]`` pool and its scales): a
    request whose prefix comes back from the host equals the same request served from
    pages that never left the device (a pool that holds them all)."""
    engine = _served_engine(1, "int8", "scan")
    batcher, from_host = _serve(engine, 0.01)
    pool = batcher.executor._slots[DECODE].k
    assert not isinstance(pool, tuple) and pool.values.dtype == np.int8  # stacked, quantized
    assert batcher.host_tier.restored == 3 * 4
    roomy, on_device = _serve(engine, None, tokens=160)
    assert roomy.stats.prefix_hits == batcher.stats.prefix_hits == 3 * 16
    assert from_host == on_device


# --- what the server exports ------------------------------------------------------------


def test_metrics_export_host_hits_and_bytes_under_jaxpar_and_vllm_names():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from jaxpar.server._offload_metrics import HostTierCollector

    tier = HostTier(capacity=4, page_size=Z, page_bytes=1000)
    for page, key in enumerate([b"a", b"b", b"c", b"d", b"e"]):
        tier.spill(page, key)
    tier.restore([b"e"], [9])
    service = SimpleNamespace(
        batcher=SimpleNamespace(host_tier=tier), model=SimpleNamespace(name="m")
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HostTierCollector(service))
    text = generate_latest(registry).decode()
    for line in [
        'jaxpar:kv_offload_host_hits_total{model_name="m"} 4.0',
        'jaxpar:kv_offload_total_bytes_total{model_name="m",transfer_type="GPU_to_CPU"} 5000.0',
        'jaxpar:kv_offload_total_bytes_total{model_name="m",transfer_type="CPU_to_GPU"} 1000.0',
        'vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="GPU_to_CPU"} 5000.0',
        'vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 1000.0',
        'jaxpar:kv_offload_host_usage_perc{model_name="m"} 1.0',
        'jaxpar:kv_offload_host_evictions_total{model_name="m"} 1.0',
    ]:
        assert line in text, line
    service.batcher.host_tier = None  # no tier: nothing exported
    assert "kv_offload" not in generate_latest(registry).decode()


def test_kv_events_name_host_pages_medium_cpu():
    from types import SimpleNamespace

    from jaxpar.server._kv_events import HOST_MEDIUM, KVEventPublisher, event_types, external_hash

    publisher = SimpleNamespace(types=event_types())
    news = [("offloaded", b"k1", Z), ("offloaded", b"k2", Z), ("dropped", b"k1")]
    events: list = []
    for item in news:
        events = KVEventPublisher._host_event(publisher, events, item)
    stored, removed = events
    assert type(stored).__name__ == "BlockStored" and type(removed).__name__ == "BlockRemoved"
    assert stored.block_hashes == [external_hash(b"k1"), external_hash(b"k2")]
    assert (stored.medium, stored.token_ids, stored.parent_block_hash, stored.block_size) == (
        HOST_MEDIUM, [], None, Z,
    )  # fmt: skip
    assert removed.block_hashes == [external_hash(b"k1")] and removed.medium == "CPU"


def test_serve_flag_reaches_the_batcher_and_needs_the_prefix_cache(capsys):
    from rich.console import Console

    from jaxpar.cli import main
    from jaxpar.cli._serve import build_batcher
    from tests.test_cli import CHAT, _serve_args

    batcher = build_batcher(_serve_args("--kv-offload-gb", "0.5"), Console(quiet=True))
    tier, pages = batcher.host_tier, batcher.executor.host_pages
    assert batcher.prefill_cache.host is tier
    assert tier.capacity == host_pages(0.5, pages.process_bytes()) > 0
    assert main(["serve", "--hf", CHAT, "--kv-offload-gb", "1", "--no-prefix-caching"]) == 2
    assert "drop --no-prefix-caching" in " ".join(capsys.readouterr().out.split())
