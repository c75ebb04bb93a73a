"""`kvtier bench overlap`: what copies cost the reference engine's requests on a GPU.

1. Time to first token of a long cached prefix plus an uncached suffix (default 32K + 2K tokens, the medium model
   in bfloat16): with the cache off; with whole loads (the engine's stream waits for the whole load before the
   suffix's prefill); with layer-wise loads (it waits per layer, in ``wait_layer``). In the same run: the load
   alone (the prefix's pages host->GPU, one synchronized copy) and the suffix's prefill alone (the prefix's blocks
   taken as they are, no copy), so the layer-wise figure can be set against max(load, prefill). The modes take
   turns request by request; rows give each mode's median and fastest request (the reference engine is host-bound,
   and its fastest request is the one the host disturbed least) and the host time of the cache's calls before the
   first token.
2. Decode step time while a store of the same prefix length streams GPU->host: a few sequences decode; between
   steps a 32K-token prompt's blocks are stored (the store call's own time is counted in the step after it); the
   steps until the store completes are timed against the three steps before each store, with copy streams and
   with every copy on the engine's stream. Each stored prompt is first admitted as the engine admits a request
   (``resume``, a miss, which hashes the prompt's chain; timed apart, as ``admission_ms``), so the store call
   costs what it costs the engine at the end of a prefill.

Run: ``kvtier bench overlap [--json]`` or ``python -m kvtier.tools.bench.overlap``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

BLOCK_SIZE = 16
LAYOUTS = ("layer-first", "page-first")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from kvtier.tools.cli import at_least, check_environment, parser
    from kvtier.tools.engine.config import PRESETS

    ap = parser("kvtier bench overlap", __doc__)
    ap.add_argument("--model", default="medium", choices=sorted(PRESETS), help="reference engine preset")
    ap.add_argument("--device", default="cuda", help="cuda (cpu only to try the script quickly)")
    ap.add_argument("--layouts", default="layer-first,page-first", help="layer-first and/or page-first")
    ap.add_argument(
        "--prefix-tokens",
        type=at_least(2 * BLOCK_SIZE),
        default=32768,
        help=f"cached prefix, whole blocks of {BLOCK_SIZE}",
    )
    ap.add_argument("--suffix-tokens", type=at_least(1), default=2048, help="uncached suffix")
    ap.add_argument("--method", default="auto", choices=("auto", "kernel", "dma"), help="copy_method of the cache")
    ap.add_argument("--reps", type=at_least(1), default=5, help="requests timed per mode (the median is reported)")
    ap.add_argument("--decode-seqs", type=at_least(1), default=4, help="sequences decoding while stores stream")
    ap.add_argument("--stores", type=at_least(1), default=20, help="stores timed (each a fresh prompt)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per row")
    args = ap.parse_args(argv)
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad or not layouts:
        ap.error(f"argument --layouts: each must be one of {', '.join(LAYOUTS)}, got {args.layouts!r}")
    args.layouts = layouts
    if args.prefix_tokens % BLOCK_SIZE:
        # The cache hits whole blocks (two at least, its default min_hit_tokens): the prefix must be all of its hit.
        ap.error(f"argument --prefix-tokens: {args.prefix_tokens} is not a multiple of the block size, {BLOCK_SIZE}")
    check_environment(ap)
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device is visible (--device cpu tries the script on the CPU)")
    return args


class _NoCopy:
    """A prefix cache that allocates and reports the prefix as cached without copying: prefill alone."""

    def __init__(self, engine: Any, hit: int) -> None:
        self.engine, self.hit = engine, hit

    def try_resume(self, seq: Any, request_id: str, prompt_ids: Any) -> int:
        if not self.engine.scheduler.try_allocate_seq(seq):
            return -1
        return self.hit

    def on_prefill_step(self, scheduled: Any, finished: Any) -> None:
        pass

    def poll(self) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


class _Timed:
    """Forwards every call to a cache and adds up the host time of those an engine makes before a request's first
    token (``poll``, ``try_resume``, ``wait_layer``): kvtier's own share of a TTFT."""

    BEFORE_FIRST_TOKEN = ("poll", "try_resume", "wait_layer")

    def __init__(self, cache: Any) -> None:
        self._cache, self.seconds = cache, 0.0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._cache, name)
        if name not in self.BEFORE_FIRST_TOKEN:
            return fn

        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def _emit(row: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(row), flush=True)
    else:
        print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _ttft(engine: Any, rid: str, prompt: list[int]) -> float:
    _sync()
    engine.add_request(rid, prompt, 1)
    engine.run_until_done()
    ttft = engine.stats[rid].ttft
    assert ttft is not None
    return ttft


def _settle(cache: Any) -> None:
    _sync()
    cache.poll()


def _config(args: argparse.Namespace, layout: str, *, num_gpu_blocks: int, chunk_size: int, max_batch: int) -> Any:
    """The reference engine's config of a run: the chosen model in bfloat16, one state ring a sequence (+1)."""
    from kvtier.tools.engine import EngineConfig

    return EngineConfig.preset(
        args.model,
        device=args.device,
        dtype="bfloat16",
        layout=layout,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=num_gpu_blocks,
        chunk_size=chunk_size,
        max_batch=max_batch,
        num_state_rings=max_batch + 1,
    )


# Whole: one measurement set up, timed and checked in the order it runs; its parts share the engine's tensors.
def ttft_rows(args: argparse.Namespace, layout: str) -> list[dict[str, Any]]:
    import torch

    from kvtier.copy import HostPool, PageCopier
    from kvtier.deepinfer import Cache
    from kvtier.tools.engine import Engine

    bs = BLOCK_SIZE
    pre, suf = args.prefix_tokens, args.suffix_tokens
    blocks_per_seq = -(-(pre + suf + 1) // bs)
    chunk = -(-(suf + 1024) // bs) * bs  # the suffix's prefill in one chunk, of whole blocks
    config = _config(args, layout, num_gpu_blocks=3 * blocks_per_seq, chunk_size=chunk, max_batch=4)
    engine = Engine(config)
    rng = np.random.default_rng(0)
    vocab = config.vocab
    prefix = rng.integers(0, vocab, pre).tolist()

    def prompt() -> list[int]:
        return prefix + rng.integers(0, vocab, suf).tolist()

    rows: list[dict[str, Any]] = []
    page_bytes = engine.page_bytes
    host_bytes = (blocks_per_seq + 64) * page_bytes * 3
    # Layer-wise loads need copy streams: on the CPU (a quick try of the script) only whole loads run.
    load_modes = ("whole_loads", "layerwise_loads") if args.device != "cpu" else ("whole_loads",)
    out: dict[str, list[float]] = {"prefill_alone": [], **{m: [] for m in load_modes}}
    calls: dict[str, list[float]] = {m: [] for m in load_modes}  # host time in the cache's calls
    # Warm the engine's kernels once.
    _ttft(engine, "warm", prompt()[: 4 * bs + 3])
    out["cache_off"] = [_ttft(engine, "off", prompt())]
    no_copy = _NoCopy(engine, pre)
    cache = Cache(engine, size_bytes=host_bytes, num_state_slots=64, preallocate=True, copy_method=args.method)
    core = cache.cache.core
    engine.cache = cache
    # Store the prefix: a prompt ending just past it, so the state at the prefix's last boundary is stored too.
    _ttft(engine, "store", prefix + rng.integers(0, vocab, 5).tolist())
    _settle(cache)
    # The three modes take turns, so drift in the host's speed touches each alike. One cache serves both load
    # modes: its layer-wise switch is flipped between requests (nothing is in flight then).
    for i in range(args.reps + 1):
        for mode in ("prefill_alone", *load_modes):
            timed = _Timed(cache)
            engine.cache = no_copy if mode == "prefill_alone" else timed
            core.set_layerwise_loads(mode == "layerwise_loads")
            rid = f"{mode}{i}"
            t = _ttft(engine, rid, prompt())
            _settle(cache)
            if engine.stats[rid].cached_tokens != pre:
                raise SystemExit(f"{mode}: expected a hit of {pre} tokens, got {engine.stats[rid].cached_tokens}")
            if i:  # the first round warms each path
                out[mode].append(t)
                if mode in calls:
                    calls[mode].append(timed.seconds)
    cache.close()
    engine.cache = None
    # The load alone: the prefix's pages into the GPU pool with the cache's method, on a stream of its own.
    n = pre // bs
    host = HostPool(n, page_bytes)
    host.grow_to(n)
    pool = engine.gpu_blocks if engine.gpu_blocks is not None else engine.gpu_layers
    assert pool is not None
    copier = PageCopier(pool, host, method=args.method)
    stream = torch.cuda.Stream() if args.device != "cpu" else None
    ids = np.arange(n, dtype=np.int32)
    loads, used = [], ""
    for i in range(args.reps + 1):
        _sync()
        t0 = time.perf_counter()
        used = copier.to_gpu(ids, ids, stream.cuda_stream if stream is not None else 0)
        _sync()
        if i:
            loads.append(time.perf_counter() - t0)
    host.close()
    load = statistics.median(loads)
    prefill = statistics.median(out["prefill_alone"])
    row: dict[str, Any] = {
        "kind": "ttft",
        "layout": layout,
        "model": args.model,
        "prefix": pre,
        "suffix": suf,
        "page_bytes": page_bytes,
        "load_method": used,
        "load_alone_ms": round(load * 1e3, 2),
        "load_gbps": round(n * page_bytes / load / 1e9, 1),
    }
    for k, v in out.items():
        row[f"{k}_ms"] = round(statistics.median(v) * 1e3, 2)
    for mode in load_modes:
        name = mode.split("_")[0]
        row[f"{name}_over_max"] = round(statistics.median(out[mode]) / max(load, prefill), 3)
        # The fastest of each mode: the run least disturbed by the host, which the reference engine is bound by.
        row[f"{name}_over_max_fastest"] = round(min(out[mode]) / max(load, min(out["prefill_alone"])), 3)
    for mode, v in calls.items():
        row[f"{mode}_cache_calls_ms"] = round(statistics.median(v) * 1e3, 2)
    row["prefill_alone_spread"] = round(max(out["prefill_alone"]) / min(out["prefill_alone"]), 3)
    row["reps"] = len(out["whole_loads"])
    rows.append(row)
    return rows


# Whole: one measurement set up, timed and checked in the order it runs; its parts share the engine's tensors.
def decode_rows(args: argparse.Namespace, layout: str) -> list[dict[str, Any]]:
    import torch

    from kvtier.deepinfer import Cache
    from kvtier.tools.engine import Engine
    from kvtier.tools.engine.sequence import Sequence as Seq

    bs = BLOCK_SIZE
    pre = args.prefix_tokens
    store_blocks = pre // bs
    steps_total = 20 + args.stores * 12
    num_blocks = store_blocks + args.decode_seqs * (-(-(512 + steps_total) // bs)) + 8
    config = _config(args, layout, num_gpu_blocks=num_blocks, chunk_size=512, max_batch=args.decode_seqs)
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(1)
    for streams in (True, False):
        engine = Engine(config)
        cache = Cache(
            engine,
            size_bytes=3 * store_blocks * engine.page_bytes,
            num_state_slots=64,
            preallocate=True,
            copy_method=args.method,
            copy_streams=streams,
        )
        engine.cache = cache
        for i in range(args.decode_seqs):
            engine.add_request(f"d{i}", rng.integers(0, config.vocab, 512).tolist(), steps_total)
        # Prefill, then a few decode steps to settle.
        while any(s.chunked_rest_len for s in engine.running) or len(engine.running) < args.decode_seqs:
            engine.step()
        # The store's blocks: a sequence the scheduler allocates but the engine never runs (the bytes are whatever
        # the pool holds; the copy is the same).
        holder = Seq("holder", [0] * pre, 1)
        if not engine.scheduler.try_allocate_seq(holder):
            raise RuntimeError("the GPU pool has no room for the stored prompt's blocks")
        holder.num_computed_tokens = pre  # as if prefilled: its state windows are in its rings
        table = holder.block_table[:store_blocks]

        def timed_step(engine: Any = engine) -> float:
            t0 = time.perf_counter()
            engine.step()
            return time.perf_counter() - t0

        for _ in range(10):
            timed_step()
        base: list[float] = []
        during: list[float] = []
        during_copy: list[float] = []  # the same steps without the store call's time
        store_call: list[float] = []
        admission: list[float] = []
        for k in range(args.stores):
            tokens = rng.integers(0, config.vocab, pre).tolist()
            # Admission, as the engine's try_resume does it: a miss, which hashes the prompt's chain for its store.
            t0 = time.perf_counter()
            if cache.cache.resume(f"s{k}", tokens, allocate=lambda: None, state=holder) != 0:
                raise RuntimeError(f"a fresh prompt was a hit: {cache.stats_dict()}")
            admission.append(time.perf_counter() - t0)
            _settle(cache.cache)
            base += [timed_step() for _ in range(3)]
            t0 = time.perf_counter()
            cache.cache.store(f"s{k}", tokens, table, seq_len=pre, state=holder)
            store_call.append(time.perf_counter() - t0)
            first = True
            while cache.stats_dict()["copies_in_flight"] and len(during) < 10_000:
                step = timed_step()
                during.append(step + (store_call[-1] if first else 0.0))
                during_copy.append(step)
                first = False
            cache.release(table)
            cache.forget(f"s{k}")
        s = cache.stats_dict()
        row = {
            "kind": "decode",
            "layout": layout,
            "copy_streams": streams,
            "method": args.method,
            "store_mib": round(store_blocks * engine.page_bytes / 2**20, 1),
            "decode_seqs": args.decode_seqs,
            "step_ms_base": round(statistics.mean(base) * 1e3, 3),
            "step_ms_during_store": round(statistics.mean(during) * 1e3, 3) if during else None,
            "steps_during_store": len(during),
            "store_call_ms": round(statistics.median(store_call) * 1e3, 3),
            "admission_ms": round(statistics.median(admission) * 1e3, 3),
            "pages_stored": s["pages_stored"],
        }
        if during:
            row["growth"] = round(statistics.mean(during) / statistics.mean(base) - 1, 4)
            # Without the store call's own host time: what the copy streaming beside the steps costs them.
            row["growth_copy_only"] = round(statistics.mean(during_copy) / statistics.mean(base) - 1, 4)
        rows.append(row)
        cache.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for layout in args.layouts:
        for row in ttft_rows(args, layout) + decode_rows(args, layout):
            _emit(row, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
