"""`kvtier bench serve`: real vLLM serving a model on a GPU, with no offloading, vLLM's own CPU offloading and kvtier.

Each configuration runs in a process of its own (one engine on the GPU at a time), on a Llama-shaped model whose
`config.json` this writes (dummy weights: vLLM seeds them, so every configuration computes the same function) and
synthetic token ids (no tokenizer). Greedy decoding: the token ids every configuration produces must be identical
to the first configuration's, and the run fails loudly when they are not. Workloads:

- `prefix`: for each length, N prompts of a distinct prefix plus 32 new tokens, 8 output tokens each. Turn 1 stores
  the prefixes; `reset_prefix_cache()` then empties the GPU's prefix cache, so turn 2 (the same prefixes, 32 other
  new tokens) is served by the offloading tier or recomputed. The no-offloading process also times turn 2 without
  the reset (a GPU prefix-cache hit) and measures pinned host -> device memcpy: the floor of a host hit is the GPU
  hit plus the prefix bytes at memcpy speed. Turn 2 and the GPU hit run `--repeats` times (other new tokens each
  time, the GPU's prefix cache reset before each turn 2); their medians are reported, with the rate of the
  tier's loads in their copies (bytes over the seconds the offloading worker reports for its load jobs, vLLM's
  ``TransferResult``: native's and kvtier's workers both time their copies on the GPU), the time the engine's
  thread spent inside the worker's load submit calls (the engine loop waits that long), the engine's longest step in
  turn 2 (a request decoding beside the turn would wait about that long for a token) and the CPU seconds of the engine
  process's busiest threads in turn 2 (Linux). `--json` keeps each timed turn's transfers as well
  (`runs_jobs`): every load and store job, when it was submitted and seen done, how long its submit call took and
  the thread's CPU time in it, its GPU blocks and their runs of consecutive ids, its bytes and its copies' ms (with
  `--job-ids`, the GPU block ids and the vLLM chunk ids themselves, which `benches/load_patterns.py --replay` copies
  again outside vLLM; a kvtier configuration also copies them again itself, in its process after its timed turns,
  and prints and keeps those rates: `replay`).
- `noreuse`: prompts that share nothing, each once (stores run, nothing is ever hit); requests a second, the median
  of the repeats, and the ms the engine's thread spent in the worker's store submit calls a run. `--noreuse
  TOKENSxPROMPTS` shapes it; it runs after the prefix workload in the same processes unless `--noreuse ''`, and
  alone when `--workloads` names `noreuse` without `prefix`.
- `trace`: a Mooncake-format trace (by default the ten-minute excerpt of Mooncake's conversation trace that
  `kvtier bench trace` replays; the requests in file order, one at a time, one output token: a request's time is
  its time to first token), every hash id its own block of token ids, prompts capped at `--trace-max-tokens`.
- `l3`: kvtier's Mooncake tier under vLLM's tiering spec, with a local master and holder this starts: one process
  runs turn 1 of the prefix workload and exits; a second, new process then runs turn 2, served from the Store.

Needs vLLM (0.25.1 through 0.34; the GPU machine's torch pins 0.25.1), a CUDA GPU and, for `l3`, Mooncake.
`--json` prints every figure; `--plot` draws turn-2 time (prefix) and TTFT (trace) by configuration.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

CONFIGS = ("none", "native", "kvtier-lru", "kvtier-adaptive")
WORKLOADS = ("prefix", "noreuse", "trace", "l3")
# Llama shapes, bf16: an 8B model's (Llama-3.1-8B), a 1B model's (Llama-3.2-1B) and that with half its layers
# (the trace's default: a thousand requests of up to 16K tokens, four configurations, in one 10-minute call).
MODELS = {
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336},
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 8192},
    "1b-8l": {"hidden_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 8192},
}  # fmt: skip
VOCAB = 128256
NEW_TOKENS = 32  # a turn's new tokens after its prefix
OUTPUT_TOKENS = 8
BLOCK = 16  # vLLM's block size (tokens)
CHILD_TIMEOUT_S = 600  # one configuration's process, engine start included


def kv_bytes_per_token(model: str) -> int:
    m = MODELS[model]
    head_dim = m["hidden_size"] // m["num_attention_heads"]
    return m["num_hidden_layers"] * m["num_key_value_heads"] * head_dim * 2 * 2  # K and V, bf16


def write_model(folder: str, model: str, max_len: int) -> str:
    """A Llama model folder with only a config.json (weights are vLLM's dummy ones)."""
    os.makedirs(folder, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **MODELS[model],
        "vocab_size": VOCAB,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def tokens(rng: Any, n: int) -> list[int]:
    return [int(t) for t in rng.integers(1000, VOCAB - 1000, size=n)]


def parse_lengths(text: str, option: str = "--lengths") -> list[tuple[int, int]]:
    """'4096x16,16384x4' -> [(4096, 16), (16384, 4)]: prefix tokens x prompts (ValueError naming ``option``)."""
    out = []
    for part in text.split(","):
        length, _, count = part.strip().partition("x")
        try:
            pair = (int(length), int(count))
        except ValueError:
            raise ValueError(f"{option}: {part!r} is not TOKENSxPROMPTS (e.g. 4096x16)") from None
        if pair[0] < BLOCK or pair[1] < 1:
            raise ValueError(f"{option}: {part!r} needs at least {BLOCK} tokens and one prompt")
        out.append(pair)
    return out


# ---- one configuration, in a process of its own ----------------------------------------------------------------


def split_config(config: str) -> tuple[str, dict[str, str]]:
    """'kvtier-lru:copy_method=kernel:copy_streams=false' -> ('kvtier-lru', {'copy_method': 'kernel', ...}): a
    configuration and the kvtier settings its extra config adds."""
    name, *parts = config.split(":")
    settings = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise ValueError(f"--configs: {part!r} in {config!r} is not SETTING=VALUE")
        settings[key.strip()] = value.strip()
    if settings and not name.startswith("kvtier-"):
        raise ValueError(f"--configs: {config!r}: only kvtier's configurations take kvtier settings")
    return name, settings


def engine_kwargs(config: str, args: dict[str, Any]) -> dict[str, Any]:
    """vLLM's LLM(...) arguments of a configuration."""
    name, settings = split_config(config)
    kw: dict[str, Any] = {
        "model": args["model_dir"],
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": args["max_model_len"],
        "gpu_memory_utilization": args["gpu_memory_utilization"],
        "num_gpu_blocks_override": args["gpu_blocks"],
        "max_num_batched_tokens": args["max_num_batched_tokens"],
        "disable_log_stats": False,
        "enable_prefix_caching": True,
    }
    host = int(args["host_gib"] * 2**30)
    if name == "native":
        kw["kv_offloading_size"] = args["host_gib"]
        kw["kv_offloading_backend"] = "native"
    elif name.startswith("kvtier-"):
        from vllm.config import KVTransferConfig

        extra: dict[str, Any] = {"spec_module_path": "kvtier.vllm", "cpu_bytes_to_use": host, **settings}
        if name == "kvtier-l3":
            extra.update(
                spec_name="KvtierTieringSpec",
                secondary_tiers=[
                    {
                        "type": "KvtierMooncakeTier",
                        "module_path": "kvtier.vllm",
                        "l3_master": args["l3_master"],
                        "model_version": "kvtier-bench-dummy-weights",
                        "l3_trusted_store": True,
                    }
                ],
            )
        else:
            extra.update(spec_name="KvtierSpec", eviction_policy=name.split("-", 1)[1])
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
    elif name != "none":
        raise ValueError(f"unknown configuration {name!r}")
    return kw


def offloading_worker() -> Any | None:
    """vLLM's offloading worker in this process (its offloading spec's ``OffloadingWorker``), or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    return getattr(getattr(get_kv_transfer_group(), "connector_worker", None), "worker", None)


def _ids(spec: Any) -> list[int]:
    """A transfer spec's block ids (none when it has none)."""
    ids = getattr(spec, "block_ids", None)
    return [] if ids is None else [int(b) for b in ids]


def _gpu_blocks(spec: Any) -> tuple[int, int]:
    """The GPU blocks of a transfer's GPU-side spec: how many, and in how many runs of consecutive ids."""
    ids = _ids(spec)
    if not ids:
        return 0, 0
    return len(ids), 1 + sum(b != a + 1 for a, b in itertools.pairwise(ids))


class Transfers:
    """An offloading worker's transfers (vLLM runs its worker in this process): the jobs ``submit_load`` and
    ``submit_store`` started, and the bytes and seconds the worker reported for them (vLLM's ``TransferResult``: what
    its transfer metrics record; native's and kvtier's workers both time their copies on the GPU). ``figures``
    sums the loads; ``timeline`` lists every job completed since the last ``clear``, in the order the worker reported
    them: its direction, when it was submitted and seen done (ms after the ``clear``; a job submitted before it has a
    negative ``submit_ms``), how long the engine's thread was inside the worker's submit call and its CPU time there
    (``submit_call_ms``, ``submit_cpu_ms``), its GPU blocks and their runs of consecutive ids, its bytes and its
    copies' ms; with ``ids``, also the ids themselves (``gpu_ids``, and ``host_ids``: the offloading side's, vLLM
    chunk ids). No worker: nothing is counted."""

    def __init__(self, worker: Any | None, ids: bool = False) -> None:
        # Jobs submitted and not yet seen done: their timeline entry so far, and when they were submitted.
        self.submitted: dict[int, tuple[dict[str, Any], float]] = {}
        self.keep_ids = ids
        self.clear()
        if worker is None:
            return
        submit_load, submit_store, get_finished = worker.submit_load, worker.submit_store, worker.get_finished

        def watched(kind: str, submit: Any, job_id: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            # submit_store(job_id, src_spec, dst_spec) / submit_load(job_id, src_spec, dst_spec): the GPU side is a
            # store's source and a load's destination.
            src = args[0] if args else kwargs.get("src_spec")
            dst = args[1] if len(args) > 1 else kwargs.get("dst_spec")
            gpu, host = (dst, src) if kind == "load" else (src, dst)
            blocks, runs = _gpu_blocks(gpu)
            entry: dict[str, Any] = {"kind": kind, "blocks": blocks, "runs": runs}
            if self.keep_ids:
                entry.update(gpu_ids=_ids(gpu), host_ids=_ids(host))
            at, cpu = time.perf_counter(), time.thread_time()
            self.submitted[job_id] = (entry, at)
            try:
                return submit(job_id, *args, **kwargs)
            finally:
                # The engine's thread is inside the worker's call for this long; the share it spent on its CPU
                # tells work or spinning (near all of it) from waiting (a lock, the GIL: near none).
                entry["submit_call_ms"] = 1e3 * (time.perf_counter() - at)
                entry["submit_cpu_ms"] = 1e3 * (time.thread_time() - cpu)
                calls = self.submit_calls[kind]
                calls[0] += entry["submit_call_ms"]
                calls[1] += entry["submit_cpu_ms"]

        def watched_load(job_id: int, *args: Any, **kwargs: Any) -> Any:
            return watched("load", submit_load, job_id, args, kwargs)

        def watched_store(job_id: int, *args: Any, **kwargs: Any) -> Any:
            return watched("store", submit_store, job_id, args, kwargs)

        def watched_finished() -> Any:
            results = get_finished()
            now = time.perf_counter()
            for r in results:
                job = self.submitted.pop(r.job_id, None)
                if job is None:
                    continue
                entry, at = job
                self.timeline.append(
                    {
                        **entry,
                        "submit_ms": 1e3 * (at - self.t0),
                        "done_ms": 1e3 * (now - self.t0),
                        "bytes": int(r.transfer_size or 0),
                        "copy_ms": None if r.transfer_time is None else 1e3 * float(r.transfer_time),
                    }
                )
            return results

        worker.submit_load = watched_load
        worker.submit_store = watched_store
        worker.get_finished = watched_finished

    def clear(self) -> None:
        self.timeline: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        # The submit calls made since: their ms in all and the thread's CPU ms in them, by direction.
        self.submit_calls = {"load": [0.0, 0.0], "store": [0.0, 0.0]}

    def figures(self) -> dict[str, Any]:
        """Load jobs completed since the last clear, their bytes, the sum of their copies' seconds (None unless
        every job was timed) and bytes over that sum (GB/s); the engine thread's ms inside the load and store submit
        calls made since, and its CPU ms there; and the ``timeline`` of every job."""
        loads = [j for j in self.timeline if j["kind"] == "load"]
        size = sum(j["bytes"] for j in loads)
        timed = bool(loads) and all(j["copy_ms"] is not None for j in loads)
        seconds = sum(j["copy_ms"] for j in loads) / 1e3 if timed else None
        return {
            "load_jobs": len(loads),
            "load_bytes": size,
            "load_s": seconds,
            "load_gbs": size / seconds / 1e9 if seconds else None,
            "load_submit_ms": self.submit_calls["load"][0],
            "load_submit_cpu_ms": self.submit_calls["load"][1],
            "store_submit_ms": self.submit_calls["store"][0],
            "store_submit_cpu_ms": self.submit_calls["store"][1],
            "jobs": list(self.timeline),
        }


def thread_cpu_s() -> dict[int, tuple[str, float]]:
    """Each live thread of this process: its id, its name (Python's for a Python thread, else the OS's: the CUDA
    driver's, torch's, kvtier's Rust threads) and its CPU seconds so far, user and system (Linux's /proc, in clock
    ticks; empty where there is none)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    python = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in map(int, tids):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # it ended in between
        # "tid (name) state ...": utime and stime are the 14th and 15th fields, the 12th and 13th after the name.
        fields = stat[stat.rindex(")") + 2 :].split()
        name = python.get(tid) or stat[stat.index("(") + 1 : stat.rindex(")")]
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def busiest(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each thread spent between two ``thread_cpu_s`` readings, by name (threads of one name summed;
    one started in between counts from zero, one that ended is not seen), the busiest first, idle ones left out."""
    spent: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        used = cpu - before.get(tid, (name, 0.0))[1]
        if used > 0:
            spent[name] = spent.get(name, 0.0) + used
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


class Hits:
    """Runs prompts and counts the prompt tokens each call found cached: in all (vLLM's ``num_cached_tokens`` of
    each request) and from the offloading tier (what the connector's ``get_num_new_matched_tokens`` gave vLLM's
    scheduler, watched in this process); the rest came from vLLM's GPU prefix cache. With an offloading tier, also
    the bytes and seconds of its loads and the timeline of its transfers (``Transfers``)."""

    def __init__(self, llm: Any, job_ids: bool = False) -> None:
        self.llm = llm
        self.external: dict[str, int] = {}
        self.transfers = Transfers(offloading_worker(), ids=job_ids)
        # Each engine step's seconds: a request decoding beside a turn waits the longest of them for a token.
        self.steps: list[float] = []
        core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
        if core is not None and callable(getattr(core, "step_fn", None)):
            core.step_fn = timed_calls(core.step_fn, self.steps)
        connector = getattr(getattr(core, "scheduler", None), "connector", None)
        # The offloading manager (scheduler side), to wait for its work after a turn (drain).
        self.manager = getattr(getattr(connector, "connector_scheduler", None), "manager", None)
        if connector is None:
            return
        matched = connector.get_num_new_matched_tokens

        def watched(request: Any, num_computed_tokens: int) -> Any:
            out = matched(request, num_computed_tokens)
            if out[0]:  # None while the tier defers its lookup; a request matched again counts once
                self.external[request.request_id] = int(out[0])
            return out

        connector.get_num_new_matched_tokens = watched

    def generate(self, prompts: list[list[int]], max_tokens: int, threads: bool = False) -> dict[str, Any]:
        """Seconds, token ids, prompt tokens, cached tokens from the GPU and from the offloading tier; with
        ``threads``, the CPU seconds the process's threads spent meanwhile (``busiest``; read outside the timed
        call, but not free: the trace workload's throughput counts every call's time)."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        self.external.clear()
        self.transfers.clear()
        self.steps.clear()
        before = thread_cpu_s() if threads else {}
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        threads_cpu_s = busiest(before, thread_cpu_s()) if threads else {}
        cached = sum(int(o.num_cached_tokens or 0) for o in outs)
        tier = sum(self.external.values())
        return {
            "s": dt,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "prompt_tokens": sum(map(len, prompts)),
            "gpu_hit_tokens": cached - tier,
            "tier_hit_tokens": tier,
            "threads_cpu_s": threads_cpu_s,
            "longest_step_ms": 1e3 * max(self.steps) if self.steps else None,
            **self.transfers.figures(),
        }


def timed_calls(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    """``fn``, appending each call's wall seconds to ``into`` (a call that raises as well)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    return call


def drain(hits: Hits, limit_s: float = 300.0) -> float:
    """Steps the engine (a one-token request at a time) until the offloading manager has no work left: vLLM's
    tiering spec cascades stores to its secondary tiers at step ends, so an engine that stops stepping leaves them
    undone. Returns the seconds it took."""
    t0 = time.perf_counter()
    manager = hits.manager
    while manager is not None and manager.has_pending_work():
        if time.perf_counter() - t0 > limit_s:
            raise RuntimeError(f"the offloading manager still had work after {limit_s:.0f} s")
        hits.generate([[1000 + BLOCK]], 1)
        time.sleep(0.05)
    return time.perf_counter() - t0


def _memcpy_gbs(nbytes: int = 1 << 30) -> float:
    """Pinned host -> device memcpy rate (GB/s), the median of 7 copies."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(8):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


def repeated(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of one timed turn as one: the median seconds (``s``), each run's seconds and token ids, the fewest
    tokens any run took from the GPU and from the offloading tier, the median rate of the tier's loads and each
    run's rate and timeline of transfers (``Transfers``), and each thread's median CPU seconds in a run."""
    rates = [r["load_gbs"] for r in runs if r.get("load_gbs")]
    names = {name for r in runs for name in r.get("threads_cpu_s", {})}
    threads = {name: statistics.median(r.get("threads_cpu_s", {}).get(name, 0.0) for r in runs) for name in names}
    return {
        "s": statistics.median(r["s"] for r in runs),
        "runs_s": [r["s"] for r in runs],
        "tokens": [r["tokens"] for r in runs],
        "prompt_tokens": runs[0]["prompt_tokens"],
        "gpu_hit_tokens": min(r["gpu_hit_tokens"] for r in runs),
        "tier_hit_tokens": min(r["tier_hit_tokens"] for r in runs),
        "load_gbs": statistics.median(rates) if len(rates) == len(runs) else None,
        "runs_load_gbs": [r.get("load_gbs") for r in runs],
        "runs_load_submit_ms": [r.get("load_submit_ms") for r in runs],
        "runs_load_submit_cpu_ms": [r.get("load_submit_cpu_ms") for r in runs],
        "runs_longest_step_ms": [r.get("longest_step_ms") for r in runs],
        "runs_jobs": [r.get("jobs", []) for r in runs],
        "threads_cpu_s": dict(sorted(((n, c) for n, c in threads.items() if c > 0), key=lambda kv: -kv[1])),
    }


def run_prefix(hits: Hits, config: str, args: dict[str, Any], turns: str = "12") -> list[dict[str, Any]]:
    """The prefix workload's rows (see the module's text); ``turns`` '1' or '2' runs one turn once (the l3
    workload, whose turn 2 must be the new instance's first)."""
    import numpy as np

    llm = hits.llm
    repeats = args["repeats"] if turns == "12" else 1
    rows = []
    for length, count in parse_lengths(args["lengths"]):
        rng = np.random.default_rng([length, count, 1])
        prefixes = [tokens(rng, length) for _ in range(count)]
        suffixes = [[tokens(rng, NEW_TOKENS) for _ in range(count)] for _ in range(1 + 2 * repeats)]
        turn = [[p + s for p, s in zip(prefixes, suffix, strict=True)] for suffix in suffixes]
        row: dict[str, Any] = {"length": length, "prompts": count, "prefix_bytes": length * count * args["kv_bytes"]}
        if "1" in turns:
            row["turn1"] = hits.generate(turn[0], OUTPUT_TOKENS)
            if config == "none":
                # A GPU prefix-cache hit: turn 2 right after turn 1.
                row["gpu_hit"] = repeated([hits.generate(turn[1 + r], OUTPUT_TOKENS) for r in range(repeats)])
            if turns == "1":
                row["drain_s"] = drain(hits)
        if "2" in turns:
            runs = []
            for r in range(repeats):
                if "1" in turns:
                    if not llm.reset_prefix_cache():
                        raise RuntimeError("vLLM refused to reset its prefix cache")
                    time.sleep(args["think_s"])
                runs.append(hits.generate(turn[1 + repeats + r], OUTPUT_TOKENS, threads=True))
            row["turn2"] = repeated(runs)
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")
        rows.append(row)
    return rows


def run_noreuse(hits: Hits, args: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    ((length, count),) = parse_lengths(args["noreuse"], "--noreuse")
    runs = []
    for r in range(args["repeats"]):
        rng = np.random.default_rng([length, count, 2, r])
        runs.append(hits.generate([tokens(rng, length) for _ in range(count)], OUTPUT_TOKENS))
    times = [run["s"] for run in runs]
    return {
        "length": length,
        "prompts": count,
        "times_s": times,
        "requests_per_s": count / statistics.median(times),
        "store_submit_ms": statistics.median(run["store_submit_ms"] for run in runs),
        "store_submit_cpu_ms": statistics.median(run["store_submit_cpu_ms"] for run in runs),
        "tokens": [run["tokens"] for run in runs],
    }


def trace_prompts(path: str, requests: int, max_tokens: int) -> list[list[int]]:
    """The first ``requests`` requests of a Mooncake-format trace as token ids: hash id h is the 512 tokens
    ``(h * 512 + j) % range + 1000``; prompts are cut at ``max_tokens``."""
    from kvtier.tools.bench.trace import read_trace

    out = []
    span = VOCAB - 2000
    for r in read_trace(path)[:requests]:
        n = min(r.tokens, max_tokens)
        ids: list[int] = []
        for h in r.hash_ids:
            ids.extend((h * 512 + j) % span + 1000 for j in range(512))
            if len(ids) >= n:
                break
        out.append(ids[:n])
    return out


def run_trace(hits: Hits, args: dict[str, Any]) -> dict[str, Any]:
    prompts = trace_prompts(args["trace"], args["trace_requests"], args["trace_max_tokens"])
    t0 = time.perf_counter()
    runs = [hits.generate([p], 1) for p in prompts]
    total = time.perf_counter() - t0
    times = sorted(run["s"] for run in runs)
    return {
        "requests": len(prompts),
        "prompt_tokens": sum(run["prompt_tokens"] for run in runs),
        "gpu_hit_tokens": sum(run["gpu_hit_tokens"] for run in runs),
        "tier_hit_tokens": sum(run["tier_hit_tokens"] for run in runs),
        "ttft_p50_s": statistics.median(times),
        "ttft_p99_s": times[min(len(times) - 1, int(0.99 * len(times)))],
        "requests_per_s": len(prompts) / total,
        "tokens": [run["tokens"][0] for run in runs],
    }


def replay_loads(copier: Any, prefix: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timed turn-2 loads that ``--job-ids`` recorded (``prefix``: ``run_prefix``'s figures), copied again by a
    kvtier worker's own page copiers (``copier``: its ``ChunkCopier``) in this process, between turns: each turn's
    loads back to back on a stream of their own, as the worker submitted them. Each load's GPU blocks, their runs, its
    rate here (GB/s; timing events on CUDA, the host's clock otherwise) and the rate its copies had under vLLM, the
    host's ms in the calls that submitted it here and in the worker's submit call under vLLM (``submit_ms``,
    ``under_vllm_submit_ms``: None when not recorded). A load's host slots are its vLLM chunks' slots from the
    chunk's first block (a prefix load starts there).

    With one page copier (vLLM's KV caches in tensors of one shape), each load is copied a second time into a
    scratch tensor of this process's own whose blocks hold the copier's layers back to back (the layout vLLM gives
    the offloading worker when it lays the KV cache out across layers), its blocks placed so that it keeps its runs
    (``scratch_gbs``): vLLM's KV tensors or this process, whichever sets the rate; and a third time into vLLM's blocks
    as two calls of alternate pages (``alternate_gbs``): one copy a page, no two adjacent in a call, as native's loads
    come when its host blocks do not follow the GPU blocks."""
    import numpy as np
    import torch

    from kvtier.copy import PageCopier

    cuda = copier.device.type == "cuda"
    stream = torch.cuda.Stream(copier.device) if cuda else None
    if cuda:
        torch.cuda.synchronize(copier.device)  # no store may still be reading a block the replay writes
    scratch = None
    if len(copier.copiers) == 1:
        c = copier.copiers[0]
        longest = max((j["blocks"] for p in prefix for run in p["turn2"]["runs_jobs"] for j in run), default=1)
        blocks = torch.empty((2 * longest, c.page_bytes), dtype=torch.uint8, device=copier.device)
        layer = c.page_bytes // c.num_layers
        layers = [blocks[:, i * layer : (i + 1) * layer] for i in range(c.num_layers)]
        scratch = PageCopier(layers, c.host, method=c.method, crossover_bytes=c.crossover_bytes,
                             piece_bytes=c.piece_bytes)  # fmt: skip

    def timed(copies: list[tuple[Any, Any, Any, Any]]) -> tuple[Callable[[], float], float]:
        """Submits ``copies`` (page copier, host slots, GPU ids, layers) between two events: their milliseconds, once
        waited for (on the CPU, where copies are made as they are submitted, the host's time), and the host's
        milliseconds in the submitting calls."""
        t0 = time.perf_counter()
        if not cuda:
            for c, slots, ids, layers in copies:
                c.to_gpu(slots, ids, layers=layers)
            host_ms = 1e3 * (time.perf_counter() - t0)
            return (lambda: host_ms), host_ms
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for c, slots, ids, layers in copies:
            c.to_gpu(slots, ids, stream=stream, layers=layers)
        submit_ms = 1e3 * (time.perf_counter() - t0)
        end.record(stream)
        return (lambda: start.elapsed_time(end)), submit_ms

    rows = []
    for length in prefix:
        for turn, jobs in enumerate(length["turn2"]["runs_jobs"]):
            loads = sorted((j for j in jobs if j["kind"] == "load" and j.get("host_ids")), key=lambda j: j["submit_ms"])
            timed_loads = []
            for j in loads:
                (group, gpu_ids, slots), *_ = copier.pairs(j["gpu_ids"], [len(j["gpu_ids"])], [0], j["host_ids"])
                runs = [(copier.copiers[r.copier], r.layers) for r in copier.group_runs[group]]
                elapsed, submit_ms = timed([(c, slots, gpu_ids, layers) for c, layers in runs])
                ms = {"gbs": elapsed}
                if scratch is not None:  # the same runs of blocks, one block apart between runs
                    ids = np.concatenate([[0], np.cumsum(np.where(np.diff(gpu_ids) == 1, 1, 2))]).astype(np.int32)
                    ms["scratch_gbs"] = timed([(scratch, slots, ids, None)])[0]
                    halves = [(np.ascontiguousarray(slots[k::2]), np.ascontiguousarray(gpu_ids[k::2])) for k in (0, 1)]
                    ms["alternate_gbs"] = timed([(c, h, g, None) for h, g in halves for c, _ in runs])[0]
                timed_loads.append((j, ms, submit_ms))
            if stream is not None:
                stream.synchronize()
            for j, ms, submit_ms in timed_loads:
                rows.append({"turn": turn, "blocks": j["blocks"], "runs": j["runs"],
                             "under_vllm_gbs": j["bytes"] / j["copy_ms"] / 1e6 if j["copy_ms"] else None,
                             "submit_ms": submit_ms, "under_vllm_submit_ms": j.get("submit_call_ms"),
                             **{key: j["bytes"] / elapsed() / 1e6 for key, elapsed in ms.items()}})  # fmt: skip
    return rows


def child(config: str, workload: str, args: dict[str, Any]) -> dict[str, Any]:
    """One configuration's figures (this process holds one engine)."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # One seed of vLLM's block hashes in every process, so a second instance finds what the first stored in the Store.
    os.environ.setdefault("PYTHONHASHSEED", "0")
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(config, args))
    out: dict[str, Any] = {"config": config, "workload": workload, "init_s": time.perf_counter() - t0}
    hits = Hits(llm, job_ids=bool(args.get("job_ids")))
    hits.generate([list(range(1000, 1000 + 4 * BLOCK))], 2)  # warm-up
    llm.reset_prefix_cache()
    if workload == "prefix":
        if args["lengths"]:
            out["prefix"] = run_prefix(hits, config, args)
            copier = getattr(offloading_worker(), "copier", None)
            if args.get("job_ids") and copier is not None and len(getattr(copier, "group_runs", ())) == 1:
                out["replay"] = replay_loads(copier, out["prefix"])
                llm.reset_prefix_cache()  # the replay wrote into GPU blocks vLLM may hold cached
            if config == "none":
                out["memcpy_h2d_gbs"] = _memcpy_gbs()
        if args.get("noreuse"):
            out["noreuse"] = run_noreuse(hits, args)
    elif workload == "trace":
        out["trace"] = run_trace(hits, args)
    elif workload == "l3":
        out["prefix"] = run_prefix(hits, config, args, turns=args["turns"])
    return out


# ---- the parent: one process a configuration, then the checks and the table ------------------------------------


def engine_log_config() -> dict[str, Any]:
    """A logging config (``logging.config.dictConfig``) for vLLM's ``VLLM_LOGGING_CONFIG_PATH``: vLLM's log and
    kvtier's (the worker's start, the Mooncake tier's failures), INFO and up, on stdout: the engine log."""
    handler = {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stdout", "level": "INFO"}
    logger = {"handlers": ["engine"], "level": "INFO", "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s:%(lineno)d] %(message)s"}},
        "handlers": {"engine": handler},
        "loggers": {"vllm": logger, "kvtier": dict(logger)},
    }


def _spawn(config: str, workload: str, args: dict[str, Any], log: str | None) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w+", suffix=".json", delete=False) as f:
        result_path = f.name
    payload = json.dumps({"config": config, "workload": workload, "args": args, "out": result_path})
    cmd = [sys.executable, "-m", "kvtier.tools.bench.serve", "--child", payload]
    env = dict(os.environ)
    log_config = None
    if log and "VLLM_LOGGING_CONFIG_PATH" not in env:
        # vLLM's engine processes read it at start: kvtier's own log lines reach the engine log beside vLLM's.
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as cf:
            json.dump(engine_log_config(), cf)
        log_config = env["VLLM_LOGGING_CONFIG_PATH"] = cf.name
    see = f"; see {log}" if log else "; --log FILE keeps the engine's output"
    with open(log or os.devnull, "a") as logf:
        logf.write(f"==== {config} {workload}\n")
        logf.flush()
        try:
            rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, timeout=CHILD_TIMEOUT_S, env=env).returncode
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"configuration {config} ({workload}) ran past {CHILD_TIMEOUT_S} s{see}") from None
        finally:
            if log_config:
                os.unlink(log_config)
    try:
        if rc != 0:
            raise RuntimeError(f"configuration {config} ({workload}) failed with exit status {rc}{see}")
        with open(result_path) as f:
            result = dict(json.load(f))
    finally:
        os.unlink(result_path)
    if log:
        # Each configuration's figures as it ends, so a run stopped part way keeps what it measured.
        with open(log, "a") as logf:
            logf.write(f"==== result {json.dumps(result)}\n")
    return result


def check_identical(results: list[dict[str, Any]], pick: Any) -> None:
    """Every configuration's greedy token ids equal the first's; AssertionError naming the first that differs."""
    ref = results[0]
    for r in results[1:]:
        if pick(r) != pick(ref):
            raise AssertionError(
                f"greedy outputs differ: {r['config']} ({r['workload']}) against {ref['config']}: the offloaded KV "
                "is not the KV the model computed"
            )


def _tokens_of_prefix(r: dict[str, Any]) -> Any:
    return [(row["turn1"]["tokens"], row["turn2"]["tokens"]) for row in r["prefix"]]


def summarize_prefix(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per length: turn-2 seconds by configuration, the GPU-hit time, the memcpy floor and the ratios."""
    base = next(r for r in results if r["config"] == "none")
    rows = []
    for i, b in enumerate(base["prefix"]):
        floor = b["gpu_hit"]["s"] + b["prefix_bytes"] / (base["memcpy_h2d_gbs"] * 1e9)
        row: dict[str, Any] = {
            "length": b["length"],
            "prompts": b["prompts"],
            "prefix_gib": b["prefix_bytes"] / 2**30,
            "recompute_s": b["turn2"]["s"],
            "gpu_hit_s": b["gpu_hit"]["s"],
            "gpu_hit_tokens": b["gpu_hit"]["gpu_hit_tokens"],
            "floor_s": floor,
        }
        for r in results:
            if r["config"] != "none":
                p = r["prefix"][i]
                turn2 = p["turn2"]
                row[r["config"]] = {
                    "turn1_s": p["turn1"]["s"],
                    "turn2_s": turn2["s"],
                    "over_floor": turn2["s"] / floor,
                    "tier_hit_tokens": turn2["tier_hit_tokens"],
                    "load_gbs": turn2.get("load_gbs"),
                    "turn2_runs_s": turn2.get("runs_s", [turn2["s"]]),
                    "runs_load_gbs": [g for g in turn2.get("runs_load_gbs", []) if g],
                    "threads_cpu_s": turn2.get("threads_cpu_s", {}),
                    # The runs that measured each figure (a run without it, None, left out).
                    **{
                        key: [m for m in turn2.get(key, []) if m is not None]
                        for key in ("runs_load_submit_ms", "runs_load_submit_cpu_ms", "runs_longest_step_ms")
                    },
                }
        rows.append(row)
    return rows


def print_prefix(rows: list[dict[str, Any]], configs: list[str]) -> None:
    print("prefix reuse: turn-2 seconds (turn 1 stored the prefixes; the GPU prefix cache was reset between)")
    head = f"{'prefix':>14} {'GiB':>5} {'recompute':>9} {'GPU hit':>8} {'floor':>6}"
    print(head + "".join(f" {c:>22}" for c in configs if c != "none"))
    for row in rows:
        line = (
            f"{row['length']:>8} x {row['prompts']:<3} {row['prefix_gib']:>5.2f} {row['recompute_s']:>9.3f} "
            f"{row['gpu_hit_s']:>8.3f} {row['floor_s']:>6.3f}"
        )
        for c in configs:
            if c != "none":
                v = row[c]
                line += f" {v['turn2_s']:>8.3f} ({v['over_floor']:.2f}x fl)"
        print(line)
    for row in rows:
        kvs = [(c, row[c]) for c in configs if c != "none"]
        runs = [f"{c} {min(v['turn2_runs_s']):.3f}-{max(v['turn2_runs_s']):.3f}" for c, v in kvs]
        print(f"  {row['length']} x {row['prompts']}: turn-2 runs, seconds: {', '.join(runs)}")
        rates = [f"{c} {v['load_gbs']:.1f} ({_spread(v['runs_load_gbs'])})" for c, v in kvs if v.get("load_gbs")]
        if rates:
            print(f"  {row['length']} x {row['prompts']}: turn-2 loads, GB/s in their copies (the worker's timing, "
                  f"medians, runs): {', '.join(rates)}")  # fmt: skip
        calls = [
            f"{c} {statistics.median(v['runs_load_submit_ms']):.1f} "
            f"({statistics.median(v['runs_load_submit_cpu_ms']):.1f} on its CPU)"
            for c, v in kvs
            if v.get("runs_load_submit_ms") and v.get("runs_load_submit_cpu_ms")
        ]
        if calls:
            print(f"  {row['length']} x {row['prompts']}: turn-2 loads, ms the engine's thread spent in the worker's "
                  f"submit calls (medians of the turns' sums): {', '.join(calls)}")  # fmt: skip
        steps = [
            f"{c} {statistics.median(v['runs_longest_step_ms']):.1f}" for c, v in kvs if v.get("runs_longest_step_ms")
        ]
        if steps:
            print(f"  {row['length']} x {row['prompts']}: turn 2, ms of the engine's longest step, which a request "
                  f"decoding beside would wait for a token (medians of the turns): {', '.join(steps)}")  # fmt: skip
        busy = [
            f"{c}: " + ", ".join(f"{name} {cpu:.2f}" for name, cpu in list(v["threads_cpu_s"].items())[:4])
            for c, v in kvs
            if v.get("threads_cpu_s")
        ]
        if busy:
            print(f"  {row['length']} x {row['prompts']}: turn 2, CPU seconds of the engine process's busiest threads "
                  f"(medians of the turns): {'; '.join(busy)}")  # fmt: skip


def _spread(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}" if values else "-"


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["--child"]:
        spec = json.loads(args_in[1])
        result = child(spec["config"], spec["workload"], spec["args"])
        with open(spec["out"], "w") as f:
            json.dump(result, f)
        return 0

    ap = _parser()
    args = ap.parse_args(argv)
    workloads, configs, lengths = _checked(ap, args)
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError as e:
        ap.error(f"needs vLLM and torch ({e})")
    from kvtier.vllm import SETTING_KEYS, resolve_settings

    for c in configs:
        _, settings = split_config(c)
        unknown = sorted(set(settings) - set(SETTING_KEYS))
        if unknown:
            ap.error(f"--configs: {c!r}: {unknown} are not settings of kvtier's vLLM spec ({', '.join(SETTING_KEYS)})")
        try:
            resolve_settings(settings)
        except ValueError as e:
            ap.error(f"--configs: {c!r}: {e}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")

    work = tempfile.mkdtemp(prefix="kvtier-serve-")
    common = {
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_batched_tokens": 8192,
        "lengths": args.lengths,
        "noreuse": args.noreuse,
        "repeats": args.repeats,
        "think_s": args.think_s,
        "job_ids": args.job_ids,
    }
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "vllm": vllm.__version__, "configs": configs}
    if "prefix" in workloads or "noreuse" in workloads:
        _prefix(report, args, common, configs, lengths if "prefix" in workloads else [], work)
    if "trace" in workloads:
        report["trace"] = _trace(args, common, configs, work)
    if "l3" in workloads:
        report["l3"] = run_l3(args, common, lengths, work)
    print("greedy token ids identical in every configuration")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report, args.plot)
    return 0


def _parser() -> argparse.ArgumentParser:
    from kvtier.tools.cli import at_least, between, parser, plot_file, positive

    ap = parser("kvtier bench serve", __doc__)
    ap.add_argument("--workloads", default="prefix,trace", help=f"comma-separated: {', '.join(WORKLOADS)}")
    ap.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, of {', '.join(CONFIGS)}; a kvtier one may add settings (kvtier-lru:copy_method=kernel);"
        " l3 runs its own two (kvtier's Mooncake tier, none)",
    )
    ap.add_argument("--model", choices=sorted(MODELS), default="8b", help="the model shape of prefix, noreuse, l3")
    ap.add_argument("--trace-model", choices=sorted(MODELS), default="1b-8l", help="the model shape of the trace")
    ap.add_argument("--lengths", default="4096x16,16384x4,32000x2", help="prefix workload: TOKENSxPROMPTS, ...")
    ap.add_argument(
        "--noreuse",
        default="4096x32",
        help="the no-reuse workload's TOKENSxPROMPTS; it runs after prefix in its processes ('' skips it), or alone",
    )
    ap.add_argument("--repeats", type=at_least(1), default=3, help="runs of no reuse, turn 2, GPU hit (medians)")
    ap.add_argument("--host-gib", type=positive(float), default=16.0, help="host bytes of every offloading tier")
    ap.add_argument("--trace-host-gib", type=positive(float), default=8.0, help="host bytes for the trace")
    from kvtier.tools.bench.trace import SHIPPED_TRACE

    ap.add_argument(
        "--trace",
        default=str(SHIPPED_TRACE),
        help="a Mooncake-format trace (.jsonl or .jsonl.gz) for the trace workload; default: the excerpt kvtier ships",
    )
    ap.add_argument("--trace-requests", type=at_least(1), default=1000, help="the trace's first requests replayed")
    ap.add_argument("--trace-max-tokens", type=at_least(BLOCK), default=16384, help="trace prompts cut here")
    ap.add_argument(
        "--gpu-blocks", type=at_least(16), default=4608, help="vLLM's GPU KV blocks (16 tokens each): a turn fits"
    )
    ap.add_argument("--think-s", type=between(0, 60, float), default=1.0, help="seconds between a turn and the next")
    ap.add_argument("--trace-gpu-blocks", type=at_least(16), default=2048, help="GPU KV blocks for the trace")
    ap.add_argument(
        "--gpu-memory-utilization", type=between(0.01, 1.0, float), default=0.5, help="vLLM's setting (0.01 to 1)"
    )
    ap.add_argument(
        "--job-ids",
        action="store_true",
        help="--json keeps each transfer's GPU block ids and vLLM chunk ids (benches/load_patterns.py --replay)",
    )
    ap.add_argument("--log", help="append every engine's output here")
    ap.add_argument("--json", metavar="PATH", help="write every figure here as JSON")
    ap.add_argument("--plot", type=plot_file, metavar="PNG", help="draw turn-2 times and trace TTFT here")
    return ap


def _checked(ap: argparse.ArgumentParser, args: Any) -> tuple[list[str], list[str], list[tuple[int, int]]]:
    """The workloads, the configurations and the prefix lengths asked for, each checked (``ap.error`` otherwise)."""
    workloads = [w for w in args.workloads.split(",") if w]
    configs = [c for c in args.configs.split(",") if c]
    if not workloads:
        ap.error(f"--workloads: name at least one of {', '.join(WORKLOADS)}")
    if not configs:
        ap.error(f"--configs: name at least one of {', '.join(CONFIGS)}")
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"--workloads: unknown workload {w!r} ({', '.join(WORKLOADS)})")
    twice = sorted({c for c in configs if configs.count(c) > 1})
    if twice:
        ap.error(f"--configs: {twice} named more than once")
    for c in configs:
        try:
            name, settings = split_config(c)
        except ValueError as e:
            ap.error(str(e))
        if name not in CONFIGS:
            ap.error(f"--configs: unknown configuration {name!r} ({', '.join(CONFIGS)})")
        if "eviction_policy" in settings:
            ap.error(
                f"--configs: {c!r}: the configuration's name sets the eviction policy (kvtier-lru, kvtier-adaptive)"
            )
    if "prefix" in workloads and "none" not in configs:
        ap.error("--configs: the prefix workload needs 'none' (its recompute, GPU-hit and memcpy baselines)")
    if "noreuse" in workloads and "none" not in configs:
        ap.error("--configs: the noreuse workload needs 'none' (the throughput it is compared with)")
    if "noreuse" in workloads and not args.noreuse:
        ap.error("--workloads noreuse: --noreuse '' leaves it nothing to run (give TOKENSxPROMPTS)")
    if args.plot and not {"prefix", "trace"} & set(workloads):
        ap.error("--plot draws the prefix and trace workloads; --workloads names neither")
    if "l3" in workloads:
        from kvtier.l3.store import import_mooncake
        from kvtier.tools.cli import L3_EXTRA

        try:
            import_mooncake()
        except ImportError as e:
            ap.error(f"--workloads l3 needs Mooncake, which is not importable ({e}): {L3_EXTRA}")
    if "trace" in workloads and not os.path.isfile(args.trace):
        ap.error(f"--trace: no trace file {args.trace!r}")
    try:
        lengths = parse_lengths(args.lengths)
        if args.noreuse and len(parse_lengths(args.noreuse, "--noreuse")) > 1:
            ap.error(f"--noreuse: {args.noreuse!r} names more than one TOKENSxPROMPTS; the workload takes one")
    except ValueError as e:
        ap.error(str(e))
    return workloads, configs, lengths


def _prefix(
    report: dict[str, Any],
    args: Any,
    common: dict[str, Any],
    configs: list[str],
    lengths: list[tuple[int, int]],
    work: str,
) -> None:
    """The prefix workload at ``lengths`` (none: the no-reuse workload alone) and the no-reuse one (unless
    ``--noreuse ''``) in every configuration, a process each, into ``report``."""
    noreuse = parse_lengths(args.noreuse, "--noreuse") if args.noreuse else []
    longest = max(n for n, _ in lengths + noreuse) + NEW_TOKENS + OUTPUT_TOKENS + BLOCK
    model_dir = write_model(os.path.join(work, "prefix-model"), args.model, longest)
    a = {**common, "lengths": ",".join(f"{n}x{c}" for n, c in lengths), "model": args.model, "model_dir": model_dir,
         "max_model_len": longest, "gpu_blocks": args.gpu_blocks, "host_gib": args.host_gib,
         "kv_bytes": kv_bytes_per_token(args.model)}  # fmt: skip
    results = [_spawn(c, "prefix", a, args.log) for c in configs]
    if lengths:
        check_identical(results, _tokens_of_prefix)
    if args.noreuse:
        check_identical(results, lambda r: r["noreuse"]["tokens"])
    line = f"{report['device']}, vLLM {report['vllm']}, model {args.model}"
    if lengths:
        report["prefix"] = summarize_prefix(results)
        report["memcpy_h2d_gbs"] = next(r for r in results if r["config"] == "none")["memcpy_h2d_gbs"]
        print(f"{line}; host -> device memcpy {report['memcpy_h2d_gbs']:.1f} GB/s")
        print_prefix(report["prefix"], configs)
    else:
        print(line)
    if args.noreuse:
        report["noreuse"] = {r["config"]: r["noreuse"]["requests_per_s"] for r in results}
        print_noreuse(results)
    for r in results:
        if r.get("replay"):
            print(f"{r['config']}: its turn-2 loads again, in its process between turns: {replay_summary(r['replay'])}")
    report["prefix_runs"] = [{k: v for k, v in r.items()} for r in results]


def print_noreuse(results: list[dict[str, Any]]) -> None:
    """The no-reuse workload's requests a second by configuration, against no offloading's, and the ms the engine's
    thread spent in the worker's store submit calls a run (medians; and its CPU ms there)."""
    base = next(r for r in results if r["config"] == "none")["noreuse"]["requests_per_s"]
    rates = [f"{r['config']} {r['noreuse']['requests_per_s']:.2f} ({r['noreuse']['requests_per_s'] / base:.3f})"
             for r in results]  # fmt: skip
    print("no reuse: requests/s (against no offloading): " + ", ".join(rates))
    calls = [
        f"{r['config']} {r['noreuse']['store_submit_ms']:.1f} ({r['noreuse']['store_submit_cpu_ms']:.1f})"
        for r in results
        if r["config"] != "none" and "store_submit_ms" in r["noreuse"]
    ]
    if calls:
        print("no reuse: ms the engine's thread spent in the worker's store submit calls a run (medians; of it on its "
              "CPU): " + ", ".join(calls))  # fmt: skip


def replay_summary(rows: list[dict[str, Any]]) -> str:
    """The replayed loads' median rates (and submit calls' ms, where recorded under vLLM), split by how they ran
    under vLLM (below 30 GB/s or not)."""
    parts = []
    for slow in (True, False):
        picked = [r for r in rows if r["under_vllm_gbs"] is not None and (r["under_vllm_gbs"] < 30) == slow]
        if picked:
            here = statistics.median(r["gbs"] for r in picked)
            there = statistics.median(r["under_vllm_gbs"] for r in picked)
            into = "".join(
                f", {statistics.median(r[key] for r in picked):.1f} {name}"
                for key, name in (("scratch_gbs", "into a scratch tensor"), ("alternate_gbs", "in alternate pages"))
                if all(key in r for r in picked)
            )
            calls = ""
            if all(r.get("under_vllm_submit_ms") is not None for r in picked):
                calls = (f"; a submit {statistics.median(r['submit_ms'] for r in picked):.2f} ms here, "
                         f"{statistics.median(r['under_vllm_submit_ms'] for r in picked):.2f} there")  # fmt: skip
            parts.append(f"{len(picked)} loads {'below' if slow else 'at or above'} 30 GB/s under vLLM: {here:.1f} "
                         f"GB/s here{into}; {there:.1f} there{calls}")  # fmt: skip
    return "; ".join(parts) or "no timed loads"


def _trace(args: Any, common: dict[str, Any], configs: list[str], work: str) -> dict[str, Any]:
    """The trace workload in every configuration: its figures by configuration."""
    model_dir = write_model(os.path.join(work, "trace-model"), args.trace_model, args.trace_max_tokens + BLOCK)
    a = {**common, "model": args.trace_model, "model_dir": model_dir,
         "max_model_len": args.trace_max_tokens + BLOCK, "gpu_blocks": args.trace_gpu_blocks,
         "host_gib": args.trace_host_gib, "trace": args.trace, "trace_requests": args.trace_requests,
         "trace_max_tokens": args.trace_max_tokens, "kv_bytes": kv_bytes_per_token(args.trace_model)}  # fmt: skip
    results = [_spawn(c, "trace", a, args.log) for c in configs]
    check_identical(results, lambda r: r["trace"]["tokens"])
    trace = {r["config"]: {k: v for k, v in r["trace"].items() if k != "tokens"} for r in results}
    host_tokens = args.trace_host_gib * 2**30 / kv_bytes_per_token(args.trace_model)
    print(f"trace: first {args.trace_requests} requests, model {args.trace_model}, host {host_tokens:,.0f} tokens")
    for c, t in trace.items():
        print(f"  {c:<16} TTFT p50 {t['ttft_p50_s'] * 1e3:7.1f} ms p99 {t['ttft_p99_s'] * 1e3:7.1f} ms, "
              f"{t['requests_per_s']:.2f} req/s, hit tokens: GPU {t['gpu_hit_tokens']:,} "
              f"host tier {t['tier_hit_tokens']:,} of {t['prompt_tokens']:,}")  # fmt: skip
    return trace


def run_l3(args: Any, common: dict[str, Any], lengths: list[tuple[int, int]], work: str) -> dict[str, Any]:
    """Turn 1 in one process, turn 2 in a new one served from the Store; recompute in a third for the ratio."""
    from kvtier.tools.mooncake import LocalMooncake

    longest = max(n for n, _ in lengths) + NEW_TOKENS + OUTPUT_TOKENS + BLOCK
    model_dir = write_model(os.path.join(work, "l3-model"), args.model, longest)
    need = sum(n * c for n, c in lengths) * kv_bytes_per_token(args.model)
    with LocalMooncake(segment_bytes=2 * need + (256 << 20)) as mc:  # the Store keeps room over its watermark
        a = {**common, "model": args.model, "model_dir": model_dir, "max_model_len": longest,
             "gpu_blocks": args.gpu_blocks, "host_gib": args.host_gib, "l3_master": mc.master_addr,
             "kv_bytes": kv_bytes_per_token(args.model)}  # fmt: skip
        first = _spawn("kvtier-l3", "l3", {**a, "turns": "1"}, args.log)
        second = _spawn("kvtier-l3", "l3", {**a, "turns": "2"}, args.log)
    recompute = _spawn("none", "l3", {**a, "turns": "2"}, args.log)
    if [r["turn2"]["tokens"] for r in second["prefix"]] != [r["turn2"]["tokens"] for r in recompute["prefix"]]:
        raise AssertionError("greedy outputs differ: turn 2 served from the Store against recompute")
    rows = []
    for s, r, f in zip(second["prefix"], recompute["prefix"], first["prefix"], strict=True):
        t1, t2, rt = f["turn1"], s["turn2"], r["turn2"]
        row = {"length": s["length"], "prompts": s["prompts"], "turn1_s": t1["s"], "l3_turn2_s": t2["s"]}
        rows.append({**row, "recompute_s": rt["s"], "ratio": t2["s"] / rt["s"], "hit_tokens": t2["tier_hit_tokens"]})
    print("L3: turn 2 in a new instance, served from Mooncake Store, against recompute")
    for row in rows:
        print(f"  {row['length']:>6} x {row['prompts']:<3} {row['l3_turn2_s']:.3f} s vs {row['recompute_s']:.3f} s "
              f"({row['ratio']:.2f}x), {row['hit_tokens']:,.0f} tokens hit")  # fmt: skip
    return {"rows": rows}


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("prefix", "trace") if k in report]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, k in zip(axes[0], panels, strict=True):
        if k == "prefix":
            rows = report["prefix"]
            labels = [f"{r['length']}x{r['prompts']}" for r in rows]
            series = {"recompute": [r["recompute_s"] for r in rows], "GPU hit": [r["gpu_hit_s"] for r in rows],
                      "floor": [r["floor_s"] for r in rows]}  # fmt: skip
            for c in report["configs"]:
                if c != "none":
                    series[c] = [r[c]["turn2_s"] for r in rows]
            width = 0.8 / len(series)
            for j, (name, ys) in enumerate(series.items()):
                ax.bar([i + j * width for i in range(len(rows))], ys, width, label=name)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], labels)
            ax.set_ylabel("turn-2 seconds")
            ax.set_title("prefix reuse (GPU prefix cache reset)")
        else:
            t = report["trace"]
            names = list(t)
            ax.bar(range(len(names)), [t[c]["ttft_p50_s"] * 1e3 for c in names], 0.4, label="TTFT p50")
            ax.bar([i + 0.4 for i in range(len(names))], [t[c]["ttft_p99_s"] * 1e3 for c in names], 0.4,
                   label="TTFT p99")  # fmt: skip
            ax.set_xticks([i + 0.2 for i in range(len(names))], names)
            ax.set_ylabel("ms")
            ax.set_title("conversation trace")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
