"""`kvtier demo`: multi-turn conversations through the reference engine, with the host prefix cache off and on.

Every conversation starts from one shared system prompt; each turn's prompt is the whole history so far (earlier
prompts, the engine's own answers, a new user message). Conversations are interleaved and the GPU pool only holds
the running requests, so without the cache every turn recomputes its whole history. The two engines must generate
identical tokens; the table shows what the cache saved.

Prefill tokens, the hit rate and the identical outputs are counts: no load on the machine changes them. Times to
first token are wall clock, so they are measured to be compared: the two engines take turns (one turn of every
conversation each, the engine that goes first alternating), so a load that comes and goes falls on both; each
median comes with a distribution-free 95% interval over its requests, and the demo warns when the machine was too
busy, or the intervals too wide, for the times to tell the two apart.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The instances of `--l3 local` share a secret key made for this run: objects nobody else can forge.
DEMO_KEY = secrets.token_hex(16)
# The demo's threads waited for a CPU more than this share of the time they were ready to run: other processes
# took the CPUs, and the times measure them as much as the cache.
BUSY_WAIT_SHARE = 0.25
LEVEL = 0.95
# The host pool and state slots of the demo's caches, unless an option or KVTIER_HOST_BYTES / KVTIER_STATE_SLOTS say.
HOST_MIB = 256
STATE_SLOTS = 256


class Progress:
    """Progress on stderr (nothing when quiet): a bar redrawn in place on a terminal, one line a step otherwise."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.done, self.quiet = total, 0, quiet
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if self.quiet:
            return
        elapsed = time.perf_counter() - self.t0
        if not self.tty:
            print(f"[{self.done}/{self.total}] {label} ({elapsed:.1f} s)", file=sys.stderr, flush=True)
            return
        width = 30
        filled = width * self.done // self.total
        bar = "#" * filled + "-" * (width - filled)
        end = "\n" if self.done == self.total else ""
        print(f"\r[{bar}] {self.done}/{self.total} {label:<22} {elapsed:6.1f}s", end=end, file=sys.stderr, flush=True)


@dataclass
class Side:
    """One engine of the comparison (``cache`` None: the cache off), run a turn at a time."""

    label: str
    engine: Any
    cache: Any
    turns: Iterator[dict[str, list[int]]]
    outputs: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft_ms(self) -> dict[str, float]:
        """Request id -> time to first token."""
        return {rid: (self.engine.stats[rid].ttft or 0.0) * 1e3 for rid in self.outputs}

    @property
    def prefill_tokens(self) -> int:
        return int(self.engine.total_prefill_tokens_computed)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.engine.stats[rid].prompt_tokens for rid in self.outputs)

    def close(self) -> None:
        if self.cache is not None:
            self.stats = self.cache.stats_dict()
            self.cache.close()


def start(args: argparse.Namespace, label: str, cache_on: bool, l3_master: str | None = None) -> Side:
    """An engine (with its cache when ``cache_on``) and its conversations, before the first turn."""
    import torch

    from kvtier.deepinfer import Cache
    from kvtier.tools.engine import Engine

    torch.manual_seed(args.seed)
    engine = Engine(engine_config(args))
    cache = None
    if cache_on:
        cache = Cache(engine, size_bytes=args.host_bytes, num_state_slots=args.state_slots, **cache_args(l3_master))
        engine.cache = cache
        if l3_master and not cache.cache.flush_l3(20):
            raise RuntimeError(f"no Mooncake master at {l3_master}")
    return Side(label, engine, cache, workload(args).turn_by_turn(engine))


def cache_args(l3_master: str | None) -> dict[str, Any]:
    """The demo's settings of its caches, beside the pool sizes."""
    l3: dict[str, Any] = {"l3": "mooncake", "l3_master": l3_master, "hash_key": DEMO_KEY} if l3_master else {}
    return {"preallocate": True, **l3}


def workload(args: argparse.Namespace) -> Any:
    from kvtier.tools.workload import Conversations

    return Conversations(
        args.conversations, args.turns, args.system_tokens, args.user_tokens, args.answer_tokens, args.seed
    )


def warm_up(args: argparse.Namespace) -> None:
    """A request of a prefill chunk and two tokens (no longer than the workload's) through a throwaway engine, so
    that neither side's first turn pays for torch's first calls."""
    from kvtier.tools.engine import Engine

    cfg = engine_config(args)
    n = max(1, min(args.chunk_size + 1, workload(args).max_tokens - 2))
    Engine(cfg).generate({"warm-up": [i % cfg.vocab for i in range(n)]}, 2)


def take_turns(sides: Sequence[Side], turns: int, progress: Progress) -> None:
    """Turn t of every side, the side that goes first rotating with t, until every turn ran."""
    for t in range(turns):
        for side in [*sides[t % len(sides) :], *sides[: t % len(sides)]]:
            t0 = time.perf_counter()
            side.outputs.update(next(side.turns))
            side.seconds += time.perf_counter() - t0
            progress.step(f"{side.label}, turn {t + 1}")


def cpu_times() -> dict[int, tuple[int, int]]:
    """Per thread of this process, nanoseconds on a CPU and nanoseconds ready to run but waiting for one (Linux
    schedstat; empty where the kernel has none)."""
    out: dict[int, tuple[int, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                on_cpu, waiting = f.read().split()[:2]
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        out[int(tid)] = (int(on_cpu), int(waiting))
    return out


def wait_share(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]) -> float | None:
    """The share of the time the threads were ready to run that they spent waiting for a CPU, between two
    ``cpu_times()`` (threads started meanwhile count from zero)."""
    on_cpu = waiting = 0
    for tid, (r1, w1) in after.items():
        r0, w0 = before.get(tid, (0, 0))
        on_cpu, waiting = on_cpu + r1 - r0, waiting + w1 - w0
    return waiting / (on_cpu + waiting) if on_cpu + waiting > 0 else None


def median_interval(values: Sequence[float], level: float = LEVEL) -> tuple[float, float | None, float | None]:
    """The median of ``values`` and a distribution-free interval for it: the order statistics x(k) and
    x(n + 1 - k) with the largest k whose coverage, 1 - 2 P(Binomial(n, 1/2) < k), is at least ``level``. None for
    the interval when too few values reach that level (fewer than 6 for 95%)."""
    x = sorted(values)
    n = len(x)
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) < k + 1)
    while k < n // 2:
        below += math.comb(n, k) / 2**n
        if 1 - 2 * below < level:
            break
        k += 1
    median = float(np.median(x))
    return (median, float(x[k - 1]), float(x[n - k])) if k else (median, None, None)


def figure(values: Sequence[float]) -> dict[str, Any]:
    """A median with its interval, as the JSON output has it."""
    median, lo, hi = median_interval(values)
    return {"median": median, "interval": None if lo is None else [lo, hi], "n": len(values)}


def summarize(args: argparse.Namespace, off: Side, on: Side, share: float | None) -> dict[str, Any]:
    s = on.stats
    t_off, t_on = off.ttft_ms, on.ttft_ms
    # Turn 1 has nothing to hit but the system prompt; the later turns are where a cache pays.
    later = [k for k in t_off if not k.endswith("-t0")]
    r: dict[str, Any] = {
        "identical": off.outputs == on.outputs,
        "requests": len(off.outputs),
        "prompt_tokens": off.prompt_tokens,
        "prefill_tokens_off": off.prefill_tokens,
        "prefill_tokens_on": on.prefill_tokens,
        "hit_rate": s.get("token_hit_rate", 0.0),
        "ttft_off_ms": figure(list(t_off.values())),
        "ttft_on_ms": figure(list(t_on.values())),
        "ttft_later_turns_off_ms": figure([t_off[k] for k in later]) if later else None,
        "ttft_later_turns_on_ms": figure([t_on[k] for k in later]) if later else None,
        # The same request with the cache off and on, a turn apart at most: the load of the moment falls on both.
        "ttft_speedup": figure([t_off[k] / t_on[k] for k in t_off if t_on.get(k)]),
        "ttft_per_turn_off_ms": [figure(per_turn(t_off, t)) for t in range(args.turns)],
        "ttft_per_turn_on_ms": [figure(per_turn(t_on, t)) for t in range(args.turns)],
        "ttft_each_off_ms": t_off,
        "ttft_each_on_ms": t_on,
        "cpu_wait_share": share,
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
    r["noise"] = noise(r["ttft_off_ms"], r["ttft_on_ms"], share)
    return r


def per_turn(ttft_ms: dict[str, float], turn: int) -> list[float]:
    return [v for k, v in ttft_ms.items() if k.endswith(f"-t{turn}")]


def noise(off: dict[str, Any], on: dict[str, Any], share: float | None) -> list[str]:
    """Why the times of this run may not mean much (empty: they do)."""
    out = []
    if share is not None and share > BUSY_WAIT_SHARE:
        out.append(
            f"the demo's threads waited for a CPU {share:.0%} of the time they were ready to run (other processes "
            f"had the CPUs; over {BUSY_WAIT_SHARE:.0%} is busy)"
        )
    if off["interval"] is None or on["interval"] is None:
        out.append(f"too few requests for a {LEVEL:.0%} interval of the medians (6 at least)")
    elif off["interval"][0] <= on["interval"][1] and on["interval"][0] <= off["interval"][1]:
        out.append(f"the {LEVEL:.0%} intervals of the cache-off and cache-on medians overlap")
    return out


def ms(f: dict[str, Any] | None, unit: str = "") -> str:
    """A median and its interval: '182.6 [170.1, 195.0]'."""
    if f is None:
        return "-"
    if f["interval"] is None:
        return f"{f['median']:.1f}{unit}"
    lo, hi = f["interval"]
    return f"{f['median']:.1f}{unit} [{lo:.1f}, {hi:.1f}]"


def print_table(r: dict[str, Any]) -> None:
    mib = 1 << 20
    verdict = "identical" if r["identical"] else "DIFFERENT (a bug: please report it)"
    rows = [
        ("requests (conversations x turns)", f"{r['requests']}", ""),
        ("prompt tokens", f"{r['prompt_tokens']}", ""),
        ("prefill tokens computed", f"{r['prefill_tokens_off']}", f"{r['prefill_tokens_on']}"),
        ("token hit rate", "-", f"{r['hit_rate']:.1%}"),
        ("pages / states to host", "-", f"{r['pages_to_host']} / {r['states_to_host']}"),
        ("pages / states from host", "-", f"{r['pages_to_gpu']} / {r['states_to_gpu']}"),
        ("MiB to host / from host", "-", f"{r['bytes_to_host'] / mib:.1f} / {r['bytes_to_gpu'] / mib:.1f}"),
        ("host pool pages used", "-", f"{r['host_pages_used']} of {r['host_page_slots']}"),
        ("host pool states used", "-", f"{r['host_states_used']} of {r['host_state_slots']}"),
        ("hits deferred (KV pool full)", "-", f"{r['deferred']}"),
    ]
    print(f"\n{'':<34} {'cache off':>24} {'cache on':>24}")
    for name, a, b in rows:
        print(f"{name:<34} {a:>24} {b:>24}")
    where = "in GPU memory" if r["device"].startswith("cuda") else f"a CPU tensor (--device {r['device']})"
    print(f"(the engine's KV pool is {where}; to host: copied from it to kvtier's host pool; from host: copied")
    print(" back into it; a deferred hit waited for free blocks in the KV pool)")
    print(f"generated tokens with the cache on vs off: {verdict}")
    print(f"\ntimes (wall clock: they depend on the machine's load), median [{LEVEL:.0%} interval]:")
    timed = [
        ("TTFT (ms)", ms(r["ttft_off_ms"]), ms(r["ttft_on_ms"])),
        ("TTFT, turns 2+ (ms)", ms(r["ttft_later_turns_off_ms"]), ms(r["ttft_later_turns_on_ms"])),
        ("TTFT off / on, per request", "", ms(r["ttft_speedup"], "x")),
        ("wall time (s)", f"{r['seconds_off']:.1f}", f"{r['seconds_on']:.1f}"),
    ]
    for name, a, b in timed:
        print(f"{name:<34} {a:>24} {b:>24}")
    turns = zip(r["ttft_per_turn_off_ms"], r["ttft_per_turn_on_ms"], strict=True)
    for t, (a, b) in enumerate(turns):
        print(f"{f'TTFT, turn {t + 1} (ms)':<34} {ms(a):>24} {ms(b):>24}")
    warn(r)


def warn(r: dict[str, Any]) -> None:
    """Says whether the run's times mean much (``r["noise"]``), and how busy the machine was."""
    if r["noise"]:
        print("WARNING: these times do not tell the cache's effect apart from noise: " + "; ".join(r["noise"]))
        print("  the counts above (prefill tokens, hit rate, identical outputs) do not depend on load")
    elif r["cpu_wait_share"] is not None:
        print(f"the demo's threads waited for a CPU {r['cpu_wait_share']:.0%} of the time they were ready to run")


def plot(r: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = np.arange(1, len(r["ttft_per_turn_off_ms"]) + 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    sides = (("off", "cache off", "o", -0.12, "C0"), ("on", "kvtier host cache on", "s", 0.12, "C1"))
    for key, label, marker, dx, color in sides:
        figures = r[f"ttft_per_turn_{key}_ms"]
        each = r[f"ttft_each_{key}_ms"]
        # A log axis has no place for 0 ms (a request without a first token): such dots are left out.
        dots = [(turn + 1 + dx, v) for turn in range(len(turns)) for k, v in each.items() if k.endswith(f"-t{turn}")]
        xs = [x for x, v in dots if v > 0]
        ys = [v for x, v in dots if v > 0]
        ax.scatter(xs, ys, s=8, alpha=0.35, marker=marker, color=color)
        medians = [f["median"] for f in figures]
        lows = [f["median"] - f["interval"][0] if f["interval"] else 0.0 for f in figures]
        highs = [f["interval"][1] - f["median"] if f["interval"] else 0.0 for f in figures]
        ax.errorbar(
            turns + dx,
            medians,
            yerr=[lows, highs],
            fmt=f"{marker}-",
            color=color,
            capsize=3,
            label=f"{label}: median, {LEVEL:.0%} interval",
        )
    ax.set_xticks(list(turns))
    # A log axis: the cache-on times are a fraction of the cache-off ones, and a few slow requests of a busy machine
    # would flatten them against the bottom of a linear one. Equal ratios are equal heights.
    ax.set_yscale("log")
    ax.set_xlabel("turn of the conversation (dots: each request)")
    ax.set_ylabel("time to first token (ms, log scale)")
    title = f"kvtier demo: {r['model']} model on {r['device']}, hit rate {r['hit_rate']:.0%}"
    ax.set_title(title + ("\n(noisy run: see the warning)" if r["noise"] else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:
    from kvtier.tools.cli import at_least, plot_file
    from kvtier.tools.cli import parser as make_parser

    ap = make_parser("kvtier demo", __doc__)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--model", default="small", help="model size preset: tiny, small, medium, large")
    ap.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16")
    ap.add_argument("--layout", default="page-first", choices=["page-first", "layer-first"], help="GPU pool layout")
    ap.add_argument("--conversations", type=at_least(1), default=8, help="conversations, interleaved")
    ap.add_argument("--turns", type=at_least(1), default=6, help="turns of each conversation")
    ap.add_argument("--system-tokens", type=at_least(0), default=512, help="shared system prompt")
    ap.add_argument("--user-tokens", type=at_least(1), default=64, help="new user message of each turn")
    ap.add_argument("--answer-tokens", type=at_least(1), default=16, help="tokens generated per turn")
    ap.add_argument("--block-size", type=at_least(1), default=16, help="tokens per KV block")
    ap.add_argument("--chunk-size", type=at_least(1), default=64, help="prefill chunk, in tokens")
    ap.add_argument("--gpu-blocks", type=at_least(1), default=200, help="GPU KV pool, in blocks (small: it evicts)")
    ap.add_argument("--max-batch", type=at_least(1), default=4, help="sequences running at once")
    ap.add_argument(
        "--host-mib",
        type=at_least(1),
        help=f"host pool size, in MiB (default: KVTIER_HOST_BYTES when set, else {HOST_MIB})",
    )
    ap.add_argument(
        "--state-slots",
        type=at_least(0),
        help=f"host state slots, models with state (default: KVTIER_STATE_SLOTS when set, else {STATE_SLOTS})",
    )
    ap.add_argument("--seed", type=at_least(0), default=0, help="seed of the weights and the conversations")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object (progress: stderr)")
    ap.add_argument(
        "--plot", type=plot_file, metavar="FILE.png", help="draw time to first token per turn, cache off vs on"
    )
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr")
    ap.add_argument(
        "--l3",
        choices=["local"],
        help="local: start a Mooncake master and holder on loopback; two "
        "engine instances with separate host pools share prefixes through it",
    )
    return ap


def engine_config(args: argparse.Namespace, ap: argparse.ArgumentParser | None = None) -> Any:
    """The engine of the demo's arguments (``ap``: a bad one ends the command in one line)."""
    from kvtier.tools.cli import engine_config as checked
    from kvtier.tools.engine import EngineConfig

    fields = dict(
        device=args.device,
        dtype=args.dtype,
        layout=args.layout,
        block_size=args.block_size,
        num_gpu_blocks=args.gpu_blocks,
        max_batch=args.max_batch,
        chunk_size=args.chunk_size,
        seed=args.seed,
    )
    return EngineConfig.preset(args.model, **fields) if ap is None else checked(ap, args.model, **fields)


def check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Everything that would fail later, checked before the first request (one line, exit status 2): the KVTIER_*
    variables, the engine, the workload against its pool, the cache's settings against this machine, and Mooncake
    for --l3. Sets ``args.host_bytes`` and ``args.state_slots``: the options, else the variables, else the demo's
    defaults."""
    from kvtier.settings import from_environment
    from kvtier.tools.cli import L3_EXTRA, cache_settings, check_environment

    check_environment(ap)
    host_bytes, source = from_environment("host_bytes")
    if args.host_mib is not None:
        args.host_bytes, host = args.host_mib << 20, f"--host-mib {args.host_mib}"
    elif source == "env":
        args.host_bytes, host = host_bytes, f"KVTIER_HOST_BYTES={os.environ['KVTIER_HOST_BYTES']}"
    else:
        args.host_bytes, host = HOST_MIB << 20, f"the default --host-mib {HOST_MIB}"
    slots = "--state-slots"
    if args.state_slots is None:
        state_slots, source = from_environment("state_slots")
        args.state_slots = state_slots if source == "env" else STATE_SLOTS
        slots = "KVTIER_STATE_SLOTS" if source == "env" else slots
    cfg = engine_config(args, ap)
    longest = workload(args).max_tokens
    if -(-longest // cfg.block_size) > cfg.num_gpu_blocks:
        ap.error(
            f"--gpu-blocks {args.gpu_blocks} cannot hold the last turn's request: {longest} tokens need "
            f"{-(-longest // cfg.block_size)} blocks of {cfg.block_size}"
        )
    has_state = cfg.num_sliding_layers > 0 and cfg.state_bytes > 0
    if args.host_bytes < cfg.page_bytes:
        ap.error(f"{host} holds no page of {cfg.page_bytes} bytes")
    if has_state and args.state_slots == 0:
        ap.error(f"{slots} must be > 0 for the {args.model} model, which has state")
    cache_settings(
        ap,
        page_bytes=cfg.page_bytes,
        state_bytes=cfg.state_bytes if has_state else 0,
        host_bytes=args.host_bytes,
        state_slots=args.state_slots if has_state else 0,
        **cache_args("127.0.0.1:1" if args.l3 else None),  # a placeholder: the local master's port comes later
    )
    if args.l3 == "local":
        from kvtier.l3.store import import_mooncake

        if args.plot:
            ap.error("--plot draws the cache off/on run; --l3 local prints its table only")
        try:
            import_mooncake()
        except ImportError as e:
            ap.error(f"--l3 local needs Mooncake, which is not importable ({e}): {L3_EXTRA}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    check(ap, args)
    if args.l3 == "local":
        return main_l3(args)
    progress = Progress(2 * args.turns, args.quiet)
    warm_up(args)
    off, on = start(args, "cache off", False), start(args, "cache on", True)
    before = cpu_times()
    take_turns([off, on], args.turns, progress)
    share = wait_share(before, cpu_times())
    on.close()
    r = summarize(args, off, on, share)
    if args.json:
        print(json.dumps(r))
    else:
        print_table(r)
    if args.plot:
        # Checked writable before the run; should it fail now all the same, the figures are out already.
        try:
            plot(r, args.plot)
        except OSError as e:
            print(f"kvtier demo: error: --plot {args.plot}: {e}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0 if r["identical"] else 1


def main_l3(args: argparse.Namespace) -> int:
    """Cache off and instance A (its own engine, cache and host pool, L3 on) take turns, then instance B (the
    same, with an empty host pool) on one local Mooncake: B serves the same conversations after A, so its prefixes
    come from L3, not from its own host."""
    from kvtier.tools.mooncake import LocalMooncake

    progress = Progress(3 * args.turns, args.quiet)
    warm_up(args)
    with LocalMooncake(segment_bytes=1 << 30, lease_ttl_ms=200) as server:
        before = cpu_times()
        off, a = start(args, "cache off", False), start(args, "instance A", True, server.master_addr)
        take_turns([off, a], args.turns, progress)
        a.close()
        b = start(args, "instance B", True, server.master_addr)
        take_turns([b], args.turns, progress)
        b.close()
        share = wait_share(before, cpu_times())
    keys = [key for key, _ in L3_ROWS]
    r: dict[str, Any] = {
        "identical": off.outputs == a.outputs == b.outputs,
        "prefill_tokens_off": off.prefill_tokens,
        "prefill_tokens_a": a.prefill_tokens,
        "prefill_tokens_b": b.prefill_tokens,
        "ttft_off_ms": figure(list(off.ttft_ms.values())),
        "ttft_a_ms": figure(list(a.ttft_ms.values())),
        "ttft_b_ms": figure(list(b.ttft_ms.values())),
        "a": {k: a.stats.get(k, 0) for k in keys},
        "b": {k: b.stats.get(k, 0) for k in keys},
        "cpu_wait_share": share,
    }
    # Instance B's times are the L3 tier's story: they are the ones set against the cache off.
    r["noise"] = noise(r["ttft_off_ms"], r["ttft_b_ms"], share)
    if args.json:
        print(json.dumps(r))
        return 0 if r["identical"] else 1
    print(f"\n{'':<34} {'cache off':>22} {'instance A':>22} {'instance B':>22}")
    print(
        f"{'prefill tokens computed':<34} {r['prefill_tokens_off']:>22} {r['prefill_tokens_a']:>22} "
        f"{r['prefill_tokens_b']:>22}"
    )
    for k, label in L3_ROWS:
        show = L3_UNITS.get(k, str)
        print(f"{label:<34} {'-':>22} {show(r['a'][k]):>22} {show(r['b'][k]):>22}")
    verdict = "identical" if r["identical"] else "DIFFERENT (a bug: please report it)"
    print(f"generated tokens, cache off / instance A / instance B: {verdict}")
    print(f"\ntimes (wall clock: they depend on the machine's load), median [{LEVEL:.0%} interval]:")
    print(f"{'TTFT (ms)':<34} {ms(r['ttft_off_ms']):>22} {ms(r['ttft_a_ms']):>22} {ms(r['ttft_b_ms']):>22}")
    warn(r)
    return 0 if r["identical"] else 1


# The L3 statistics the `--l3 local` table shows (the JSON output keeps their names), and how some are shown.
L3_ROWS = (
    ("l3_puts_submitted", "objects put to L3"),
    ("l3_bytes_put", "MiB put to L3"),
    ("l3_lookups", "requests looked up in L3"),
    ("l3_hits", "L3 fetches that brought pages"),
    ("l3_pages_loaded", "pages loaded from L3"),
    ("l3_states_loaded", "states loaded from L3"),
    ("l3_bytes_loaded", "MiB loaded from L3"),
    ("l3_gets_failed", "L3 gets failed"),
    ("l3_get_seconds", "seconds in L3 gets"),
    ("l3_deadline_passed", "L3 fetches past their deadline"),
    ("l3_errors", "L3 errors"),
    ("hits", "requests resumed from the host"),
    ("token_hit_rate", "token hit rate"),
)
L3_UNITS: dict[str, Any] = {
    "l3_bytes_put": lambda v: f"{v / (1 << 20):.1f}",
    "l3_bytes_loaded": lambda v: f"{v / (1 << 20):.1f}",
    "l3_get_seconds": lambda v: f"{v:.3f}",
    "token_hit_rate": lambda v: f"{v:.1%}",
}


if __name__ == "__main__":
    raise SystemExit(main())
