"""`kvtier bench index`: the Rust index against plain-Python bookkeeping, from Python, in one process.

By default one long prompt (131,072 tokens in pages of 64, a pool that holds all of them): the calls an engine
repeats for a request it has seen (a lookup when every page is cached, which compares the first and last hashed
blocks; the same lookup when its hit is served, which compares every token; a store plan, which compares every
token, and its completion when every page is present), each with the token ids as a Python list and as a numpy
int32 array; the first lookup of a new request (hashing included); and the hash rates. The baseline
(`kvtier/tools/pyindex.py`) follows the same rules and caches each request's chain, extending it, as an engine does.
`--trace` runs a multi-turn workload instead (conversations sharing a system prompt, each turn a new request, a
pool small enough to evict). Times are wall clock per call, the median of `--repeat` calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier import Index, IndexConfig
from kvtier.tools.pyindex import PyIndex


def _median_us(call: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def prompt_case(tokens: int, block_size: int, page_slots: int, repeat: int, seed: int) -> dict[str, Any]:
    """The long-prompt case: every figure of the --json output."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 150_000, size=tokens, dtype=np.int32)
    ids_list = ids.tolist()
    rust = Index(IndexConfig(page_slots, block_size=block_size))
    py = PyIndex(IndexConfig(page_slots, block_size=block_size))
    rust.complete(rust.plan_store("warm", ids).ticket)
    py.complete(py.plan_store("warm", ids_list)[0])

    # A request already hashed, every page cached: the lookup an engine repeats while a request waits.
    want = rust.lookup("array", ids).hit_tokens
    hits = {"rust (array)": want, "rust (list)": rust.lookup("list", ids_list).hit_tokens}
    hits["python"] = py.lookup("py", ids_list)[0]
    if len(set(hits.values())) > 1:
        raise SystemExit(f"the two implementations disagree on the hit: {hits} tokens")
    out: dict[str, Any] = {"tokens": tokens, "block_size": block_size, "hit_tokens": want}
    out["rust_lookup_us"] = _median_us(lambda: rust.lookup("array", ids), repeat)
    out["rust_lookup_list_us"] = _median_us(lambda: rust.lookup("list", ids_list), repeat)
    out["python_lookup_us"] = _median_us(lambda: py.lookup("py", ids_list), repeat)
    # The same lookup when its hit is served next: every hashed token compared with the request's chain.
    out["rust_verified_lookup_us"] = _median_us(lambda: rust.lookup("array", ids, verify=True), repeat)
    out["rust_verified_lookup_list_us"] = _median_us(lambda: rust.lookup("list", ids_list, verify=True), repeat)

    # The store at the end of its prefill, every page present: plan (every token compared), then complete.
    out["rust_store_us"] = _median_us(lambda: rust.complete(rust.plan_store("array", ids).ticket), repeat)
    out["rust_store_list_us"] = _median_us(lambda: rust.complete(rust.plan_store("list", ids_list).ticket), repeat)
    out["python_store_us"] = _median_us(lambda: py.complete(py.plan_store("py", ids_list)[0]), repeat)

    # A new request: its first lookup hashes the whole prompt (keyed BLAKE3, the default).
    def first(x: Any, n: list[int] = [0]) -> Callable[[], object]:  # noqa: B006 - a counter for fresh ids
        def call() -> object:
            n[0] += 1
            rid = f"new{n[0]}"
            hit = rust.lookup(rid, x).hit_tokens
            rust.forget(rid)
            return hit

        return call

    first_repeat = max(3, repeat // 10)
    out["first_lookup_us"] = _median_us(first(ids), first_repeat)
    out["first_lookup_list_us"] = _median_us(first(ids_list), first_repeat)

    # Hash rates: bytes of token ids a second, hashing a whole prompt from an int32 array (the first lookup of a
    # new request on an empty index: all hashing, the walk stops at page 0).
    for kind in ("blake3", "xxh3"):

        def hash_prompt(ix: Index = Index(IndexConfig(4, block_size=block_size, hash_kind=kind))) -> None:  # noqa: B008
            ix.lookup("h", ids)
            ix.forget("h")

        out[f"hash_gbps_{kind}"] = tokens * 4 / (_median_us(hash_prompt, first_repeat) * 1e-6) / 1e9

    out["speedup_lookup"] = out["python_lookup_us"] / out["rust_lookup_us"]
    out["speedup_lookup_list"] = out["python_lookup_us"] / out["rust_lookup_list_us"]
    out["speedup_store"] = out["python_store_us"] / out["rust_store_us"]
    out["speedup_store_list"] = out["python_store_us"] / out["rust_store_list_us"]
    return out


def make_trace(conversations: int, turns: int, system: int, turn_tokens: int, seed: int) -> list[tuple[str, list[int]]]:
    rng = np.random.default_rng(seed)
    system_prompt = rng.integers(0, 32000, size=system).tolist()
    histories = [list(system_prompt) for _ in range(conversations)]
    trace = []
    for t in range(turns):
        for c in range(conversations):
            histories[c] = histories[c] + rng.integers(0, 32000, size=turn_tokens).tolist()
            trace.append((f"c{c}t{t}", list(histories[c])))
    return trace


def run_trace(ix: Index | PyIndex, trace: Sequence[tuple[str, list[int]]]) -> tuple[float, float, int]:
    """Seconds of lookups (with their loads), seconds of stores, and hit tokens over the trace; token lists in."""
    lookup_s = store_s = 0.0
    hit_tokens = 0
    for rid, tokens in trace:
        t0 = time.perf_counter()
        if isinstance(ix, Index):
            hit = ix.lookup(rid, tokens).hit_tokens
            if hit:
                ix.complete(ix.begin_load(rid, hit).ticket)
            t1 = time.perf_counter()
            ix.complete(ix.plan_store(rid, tokens).ticket)
        else:
            hit = ix.lookup(rid, tokens)[0]
            if hit:
                ix.complete(ix.begin_load(rid, hit)[0])
            t1 = time.perf_counter()
            ix.complete(ix.plan_store(rid, tokens)[0])
        ix.forget(rid)
        t2 = time.perf_counter()
        lookup_s += t1 - t0
        store_s += t2 - t1
        hit_tokens += hit
    return lookup_s, store_s, hit_tokens


def trace_case(a: argparse.Namespace) -> dict[str, Any]:
    trace = make_trace(a.conversations, a.turns, a.system_tokens, a.turn_tokens, a.seed)
    ops = len(trace)

    def best(make: Callable[[], Index | PyIndex]) -> tuple[float, float, int]:
        runs = [run_trace(make(), trace) for _ in range(a.repeat)]
        return min(runs, key=lambda r: r[0] + r[1])

    rust = best(lambda: Index(IndexConfig(a.page_slots, block_size=a.block_size)))
    py = best(lambda: PyIndex(IndexConfig(a.page_slots, block_size=a.block_size)))
    if rust[2] != py[2]:
        raise SystemExit(f"the two implementations disagree: {rust[2]} vs {py[2]} hit tokens")
    tokens = sum(len(t) for _, t in trace)
    out: dict[str, Any] = {
        "ops": ops,
        "tokens": tokens,
        "avg_prompt_tokens": tokens / ops,
        "hit_tokens": rust[2],
        "rust_lookup_us": rust[0] / ops * 1e6,
        "python_lookup_us": py[0] / ops * 1e6,
        "rust_store_us": rust[1] / ops * 1e6,
        "python_store_us": py[1] / ops * 1e6,
    }
    out["speedup_lookup"] = out["python_lookup_us"] / out["rust_lookup_us"]
    out["speedup_store"] = out["python_store_us"] / out["rust_store_us"]
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from kvtier.tools.cli import at_least, mode_options, parser

    ap = parser("kvtier bench index", __doc__)
    ap.add_argument("--tokens", type=at_least(1), help="prompt length of the long-prompt case (default: 131072)")
    ap.add_argument("--block-size", type=at_least(1), default=None, help="tokens a page (default: 64, --trace: 16)")
    ap.add_argument(
        "--page-slots",
        type=at_least(1),
        default=None,
        help="host pool size in pages (default: two prompts, and one at least; --trace: 4096, small enough to evict)",
    )
    ap.add_argument(
        "--repeat",
        type=at_least(1),
        default=None,
        help="timed calls a figure, the median counts (default: 200; --trace: runs, the fastest counts: 3)",
    )
    ap.add_argument("--trace", action="store_true", help="the multi-turn trace instead of one long prompt")
    ap.add_argument("--conversations", type=at_least(1), help="--trace: conversations (default: 16)")
    ap.add_argument("--turns", type=at_least(1), help="--trace: turns a conversation (default: 8)")
    ap.add_argument("--system-tokens", type=at_least(1), help="--trace: shared system prompt (default: 2048)")
    ap.add_argument("--turn-tokens", type=at_least(1), help="--trace: tokens each turn adds (default: 512)")
    ap.add_argument("--seed", type=at_least(0), default=0, help="seed of the prompt's (or the trace's) token ids")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    mode_options(ap, a, "the long-prompt case (without --trace)", not a.trace, tokens=131_072)
    mode_options(ap, a, "--trace", a.trace, conversations=16, turns=8, system_tokens=2048, turn_tokens=512)
    if a.block_size is None:
        a.block_size = 16 if a.trace else 64
    if a.page_slots is None:
        a.page_slots = 4096 if a.trace else 2 * (a.tokens // a.block_size) + 16
    if a.repeat is None:
        a.repeat = 3 if a.trace else 200
    if not a.trace and a.tokens < 2 * a.block_size + 1:
        ap.error(f"--tokens must be > 2 x --block-size ({2 * a.block_size}) so that a lookup can hit, got {a.tokens}")
    if not a.trace and a.page_slots < a.tokens // a.block_size:
        # The case times the calls for a prompt whose every page is cached: a smaller pool holds only part of it.
        ap.error(
            f"--page-slots must hold the prompt's {a.tokens // a.block_size} pages (every page cached), "
            f"got {a.page_slots}"
        )
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.trace:
        out = trace_case(a)
    else:
        out = prompt_case(a.tokens, a.block_size, a.page_slots, a.repeat, a.seed)
    if a.json:
        print(json.dumps(out))
        return 0
    if a.trace:
        print(
            f"{out['ops']} turns, {out['tokens']} prompt tokens ({out['avg_prompt_tokens']:.0f} a prompt), "
            f"{out['hit_tokens']} hit tokens"
        )
        print(f"{'op':<8} {'rust us':>10} {'python us':>10} {'speedup':>8}")
        for op in ("lookup", "store"):
            r, p = out[f"rust_{op}_us"], out[f"python_{op}_us"]
            print(f"{op:<8} {r:>10.1f} {p:>10.1f} {p / r:>7.1f}x")
        return 0
    print(f"one prompt of {out['tokens']} tokens, pages of {out['block_size']}, every page cached")
    print(f"{'call':<28} {'rust array':>11} {'rust list':>11} {'python':>11} {'speedup':>15}")
    for op, what in (("lookup", "lookup (already hashed)"), ("store", "store plan + complete")):
        r, rl, p = out[f"rust_{op}_us"], out[f"rust_{op}_list_us"], out[f"python_{op}_us"]
        print(f"{what:<28} {r:>9.1f}us {rl:>9.1f}us {p:>9.1f}us {p / r:>6.1f}x / {p / rl:>5.1f}x")
        if op == "lookup":
            v, vl = out["rust_verified_lookup_us"], out["rust_verified_lookup_list_us"]
            print(f"{'lookup, every token compared':<28} {v:>9.1f}us {vl:>9.1f}us")
    print(f"{'first lookup (keyed BLAKE3)':<28} {out['first_lookup_us']:>9.1f}us {out['first_lookup_list_us']:>9.1f}us")
    print(f"hashing: keyed BLAKE3 {out['hash_gbps_blake3']:.2f} GB/s, xxh3 {out['hash_gbps_xxh3']:.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
