"""`kvtier bench copy`: the copy kernel and the copy engine against the same run's contiguous memcpy, and what
each costs the model.

Rates: for each layout (page-first; layer-first with 61 layers, segment = page / 61 rounded to ``--segment-align``
bytes, 128 by default as a model's segments are: tokens x heads x head_dim x dtype), page size,
direction (host->device, device->host, both at once on two streams) and method (kernel, dma = the copy engine
through one ``cudaMemcpyBatchAsync`` a batch, auto), copies pages with random ids (so no two pages make one
contiguous piece) and reports GB/s (1e9 bytes/s) next to a ``copy_`` of one pinned buffer of the same bytes.

Cost: a bf16 8192^3 GEMM loop's TFLOP/s alone and while pages stream at full rate in one direction, per method,
kernel grid and page size, with the copy rate reached meanwhile.

Run: ``kvtier bench copy [--json] [--plot FILE.png]`` or ``python -m kvtier.tools.bench.copy``.
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
METHODS = ("kernel", "dma", "auto")
LAYOUTS = ("page", "layer")


def _sizes(text: str) -> list[int]:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    out = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        p = part.lower().removesuffix("ib").removesuffix("b")
        out.append(int(float(p[:-1]) * units[p[-1]]) if p and p[-1] in units else int(p))
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from kvtier.settings import SETTINGS
    from kvtier.tools.cli import at_least, parser, plot_file

    ap = parser("kvtier bench copy", __doc__)
    ap.add_argument(
        "--page-sizes", type=_sizes, default=_sizes("4K,16K,64K,128K,256K,512K,1M,4M,8M"), help="bytes per page"
    )
    ap.add_argument("--methods", type=_names, default=list(METHODS), help="kernel, dma, auto")
    ap.add_argument("--ctas", type=_ints, default=[8], help="kernel grid sizes to try; 0 = one CTA per SM")
    ap.add_argument("--threads", type=at_least(32), default=512, help="threads per CTA")
    ap.add_argument(
        "--segment-align", type=at_least(16), default=128, help="layer-first segments: a multiple of these bytes"
    )
    ap.add_argument("--crossover", type=_sizes, default=None, help="auto's crossover in bytes (default: built-in)")
    ap.add_argument("--layouts", type=_names, default=list(LAYOUTS), help="page (page-first), layer (layer-first)")
    ap.add_argument("--directions", type=_names, default=list(DIRECTIONS), help="h2d, d2h, both")
    ap.add_argument("--mib", type=at_least(1), default=512, help="MiB moved per direction in one measurement (at most)")
    ap.add_argument("--max-pieces", type=at_least(1), default=16384, help="fewer bytes for small pieces: at most this")
    ap.add_argument("--reps", type=at_least(1), default=7, help="timed repetitions (the median is reported)")
    ap.add_argument(
        "--gemm-sizes",
        type=_sizes,
        default=_sizes("64K,256K,1M,8M"),
        help="bytes a layer a page (the copy pieces) of the GEMM-cost runs (empty: skip)",
    )
    ap.add_argument(
        "--gemm-layers",
        type=at_least(1),
        default=1,
        help="layer tensors of the GEMM-cost runs' pool (1: page-first; more: one layer-first tensor, 2D copies)",
    )
    ap.add_argument(
        "--layer-alloc",
        choices=("separate", "one"),
        default="separate",
        help="layer-first rate runs: a tensor a layer, or the layers of one tensor (2D copy-engine pieces)",
    )
    ap.add_argument("--gemm-iters", type=at_least(1), default=60, help="GEMMs a timed loop")
    ap.add_argument("--pin-gib", type=at_least(0, float), default=0.0, help="GiB of HostPool to back and pin (0: skip)")
    pin_method = SETTINGS["pin_method"]
    ap.add_argument(
        "--pin-method", choices=pin_method.choices, default=pin_method.default, help="the host pools' pin_method"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object per row instead of a table")
    ap.add_argument("--plot", type=plot_file, metavar="FILE.png", help="draw GB/s against page size (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.segment_align % 16:
        ap.error(f"argument --segment-align: must be a multiple of 16 bytes, got {args.segment_align}")
    lists = (("page-sizes", args.page_sizes, 1), ("ctas", args.ctas, 0), ("gemm-sizes", args.gemm_sizes or [1], 1))
    for name, values, low in lists:
        if not values or min(values) < low:
            ap.error(f"argument --{name}: every value must be >= {low}, got {values}")
    for name, values, allowed in (
        ("methods", args.methods, METHODS),
        ("layouts", args.layouts, LAYOUTS),
        ("directions", args.directions, DIRECTIONS),
    ):
        if not values or not set(values) <= set(allowed) or len(set(values)) < len(values):
            ap.error(f"argument --{name}: each of {', '.join(allowed)} at most once, got {values}")
    if args.crossover is not None and len(args.crossover) != 1:
        ap.error(f"argument --crossover: one size in bytes, got {args.crossover}")
    if 0 < args.pin_gib * (1 << 30) < 2 << 20:
        ap.error(f"argument --pin-gib: {args.pin_gib} GiB holds no 2 MiB slot (0 skips the pin run)")
    import torch

    if not torch.cuda.is_available():
        ap.error("no CUDA device is visible: the copy kernel and the copy engine need one")
    return args


def _method_grids(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The (method, kernel grid) pairs to measure: the copy engine has no grid, so it runs once."""
    return [(m, c) for m, c in itertools.product(args.methods, args.ctas) if m != "dma" or c == args.ctas[0]]


class _Timer:
    """Times work enqueued on streams with CUDA events; a GPU sleep first hides the host's enqueue time."""

    def __init__(self, torch: Any, streams: Sequence[Any]) -> None:
        self.torch = torch
        self.streams = streams

    def run(self, work: Callable[[], None], reps: int, sleep_cycles: int = 20_000_000) -> float:
        torch = self.torch
        main = self.streams[0]
        with torch.cuda.stream(main):
            work()  # warm-up
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(main):
                torch.cuda._sleep(sleep_cycles)  # the launches below are all enqueued before start fires
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


def _pin_rate(gib: float, pin_method: str) -> dict[str, Any]:
    from kvtier.copy import HostPool

    slot = 2 << 20
    pool = HostPool(int(gib * (1 << 30)) // slot, slot, pin_method=pin_method)
    steps = []
    t0 = time.perf_counter()
    while pool.usable_slots < pool.slots:
        s = time.perf_counter()
        pool.grow_step()
        steps.append(time.perf_counter() - s)
    total = time.perf_counter() - t0
    row = {
        "kind": "pin",
        "gib": pool.slots * slot / (1 << 30),
        "seconds": total,
        "gibps": pool.slots * slot / (1 << 30) / total,
        "step_bytes": pool.step_bytes,
        "max_step_ms": max(steps) * 1e3,
        "pinning": pool.pinning,
    }
    pool.close()
    return row


class _Pages:
    """A GPU pool and a pinned host pool of 2n pages with random bytes; one half is read, the other written."""

    def __init__(
        self,
        torch: Any,
        dev: Any,
        layers: int,
        segment: int,
        n: int,
        pinned: Any,
        rng: Any,
        pin_method: str,
        one: bool = False,
    ) -> None:
        from kvtier.copy import HostPool, host_array

        page_bytes = segment * layers
        if one:  # the layers of one tensor: evenly spaced, so the copy engine takes a page as one 2D piece
            self.pool = list(torch.randint(0, 256, (layers, 2 * n, segment), dtype=torch.uint8, device=dev))
        else:
            self.pool = [torch.randint(0, 256, (2 * n, segment), dtype=torch.uint8, device=dev) for _ in range(layers)]
        self.host = HostPool(2 * n, page_bytes, pin_method=pin_method)
        self.host.grow_to(2 * n)
        pinned[: 2 * n * page_bytes].copy_(torch.randint(0, 256, (2 * n * page_bytes,), dtype=torch.uint8, device=dev))
        host_array(self.host).reshape(-1)[:] = pinned[: 2 * n * page_bytes].numpy()
        gpu_perm = rng.permutation(2 * n).astype(np.int32)
        host_perm = rng.permutation(2 * n).astype(np.int32)
        self.g_out, self.g_in = gpu_perm[:n], gpu_perm[n:]
        self.h_out, self.h_in = host_perm[:n], host_perm[n:]
        self.layers = layers

    def copier(self, **kw: Any) -> Any:
        from kvtier.copy import PageCopier

        return PageCopier(self.pool[0] if self.layers == 1 else self.pool, self.host, **kw)

    def close(self) -> None:
        self.host.close()


# Whole: one measurement set up, timed and checked in the order it runs, over the streams it makes.
def _rates(args: argparse.Namespace, torch: Any, dev: Any, sms: int, pinned: Any, rows: list[dict[str, Any]]) -> None:
    s_main, s_other = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    h_main, h_other = s_main.cuda_stream, s_other.cuda_stream
    flat = torch.empty(pinned.numel(), dtype=torch.uint8, device=dev)
    half = pinned.numel() // 2
    rng = np.random.default_rng(0)
    for layout in args.layouts:
        for page in args.page_sizes:
            a = args.segment_align
            segment = max(a, round(page / LAYERS / a) * a) if layout == "layer" else page
            layers = LAYERS if layout == "layer" else 1
            page_bytes = segment * layers
            total = min(args.mib << 20, args.max_pieces * segment, half)
            n = max(1, total // page_bytes)
            total = n * page_bytes
            pages = _Pages(torch, dev, layers, segment, n, pinned, rng, args.pin_method, one=args.layer_alloc == "one")
            memcpy = {
                "h2d": lambda t=total: flat[:t].copy_(pinned[:t], non_blocking=True),
                "d2h": lambda t=total: pinned[half : half + t].copy_(flat[half : half + t], non_blocking=True),
            }
            for d in args.directions:
                if d == "both":

                    def mc(memcpy: dict[str, Callable[..., Any]] = memcpy) -> None:
                        memcpy["d2h"]()
                        with torch.cuda.stream(s_other):
                            memcpy["h2d"]()
                else:
                    mc = memcpy[d]
                streams = [s_main, s_other] if d == "both" else [s_main]
                timer = _Timer(torch, streams)
                t_mc = timer.run(mc, args.reps)
                bytes_moved = (2 if d == "both" else 1) * total
                memcpy_gbps = bytes_moved / t_mc / 1e9
                for method, ctas in _method_grids(args):
                    kw = {"crossover_bytes": args.crossover[0]} if args.crossover else {}
                    c = pages.copier(ctas=ctas or sms, threads=args.threads, method=method, **kw)
                    used: dict[str, str] = {}

                    def work(c: Any = c, d: str = d, used: dict[str, str] = used, pages: _Pages = pages) -> None:
                        if d in ("d2h", "both"):
                            used["d2h"] = c.to_host(pages.g_out, pages.h_out, h_main)
                        if d == "h2d":
                            used["h2d"] = c.to_gpu(pages.h_in, pages.g_in, h_main)
                        if d == "both":
                            used["h2d"] = c.to_gpu(pages.h_in, pages.g_in, h_other)

                    t0 = time.perf_counter()
                    work()
                    torch.cuda.synchronize()
                    t = timer.run(work, args.reps, sleep_cycles=20_000_000 + int(4e9 * (time.perf_counter() - t0)))
                    gbps = bytes_moved / t / 1e9
                    row = {
                        "kind": "rate",
                        "layout": "page-first" if layers == 1 else "layer-first",
                        "pinning": pages.host.pinning,
                        "direction": d,
                        "page_bytes": page_bytes,
                        "piece_bytes": segment,
                        "layers": layers,
                        "layer_runs": len(c.layer_runs),
                        "method": method,
                        "used": "+".join(sorted(set(used.values()))),
                        "ctas": ctas or sms,
                        "gbps": round(gbps, 2),
                        "memcpy_gbps": round(memcpy_gbps, 2),
                        "ratio": round(gbps / memcpy_gbps, 4),
                    }
                    rows.append(row)
                    _emit(row, args.json)
            torch.cuda.synchronize()
            pages.close()


# Whole: one measurement set up, timed and checked in the order it runs, over the streams it makes.
def _gemm_cost(
    args: argparse.Namespace, torch: Any, dev: Any, sms: int, pinned: Any, rows: list[dict[str, Any]]
) -> None:
    """A bf16 GEMM loop on one stream; pages streaming on another for longer than the loop runs."""
    m = 8192
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(m, m, device=dev, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(m, m, device=dev, dtype=torch.bfloat16, generator=gen)
    out = torch.empty(m, m, device=dev, dtype=torch.bfloat16)
    compute, copy_stream = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    flops = 2 * m**3 * args.gemm_iters

    def gemm_loop() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(compute):
            start.record(compute)
            for _ in range(args.gemm_iters):
                torch.mm(a, b, out=out)
            end.record(compute)
        end.synchronize()
        return flops / (start.elapsed_time(end) / 1e3) / 1e12

    t_end = time.perf_counter() + 2.0
    while time.perf_counter() < t_end:  # clocks up
        gemm_loop()
    alone = [gemm_loop() for _ in range(3)]
    rng = np.random.default_rng(1)
    half = pinned.numel() // 2
    layers = args.gemm_layers
    for page in args.gemm_sizes:
        n = max(1, min(args.mib << 20, half) // (page * layers))
        pages = _Pages(torch, dev, layers, page, n, pinned, rng, args.pin_method, one=True)
        for (method, ctas), d in itertools.product(_method_grids(args), ("h2d", "d2h")):
            c = pages.copier(method=method, ctas=ctas or sms, threads=args.threads)
            h = copy_stream.cuda_stream

            def batch(c: Any = c, d: str = d, pages: _Pages = pages, h: int = h) -> str:
                if d == "h2d":
                    return str(c.to_gpu(pages.h_in, pages.g_in, h))
                return str(c.to_host(pages.g_out, pages.h_out, h))

            used = batch()
            torch.cuda.synchronize()
            # Enough batches to outlast the GEMM loop (measured alone) by half again.
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record(copy_stream)
            batch()
            t1.record(copy_stream)
            t1.synchronize()
            one = t0.elapsed_time(t1) / 1e3
            loop_s = flops / (statistics.median(alone) * 1e12)
            reps = max(2, int(1.5 * loop_s / one) + 2)
            base = statistics.median([gemm_loop() for _ in range(3)])  # alone, just before
            c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            c0.record(copy_stream)
            for _ in range(reps):
                batch()
            c1.record(copy_stream)
            time.sleep(min(0.005, one))  # let the copies reach full rate before the GEMMs start
            during = gemm_loop()
            c1.synchronize()
            copy_gbps = reps * n * page * layers / (c0.elapsed_time(c1) / 1e3) / 1e9
            row = {
                "kind": "gemm",
                "pinning": pages.host.pinning,
                "direction": d,
                "page_bytes": page * layers,
                "piece_bytes": page,
                "layers": layers,
                "method": method,
                "used": used,
                "ctas": ctas or sms,
                "gemm_tflops_alone": round(base, 1),
                "gemm_tflops_during": round(during, 1),
                "loss": round(1 - during / base, 4),
                "copy_gbps": round(copy_gbps, 2),
            }
            rows.append(row)
            _emit(row, args.json)
        pages.close()
    alone_after = gemm_loop()
    rows.append(
        {"kind": "gemm_alone", "tflops_before": [round(x, 1) for x in alone], "tflops_after": round(alone_after, 1)}
    )
    _emit(rows[-1], args.json)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows: list[dict[str, Any]] = []
    # One pinned buffer: the memcpy ceiling's source and destination, and the staging of random host bytes.
    pinned = torch.empty(2 * (args.mib << 20), dtype=torch.uint8).pin_memory()
    _rates(args, torch, dev, sms, pinned, rows)
    if args.gemm_sizes:
        _gemm_cost(args, torch, dev, sms, pinned, rows)
    if args.pin_gib > 0:
        row = _pin_rate(args.pin_gib, args.pin_method)
        rows.append(row)
        _emit(row, args.json)
    return rows


_HEADER: set[str] = set()


def _emit(row: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(row), flush=True)
        return
    kind = row["kind"]
    if kind == "pin":
        print(
            f"host pool: backed and pinned {row['gib']:.1f} GiB in {row['seconds']:.2f} s = {row['gibps']:.2f} GiB/s "
            f"(steps of {row['step_bytes'] >> 20} MiB, longest {row['max_step_ms']:.0f} ms, pinning={row['pinning']})",
            flush=True,
        )
    elif kind == "gemm_alone":
        print(f"GEMM alone: {row['tflops_before']} TFLOP/s before, {row['tflops_after']} after", flush=True)
    elif kind == "gemm":
        if kind not in _HEADER:
            print(f"{'dir':<5}{'page':>9}{'method':>8}{'used':>8}{'TFLOP/s':>9}{'alone':>8}{'loss':>8}{'GB/s':>7}")
            _HEADER.add(kind)
        print(
            f"{row['direction']:<5}{row['page_bytes']:>9}{row['method']:>8}{row['used']:>8}"
            f"{row['gemm_tflops_during']:>9.1f}{row['gemm_tflops_alone']:>8.1f}{row['loss']:>8.1%}{row['copy_gbps']:>7.1f}",
            flush=True,
        )
    else:
        if kind not in _HEADER:
            print(
                f"{'layout':<12}{'dir':<6}{'page':>9}{'piece':>9}{'method':>8}{'used':>8}{'ctas':>6}{'GB/s':>8}"
                f"{'memcpy':>8}{'ratio':>7}"
            )
            _HEADER.add(kind)
        print(
            f"{row['layout']:<12}{row['direction']:<6}{row['page_bytes']:>9}{row['piece_bytes']:>9}{row['method']:>8}"
            f"{row['used']:>8}{row['ctas']:>6}{row['gbps']:>8.1f}{row['memcpy_gbps']:>8.1f}{row['ratio']:>7.3f}",
            flush=True,
        )


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["kind"] == "rate"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    for ax, d in zip(axes, DIRECTIONS, strict=False):
        sel = [r for r in rows if r["direction"] == d]
        for layout, method in sorted({(r["layout"], r["method"]) for r in sel}):
            pts = sorted((r["piece_bytes"], r["gbps"]) for r in sel if r["layout"] == layout and r["method"] == method)
            ax.plot(
                *zip(*pts, strict=False),
                marker="o",
                ls="-" if layout == "page-first" else "--",
                label=f"{layout}, {method}",
            )
        mc = sorted({(r["piece_bytes"], r["memcpy_gbps"]) for r in sel if r["layout"] == "page-first"})
        if mc:
            ax.plot(*zip(*mc, strict=False), color="black", ls=":", label="contiguous memcpy")
        ax.set_xscale("log", base=2)
        ax.set_title(d)
        ax.set_xlabel("piece bytes")
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
