"""`kvtier bench loop`: the host time of each engine-loop call at a real model's geometry (needs CUDA).

An 8B-class model's KV (default: 32 layers, 8 KV heads x 128, bf16, blocks of 64 tokens: 8 MiB a block) in a
layer-first pool (one tensor a layer) and a page-first one (one tensor, a block's layers side by side), a prompt of
each length in ``--tokens``: per repetition a fresh prompt is stored (``store``, the call alone: it hashes,
plans and enqueues the copies, and returns), the copies are waited for and retired (``poll``), then the prompt
is resumed under a new request id (``resume``: lookup, allocation, the loads enqueued). The time of each call is
the host's; the copies themselves run on kvtier's streams after it returns. Reported: median and maximum per call,
and the CPU time the slowest call spent on its thread (``*_cpu_ms_of_max``).

A layer-first pool's tensors are allocated one by one (``--layer-alloc separate``, as vLLM does) or as one tensor
(``one``); ``layer_runs`` says how many runs of evenly spaced layer tensors kvtier found, and so how many copy-engine
pieces a page costs.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

LAYOUTS = ("layer-first", "page-first")


def main(argv: Sequence[str] | None = None) -> int:
    from kvtier.tools.cli import at_least, check_environment, parser

    def lengths(text: str) -> list[int]:
        return [at_least(64)(t) for t in text.split(",")]

    ap = parser("kvtier bench loop", __doc__)
    ap.add_argument("--tokens", type=lengths, default=[4096, 32768], help="prompt lengths, comma-separated")
    ap.add_argument("--layers", type=at_least(1), default=32, help="model layers")
    ap.add_argument("--kv-heads", type=at_least(1), default=8, help="KV heads")
    ap.add_argument("--head-dim", type=at_least(1), default=128, help="head dimension (bf16 elements)")
    ap.add_argument("--block-size", type=at_least(1), default=64, help="tokens a block")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="layer-first and/or page-first")
    ap.add_argument("--methods", default="auto", help="copy_method values, comma-separated (auto, kernel, dma)")
    ap.add_argument(
        "--layer-alloc",
        choices=("separate", "one"),
        default="separate",
        help="layer-first: a tensor a layer, allocated in turn, or the layers as views of one tensor",
    )
    ap.add_argument("--reps", type=at_least(1), default=7, help="repetitions a configuration")
    ap.add_argument("--json", action="store_true", help="print one JSON object per row")
    a = ap.parse_args(argv)
    layouts = a.layouts.split(",")
    if any(x not in LAYOUTS for x in layouts):
        ap.error(f"--layouts: each must be one of {', '.join(LAYOUTS)}, got {a.layouts!r}")
    methods = a.methods.split(",")
    if any(m not in ("auto", "kernel", "dma") for m in methods):
        ap.error(f"--methods: each must be one of auto, kernel, dma, got {a.methods!r}")
    if len(set(layouts)) < len(layouts) or len(set(methods)) < len(methods):
        ap.error(f"--layouts and --methods: each name once, got {a.layouts!r} and {a.methods!r}")
    if min(a.tokens) < 2 * a.block_size:
        ap.error(f"--tokens: every length must hold two blocks of --block-size {a.block_size}, got {min(a.tokens)}")
    check_environment(ap)
    import torch

    if not torch.cuda.is_available():
        ap.error("kvtier bench loop needs a CUDA device; none is visible")

    rows = []
    for layout in layouts:
        for tokens in a.tokens:
            for method in methods:
                row = run(a, layout, tokens, method)
                rows.append(row)
                print(json.dumps(row) if a.json else _line(row), flush=True)
    return 0


def _line(r: dict[str, Any]) -> str:
    calls = "  ".join(f"{c} {r[c + '_ms_p50']:.3f}/{r[c + '_ms_max']:.3f} ms" for c in ("store", "poll", "resume"))
    return f"{r['layout']:<11} {r['tokens']:>6} tokens  {r['method']:<6}  {calls}  (median/max)"


# Whole: one measurement set up, timed and reported in the order it runs.
def run(a: Any, layout: str, tokens: int, method: str) -> dict[str, Any]:
    import torch

    from kvtier.cache import HostPrefixCache

    layer_bytes = 2 * a.kv_heads * a.head_dim * a.block_size * 2  # K and V, bf16
    blocks = tokens // a.block_size
    n_blocks = blocks + 1
    if layout == "layer-first" and a.layer_alloc == "one":
        pages: Any = list(torch.zeros((a.layers, n_blocks, layer_bytes), dtype=torch.uint8, device="cuda"))
    elif layout == "layer-first":
        pages = [torch.zeros((n_blocks, layer_bytes), dtype=torch.uint8, device="cuda") for _ in range(a.layers)]
    else:
        pages = torch.zeros((n_blocks, a.layers * layer_bytes), dtype=torch.uint8, device="cuda")
    cache = HostPrefixCache(
        pages,
        block_size=a.block_size,
        page_layers=a.layers,
        host_bytes=(blocks + 1) * a.layers * layer_bytes,
        preallocate=True,
        copy_method=method,
        hash_key="kvtier bench loop",
    )
    table = np.arange(n_blocks, dtype=np.int32)
    times: dict[str, list[float]] = {"store": [], "poll": [], "resume": []}
    cpu: dict[str, list[float]] = {"store": [], "poll": [], "resume": []}
    rng = np.random.default_rng(0)

    def timed(name: str, fn: Any, *args: Any, **kw: Any) -> Any:
        c0, t0 = time.thread_time(), time.perf_counter()
        out = fn(*args, **kw)
        times[name].append(time.perf_counter() - t0)
        cpu[name].append(time.thread_time() - c0)
        return out

    try:
        for rep in range(a.reps + 1):  # the first repetition warms up and is not counted
            prompt = rng.integers(0, 100_000, size=tokens + 1, dtype=np.int32)
            timed("store", cache.store, f"s{rep}", prompt, table)
            torch.cuda.synchronize()
            timed("poll", cache.poll)
            cache.forget(f"s{rep}")
            hit = timed("resume", cache.resume, f"r{rep}", prompt, allocate=lambda: table)
            torch.cuda.synchronize()
            cache.poll()
            cache.forget(f"r{rep}")
            if hit != blocks * a.block_size:
                raise SystemExit(f"kvtier bench loop: expected a hit of {blocks * a.block_size} tokens, got {hit}")
            if rep == 0:
                for v in (*times.values(), *cpu.values()):
                    v.clear()
        stats = cache.stats()
        runs = cache.layer_runs
        pin_step, pinning = cache.settings.pin_step_bytes, cache.host_pools[0].pinning
    finally:
        cache.close()
    row: dict[str, Any] = {"layout": layout, "tokens": tokens, "method": method, "reps": a.reps}
    for name, v in times.items():
        row[name + "_ms_p50"] = round(statistics.median(v) * 1e3, 3)
        row[name + "_ms_max"] = round(max(v) * 1e3, 3)
        # The slowest call's CPU time on its thread: well under its wall time, the thread was waiting off the CPU.
        row[name + "_cpu_ms_of_max"] = round(cpu[name][v.index(max(v))] * 1e3, 3)
    row["page_bytes"] = a.layers * layer_bytes
    row["layer_alloc"] = a.layer_alloc if layout == "layer-first" else "one"
    row["layer_runs"] = len(runs)
    row["pin_step_bytes"] = pin_step
    row["pinning"] = pinning
    row["errors"] = stats["errors"]
    return row


if __name__ == "__main__":
    raise SystemExit(main())
