"""KV events: the prefix cache's pages published over ZMQ as vLLM publishes its blocks.

A small page table (two batch shards, four usable pages each) is driven as the scheduler
drives it: each request looks up its prompt, is admitted with its hit, commits its full
pages and is freed; the pool is small, so cached pages are evicted, and some prompts go
to both shards. A pyzmq subscriber decodes every message with vLLM's own event structs
(msgspec; the current field list, both encodings) and replays the events: the blocks it
believes stored are exactly the keys the page table indexes, each BlockStored carries the
tokens of its pages, its parent is the page before (None for a prompt's first), and a key
held by both shards is stored once and removed only when the last shard evicts it.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import shlex
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from jaxpar.cli import main
from jaxpar.engine._cache import CacheManager
from jaxpar.engine._pages import PagePool, PageTable
from jaxpar.engine._prefix import cache_salt, page_keys
from jaxpar.errors import ConfigError
from jaxpar.server import KVEventPublisher, parse_kv_events_config
from jaxpar.server._kv_events import external_hash
from tests._vllm_events import vllm_structs

Z = 4
POOL = PagePool(page_size=Z, pages_per_shard=5, shards=2, rows=4, max_seq_len=16)
SALT = cache_salt("test_kv_events")
TIMEOUT_MS = 5000


@dataclasses.dataclass
class Subscriber:
    socket: zmq.Socket
    topic: bytes
    seq: int = -1

    def receive(self) -> list[bytes]:
        assert self.socket.poll(TIMEOUT_MS), "no KV event message arrived"
        topic, seq, payload = self.socket.recv_multipart()
        assert topic == self.topic
        return [seq, payload]

    def until(self, publisher: KVEventPublisher) -> list[bytes]:
        """Every payload up to the last batch the publisher has sent (sequence numbers
        consecutive, 8 bytes big-endian)."""
        assert publisher.flush(TIMEOUT_MS / 1000)
        payloads = []
        while self.seq < publisher.sent_batches - 1:
            seq, payload = self.receive()
            assert len(seq) == 8 and int.from_bytes(seq, "big") == self.seq + 1
            self.seq += 1
            payloads.append(payload)
        return payloads


@pytest.fixture(params=["array", "map"])
def wired(request):
    """A publisher on an inproc endpoint, a subscriber that has seen its first message,
    and a cache manager whose page events go to the publisher."""
    endpoint = f"inproc://kv-events-{request.param}"
    config = parse_kv_events_config(
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "{endpoint}", '
        f'"topic": "kv", "encoding": "{request.param}"}}'
    )
    publisher = KVEventPublisher(config)
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.connect(endpoint)
    socket.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub = Subscriber(socket, b"kv")
    # A subscription takes effect a moment after connecting: clear until one arrives.
    while not socket.poll(20):
        publisher.clear()
    sub.seq = int.from_bytes(sub.receive()[0], "big")
    sub.until(publisher)  # the rest of the handshake's clears
    cache = CacheManager(PageTable(POOL), SALT, caching=True)
    cache.events = publisher
    try:
        yield request.param, cache, publisher, sub
    finally:
        publisher.close()
        socket.close(linger=0)


def _serve(cache: CacheManager, row: int, prompt: list[int]) -> None:
    """One request as the scheduler runs it: admitted with its hit, its full pages
    committed after prefill, then freed (they stay cached)."""
    keys = cache.keys(prompt)
    hit = cache.computed(cache.shard(row), keys, len(prompt))
    assert cache.fits(hit, len(prompt) + 1)
    cache.admit(row, hit, len(prompt) + 1)
    cache.commit(row, keys[: len(prompt) // Z], prompt)
    cache.free(row)


def _indexed(cache: CacheManager) -> set[int]:
    return {external_hash(k) for index in cache.pages._index for k in index}


def test_events_follow_the_page_table(wired):
    encoding, cache, publisher, sub = wired
    batch_type, stored_type, removed_type, cleared_type = vllm_structs(encoding == "array")
    decode = msgspec.msgpack.Decoder(batch_type).decode
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50, 13).tolist() for _ in range(6)]
    prompts.append(prompts[0][:8] + [99, 98, 97, 96])  # shares prompt 0's first two pages
    # Which tokens each page key holds, and its parent, from the prompts themselves.
    pages = {}
    for prompt in prompts:
        keys = page_keys(prompt, Z, SALT)
        for i, key in enumerate(keys):
            parent = external_hash(keys[i - 1]) if i else None
            pages[external_hash(key)] = (prompt[i * Z : (i + 1) * Z], parent)
    believed: set[int] = set()
    counts = {"stored": 0, "removed": 0}
    # Shard 0 is row 0 or 1, shard 1 row 2 or 3: the first two prompts go to both.
    plan = [(0, 0), (2, 0), (0, 1), (2, 1), (1, 2), (0, 3), (2, 6), (1, 4), (3, 5), (0, 6)]
    for row, p in plan:
        _serve(cache, row, prompts[p])
        cache.check()
        for payload in sub.until(publisher):
            raw = msgspec.msgpack.decode(payload)
            assert isinstance(raw, list) and raw[2] == 0  # [ts, events, data_parallel_rank]
            for event in raw[1]:
                tag = event[0] if encoding == "array" else event["type"]
                assert tag in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
            for event in decode(payload).events:
                if isinstance(event, stored_type):
                    assert event.block_size == Z and event.medium == "GPU"
                    assert event.lora_id is None and event.lora_name is None
                    assert len(event.token_ids) == Z * len(event.block_hashes)
                    parent = event.parent_block_hash
                    for j, h in enumerate(event.block_hashes):
                        tokens, want_parent = pages[h]
                        assert event.token_ids[j * Z : (j + 1) * Z] == tokens
                        assert parent == want_parent
                        assert h not in believed, "a block stored twice"
                        believed.add(h)
                        parent = h
                    counts["stored"] += len(event.block_hashes)
                elif isinstance(event, removed_type):
                    assert set(event.block_hashes) <= believed
                    believed -= set(event.block_hashes)
                    counts["removed"] += len(event.block_hashes)
                else:
                    assert isinstance(event, cleared_type)
                    believed.clear()
        assert believed == _indexed(cache), (row, p)
    assert cache.pages.evictions > 0 and counts["removed"] > 0
    # AllBlocksCleared: the subscriber forgets everything.
    publisher.clear()
    (payload,) = sub.until(publisher)
    assert [type(e) for e in decode(payload).events] == [cleared_type]


def test_a_key_in_both_shards_is_removed_with_the_last(wired):
    """Prompt 0 cached by both shards is stored once; evicting it from one shard removes
    nothing, from the other removes it."""
    encoding, cache, publisher, sub = wired
    batch_type, stored_type, removed_type, _ = vllm_structs(encoding == "array")
    decode = msgspec.msgpack.Decoder(batch_type).decode

    def events():
        return [e for p in sub.until(publisher) for e in decode(p).events]

    prompt = list(range(1, 9))  # two full pages
    hashes = [external_hash(k) for k in page_keys(prompt, Z, SALT)]
    _serve(cache, 0, prompt)
    (stored,) = events()
    assert isinstance(stored, stored_type) and stored.block_hashes == hashes
    assert stored.parent_block_hash is None and stored.token_ids == prompt
    _serve(cache, 2, prompt)
    assert events() == []  # the other shard's copy is not news
    keys = page_keys(prompt, Z, SALT)

    def removed() -> set[int]:
        return {h for e in events() if isinstance(e, removed_type) for h in e.block_hashes}

    # Fresh prompts fill shard 0 and evict its copy of the prompt: not removed (shard 1
    # still holds it), though the fresh pages evicted meanwhile are.
    for start in (20, 30):
        _serve(cache, 0, list(range(start, start + 8)))
    assert not set(keys) & set(cache.pages._index[0]) and set(keys) <= set(cache.pages._index[1])
    assert removed().isdisjoint(hashes)
    for start in (40, 50):
        _serve(cache, 2, list(range(start, start + 8)))
    assert removed() >= set(hashes)
    assert _indexed(cache).isdisjoint(hashes)


@pytest.mark.parametrize(
    "text, names",
    [
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', ["endpont", "endpoint"]),
        ('{"publisher": "kafka"}', ["kafka", "zmq"]),
        ('{"buffer_steps": "many"}', ["buffer_steps"]),
        ('{"encoding": "json"}', ["json", "array", "map"]),
        ("[1]", ["JSON object"]),
        ("{", ["not JSON"]),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(text, names):
    with pytest.raises(ConfigError) as e:
        parse_kv_events_config(text)
    for name in names:
        assert name in str(e.value)


def test_events_off_costs_nothing():
    """Disabled (the default), the page table calls no hook: no publisher exists."""
    assert not parse_kv_events_config("{}").publishes
    assert not parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "null"}'
    ).publishes
    cache = CacheManager(PageTable(POOL), SALT, caching=True)
    assert cache.events is None and cache.pages.on_evict is None
    for start in itertools.islice(itertools.count(0, 8), 6):
        _serve(cache, 0, list(range(start, start + 8)))
    assert cache.pages.evictions > 0


def test_serve_refuses_a_bad_config_before_loading(capsys):
    """``jaxpar serve --kv-events-config`` with an unknown key: exit 2 naming it, before the
    checkpoint is read (the path does not exist)."""
    args = ["serve", "--hf", "/nonexistent", "--kv-events-config", '{"endpont": "tcp://*:1"}']
    assert main(args) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "unknown key 'endpont'" in out and "endpoint" in out


def test_replay_resends_buffered_batches_from_a_sequence_number():
    """A DEALER asks the replay ROUTER for every batch from sequence 1: it gets each
    buffered one again, in order, then the end marker (-1, empty)."""
    config = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "endpoint": "inproc://kv-live", '
        '"replay_endpoint": "inproc://kv-replay", "buffer_steps": 8}'
    )
    publisher = KVEventPublisher(config)
    cache = CacheManager(PageTable(POOL), SALT, caching=True)
    cache.events = publisher
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect("inproc://kv-replay")
    try:
        assert publisher.flush(TIMEOUT_MS / 1000)  # the opening AllBlocksCleared, alone
        for row, start in [(0, 0), (2, 10), (0, 20)]:
            _serve(cache, row, list(range(start, start + 8)))
            assert publisher.flush(TIMEOUT_MS / 1000)
        sent = publisher.sent_batches  # a request's events may span two batches
        assert sent >= 4  # AllBlocksCleared at start, then the three requests'
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(TIMEOUT_MS)
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            replies.append((int.from_bytes(seq, "big", signed=True), payload))
            if replies[-1][0] == -1:
                break
        assert [s for s, _ in replies] == [*range(1, sent), -1] and replies[-1][1] == b""
        decode = msgspec.msgpack.Decoder(vllm_structs(True)[0]).decode
        events = [e for _, p in replies[:-1] for e in decode(p).events]
        stored = [e.token_ids for e in events if hasattr(e, "token_ids")]
        assert stored == [list(range(0, 8)), list(range(10, 18)), list(range(20, 28))]
    finally:
        publisher.close()
        dealer.close(linger=0)


def test_the_documented_command_line_parses():
    """The fleet page's ``--kv-events-config`` example is a config the server takes."""
    page = Path(__file__).parents[1] / "scripts" / "docs" / "pages" / "fleet.md"
    (block,) = re.findall(r"^```bash kv-events\n(.*?)^```", page.read_text(), re.M | re.S)
    args = shlex.split(block.replace("\\\n", " "))
    config = parse_kv_events_config(args[args.index("--kv-events-config") + 1])
    assert config.enable_kv_cache_events and config.publisher == "zmq"
    assert (config.endpoint, config.topic) == ("tcp://*:5557", "kv-events")
