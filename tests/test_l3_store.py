"""The Mooncake Store layer of the L3 tier against a real master and holder on loopback ports."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import CancelledError

import numpy as np
import pytest

from conftest import needs_mooncake

needs_mooncake()

import kvtier.tools.mooncake as server_module  # noqa: E402
from kvtier.l3.store import (  # noqa: E402
    INVALID_PARAMS,
    LEASE_EXPIRED,
    OBJECT_NOT_FOUND,
    RPC_FAIL,
    Breaker,
    L3Error,
    L3Timeout,
    L3Unavailable,
    MooncakeStore,
    StoreConfig,
    Worker,
    WorkerFull,
    error_name,
    port_open,
)
from kvtier.tools.mooncake import LocalMooncake, MooncakeServerError, free_port, free_ports  # noqa: E402

pytestmark = pytest.mark.mooncake

KIB = 1024
PAGE = 256 * KIB
N_PAGES = 64
# Each object is put from three pieces of its row, out of memory order, so a wrong order or offset shows.
PIECES = [(192 * KIB, 64 * KIB), (0, 128 * KIB), (128 * KIB, 64 * KIB)]


def pool(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(N_PAGES, PAGE), dtype=np.uint8)


def object_bytes(row: np.ndarray) -> bytes:
    return b"".join(row[off : off + n].tobytes() for off, n in PIECES)


def pieces(arr: np.ndarray, rows: range) -> tuple[list[list[int]], list[list[int]]]:
    base = arr.ctypes.data
    ptrs = [[base + i * PAGE + off for off, _ in PIECES] for i in rows]
    sizes = [[n for _, n in PIECES] for _ in rows]
    return ptrs, sizes


def halves(arr: np.ndarray, rows: range) -> tuple[list[list[int]], list[list[int]]]:
    """A second split: the object's first half goes to the row's second half and back."""
    half = PAGE // 2
    return [[arr.ctypes.data + i * PAGE + half, arr.ctypes.data + i * PAGE] for i in rows], [[half, half] for _ in rows]


def whole(arr: np.ndarray, rows: range) -> tuple[list[list[int]], list[list[int]]]:
    return [[arr.ctypes.data + i * PAGE] for i in rows], [[PAGE] for _ in rows]


# Runs in a separate process: fetch the parent's objects into one buffer each and compare with the bytes the
# parent's seed gives, then put objects of its own from pieces. Prints one JSON line.
CHILD = """
import json, sys, time
import numpy as np
sys.path[:0] = json.loads(sys.argv[3])
import test_l3_store as t
from kvtier.l3.store import MooncakeStore, StoreConfig

master, prefix = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
store = MooncakeStore(StoreConfig(master))
setup_s = time.perf_counter() - t0
src, dst = t.pool(2), np.zeros((t.N_PAGES, t.PAGE), np.uint8)
store.register(src.ctypes.data, src.nbytes)
store.register(dst.ctypes.data, dst.nbytes)
rows = range(t.N_PAGES)
t0 = time.perf_counter()
got = store.get_many([f"{prefix}/parent/{i}" for i in rows], *t.whole(dst, rows))
get_s = time.perf_counter() - t0
parent = t.pool(1)
exact = all(dst[i].tobytes() == t.object_bytes(parent[i]) for i in rows)
t0 = time.perf_counter()
put = store.put_many([f"{prefix}/child/{i}" for i in rows], *t.pieces(src, rows))
put_s = time.perf_counter() - t0
store.unregister(src.ctypes.data)
store.unregister(dst.ctypes.data)
t0 = time.perf_counter()
store.close()
close_s = time.perf_counter() - t0
print(json.dumps(dict(got=got, exact=exact, put=put, setup_s=setup_s, get_s=get_s, put_s=put_s, close_s=close_s)))
"""


@pytest.fixture(scope="module")
def buffers(mooncake_store: MooncakeStore):  # type: ignore[no-untyped-def]
    """Two registered pools: `src` holds seed-1 bytes, `dst` receives."""
    src, dst = pool(1), np.zeros((N_PAGES, PAGE), np.uint8)
    for arr in (src, dst):
        mooncake_store.register(arr.ctypes.data, arr.nbytes)
    yield src, dst
    for arr in (src, dst):
        mooncake_store.unregister(arr.ctypes.data)


def test_nothing_of_mooncake_is_imported_before_a_store_is_built() -> None:
    code = "import sys, kvtier.l3; print(sorted(m for m in sys.modules if m.startswith('mooncake')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_config_and_codes() -> None:
    for addr in ("127.0.0.1", ":50051", "host:port", "h:0", "h:70000"):
        with pytest.raises(ValueError, match="master_addr"):
            StoreConfig(addr)
    with pytest.raises(ValueError, match="call_timeout_s"):
        StoreConfig("127.0.0.1:1", call_timeout_s=0)
    assert [error_name(c) for c in (0, 5, -200, -704, -900, -12345)] == [
        "OK",
        "5 bytes",
        "NO_SPACE",
        "OBJECT_NOT_FOUND",
        "RPC_FAIL",
        "ERROR_12345",
    ]


def test_no_master_is_known_from_its_closed_port(timed: bool) -> None:
    """The port is probed before Mooncake's setup, which retries for ~90 s: the message is the probe's."""
    t0 = time.monotonic()
    with pytest.raises(L3Unavailable, match="no Mooncake master accepts connections"):
        MooncakeStore(StoreConfig(f"127.0.0.1:{free_port()}"))
    if timed:
        assert time.monotonic() - t0 < 2.0


def test_a_port_is_open_only_while_a_server_listens_on_it() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    assert port_open("127.0.0.1", port)
    assert port_open("localhost", port)
    listener.close()
    assert not port_open("127.0.0.1", port)
    assert len(set(free_ports(8))) == 8


def test_a_start_whose_port_was_taken_is_tried_again_on_new_ports(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process may bind a port between its pick and the master's bind: the master exits, and the start
    goes on with new ports."""
    taken = socket.create_server(("127.0.0.1", 0))
    picks = [[taken.getsockname()[1], free_port()]]
    real = server_module.free_ports
    monkeypatch.setattr(server_module, "free_ports", lambda n, host: picks.pop() if picks else real(n, host))
    with taken, caplog.at_level(logging.WARNING, "kvtier.l3"), LocalMooncake(segment_bytes=16 << 20) as server:
        assert not picks and server.master_port != taken.getsockname()[1]
        assert server.master_running() and server.holder_running()
        assert port_open("127.0.0.1", server.master_port)
    assert "Mooncake did not start (attempt 1 of 3), trying new ports: mooncake_master exited" in caplog.text


@pytest.mark.parametrize("segment", [-1, 1, (16 << 20) - 1])
def test_a_segment_mooncake_cannot_mount_is_refused_before_anything_starts(segment: int) -> None:
    with pytest.raises(ValueError, match=f"segment_bytes must be 0 .* got {segment}"):
        LocalMooncake(segment_bytes=segment)


def test_a_master_that_cannot_start_is_reported_with_its_log_and_leaves_nothing_running() -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    server = LocalMooncake(segment_bytes=16 << 20, master_args=(f"--rpc_port={taken.getsockname()[1]}",))
    with taken, pytest.raises(MooncakeServerError, match="did not start in 3 attempts") as e:
        server.start()
    assert "mooncake_master exited with code" in str(e.value)
    assert str(e.value).count("Master service started") == 1  # the last master's own log, not the earlier ones
    assert server.pids() == [] and server.log_dir is None


def test_two_processes_exchange_exact_bytes(
    mooncake_server: LocalMooncake, mooncake_store: MooncakeStore, buffers: tuple[np.ndarray, np.ndarray]
) -> None:
    src, dst = buffers
    rows = range(N_PAGES)
    prefix = f"xproc{time.monotonic_ns()}"
    t0 = time.perf_counter()
    assert mooncake_store.put_many([f"{prefix}/parent/{i}" for i in rows], *pieces(src, rows)) == [0] * N_PAGES
    put_s = time.perf_counter() - t0

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    argv = [sys.executable, "-c", CHILD, mooncake_server.master_addr, prefix, json.dumps([tests_dir, *sys.path])]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-4000:]
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["got"] == [PAGE] * N_PAGES
    assert child["exact"]
    assert child["put"] == [0] * N_PAGES

    # The child has exited: its objects live on in the holder. Read them back in pieces of another split.
    dst[:] = 0
    t0 = time.perf_counter()
    assert mooncake_store.get_many([f"{prefix}/child/{i}" for i in rows], *halves(dst, rows)) == [PAGE] * N_PAGES
    get_s = time.perf_counter() - t0
    child_src = pool(2)
    for i in rows:
        assert dst[i, PAGE // 2 :].tobytes() + dst[i, : PAGE // 2].tobytes() == object_bytes(child_src[i])
    mib = N_PAGES * PAGE / 2**20
    print(
        f"\n64 x 256 KiB: parent put {put_s * 1e3:.1f} ms ({mib / put_s:.0f} MiB/s), parent get "
        f"{get_s * 1e3:.1f} ms ({mib / get_s:.0f} MiB/s); child setup {child['setup_s'] * 1e3:.1f} ms, get "
        f"{child['get_s'] * 1e3:.1f} ms, put {child['put_s'] * 1e3:.1f} ms, close {child['close_s'] * 1e3:.0f} ms"
    )


def test_put_of_an_existing_key_does_not_overwrite(
    mooncake_store: MooncakeStore, buffers: tuple[np.ndarray, np.ndarray]
) -> None:
    src, dst = buffers
    key = f"first-wins{time.monotonic_ns()}"
    assert mooncake_store.put_many([key], *whole(src, range(0, 1))) == [0]
    assert mooncake_store.put_many([key], *whole(src, range(1, 2))) == [0]
    assert mooncake_store.get_many([key], *whole(dst, range(0, 1))) == [PAGE]
    assert dst[0].tobytes() == src[0].tobytes()


def test_missing_keys_and_small_buffers(mooncake_store: MooncakeStore, buffers: tuple[np.ndarray, np.ndarray]) -> None:
    src, dst = buffers
    key = f"small{time.monotonic_ns()}"
    assert mooncake_store.exists_many(["missing/a", "missing/b"]) == [0, 0]
    assert mooncake_store.get_many(["missing/a"], *whole(dst, range(1))) == [OBJECT_NOT_FOUND]
    assert mooncake_store.put_many([key], *whole(src, range(1))) == [0]
    assert mooncake_store.exists_many([key, "missing/a"]) == [1, 0]
    assert mooncake_store.get_many([key], [[dst.ctypes.data]], [[PAGE // 2]]) == [INVALID_PARAMS]
    assert mooncake_store.get_many([], [], []) == []
    with pytest.raises(ValueError, match="differ in length"):
        mooncake_store.get_many([key], [], [])
    with pytest.raises(ValueError, match="sizes"):
        mooncake_store.put_many([key], [[dst.ctypes.data]], [[0]])
    with pytest.raises(L3Error, match="-600") as err:
        mooncake_store.unregister(dst.ctypes.data + 64)
    assert err.value.code == INVALID_PARAMS


def test_forced_remove_between_exists_and_get(
    mooncake_store: MooncakeStore, buffers: tuple[np.ndarray, np.ndarray]
) -> None:
    src, dst = buffers
    keys = [f"removed{time.monotonic_ns()}/{i}" for i in range(2)]
    assert mooncake_store.put_many(keys, *whole(src, range(2))) == [0, 0]
    assert mooncake_store.exists_many(keys) == [1, 1]
    assert mooncake_store.remove(keys[1], force=True) == 0
    assert mooncake_store.get_many(keys, *whole(dst, range(2))) == [PAGE, OBJECT_NOT_FOUND]
    assert mooncake_store.remove(keys[1], force=True) == OBJECT_NOT_FOUND


# How long a wait for a state (a breaker closed again, a holder remounted, a late native call back) may take
# before the test gives up: far beyond what it takes on a quiet machine, so that a loaded one still passes.
SETTLE_S = 60.0


def wait_stopped(pid: int, timeout_s: float = 60.0) -> None:
    """Waits until every thread of `pid` is stopped: SIGSTOP is delivered asynchronously, and on a loaded machine a
    thread can still answer a request after kill() returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(s in ("T", "t") for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped: thread states {states}"
        time.sleep(0.005)


def test_master_killed_then_restarted(timed: bool) -> None:
    """Every call returns within its bound (checked in the slow run) with the master killed, restarted, frozen."""
    call_timeout_s = 1.5
    with LocalMooncake(segment_bytes=64 << 20, lease_ttl_ms=200) as server:
        pids = server.pids()
        cfg = StoreConfig(server.master_addr, call_timeout_s=call_timeout_s, probe_timeout_s=1.0, max_backoff_s=0.4)
        with MooncakeStore(cfg) as store:
            buf = pool(3)[:2].copy()
            store.register(buf.ctypes.data, buf.nbytes)
            assert store.put_many(["before"], *whole(buf, range(1))) == [0]
            assert store.healthy()

            server.kill_master()
            # The first call after the kill is still let through: it returns -900 or times out, within the bound.
            t0 = time.monotonic()
            pending = None
            try:
                codes = store.put_many(["during"], *whole(buf, range(1)))
                assert codes == [RPC_FAIL]
            except L3Timeout as exc:
                pending = exc.pending
            took = time.monotonic() - t0
            print(f"\nfirst call after the master was killed: {took:.3f} s, timed out: {pending is not None}")
            if timed:
                assert took < call_timeout_s + 0.5
            assert store.breaker.is_open

            # While open, calls are refused at once without touching the Store (or after a quick failed probe).
            for _ in range(20):
                t0 = time.monotonic()
                assert store.exists_many(["before", "x"]) == [RPC_FAIL, RPC_FAIL]
                assert store.get_many(["before"], *whole(buf, range(1, 2))) == [RPC_FAIL]
                assert store.remove("before") == RPC_FAIL
                assert not store.healthy()
                if timed:
                    assert time.monotonic() - t0 < cfg.port_timeout_s + 0.1
            if pending is not None:
                assert pending.result(timeout=SETTLE_S) == [RPC_FAIL]  # the native call ends on its own (~4.3 s)

            server.restart_master()
            deadline = time.monotonic() + SETTLE_S
            while not store.healthy():
                assert time.monotonic() < deadline, f"breaker still open: {store.breaker.reason}"
                time.sleep(0.05)
            assert not store.breaker.is_open
            # A new master knows no objects; puts and gets work again through the holder, once it remounted.
            deadline = time.monotonic() + SETTLE_S
            while store.put_many(["after"], *whole(buf, range(1))) != [0]:
                assert time.monotonic() < deadline, "no put landed after the master's restart"
                time.sleep(0.1)
            assert store.get_many(["after"], *whole(buf, range(1, 2))) == [PAGE]
            assert buf[1].tobytes() == buf[0].tobytes()

            # A frozen master (SIGSTOP) accepts connections but never answers: native calls would block ~30 s.
            # The caller gets L3Timeout at the bound; the native call ends once the master runs again.
            assert store.healthy()
            master_pid = server.master_pid
            assert master_pid is not None
            os.kill(master_pid, signal.SIGSTOP)
            try:
                wait_stopped(master_pid)
                t0 = time.monotonic()
                with pytest.raises(L3Timeout) as frozen:
                    store.get_many(["after"], *whole(buf, range(1, 2)))
                if timed:
                    assert time.monotonic() - t0 < call_timeout_s + 0.5
                assert store.breaker.is_open
                assert store.exists_many(["after"]) == [RPC_FAIL]
            finally:
                os.kill(master_pid, signal.SIGCONT)
            # The read lease (200 ms) ran out while the master was frozen: the late answer is bytes or -707.
            assert frozen.value.pending.result(timeout=SETTLE_S)[0] in (PAGE, LEASE_EXPIRED)
            deadline = time.monotonic() + SETTLE_S
            while not store.healthy():
                assert time.monotonic() < deadline, f"breaker still open: {store.breaker.reason}"
                time.sleep(0.05)
            assert store.exists_many(["after"]) == [1]
            store.unregister(buf.ctypes.data)
        assert store.closed
        with pytest.raises(L3Error, match="closed"):
            store.exists_many(["after"])
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_worker_runs_in_order_and_closes_without_waiting_for_a_stuck_call() -> None:
    worker = Worker("test-worker", max_pending=4)
    seen: list[int] = []
    futures = [worker.submit(seen.append, i) for i in range(4)]
    assert [f.result(5) for f in futures] == [None] * 4
    assert seen == [0, 1, 2, 3]
    with pytest.raises(ZeroDivisionError):
        worker.submit(lambda: 1 // 0).result(5)

    started, release = threading.Event(), threading.Event()

    def block() -> bool:
        started.set()
        return release.wait(10)

    stuck = worker.submit(block)
    assert started.wait(5)
    queued = [worker.submit(seen.append, i) for i in range(4)]
    with pytest.raises(WorkerFull):
        worker.submit(seen.append, 99)
    # The running callable is never interrupted, and close() does not wait for it: it runs until released below.
    assert worker.close(timeout_s=0.2) is False
    for f in queued:
        with pytest.raises(CancelledError):
            f.result(0)
    with pytest.raises(L3Error, match="closed"):
        worker.submit(seen.append, 100)
    release.set()
    assert stuck.result(5) is True
    assert worker.close(timeout_s=1.0) is True
    assert seen == [0, 1, 2, 3]

    drained = Worker("test-drain")
    later = [drained.submit(time.sleep, 0.01) for _ in range(5)]
    assert drained.close(timeout_s=5.0, drain=True) is True
    assert all(f.done() and not f.cancelled() for f in later)


def test_breaker_backs_off_and_closes() -> None:
    now = [0.0]
    probe_ok = [False]
    probes: list[float] = []

    def probe() -> bool:
        probes.append(now[0])
        return probe_ok[0]

    # Binary fractions keep the clock arithmetic exact.
    breaker = Breaker(probe, initial_backoff_s=0.125, max_backoff_s=0.5, clock=lambda: now[0])
    assert breaker.allow() and not breaker.is_open
    breaker.failure("rpc failed")
    assert breaker.is_open and breaker.times_opened == 1
    for t in (0.0625, 0.125, 0.25, 0.375, 0.875, 1.25, 1.375):
        now[0] = t
        assert not breaker.allow()
    # Probes when due, the wait doubling up to the cap: 0.125 (then 0.25), 0.375 (0.5), 0.875 (0.5), 1.375.
    assert probes == [0.125, 0.375, 0.875, 1.375]
    probe_ok[0] = True
    now[0] = 1.875
    assert breaker.allow() and not breaker.is_open
    breaker.failure("again")
    assert breaker.backoff_s == 0.125 and breaker.times_opened == 2
    breaker.success()
    assert not breaker.is_open
