"""`kvtier bench copy`: the page-copy kernel against the contiguous cudaMemcpyAsync ceiling of the same run.

For each layout (page-first; layer-first with 61 layers, chunk = page / 61 rounded to 16 bytes), page size,
direction (host->device, device->host, both at once on two streams) and grid size, copies a few hundred MB of pages
with random ids and reports GB/s (1e9 bytes/s) next to a torch ``copy_`` of one pinned buffer of the same bytes.
Also measures how fast a HostPool backs and pins memory. Run: ``kvtier bench copy [--json] [--plot FILE.png]`` or
``python -m kvtier.bench.copy``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

LAYERS = 61
DIRECTIONS = ("h2d", "d2h", "both")


def _sizes(text: str) -> list[int]:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    out = []
    for part in text.split(","):
        p = part.strip().lower().removesuffix("ib").removesuffix("b")
        out.append(int(float(p[:-1]) * units[p[-1]]) if p and p[-1] in units else int(p))
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from kvtier.cli import at_least, parser

    ap = parser("kvtier bench copy", __doc__.splitlines()[0])
    ap.add_argument("--page-sizes", type=_sizes, default=_sizes("16K,64K,256K,1M,4M"), help="bytes per page")
    ap.add_argument("--blocks", type=_ints, default=[2, 4, 8, 16, 0], help="grid sizes to try; 0 = one block per SM")
    ap.add_argument("--threads", type=_ints, default=[512], help="threads per block to try")
    ap.add_argument("--layouts", default="page,layer", help="page (page-first) and/or layer (layer-first)")
    ap.add_argument("--directions", default=",".join(DIRECTIONS), help="h2d, d2h, both")
    ap.add_argument("--mib", type=at_least(1), default=512, help="MiB moved per direction in one measurement")
    ap.add_argument("--reps", type=at_least(1), default=7, help="timed repetitions (the median is reported)")
    ap.add_argument("--pin-gib", type=at_least(0, float), default=4.0, help="GiB of HostPool to back and pin (0: skip)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per row instead of a table")
    ap.add_argument("--plot", metavar="FILE.png", help="draw GB/s against page size (needs matplotlib)")
    args = ap.parse_args(argv)
    lists = (("page-sizes", args.page_sizes, 1), ("blocks", args.blocks, 0), ("threads", args.threads, 1))
    for name, values, low in lists:
        if not values or min(values) < low:
            ap.error(f"argument --{name}: every value must be >= {low}, got {values}")
    return args


class _Timer:
    """Times work enqueued on streams with CUDA events; a GPU sleep first hides the host's enqueue time."""

    def __init__(self, torch: Any, streams: Sequence[Any]) -> None:
        self.torch = torch
        self.streams = streams

    def run(self, work: Callable[[], None], reps: int) -> float:
        torch = self.torch
        main = self.streams[0]
        with torch.cuda.stream(main):
            work()  # warm-up
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(main):
                torch.cuda._sleep(20_000_000)  # ~10 ms: the launches below are all enqueued before start fires
                start.record(main)
            for s in self.streams[1:]:
                s.wait_event(start)
            with torch.cuda.stream(main):
                work()
            for s in self.streams[1:]:
                done = torch.cuda.Event()
                done.record(s)
                main.wait_event(done)
            end.record(main)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)


def _pin_rate(gib: float) -> dict[str, Any]:
    from kvtier.copy import HostPool

    slot = 2 << 20
    pool = HostPool(int(gib * (1 << 30)) // slot, slot)
    steps = []
    t0 = time.perf_counter()
    while pool.usable_slots < pool.slots:
        s = time.perf_counter()
        pool.grow_chunk()
        steps.append(time.perf_counter() - s)
    total = time.perf_counter() - t0
    row = {
        "layout": "hostpool",
        "direction": "pin",
        "gib": pool.slots * slot / (1 << 30),
        "seconds": total,
        "gibps": pool.slots * slot / (1 << 30) / total,
        "chunk_bytes": pool.chunk_bytes,
        "max_chunk_ms": max(steps) * 1e3,
        "pinned": pool.pinned,
    }
    pool.close()
    return row


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from kvtier.copy import HostPool, PageCopier, host_array

    if not torch.cuda.is_available():
        raise SystemExit("kvtier bench copy needs a CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    s_main, s_other = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    rng = np.random.default_rng(0)
    total = args.mib << 20
    # The ceiling: one contiguous copy of the same bytes each way (two pinned halves, two device halves).
    pinned = torch.empty(2 * total, dtype=torch.uint8).pin_memory()
    flat = torch.empty(2 * total, dtype=torch.uint8, device=dev)
    memcpy = {
        "h2d": lambda: flat[:total].copy_(pinned[:total], non_blocking=True),
        "d2h": lambda: pinned[total:].copy_(flat[total:], non_blocking=True),
    }
    rows: list[dict[str, Any]] = []
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    directions = [x.strip() for x in args.directions.split(",") if x.strip()]
    for layout in layouts:
        for page in args.page_sizes:
            chunk = max(16, round(page / LAYERS / 16) * 16) if layout == "layer" else page
            layers = LAYERS if layout == "layer" else 1
            page_bytes = chunk * layers
            n = max(1, total // page_bytes)
            # Pools of 2n pages: one half is read, the other written, so both directions can run at once.
            pool = [torch.randint(0, 256, (2 * n, chunk), dtype=torch.uint8, device=dev) for _ in range(layers)]
            host = HostPool(2 * n, page_bytes)
            host.grow_to(2 * n)
            # Random host bytes through the pinned buffer: a CUDA copy may not span two registered chunks.
            pinned[: 2 * n * page_bytes].copy_(torch.randint(0, 256, (2 * n * page_bytes,), dtype=torch.uint8, device=dev))
            host_array(host).reshape(-1)[:] = pinned[: 2 * n * page_bytes].numpy()
            gpu_perm = rng.permutation(2 * n).astype(np.int32)
            host_perm = rng.permutation(2 * n).astype(np.int32)
            g_out, g_in = gpu_perm[:n], gpu_perm[n:]
            h_out, h_in = host_perm[:n], host_perm[n:]
            for d in directions:
                if d == "both":

                    def mc() -> None:
                        memcpy["d2h"]()
                        with torch.cuda.stream(s_other):
                            memcpy["h2d"]()
                else:
                    mc = memcpy[d]
                streams = [s_main, s_other] if d == "both" else [s_main]
                timer = _Timer(torch, streams)
                t_mc = timer.run(mc, args.reps)
                bytes_moved = (2 if d == "both" else 1) * n * page_bytes
                memcpy_gbps = (2 if d == "both" else 1) * total / t_mc / 1e9
                for threads, b in itertools.product(args.threads, args.blocks):
                    blocks = b or sms
                    c = PageCopier(pool[0] if layers == 1 else pool, host, blocks=blocks, threads=threads)
                    h_main, h_other = s_main.cuda_stream, s_other.cuda_stream

                    def work(c: PageCopier = c, d: str = d) -> None:
                        if d in ("d2h", "both"):
                            c.to_host(g_out, h_out, h_main)
                        if d == "h2d":
                            c.to_gpu(h_in, g_in, h_main)
                        if d == "both":
                            c.to_gpu(h_in, g_in, h_other)

                    t = timer.run(work, args.reps)
                    gbps = bytes_moved / t / 1e9
                    row = {
                        "layout": "page-first" if layers == 1 else "layer-first",
                        "direction": d,
                        "page_bytes": page_bytes,
                        "chunk_bytes": chunk,
                        "layers": layers,
                        "blocks": blocks,
                        "threads": threads,
                        "gbps": round(gbps, 2),
                        "memcpy_gbps": round(memcpy_gbps, 2),
                        "ratio": round(gbps / memcpy_gbps, 4),
                    }
                    rows.append(row)
                    _emit(row, args.json)
            torch.cuda.synchronize()
            del pool
            host.close()
    if args.pin_gib > 0:
        row = _pin_rate(args.pin_gib)
        rows.append(row)
        _emit(row, args.json)
    return rows


_HEADER = False


def _emit(row: dict[str, Any], as_json: bool) -> None:
    global _HEADER
    if as_json:
        print(json.dumps(row), flush=True)
        return
    if row["layout"] == "hostpool":
        print(f"host pool: backed and pinned {row['gib']:.1f} GiB in {row['seconds']:.2f} s = {row['gibps']:.2f} GiB/s "
              f"(chunks of {row['chunk_bytes'] >> 20} MiB, longest {row['max_chunk_ms']:.0f} ms, pinned={row['pinned']})",
              flush=True)
        return
    if not _HEADER:
        print(f"{'layout':<12}{'dir':<6}{'page':>10}{'chunk':>9}{'blocks':>7}{'thr':>6}{'GB/s':>8}{'memcpy':>8}{'ratio':>7}")
        _HEADER = True
    print(f"{row['layout']:<12}{row['direction']:<6}{row['page_bytes']:>10}{row['chunk_bytes']:>9}{row['blocks']:>7}"
          f"{row['threads']:>6}{row['gbps']:>8.1f}{row['memcpy_gbps']:>8.1f}{row['ratio']:>7.3f}", flush=True)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["layout"] != "hostpool"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    for ax, d in zip(axes, DIRECTIONS):
        sel = [r for r in rows if r["direction"] == d]
        for layout in sorted({r["layout"] for r in sel}):
            for blocks in sorted({r["blocks"] for r in sel}):
                pts = sorted((r["page_bytes"], r["gbps"]) for r in sel if r["layout"] == layout and r["blocks"] == blocks)
                if pts:
                    ax.plot(*zip(*pts), marker="o", ls="-" if layout == "page-first" else "--", label=f"{layout}, {blocks} blocks")
        mc = sorted({(r["page_bytes"], r["memcpy_gbps"]) for r in sel if r["layout"] == "page-first"})
        if mc:
            ax.plot(*zip(*mc), color="black", ls=":", label="contiguous memcpy")
        ax.set_xscale("log", base=2)
        ax.set_title(d)
        ax.set_xlabel("page bytes")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
