"""KV events for routers: what a cache stored and evicted, per tier, in vLLM's KV-event encoding.

A router that places requests by what each instance holds (vLLM's KV-aware routing, NVIDIA Dynamo) subscribes to
the engines' ZMQ publishers and reads msgpack ``KVEventBatch`` frames. ``EventPublisher`` sends kvtier's events
(``HostPrefixCache.take_events()``, ``Index.take_events()``) the same way, so such a router reads kvtier's tiers
as it reads vLLM's own CPU offloading:

- a frame is ``(topic, sequence number as 8 bytes big-endian, payload)``; the sequence counts the publisher's
  batches from 0, so a gap tells a subscriber it missed one (a batch dropped, or events the cache dropped before
  they were published);
- the payload is a batch ``[timestamp, [event, ...], data-parallel rank or None]``;
- an event is a map tagged by ``type``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
  ``block_size``, ``lora_id``, ``medium``, ``lora_name``, ``group_idx``) or ``BlockRemoved`` (``block_hashes``,
  ``medium``, ``group_idx``), fields in that order. ``medium`` is ``"CPU"`` for the host pool and ``"STORAGE"``
  for L3; ``block_hashes`` are the pages' keys as bytes. Like vLLM's offloading connector, which knows its blocks
  by key only, a store carries no token ids (``token_ids`` empty, ``block_size`` 0, no parent).

Nothing is recorded unless the cache's ``event_buffer`` setting is > 0; events not taken in time are dropped
oldest first and counted (``events_dropped``). Needs ``msgpack`` (the ``events`` extra); routers subscribe
with any ZMQ SUB socket.
"""

from __future__ import annotations

import collections
import logging
import queue as queue_module
import selectors
import socket as socket_module
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvtier import BadArgument, KvEvent
from kvtier.extras import install_hint

log = logging.getLogger("kvtier.events")

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


# ZMTP 3.0 (rfc.zeromq.org/spec/23), the wire protocol of ZMQ sockets, as far as a PUB socket speaks it with its
# SUB peers: the greeting of the NULL security mechanism, the READY command, and frames.
_GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
_PEER_TYPES = (b"SUB", b"XSUB")
# A peer's frames are subscriptions and commands; a longer one is refused (the peer is disconnected).
_MAX_FRAME = 4096
# Bytes waiting to be sent to one peer at most: a batch that does not fit is not sent to it (a slow reader loses
# batches, as with ZMQ's high-water mark, and sees the gap in the sequence numbers).
_MAX_PENDING_BYTES = 64 << 20
# Subscriptions one connection may send (a router sends one a topic it reads): a peer that sends more is
# disconnected, so that a flood of them costs the engine's process little time and no memory.
_MAX_SUBSCRIPTIONS = 4096
# How long the sender thread waits for the network before it looks for batches (publish() never wakes it: a
# system call there would give the GIL away on the engine loop).
_TICK_S = 0.005
# Bytes read from a peer at a time: a read's parsing holds the GIL for tens of microseconds at most, so the engine
# thread never waits long for it.
_READ_BYTES = 4096


def _frame(body: bytes, flags: int = 0) -> bytes:
    if len(body) > 255:
        return bytes([flags | _LONG]) + len(body).to_bytes(8, "big") + body
    return bytes([flags, len(body)]) + body


def _command(name: bytes, data: bytes = b"") -> bytes:
    return _frame(bytes([len(name)]) + name + data, _COMMAND)


def _message(parts: Sequence[bytes]) -> bytes:
    return b"".join(_frame(p, _MORE if i < len(parts) - 1 else 0) for i, p in enumerate(parts))


_READY = _command(b"READY", b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"PUB")


class _ProtocolError(Exception):
    pass


class _Peer:
    """One subscriber's connection: what it sent not yet parsed, what waits to be sent to it, and how many of its
    subscriptions match the publisher's topic (all it keeps of them: a peer's subscriptions cost O(1))."""

    def __init__(self, sock: socket_module.socket, topic: bytes) -> None:
        self.sock = sock
        self.topic = topic
        self.inbox = bytearray()
        self.out: collections.deque[bytes] = collections.deque([_GREETING, _READY])
        self.pending = len(_GREETING) + len(_READY)
        self.greeted = False
        self.ready = False
        self.matching = 0
        self.subscriptions = 0
        self.in_message = False  # a frame of a message whose first frame was read

    def feed(self, data: bytes) -> None:
        """Parses what arrived: the greeting, then frames; raises _ProtocolError for anything a SUB never sends."""
        self.inbox += data
        if not self.greeted:
            if len(self.inbox) < len(_GREETING):
                return
            g = bytes(self.inbox[: len(_GREETING)])
            if g[0] != 0xFF or g[9] & 0x01 != 0x01 or g[10] < 3 or g[12:32].rstrip(b"\0") != b"NULL":
                raise _ProtocolError("not a ZMTP 3 peer with the NULL mechanism")
            del self.inbox[: len(_GREETING)]
            self.greeted = True
        while self.inbox:
            flags = self.inbox[0]
            head = 9 if flags & _LONG else 2
            if len(self.inbox) < head:
                return
            size = int.from_bytes(self.inbox[1:head], "big")
            if size > _MAX_FRAME:
                raise _ProtocolError(f"a frame of {size} bytes")
            if len(self.inbox) < head + size:
                return
            body = bytes(self.inbox[head : head + size])
            del self.inbox[: head + size]
            if flags & _COMMAND:
                self._command(body)
            elif not self.ready:
                raise _ProtocolError("a message before READY")
            else:
                if not self.in_message and body[:1] in (b"\x00", b"\x01"):
                    self._subscribe(body[1:], body[:1] == b"\x01")
                self.in_message = bool(flags & _MORE)

    def _command(self, body: bytes) -> None:
        name = body[1 : 1 + body[0]] if body else b""
        data = body[1 + len(name) :]
        if name == b"READY":
            props, at = {}, 0
            while at < len(data):
                n = data[at]
                key = data[at + 1 : at + 1 + n]
                m = int.from_bytes(data[at + 1 + n : at + 5 + n], "big")
                props[key.lower()] = data[at + 5 + n : at + 5 + n + m]
                at += 5 + n + m
            if props.get(b"socket-type") not in _PEER_TYPES:
                raise _ProtocolError(f"a {props.get(b'socket-type')!r} socket cannot subscribe")
            self.ready = True
        elif name in (b"SUBSCRIBE", b"CANCEL") and self.ready:  # ZMTP 3.1's form of a subscription
            self._subscribe(data, name == b"SUBSCRIBE")
        elif name == b"PING":
            self.send(_command(b"PONG", data[2:]))
        elif name == b"ERROR":
            raise _ProtocolError("the peer reported an error")

    def _subscribe(self, prefix: bytes, on: bool) -> None:
        self.subscriptions += 1
        if self.subscriptions > _MAX_SUBSCRIPTIONS:
            raise _ProtocolError(f"more than {_MAX_SUBSCRIPTIONS} subscriptions")
        if self.topic.startswith(prefix):
            self.matching = self.matching + 1 if on else max(0, self.matching - 1)

    def send(self, data: bytes) -> bool:
        if self.pending + len(data) > _MAX_PENDING_BYTES:
            return False
        self.out.append(data)
        self.pending += len(data)
        return True

    def flush(self) -> None:
        while self.out:
            head = self.out[0]
            n = self.sock.send(head)
            self.pending -= n
            if n < len(head):
                self.out[0] = head[n:]
                return
            self.out.popleft()


def _address(endpoint: str) -> tuple[int, Any, str]:
    """The socket family, address and scheme of a ``tcp://host:port`` or ``ipc://path`` endpoint."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "ipc" and rest:
        return socket_module.AF_UNIX, rest, scheme
    host, sep, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not host or not (port == "*" or port.isdigit()):
        raise BadArgument(f"endpoint must be 'tcp://host:port' or 'ipc://path', got {endpoint!r}")
    host = host.strip("[]")
    host = "0.0.0.0" if host == "*" else host  # noqa: S104 - binding every interface is what '*' asks for
    family = socket_module.AF_INET6 if ":" in host else socket_module.AF_INET
    return family, (host, 0 if port == "*" else int(port)), scheme


class EventPublisher:
    """Publishes batches of KV events to ZMQ SUB sockets (routers), as a ZMQ PUB socket does: it speaks ZMTP 3.0
    itself. It binds (routers connect): ``tcp://127.0.0.1:5557`` by default, loopback only; ``tcp://*:5557`` for
    every interface, ``tcp://host:*`` for a free port (``endpoint`` names it), or ``ipc://path``.

    ``publish(cache.take_events())`` from the engine loop only queues the events (a bounded queue of ``queue``
    batches) and returns at once: a sender thread of its own encodes and sends them, as vLLM's publisher does. A
    batch that finds the queue full is dropped and counted (``dropped``); its sequence number is used all the same,
    so subscribers see the gap; so do events the cache dropped from a full ``event_buffer`` before they were
    published (they take a sequence number too). A subscriber that reads too slowly loses batches beyond 64 MiB
    waiting for it.

    What a peer can make the publisher keep is bounded: of its subscriptions only how many match the topic, at
    most ``max_peers`` connections, frames of at most 4 KiB. Thread-safe: any thread may publish; ``close()`` is
    idempotent and bounded, and a ``publish()`` after it does nothing."""

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:5557",
        *,
        topic: str = "",
        data_parallel_rank: int | None = None,
        queue: int = 1024,
        max_peers: int = 64,
    ) -> None:
        _module("msgpack")
        if not isinstance(endpoint, str):
            raise BadArgument(f"endpoint must be 'tcp://host:port' or 'ipc://path', got {endpoint!r}")
        family, address, scheme = _address(endpoint)
        if data_parallel_rank is not None and (not isinstance(data_parallel_rank, int) or data_parallel_rank < 0):
            raise BadArgument(f"data_parallel_rank must be an int >= 0, got {data_parallel_rank!r}")
        for name, value in (("queue", queue), ("max_peers", max_peers)):
            if not isinstance(value, int) or value < 1:
                raise BadArgument(f"{name} must be an int >= 1, got {value!r}")
        listener = socket_module.socket(family, socket_module.SOCK_STREAM)
        try:
            if family != socket_module.AF_UNIX:
                listener.setsockopt(socket_module.SOL_SOCKET, socket_module.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(max_peers)
            listener.setblocking(False)
        except OSError as e:
            listener.close()
            raise ValueError(f"endpoint {endpoint!r}: {e}") from None
        self._listener = listener
        bound = listener.getsockname()
        self.endpoint = f"ipc://{bound}" if scheme == "ipc" else f"tcp://{_host(bound[0])}:{bound[1]}"
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._max_peers = max_peers
        self._peers: dict[socket_module.socket, _Peer] = {}
        self._lock = threading.Lock()
        self._queue: queue_module.Queue[tuple[int, Sequence[KvEvent]] | None] = queue_module.Queue(queue)
        self._closed = False
        self._last_seq: int | None = None
        self.sent = 0  # sequence numbers used (the next one)
        self.dropped = 0  # of which were dropped: the queue full, or events the cache dropped
        self._thread = threading.Thread(target=self._run, name="kvtier-events", daemon=True)
        self._thread.start()

    @property
    def subscribers(self) -> int:
        """Peers subscribed to this publisher's topic now."""
        return sum(1 for p in list(self._peers.values()) if p.ready and p.matching)

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Queues the events as one batch (nothing for none) for the sender thread; never blocks."""
        if not events:
            return
        with self._lock:
            if self._closed:
                return
            if self._last_seq is not None and events[0].seq > self._last_seq + 1:
                self.sent += 1  # events the cache dropped: a sequence number of their own, never sent
                self.dropped += 1
            self._last_seq = events[-1].seq
            seq = self.sent
            self.sent += 1
            try:
                self._queue.put_nowait((seq, events))
            except queue_module.Full:
                self.dropped += 1

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        try:
            while True:
                for key, mask in sel.select(_TICK_S):
                    if key.fileobj is self._listener:
                        self._accept(sel)
                    else:
                        self._serve(sel, self._peers[key.fileobj], mask)  # type: ignore[index]
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue_module.Empty:
                        break
                    if item is None:
                        for peer in list(self._peers.values()):
                            self._serve(sel, peer, selectors.EVENT_WRITE)
                        return
                    self._send(sel, item)
        finally:
            for peer in list(self._peers.values()):
                peer.sock.close()
            self._peers.clear()
            self._listener.close()
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        if len(self._peers) >= self._max_peers:
            sock.close()
            return
        sock.setblocking(False)
        if sock.family != socket_module.AF_UNIX:
            sock.setsockopt(socket_module.IPPROTO_TCP, socket_module.TCP_NODELAY, 1)
        peer = self._peers[sock] = _Peer(sock, self._topic)
        sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        self._serve(sel, peer, selectors.EVENT_WRITE)

    def _serve(self, sel: selectors.BaseSelector, peer: _Peer, mask: int) -> None:
        try:
            if mask & selectors.EVENT_READ:
                data = peer.sock.recv(_READ_BYTES)
                if not data:
                    raise _ProtocolError("closed")
                peer.feed(data)
            if mask & selectors.EVENT_WRITE or peer.out:
                peer.flush()
            sel.modify(peer.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if peer.out else 0))
        except (OSError, _ProtocolError) as e:
            if not isinstance(e, _ProtocolError) or str(e) != "closed":
                log.info("KV event publisher %s: a peer is disconnected: %s", self.endpoint, e)
            sel.unregister(peer.sock)
            del self._peers[peer.sock]
            peer.sock.close()

    def _send(self, sel: selectors.BaseSelector, item: tuple[int, Sequence[KvEvent]]) -> None:
        seq, events = item
        readers = [p for p in self._peers.values() if p.ready and p.matching]
        if not readers:
            return
        frame = _message([self._topic, seq.to_bytes(8, "big"), encode_batch(events, data_parallel_rank=self._rank)])
        for peer in readers:
            if peer.send(frame):
                self._serve(sel, peer, 0)

    def close(self, timeout_s: float = 5.0) -> None:
        """Sends what was queued (within ``timeout_s``) and closes every connection. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue_module.Full:
            pass
        self._thread.join(timeout_s)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _module(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise ImportError(f"KV events need {name}: {EVENTS_EXTRA}") from None
