"""`kvtier bench index`: the Rust index against the plain-Python bookkeeping on the same operation trace.

The trace is a multi-turn workload: conversations share a system prompt, each turn's prompt is the previous turn's
prompt plus new tokens, and the host pool is small enough to evict. For every turn both implementations look the
prompt up (and load the hit), then plan and complete its store. Times are per operation, wall clock, in one
process; the Rust side includes turning the engine's token list into an int32 array.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import numpy as np

from kvtier import Index
from kvtier.pyindex import PyIndex


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


class RustSide:
    """The Rust index, fed int32 arrays made from the engine's token lists."""

    def __init__(self, page_slots: int, block_size: int) -> None:
        self.ix = Index(page_slots, block_size=block_size)

    def prepare(self, tokens: list[int]) -> np.ndarray:
        return np.asarray(tokens, dtype=np.int32)

    def lookup(self, rid: str, tokens: np.ndarray) -> int:
        return self.ix.lookup(rid, tokens).hit_tokens

    def load(self, rid: str, hit: int) -> int:
        return self.ix.begin_load(rid, hit).ticket

    def store(self, rid: str, tokens: np.ndarray) -> int:
        return self.ix.plan_store(rid, tokens).ticket


class PythonSide:
    """The plain-Python bookkeeping, fed the token lists as they are."""

    def __init__(self, page_slots: int, block_size: int) -> None:
        self.ix = PyIndex(page_slots, block_size=block_size)

    def prepare(self, tokens: list[int]) -> list[int]:
        return tokens

    def lookup(self, rid: str, tokens: list[int]) -> int:
        return self.ix.lookup(rid, tokens)[0]

    def load(self, rid: str, hit: int) -> int:
        return self.ix.begin_load(rid, hit)[0]

    def store(self, rid: str, tokens: list[int]) -> int:
        return self.ix.plan_store(rid, tokens)[0]


def run(side: RustSide | PythonSide, trace: Sequence[tuple[str, list[int]]]) -> tuple[float, float, int]:
    """Seconds of lookups (with their loads), seconds of stores, and hit tokens over the trace."""
    ix = side.ix
    lookup_s = store_s = 0.0
    hit_tokens = 0
    for rid, tokens in trace:
        t0 = time.perf_counter()
        prepared = side.prepare(tokens)
        hit = side.lookup(rid, prepared)
        if hit:
            ix.complete(side.load(rid, hit))
        t1 = time.perf_counter()
        ix.complete(side.store(rid, prepared))
        ix.forget(rid)
        t2 = time.perf_counter()
        lookup_s += t1 - t0
        store_s += t2 - t1
        hit_tokens += hit
    return lookup_s, store_s, hit_tokens


def main(argv: Sequence[str] | None = None) -> int:
    from kvtier.cli import at_least, parser

    ap = parser("kvtier bench index", __doc__.splitlines()[0])
    ap.add_argument("--conversations", type=at_least(1), default=16, help="conversations in the trace")
    ap.add_argument("--turns", type=at_least(1), default=8, help="turns of each conversation")
    ap.add_argument("--system-tokens", type=at_least(1), default=2048, help="shared system prompt")
    ap.add_argument("--turn-tokens", type=at_least(1), default=512, help="tokens each turn adds")
    ap.add_argument("--block-size", type=at_least(1), default=16, help="tokens per KV block")
    ap.add_argument("--page-slots", type=at_least(1), default=4096, help="host pool size in pages (small: it evicts)")
    ap.add_argument("--repeat", type=at_least(1), default=3, help="runs of each side; the fastest counts")
    ap.add_argument("--seed", type=at_least(0), default=0, help="seed of the trace")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    trace = make_trace(a.conversations, a.turns, a.system_tokens, a.turn_tokens, a.seed)
    ops = len(trace)
    tokens = sum(len(t) for _, t in trace)
    def best(side: type[RustSide] | type[PythonSide]) -> tuple[float, float, int]:
        runs = [run(side(a.page_slots, a.block_size), trace) for _ in range(a.repeat)]
        return min(runs, key=lambda r: r[0] + r[1])

    rust, py = best(RustSide), best(PythonSide)
    if rust[2] != py[2]:
        raise SystemExit(f"the two implementations disagree: {rust[2]} vs {py[2]} hit tokens")
    out = {
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
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"{ops} turns, {tokens} prompt tokens ({out['avg_prompt_tokens']:.0f} a prompt), {rust[2]} hit tokens")
    print(f"{'op':<8} {'rust us':>10} {'python us':>10} {'speedup':>8}")
    for op in ("lookup", "store"):
        r, p = out[f"rust_{op}_us"], out[f"python_{op}_us"]
        print(f"{op:<8} {r:>10.1f} {p:>10.1f} {p / r:>7.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
