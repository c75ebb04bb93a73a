"""`kvtier bench trace`: replays a request trace through the index at several pool sizes, for each eviction policy.

A trace is Mooncake's format (one JSON object a line: `input_length` tokens, `hash_ids` one id per block of the
prompt, the last one covering a partial block; two requests whose first k ids are equal share their first k
blocks), plain or gzip-compressed (`.gz`). Without one, the benchmark replays the trace that ships with kvtier: the
first ten minutes of Mooncake's public FAST'25 conversation trace (1,750 requests; its README says where the whole
hour is). Every hash id becomes its own token ids (`id * block_size + j`), so the index's chained keys reproduce the
trace's prefix sharing exactly. The rules are the seed's: requests one at a time in file order; a hit is the
cached prefix capped at `floor((n - 1) / block_size)` blocks (keep_tokens 1, no minimum hit), loaded; then every
full block of the prompt is stored. The unbounded row is a pool that never evicts: the most any policy can serve.

`--synthetic` replays a generated trace of another shape instead (`--write` saves it in the same format):
- `agents`: tool-using agents. A few long tool prompts of Zipf popularity, each request one of them plus its own
  task; half the tasks go on for a few quick steps, each extending the last.
- `recency`: LRU's best case. Conversations with no shared prompt, resumed soon after their last turn, the most
  recent likeliest; once a conversation ends its pages are never used again, however often they were used.
- `scans`: a small hot set of conversations under one system prompt, interleaved with long one-off documents.

Token hit rate: prompt tokens served from the pool over prompt tokens. Page hit rate: pages served over the
prompts' full pages. All configurations read each request once: one pass over the trace feeds every index.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier import EVICTION_POLICIES, Index, IndexConfig

DEFAULT_POOLS = "1M,3M,10M,30M"
# The first ten minutes of Mooncake's FAST'25 conversation trace (traces/README.md: source, licence, changes).
SHIPPED_TRACE = Path(__file__).resolve().parent / "traces" / "conversation_10min.jsonl.gz"
SYNTHETIC = ("agents", "recency", "scans")
TOKEN_LIMIT = 2**31  # token ids are 0 <= id < 2**31
_TOKENS = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgKMG]?)\s*$")


@dataclass(frozen=True)
class Request:
    tokens: int
    hash_ids: list[int]


def read_trace(path: str) -> list[Request]:
    """The requests of a Mooncake-format trace (gzip-compressed when its name ends in .gz); ValueError naming the line
    of a bad record."""
    out = []
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                req = Request(int(r["input_length"]), [int(x) for x in r["hash_ids"]])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i}: not a trace record ({type(e).__name__}: {e})") from None
            if req.tokens < 1 or not req.hash_ids or min(req.hash_ids) < 0:
                raise ValueError(f"{path}:{i}: input_length must be >= 1 and hash_ids non-empty and >= 0")
            out.append(req)
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def block_sizes_of(trace: Sequence[Request]) -> tuple[int, int]:
    """The block sizes that give every request exactly its number of hash ids (`ceil(input_length / block_size)`):
    the trace was made with one of them, ``(low, high)``."""
    low = max(-(-r.tokens // len(r.hash_ids)) for r in trace)
    high = min(((r.tokens - 1) // (len(r.hash_ids) - 1) for r in trace if len(r.hash_ids) > 1), default=TOKEN_LIMIT)
    if low > high:
        raise ValueError("no block size gives every request its number of hash ids: not a Mooncake-format trace")
    return low, high


def block_size_of(trace: Sequence[Request]) -> int:
    """The block size the trace was made with: 512 (Mooncake's) when it fits, else the smallest that does."""
    low, high = block_sizes_of(trace)
    return 512 if low <= 512 <= high else low


def parse_tokens(text: str) -> int:
    """`1M` -> 1_000_000 tokens (k, M, G: powers of 1000)."""
    m = _TOKENS.match(text)
    if m is None:
        raise ValueError(f"not a token count: {text!r} (e.g. 1M, 300k, 2500000)")
    n = int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()])
    if n < 1:
        raise ValueError(f"a pool must hold at least one token, got {text!r}")
    return n


def show_tokens(n: int) -> str:
    for unit, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size and n % (size // 10) == 0:
            return f"{n / size:g}{unit}"
    return str(n)


# ---- synthetic traces ------------------------------------------------------------------------------------------


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def new(self, k: int) -> list[int]:
        self.next += k
        return list(range(self.next - k, self.next))


def synthetic(shape: str, requests: int, seed: int, block_size: int = 512) -> list[Request]:
    """A generated trace of `requests` requests (see the module docstring for the shapes)."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    prompts: list[list[int]] = []
    for blocks in _shape(shape, rng, ids):
        prompts.append(blocks)
        if len(prompts) == requests:
            break
    # Each prompt's last block is partial by a random amount, as in a real trace.
    return [Request(len(p) * block_size - int(rng.integers(0, block_size)), p) for p in prompts]


def _shape(shape: str, rng: np.random.Generator, ids: _Ids) -> Iterator[list[int]]:
    if shape == "agents":
        tools = [ids.new(int(rng.integers(4, 24))) for _ in range(40)]
        weight = 1 / np.arange(1, len(tools) + 1) ** 1.1
        weight /= weight.sum()
        sessions: list[list[Any]] = []  # [history, steps left]
        while True:
            if sessions and rng.random() < 0.55:
                s = sessions[int(rng.integers(len(sessions)))]
                s[0] = s[0] + ids.new(int(rng.integers(1, 6)))
                s[1] -= 1
                if s[1] <= 0:
                    sessions.remove(s)
                yield s[0]
            else:
                task = tools[rng.choice(len(tools), p=weight)] + ids.new(int(rng.integers(2, 40)))
                if rng.random() < 0.5:
                    sessions.append([task, int(rng.geometric(0.25))])
                    if len(sessions) > 2000:
                        sessions.pop(0)
                yield task
    elif shape == "recency":
        live: list[list[Any]] = []  # conversations, least recently resumed first
        while True:
            if live and rng.random() < 0.7:
                i = len(live) - min(int(rng.geometric(0.004)), len(live))
                c = live.pop(i)
                c[0] = c[0] + ids.new(int(rng.integers(1, 6)))
                c[1] -= 1
                if c[1] > 0:
                    live.append(c)
                yield c[0]
            else:
                first = ids.new(int(rng.integers(2, 60)))
                live.append([first, int(rng.integers(1, 20))])
                yield first
    elif shape == "scans":
        system = ids.new(3)
        hot = [system + ids.new(int(rng.integers(2, 10))) for _ in range(60)]
        while True:
            if rng.random() < 0.4:
                yield ids.new(int(rng.integers(40, 200)))
            else:
                i = int(rng.zipf(1.3)) % len(hot)
                hot[i] = hot[i] + ids.new(1) if len(hot[i]) < 120 else system + ids.new(int(rng.integers(2, 10)))
                yield hot[i]
    else:
        raise ValueError(f"synthetic trace must be one of {', '.join(SYNTHETIC)}, got {shape!r}")


def write_trace(path: str, trace: Sequence[Request]) -> None:
    with open(path, "w") as f:
        for i, r in enumerate(trace):
            f.write(json.dumps({"timestamp": i, "input_length": r.tokens, "output_length": 0, "hash_ids": r.hash_ids}))
            f.write("\n")


# ---- the replay ------------------------------------------------------------------------------------------------


def replay(trace: Sequence[Request], block_size: int, pools: Sequence[int], policies: Sequence[str]) -> dict[str, Any]:
    """Every (policy, pool) configuration and the unbounded pool over one pass of the trace."""
    full_pages = sum(r.tokens // block_size for r in trace)
    # The unbounded pool is an LRU one that never fills.
    configs: list[tuple[str, int, int]] = [("unbounded", 0, max(full_pages, 1))]
    configs += [(p, tokens, max(tokens // block_size, 1)) for p in policies for tokens in pools]
    indices = [
        # xxh3: the hash decides no hit here, and it is the faster one.
        Index(
            IndexConfig(
                slots,
                block_size=block_size,
                min_hit_tokens=0,
                hash_kind="xxh3",
                eviction_policy=p if p in EVICTION_POLICIES else "lru",
            )
        )
        for p, _, slots in configs
    ]
    hit_tokens = [0] * len(configs)
    j = np.arange(block_size, dtype=np.int64)
    t0 = time.perf_counter()
    for i, r in enumerate(trace):
        ids = np.asarray(r.hash_ids, dtype=np.int64)
        tokens = ((ids[:, None] * block_size + j).reshape(-1)[: r.tokens] % TOKEN_LIMIT).astype(np.int32)
        rid = str(i)
        for c, ix in enumerate(indices):
            hit = ix.lookup(rid, tokens).hit_tokens
            if hit:
                ix.complete(ix.begin_load(rid, hit).ticket)
            ix.complete(ix.plan_store(rid, tokens).ticket)
            ix.forget(rid)
            hit_tokens[c] += hit
    seconds = time.perf_counter() - t0
    total = sum(r.tokens for r in trace)
    rows = []
    for (policy, pool_tokens, slots), ix, hit in zip(configs, indices, hit_tokens, strict=True):
        s = ix.stats()
        rows.append(
            {
                "policy": policy,
                "pool_tokens": pool_tokens if policy != "unbounded" else None,
                "page_slots": slots,
                "token_hit_rate": hit / total,
                "page_hit_rate": hit / block_size / max(full_pages, 1),
                "pages_evicted": s["pages_evicted"],
            }
        )
    return {
        "requests": len(trace),
        "prompt_tokens": total,
        "block_size": block_size,
        "pools": list(pools),
        "policies": list(policies),
        "seconds": seconds,
        "results": rows,
    }


def print_table(out: dict[str, Any], name: str) -> None:
    rows = out["results"]
    unbounded = rows[0]
    lru = {r["pool_tokens"]: r["token_hit_rate"] for r in rows if r["policy"] == "lru"}
    print(
        f"{name}: {out['requests']} requests, {out['prompt_tokens']} prompt tokens, block size {out['block_size']}; "
        f"unbounded pool: {100 * unbounded['token_hit_rate']:.1f}% of tokens, "
        f"{100 * unbounded['page_hit_rate']:.1f}% of pages ({out['seconds']:.1f} s)"
    )
    print(f"{'policy':<10} {'pool':>6} {'token hit':>10} {'vs lru':>7} {'page hit':>9} {'evicted':>9}")
    for r in rows[1:]:
        base = lru.get(r["pool_tokens"])
        ratio = f"{r['token_hit_rate'] / base:.2f}x" if base else "-"
        print(
            f"{r['policy']:<10} {show_tokens(r['pool_tokens']):>6} {100 * r['token_hit_rate']:>9.1f}% {ratio:>7} "
            f"{100 * r['page_hit_rate']:>8.1f}% {r['pages_evicted']:>9}"
        )


def plot(out: dict[str, Any], path: str, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for policy in out["policies"]:
        rows = [r for r in out["results"] if r["policy"] == policy]
        ax.plot([r["pool_tokens"] for r in rows], [100 * r["token_hit_rate"] for r in rows], marker="o", label=policy)
    ax.axhline(100 * out["results"][0]["token_hit_rate"], color="grey", linestyle="--", label="unbounded")
    ax.set_xscale("log")
    ax.set_xlabel("host pool (tokens)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(name, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from kvtier.tools.cli import at_least, mode_options, parser, plot_file

    ap = parser("kvtier bench trace", __doc__.splitlines()[0])
    ap.add_argument(
        "trace",
        nargs="?",
        help="a Mooncake-format trace (.jsonl, or .jsonl.gz); default: the one kvtier ships, the first ten minutes "
        "of Mooncake's FAST'25 conversation trace (or --synthetic)",
    )
    ap.add_argument("--synthetic", choices=SYNTHETIC, help="replay a generated trace of this shape")
    ap.add_argument("--requests", type=at_least(1), help="--synthetic: requests (default: 12000)")
    ap.add_argument("--seed", type=at_least(0), help="--synthetic: seed (default: 1)")
    ap.add_argument("--write", metavar="PATH", help="--synthetic: also write the trace here")
    ap.add_argument("--pools", default=DEFAULT_POOLS, help="host pool sizes in tokens, comma-separated (k, M, G)")
    ap.add_argument(
        "--policies", default=",".join(EVICTION_POLICIES), help=f"comma-separated, of {', '.join(EVICTION_POLICIES)}"
    )
    ap.add_argument(
        "--block-size", type=at_least(1), default=None, help="tokens a block (default: the trace's, 512 for Mooncake's)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--plot", type=plot_file, metavar="FILE.png", help="write token hit rate against pool size, one line a policy"
    )
    a = ap.parse_args(argv)
    if a.trace is not None and a.synthetic is not None:
        ap.error(f"give a trace file or --synthetic, not both (got {a.trace!r} and --synthetic {a.synthetic})")
    if a.trace is None and a.synthetic is None:
        a.trace = str(SHIPPED_TRACE)
    if a.write and not a.synthetic:
        ap.error("--write needs --synthetic")
    mode_options(ap, a, "--synthetic", a.synthetic is not None, requests=12_000, seed=1)
    try:
        a.pools = sorted({parse_tokens(t) for t in a.pools.split(",")})
    except ValueError as e:
        ap.error(f"argument --pools: {e}")
    a.policies = [p.strip() for p in a.policies.split(",")]
    bad = [p for p in a.policies if p not in EVICTION_POLICIES]
    if bad or len(set(a.policies)) != len(a.policies):
        ap.error(f"argument --policies: each of {', '.join(EVICTION_POLICIES)} at most once, got {a.policies}")
    if a.trace is not None:
        try:
            a.requests_read = read_trace(a.trace)
            if a.block_size is None:
                a.block_size = block_size_of(a.requests_read)
            else:
                low, high = block_sizes_of(a.requests_read)
                if not low <= a.block_size <= high:
                    ap.error(
                        f"argument --block-size: {a.block_size} does not give the trace's requests their numbers of "
                        f"hash ids ({low if low == high else f'{low} to {high}'} tokens a block does)"
                    )
        except (OSError, ValueError) as e:
            ap.error(str(e))
    a.block_size = a.block_size or 512
    small = [show_tokens(p) for p in a.pools if p < a.block_size]
    if small:
        ap.error(f"argument --pools: {', '.join(small)} tokens hold no block of {a.block_size}")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    bs = a.block_size
    if a.synthetic:
        trace = synthetic(a.synthetic, a.requests, a.seed, bs)
        name = f"synthetic {a.synthetic} (seed {a.seed})"
        if a.write:
            write_trace(a.write, trace)
    else:
        trace = a.requests_read
        name = os.path.basename(a.trace)
    if max(max(r.hash_ids) for r in trace) >= TOKEN_LIMIT // bs:
        print(f"kvtier bench trace: note: hash ids beyond {TOKEN_LIMIT // bs} share token ids", file=sys.stderr)
    out = replay(trace, bs, a.pools, a.policies)
    out["trace"] = name
    if a.plot:
        plot(out, a.plot, name)
    if a.json:
        print(json.dumps(out))
    else:
        print_table(out, name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
