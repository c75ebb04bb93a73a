"""The Mooncake Store client of the L3 tier: every call bounded in time, a circuit breaker, a background worker.

Bounds, from the caller's point of view (C = call_timeout_s, P = probe_timeout_s, T = port_timeout_s):
- breaker closed: a call returns within C; a native call still running at C raises `L3Timeout` and opens the
  breaker (with a killed master native calls return -900 after ~4.3 s, with a stopped one -901 after ~30 s);
- breaker open, back-off not due: the call returns at once, every key with -900, and the Store is not touched;
- breaker open, back-off due: this caller probes first (port, health_check, one exists RPC), within T + 2 P, then
  either makes the call (bound C) or returns -900 at once;
- construction: T + setup_timeout_s; close(): its timeout_s plus one second for the call thread.
Native calls run on one call thread per store (mooncake itself may block far longer than these bounds); a call
that timed out keeps running there, which is why `L3Timeout.pending` tells when its buffers are free again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from kvtier._core import KvtierError
from kvtier.l3.server import port_open

log = logging.getLogger("kvtier.l3")

R = TypeVar("R")

# Return codes of Mooncake Store 0.3.13 (ErrorCode in mooncake-store/include/types.h) that matter here.
NO_SPACE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901

ERROR_NAMES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    NO_SPACE: "NO_SPACE",
    INVALID_PARAMS: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    LEASE_EXPIRED: "LEASE_EXPIRED",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}

# Codes that say the Store itself (master or transfer path) is failing, not one object: they open the breaker.
FAILURE_CODES = frozenset({TRANSFER_FAIL, RPC_FAIL, RPC_TIMEOUT})

# The key the breaker's probe asks about; it is never put.
_PROBE_KEY = "kvtier/probe"


def error_name(code: int) -> str:
    """"OK", a byte count, or the name of a Mooncake return code, for log messages."""
    if code >= 0:
        return "OK" if code == 0 else f"{code} bytes"
    return ERROR_NAMES.get(code, f"ERROR_{-code}")


class L3Error(KvtierError):
    """A Mooncake Store call failed; `code` is Mooncake's return code when there is one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class L3Unavailable(L3Error):
    """The Store cannot be reached (no master, setup failed, or a call timed out)."""


class L3Timeout(L3Unavailable):
    """A native call did not return within its bound. It may still be running: until `pending` is done, a put may
    still read and a get may still write the buffers it was given, so they must stay allocated and untouched."""

    def __init__(self, message: str, pending: Future[Any]) -> None:
        super().__init__(message, RPC_TIMEOUT)
        self.pending = pending


class WorkerFull(L3Error):
    """A worker's queue is full; the submission was not accepted."""


class Worker:
    """One daemon thread that runs submitted callables in submission order; results come back as Futures.

    `submit` never blocks: it raises WorkerFull when `max_pending` callables wait already, and L3Error after close.
    """

    def __init__(self, name: str = "kvtier-l3", max_pending: int = 1024) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.name = name
        self.max_pending = max_pending
        self._queue: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Callables queued and not yet started."""
        with self._cond:
            return len(self._queue)

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> Future[R]:
        fut: Future[R] = Future()
        with self._cond:
            if self._closed:
                raise L3Error(f"worker {self.name} is closed")
            if len(self._queue) >= self.max_pending:
                raise WorkerFull(f"worker {self.name} has {len(self._queue)} callables queued (max_pending)")
            self._queue.append((fut, fn, args, kwargs))
            self._cond.notify()
        return fut

    def close(self, timeout_s: float = 5.0, *, drain: bool = False) -> bool:
        """Stop accepting work and join the thread within `timeout_s`.

        drain=False cancels the queued callables at once; drain=True lets them run until the deadline and cancels
        what is left then. A callable already running is never interrupted: if it outlives the deadline, close
        returns False and its Future completes whenever it returns (the thread is a daemon). Idempotent.
        """
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        with self._cond:
            self._closed = True
            if not drain:
                self._cancel_queued()
            self._cond.notify()
        self._thread.join(timeout_s)
        with self._cond:
            self._cancel_queued()
        return not self._thread.is_alive()

    def _cancel_queued(self) -> None:
        while self._queue:
            self._queue.popleft()[0].cancel()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                fut, fn, args, kwargs = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - delivered to the submitter through the Future
                fut.set_exception(exc)
            else:
                fut.set_result(result)


class Breaker:
    """A circuit breaker: closed lets calls through; one failure opens it; while open, `allow()` refuses at once
    until the back-off is due, then runs `probe` on the calling thread (one prober at a time): success closes it,
    failure doubles the back-off (from initial_backoff_s up to max_backoff_s)."""

    def __init__(
        self,
        probe: Callable[[], bool],
        *,
        initial_backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if initial_backoff_s <= 0 or max_backoff_s < initial_backoff_s:
            raise ValueError(
                f"need 0 < initial_backoff_s <= max_backoff_s, got {initial_backoff_s}, {max_backoff_s}"
            )
        self._probe = probe
        self._initial = initial_backoff_s
        self._max = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._open = False
        self._probing = False
        self._backoff = initial_backoff_s
        self._next_probe = 0.0
        self.reason = ""
        self.times_opened = 0

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def backoff_s(self) -> float:
        """The wait before the next probe (meaningful while open)."""
        return self._backoff

    def allow(self) -> bool:
        """True when a call may go to the Store now (probing first if the back-off is due)."""
        with self._lock:
            if not self._open:
                return True
            if self._probing or self._clock() < self._next_probe:
                return False
            self._probing = True
        ok = False
        try:
            ok = bool(self._probe())
        except Exception:  # noqa: BLE001 - a probe that raises is a failed probe
            log.exception("L3 breaker probe raised")
        with self._lock:
            self._probing = False
            if ok:
                self._close_locked()
            else:
                self._backoff = min(self._backoff * 2, self._max)
                self._next_probe = self._clock() + self._backoff
        return ok

    def failure(self, reason: str) -> None:
        """Open the breaker (or, when open, push the next probe one back-off away)."""
        with self._lock:
            if not self._open:
                self._open = True
                self._backoff = self._initial
                self.times_opened += 1
                log.warning("L3 store unavailable, breaker open: %s", reason)
            self.reason = reason
            self._next_probe = self._clock() + self._backoff

    def success(self) -> None:
        """A call went through: close the breaker if it was open."""
        with self._lock:
            if self._open:
                self._close_locked()

    def _close_locked(self) -> None:
        log.warning("L3 store available again, breaker closed (was open: %s)", self.reason)
        self._open = False
        self._backoff = self._initial
        self.reason = ""


@dataclass(frozen=True)
class StoreConfig:
    """How to reach Mooncake Store and how long to wait for it.

    global_segment_bytes: memory this process contributes to the Store (0.3.13 accepts 0: a holder process, see
        kvtier.l3.server, contributes the memory instead, so objects survive this process).
    local_buffer_bytes: Mooncake's staging buffer; the multi-buffer calls used here transfer straight from and to
        registered memory, so it may stay small.
    """

    master_addr: str
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    local_hostname: str = "127.0.0.1"
    global_segment_bytes: int = 0
    local_buffer_bytes: int = 16 << 20
    rdma_devices: str = ""
    port_timeout_s: float = 0.5
    setup_timeout_s: float = 10.0
    call_timeout_s: float = 5.0
    probe_timeout_s: float = 2.0
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    max_pending_calls: int = 64

    def __post_init__(self) -> None:
        host, sep, port = self.master_addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"master_addr must be 'host:port', got {self.master_addr!r}")
        for name in ("global_segment_bytes", "local_buffer_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("port_timeout_s", "setup_timeout_s", "call_timeout_s", "probe_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_pending_calls < 1:
            raise ValueError(f"max_pending_calls must be >= 1, got {self.max_pending_calls}")

    @property
    def master_host(self) -> str:
        return self.master_addr.rpartition(":")[0]

    @property
    def master_port(self) -> int:
        return int(self.master_addr.rpartition(":")[2])


def _check_keys(keys: Sequence[str]) -> None:
    for key in keys:
        if not isinstance(key, str) or not key:
            raise ValueError(f"keys must be non-empty strings, got {key!r}")


def _check_buffers(keys: Sequence[str], ptrs_per_key: Sequence[Sequence[int]], sizes_per_key: Sequence[Sequence[int]]) -> None:
    _check_keys(keys)
    if not len(keys) == len(ptrs_per_key) == len(sizes_per_key):
        raise ValueError(
            f"keys, ptrs_per_key and sizes_per_key differ in length: {len(keys)}, {len(ptrs_per_key)}, "
            f"{len(sizes_per_key)}"
        )
    for key, ptrs, sizes in zip(keys, ptrs_per_key, sizes_per_key):
        if len(ptrs) != len(sizes) or not ptrs:
            raise ValueError(f"key {key!r}: need as many sizes as pointers, at least one, got {ptrs!r}, {sizes!r}")
        for ptr, size in zip(ptrs, sizes):
            if not isinstance(ptr, int) or ptr <= 0:
                raise ValueError(f"key {key!r}: buffer pointers must be positive ints, got {ptr!r}")
            if not isinstance(size, int) or size <= 0:
                raise ValueError(f"key {key!r}: buffer sizes must be positive ints, got {size!r}")


class MooncakeStore:
    """A Mooncake Store client (`mooncake.store.MooncakeDistributedStore`, imported here on construction only).

    Batch calls return one int per key, as Mooncake does: put 0 or a negative code, exists 1 / 0 / negative,
    get the bytes read or a negative code. While the breaker is open they return RPC_FAIL (-900) for every key
    without touching the Store. Buffers are raw host pointers (e.g. `ndarray.ctypes.data`) inside memory given to
    `register`; the caller keeps that memory alive and untouched until the call returns, or, after L3Timeout,
    until `exc.pending` is done. Thread-safe; native calls are serialised on the store's call thread.
    """

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._closed = False
        self._calls = Worker("kvtier-l3-mooncake", config.max_pending_calls)
        self.breaker = Breaker(
            self._probe, initial_backoff_s=config.initial_backoff_s, max_backoff_s=config.max_backoff_s
        )
        try:
            self._store, self._replicate = self._connect()
        except BaseException:
            self._closed = True
            self._calls.close(0.0)
            raise

    def _connect(self) -> tuple[Any, Any]:
        cfg = self.config
        # setup() retries for ~90 s when no master answers; a closed port is known in milliseconds.
        if not port_open(cfg.master_host, cfg.master_port, cfg.port_timeout_s):
            raise L3Unavailable(f"no Mooncake master accepts connections at {cfg.master_addr}")
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as exc:
            raise L3Unavailable(
                f"mooncake is not importable ({exc}); install kvtier[mooncake] or kvtier[mooncake-cpu]"
            ) from exc
        store = MooncakeDistributedStore()
        t0 = time.monotonic()
        try:
            rc = self._call(
                "setup",
                cfg.setup_timeout_s,
                store.setup,
                cfg.local_hostname,
                cfg.metadata_server,
                cfg.global_segment_bytes,
                cfg.local_buffer_bytes,
                cfg.protocol,
                cfg.rdma_devices,
                cfg.master_addr,
            )
        except L3Timeout as exc:
            raise L3Unavailable(f"Mooncake setup with master {cfg.master_addr} did not finish: {exc}") from exc
        if rc != 0:
            raise L3Unavailable(f"Mooncake setup with master {cfg.master_addr} returned {rc} ({error_name(rc)})", rc)
        log.info("L3 store connected to %s in %.3f s", cfg.master_addr, time.monotonic() - t0)
        return store, ReplicateConfig()

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _call(self, what: str, timeout_s: float, fn: Callable[..., R], *args: Any) -> R:
        """Run a native call on the call thread and wait at most timeout_s (no breaker bookkeeping here)."""
        if self._closed and what != "close":
            raise L3Error("the L3 store is closed")
        fut = self._calls.submit(fn, *args)
        try:
            return fut.result(timeout_s)
        except FutureTimeout:
            fut.cancel()  # succeeds when it was still queued behind a stuck call
            raise L3Timeout(f"Mooncake {what} did not return within {timeout_s} s", fut) from None

    def _guarded(self, what: str, n_keys: int, fn: Callable[..., list[int]], *args: Any) -> list[int]:
        if n_keys == 0:
            return []
        if not self.breaker.allow():
            return [RPC_FAIL] * n_keys
        try:
            codes = list(self._call(what, self.config.call_timeout_s, fn, *args))
        except L3Timeout as exc:
            self.breaker.failure(str(exc))
            raise
        failed = [c for c in codes if c in FAILURE_CODES]
        if failed:
            self.breaker.failure(f"{what} of {n_keys} keys: {len(failed)} failed, first {error_name(failed[0])}")
        else:
            self.breaker.success()
        return codes

    def _probe(self) -> bool:
        cfg = self.config
        if not port_open(cfg.master_host, cfg.master_port, cfg.port_timeout_s):
            return False
        try:
            if self._call("health_check", cfg.probe_timeout_s, self._store.health_check) != 0:
                return False
            code = self._call("probe exists", cfg.probe_timeout_s, self._store.batch_is_exist, [_PROBE_KEY])[0]
        except L3Error:
            return False
        return bool(code >= 0)

    def register(self, ptr: int, size: int) -> None:
        """Register host memory [ptr, ptr + size) for transfers (once per pool). Raises L3Error with the code."""
        if not isinstance(ptr, int) or ptr <= 0:
            raise ValueError(f"ptr must be a positive int, got {ptr!r}")
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"size must be a positive int, got {size!r}")
        rc = self._call("register_buffer", self.config.call_timeout_s, self._store.register_buffer, ptr, size)
        if rc != 0:
            raise L3Error(f"register_buffer(ptr=0x{ptr:x}, size={size}) returned {rc} ({error_name(rc)})", rc)

    def unregister(self, ptr: int) -> None:
        """Unregister memory given to `register`. Raises L3Error with the code."""
        if not isinstance(ptr, int) or ptr <= 0:
            raise ValueError(f"ptr must be a positive int, got {ptr!r}")
        rc = self._call("unregister_buffer", self.config.call_timeout_s, self._store.unregister_buffer, ptr)
        if rc != 0:
            raise L3Error(f"unregister_buffer(ptr=0x{ptr:x}) returned {rc} ({error_name(rc)})", rc)

    def put_many(
        self, keys: Sequence[str], ptrs_per_key: Sequence[Sequence[int]], sizes_per_key: Sequence[Sequence[int]]
    ) -> list[int]:
        """Put each key's buffers, concatenated, as one object. 0 per stored key (also when the key existed: the
        first writer wins, nothing is overwritten), NO_SPACE when the Store is full, other codes on failure."""
        _check_buffers(keys, ptrs_per_key, sizes_per_key)
        return self._guarded(
            "put",
            len(keys),
            self._store.batch_put_from_multi_buffers,
            list(keys),
            [list(p) for p in ptrs_per_key],
            [list(s) for s in sizes_per_key],
            self._replicate,
        )

    def exists_many(self, keys: Sequence[str]) -> list[int]:
        """1 when the key exists, 0 when not, negative on error. Grants the object a read lease."""
        _check_keys(keys)
        return self._guarded("exists", len(keys), self._store.batch_is_exist, list(keys))

    def get_many(
        self, keys: Sequence[str], ptrs_per_key: Sequence[Sequence[int]], sizes_per_key: Sequence[Sequence[int]]
    ) -> list[int]:
        """Read each key's object into its buffers, in order. Bytes read per key, OBJECT_NOT_FOUND for a missing
        (or meanwhile evicted) key, INVALID_PARAMS when the buffers are too small, other codes on failure."""
        _check_buffers(keys, ptrs_per_key, sizes_per_key)
        return self._guarded(
            "get",
            len(keys),
            self._store.batch_get_into_multi_buffers,
            list(keys),
            [list(p) for p in ptrs_per_key],
            [list(s) for s in sizes_per_key],
            False,  # prefer_alloc_in_same_node
        )

    def remove(self, key: str, force: bool = False) -> int:
        """Remove one object: 0, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE (unless force), or a failure code."""
        _check_keys([key])

        def remove_one(k: str, f: bool) -> list[int]:
            return [self._store.remove(k, f)]

        return self._guarded("remove", 1, remove_one, key, bool(force))[0]

    def healthy(self) -> bool:
        """True when the breaker is closed (or its due probe succeeds), the master's port accepts connections and
        health_check() is 0. Bounded like any other call; a negative answer opens the breaker."""
        if self._closed or not self.breaker.allow():
            return False
        cfg = self.config
        if not port_open(cfg.master_host, cfg.master_port, cfg.port_timeout_s):
            self.breaker.failure(f"master port {cfg.master_addr} refuses connections")
            return False
        try:
            rc = self._call("health_check", cfg.probe_timeout_s, self._store.health_check)
        except L3Timeout as exc:
            self.breaker.failure(str(exc))
            return False
        if rc != 0:
            self.breaker.failure(f"health_check returned {rc}")
            return False
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the client (Mooncake's close takes 1-3 s) within timeout_s plus one second. Objects in segments
        this process contributed are gone afterwards. Idempotent; later calls raise L3Error."""
        if self._closed:
            return
        self._closed = True
        try:
            rc = self._call("close", timeout_s, self._store.close)
            if rc not in (0, None):
                log.warning("Mooncake close returned %s (%s)", rc, error_name(rc))
        except L3Error as exc:
            log.warning("Mooncake close: %s", exc)
        self._calls.close(1.0)


__all__ = [
    "ERROR_NAMES",
    "FAILURE_CODES",
    "INVALID_PARAMS",
    "LEASE_EXPIRED",
    "NO_SPACE",
    "OBJECT_ALREADY_EXISTS",
    "OBJECT_HAS_LEASE",
    "OBJECT_NOT_FOUND",
    "RPC_FAIL",
    "RPC_TIMEOUT",
    "TRANSFER_FAIL",
    "Breaker",
    "L3Error",
    "L3Timeout",
    "L3Unavailable",
    "MooncakeStore",
    "StoreConfig",
    "Worker",
    "WorkerFull",
    "error_name",
]
