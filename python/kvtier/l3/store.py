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

import contextlib
import ctypes
import logging
import os
import socket
import struct
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from kvtier._core import L3_CODES, BadArgument
from kvtier.extras import l3_install_hint
from kvtier.l3 import forked
from kvtier.l3.errors import RPC_TIMEOUT, L3Error, L3Timeout, L3Unavailable, WorkerFull
from kvtier.l3.worker import Breaker, Worker
from kvtier.settings import L3_MASTER_MISSING, is_address

if TYPE_CHECKING:
    from kvtier.settings import CacheSettings

log = logging.getLogger("kvtier.l3")

R = TypeVar("R")

# Every Store return code, read once in the core (rust/l3/path.rs's CODES): (code, name, class, store failing).
ERROR_NAMES: dict[int, str] = {code: name for code, name, _, _ in L3_CODES}
_CODE = {name: code for code, name in ERROR_NAMES.items()}
# Return codes of Mooncake Store 0.3.13 (ErrorCode in mooncake-store/include/types.h) that matter here.
NO_SPACE = _CODE["NO_SPACE"]
INVALID_PARAMS = _CODE["INVALID_PARAMS"]
OBJECT_NOT_FOUND = _CODE["OBJECT_NOT_FOUND"]
OBJECT_ALREADY_EXISTS = _CODE["OBJECT_ALREADY_EXISTS"]
OBJECT_HAS_LEASE = _CODE["OBJECT_HAS_LEASE"]
LEASE_EXPIRED = _CODE["LEASE_EXPIRED"]
TRANSFER_FAIL = _CODE["TRANSFER_FAIL"]
RPC_FAIL = _CODE["RPC_FAIL"]
# kvtier's own code: the Store holds a value of another length than the buffers a get gave.
WRONG_LENGTH = _CODE["WRONG_LENGTH"]
# kvtier's own code: a Store call raised something other than an L3Error (kvtier's failure, not the Store's).
STORE_RAISED = _CODE["STORE_RAISED"]

# Codes that say the Store itself (master or transfer path) is failing, not one object: they open the breaker.
FAILURE_CODES = frozenset(code for code, _, _, failing in L3_CODES if failing)

# The key the breaker's probe asks about; it is never put.
_PROBE_KEY = "kvtier/probe"

# Mooncake 0.3.13 logs through glog 0.3.5, to stderr. Its library reads MC_LOG_DIR and MC_LOG_LEVEL when it
# loads: with MC_LOG_DIR the log goes to files in that directory, except the records at or above glog's stderr
# threshold (ERROR; glog 0.3.5 reads no variable for it), which are copied to stderr too. Unless the deployment
# set either variable, kvtier sends the log to files here and raises the threshold to FATAL, so that no Mooncake
# record but a fatal one reaches stderr: the Store failures kvtier meets it logs itself, with their codes.
MOONCAKE_LOG_DIR = os.path.join(tempfile.gettempdir(), "kvtier-mooncake-log")
GLOG_FATAL = 3


def import_mooncake() -> Any:
    """Imports ``mooncake.store`` with its log sent to `MOONCAKE_LOG_DIR`, unless MC_LOG_DIR or MC_LOG_LEVEL is
    set or it was imported already. The variable is set only while the library loads: a child process (the
    master, a holder) that inherited it would initialise glog twice and abort."""
    import importlib
    import sys

    if "mooncake.store" in sys.modules or "MC_LOG_DIR" in os.environ or "MC_LOG_LEVEL" in os.environ:
        return importlib.import_module("mooncake.store")
    os.makedirs(MOONCAKE_LOG_DIR, exist_ok=True)
    os.environ["MC_LOG_DIR"] = MOONCAKE_LOG_DIR
    try:
        module = importlib.import_module("mooncake.store")
    finally:
        os.environ.pop("MC_LOG_DIR", None)
    _glog_stderr_threshold(GLOG_FATAL)
    return module


def _glog_stderr_threshold(severity: int) -> None:
    """``google::SetStderrLogging(severity)`` in the glog library Mooncake loaded (a build whose glog is not a
    shared library of its own keeps glog's threshold)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libglog" in line}
    except OSError:
        return
    for path in paths:
        try:
            glog = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # the copy already loaded, never another
            glog._ZN6google16SetStderrLoggingEi(ctypes.c_int(severity))
        except (OSError, AttributeError):
            continue


def error_name(code: int) -> str:
    """ "OK", a byte count, or the name of a Mooncake return code, for log messages."""
    if code >= 0:
        return "OK" if code == 0 else f"{code} bytes"
    return ERROR_NAMES.get(code, f"ERROR_{-code}")


class Store(Protocol):
    """The one seam between the L3 tier and a storage backend. Batch calls return one int per key, as Mooncake
    Store does: put 0 or a negative code; exists 1 / 0 / negative; get the bytes read or a negative code
    (`WRONG_LENGTH` when the value has another length than the buffers). Buffers are raw host pointers inside
    memory given to `register`, kept alive by the caller until the call returns (after `L3Timeout`, until its
    `pending` future is done). Failures of the backend itself raise `L3Error`."""

    @property
    def breaker_open(self) -> bool: ...
    def register(self, ptr: int, size: int) -> None: ...
    def unregister(self, ptr: int) -> None: ...
    def put_many(
        self, keys: Sequence[str], ptrs_per_key: Sequence[Sequence[int]], sizes_per_key: Sequence[Sequence[int]]
    ) -> list[int]: ...
    def exists_many(self, keys: Sequence[str]) -> list[int]: ...
    def get_many(
        self, keys: Sequence[str], ptrs_per_key: Sequence[Sequence[int]], sizes_per_key: Sequence[Sequence[int]]
    ) -> list[int]: ...
    def remove(self, key: str, force: bool = False) -> int: ...
    def close(self, timeout_s: float = 10.0) -> None: ...


@dataclass(frozen=True)
class StoreConfig:
    """How to reach Mooncake Store and how long to wait for it.

    global_segment_bytes: memory this process contributes to the Store (0.3.13 accepts 0: a holder process, see
        kvtier.tools.mooncake, contributes the memory instead, so objects survive this process).
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
        if not is_address(self.master_addr):
            raise BadArgument(f"master_addr must be 'host:port', got {self.master_addr!r}")
        for name in ("global_segment_bytes", "local_buffer_bytes"):
            if getattr(self, name) < 0:
                raise BadArgument(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("port_timeout_s", "setup_timeout_s", "call_timeout_s", "probe_timeout_s"):
            if not getattr(self, name) > 0:
                raise BadArgument(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_pending_calls < 1:
            raise BadArgument(f"max_pending_calls must be >= 1, got {self.max_pending_calls}")

    @classmethod
    def of(cls, settings: CacheSettings) -> StoreConfig:
        """The Store's address and sizes from kvtier's L3 settings (``l3_master`` must be set)."""
        if settings.l3_master is None:
            raise BadArgument(L3_MASTER_MISSING)
        return cls(
            settings.l3_master,
            metadata_server=settings.l3_metadata_server,
            protocol=settings.l3_protocol,
            local_hostname=settings.l3_local_hostname,
            global_segment_bytes=settings.l3_segment_bytes,
            local_buffer_bytes=settings.l3_buffer_bytes,
        )

    @property
    def master_host(self) -> str:
        return self.master_addr.rpartition(":")[0]

    @property
    def master_port(self) -> int:
        return int(self.master_addr.rpartition(":")[2])


def port_open(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """True when a server accepts a TCP connection to host:port within `timeout_s`.

    While nothing listens on a port of the ephemeral range, a connect to it from the same address can meet itself
    (TCP simultaneous open, the kernel having picked the target port as the source port). That is no server, and
    the connection's TIME_WAIT then keeps the server from binding the port (Mooncake's master exits). So a loopback
    target is probed from another loopback address, where this cannot happen, and a connection to itself counts as
    closed and is reset, leaving no TIME_WAIT behind.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.settimeout(timeout_s)
            ip = str(addr[0])
            if family == socket.AF_INET and ip.startswith("127."):
                with contextlib.suppress(OSError):  # a sandbox may allow 127.0.0.1 only: the check below still holds
                    s.bind(("127.0.0.2" if ip != "127.0.0.2" else "127.0.0.3", 0))
            try:
                s.connect(addr)
            except OSError:
                continue
            if s.getsockname() != s.getpeername():
                return True
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return False


class HostBuffer:
    """Zeroed host memory handed to a Store by address (header slots, staging buffers)."""

    def __init__(self, nbytes: int) -> None:
        self.array = np.zeros(nbytes, dtype=np.uint8)
        self.addr = int(self.array.ctypes.data)
        self.nbytes = nbytes


# Mooncake 0.3.13 fails (TRANSFER_FAIL) the objects of a batch beyond this many buffer pieces in all.
MAX_BATCH_PIECES = 2048


def _in_batches(
    fn: Callable[[list[str], list[list[int]], list[list[int]]], list[int]],
    keys: list[str],
    ptrs: list[list[int]],
    sizes: list[list[int]],
) -> list[int]:
    """``fn`` over consecutive runs of keys with at most MAX_BATCH_PIECES pieces each; the codes concatenated."""
    out: list[int] = []
    start = pieces = 0
    for i, p in enumerate(ptrs):
        if pieces + len(p) > MAX_BATCH_PIECES and i > start:
            out += fn(keys[start:i], ptrs[start:i], sizes[start:i])
            start, pieces = i, 0
        pieces += len(p)
    return out + fn(keys[start:], ptrs[start:], sizes[start:])


def _check_keys(keys: Sequence[str]) -> None:
    if set(map(type, keys)) <= {str} and all(keys):
        return
    for key in keys:
        if not isinstance(key, str) or not key:
            raise BadArgument(f"keys must be non-empty strings, got {key!r}")


def _check_buffers(
    keys: Sequence[str], ptrs_per_key: Sequence[Sequence[int]], sizes_per_key: Sequence[Sequence[int]]
) -> None:
    _check_keys(keys)
    if not len(keys) == len(ptrs_per_key) == len(sizes_per_key):
        raise BadArgument(
            f"keys, ptrs_per_key and sizes_per_key differ in length: {len(keys)}, {len(ptrs_per_key)}, "
            f"{len(sizes_per_key)}"
        )
    # The common case, checked with C loops (a worker holding the GIL in a Python loop delays the engine loop).
    counts = list(map(len, ptrs_per_key))
    if counts == list(map(len, sizes_per_key)) and min(counts, default=1) > 0:
        flat = [x for seq in (*ptrs_per_key, *sizes_per_key) for x in seq]
        if set(map(type, flat)) <= {int} and min(flat, default=1) > 0:
            return
    for key, ptrs, sizes in zip(keys, ptrs_per_key, sizes_per_key, strict=False):
        if len(ptrs) != len(sizes) or not ptrs:
            raise BadArgument(f"key {key!r}: need as many sizes as pointers, at least one, got {ptrs!r}, {sizes!r}")
        for ptr, size in zip(ptrs, sizes, strict=False):
            if not isinstance(ptr, int) or ptr <= 0:
                raise BadArgument(f"key {key!r}: buffer pointers must be positive ints, got {ptr!r}")
            if not isinstance(size, int) or size <= 0:
                raise BadArgument(f"key {key!r}: buffer sizes must be positive ints, got {size!r}")


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
            mooncake = import_mooncake()
        except ImportError as exc:
            raise L3Unavailable(f"mooncake is not importable ({exc}): {l3_install_hint()}") from exc
        store = mooncake.MooncakeDistributedStore()
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
        forked.client_made()
        log.info("L3 store connected to %s in %.3f s", cfg.master_addr, time.monotonic() - t0)
        return store, mooncake.ReplicateConfig()

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
            raise BadArgument(f"ptr must be a positive int, got {ptr!r}")
        if not isinstance(size, int) or size <= 0:
            raise BadArgument(f"size must be a positive int, got {size!r}")
        rc = self._call("register_buffer", self.config.call_timeout_s, self._store.register_buffer, ptr, size)
        if rc != 0:
            raise L3Error(f"register_buffer(ptr=0x{ptr:x}, size={size}) returned {rc} ({error_name(rc)})", rc)

    def unregister(self, ptr: int) -> None:
        """Unregister memory given to `register`. Raises L3Error with the code."""
        if not isinstance(ptr, int) or ptr <= 0:
            raise BadArgument(f"ptr must be a positive int, got {ptr!r}")
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
            _in_batches,
            self._put_batch,
            list(keys),
            [list(p) for p in ptrs_per_key],
            [list(s) for s in sizes_per_key],
        )

    def _put_batch(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        return list(self._store.batch_put_from_multi_buffers(keys, ptrs, sizes, self._replicate))

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
            _in_batches,
            self._get_sized,
            list(keys),
            [list(p) for p in ptrs_per_key],
            [list(s) for s in sizes_per_key],
        )

    def _get_sized(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Mooncake answers a value shorter than the buffers with TRANSFER_FAIL, the code of a failing transfer
        path: ask those keys' sizes, and a size that differs is the object's fault (WRONG_LENGTH), not the
        Store's. Runs on the call thread."""
        got = list(self._store.batch_get_into_multi_buffers(keys, ptrs, sizes, False))  # not prefer same node
        for i, code in enumerate(got):
            if code == TRANSFER_FAIL:
                size = self._store.get_size(keys[i])
                if size >= 0 and size != sum(sizes[i]):
                    got[i] = WRONG_LENGTH
        return got

    def remove(self, key: str, force: bool = False) -> int:
        """Remove one object: 0, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE (unless force), or a failure code."""
        _check_keys([key])

        def remove_one(k: str, f: bool) -> list[int]:
            return [self._store.remove(k, f)]

        return self._guarded("remove", 1, remove_one, key, bool(force))[0]

    @property
    def breaker_open(self) -> bool:
        return self.breaker.is_open

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
    "STORE_RAISED",
    "TRANSFER_FAIL",
    "WRONG_LENGTH",
    "Breaker",
    "HostBuffer",
    "L3Error",
    "L3Timeout",
    "L3Unavailable",
    "MooncakeStore",
    "Store",
    "StoreConfig",
    "Worker",
    "WorkerFull",
    "error_name",
    "import_mooncake",
]
