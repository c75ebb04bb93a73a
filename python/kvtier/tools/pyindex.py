"""The index bookkeeping in plain Python, as a straightforward engine would write it.

It follows the same rules as the Rust index (``kvtier.Index``, rules in docs/INDEX.md), slot for slot: hashlib
BLAKE2b-128 chains cached per request, ``OrderedDict`` pools with refs and ready flags and both eviction policies
(docs/EVICTION.md), the same lookup, store, load and completion planning, and the same KV events. It is the baseline
of ``kvtier bench index`` and the model the stateful tests check the Rust index against (they give it the Rust
chain through ``chain_fn``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier import IndexConfig

ChainFn = Callable[[str, bytes, Sequence[int]], list[int]]

# The pool keys of pages stored by engine key: this tag and a count mixed by SplitMix64's finalizer.
ENGINE_KEYS = 0xE6 << 120
_U64 = (1 << 64) - 1


def engine_pool_key(count: int) -> int:
    """The pool key of the count-th page stored by engine key (from 1)."""
    z = count
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return ENGINE_KEYS | (z ^ (z >> 31))


def blake2b_chain(block_size: int) -> ChainFn:
    """Per-request chains of BLAKE2b-128 keys, as an engine caches them: a request's tokens only grow until it is
    forgotten, so a known request hashes only the full blocks past those it has (the tokens are not compared)."""
    chains: dict[str, list[int]] = {}

    def chain(request_id: str, namespace: bytes, tokens: Sequence[int]) -> list[int]:
        keys = chains.setdefault(request_id, [])
        prev = keys[-1] if keys else int.from_bytes(hashlib.blake2b(namespace, digest_size=16).digest(), "little")
        for i in range(len(keys), len(tokens) // block_size):
            block = tokens[i * block_size : (i + 1) * block_size]
            h = hashlib.blake2b(prev.to_bytes(16, "little"), digest_size=16)
            h.update(b"".join(t.to_bytes(4, "little") for t in block))
            prev = int.from_bytes(h.digest(), "little")
            keys.append(prev)
        return keys

    chain.forget = chains.pop  # type: ignore[attr-defined]
    return chain


@dataclass
class Entry:
    slot: int
    refs: int
    ready: bool
    segment: int = 0  # 0: probation (the only list of lru), 1: protected
    used: bool = False  # acquired for a use since it was last listed


class Pool:
    """Fixed slots; per segment an ``OrderedDict`` of evictable keys (refs 0 and ready), least recent first; under
    ``adaptive`` also one ``OrderedDict`` of ghost keys per segment (oldest first) and probation's target size in
    sixteenths of a slot."""

    def __init__(self, capacity: int, usable: int, policy: str = "lru") -> None:
        self.capacity = capacity
        self.usable = 0
        self.adaptive = policy == "adaptive"
        self.entries: dict[int, Entry] = {}
        self.lists: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (OrderedDict(), OrderedDict())
        self.ghosts: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (OrderedDict(), OrderedDict())
        self.target = capacity * 16 // 2
        self.listed_at: dict[int, int] = {}
        self.clock = 0
        self.free: list[int] = []
        self.evicted = 0
        self.grow(usable)

    def grow(self, usable: int) -> None:
        usable = min(usable, self.capacity)
        if usable > self.usable:
            self.free = list(range(usable - 1, self.usable - 1, -1)) + self.free
            self.usable = usable

    def evictable(self) -> int:
        return len(self.lists[0]) + len(self.lists[1])

    def available(self) -> int:
        return len(self.free) + self.evictable()

    def lru_order(self) -> list[int]:
        """Evictable keys, least recently listed first."""
        return sorted([*self.lists[0], *self.lists[1]], key=self.listed_at.__getitem__)

    def ready_slot(self, key: int) -> int | None:
        e = self.entries.get(key)
        return e.slot if e is not None and e.ready else None

    def reserve(self, keys: Sequence[int]) -> tuple[list[int], list[int]] | None:
        """(slots, evicted keys), or None (nothing changed) when the keys do not fit."""
        if len(keys) > self.available():
            return None
        slots: list[int] = []
        segments: list[int] = []
        evicted: list[int] = []
        for key in keys:
            segment = self._admit(key)
            if self.free:
                slots.append(self.free.pop())
            else:
                # The call's earlier keys count in probation's size, as entries, before they have their slots.
                old, slot = self._evict(segments.count(0))
                evicted.append(old)
                slots.append(slot)
            segments.append(segment)
        slots.sort()  # the keys get the slots in ascending order
        for key, slot, segment in zip(keys, slots, segments, strict=True):
            self.entries[key] = Entry(slot, 1, False, segment)
        return slots, evicted

    def _admit(self, key: int) -> int:
        if not self.adaptive:
            return 0
        for g, other in ((0, 1), (1, 0)):
            if key in self.ghosts[g]:
                step = max(1, len(self.ghosts[other]) // len(self.ghosts[g]))
                if g == 0:
                    self.target = min(self.target + step, self.capacity * 16)
                else:
                    self.target = max(self.target - step, 0)
                del self.ghosts[g][key]
                return 1
        return 0

    def _evict(self, pending_probation: int = 0) -> tuple[int, int]:
        probation, protected = self.lists
        if probation and protected:
            over = (sum(e.segment == 0 for e in self.entries.values()) + pending_probation) * 16 > self.target
            older = self.listed_at[next(iter(probation))] < self.listed_at[next(iter(protected))]
            segment = 0 if over or older else 1
        else:
            segment = 0 if probation else 1
        key, _ = self.lists[segment].popitem(last=False)
        slot = self.entries.pop(key).slot
        del self.listed_at[key]
        if self.adaptive:
            self.ghosts[segment][key] = None
            if len(self.ghosts[segment]) > self.capacity:
                self.ghosts[segment].popitem(last=False)
        self.evicted += 1
        return key, slot

    def acquire(self, key: int) -> None:
        e = self.entries[key]
        e.refs += 1
        e.used = True
        if e.refs == 1 and e.ready:
            del self.lists[e.segment][key]

    def release(self, key: int) -> None:
        e = self.entries[key]
        assert e.refs > 0, f"release of {key:x} with no references"
        e.refs -= 1
        if e.refs == 0 and e.ready:
            if e.used and self.adaptive:
                e.segment = 1
            e.used = False
            self.listed_at[key] = self.clock
            self.clock += 1
            self.lists[e.segment][key] = None

    def discard(self, key: int) -> None:
        e = self.entries.pop(key)
        assert e.refs == 1 and not e.ready
        self.free.append(e.slot)


@dataclass
class Ticket:
    load_tokens: int | None  # None for a store
    pages: list[tuple[int, bool]] = field(default_factory=list)  # (key, new)
    states: list[tuple[int, bool]] = field(default_factory=list)


class PyIndex:
    """The same rules as ``kvtier.Index``; plans are returned as plain tuples and lists."""

    def __init__(self, config: IndexConfig, *, chain_fn: ChainFn | None = None) -> None:
        self.block_size = block_size = config.block_size
        self.keep_tokens = config.keep_tokens
        self.min_hit_tokens = config.min_hit_tokens
        self.state_lookback_blocks = config.state_lookback_blocks
        self.ring_slack = config.ring_slack
        self.pages = Pool(config.page_slots, config.page_slots, config.eviction_policy)
        self.states = Pool(config.state_slots, config.state_slots, config.eviction_policy)
        self.event_buffer = config.event_buffer
        self.events: list[tuple[int, bool, list[bytes]]] = []  # (seq, removed, page keys as bytes); host pages only
        self.next_seq = 0
        self.events_dropped = 0
        self.has_states = config.state_slots > 0
        self.chain_fn = chain_fn or blake2b_chain(block_size)
        self.names: dict[int, bytes] = {}  # the engine's bytes of engine-keyed pages
        self.engine_keys: dict[bytes, int] = {}  # an engine key -> the pool key of the page last stored by it
        self.engine_keys_given = 0
        self.chains: dict[str, list[int]] = {}
        self.counted: set[str] = set()
        self.tickets: dict[int, Ticket] = {}
        # Engine keys being copied by key stores, each with the stores owed a report of it (oldest first), and each
        # store's [keys owed, whether one was reported failed].
        self.owed: dict[bytes, list[int]] = {}
        self.owed_count: dict[int, list] = {}
        self.next_ticket = 1
        self.stats = dict.fromkeys(
            [
                "lookups",
                "hits",
                "hit_tokens",
                "lookup_tokens",
                "deferred",
                "stores",
                "store_skipped",
                "pages_stored",
                "pages_loaded",
                "states_stored",
                "states_loaded",
                "errors",
            ],
            0,
        )

    def chain(self, request_id: str, tokens: Sequence[int], namespace: bytes = b"") -> list[int]:
        keys = self.chain_fn(request_id, namespace, tokens)
        self.chains[request_id] = keys
        return keys

    def lookup(self, request_id: str, tokens: Sequence[int], namespace: bytes = b"") -> tuple[int, int, int]:
        """(hit_tokens, ready_pages, limit_pages)"""
        keys = self.chain(request_id, tokens, namespace)
        if request_id not in self.counted:
            self.counted.add(request_id)
            self.stats["lookups"] += 1
            self.stats["lookup_tokens"] += len(tokens)
        limit = max(len(tokens) - self.keep_tokens, 0) // self.block_size
        ready = 0
        while ready < limit and self.pages.ready_slot(keys[ready]) is not None:
            ready += 1
        hit = ready
        if self.has_states:
            hit = next((p for p in range(ready, 0, -1) if self.states.ready_slot(keys[p - 1]) is not None), 0)
        hit_tokens = hit * self.block_size
        if hit_tokens < max(self.min_hit_tokens, 1):
            hit_tokens = 0
        return hit_tokens, ready, limit

    def defer(self, request_id: str) -> None:
        if request_id not in self.chains:
            raise KeyError(request_id)
        self.stats["deferred"] += 1

    def begin_load(self, request_id: str, hit_tokens: int) -> tuple[int, list[int], int | None]:
        """(ticket, page_slots, state_slot); raises LookupError when stale."""
        keys = self.chains[request_id]
        n = hit_tokens // self.block_size
        assert hit_tokens > 0 and hit_tokens % self.block_size == 0 and n <= len(keys)
        slots = [self.pages.ready_slot(k) for k in keys[:n]]
        state = self.states.ready_slot(keys[n - 1]) if self.has_states else None
        if any(s is None for s in slots) or (self.has_states and state is None):
            raise LookupError(f"lookup of request {request_id!r} is stale")
        for k in keys[:n]:
            self.pages.acquire(k)
        if self.has_states:
            self.states.acquire(keys[n - 1])
        self.stats["hits"] += 1
        self.stats["hit_tokens"] += hit_tokens
        t = Ticket(hit_tokens, [(k, False) for k in keys[:n]], [(keys[n - 1], False)] if self.has_states else [])
        return self._issue(t), slots, state  # type: ignore[return-value]

    # Whole: it follows Index::plan_store (rust/index/mod.rs) step by step, so the two read side by side.
    def plan_store(
        self, request_id: str, tokens: Sequence[int], seq_len: int | None = None, namespace: bytes = b""
    ) -> tuple[int, list[int], list[int], list[int], list[int]]:
        """(ticket, page_indices, page_slots, state_boundaries, state_slots)"""
        seq_len = len(tokens) if seq_len is None else seq_len
        keys = self.chain(request_id, tokens, namespace)
        bs = self.block_size
        if len(keys) * bs < self.min_hit_tokens:  # could never hit: store nothing
            return self._issue(Ticket(None)), [], [], [], []
        # Pages: acquire the ready ones first (a reservation must not evict the prompt's own prefix).
        held, missing = [], []
        for i, k in enumerate(keys):
            e = self.pages.entries.get(k)
            if e is None:
                missing.append(i)
            elif e.ready:
                self.pages.acquire(k)
                held.append(i)
        pages_wanted = bool(missing)
        fit = min(len(missing), self.pages.available())
        run = missing[fit] if fit < len(missing) else len(keys)  # pages 0..run present once `fit` are in
        # States: the deepest `state_lookback_blocks` boundaries, >= min_hit, pages present, still in the ring;
        # present ones acquired before any is reserved, missing ones reserved deepest first.
        states: list[tuple[int, bool]] = []
        boundaries: list[int] = []
        state_slots: list[int] = []
        states_wanted = False
        deepest = 0
        if self.has_states:
            lowest = max(len(keys) + 1 - self.state_lookback_blocks, 1, -(-self.min_hit_tokens // bs))
            absent = []
            for blocks in range(run, lowest - 1, -1):
                if blocks * bs + self.ring_slack < seq_len:
                    break
                k = keys[blocks - 1]
                e = self.states.entries.get(k)
                if e is None:
                    absent.append(blocks)
                    continue
                if e.ready:
                    self.states.acquire(k)
                    states.append((k, False))
                deepest = max(deepest, blocks)
            states_wanted = bool(absent)
            for blocks in absent:
                got = self.states.reserve([keys[blocks - 1]])
                if got is not None:
                    states.append((keys[blocks - 1], True))
                    boundaries.append(blocks * bs)
                    state_slots.append(got[0][0])
                    deepest = max(deepest, blocks)
        # A partial run with states is kept only up to the deepest boundary whose state is stored.
        take = fit
        if fit < len(missing) and self.has_states:
            take = sum(1 for i in missing[:fit] if i < deepest)
        missing = missing[:take]
        new_slots, evicted = self.pages.reserve([keys[i] for i in missing]) or ([], [])
        self._record(True, evicted)
        pages = sorted([(i, False) for i in held] + [(i, True) for i in missing])
        if new_slots or state_slots:
            self.stats["stores"] += 1
        elif pages_wanted or states_wanted:
            self.stats["store_skipped"] += 1
        t = Ticket(None, [(keys[i], new) for i, new in pages], states)
        return self._issue(t), missing, new_slots, boundaries, state_slots

    def _name(self, key: int) -> bytes:
        """A page key as events and evictions name it: the engine's key, else the chain key's 16 bytes."""
        return self.names.get(key) or key.to_bytes(16, "big")

    def _record(self, removed: bool, keys: list[int]) -> None:
        if not self.event_buffer or not keys:
            return
        if len(self.events) == self.event_buffer:
            self.events.pop(0)
            self.events_dropped += 1
        self.events.append((self.next_seq, removed, [self._name(k) for k in keys]))
        self.next_seq += 1

    def _pool_key(self, key: bytes) -> int | None:
        """The pool key of the page stored by an engine key, while that page is on the host."""
        k = self.engine_keys.get(bytes(key))
        return k if k in self.pages.entries else None

    def _entry(self, key: bytes) -> Entry | None:
        """The host entry of the page stored by an engine key, if it is on the host."""
        k = self._pool_key(key)
        return None if k is None else self.pages.entries[k]

    def lookup_keys(self, keys: Sequence[bytes]) -> tuple[int, bool]:
        """(hits, pending): the leading engine keys ready on the host, and whether the next is being stored."""
        entries = [self._entry(key) for key in keys]
        hits = 0
        while hits < len(entries) and (e := entries[hits]) is not None and e.ready:
            hits += 1
        self.stats["lookups"] += 1
        self.stats["lookup_tokens"] += len(keys) * self.block_size
        return hits, hits < len(entries) and entries[hits] is not None

    def load_keys(self, keys: Sequence[bytes]) -> tuple[int, list[int]]:
        """(ticket, page_slots); raises ValueError unless every key is ready (and none repeats)."""
        found = [self._pool_key(k) for k in keys]
        pool_keys = [k for k in found if k is not None and self.pages.entries[k].ready]
        if not keys or len(pool_keys) < len(keys) or len(set(pool_keys)) < len(pool_keys):
            raise ValueError("load_keys needs distinct keys, every one ready")
        for k in pool_keys:
            self.pages.acquire(k)
        hit_tokens = len(keys) * self.block_size
        self.stats["hits"] += 1
        self.stats["hit_tokens"] += hit_tokens
        slots = [self.pages.entries[k].slot for k in pool_keys]
        return self._issue(Ticket(hit_tokens, [(k, False) for k in pool_keys])), slots

    def key_state(self, key: bytes) -> int:
        """0: no page of the engine key on the host, 1: being stored, 2: ready (not counted as a lookup)."""
        e = self._entry(key)
        return 0 if e is None else 2 if e.ready else 1

    def complete_keys(self, keys: Iterable[bytes], ok: bool) -> tuple[int, list[tuple[int, bool]]]:
        """(matched, due): each key reported settles one report the oldest store owed it; stores owed nothing
        more are due, oldest first, with whether one of their keys failed."""
        keys = list(keys)
        for i, key in enumerate(keys):
            if not 1 <= len(key) <= 64:
                raise ValueError(f"keys[{i}]: an engine key must be 1 to 64 bytes, got {len(key)} bytes")
        matched, due = 0, []
        for key in keys:
            stores = self.owed.get(bytes(key))
            if not stores:
                continue
            t = stores.pop(0)
            if not stores:
                del self.owed[bytes(key)]
            matched += 1
            count = self.owed_count[t]
            count[0] -= 1
            count[1] = count[1] or not ok
            if count[0] == 0:
                due.append((t, count[1]))
        return matched, sorted(due)

    def _settle_owed(self, ticket: int) -> None:
        if self.owed_count.pop(ticket, None) is None:
            return
        for key in list(self.owed):
            self.owed[key] = [t for t in self.owed[key] if t != ticket]
            if not self.owed[key]:
                del self.owed[key]

    def store_keys(self, keys: Sequence[bytes]) -> tuple[int, list[int] | None, list[int], list[bytes]] | None:
        """(ticket, indices, slots, evicted engine keys), or None when the pool cannot take every new key; the
        indices are None when every key is copied, in order."""
        held: dict[int, None] = {}  # ready keys, in order
        new: dict[bytes, int] = {}  # engine key with no page on the host -> its first index
        for i, name in enumerate(keys):
            k = self._pool_key(name)
            if k is None:
                new.setdefault(bytes(name), i)
            elif self.pages.entries[k].ready:
                held[k] = None
        missing = list(new.values())
        idle = sum(1 for k in held if self.pages.entries[k].refs == 0)
        if len(missing) > self.pages.available() - idle:
            return None
        for k in held:
            self.pages.acquire(k)
        # Each page stored gets a pool key never given before.
        new_keys = [engine_pool_key(self.engine_keys_given + n + 1) for n in range(len(missing))]
        self.engine_keys_given += len(missing)
        slots, evicted = self.pages.reserve(new_keys) or ([], [])
        evicted_names = [self._name(k) for k in evicted]
        self._record(True, evicted)
        for i, k in zip(missing, new_keys, strict=True):
            self.names[k] = bytes(keys[i])
            self.engine_keys[bytes(keys[i])] = k
        t = Ticket(None, [(k, False) for k in held] + [(k, True) for k in new_keys])
        tid = self._issue(t)
        for i in missing:
            self.owed.setdefault(bytes(keys[i]), []).append(tid)
        self.owed_count[tid] = [len(missing), False]
        return tid, None if missing == list(range(len(keys))) else missing, slots, evicted_names

    def take_events(self) -> list[tuple[int, bool, list[bytes]]]:
        out, self.events = self.events, []
        return out

    def _issue(self, t: Ticket) -> int:
        tid = self.next_ticket
        self.next_ticket += 1
        self.tickets[tid] = t
        return tid

    def complete(self, ticket: int) -> None:
        t = self.tickets.pop(ticket)
        self._settle_owed(ticket)
        for k, new in reversed(t.pages):
            if new:
                self.pages.entries[k].ready = True
                self.stats["pages_stored"] += 1
            self.pages.release(k)
        self._record(False, [k for k, new in t.pages if new])
        for k, new in t.states:
            if new:
                self.states.entries[k].ready = True
                self.stats["states_stored"] += 1
            self.states.release(k)
        if t.load_tokens is not None:
            self.stats["pages_loaded"] += len(t.pages)
            self.stats["states_loaded"] += len(t.states)

    def abort(self, ticket: int) -> None:
        t = self.tickets.pop(ticket)
        self._settle_owed(ticket)
        for pool, entries in ((self.pages, t.pages), (self.states, t.states)):
            for k, new in entries:
                if new:
                    pool.discard(k)
                else:
                    pool.release(k)
        if t.load_tokens is not None:
            self.stats["hits"] -= 1
            self.stats["hit_tokens"] -= t.load_tokens

    def forget(self, request_id: str) -> bool:
        self.counted.discard(request_id)
        forget = getattr(self.chain_fn, "forget", None)
        if forget is not None:
            forget(request_id, None)
        return self.chains.pop(request_id, None) is not None
