"""KV events: the prefix cache's pages as vLLM publishes its blocks, over ZMQ.

A router that places requests by prefix (llm-d's KV-cache indexer, and others that read
vLLM's KV events) subscribes to each model server's events: a block stored (a full page
of a prompt indexed by the prefix cache, with its tokens and its parent in the hash
chain), blocks removed (evicted), all blocks cleared. ``jaxpar serve --kv-events-config
JSON`` takes vLLM's keys (:class:`KVEventsConfig`) and publishes what vLLM publishes:

* each message is three ZMQ frames, ``[topic, sequence number (8 bytes, big-endian),
  payload]``, on a PUB socket (bound when the endpoint has ``*``, ``::``, ``ipc://`` or
  ``inproc://``, else connected); with ``replay_endpoint`` a ROUTER answers a request
  ``[start sequence (8 bytes)]`` with every buffered message from there, then
  ``[-1, b""]``, as vLLM's publisher does;
* the payload is msgspec's MessagePack of ``KVEventBatch(ts, events,
  data_parallel_rank)``, an array; each event is tagged with its class name
  (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``): as an array whose first
  element is the tag (``encoding: "array"``, the default: vLLM up to 0.23 and every
  consumer), or as a map with the tag under ``"type"`` (``"map"``: vLLM since its PR
  42892).

The pages are jaxpar's (:mod:`jaxpar.engine._prefix`): a page's hash is its 128-bit
BLAKE2b prefix key, sent as vLLM sends its hashes by default, the key's last 8 bytes as
an unsigned big-endian integer; the first page's parent is None, as in vLLM. A key is
advertised once however many batch shards (and KV groups) hold it, and removed when the
last is evicted. The hook in the engine only queues what changed
(:class:`~jaxpar.engine.KVEventSink`, called with the batcher's lock held); this module's
thread builds the events, encodes and sends them. Nothing is imported or run while the
events are off.

With a host tier (``--kv-offload-gb``, :mod:`jaxpar.engine._host_tier`), a page copied to
host memory is a ``BlockStored`` with ``medium="CPU"`` (no tokens, no parent) and its
eviction from the host a ``BlockRemoved`` with ``medium="CPU"``, as vLLM's CPU offloading
publishes them.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace

from jaxpar.errors import ConfigError

log = logging.getLogger("jaxpar.kv_events")

#: The device tier's name in vLLM's events (``medium``).
MEDIUM = "GPU"
#: The host tier's (``--kv-offload-gb``), as vLLM's CPU offloading names it.
HOST_MEDIUM = "CPU"
#: Seconds the publisher thread waits for news before it looks at replay requests.
POLL_S = 0.1
#: Seconds :meth:`KVEventPublisher.close` waits for the thread to send what is queued.
CLOSE_TIMEOUT_S = 2.0
ENCODINGS = ("array", "map")


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """``--kv-events-config``: vLLM's ``KVEventsConfig`` keys, and ``encoding``.

    Attributes:
        enable_kv_cache_events: publish (default False: nothing is published).
        publisher: ``"zmq"`` (the default once enabled) or ``"null"`` (publish nothing).
        endpoint: the PUB socket's address (default ``tcp://*:5557``: bound on every
            interface).
        replay_endpoint: a ROUTER address that resends buffered messages on request.
        buffer_steps: messages kept for replay.
        hwm: the PUB socket's high-water mark (messages queued per subscriber).
        max_queue_size: accepted as vLLM's key; unused: the queue to the publisher
            thread is unbounded, so the batcher never waits on it.
        topic: the first frame of every message.
        encoding: jaxpar's key: ``"array"`` (each event a tagged array, vLLM <= 0.23) or
            ``"map"`` (a map with ``"type"``, newer vLLM).
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: str = "array"

    def __post_init__(self) -> None:
        if self.publisher not in (None, "zmq", "null"):
            raise ConfigError(
                f"--kv-events-config: publisher {self.publisher!r} is not one jaxpar has; "
                "use 'zmq' (or 'null': publish nothing)"
            )
        if self.encoding not in ENCODINGS:
            raise ConfigError(
                f"--kv-events-config: encoding {self.encoding!r}; use one of {ENCODINGS}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--kv-events-config: {name} must be >= 1")

    @property
    def publishes(self) -> bool:
        """Events are on and go somewhere."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


_TYPES: dict[str, type | tuple[type, ...]] = {
    "enable_kv_cache_events": bool,
    "publisher": (str, type(None)),
    "endpoint": str,
    "replay_endpoint": (str, type(None)),
    "buffer_steps": int,
    "hwm": int,
    "max_queue_size": int,
    "topic": str,
    "encoding": str,
}


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """``--kv-events-config``'s JSON object.

    Raises:
        ConfigError: not a JSON object, an unknown key (the legal ones named), a value
            of the wrong type.
    """
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--kv-events-config: not JSON ({e}); give an object") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"--kv-events-config: a JSON object is needed, got {text!r}")
    for key, value in raw.items():
        if key not in _TYPES:
            raise ConfigError(
                f"--kv-events-config: unknown key {key!r}; the keys are {', '.join(_TYPES)}"
            )
        wanted = _TYPES[key]
        if not isinstance(value, wanted) or (isinstance(value, bool) and wanted is int):
            raise ConfigError(f"--kv-events-config: {key} = {value!r} has the wrong type")
    return KVEventsConfig(**raw)


def external_hash(key: bytes) -> int:
    """A prefix key as vLLM sends a block hash (its int form): the last 8 bytes,
    unsigned big-endian."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


def event_types(encoding: str = "array") -> SimpleNamespace:
    """vLLM's event structs (msgspec), each event as a tagged array or a tagged map; the
    batch is an array either way. A subscriber decodes with the same."""
    import msgspec

    event = {"array_like": encoding == "array", "omit_defaults": True, "gc": False}
    event["tag"] = True  # the class name: first in the array, or under "type" in the map
    optional_int, optional_str = int | None, str | None
    stored = msgspec.defstruct(
        "BlockStored",
        [
            ("block_hashes", list[int]),
            ("parent_block_hash", optional_int),
            ("token_ids", list[int]),
            ("block_size", int),
            ("lora_id", optional_int),
            ("medium", optional_str),
            ("lora_name", optional_str),
        ],
        **event,
    )
    removed = msgspec.defstruct(
        "BlockRemoved", [("block_hashes", list[int]), ("medium", optional_str)], **event
    )
    cleared = msgspec.defstruct("AllBlocksCleared", [], **event)
    batch = msgspec.defstruct(
        "KVEventBatch",
        [
            ("ts", float),
            ("events", list[stored | removed | cleared]),
            ("data_parallel_rank", optional_int, None),
        ],
        array_like=True,
        omit_defaults=True,
        gc=False,
    )
    return SimpleNamespace(
        KVEventBatch=batch, BlockStored=stored, BlockRemoved=removed, AllBlocksCleared=cleared
    )


class _Advertised:
    """Which prefix keys subscribers have been told of: a key counts once per (shard,
    group) holding it; it is stored at its first and removed at its last."""

    def __init__(self, types: SimpleNamespace):
        self.types = types
        self.count: collections.Counter[bytes] = collections.Counter()

    def stored(self, pages, keys: Sequence[bytes]) -> list:
        """BlockStored events for the new keys of one commit, a run of consecutive
        columns each (its first's parent: the column before, None for column 0)."""
        events, run, last = [], None, None
        for _, i, key, tokens in pages:
            self.count[key] += 1
            if self.count[key] > 1:
                run = None
                continue
            if run is None or last != i - 1:
                parent = external_hash(keys[i - 1]) if i else None
                run = self.types.BlockStored(
                    block_hashes=[], parent_block_hash=parent, token_ids=[],
                    block_size=len(tokens), lora_id=None, medium=MEDIUM, lora_name=None,
                )  # fmt: skip
                events.append(run)
            run.block_hashes.append(external_hash(key))
            run.token_ids.extend(int(t) for t in tokens)
            last = i
        return events

    def removed(self, key: bytes) -> int | None:
        """The hash to remove once no (shard, group) holds ``key`` any more, else None."""
        if not self.count[key]:
            self.count.pop(key, None)
            return None  # never advertised (indexed before the publisher started)
        self.count[key] -= 1
        if self.count[key]:
            return None
        del self.count[key]
        return external_hash(key)


class KVEventPublisher:
    """vLLM's ZMQ publisher of KV events, fed by the batcher's page hook
    (:class:`~jaxpar.engine.KVEventSink`): :meth:`stored` and :meth:`removed` only queue;
    a daemon thread batches what is queued into one :class:`KVEventBatch` per wake-up,
    encodes and sends it. Its first message is ``AllBlocksCleared`` (this server's cache
    starts empty), and :meth:`close` sends one too (its cache is gone).

    Raises:
        ConfigError: the endpoint cannot be bound or connected.
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        import msgspec
        import zmq

        self.config = config
        self.types = event_types(config.encoding)
        self._rank = data_parallel_rank
        self._encode = msgspec.msgpack.Encoder().encode
        self._news: queue.SimpleQueue = queue.SimpleQueue()
        self._advertised = _Advertised(self.types)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps
        )
        self._seq = itertools.count()
        self._topic = config.topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            endpoint = config.endpoint
            if any(s in endpoint for s in ("*", "::")) or endpoint.startswith(
                ("ipc://", "inproc://")
            ):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(
                f"--kv-events-config: cannot open {config.endpoint!r} or "
                f"{config.replay_endpoint!r}: {e}"
            ) from e
        #: Batches sent.
        self.sent_batches = 0
        self._news.put(("clear",))
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # --- the batcher's hook (lock held: queue only) ----------------------------------------

    def stored(self, pages, keys: Sequence[bytes]) -> None:
        self._news.put(("stored", pages, keys))

    def removed(self, key: bytes, group: int) -> None:
        self._news.put(("removed", key))

    def offloaded(self, key: bytes, block_size: int) -> None:
        self._news.put(("offloaded", key, block_size))

    def dropped(self, key: bytes) -> None:
        self._news.put(("dropped", key))

    # --- life cycle --------------------------------------------------------------------

    def clear(self) -> None:
        """Publishes ``AllBlocksCleared`` (what vLLM sends when its prefix cache is reset):
        subscribers forget this server's blocks, and only pages indexed from now on are
        advertised."""
        self._news.put(("clear",))

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until everything queued before the call is sent; False on timeout."""
        sent = threading.Event()
        self._news.put(("flush", sent))
        return sent.wait(timeout)

    def close(self) -> None:
        """Sends what is queued and ``AllBlocksCleared``, then stops the thread."""
        self._news.put(("clear",))
        self._news.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=int(CLOSE_TIMEOUT_S * 1000))

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                first = self._news.get(timeout=POLL_S)
            except queue.Empty:
                continue
            news = [first]
            while news[-1] is not None:
                try:
                    news.append(self._news.get_nowait())
                except queue.Empty:
                    break
            stop = news[-1] is None
            try:
                self._send([n for n in news if n is not None])
            except Exception:  # noqa: BLE001 - a bad batch must not stop the events
                log.exception("KV events: a batch could not be sent")
            for item in news:
                if item is not None and item[0] == "flush":
                    item[1].set()
            if stop:
                return

    def _events(self, news: list[tuple]) -> list:
        events: list = []
        for item in news:
            if item[0] == "stored":
                events += self._advertised.stored(item[1], item[2])
            elif item[0] == "removed":
                gone = self._advertised.removed(item[1])
                if gone is None:
                    continue
                if events and isinstance(events[-1], self.types.BlockRemoved):
                    events[-1].block_hashes.append(gone)
                else:
                    events.append(self.types.BlockRemoved(block_hashes=[gone], medium=MEDIUM))
            elif item[0] in ("offloaded", "dropped"):
                events = self._host_event(events, item)
            elif item[0] == "clear":
                self._advertised.count.clear()
                events.append(self.types.AllBlocksCleared())
        return events

    def _host_event(self, events: list, item: tuple) -> list:
        """A host-tier page stored or evicted (``--kv-offload-gb``), as vLLM's CPU
        offloading publishes them: ``medium="CPU"``, a stored block with no tokens and no
        parent (its GPU event carried them); consecutive ones of a kind in one event."""
        kind = self.types.BlockStored if item[0] == "offloaded" else self.types.BlockRemoved
        last = events[-1] if events else None
        if isinstance(last, kind) and last.medium == HOST_MEDIUM:
            last.block_hashes.append(external_hash(item[1]))
        elif item[0] == "offloaded":
            events.append(
                kind(
                    block_hashes=[external_hash(item[1])],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=item[2],
                    lora_id=None,
                    medium=HOST_MEDIUM,
                    lora_name=None,
                )  # fmt: skip
            )
        else:
            events.append(kind(block_hashes=[external_hash(item[1])], medium=HOST_MEDIUM))
        return events

    def _send(self, news: list[tuple]) -> None:
        events = self._events(news)
        if not events:
            return
        batch = self.types.KVEventBatch(
            ts=time.time(), events=events, data_parallel_rank=self._rank
        )
        payload = self._encode(batch)
        seq = next(self._seq)
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.sent_batches += 1

    def _serve_replay(self) -> None:
        """A replay request ``[identity, b"", start]``: every buffered message from
        ``start`` on, then the end marker (sequence -1, empty payload)."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", (-1).to_bytes(8, "big", signed=True), b""))
