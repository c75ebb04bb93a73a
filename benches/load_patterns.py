"""The rate of one 512 MiB load (256 pages of 2 MiB, host -> GPU) by the pattern of its GPU blocks.

Under vLLM the copy engine's loads ran slower the more copies a load made (docs/VLLM.md, "Runs H and I"). This
measures the same loads outside any engine: GPU block ids in one run, descending, scattered, in a few long runs or in
pairs, from host slots in order or scattered; by the copy engine (pieces merged where blocks and slots are both
consecutive, or one 2 MiB piece a page), by the kernel, and by torch's own copies (one a segment) as a reference; alone,
then beside engine-like work on another stream (bf16 GEMMs and small host -> GPU copies). Each figure is the median
of five timed loads (the rate by timing events on the copy's stream, the submit's time on the host), each waited for
before the next; then every pattern's load is submitted back to back on one stream, as an engine's worker submits a
turn's loads, each timed by its own events. ``--gpu-gib`` sizes the GPU block pool (a vLLM engine's is most of the
GPU); ``--host-gib``, ``--pin-step-mib`` and ``--pin-method`` make the host pool: its size, the steps it is pinned in
and how (a vLLM worker's pool is vLLM's offloading size, pinned in 256 MiB steps by default); ``--allocations``
makes that many small pinned host and GPU tensors first, as an engine's process holds. ``--kv-tensors N`` splits each
2 MiB block into N segments, one in each of N tensors that are views of one allocation, evenly spaced (vLLM 0.25.1's
8B-shaped pool is 32 tensors of 64 KiB a block: a block the copy engine moves alone is N copies, or one 2D copy of N
rows; ``--gpu-gib`` sets their spacing). ``--replay`` copies again the
turn-2 loads that ``kvtier bench serve --json J --job-ids`` recorded under vLLM (the same GPU blocks and host slots,
submitted back to back turn by turn, by the copy engine and by the kernel) beside the rates vLLM's run measured;
``--streams N`` makes those loads take turns on N streams, each waiting for the load before (vLLM's native worker
gives each transfer a stream of its own). Needs a GPU:

    python benches/load_patterns.py [--gpu-gib 8] [--host-gib 2] [--pin-step-mib 256] [--pin-method auto]
        [--allocations 0] [--kv-tensors 1] [--replay SERVE_JSON] [--streams 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np
import torch

from kvtier._core import HostPool
from kvtier.copy import PageCopier, host_array

PAGE = 2 << 20
PAGES = 256


def gpu_patterns(rng: np.random.Generator, gpu_blocks: int) -> dict[str, np.ndarray]:
    def in_pairs(pairs: int) -> np.ndarray:
        singles = np.sort(rng.choice(np.arange(0, gpu_blocks - 2, 3), PAGES - pairs, replace=False))
        seconds = singles[rng.choice(len(singles), pairs, replace=False)] + 1
        return np.sort(np.concatenate([singles, seconds]))[:PAGES]

    patterns = {
        "one run": np.arange(100, 100 + PAGES),
        "descending": np.arange(99 + PAGES, 99, -1),
        "scattered, sorted": np.sort(rng.choice(gpu_blocks, PAGES, replace=False)),
        "scattered, unsorted": rng.choice(gpu_blocks, PAGES, replace=False),
        "scattered, 14 pairs": in_pairs(14),
        "4 runs": np.concatenate([np.arange(s, s + 64) for s in (3000, 200, 1500, 800)]),
        "20 runs": np.concatenate([np.arange(s, s + 13) for s in range(0, 20 * 40, 40)])[:PAGES],
    }
    return {name: ids.astype(np.int32) for name, ids in patterns.items()}


def runs_of(ids: np.ndarray) -> int:
    """How many runs of consecutive ids (ascending) ``ids`` comes in."""
    return 1 + int(np.count_nonzero(np.diff(ids) != 1))


def recorded_turns(path: str) -> list[tuple[str, list[tuple[np.ndarray, np.ndarray, float]]]]:
    """The timed turn-2 loads of each offloading configuration (native's too) in a ``kvtier bench serve --json
    --job-ids`` file, turn by turn, in the order they were submitted: (GPU block ids, host slots, the rate vLLM's run
    measured in GB/s, NaN where the worker did not time it). A load's host slots are its vLLM chunks' slots
    (``blocks_per_chunk`` a chunk, from the load's first)."""
    with open(path) as f:
        report = json.load(f)
    turns = []
    for run in report.get("prefix_runs", []):
        for length in run["prefix"]:
            for jobs in length["turn2"]["runs_jobs"]:
                loads = []
                for j in sorted(
                    (j for j in jobs if j["kind"] == "load" and j.get("gpu_ids") and j.get("host_ids")),
                    key=lambda j: j["submit_ms"],
                ):
                    gpu_ids, chunks = np.asarray(j["gpu_ids"], np.int32), np.asarray(j["host_ids"], np.int64)
                    per_chunk = -(-len(gpu_ids) // len(chunks))
                    slots = (chunks[:, None] * per_chunk + np.arange(per_chunk)).ravel()[: len(gpu_ids)]
                    rate = j["bytes"] / j["copy_ms"] / 1e6 if j["copy_ms"] else float("nan")
                    loads.append((gpu_ids, slots.astype(np.int32), rate))
                if loads:
                    turns.append((run["config"], loads))
    if not turns:
        raise SystemExit(f"{path}: no turn-2 loads with their ids (run kvtier bench serve with --json and --job-ids)")
    return turns


def engine_work(stop: threading.Event) -> None:
    """GEMMs and small pinned host -> GPU copies on a stream of their own until ``stop``."""
    stream = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    small = torch.zeros(64 << 10, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(small, device="cuda")
    with torch.cuda.stream(stream):
        while not stop.is_set():
            for _ in range(8):
                dst.copy_(small, non_blocking=True)
                a = (a @ a).clamp_(-1, 1)
            stream.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-gib", type=float, default=8.0, help="the GPU block pool's size")
    parser.add_argument("--host-gib", type=float, default=2.0, help="the host pool's size")
    parser.add_argument("--pin-step-mib", type=int, default=256, help="the host pool's pin step")
    parser.add_argument("--pin-method", choices=("auto", "driver", "register"), default="auto")
    parser.add_argument(
        "--allocations",
        type=int,
        default=0,
        help="this many small pinned host tensors and GPU tensors made first, as an engine's process holds",
    )
    parser.add_argument(
        "--kv-tensors", type=int, default=1, help="the GPU pool's tensors, each holding an equal segment of every block"
    )
    parser.add_argument(
        "--replay",
        metavar="SERVE_JSON",
        help="copy again, here, the turn-2 loads a `kvtier bench serve --json --job-ids` run recorded under vLLM",
    )
    parser.add_argument(
        "--streams",
        type=int,
        default=1,
        help="the replay's loads take turns on this many streams, each after the load before (vLLM's native worker"
        " gives each transfer a stream of its own)",
    )
    parser.add_argument("--json", metavar="FILE", help="write every row here as well")
    args = parser.parse_args()
    if args.streams < 1:
        raise SystemExit(f"--streams {args.streams}: needs at least one")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    turns = recorded_turns(args.replay) if args.replay else []
    rng = np.random.default_rng(0)
    gpu_blocks = int(args.gpu_gib * (1 << 30)) // PAGE
    for _, loads in turns:
        gpu_blocks = max([gpu_blocks, *(int(g.max()) + 1 for g, _, _ in loads)])
    if gpu_blocks < 4000:
        raise SystemExit(f"--gpu-gib {args.gpu_gib} holds {gpu_blocks} blocks of 2 MiB; the patterns reach block 3999")
    tensors = args.kv_tensors
    if tensors < 1 or PAGE % (tensors * 16):
        raise SystemExit(f"--kv-tensors {tensors}: a 2 MiB block does not split into that many 16-byte multiples")
    gpu = torch.empty((tensors, gpu_blocks, PAGE // tensors), dtype=torch.uint8, device="cuda")
    pool = [gpu[t] for t in range(tensors)]
    # Sizes that vary, so neither torch's caching allocators nor the driver hand back one block for all of them.
    _held = [
        (
            torch.empty(4096 + 512 * i, dtype=torch.uint8).pin_memory(),
            torch.empty(1 << (20 + i % 4), dtype=torch.uint8, device="cuda"),
        )
        for i in range(args.allocations)
    ]
    host_slots = int(args.host_gib * (1 << 30)) // PAGE
    for _, loads in turns:
        host_slots = max([host_slots, *(int(h.max()) + 1 for _, h, _ in loads)])
    if host_slots < PAGES:
        raise SystemExit(f"--host-gib {args.host_gib} holds {host_slots} pages of 2 MiB; a load takes {PAGES}")
    host = HostPool(host_slots, PAGE, step_bytes=args.pin_step_mib << 20, pin=True, pin_method=args.pin_method)
    host.grow_to(host_slots)
    host_pages = torch.from_numpy(host_array(host))
    slot_patterns = {
        "in order": np.arange(PAGES, dtype=np.int32),
        "scattered": rng.choice(host_slots, PAGES, replace=False).astype(np.int32),
    }
    methods = {
        "copy engine": PageCopier(pool, host, method="dma"),
        "copy engine, 2 MiB pieces": PageCopier(pool, host, method="dma", piece_bytes=PAGE),
        "kernel": PageCopier(pool, host, method="kernel"),
        "torch, a copy a segment": None,
    }
    streams = [torch.cuda.Stream() for _ in range(args.streams)]
    stream = streams[0]
    rows = []

    def load(
        copier: PageCopier | None, ids: np.ndarray, slots: np.ndarray, stream: torch.cuda.Stream = stream
    ) -> tuple[torch.cuda.Event, torch.cuda.Event, float]:
        """Submits one load on ``stream`` between timing events; returns them and the submit's host seconds."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        t0 = time.perf_counter()
        if copier is None:
            with torch.cuda.stream(stream):
                for g, h in zip(ids.tolist(), slots.tolist(), strict=True):
                    for t, segment in enumerate(host_pages[h].view(tensors, -1)):
                        gpu[t, g].copy_(segment, non_blocking=True)
        else:
            copier.to_gpu(slots, ids, stream=stream)
        submit = time.perf_counter() - t0
        end.record(stream)
        return start, end, submit

    def record(beside: str, pattern: str, ids: np.ndarray, slots: str, method: str, timed: list[tuple]) -> None:
        """One row: the median rate (GB/s, by the events) and submit time (ms, on the host) of the timed loads."""
        runs = runs_of(ids)
        gbs = round(statistics.median(PAGES * PAGE / s.elapsed_time(e) / 1e6 for s, e, _ in timed), 1)
        submit_ms = round(statistics.median(t * 1e3 for _, _, t in timed), 2)
        rows.append(
            {
                "beside": beside,
                "gpu_blocks": pattern,
                "runs": runs,
                "host_slots": slots,
                "method": method,
                "gbs": gbs,
                "submit_ms": submit_ms,
            }
        )
        print(
            f"{beside:11} {pattern:19} {runs:3} runs, slots {slots:9} {method:25} {gbs:5.1f} GB/s {submit_ms:6.2f} ms"
        )

    def measure(beside: str) -> None:
        for pattern, ids in gpu_patterns(np.random.default_rng(1), gpu_blocks).items():
            for slots_name, slots in slot_patterns.items():
                for method, copier in methods.items():
                    timed = []
                    for _ in range(6):
                        timed.append(load(copier, ids, slots))
                        timed[-1][1].synchronize()
                    record(beside, pattern, ids, slots_name, method, timed[1:])

    def measure_queued() -> None:
        patterns = gpu_patterns(np.random.default_rng(1), gpu_blocks)
        for slots_name, slots in slot_patterns.items():
            for method, copier in methods.items():
                if copier is None:
                    continue
                timed: dict[str, list[tuple]] = {name: [] for name in patterns}
                for _ in range(4):
                    for name, ids in patterns.items():
                        timed[name].append(load(copier, ids, slots))
                    stream.synchronize()
                for name, ids in patterns.items():
                    record("queued", name, ids, slots_name, method, timed[name][1:])

    def replay() -> None:
        """Each recorded turn's loads submitted back to back, as the worker submitted them, by each copy method."""
        for t, (config, loads) in enumerate(turns):
            for method in ("copy engine", "kernel"):
                timed = []
                for i, (g, h, _) in enumerate(loads):
                    on = streams[i % len(streams)]
                    if timed:
                        on.wait_event(timed[-1][1])
                    timed.append(load(methods[method], g, h, on))
                torch.cuda.synchronize()
                for (g, _, under_vllm), (start, end, submit) in zip(loads, timed, strict=True):
                    runs = runs_of(g)
                    gbs = len(g) * PAGE / start.elapsed_time(end) / 1e6
                    rows.append(
                        {
                            "config": config,
                            "turn": t,
                            "method": method,
                            "runs": runs,
                            "under_vllm_gbs": round(under_vllm, 1),
                            "gbs": round(gbs, 1),
                            "submit_ms": round(submit * 1e3, 2),
                        }
                    )
                    print(
                        f"turn {t:2} {method:12} {runs:4} runs: {gbs:5.1f} GB/s here (submit {submit * 1e3:6.2f} ms), "
                        f"{under_vllm:5.1f} under vLLM"
                    )

    if turns:
        replay()
    else:
        measure("alone")
        measure_queued()
        stop = threading.Event()
        worker = threading.Thread(target=engine_work, args=(stop,))
        worker.start()
        try:
            measure("engine work")
        finally:
            stop.set()
            worker.join()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
