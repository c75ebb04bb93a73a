"""`kvtier bench pin`: pin a large host pool while the engine serves, and time every cache call on the loop.

The reference engine runs multi-turn conversations with a cache whose host pool (default 64 GiB) is pinned lazily,
pin step by pin step, on a background thread. Every call the engine makes into the cache (try_resume, on_prefill_step,
poll) is timed; the target is that none takes over 5 ms while the pool is being pinned. Also reported: the pinning
rate (GiB/s) and the calls' times after pinning finished, in the same run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def timed(fn: Callable[..., Any], sink: list[tuple[float, float, str]], name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            sink.append((t0, t1 - t0, name))

    return call


def _figures(
    a: Any,
    calls: list[tuple[float, float, str]],
    t_start: float,
    t_pinned: float | None,
    s: dict[str, Any],
    pinning: Any,
) -> dict[str, Any]:
    """What the run measured: the engine's calls while the pool was being pinned and after."""
    # The first store starts the pinning.
    first_store = min((t for t, _, name in calls if name == "on_prefill_step"), default=t_start)
    during = [d for t, d, _ in calls if t_pinned is None or t < t_pinned]
    after = [d for t, d, _ in calls if t_pinned is not None and t >= t_pinned]
    slowest = {
        name: max((d for _, d, n in calls if n == name), default=0.0) * 1e3
        for name in ("try_resume", "on_prefill_step", "poll")
    }
    pin_s = (t_pinned - first_store) if t_pinned else float("nan")
    return {
        "host_gib": a.host_gib,
        "pin_step_mib": a.pin_step_mib,
        "pinning": pinning,
        "pinned": t_pinned is not None,
        "pin_seconds": pin_s,
        "pin_gib_per_s": s["host_bytes_pinned"] / (1 << 30) / pin_s if t_pinned else None,
        "calls_while_pinning": len(during),
        "max_call_ms_while_pinning": max(during, default=0) * 1e3,
        "p99_call_ms_while_pinning": float(np.percentile(during, 99)) * 1e3 if during else 0.0,
        "calls_after": len(after),
        "max_call_ms_after": max(after, default=0) * 1e3,
        "p99_call_ms_after": float(np.percentile(after, 99)) * 1e3 if after else 0.0,
        "max_ms_by_call": slowest,
        "hits": s["hits"],
        "token_hit_rate": s["token_hit_rate"],
        "device": a.device,
    }


# Whole: the engine loop it times and the wrappers that time each engine call share the run's state.
def main(argv: Sequence[str] | None = None) -> int:
    from kvtier.tools.cli import at_least, cache_settings, engine_config, parser, positive

    ap = parser("kvtier bench pin", __doc__)
    ap.add_argument("--host-gib", type=positive(), default=64, help="host pool to pin, in GiB")
    ap.add_argument("--pin-step-mib", type=at_least(1), default=256, help="pin step, in MiB")
    ap.add_argument("--device", default="cuda", help="the CUDA device (a CPU pool's host pool is not pinned)")
    ap.add_argument("--model", default="small", help="model size preset of the reference engine")
    ap.add_argument("--after-seconds", type=at_least(0, float), default=5.0, help="serve this long after pinning")
    ap.add_argument("--max-seconds", type=positive(), default=120.0, help="give up after this long")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    import torch

    if not a.device.startswith("cuda"):
        ap.error(
            f"--device {a.device}: only a CUDA pool's host pool is pinned (a CPU pool's is usable at once, its "
            "memory committed as it is first written): there is no pinning to time"
        )
    if not torch.cuda.is_available():
        ap.error(f"--device {a.device}: no CUDA device is visible")
    cfg = engine_config(ap, a.model, device=a.device, num_gpu_blocks=512, max_batch=8)
    host_bytes = int(a.host_gib * (1 << 30))
    state_slots = 4096 if cfg.num_sliding_layers else 0
    cache_settings(
        ap,
        page_bytes=cfg.page_bytes,
        state_bytes=cfg.state_bytes,
        host_bytes=host_bytes,
        state_slots=state_slots,
        pin_step_bytes=a.pin_step_mib << 20,
    )

    from kvtier.deepinfer import Cache
    from kvtier.tools.engine import Engine
    from kvtier.tools.workload import Conversations

    engine = Engine(cfg)
    cache = Cache(engine, size_bytes=host_bytes, num_state_slots=state_slots, pin_step_bytes=a.pin_step_mib << 20)
    calls: list[tuple[float, float, str]] = []
    inner = cache.cache
    pinned_at: list[float] = []
    poll = timed(cache.poll, calls, "poll")

    def poll_and_watch() -> None:
        # Asked on the engine loop's thread, the one that starts the pinning (at the first store): from another
        # thread, the pinning thread could be found created but not yet started. One engine step of resolution.
        poll()
        if not pinned_at and inner.wait_pinned(0):
            pinned_at.append(time.perf_counter())

    cache.try_resume = timed(cache.try_resume, calls, "try_resume")  # type: ignore[method-assign]
    cache.on_prefill_step = timed(cache.on_prefill_step, calls, "on_prefill_step")  # type: ignore[method-assign]
    cache.poll = poll_and_watch  # type: ignore[method-assign]
    engine.cache = cache
    t_start = time.perf_counter()
    seed = 0
    while time.perf_counter() - t_start < a.max_seconds:
        work = Conversations(
            conversations=8, turns=2, system_tokens=512, user_tokens=64, answer_tokens=8, seed=seed, prefix=f"s{seed}-"
        )
        work.run(engine)
        seed += 1
        if pinned_at and time.perf_counter() - pinned_at[0] > a.after_seconds:
            break
    t_pinned = pinned_at[0] if pinned_at else None
    s = cache.stats_dict()
    cache.close()
    out = _figures(a, calls, t_start, t_pinned, s, inner.host_pools[0].pinning)
    if a.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:<28} {v:.3f}" if isinstance(v, float) else f"{k:<28} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
