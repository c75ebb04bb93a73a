"""`kvtier soak`: a randomized fault and load driver over the reference engine, bounded in time.

Each round draws an engine (layout, layer pattern, a GPU pool small enough to run out) and a tiny host cache
(constant eviction), runs a random multi-turn workload with the cache off and then on, and injects faults while
the cache is on: engine state callbacks and page copies that raise, and forget() of requests in flight; with
L3, Store faults (failed calls, lost, short, corrupted and misplaced values) and a master restart. Every
generated token must equal cache off; the index's invariants are checked at every engine step; when the round
ends, no copy is in flight, every chain was forgotten and no host slot is held. It prints one summary line,
which says whether the resident memory grew within its bound (RSS_BOUND_MIB after the warm-up round); the exit
status is 1 on a mismatch or a growth over the bound.
"""

from __future__ import annotations

import ctypes
import json
import logging
import random
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.deepinfer import Cache
from kvtier.l3.store import MooncakeStore, Store, StoreConfig
from kvtier.tools.engine import Engine, EngineConfig
from kvtier.tools.faults import StoreWrapper
from kvtier.tools.workload import Conversations

# Resident memory may grow this much after the warm-up round: torch's and the allocator's working set. Every
# round closes its pools, so more is a leak until shown otherwise.
RSS_BOUND_MIB = 96.0


class Fault(RuntimeError):
    """An injected failure."""


@dataclass
class Summary:
    rounds: int = 0
    requests: int = 0
    hits: int = 0
    hit_tokens: int = 0
    l3_hits: int = 0
    l3_rejected: int = 0
    l3_tampered: int = 0  # values a get returned short or corrupted: each must be rejected
    l3_restarts: int = 0
    deferred: int = 0
    evicted: int = 0
    faults: int = 0
    forgets: int = 0
    steps_checked: int = 0
    mismatches: int = 0
    rss_growth_mib: float = 0.0
    rss_bound_mib: float = RSS_BOUND_MIB
    seconds: float = 0.0

    @property
    def rss_within_bound(self) -> bool:
        return self.rss_growth_mib <= self.rss_bound_mib

    @property
    def passed(self) -> bool:
        """Cache on equalled cache off, and memory stayed within its bound."""
        return self.mismatches == 0 and self.rss_within_bound

    def line(self) -> str:
        fields = " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in asdict(self).items())
        memory = "within its bound" if self.rss_within_bound else "OVER its bound: a leak until shown otherwise"
        outputs = "cache on equals cache off" if self.mismatches == 0 else f"{self.mismatches} MISMATCHES"
        return f"soak: {fields} ({outputs}; memory growth {memory})"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rss_within_bound": self.rss_within_bound, "passed": self.passed}


def rss_mib() -> float:
    """Resident memory now (Linux), in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / (1 << 20)


def flaky(fn: Any, rng: random.Random, p: float, summary: Summary) -> Any:
    """``fn`` that raises an injected fault with probability ``p``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if rng.random() < p:
            summary.faults += 1
            raise Fault("injected")
        return fn(*args, **kwargs)

    return call


class FaultyStore(StoreWrapper):
    """A Store over a real client that fails on purpose: puts and gets that fail, objects removed between exists()
    and get(), short reads, values corrupted on the way in (one bit flipped) and values put under another object's
    key (misplaced). None of them may ever be served."""

    def __init__(self, store: Store, rng: random.Random, p: float, summary: Summary) -> None:
        super().__init__(store)
        self._rng, self._p, self._summary = rng, p, summary

    def _fault(self) -> bool:
        hit = self._rng.random() < self._p
        self._summary.faults += hit
        return hit

    def put_many(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        if self._fault():
            return [-800] * len(keys)  # transfer failed
        same = [i for i in range(1, len(keys)) if list(sizes[i]) == list(sizes[0])]
        if same and self._fault():
            keys = list(keys)
            keys[0], keys[same[0]] = keys[same[0]], keys[0]  # misplaced: each value under the other's key
        return self.inner.put_many(keys, ptrs, sizes)

    def exists_many(self, keys: Sequence[str]) -> list[int]:
        codes = self.inner.exists_many(keys)
        present = [k for k, c in zip(keys, codes, strict=False) if c == 1]
        if present and self._fault():
            self.inner.remove(self._rng.choice(present), True)  # lost between exists() and get()
        return codes

    def get_many(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        if self._fault():
            return [-800] * len(keys)
        got = self.inner.get_many(keys, ptrs, sizes)
        if got and got[0] > 0 and self._fault():
            got = [got[0] - 16, *got[1:]]  # a short read
            self._summary.l3_tampered += 1
        if got and got[0] == sum(sizes[0]) and self._fault():
            at = ptrs[0][-1] + self._rng.randrange(sizes[0][-1])
            ctypes.c_uint8.from_address(at).value ^= 1 << self._rng.randrange(8)  # corrupted: one bit flipped
            self._summary.l3_tampered += 1
        return got


# Whole: one randomized round in the order it runs (engines, faults, the checks after every step), on shared state.
def one_round(rng: random.Random, device: str, fault_p: float, summary: Summary, l3: Any = None) -> None:
    pattern = rng.choice(["FS", "F", "SF"])
    cfg = EngineConfig.preset(
        "tiny",
        device=device,
        layout=rng.choice(["page-first", "layer-first"]),
        layer_pattern=pattern,
        num_gpu_blocks=rng.randint(24, 64),
        num_state_rings=rng.randint(2, 6),
        max_batch=rng.randint(2, 6),
        chunk_size=rng.choice([16, 32, 64]),
        ring_slack=rng.choice([16, 48, 64]),
        seed=rng.randrange(1 << 16),
    )
    work = Conversations(
        conversations=rng.randint(2, 6),
        turns=rng.randint(2, 4),
        system_tokens=rng.randint(16, 96),
        user_tokens=rng.randint(4, 40),
        answer_tokens=rng.randint(1, 6),
        seed=rng.randrange(1 << 16),
    )
    expected = work.run(Engine(cfg))

    engine = Engine(cfg)
    has_state = engine.gpu_states is not None
    l3_settings: dict[str, Any] = {}
    if l3 is not None:

        def faulty(config: StoreConfig) -> Store:
            return FaultyStore(MooncakeStore(config), rng, fault_p, summary)

        l3_settings = {
            "l3": "mooncake",
            "l3_master": l3.master_addr,
            "hash_key": f"kvtier soak {rng.random()}",
            "l3_group_pages": rng.choice([1, 2, 4]),
            "l3_deadline_ms": rng.choice([5, 50, 500]),
            "l3_store": faulty,
        }
    if has_state:  # the engine's state kernels fail at random
        engine.select_state = flaky(engine.select_state, rng, fault_p, summary)  # type: ignore[method-assign]
        engine.load_state = flaky(engine.load_state, rng, fault_p, summary)  # type: ignore[method-assign]
    cache = Cache(
        engine,
        size_bytes=rng.randint(4, 24) * engine.page_bytes,
        num_state_slots=rng.randint(1, 6) if has_state else None,
        preallocate=rng.random() < 0.5 or l3 is not None,
        pin_step_bytes=4 * engine.page_bytes,
        max_errors=1 << 30,
        **l3_settings,
    )
    engine.cache = cache
    inner = cache.cache
    restart_at = -1
    if l3 is not None:
        inner.l3.wait_connected(10)
        if summary.l3_restarts == 0 and summary.rounds >= 2:
            restart_at = rng.randint(5, 40)  # restart the master once, in the middle of a round
    # Copy faults: page copy batches fail at random, as failed launches do (the core's fault seam).
    inner.core.set_copy_fault(flaky(lambda: False, rng, fault_p, summary))

    poll = cache.poll

    def checked_poll() -> None:
        poll()
        inner.index.check()
        summary.steps_checked += 1
        if summary.steps_checked == restart_at + steps0:
            l3.restart_master()
            summary.l3_restarts += 1
        if engine.running and rng.random() < 0.05:
            seq = rng.choice(engine.running)
            cache.forget(seq.request_id)
            summary.forgets += 1

    steps0 = summary.steps_checked
    cache.poll = checked_poll  # type: ignore[method-assign]
    got = work.run(engine)
    summary.mismatches += sum(got.get(rid) != out for rid, out in expected.items())
    inner.wait_pinned(30)
    if inner.l3 is not None:
        inner.l3.flush(10)  # puts and fetches in flight release their slots
    inner.poll()
    s = cache.stats_dict()
    inner.index.check()
    if s["copies_in_flight"] or s["requests"] or s["pages_used"] != s["pages_evictable"]:
        raise AssertionError(f"round ended with work left over: {s}")
    cache.close()
    summary.rounds += 1
    summary.requests += len(expected)
    summary.hits += s["hits"]
    summary.hit_tokens += s["hit_tokens"]
    summary.l3_hits += s.get("l3_hits", 0)
    summary.l3_rejected += s.get("l3_rejected", 0)
    summary.deferred += s["deferred"]
    summary.evicted += s["pages_evicted"]


def soak(
    seconds: float | None,
    seed: int = 0,
    device: str = "cpu",
    fault_p: float = 0.05,
    max_rounds: int = 10_000,
    l3: Any = None,
) -> Summary:
    """A warm-up round, then rounds until ``seconds`` are spent (None: no time budget) or ``max_rounds`` ran in all
    (at least 2: the resident memory's growth is measured over the rounds after the warm-up).
    ``l3``: a running ``kvtier.tools.mooncake.LocalMooncake`` to put the L3 tier (with injected Store faults and one
    master restart) under the same test."""
    if max_rounds < 2:
        raise ValueError(f"max_rounds must be >= 2 (a warm-up round and one to measure), got {max_rounds}")
    rng = random.Random(seed)
    summary = Summary()
    t0 = time.perf_counter()
    one_round(rng, device, fault_p, summary, l3)  # warm-up: torch and the allocator reach their working size
    rss0 = rss_mib()
    while (seconds is None or time.perf_counter() - t0 < seconds) and summary.rounds < max_rounds:
        one_round(rng, device, fault_p, summary, l3)
    summary.rss_growth_mib = rss_mib() - rss0
    summary.seconds = time.perf_counter() - t0
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    from kvtier.tools.cli import L3_EXTRA, at_least, between, cache_settings, engine_config, parser, positive

    ap = parser("kvtier soak", __doc__)
    ap.add_argument("--seconds", type=positive(), default=30.0, help="time budget (rounds run until it is spent)")
    ap.add_argument("--seed", type=at_least(0), default=0, help="seed of the randomized rounds")
    ap.add_argument(
        "--rounds",
        type=at_least(2),
        default=10_000,
        help="at most this many rounds, the first a warm-up (memory growth: after it)",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--fault-rate", type=between(0, 1, float), default=0.05, help="chance that an injected call fails")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--verbose", action="store_true", help="log every handled (injected) error")
    ap.add_argument("--l3", action="store_true", help="also run the L3 tier on a local Mooncake Store")
    a = ap.parse_args(argv)
    # Before the first round: the device, and the settings the environment gives every round's cache.
    cfg = engine_config(ap, "tiny", device=a.device)
    l3: dict[str, Any] = {"l3": "mooncake", "l3_master": "127.0.0.1:1"} if a.l3 else {}  # master: a placeholder
    cache_settings(ap, page_bytes=cfg.page_bytes, host_bytes=24 * cfg.page_bytes, max_errors=1 << 30, **l3)
    if a.l3:
        from kvtier.l3.store import import_mooncake

        try:
            import_mooncake()
        except ImportError as e:
            ap.error(f"--l3 needs Mooncake, which is not importable ({e}): {L3_EXTRA}")
    logger = logging.getLogger("kvtier")
    level = logger.level
    if not a.verbose:
        logger.setLevel(logging.ERROR)  # the injected failures are expected: only the others are logged
    try:
        if a.l3:
            from kvtier.tools.mooncake import LocalMooncake

            with LocalMooncake(segment_bytes=512 << 20) as server:
                s = soak(a.seconds, a.seed, a.device, a.fault_rate, a.rounds, l3=server)
        else:
            s = soak(a.seconds, a.seed, a.device, a.fault_rate, a.rounds)
    finally:
        logger.setLevel(level)  # a caller in the same process keeps its logging
    print(json.dumps(s.to_json()) if a.json else s.line())
    return 0 if s.passed else 1


if __name__ == "__main__":
    sys.exit(main())
