"""KV events for routers: what a cache stored and evicted, per tier, in vLLM's KV-event encoding.

A router that places requests by what each instance holds (vLLM's KV-aware routing, NVIDIA Dynamo) subscribes to
the engines' ZMQ publishers and reads msgpack ``KVEventBatch`` frames. ``EventPublisher`` sends kvtier's events
(``HostPrefixCache.take_events()``, ``Index.take_events()``) the same way, so such a router reads kvtier's tiers
as it reads vLLM's own CPU offloading:

- a frame is ``(topic, sequence number as 8 bytes big-endian, payload)``; the sequence counts the publisher's
  batches from 0, so a gap tells a subscriber it missed one;
- the payload is a batch ``[timestamp, [event, ...], data-parallel rank or None]``;
- an event is a map tagged by ``type``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
  ``block_size``, ``lora_id``, ``medium``, ``lora_name``, ``group_idx``) or ``BlockRemoved`` (``block_hashes``,
  ``medium``, ``group_idx``), fields in that order. ``medium`` is ``"CPU"`` for the host pool and ``"STORAGE"``
  for L3; ``block_hashes`` are the pages' keys as bytes. Like vLLM's offloading connector, which knows its blocks
  by key only, a store carries no token ids (``token_ids`` empty, ``block_size`` 0, no parent).

Nothing is recorded unless the cache's ``event_buffer`` setting is > 0; events not taken in time are dropped
oldest first and counted (``events_dropped``). Needs ``msgpack`` and ``pyzmq`` (the ``events`` extra).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvtier import KvEvent
from kvtier.extras import install_hint

EVENTS_EXTRA = install_hint("events")


def event_message(event: KvEvent) -> dict[str, Any]:
    """One event as vLLM's ``BlockStored`` / ``BlockRemoved`` map, fields in vLLM's order."""
    if event.removed:
        return {"type": "BlockRemoved", "block_hashes": list(event.keys), "medium": event.medium, "group_idx": 0}
    return {
        "type": "BlockStored",
        "block_hashes": list(event.keys),
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": event.medium,
        "lora_name": None,
        "group_idx": 0,
    }


def encode_batch(events: Sequence[KvEvent], *, ts: float | None = None, data_parallel_rank: int | None = None) -> bytes:
    """The msgpack payload of one ``KVEventBatch``."""
    msgpack = _module("msgpack")
    batch = [time.time() if ts is None else float(ts), [event_message(e) for e in events], data_parallel_rank]
    return bytes(msgpack.packb(batch, use_bin_type=True))


class EventPublisher:
    """Publishes batches of KV events on a ZMQ PUB socket (``tcp://*:5557`` binds; ``tcp://host:port`` connects).

    ``publish(cache.take_events())`` from the engine loop sends one frame and never blocks: a subscriber that is
    too slow loses frames beyond ``hwm`` (ZMQ's high-water mark), and sees the gap in the sequence numbers. Not
    thread-safe: one thread publishes."""

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        topic: str = "",
        data_parallel_rank: int | None = None,
        hwm: int = 100_000,
    ) -> None:
        zmq = _module("zmq")
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(f"endpoint must be a ZMQ address such as 'tcp://*:5557', got {endpoint!r}")
        if data_parallel_rank is not None and (not isinstance(data_parallel_rank, int) or data_parallel_rank < 0):
            raise ValueError(f"data_parallel_rank must be an int >= 0, got {data_parallel_rank!r}")
        self._zmq = zmq
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(hwm)
        try:
            if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._socket.bind(endpoint)
            else:
                self._socket.connect(endpoint)
        except zmq.ZMQError as e:
            self._socket.close(linger=0)
            raise ValueError(f"endpoint {endpoint!r}: {e}") from None
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self.sent = 0  # batches published (the next sequence number)
        self.dropped = 0  # of which the high-water mark refused

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Sends the events as one batch (nothing for none). A frame the high-water mark refuses is dropped and
        counted (``dropped``); its sequence number is used all the same, so subscribers see the gap."""
        if not events:
            return
        payload = encode_batch(events, data_parallel_rank=self._rank)
        try:
            self._socket.send_multipart([self._topic, self.sent.to_bytes(8, "big"), payload], flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            self.dropped += 1
        self.sent += 1

    def close(self) -> None:
        self._socket.close(linger=0)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _module(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise ImportError(f"KV events need {name}: {EVENTS_EXTRA}") from None
