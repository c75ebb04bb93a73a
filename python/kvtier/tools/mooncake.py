"""A local Mooncake master and holder on loopback ports, for the tests, the demo, the soak and the benchmarks
(``kvtier bench l3``, ``serve``, ``sglang``); no part of the library imports it.

The master keeps only metadata; the bytes live in the segments that clients contribute. The holder is a
long-lived `mooncake_client` process that contributes a segment, so objects survive the engine processes that put
them (an engine then contributes 0 bytes of its own).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import IO

from kvtier.l3.store import port_open

LOOPBACK = "127.0.0.1"

log = logging.getLogger("kvtier.l3")

# The smallest segment a Mooncake client mounts.
MIN_SEGMENT_BYTES = 16 << 20
# Starts tried, each on new ports, before LocalMooncake.start gives up.
_START_ATTEMPTS = 3
# How much of a process's log goes into an error message.
_LOG_TAIL_BYTES = 4000
_PR_SET_PDEATHSIG = 1


def segment_mib_for(puts: int, asked: int | None) -> int:
    """The holder's segment (MiB) of a run that puts ``puts`` bytes and removes nothing: Mooncake needs room beyond
    the bytes it holds, a quarter on top here. ``asked`` (the user's) is kept when it is enough, else ValueError."""
    need = max(-(-puts * 5 // (4 << 20)), MIN_SEGMENT_BYTES >> 20)
    if asked is None:
        return need
    if asked < need:
        raise ValueError(f"--segment-mib {asked} is too small: this run puts {puts >> 20} MiB, which needs {need} MiB")
    return asked


class MooncakeServerError(RuntimeError):
    """The master or the holder did not start, or could not be found."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on `host` that nothing listens on right now (the kernel picks it)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """`n` different TCP ports on `host` that nothing listens on right now (each socket is held until all are
    picked, so the kernel cannot hand out one port twice)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


# Looked up here, not in the child: after fork only the forking thread exists, and dlopen's lock may be held by a
# thread that is gone.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel kills it when the thread that started it exits, so a
    # killed test run leaves no master or holder behind.
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _stop_process(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; always reaps."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


def _log_tail(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "(no log)"
    return data[-_LOG_TAIL_BYTES:].decode("utf-8", "replace")


class _Process:
    """One child process with its log file; stopped by `stop`."""

    def __init__(self, name: str, argv: list[str], log_path: Path, die_with_parent: bool) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        log: IO[bytes]
        with open(log_path, "ab") as log:
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent if die_with_parent else None,
            )

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait_port(self, port: int, timeout_s: float, needs: _Process | None = None) -> None:
        """Block until `port` on loopback accepts connections; raise with the log tail if it does not, or if
        `needs` (the process this one connects to) exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in (self, needs):
                if proc is not None and not proc.running():
                    raise MooncakeServerError(
                        f"{proc.name} exited with code {proc.proc.returncode} before {self.name} listened on "
                        f"{LOOPBACK}:{port}; command: {' '.join(proc.argv)}\n{_log_tail(proc.log_path)}"
                    )
            if port_open(LOOPBACK, port):
                return
            time.sleep(0.05)
        logs = "".join(f"\n--- {p.name}:\n{_log_tail(p.log_path)}" for p in (self, needs) if p is not None)
        raise MooncakeServerError(
            f"{self.name} did not listen on {LOOPBACK}:{port} within {timeout_s} s; "
            f"command: {' '.join(self.argv)}{logs}"
        )

    def stop(self, timeout_s: float) -> None:
        _stop_process(self.proc, timeout_s)

    def kill(self) -> None:
        if self.running():
            self.proc.kill()
        self.proc.wait()


def _find_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise MooncakeServerError(
            f"{name} not found on PATH; install mooncake-transfer-engine (-cuda13 with CUDA 13, -non-cuda on "
            "machines without CUDA)"
        )
    return path


class LocalMooncake:
    """A Mooncake master and (optionally) a holder on free loopback ports.

    Use as a context manager; `stop()` (also run by `__exit__`, and by a finalizer at garbage collection or
    interpreter exit) sends SIGTERM and
    SIGKILL after `stop_timeout_s`, so no process is left behind when a test fails. With `die_with_parent` the
    kernel also kills both when the thread that started them exits (start them from a long-lived thread).

    segment_bytes: size of the holder's segment (at least MIN_SEGMENT_BYTES, 16 MiB); 0 starts no holder.
    lease_ttl_ms: the master's read lease of an object after exists() or get() (leased objects are not evicted).
    client_ttl_s: seconds the master keeps a silent client's segments mounted.
    """

    def __init__(
        self,
        segment_bytes: int = 256 << 20,
        lease_ttl_ms: int = 200,
        *,
        client_ttl_s: int = 10,
        eviction_high_watermark_ratio: float = 0.9,
        eviction_ratio: float = 0.05,
        start_timeout_s: float = 15.0,
        stop_timeout_s: float = 5.0,
        die_with_parent: bool = True,
        master_args: tuple[str, ...] = (),
    ) -> None:
        if segment_bytes != 0 and segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(
                f"segment_bytes must be 0 (no holder) or at least {MIN_SEGMENT_BYTES} (Mooncake's smallest segment), "
                f"got {segment_bytes}"
            )
        if lease_ttl_ms <= 0:
            raise ValueError(f"lease_ttl_ms must be > 0, got {lease_ttl_ms}")
        if client_ttl_s <= 0:
            raise ValueError(f"client_ttl_s must be > 0, got {client_ttl_s}")
        if not 0.0 < eviction_high_watermark_ratio <= 1.0:
            raise ValueError(f"eviction_high_watermark_ratio must be in (0, 1], got {eviction_high_watermark_ratio}")
        if not 0.0 < eviction_ratio <= 1.0:
            raise ValueError(f"eviction_ratio must be in (0, 1], got {eviction_ratio}")
        if start_timeout_s <= 0 or stop_timeout_s <= 0:
            raise ValueError(f"timeouts must be > 0, got start {start_timeout_s}, stop {stop_timeout_s}")
        self.segment_bytes = segment_bytes
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.eviction_high_watermark_ratio = eviction_high_watermark_ratio
        self.eviction_ratio = eviction_ratio
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.die_with_parent = die_with_parent
        self.master_args = master_args
        self.master_port = 0
        self.metrics_port = 0
        self.holder_port = 0
        self._master: _Process | None = None
        self._holder: _Process | None = None
        self._log_dir: Path | None = None
        self._lock = threading.Lock()
        self._children: list[_Process] = []
        self._finalizer: weakref.finalize | None = None

    @property
    def master_addr(self) -> str:
        """ "127.0.0.1:<port>" of the master's RPC service (what clients pass as master_server_address)."""
        if not self.master_port:
            raise MooncakeServerError("LocalMooncake is not started")
        return f"{LOOPBACK}:{self.master_port}"

    @property
    def holder_addr(self) -> str | None:
        """ "127.0.0.1:<port>" of the holder's service, or None when no holder runs."""
        return f"{LOOPBACK}:{self.holder_port}" if self._holder is not None else None

    @property
    def log_dir(self) -> Path | None:
        """Directory of master.log and holder.log while started."""
        return self._log_dir

    def master_running(self) -> bool:
        return self._master is not None and self._master.running()

    def holder_running(self) -> bool:
        return self._holder is not None and self._holder.running()

    @property
    def master_pid(self) -> int | None:
        """Process id of the current master (for fault tests that signal it), None when not started."""
        return self._master.proc.pid if self._master is not None else None

    def pids(self) -> list[int]:
        """Process ids of the children started so far that still run (empty after stop)."""
        return [p.proc.pid for p in self._children if p.running()]

    def __enter__(self) -> LocalMooncake:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> LocalMooncake:
        """Start the master, wait for its RPC port, then the holder and wait for its port (bounded by
        start_timeout_s each). A port picked free can be taken before the process binds it, so a start that fails
        is tried again on new ports, up to _START_ATTEMPTS times. Raises MooncakeServerError with the processes'
        logs when no attempt succeeds."""
        with self._lock:
            if self._master is not None:
                raise MooncakeServerError("LocalMooncake is already started")
            self._log_dir = Path(tempfile.mkdtemp(prefix="kvtier-mooncake-"))
            # Every child ever started goes into this list, restarted masters included; the finalizer stops them
            # all even when stop() is never called.
            self._children = []
            self._finalizer = weakref.finalize(self, _stop_all, self._children, self._log_dir, self.stop_timeout_s)
            _STARTED.add(self)
            attempt = 0
            try:
                _find_binary("mooncake_master")  # a missing binary is not worth another attempt
                if self.segment_bytes > 0:
                    _find_binary("mooncake_client")
                while True:
                    attempt += 1
                    self.master_port, self.metrics_port = free_ports(2, LOOPBACK)
                    try:
                        self._start_master()
                        if self.segment_bytes > 0:
                            self._start_holder()
                        return self
                    except MooncakeServerError as e:
                        if attempt == _START_ATTEMPTS:
                            raise MooncakeServerError(
                                f"Mooncake did not start in {attempt} attempts; the last: {e}"
                            ) from e
                        log.warning(
                            "Mooncake did not start (attempt %d of %d), trying new ports: %s",
                            attempt,
                            _START_ATTEMPTS,
                            e,
                        )
                        for proc in reversed(self._children):
                            proc.stop(self.stop_timeout_s)
                            proc.log_path.unlink(missing_ok=True)  # told above; the next attempt's log starts empty
                        self._children.clear()
                        self._holder = None
            except BaseException:
                self._stop_locked()
                raise

    def stop(self) -> None:
        """Stop the holder and the master (SIGTERM, SIGKILL after stop_timeout_s) and remove the logs. Idempotent."""
        with self._lock:
            self._stop_locked()

    def kill_master(self) -> None:
        """SIGKILL the master and reap it (the holder keeps running and keeps its data)."""
        with self._lock:
            if self._master is None:
                raise MooncakeServerError("LocalMooncake is not started")
            self._master.kill()

    def restart_master(self) -> None:
        """Kill the master (if running) and start a new one on the same ports; returns when its RPC port accepts
        connections. The new master knows no objects; clients and the holder reconnect and remount on their own."""
        with self._lock:
            if self._master is None:
                raise MooncakeServerError("LocalMooncake is not started")
            self._master.kill()
            self._start_master()

    def _start_master(self) -> None:
        assert self._log_dir is not None
        argv = [
            _find_binary("mooncake_master"),
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={self.master_port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            f"--client_ttl={self.client_ttl_s}",
            f"--eviction_high_watermark_ratio={self.eviction_high_watermark_ratio}",
            f"--eviction_ratio={self.eviction_ratio}",
            "--enable_metric_reporting=false",
            *self.master_args,
        ]
        self._master = _Process("mooncake_master", argv, self._log_dir / "master.log", self.die_with_parent)
        self._children.append(self._master)
        self._master.wait_port(self.master_port, self.start_timeout_s)

    def _start_holder(self) -> None:
        assert self._log_dir is not None
        self.holder_port = free_port()
        argv = [
            _find_binary("mooncake_client"),
            f"--global_segment_size={self.segment_bytes}",
            "--local_buffer_size=0",
            f"--master_server_address={self.master_addr}",
            "--metadata_server=P2PHANDSHAKE",
            f"--host={LOOPBACK}",
            f"--port={self.holder_port}",
            "--protocol=tcp",
        ]
        self._holder = _Process("mooncake_client (holder)", argv, self._log_dir / "holder.log", self.die_with_parent)
        self._children.append(self._holder)
        # The holder listens only after its segment is mounted at the master.
        self._holder.wait_port(self.holder_port, self.start_timeout_s, needs=self._master)

    def _stop_locked(self) -> None:
        self._holder = None
        self._master = None
        self.master_port = self.metrics_port = self.holder_port = 0
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._log_dir = None


# Servers started by this process. A child made by fork() does not own them: there they are left running, not
# stopped (by stop() or at exit).
_STARTED: weakref.WeakSet[LocalMooncake] = weakref.WeakSet()


def _disown_in_child() -> None:
    for server in list(_STARTED):
        if server._finalizer is not None:
            server._finalizer.detach()
            server._finalizer = None


os.register_at_fork(after_in_child=_disown_in_child)


def _stop_all(procs: list[_Process], log_dir: Path, timeout_s: float) -> None:
    # Newest first: the holder before the master it is mounted at.
    for proc in reversed(procs):
        proc.stop(timeout_s)
    shutil.rmtree(log_dir, ignore_errors=True)


__all__ = ["LOOPBACK", "MIN_SEGMENT_BYTES", "LocalMooncake", "MooncakeServerError", "free_port"]
