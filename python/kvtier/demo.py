"""`kvtier demo`: multi-turn conversations through the reference engine, with the host prefix cache off and on.

Every conversation starts from one shared system prompt; each turn's prompt is the whole history so far (earlier
prompts, the engine's own answers, a new user message). Conversations are interleaved and the GPU pool only holds
the running requests, so without the cache every turn recomputes its whole history. The two runs must generate
identical tokens; the table shows what the cache saved.
"""

from __future__ import annotations

import argparse
import importlib
import json
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The instances of `--l3 local` share a secret key made for this run: objects nobody else can forge.
DEMO_KEY = secrets.token_hex(16)


@dataclass
class RunResult:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    ttft_ms: dict[str, float] = field(default_factory=dict)  # request id -> time to first token
    prefill_tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)


class Progress:
    """A one-line progress bar on stderr (nothing when quiet)."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.done, self.quiet = total, 0, quiet
        self.t0 = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if self.quiet:
            return
        width = 30
        filled = width * self.done // self.total
        elapsed = time.perf_counter() - self.t0
        bar = "#" * filled + "-" * (width - filled)
        end = "\n" if self.done == self.total else ""
        print(f"\r[{bar}] {self.done}/{self.total} {label:<22} {elapsed:6.1f}s", end=end, file=sys.stderr, flush=True)


def run(args: argparse.Namespace, cache_on: bool, progress: Progress, l3_master: str | None = None) -> RunResult:
    import torch

    from kvtier.deepinfer import Cache
    from kvtier.engine import Engine
    from kvtier.workload import Conversations

    torch.manual_seed(args.seed)
    engine = Engine(engine_config(args))
    cache = None
    if cache_on:
        l3: dict[str, Any] = {"l3": "mooncake", "l3_master": l3_master, "hash_key": DEMO_KEY} if l3_master else {}
        cache = Cache(engine, size_bytes=args.host_mib << 20, num_state_slots=args.state_slots, preallocate=True, **l3)
        engine.cache = cache
        if l3_master and not cache.cache._l3.wait_connected(20):
            raise RuntimeError(f"no Mooncake master at {l3_master}")
    work = Conversations(
        args.conversations, args.turns, args.system_tokens, args.user_tokens, args.answer_tokens, args.seed
    )
    res = RunResult()
    t0 = time.perf_counter()
    label = "on" if cache_on else "off"
    res.outputs = work.run(engine, on_turn=lambda t: progress.step(f"cache {label}, turn {t + 1}"))
    res.ttft_ms = {rid: (engine.stats[rid].ttft or 0.0) * 1e3 for rid in res.outputs}
    res.prompt_tokens = sum(engine.stats[rid].prompt_tokens for rid in res.outputs)
    res.seconds = time.perf_counter() - t0
    res.prefill_tokens = engine.total_prefill_tokens_computed
    if cache is not None:
        res.stats = cache.stats_dict()
        cache.close()
    return res


def per_turn(res: RunResult, turns: int) -> list[float]:
    """Median time to first token of each turn, in ms."""
    return [float(np.median([v for k, v in res.ttft_ms.items() if k.endswith(f"-t{t}")])) for t in range(turns)]


def summarize(args: argparse.Namespace, off: RunResult, on: RunResult) -> dict[str, Any]:
    identical = off.outputs == on.outputs
    s = on.stats
    # Turn 0 has nothing to hit but the system prompt; the later turns are where a cache pays.
    later = [k for k in off.ttft_ms if not k.endswith("-t0")]
    return {
        "identical": identical,
        "requests": len(off.outputs),
        "prompt_tokens": off.prompt_tokens,
        "prefill_tokens_off": off.prefill_tokens,
        "prefill_tokens_on": on.prefill_tokens,
        "hit_rate": s.get("token_hit_rate", 0.0),
        "ttft_p50_off_ms": float(np.percentile(list(off.ttft_ms.values()), 50)),
        "ttft_p50_on_ms": float(np.percentile(list(on.ttft_ms.values()), 50)),
        "ttft_p99_off_ms": float(np.percentile(list(off.ttft_ms.values()), 99)),
        "ttft_p99_on_ms": float(np.percentile(list(on.ttft_ms.values()), 99)),
        "ttft_p50_later_turns_off_ms": float(np.percentile([off.ttft_ms[k] for k in later], 50)) if later else 0.0,
        "ttft_p50_later_turns_on_ms": float(np.percentile([on.ttft_ms[k] for k in later], 50)) if later else 0.0,
        "ttft_per_turn_off_ms": per_turn(off, args.turns),
        "ttft_per_turn_on_ms": per_turn(on, args.turns),
        "seconds_off": off.seconds,
        "seconds_on": on.seconds,
        "pages_to_host": s.get("pages_stored", 0),
        "pages_to_gpu": s.get("pages_loaded", 0),
        "states_to_host": s.get("states_stored", 0),
        "states_to_gpu": s.get("states_loaded", 0),
        "bytes_to_host": s.get("bytes_to_host", 0),
        "bytes_to_gpu": s.get("bytes_to_gpu", 0),
        "host_pages_used": s.get("pages_used", 0),
        "host_page_slots": s.get("page_slots", 0),
        "host_states_used": s.get("states_used", 0),
        "host_state_slots": s.get("state_slots", 0),
        "pages_evicted": s.get("pages_evicted", 0),
        "deferred": s.get("deferred", 0),
        "cache_errors": s.get("errors", 0),
        "device": args.device,
        "model": args.model,
        "layout": args.layout,
    }


def print_table(r: dict[str, Any]) -> None:
    mib = 1 << 20
    rows = [
        ("requests (conversations x turns)", f"{r['requests']}", ""),
        ("prompt tokens", f"{r['prompt_tokens']}", ""),
        ("prefill tokens computed", f"{r['prefill_tokens_off']}", f"{r['prefill_tokens_on']}"),
        ("token hit rate", "-", f"{r['hit_rate']:.1%}"),
        ("TTFT p50 (ms)", f"{r['ttft_p50_off_ms']:.1f}", f"{r['ttft_p50_on_ms']:.1f}"),
        ("TTFT p99 (ms)", f"{r['ttft_p99_off_ms']:.1f}", f"{r['ttft_p99_on_ms']:.1f}"),
        (
            "TTFT p50, turns 2+ (ms)",
            f"{r['ttft_p50_later_turns_off_ms']:.1f}",
            f"{r['ttft_p50_later_turns_on_ms']:.1f}",
        ),
        ("wall time (s)", f"{r['seconds_off']:.1f}", f"{r['seconds_on']:.1f}"),
        ("pages / states GPU->host", "-", f"{r['pages_to_host']} / {r['states_to_host']}"),
        ("pages / states host->GPU", "-", f"{r['pages_to_gpu']} / {r['states_to_gpu']}"),
        ("MiB GPU->host / host->GPU", "-", f"{r['bytes_to_host'] / mib:.1f} / {r['bytes_to_gpu'] / mib:.1f}"),
        ("host pool pages used", "-", f"{r['host_pages_used']} of {r['host_page_slots']}"),
        ("host pool states used", "-", f"{r['host_states_used']} of {r['host_state_slots']}"),
        ("GPU-pool deferrals", "-", f"{r['deferred']}"),
    ]
    print(f"\n{'':<34} {'cache off':>12} {'cache on':>18}")
    for name, a, b in rows:
        print(f"{name:<34} {a:>12} {b:>18}")
    turns = zip(r["ttft_per_turn_off_ms"], r["ttft_per_turn_on_ms"], strict=True)
    print(
        "\nper turn, median TTFT (ms):  " + "  ".join(f"t{t + 1}: {a:.0f} -> {b:.0f}" for t, (a, b) in enumerate(turns))
    )
    verdict = "identical" if r["identical"] else "DIFFERENT (a bug: please report it)"
    print(f"generated tokens with the cache on vs off: {verdict}")


def plot(r: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = range(1, len(r["ttft_per_turn_off_ms"]) + 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(turns, r["ttft_per_turn_off_ms"], "o-", label="cache off")
    ax.plot(turns, r["ttft_per_turn_on_ms"], "s-", label="kvtier host cache on")
    ax.set_xticks(list(turns))
    ax.set_xlabel("turn of the conversation")
    ax.set_ylabel("median time to first token (ms)")
    ax.set_title(f"kvtier demo: {r['model']} model on {r['device']}, hit rate {r['hit_rate']:.0%}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:
    from kvtier.cli import at_least
    from kvtier.cli import parser as make_parser

    ap = make_parser("kvtier demo", __doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--model", default="small", help="model size preset: tiny, small, medium, large")
    ap.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16")
    ap.add_argument("--layout", default="page-first", choices=["page-first", "layer-first"], help="GPU pool layout")
    ap.add_argument("--conversations", type=at_least(1), default=8, help="conversations, interleaved")
    ap.add_argument("--turns", type=at_least(1), default=6, help="turns of each conversation")
    ap.add_argument("--system-tokens", type=at_least(1), default=512, help="shared system prompt")
    ap.add_argument("--user-tokens", type=at_least(1), default=64, help="new user message of each turn")
    ap.add_argument("--answer-tokens", type=at_least(1), default=16, help="tokens generated per turn")
    ap.add_argument("--block-size", type=at_least(1), default=16, help="tokens per KV block")
    ap.add_argument("--chunk-size", type=at_least(1), default=64, help="prefill chunk, in tokens")
    ap.add_argument("--gpu-blocks", type=at_least(1), default=200, help="GPU KV pool, in blocks (small: it evicts)")
    ap.add_argument("--max-batch", type=at_least(1), default=4, help="sequences running at once")
    ap.add_argument("--host-mib", type=at_least(1), default=256, help="host pool size, in MiB")
    ap.add_argument("--state-slots", type=at_least(0), default=256, help="host state slots (models with state)")
    ap.add_argument("--seed", type=at_least(0), default=0, help="seed of the weights and the conversations")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--plot", metavar="FILE.png", help="draw time to first token per turn, cache off vs on")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument(
        "--l3",
        choices=["local"],
        help="local: start a Mooncake master and holder on loopback; two "
        "engine instances with separate host pools share prefixes through it",
    )
    return ap


def engine_config(args: argparse.Namespace) -> Any:
    from kvtier.engine import EngineConfig

    return EngineConfig.preset(
        args.model,
        device=args.device,
        dtype=args.dtype,
        layout=args.layout,
        block_size=args.block_size,
        num_gpu_blocks=args.gpu_blocks,
        max_batch=args.max_batch,
        chunk_size=args.chunk_size,
        seed=args.seed,
    )


def check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Everything that would fail later, checked before the baseline runs (one line, exit status 2)."""
    from kvtier.cli import L3_EXTRA
    from kvtier.settings import CacheSettings, check_fits

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error('--plot needs matplotlib: pip install "kvtier[demo]"')
    if args.l3 == "local":
        try:
            importlib.import_module("mooncake.store")
        except ImportError as e:
            ap.error(f"--l3 local needs Mooncake, which is not importable ({e}): {L3_EXTRA}")
    try:
        cfg = engine_config(args)
        settings = CacheSettings(host_bytes=args.host_mib << 20, state_slots=args.state_slots)
        has_state = cfg.num_sliding_layers > 0 and cfg.state_bytes > 0
        if args.host_mib << 20 < cfg.page_bytes:
            raise ValueError(f"--host-mib {args.host_mib} holds no page of {cfg.page_bytes} bytes")
        if has_state and args.state_slots == 0:
            raise ValueError(f"--state-slots must be > 0 for the {args.model} model, which has state")
        check_fits(
            settings,
            page_slots=(args.host_mib << 20) // cfg.page_bytes,
            page_bytes=cfg.page_bytes,
            state_bytes=cfg.state_bytes if has_state else 0,
        )
    except ValueError as e:
        ap.error(str(e))


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    check(ap, args)
    if args.l3 == "local":
        return main_l3(args)
    progress = Progress(2 * args.turns, args.quiet or args.json)
    off = run(args, False, progress)
    on = run(args, True, progress)
    r = summarize(args, off, on)
    if args.plot:
        plot(r, args.plot)
    if args.json:
        print(json.dumps(r))
    else:
        print_table(r)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0 if r["identical"] else 1


def main_l3(args: argparse.Namespace) -> int:
    """Cache off, then instance A and instance B (each its own engine, cache and host pool, L3 on) on one local
    Mooncake: B serves the same conversations after A, so its prefixes come from L3, not from its own host."""
    from kvtier.l3.server import LocalMooncake

    progress = Progress(3 * args.turns, args.quiet or args.json)
    off = run(args, False, progress)
    with LocalMooncake(segment_bytes=1 << 30, lease_ttl_ms=200) as server:
        a = run(args, True, progress, l3_master=server.master_addr)
        b = run(args, True, progress, l3_master=server.master_addr)
    keys = (
        "l3_puts_submitted",
        "l3_bytes_put",
        "l3_lookups",
        "l3_hits",
        "l3_pages_loaded",
        "l3_states_loaded",
        "l3_bytes_loaded",
        "l3_gets_failed",
        "l3_get_seconds",
        "l3_deadline_passed",
        "l3_errors",
        "hits",
        "token_hit_rate",
    )
    r: dict[str, Any] = {
        "identical": off.outputs == a.outputs == b.outputs,
        "prefill_tokens_off": off.prefill_tokens,
        "prefill_tokens_a": a.prefill_tokens,
        "prefill_tokens_b": b.prefill_tokens,
        "ttft_p50_off_ms": float(np.percentile(list(off.ttft_ms.values()), 50)),
        "ttft_p50_a_ms": float(np.percentile(list(a.ttft_ms.values()), 50)),
        "ttft_p50_b_ms": float(np.percentile(list(b.ttft_ms.values()), 50)),
        "a": {k: a.stats.get(k, 0) for k in keys},
        "b": {k: b.stats.get(k, 0) for k in keys},
    }
    if args.json:
        print(json.dumps(r))
    else:
        print(f"\n{'':<34} {'cache off':>12} {'instance A':>12} {'instance B':>12}")
        print(
            f"{'prefill tokens computed':<34} {r['prefill_tokens_off']:>12} {r['prefill_tokens_a']:>12} "
            f"{r['prefill_tokens_b']:>12}"
        )
        print(
            f"{'TTFT p50 (ms)':<34} {r['ttft_p50_off_ms']:>12.1f} {r['ttft_p50_a_ms']:>12.1f} "
            f"{r['ttft_p50_b_ms']:>12.1f}"
        )
        for k in keys:
            fmt = (lambda v: f"{v:.3f}") if isinstance(a.stats.get(k, 0), float) else str
            print(f"{k:<34} {'-':>12} {fmt(r['a'][k]):>12} {fmt(r['b'][k]):>12}")
        verdict = "identical" if r["identical"] else "DIFFERENT (a bug: please report it)"
        print(f"generated tokens, cache off / instance A / instance B: {verdict}")
    return 0 if r["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
