"""How long a process that shares nothing with kvtier waits for a core while Mooncake moves a batch over loopback.

A second process spins on a clock and records its longest gap while this one runs a 32 MiB batch get (512 objects
of 64 KiB) against a local master and holder. No GIL or lock is shared: a gap is the OS not running the process,
which bounds from below what any engine-loop thread can promise on the same machine during an L3 transfer.

    python benches/scheduling_gaps.py [rounds]
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

import numpy as np

from kvtier.l3.store import MooncakeStore, StoreConfig
from kvtier.tools.mooncake import LocalMooncake


def spin(out: mp.Queue, stop: mp.Event) -> None:  # type: ignore[type-arg]
    longest, last = 0.0, time.perf_counter()
    while not stop.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    out.put(longest)


def main(rounds: int) -> None:
    n, size = 512, 64 << 10
    with (
        LocalMooncake(segment_bytes=256 << 20, lease_ttl_ms=200) as server,
        MooncakeStore(StoreConfig(server.master_addr)) as store,
    ):
        buf = np.zeros(n * size, np.uint8)
        store.register(buf.ctypes.data, buf.nbytes)
        keys = [f"gaps/{i}" for i in range(n)]
        ptrs = [[buf.ctypes.data + i * size] for i in range(n)]
        sizes = [[size]] * n
        assert store.put_many(keys, ptrs, sizes) == [0] * n
        for _ in range(rounds):
            out, stop = mp.Queue(), mp.Event()
            p = mp.Process(target=spin, args=(out, stop))
            p.start()
            time.sleep(0.2)
            t0 = time.perf_counter()
            got = store.get_many(keys, ptrs, sizes)
            took = time.perf_counter() - t0
            stop.set()
            gap = out.get()
            p.join()
            assert got == [size] * n, got
            print(
                f"get of {n * size >> 20} MiB: {took * 1e3:.1f} ms; longest gap of another process {gap * 1e3:.2f} ms"
            )
        store.unregister(buf.ctypes.data)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
