"""The L3 tier of a host prefix cache: page groups and states shared through a Store (Mooncake Store).

The planning and the Store calls are the core's (``kvtier._core.L3Planner``, rust/l3/plan.rs, over the one object
path of every adapter, rust/l3/path.rs): which groups and states a put sends and a fetch gets, their keys and
pieces, batching, staging, headers, the check of every fetched object and the removal of a wrong one. This module
runs those jobs on two worker threads and keeps the statistics.

Write-behind: ``put(ready)`` with what a completed store made ready (``Index.complete``) submits a put job: the
planner holds the new whole groups and group-end states, skips keys seen before; what the Store has already is
not sent (the first writer wins); the rest is sealed and put and the hold released.

Read: on a host miss ``start_fetch`` submits the request's one fetch job and the request answers "retry later"
until it is done or its deadline passed. The job asks the Store which groups beyond the host's ready run exist,
the planner picks the run (snapped to a state for models with state) and reserves slots, the objects are got
and every header and digest checked: the slots become ready only when every object checks. A rejected object
(wrong length, header or digest) is counted, removed from the Store and never served; it does not open the
breaker. A transient Store code (a failing transfer, an expired lease, an open breaker, a timeout) removes
nothing. A fetch checks its objects under the model version it was planned for.

KV events: the groups a put stored and the groups found gone (removed after a failed check, or missing at a get)
become "STORAGE" events of the index (``Index.take_events``), named by their pages' keys.

Failure policy: the core finishes every job's ticket (after a Store call that timed out, once that call
returned); a job that raises is counted (``l3_gets_failed`` / ``l3_puts_failed``; ``l3_errors`` for
anything but a Store error) and logged. The engine loop never calls the Store.

Shutdown: ``close()`` is bounded; a tier dropped without ``close()`` is shut down by a finalizer on a background
thread. Either way, when a native call may still use the host pools or the planner's buffers, they are kept
(leaked) rather than freed.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvtier import BadArgument, Index, L3Planner, Ready, fingerprint
from kvtier.copy import HostPool
from kvtier.geometry import Geometry
from kvtier.l3.errors import L3Error, L3Unavailable
from kvtier.l3.store import STORE_RAISED, Store, StoreConfig
from kvtier.l3.worker import Backoff, Worker
from kvtier.settings import CacheSettings

log = logging.getLogger("kvtier.l3")

# Waits between connection attempts: the first, then doubling up to the last.
_CONNECT_BACKOFF_S = (0.5, 10.0)

# What a shutdown that ran out of time could not free: a native call may still use it.
_LEAKED: list[Any] = []

# The tier's own counters; those of the objects it moves are the object path's (``L3Planner.stats``).
COUNTERS = (
    "lookups",
    "hits",
    "misses",
    "pages_loaded",
    "states_loaded",
    "gets_failed",
    "deadline_passed",
    "puts_submitted",
    "puts_failed",
    "errors",
)
TIMERS = ("get_seconds", "exists_seconds")


@dataclass
class _Fetch:
    future: Future[Any]
    deadline: float


class _Connection:
    """The Store client and what is registered with it; shared with the finalizer (it never refers to the tier)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.store: Store | None = None
        self.registered: list[int] = []
        self.closed = False

    def attach(self, store: Store, buffers: list[tuple[int, int]]) -> None:
        """Registers the buffers with a new client and keeps it, unless the tier closed meanwhile."""
        try:
            for ptr, size in buffers:
                store.register(ptr, size)
                self.registered.append(ptr)
        except BaseException:
            self.registered.clear()
            store.close(timeout_s=3.0)
            raise
        with self.lock:
            if not self.closed:
                self.store = store
                return
        self.detach_from(store)

    def detach(self) -> None:
        with self.lock:
            self.closed = True
            store = self.store
        if store is not None:
            self.detach_from(store)

    def detach_from(self, store: Store) -> None:
        for ptr in self.registered:
            try:
                store.unregister(ptr)
            except Exception as e:  # noqa: BLE001 - closing anyway
                log.warning("L3 unregister failed: %s", e)
        store.close(timeout_s=3.0)


def _shutdown(conn: _Connection, workers: tuple[Worker, Worker], keep: tuple[Any, ...], timeout_s: float) -> bool:
    """Stops the workers, unregisters and closes the Store within ``timeout_s``. What a native call may still
    use (``keep``: host pools, the planner) is leaked when it did not finish in time; returns whether it did."""
    end = time.monotonic() + timeout_s
    gets, puts = workers
    quiet = gets.close(max(0.0, (end - time.monotonic()) / 4))
    # Queued write-behind puts run until half the time left: a closing instance leaves its prefixes behind.
    quiet = puts.close(max(0.0, (end - time.monotonic()) / 2), drain=True) and quiet
    done = threading.Event()

    def disconnect() -> None:
        conn.detach()
        done.set()

    t = threading.Thread(target=disconnect, name="kvtier-l3-close", daemon=True)
    t.start()
    t.join(max(0.0, end - time.monotonic()))
    if quiet and done.is_set():
        return True
    _LEAKED.append(keep)
    log.warning("L3 tier: the Store did not stop within %.1f s; its buffers are kept, not freed", timeout_s)
    return False


def _shutdown_dropped(conn: _Connection, workers: tuple[Worker, Worker], keep: tuple[Any, ...]) -> None:
    # The finalizer of a tier dropped without close(): never block the thread that dropped it.
    threading.Thread(target=_shutdown, args=(conn, workers, keep, 8.0), name="kvtier-l3-close", daemon=True).start()


def cache_fields(
    settings: CacheSettings,
    geometry: Geometry,
    index: Index,
    fingerprint_fields: Mapping[str, str] | Callable[[CacheSettings], Mapping[str, str]] | None,
    shard: Any,
) -> dict[str, str]:
    """The fingerprint fields of a host prefix cache's objects: the pool's geometry, the index's hashing, the shard
    (``kvtier.identity.Shard``, default rank 0 of 1) and what names the model (``fingerprint_fields``, or a callable
    of the settings that makes them, and the ``model_version`` setting: one of them is required)."""
    from kvtier.identity import Shard, layout_fields

    if callable(fingerprint_fields):
        fingerprint_fields = fingerprint_fields(settings)
    if fingerprint_fields is None and settings.model_version is None:
        raise BadArgument(
            "l3='mooncake' needs the model's identity: model_version (a revision the deployment vouches "
            "for), or fingerprint_fields naming the model (its config and the digest of its weights), or "
            "fingerprint_fields={} to say that the page geometry alone decides the bytes"
        )
    if shard is not None and not isinstance(shard, Shard):
        raise BadArgument(f"shard must be a kvtier.identity.Shard, got {type(shard).__name__}")
    return layout_fields(
        page_bytes=geometry.page_bytes,
        state_bytes=geometry.state_bytes,
        block_size=geometry.block_size,
        layout=geometry.layout,
        hash_kind=index.hash_kind,
        key_id=index.key_id,
        shard=shard or Shard(),
        model_fields=fingerprint_fields or {},
        model_version=settings.model_version,
    )


class L3Tier:
    """Puts and gets of one cache's host pools through a Store; see the module docstring.

    ``fingerprint_fields``: everything that decides the bytes behind a key (see ``kvtier.identity``).
    ``store_factory(config)`` builds the Store client (default ``MooncakeStore``); it runs on the get worker, so
    a missing master never delays the caller.
    """

    def __init__(
        self,
        settings: CacheSettings,
        *,
        index: Index,
        page_pool: HostPool,
        state_pool: HostPool | None,
        fingerprint_fields: Mapping[str, str],
        store_factory: Callable[[StoreConfig], Store] | None = None,
    ) -> None:
        self.config = StoreConfig.of(settings)
        self.deadline_s = settings.l3_deadline_ms / 1e3
        self._fields = dict(fingerprint_fields)
        self.planner = L3Planner(
            index,
            fingerprint(self._fields),
            group_pages=settings.l3_group_pages,
            pages=page_pool,
            states=state_pool,
            hash_key=settings.hash_key,
            seen_keys=settings.l3_seen_keys,
            staging_bytes=None if settings.l3_zero_copy else settings.l3_staging_bytes,
        )
        self._factory = store_factory or _mooncake
        self._pools = [p for p in (page_pool, state_pool) if p is not None]
        self._conn = _Connection()
        self._lock = threading.Lock()
        self._connect_backoff = Backoff(*_CONNECT_BACKOFF_S)
        self._connecting: Future[Any] | None = None
        self._fetches: dict[str, _Fetch | None] = {}  # request -> fetch in flight, None once consulted
        self._stats = dict.fromkeys(COUNTERS, 0)
        self._seconds = dict.fromkeys(TIMERS, 0.0)
        self._gets = Worker("kvtier-l3-get", max_pending=256)
        self._puts = Worker("kvtier-l3-put", max_pending=4096)
        self._finalizer = weakref.finalize(
            self, _shutdown_dropped, self._conn, (self._gets, self._puts), (*self._pools, self.planner)
        )
        self._maybe_connect()

    @property
    def fingerprint(self) -> str:
        return self.planner.fingerprint

    @property
    def group_pages(self) -> int:
        return self.planner.group_pages

    @property
    def store(self) -> Store | None:
        """The connected Store client, or None."""
        return self._conn.store

    def set_model_version(self, version: str) -> None:
        """Objects are named and checked under the new version's fingerprint from now on."""
        self._fields["model_version"] = version
        self.planner.set_fingerprint(fingerprint(self._fields))

    def group_key(self, last_page_key: int) -> str:
        return self.planner.group_key(last_page_key)

    def state_key(self, page_key: int) -> str:
        return self.planner.state_key(page_key)

    # Connection

    def _maybe_connect(self) -> None:
        """Submits a connection attempt when none is running and the back-off is due (engine loop: no waiting)."""
        with self._lock:
            if self._conn.store is not None or self._connecting is not None or not self._connect_backoff.due():
                return
            try:
                self._connecting = self._gets.submit(self._connect)
            except L3Error:  # closed or full: try again later
                self._connect_backoff.wait()

    def _connect(self) -> None:
        try:
            # Zero-copy, the Store moves objects straight from and into the host pools; staged, only the staging
            # buffers are registered, so no peer of the Store can write memory the engine loads from.
            self._conn.attach(self._factory(self.config), self.planner.buffers())
            with self._lock:
                self._connect_backoff.reset()
            log.info("L3 tier connected to %s (fingerprint %s)", self.config.master_addr, self.fingerprint)
        except Exception as e:  # noqa: BLE001 - no Store: the cache serves from the host, and retries later
            with self._lock:
                self._connect_backoff.failed()
            self._count("errors")
            log.warning("L3 tier: no Store at %s (%s); retrying later", self.config.master_addr, e)
        finally:
            with self._lock:
                self._connecting = None

    def wait_connected(self, timeout_s: float) -> bool:
        """Waits until the Store is connected and the buffers registered (tests, demos); returns whether it is."""
        end = time.monotonic() + timeout_s
        while self._conn.store is None and time.monotonic() < end:
            self._maybe_connect()
            fut = self._connecting
            if fut is not None:
                try:
                    fut.result(max(0.0, end - time.monotonic()))
                except Exception:  # noqa: BLE001 - the attempt logged its own failure
                    pass
            else:
                time.sleep(0.01)
        return self._conn.store is not None

    def _connected_store(self) -> Store:
        store = self._conn.store
        if store is None:
            raise L3Unavailable("the L3 tier is not connected")
        return store

    # Engine-loop calls: none of them waits for the Store

    def waiting(self, request_id: str) -> bool:
        """True while this request's fetch runs and its deadline has not passed (answer "retry later"). A fetch
        that failed was read, counted and logged as it finished (``_job_done``): the request goes ahead uncached."""
        f = self._fetches.get(request_id)
        if f is None:
            return False
        if not f.future.done():
            if time.monotonic() < f.deadline:
                return True
            self._count("deadline_passed")
        self._fetches[request_id] = None
        return False

    def fetch_group_pages(self, request_id: str) -> int | None:
        """The group size for the core's resume to judge whether this request should consult L3 (``FETCH``), or
        None when it consulted it already or no Store is connected (a connection attempt is started then)."""
        if request_id in self._fetches:
            return None
        if self._conn.store is None:
            self._maybe_connect()
            return None
        return self.planner.group_pages

    def start_fetch(self, request_id: str) -> bool:
        """Starts this request's one L3 consultation (the core's resume answered ``FETCH``): the fetch worker
        probes from the request's last lookup. True when a fetch was started (the request should retry later)."""
        self._fetches[request_id] = None
        try:
            fut = self._submit(self._gets, "fetch", self._fetch, request_id)
        except L3Error:  # a full or closed worker: the request goes ahead without L3
            return False
        self._count("lookups")
        self._fetches[request_id] = _Fetch(fut, time.monotonic() + self.deadline_s)
        return True

    def put(self, ready: Ready) -> None:
        """A store's copies completed (``Index.complete`` said what became ready): submit its write-behind."""
        if self._conn.store is None:
            self._maybe_connect()
            return
        try:
            self._submit(self._puts, "put", self._put, ready)
        except L3Error:  # a full or closed worker drops this write-behind
            self._count("puts_failed")

    def forget(self, request_id: str) -> None:
        self._fetches.pop(request_id, None)

    # Worker jobs

    def _submit(self, worker: Worker, what: str, fn: Callable[..., None], *args: Any) -> Future[None]:
        fut = worker.submit(fn, *args)
        tier = weakref.ref(self)  # a future kept by the tier must not keep the tier alive

        def done(f: Future[None]) -> None:
            t = tier()
            if t is not None:
                t._job_done(what, f)

        fut.add_done_callback(done)
        return fut

    def _job_done(self, what: str, fut: Future[None]) -> None:
        """Reads every job's outcome: a failure is counted and logged (the job finished its ticket already)."""
        if fut.cancelled() or fut.exception() is None:
            return
        e = fut.exception()
        self._count("gets_failed" if what == "fetch" else "puts_failed")
        if not isinstance(e, L3Error):
            self._count("errors")
        log.warning("L3 %s failed: %s: %s", what, type(e).__name__, e)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def _put(self, ready: Ready) -> None:
        report = self.planner.put(self._connected_store(), ready)
        if report is None:
            return
        self._count("puts_submitted", report.objects - report.present)
        self._count("errors", sum(code == STORE_RAISED for _, code in report.failed))
        if report.failed:
            log.info(
                "L3 put: %d of %d objects not stored, first %s: %s",
                len(report.failed),
                report.objects,
                *report.failed[0],
            )

    def _fetch(self, request_id: str) -> None:
        report = self.planner.fetch(self._connected_store(), request_id)
        with self._lock:
            self._seconds["exists_seconds"] += report.exists_s
            self._seconds["get_seconds"] += report.get_s
        if report.outcome == "miss":  # nothing usable in the Store, no room on the host, or nothing to ask
            self._count("misses")
        elif report.error is not None:  # the exists() call failed
            code, message = report.error
            if code == STORE_RAISED:
                raise RuntimeError(f"exists failed: {message}")
            raise L3Error(f"exists failed: {message}", code)
        elif report.outcome == "admitted":
            with self._lock:
                self._stats["hits"] += 1
                self._stats["pages_loaded"] += report.pages
                self._stats["states_loaded"] += report.states
        else:
            self._count("gets_failed")
            self._count("errors", sum(code == STORE_RAISED for _, code in report.lost))
            if report.rejected:
                log.warning("L3: %d objects rejected, first %s: %s", len(report.rejected), *report.rejected[0][:2])
            if report.lost:
                log.info("L3 fetch dropped: %d objects not read, first %s: %s", len(report.lost), *report.lost[0])

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
        out: dict[str, Any] = dict(self.planner.stats())
        with self._lock:
            for k, v in self._stats.items():
                out[f"l3_{k}"] = out.get(f"l3_{k}", 0) + v
            out.update({f"l3_{k}": v for k, v in self._seconds.items()})
        store = self._conn.store
        out["l3_connected"] = store is not None
        out["l3_breaker_open"] = bool(store is not None and store.breaker_open)
        return out

    def abandon(self) -> None:
        """In a child made by fork(): the Store client and the workers are the parent's; nothing of them is
        stopped or closed here, not even at exit."""
        self._finalizer.detach()

    def close(self, timeout_s: float = 8.0) -> bool:
        """Stops the workers, unregisters the buffers and closes the Store within ``timeout_s``. Returns False
        when a native call may still use the host pools (then they must not be freed; they are kept)."""
        if not self._finalizer.detach():
            return True  # closed already
        return _shutdown(self._conn, (self._gets, self._puts), (*self._pools, self.planner), timeout_s)


def _mooncake(config: StoreConfig) -> Store:
    from kvtier.l3.store import MooncakeStore

    return MooncakeStore(config)
