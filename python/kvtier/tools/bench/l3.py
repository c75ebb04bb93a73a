"""`kvtier bench l3`: page groups through the L3 tier against raw Mooncake Store calls of the same bytes.

Starts a Mooncake master and holder on loopback (or uses ``--master``), then per round:
- put: a cache stores a prompt of ``groups x group_pages`` fresh pages and the tier puts them (write-behind,
  multi-buffer, one object per group) — timed from the put's submission until the put worker is idle; the raw
  side puts the same number of objects of the same size with ``batch_put_from`` from one registered buffer;
- get: a second cache with an empty host pool resumes that prompt, which starts the tier's fetch (exists, plan,
  multi-buffer get, size checks, index completion) — timed from the resume call until the fetch is done; the raw
  side is ``batch_get_into`` of the raw objects into one registered buffer;
- miss: a prompt that L3 has never seen: the tier's fetch (one ``batch_is_exist``) against a raw
  ``batch_is_exist`` of the same keys; plus the engine-loop time of the resume call that starts a fetch.
The tier moves objects through its registered staging buffers (the default) or, with ``--zero-copy``, straight from
and into its registered host pools. Throughput is in GB/s (1e9 bytes/s), medians over the rounds. Run: ``kvtier
bench l3 [--zero-copy] [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from kvtier.tools.cli import at_least, parser

    ap = parser("kvtier bench l3", __doc__)
    ap.add_argument("--master", help="host:port of a running Mooncake master (default: start one on loopback)")
    ap.add_argument("--page-kib", type=at_least(1), default=256, help="page size in KiB")
    ap.add_argument("--group-pages", type=at_least(1), default=4, help="pages per L3 object")
    ap.add_argument("--groups", type=at_least(1), default=16, help="groups per batch (one prompt)")
    ap.add_argument("--rounds", type=at_least(1), default=10, help="timed rounds")
    ap.add_argument(
        "--segment-mib",
        type=at_least(1),
        default=None,
        help="the holder's segment of the master this starts (default: what the run puts, nothing being removed "
        "during a run, with a quarter to spare; a smaller one is refused)",
    )
    ap.add_argument(
        "--zero-copy",
        action="store_true",
        help="the tier registers its host pools and moves objects straight from and into them (l3_zero_copy); "
        "default: through its staging buffers",
    )
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    a = ap.parse_args(argv)
    check(ap, a)
    return a


# How long the master given by --master has to accept a connection before the benchmark gives up on it.
MASTER_TIMEOUT_S = 2.0


def check(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """What would fail later, before any work (one line, exit status 2): the settings of the caches (the KVTIER_*
    variables included), Mooncake, and a --master that is no host:port or accepts no connection."""
    from kvtier.l3.store import StoreConfig, import_mooncake, port_open
    from kvtier.settings import is_address
    from kvtier.tools.cli import L3_EXTRA, cache_settings

    if a.master and not is_address(a.master):
        ap.error(f"--master must be host:port, got {a.master!r}")
    if a.master and a.segment_mib is not None:
        ap.error("--segment-mib sizes the holder of the master this starts; with --master none is started")
    if not a.master:
        try:
            a.segment_mib = segment_mib(a)
        except ValueError as e:
            ap.error(str(e))
    pages = a.groups * a.group_pages
    master = a.master or "127.0.0.1:1"  # a placeholder until the local master runs
    cache_settings(
        ap,
        page_bytes=a.page_kib << 10,
        host_bytes=(pages + 8) * (a.page_kib << 10),
        l3="mooncake",
        l3_master=master,
        l3_group_pages=a.group_pages,
        hash_key="kvtier bench",  # the run's caches use a key of their own
    )
    config = StoreConfig(master)
    if a.master and not port_open(config.master_host, config.master_port, MASTER_TIMEOUT_S):
        ap.error(f"--master {a.master}: no Mooncake master accepts connections there")
    try:
        import_mooncake()
    except ImportError as e:
        ap.error(f"needs Mooncake, which is not importable ({e}): {L3_EXTRA}")


def segment_mib(a: argparse.Namespace) -> int:
    """The holder's segment of a run: every round puts a batch through the tier and a batch of raw objects, under
    keys of their own, and nothing is removed; Mooncake needs room beyond the bytes it holds. Raises ValueError when
    ``--segment-mib`` is too small for that."""
    from kvtier._core import L3_HEADER_BYTES
    from kvtier.tools.mooncake import segment_mib_for

    return segment_mib_for(
        2 * a.rounds * a.groups * (a.group_pages * (a.page_kib << 10) + L3_HEADER_BYTES), a.segment_mib
    )


@contextlib.contextmanager
def _master(args: argparse.Namespace) -> Iterator[str]:
    if args.master:
        yield args.master
        return
    from kvtier.tools.mooncake import LocalMooncake

    with LocalMooncake(segment_bytes=args.segment_mib << 20, lease_ttl_ms=200) as server:
        yield server.master_addr


# Whole: the timed steps are closures over each round's prompt and keys, and run in the order they are written.
def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvtier.cache import HostPrefixCache
    from kvtier.l3.store import MooncakeStore, StoreConfig

    bs, G, n = 16, args.group_pages, args.groups
    page = args.page_kib << 10
    pages = n * G
    obj = G * page
    batch_bytes = n * obj
    gpu = torch.randint(0, 256, (pages, page), dtype=torch.uint8)
    table = np.arange(pages, dtype=np.int32)
    rng = np.random.default_rng(0)
    put_tier, put_raw, get_tier, get_raw, miss_tier, miss_raw, loop_call = ([] for _ in range(7))
    run_id = str(time.time_ns())  # fresh keys for every run against a long-lived master
    with _master(args) as master:

        def cache() -> HostPrefixCache:
            c = HostPrefixCache(
                gpu,
                block_size=bs,
                host_bytes=(pages + 8) * page,
                preallocate=True,
                l3="mooncake",
                l3_master=master,
                hash_key=f"kvtier bench {run_id}",
                l3_zero_copy=args.zero_copy,
                l3_group_pages=G,
                l3_deadline_ms=60_000,
                fingerprint_fields={"bench": run_id},
            )
            if not c.l3.wait_connected(20):
                raise SystemExit(f"kvtier bench l3: the Mooncake master at {master} accepted no client within 20 s")
            return c

        writer, reader = cache(), cache()
        raw = MooncakeStore(StoreConfig(master))
        buf = np.random.default_rng(1).integers(0, 256, size=batch_bytes, dtype=np.uint8)
        raw.register(buf.ctypes.data, buf.nbytes)
        ptrs = [[buf.ctypes.data + i * obj] for i in range(n)]
        sizes = [[obj]] * n
        try:
            for r in range(args.rounds):
                prompt = rng.integers(0, 30000, size=pages * bs + 1, dtype=np.int32)
                keys = [f"kvtier/tools/bench/{run_id}/raw/{r}/{i}" for i in range(n)]

                def tier_put() -> None:
                    # The store's copies complete in poll(), which submits the write-behind put.
                    writer.store(f"p{r}", prompt, table)
                    t0 = time.perf_counter()
                    writer.poll()
                    if not writer.l3.flush(60):
                        raise RuntimeError("the tier's put did not finish within 60 s")
                    put_tier.append(time.perf_counter() - t0)
                    writer.forget(f"p{r}")

                def raw_put() -> None:
                    t0 = time.perf_counter()
                    codes = raw.put_many(keys, ptrs, sizes)
                    put_raw.append(time.perf_counter() - t0)
                    if any(codes):
                        raise RuntimeError(f"raw put failed: {codes}")

                def tier_get() -> None:
                    # The resume that starts the fetch, then the fetch until done.
                    t0 = time.perf_counter()
                    started = reader.resume(f"g{r}", prompt, allocate=lambda: table)
                    t1 = time.perf_counter()
                    fetch = reader.l3._fetches[f"g{r}"]
                    if started != -1 or fetch is None:
                        raise RuntimeError("the tier did not start a fetch")
                    fetch.future.result(60)
                    get_tier.append(time.perf_counter() - t0)
                    loop_call.append(t1 - t0)
                    reader.forget(f"g{r}")

                def raw_get() -> None:
                    t0 = time.perf_counter()
                    got = raw.get_many(keys, ptrs, sizes)
                    get_raw.append(time.perf_counter() - t0)
                    if got != [obj] * n:
                        raise RuntimeError(f"raw get failed: {got}")

                # Alternate which side goes first, so that neither always meets a warm (or cold) Store.
                for step in (
                    (tier_put, raw_put, tier_get, raw_get) if r % 2 == 0 else (raw_put, tier_put, raw_get, tier_get)
                ):
                    step()
                # A miss: a prompt nothing has stored.
                other = rng.integers(0, 30000, size=pages * bs + 1, dtype=np.int32)
                t0 = time.perf_counter()
                reader.resume(f"m{r}", other, allocate=lambda: table)
                t1 = time.perf_counter()
                fetch = reader.l3._fetches[f"m{r}"]
                assert fetch is not None and fetch.future is not None
                fetch.future.result(60)
                miss_tier.append(time.perf_counter() - t0)
                loop_call.append(t1 - t0)
                reader.forget(f"m{r}")
                t0 = time.perf_counter()
                raw.exists_many([f"kvtier/tools/bench/{run_id}/none/{r}/{i}" for i in range(n)])
                miss_raw.append(time.perf_counter() - t0)
            ws, rs = writer.stats(), reader.stats()
            if ws["l3_puts_failed"] or rs["l3_gets_failed"] or rs["l3_pages_loaded"] != pages * args.rounds:
                raise RuntimeError(
                    f"the tier dropped work: puts failed {ws['l3_puts_failed']}, "
                    f"gets failed {rs['l3_gets_failed']}, pages loaded {rs['l3_pages_loaded']}"
                )
        finally:
            raw.unregister(buf.ctypes.data)
            raw.close(timeout_s=5)
            writer.close()
            reader.close()

    def gbps(times: list[float]) -> float:
        return batch_bytes / statistics.median(times) / 1e9

    def ms(times: list[float]) -> float:
        return statistics.median(times) * 1e3

    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {_cores()} cores",
        "zero_copy": args.zero_copy,
        "page_bytes": page,
        "group_pages": G,
        "groups_per_batch": n,
        "batch_bytes": batch_bytes,
        "rounds": args.rounds,
        "put_tier_gbps": gbps(put_tier),
        "put_raw_gbps": gbps(put_raw),
        "put_tier_vs_raw": gbps(put_tier) / gbps(put_raw),
        "get_tier_gbps": gbps(get_tier),
        "get_raw_gbps": gbps(get_raw),
        "get_tier_vs_raw": gbps(get_tier) / gbps(get_raw),
        "miss_tier_ms": ms(miss_tier),
        "miss_raw_exists_ms": ms(miss_raw),
        "miss_added_ms": ms(miss_tier) - ms(miss_raw),
        "loop_call_start_fetch_ms_max": max(loop_call) * 1e3,
        "loop_call_start_fetch_ms_p50": ms(loop_call),
    }


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    r = run(args)
    if args.json:
        print(json.dumps(r))
        return 0
    mib = 1 << 20
    print(
        f"L3 tier ({'zero-copy' if r['zero_copy'] else 'staged'}) vs raw Mooncake Store, {r['groups_per_batch']} "
        f"objects of {r['group_pages']} x {r['page_bytes'] // 1024} KiB pages a batch ({r['batch_bytes'] / mib:.0f} "
        f"MiB), median of {r['rounds']}"
    )
    print(f"{'':<28} {'tier':>10} {'raw':>10} {'tier/raw':>9}")
    print(f"{'put (GB/s)':<28} {r['put_tier_gbps']:>10.3f} {r['put_raw_gbps']:>10.3f} {r['put_tier_vs_raw']:>9.2f}")
    print(f"{'get (GB/s)':<28} {r['get_tier_gbps']:>10.3f} {r['get_raw_gbps']:>10.3f} {r['get_tier_vs_raw']:>9.2f}")
    print(f"{'miss: lookup (ms)':<28} {r['miss_tier_ms']:>10.3f} {r['miss_raw_exists_ms']:>10.3f}")
    print(
        f"engine-loop call that starts a fetch: p50 {r['loop_call_start_fetch_ms_p50']:.3f} ms, "
        f"max {r['loop_call_start_fetch_ms_max']:.3f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
