"""The L3 tier of a host prefix cache: page groups and states shared through Mooncake Store.

Write-behind: when a store's host copies complete, the prompt's whole groups of ``group_pages`` pages (one object
per group, named by the chain key of its last page) and its group-aligned states are put straight from the host
pools on the put worker, with the host entries held until the put returns. Keys in the seen-set are skipped, and
one exists() call drops those another instance put already (the first writer wins, so sending them is waste).

Read: on a host miss the cache asks ``start_fetch``; the get worker asks the Store which groups beyond the host's
reach exist, takes the longest run (and, for models with state, the deepest group-aligned boundary with a state on
the host or in the Store), reserves fresh host slots and gets the objects into them. Meanwhile the request answers
"retry later" until the fetch is done or its deadline passed; then the ordinary host hit path runs.

The engine loop never calls the Store: it only submits work to the two workers and reads futures. Any Store
error, short or oversized read, object lost between exists and get, or timeout drops that fetch (its slots are
freed) or that put, and is counted; the breaker in ``MooncakeStore`` makes a Store that is down fail fast.

Registration: each HostPool's whole reserved range is registered once, when the Store is connected. That suffices
for TCP; RDMA pins what it registers, so it would need per-chunk registration as the pools grow.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier import Index, SeenSet, fingerprint, group_key_string, state_key_string
from kvtier.copy import HostPool
from kvtier.settings import CacheSettings

log = logging.getLogger("kvtier.l3")

FORMAT_VERSION = "1"

# How long to wait before the next connection attempt after a failed one (doubling up to the maximum).
_CONNECT_BACKOFF_S = (0.5, 10.0)


def layout_fingerprint(fields: Mapping[str, str]) -> str:
    """The fingerprint of every field that changes the bytes of a page or a state, plus the format version."""
    return fingerprint({"format": FORMAT_VERSION, **{k: str(v) for k, v in fields.items()}})


@dataclass
class _Stored:
    """What a store ticket wrote, kept until its copies complete (forget() may drop the chain meanwhile)."""

    keys: list[int]
    state_boundaries: list[int]


@dataclass
class _Fetch:
    future: Future[Any] | None
    deadline: float


class L3Tier:
    """Puts and gets of one cache's host pools through Mooncake Store; see the module docstring.

    ``store_factory`` builds the Store client (default: ``MooncakeStore`` from the settings); it runs on the get
    worker, so a missing master never delays the caller.
    """

    def __init__(
        self,
        settings: CacheSettings,
        *,
        index: Index,
        page_pool: HostPool,
        state_pool: HostPool | None,
        block_size: int,
        fingerprint_fields: Mapping[str, str],
        store_factory: Callable[[], Any] | None = None,
    ) -> None:
        from kvtier.l3.store import StoreConfig, Worker

        if settings.l3_master is None:
            raise ValueError("the L3 tier needs l3_master (host:port)")
        self.settings = settings
        self.group_pages = settings.l3_group_pages
        self.deadline_s = settings.l3_deadline_ms / 1e3
        self.index = index
        self.pages = page_pool
        self.states = state_pool
        self.block_size = block_size
        self.page_bytes = page_pool.slot_bytes
        self.state_bytes = state_pool.slot_bytes if state_pool is not None else 0
        self.fingerprint = layout_fingerprint(fingerprint_fields)
        self.config = StoreConfig(
            settings.l3_master,
            metadata_server=settings.l3_metadata_server,
            protocol=settings.l3_protocol,
            global_segment_bytes=settings.l3_segment_bytes,
            local_buffer_bytes=settings.l3_buffer_bytes,
        )
        self._factory = store_factory or self._default_store
        self.store: Any = None
        self._registered: list[int] = []
        # Pages of a fetched group that the host holds already are read into this scratch buffer and dropped.
        self._scratch = np.zeros(self.group_pages * self.page_bytes, dtype=np.uint8)
        self._seen = SeenSet(settings.l3_seen_keys)
        self._lock = threading.Lock()
        self._stored: dict[int, _Stored] = {}
        self._fetches: dict[str, _Fetch | None] = {}  # request -> fetch in flight, None once consulted
        self._connect_at = 0.0
        self._connect_backoff = _CONNECT_BACKOFF_S[0]
        self._connecting: Future[Any] | None = None
        self._stats = dict.fromkeys(
            ("lookups", "hits", "misses", "pages_loaded", "states_loaded", "bytes_loaded", "gets_failed",
             "deadline_passed", "puts_submitted", "puts_present", "puts_failed", "bytes_put", "errors"), 0)  # fmt: skip
        self._stats_f = {"get_seconds": 0.0, "exists_seconds": 0.0}
        self._gets = Worker("kvtier-l3-get", max_pending=256)
        self._puts = Worker("kvtier-l3-put", max_pending=4096)
        self._maybe_connect()

    # Connection

    def _default_store(self) -> Any:
        from kvtier.l3.store import MooncakeStore

        return MooncakeStore(self.config)

    def _maybe_connect(self) -> None:
        """Submits a connection attempt when none is running and the back-off is due (engine loop: no waiting)."""
        with self._lock:
            if self.store is not None or self._connecting is not None or time.monotonic() < self._connect_at:
                return
            try:
                self._connecting = self._gets.submit(self._connect)
            except Exception:  # noqa: BLE001 - closed or full: try again later
                self._connect_at = time.monotonic() + self._connect_backoff

    def _connect(self) -> None:
        try:
            store = self._factory()
            try:
                for pool in (self.pages, self.states):
                    if pool is not None:
                        store.register(pool.base_ptr, pool.slots * pool.slot_bytes)
                        self._registered.append(pool.base_ptr)
                store.register(self._scratch.ctypes.data, self._scratch.nbytes)
                self._registered.append(self._scratch.ctypes.data)
            except BaseException:
                self._registered.clear()
                store.close(timeout_s=3.0)
                raise
            with self._lock:
                self.store = store
                self._connect_backoff = _CONNECT_BACKOFF_S[0]
            log.info("L3 tier connected to %s (fingerprint %s)", self.config.master_addr, self.fingerprint)
        except Exception as e:  # noqa: BLE001 - no Store: the cache serves from the host, and retries later
            with self._lock:
                self._connect_at = time.monotonic() + self._connect_backoff
                self._connect_backoff = min(self._connect_backoff * 2, _CONNECT_BACKOFF_S[1])
            self._count("errors")
            log.warning("L3 tier: no Store at %s (%s); retrying later", self.config.master_addr, e)
        finally:
            with self._lock:
                self._connecting = None

    def wait_connected(self, timeout_s: float) -> bool:
        """Waits until the Store is connected and the pools registered (tests, demos); returns whether it is."""
        end = time.monotonic() + timeout_s
        while self.store is None and time.monotonic() < end:
            self._maybe_connect()
            fut = self._connecting
            if fut is not None:
                try:
                    fut.result(max(0.0, end - time.monotonic()))
                except Exception:  # noqa: BLE001 - the attempt logged its own failure
                    pass
            else:
                time.sleep(0.01)
        return self.store is not None

    # Keys and addresses

    def group_key(self, last_page_key: int) -> str:
        return str(group_key_string(self.fingerprint, self.group_pages, last_page_key))

    def state_key(self, page_key: int) -> str:
        return str(state_key_string(self.fingerprint, page_key))

    def _page_ptr(self, slot: int) -> int:
        # SAFETY: the slot is held or reserved in the index, so the pool memory stays allocated and unused by
        # anything else until the ticket completes or aborts; the pool itself outlives the tier (see close()).
        return self.pages.base_ptr + slot * self.page_bytes

    def _state_ptr(self, slot: int) -> int:
        assert self.states is not None
        return self.states.base_ptr + slot * self.state_bytes

    # Engine-loop calls: none of them waits for the Store

    def waiting(self, request_id: str) -> bool:
        """True while this request's fetch runs and its deadline has not passed (answer "retry later")."""
        f = self._fetches.get(request_id)
        if f is None:
            return False
        if f.future is not None and not f.future.done() and time.monotonic() < f.deadline:
            return True
        if f.future is not None and not f.future.done():
            self._count("deadline_passed")
        self._fetches[request_id] = None
        return False

    def start_fetch(self, request_id: str, keys_of: Callable[[], list[int]], ready_pages: int, limit_pages: int) -> bool:
        """Starts this request's one L3 consultation when whole groups lie beyond the host's ready run; True when
        a fetch was started (the request should retry later)."""
        if request_id in self._fetches:
            return False
        g0, g1 = ready_pages // self.group_pages, limit_pages // self.group_pages
        if g1 <= g0:
            return False
        self._fetches[request_id] = None
        if self.store is None:
            self._maybe_connect()
            return False
        try:
            # The chain keys are read on the worker: turning a long chain into Python ints is not loop work.
            fut = self._gets.submit(lambda: self._fetch(keys_of()[: g1 * self.group_pages], g0, g1))
        except Exception:  # noqa: BLE001 - a full or closed worker: the request goes ahead without L3
            return False
        self._count("lookups")
        self._fetches[request_id] = _Fetch(fut, time.monotonic() + self.deadline_s)
        return True

    def note_store(self, ticket: int, keys: list[int], state_boundaries: Sequence[int]) -> None:
        """Remembers what a store ticket writes, so that its completion can put it."""
        with self._lock:
            self._stored[ticket] = _Stored(keys, list(state_boundaries))

    def completed(self, ticket: int) -> None:
        """A ticket's host copies completed: submit the put of a stored prompt's new groups and states."""
        with self._lock:
            stored = self._stored.pop(ticket, None)
        if stored is None:
            return
        if self.store is None:
            self._maybe_connect()
            return
        try:
            self._puts.submit(self._put, stored)
        except Exception:  # noqa: BLE001 - a full or closed worker drops this write-behind
            self._count("puts_failed")

    def dropped(self, ticket: int) -> None:
        """A store ticket was aborted: nothing to put."""
        with self._lock:
            self._stored.pop(ticket, None)

    def forget(self, request_id: str) -> None:
        self._fetches.pop(request_id, None)

    # Worker jobs

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def _new_keys(self, keys: Sequence[str]) -> list[bool]:
        """Marks keys seen; True for those not seen before."""
        with self._lock:
            return [self._seen.insert(_seen_id(k)) for k in keys]

    def _unsee(self, key: str) -> None:
        with self._lock:
            self._seen.remove(_seen_id(key))

    def _put(self, stored: _Stored) -> None:
        from kvtier.l3.store import L3Error, L3Timeout

        G, keys = self.group_pages, stored.keys
        groups = list(range(len(keys) // G))
        gkeys = [self.group_key(keys[(g + 1) * G - 1]) for g in groups]
        fresh = self._new_keys(gkeys)
        groups = [g for g, new in zip(groups, fresh) if new]
        state_pages = self._group_aligned(stored.state_boundaries, len(keys))
        skeys = [self.state_key(keys[p - 1]) for p in state_pages]
        sfresh = self._new_keys(skeys)
        state_pages = [p for p, new in zip(state_pages, sfresh) if new]
        if not groups and not state_pages:
            return
        page_keys = [keys[i] for g in groups for i in range(g * G, (g + 1) * G)]
        ticket, pslots, sslots = self.index.hold(page_keys, [keys[p - 1] for p in state_pages])
        out_keys: list[str] = []
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        for j, g in enumerate(groups):
            slots = pslots[j * G : (j + 1) * G]
            key = self.group_key(keys[(g + 1) * G - 1])
            if any(s is None for s in slots):
                self._unsee(key)  # a page left the host: another prompt may put this group later
                continue
            out_keys.append(key)
            ptrs.append([self._page_ptr(s) for s in slots])  # type: ignore[arg-type]
            sizes.append([self.page_bytes] * G)
        for p, s in zip(state_pages, sslots):
            key = self.state_key(keys[p - 1])
            if s is None:
                self._unsee(key)
                continue
            out_keys.append(key)
            ptrs.append([self._state_ptr(s)])
            sizes.append([self.state_bytes])
        if out_keys:
            # Another instance may have put these already (the first writer wins): one exists() round trip
            # costs far less than sending the bytes again.
            try:
                present = self.store.exists_many(out_keys)
            except L3Error:
                present = [0] * len(out_keys)
            kept = [i for i, code in enumerate(present) if code != 1]
            self._count("puts_present", len(out_keys) - len(kept))
            out_keys, ptrs, sizes = [out_keys[i] for i in kept], [ptrs[i] for i in kept], [sizes[i] for i in kept]
        if not out_keys:
            self.index.complete(ticket)
            return
        self._count("puts_submitted", len(out_keys))
        try:
            codes = self.store.put_many(out_keys, ptrs, sizes)
        except L3Timeout as e:
            # The native put may still read the slots: release them only once it returned.
            e.pending.add_done_callback(lambda _f: self.index.complete(ticket))
            self._put_failed(out_keys, e)
            return
        except L3Error as e:
            self.index.complete(ticket)
            self._put_failed(out_keys, e)
            return
        self.index.complete(ticket)
        for key, code, sz in zip(out_keys, codes, sizes):
            if code == 0:
                self._count("bytes_put", sum(sz))
            else:
                self._count("puts_failed")
                self._unsee(key)

    def _group_aligned(self, boundaries: Sequence[int], n_keys: int) -> list[int]:
        """The state boundaries (tokens) at a group's end, as page counts; a read only uses those."""
        if self.states is None:
            return []
        pages = [b // self.block_size for b in boundaries if b % self.block_size == 0]
        return [p for p in pages if 0 < p <= n_keys and p % self.group_pages == 0]

    def _put_failed(self, keys: list[str], e: Exception) -> None:
        self._count("puts_failed", len(keys))
        self._count("errors")
        for key in keys:
            self._unsee(key)
        log.warning("L3 put of %d objects failed: %s", len(keys), e)

    def _fetch(self, keys: list[int], g0: int, g1: int) -> None:
        """Exists over groups g0..g1-1 (and their end states), then one get of the longest usable run."""
        from kvtier.l3.store import L3Error, L3Timeout

        G = self.group_pages
        gkeys = [self.group_key(keys[(g + 1) * G - 1]) for g in range(g0, g1)]
        # End states of the candidate groups that the host lacks; models without state need none.
        need_state = self.states is not None
        state_on_host = [need_state and self.index.state_slot(keys[(g + 1) * G - 1]) is not None
                         for g in range(g0, g1)]  # fmt: skip
        ask = [i for i, on_host in enumerate(state_on_host) if need_state and not on_host]
        skeys = [self.state_key(keys[(g0 + i + 1) * G - 1]) for i in ask]
        t0 = time.perf_counter()
        try:
            codes = self.store.exists_many(gkeys + skeys)
        except L3Error as e:
            self._get_failed(f"exists: {e}")
            return
        finally:
            self._add_seconds("exists_seconds", time.perf_counter() - t0)
        run = 0
        while run < len(gkeys) and codes[run] == 1:
            run += 1
        self._new_keys(gkeys[:run])  # in the Store: never put them again
        state_in_store = dict.fromkeys(range(len(gkeys)), False)
        for i, code in zip(ask, codes[len(gkeys) :]):
            state_in_store[i] = code == 1
        n, state_i = run, None
        if need_state:
            usable = [i for i in range(run) if state_on_host[i] or state_in_store[i]]
            n = usable[-1] + 1 if usable else 0
            state_i = usable[-1] if usable and not state_on_host[usable[-1]] else None
        if n == 0:
            self._count("misses")
            return
        page_keys = keys[g0 * G : (g0 + n) * G]
        state_keys = [keys[(g0 + state_i + 1) * G - 1]] if state_i is not None else []
        plan = self.index.plan_fetch(page_keys, state_keys)
        if plan is None:
            self._count("misses")  # the host pools cannot make room now
            return
        ticket, pslots, sslots = plan
        out_keys: list[str] = []
        ptrs: list[list[int]] = []
        for j in range(n):
            slots = pslots[j * G : (j + 1) * G]
            if all(s is None for s in slots):
                continue  # the host has this whole group already
            scratch = self._scratch.ctypes.data
            out_keys.append(gkeys[j])
            ptrs.append([self._page_ptr(s) if s is not None else scratch + i * self.page_bytes
                         for i, s in enumerate(slots)])  # fmt: skip
        sizes = [[self.page_bytes] * G for _ in out_keys]
        if state_i is not None and sslots[0] is not None:
            out_keys.append(skeys[ask.index(state_i)])
            ptrs.append([self._state_ptr(sslots[0])])
            sizes.append([self.state_bytes])
        if not out_keys:
            self.index.complete(ticket)
            return
        self._new_keys(out_keys)
        t0 = time.perf_counter()
        try:
            got = self.store.get_many(out_keys, ptrs, sizes)
        except L3Timeout as e:
            # The native get may still write the slots: free them only once it returned.
            e.pending.add_done_callback(lambda _f: self.index.abort(ticket))
            self._get_failed(f"get: {e}", out_keys)
            return
        except L3Error as e:
            self.index.abort(ticket)
            self._get_failed(f"get: {e}", out_keys)
            return
        finally:
            self._add_seconds("get_seconds", time.perf_counter() - t0)
        bad = [(k, code, sum(sz)) for k, code, sz in zip(out_keys, got, sizes) if code != sum(sz)]
        if bad:
            # A lost object, a lease that expired, or a value of another size: none of it is used.
            self.index.abort(ticket)
            k, code, want = bad[0]
            self._get_failed(f"get of {len(bad)} of {len(out_keys)} objects, first {k}: {code} (want {want} bytes)",
                             out_keys)  # fmt: skip
            return
        self.index.complete(ticket)
        pages = sum(s is not None for s in pslots)
        states = sum(s is not None for s in sslots)
        with self._lock:
            self._stats["hits"] += 1
            self._stats["pages_loaded"] += pages
            self._stats["states_loaded"] += states
            self._stats["bytes_loaded"] += pages * self.page_bytes + states * self.state_bytes

    def _get_failed(self, why: str, keys: Sequence[str] = ()) -> None:
        for key in keys:  # they may be gone or wrong: a later store of this prefix puts them again
            self._unsee(key)
        self._count("gets_failed")
        log.warning("L3 fetch dropped: %s", why)

    def _add_seconds(self, name: str, dt: float) -> None:
        with self._lock:
            self._stats_f[name] += dt

    def flush(self, timeout_s: float) -> bool:
        """Waits until the work submitted so far has run (tests, benchmarks, demos); returns whether it has."""
        end = time.monotonic() + timeout_s
        try:
            futs = [w.submit(lambda: None) for w in (self._gets, self._puts)]
            for f in futs:
                f.result(max(0.0, end - time.monotonic()))
        except Exception:  # noqa: BLE001 - closed, full or not done in time
            return False
        return True

    # Statistics and shutdown

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {f"l3_{k}": v for k, v in self._stats.items()}
            out.update({f"l3_{k}": v for k, v in self._stats_f.items()})
        out["l3_connected"] = self.store is not None
        out["l3_breaker_open"] = bool(self.store is not None and self.store.breaker.is_open)
        return out

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stops the workers, unregisters the pools and closes the Store within about ``timeout_s`` plus the
        Store's own close bound. Returns False when a native call may still use the host pools (then they must
        not be freed)."""
        end = time.monotonic() + timeout_s
        quiet = self._gets.close(max(0.0, (end - time.monotonic()) / 2))
        # Queued write-behind puts still run until the deadline: a closing instance leaves its prefixes behind.
        quiet = self._puts.close(max(0.0, end - time.monotonic()), drain=True) and quiet
        store = self.store
        if store is None:
            return quiet
        for ptr in self._registered:
            try:
                store.unregister(ptr)
            except Exception as e:  # noqa: BLE001
                quiet = False
                log.warning("L3 unregister failed: %s", e)
        store.close(timeout_s=3.0)
        return quiet


def _seen_id(key: str) -> int:
    """A 128-bit id of a Store key for the seen-set (group and state keys of one chain key differ)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=16).digest(), "little")
