"""KV events: a subscriber of the published batches rebuilds exactly what each tier holds."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import kvtier
from conftest import needs_mooncake
from kvtier.cache import HostPrefixCache
from kvtier.events import EventPublisher, encode_batch, event_message

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

BLOCK = 4


@pytest.fixture
def pubsub():  # type: ignore[no-untyped-def]
    """A publisher on a free loopback port and a ZMQ subscriber of its topic, yielded once the publisher has the
    subscription (no batch is lost to a slow joiner)."""
    with EventPublisher("tcp://127.0.0.1:*", topic="kv") as pub:
        sub = zmq.Context.instance().socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.RCVTIMEO, 10_000)
            sub.connect(pub.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")
            end = time.monotonic() + 10
            while pub.subscribers < 1:
                assert time.monotonic() < end, "the subscription never reached the publisher"
                time.sleep(0.005)
            yield pub, sub
        finally:
            sub.close(0)


class Router:
    """What a router keeps from the events: the pages of each medium, by key."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = {"CPU": set(), "STORAGE": set()}
        self.groups: set[str] = set()  # L3 objects (groups of 2 pages) by the key of their last page, hex
        self.next_batch = 0

    def receive(self, sub) -> None:  # type: ignore[no-untyped-def]
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and int.from_bytes(seq, "big") == self.next_batch, "a batch went missing"
        self.next_batch += 1
        _, events, rank = msgpack.unpackb(payload)
        assert rank is None
        for e in events:
            held = self.held[e["medium"]]
            ends = {k.hex() for k in e["block_hashes"][1::2]} if e["medium"] == "STORAGE" else set()
            if e["type"] == "BlockStored":
                held.update(e["block_hashes"])
                self.groups |= ends
            else:
                assert e["type"] == "BlockRemoved"
                held.difference_update(e["block_hashes"])
                self.groups -= ends


def ready_pages(ix: kvtier.Index) -> set[bytes]:
    entries = (ix.page_entry(s) for s in range(ix.page_slots))
    return {e[0].to_bytes(16, "big") for e in entries if e is not None and e[2]}


def test_a_batch_is_vllms_kv_event_batch():
    ix = kvtier.Index(kvtier.IndexConfig(2, block_size=BLOCK, min_hit_tokens=0, event_buffer=8))
    ix.complete(ix.plan_store("a", list(range(8))).ticket)
    ix.complete(ix.plan_store("b", list(range(100, 108))).ticket)
    a, b = (ix.chain(r, t) for r, t in (("a", list(range(8))), ("b", list(range(100, 108)))))
    events = ix.take_events()
    assert [(e.seq, e.removed, e.medium) for e in events] == [(0, False, "CPU"), (1, True, "CPU"), (2, False, "CPU")]
    as_bytes = [[k.to_bytes(16, "big") for k in keys] for keys in (a, a[::-1], b)]
    assert [e.keys for e in events] == as_bytes, "stores in prompt order, evictions deepest first"
    ts, got, rank = msgpack.unpackb(encode_batch(events, ts=2.5))
    assert (ts, rank) == (2.5, None)
    assert got[1] == {"type": "BlockRemoved", "block_hashes": as_bytes[1], "medium": "CPU", "group_idx": 0}
    assert list(got[0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "group_idx",
    ], "vLLM's field order"
    assert got[0] == event_message(events[0]) | {"block_hashes": as_bytes[0]}
    assert (got[0]["token_ids"], got[0]["block_size"], got[0]["parent_block_hash"]) == ([], 0, None)
    assert msgpack.unpackb(encode_batch(events, data_parallel_rank=3))[2] == 3


def test_nothing_is_recorded_without_a_buffer_and_a_full_buffer_drops_the_oldest():
    off = kvtier.Index(kvtier.IndexConfig(4, block_size=BLOCK, min_hit_tokens=0))
    off.complete(off.plan_store("a", list(range(8))).ticket)
    assert off.take_events() == [] and off.stats()["events_dropped"] == 0
    ix = kvtier.Index(kvtier.IndexConfig(8, block_size=BLOCK, min_hit_tokens=0, event_buffer=2))
    for i in range(5):
        ix.complete(ix.plan_store(f"r{i}", list(range(100 * i, 100 * i + 4))).ticket)
    assert [e.seq for e in ix.take_events()] == [3, 4], "the newest kept; the gap shows the loss"
    assert ix.stats()["events_dropped"] == 3


@pytest.mark.parametrize("policy", kvtier.EVICTION_POLICIES)
def test_a_subscriber_rebuilds_the_host_pool_under_random_stores_and_evictions(policy, pubsub):
    config = kvtier.IndexConfig(10, block_size=BLOCK, min_hit_tokens=0, eviction_policy=policy, event_buffer=4096)
    ix = kvtier.Index(config)
    pub, sub = pubsub
    router = Router()
    rng = np.random.default_rng(3)
    bases = [rng.integers(0, 1000, size=48, dtype=np.int32) for _ in range(4)]
    pending: list[int] = []
    for i in range(300):
        prompt = bases[int(rng.integers(len(bases)))][: int(rng.integers(4, 48))]
        rid = f"q{i}"
        hit = ix.lookup(rid, prompt).hit_tokens
        if hit and rng.random() < 0.5:
            pending.append(ix.begin_load(rid, hit).ticket)
        pending.append(ix.plan_store(rid, prompt).ticket)
        rng.shuffle(pending)
        while pending and rng.random() < 0.6:
            ticket = pending.pop()
            if rng.random() < 0.15:
                ix.abort(ticket)  # a failed copy: its new pages were never stored
            else:
                ix.complete(ticket)
        ix.forget(rid)
        pub.publish(ix.take_events())
        while router.next_batch < pub.sent:
            router.receive(sub)
        assert router.held["CPU"] == ready_pages(ix)
    assert ix.stats()["pages_evicted"] > 0 and ix.stats()["events_dropped"] == 0 and pub.dropped == 0


def test_l3_puts_and_drops_become_storage_events(mooncake_server, pubsub):
    """A cache whose host pool is too small for its prompts, over a Store that loses objects (removed just before
    a get asks for them, as a Store evicting under memory pressure does): the router's "STORAGE" pages are those of
    the groups put and not found gone, its "CPU" pages the host pool's."""
    needs_mooncake()
    from kvtier.l3 import MooncakeStore
    from kvtier.tools.faults import StoreWrapper

    class Ledger:
        held: set[str] = set()  # the chain key (hex) of the last page of each group the Store holds
        lost = 0
        gets = 0

    store = Ledger()

    class Losing(StoreWrapper):
        def put_many(self, keys, ptrs, sizes):  # type: ignore[no-untyped-def]
            codes = super().put_many(keys, ptrs, sizes)
            store.held.update(k.rsplit("/", 1)[1] for k, c in zip(keys, codes, strict=True) if c == 0 and "/g2/" in k)
            return codes

        def get_many(self, keys, ptrs, sizes):  # type: ignore[no-untyped-def]
            for k in keys:
                store.gets += 1
                if store.gets % 3 == 0 and "/g2/" in k:
                    self.inner.remove(k, True)
                    store.held.discard(k.rsplit("/", 1)[1])
                    store.lost += 1
            return super().get_many(keys, ptrs, sizes)

    def losing(config):  # type: ignore[no-untyped-def]
        return Losing(MooncakeStore(config))

    page_bytes = 64
    gpu = torch.zeros((64, page_bytes), dtype=torch.uint8)
    cache = HostPrefixCache(
        gpu,
        block_size=BLOCK,
        host_bytes=10 * page_bytes,
        preallocate=True,
        min_hit_tokens=0,
        l3="mooncake",
        l3_master=mooncake_server.master_addr,
        l3_group_pages=2,
        l3_deadline_ms=10_000,
        fingerprint_fields={"test": "storage-events"},
        hash_key="storage-events test",
        l3_store=losing,
        event_buffer=1 << 16,
    )
    try:
        end = time.monotonic() + 30
        while not cache.stats()["l3_connected"]:
            assert time.monotonic() < end, "no Store connection"
            time.sleep(0.01)
        pub, sub = pubsub
        router = Router()
        rng = np.random.default_rng(5)
        bases = [rng.integers(0, 1000, size=40, dtype=np.int32) for _ in range(6)]
        for i in range(60):
            prompt = bases[int(rng.integers(len(bases)))][: int(rng.integers(8, 40))]
            rid, table = f"q{i}", list(range(len(prompt) // BLOCK + 1))
            end = time.monotonic() + 30
            while cache.resume(rid, prompt, allocate=lambda table=table: table) < 0:
                assert time.monotonic() < end, "an L3 fetch never finished"
                cache.poll()
            cache.store(rid, prompt, table)
            cache.poll()
            cache.forget(rid)
            pub.publish(cache.take_events())
            while router.next_batch < pub.sent:
                router.receive(sub)
            assert router.held["CPU"] == ready_pages(cache.index)
        # The write-behind puts run on a worker: take events until those of the last put are in.
        end = time.monotonic() + 30
        while router.groups != store.held and time.monotonic() < end:
            cache.poll()
            pub.publish(cache.take_events())
            while router.next_batch < pub.sent:
                router.receive(sub)
        assert router.groups == store.held
        assert len(router.held["STORAGE"]) == 2 * len(router.groups), "the pages of the groups held, none else"
        s = cache.stats()
        assert s["l3_puts_submitted"] > 0 and s["l3_hits"] > 0 and store.lost > 0, (
            {k: v for k, v in s.items() if "l3" in k},
            store.gets,
        )
    finally:
        cache.close()


def test_the_cache_takes_its_policy_and_event_buffer_from_the_environment():
    gpu = torch.zeros((8, 64), dtype=torch.uint8)
    env = {"KVTIER_EVICTION_POLICY": "adaptive", "KVTIER_EVENT_BUFFER": "16"}
    cache = HostPrefixCache(gpu, block_size=BLOCK, host_bytes=4 * 64, preallocate=True, min_hit_tokens=0, env=env)
    assert cache.index.eviction_policy == "adaptive"
    cache.store("r", list(range(8)), [0, 1])
    cache.poll()
    assert [(e.removed, e.medium, len(e.keys)) for e in cache.take_events()] == [(False, "CPU", 2)]
    cache.close()
    with pytest.raises(ValueError, match=r"eviction_policy \(from KVTIER_EVICTION_POLICY='arc'\)"):
        HostPrefixCache(gpu, block_size=BLOCK, env={"KVTIER_EVICTION_POLICY": "arc"})


# A peer that subscribes to many distinct topics, then leaves.
FLOOD = """
import sys, time, zmq
s = zmq.Context.instance().socket(zmq.XSUB)
s.connect(sys.argv[1])
for i in range(int(sys.argv[2])):
    s.send(b"\\x01" + i.to_bytes(8, "big") * 25)
time.sleep(1.0)
s.close(linger=1000)
"""


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_a_subscription_flood_leaves_the_publishers_memory_flat(timed):
    """A peer sends distinct 200-byte subscriptions (400,000 of them in the slow run: 76 MiB) while the engine
    publishes: the publishing process grows by less than 64 MiB, (slow run) publish() stays under 1 ms, and once
    the peer left a subscriber gets the batches."""
    import subprocess
    import sys

    n = 400_000 if timed else 40_000
    ix = kvtier.Index(kvtier.IndexConfig(8, block_size=BLOCK, min_hit_tokens=0, event_buffer=8))
    ix.complete(ix.plan_store("a", list(range(8))).ticket)
    events = ix.take_events()
    with EventPublisher("tcp://127.0.0.1:*", topic="kv") as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:"), pub.endpoint
        before = rss_bytes()
        peer = subprocess.Popen([sys.executable, "-c", FLOOD, pub.endpoint, str(n)])
        took = []
        end = time.monotonic() + 600
        while peer.poll() is None:
            assert time.monotonic() < end, "the flooding peer never finished"
            t0 = time.perf_counter()
            pub.publish(events)
            took.append(time.perf_counter() - t0)
            time.sleep(0.002)
        assert peer.returncode == 0
        grown = rss_bytes() - before
        sub = zmq.Context.instance().socket(zmq.SUB)
        try:
            sub.connect(pub.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")
            end = time.monotonic() + 60
            while not sub.poll(10):
                assert time.monotonic() < end, "no batch reached a subscriber after the flood"
                pub.publish(events)
            assert sub.recv_multipart()[0] == b"kv"
        finally:
            sub.close(0)
    assert grown < 64 << 20, f"the publisher grew by {grown >> 20} MiB"
    if timed:  # the 99.9th percentile: a loaded machine preempts any thread for milliseconds now and then
        p999 = float(np.percentile(took, 99.9))
        assert p999 < 1e-3, f"publish() took {p999 * 1e3:.2f} ms (99.9th percentile), at most {max(took) * 1e3:.2f}"


def test_the_default_endpoint_is_loopback_and_publish_after_close_does_nothing():
    import inspect

    assert inspect.signature(EventPublisher).parameters["endpoint"].default.startswith("tcp://127.0.0.1:")
    ix = kvtier.Index(kvtier.IndexConfig(8, block_size=BLOCK, min_hit_tokens=0, event_buffer=8))
    ix.complete(ix.plan_store("a", list(range(8))).ticket)
    pub = EventPublisher("tcp://127.0.0.1:*")
    pub.close()
    pub.publish(ix.take_events())
    pub.close()
    assert (pub.sent, pub.dropped) == (0, 0)


def test_events_the_cache_dropped_show_as_a_gap_in_the_sequence(pubsub):
    ix = kvtier.Index(kvtier.IndexConfig(8, block_size=BLOCK, min_hit_tokens=0, event_buffer=1))
    pub, sub = pubsub
    ix.complete(ix.plan_store("a", list(range(4))).ticket)
    pub.publish(ix.take_events())
    for i in range(3):  # three events, the buffer keeps one: two dropped before they were published
        ix.complete(ix.plan_store(f"b{i}", list(range(10 * i + 10, 10 * i + 14))).ticket)
    pub.publish(ix.take_events())
    seqs = [int.from_bytes(sub.recv_multipart()[1], "big") for _ in range(2)]
    assert seqs == [0, 2], "the subscriber sees that it missed something"
    assert pub.dropped == 1


def test_endpoints_are_tcp_or_ipc_and_an_ipc_subscriber_gets_batches(tmp_path):
    with pytest.raises(ValueError, match="endpoint"):
        EventPublisher("inproc://kv")
    ix = kvtier.Index(kvtier.IndexConfig(8, block_size=BLOCK, min_hit_tokens=0, event_buffer=8))
    ix.complete(ix.plan_store("a", list(range(8))).ticket)
    with EventPublisher(f"ipc://{tmp_path}/events") as pub:
        sub = zmq.Context.instance().socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.RCVTIMEO, 10_000)
            sub.connect(pub.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            end = time.monotonic() + 10
            while pub.subscribers < 1:
                assert time.monotonic() < end, "the subscription never reached the publisher"
                time.sleep(0.005)
            pub.publish(ix.take_events())
            topic, seq, payload = sub.recv_multipart()
        finally:
            sub.close(0)
    assert (topic, int.from_bytes(seq, "big")) == (b"", 0)
    assert msgpack.unpackb(payload)[1][0]["type"] == "BlockStored"
