"""`kvtier bench serve`: real vLLM serving a model on a GPU, with no offloading, vLLM's own CPU offloading and kvtier.

Each configuration runs in a process of its own (one engine on the GPU at a time), on a Llama-shaped model whose
`config.json` this writes (dummy weights: vLLM seeds them, so every configuration computes the same function) and
synthetic token ids (no tokenizer). Greedy decoding: the token ids every configuration produces must be identical
to the first configuration's, and the run fails loudly when they are not. Workloads:

- `prefix`: for each length, N prompts of a distinct prefix plus 32 new tokens, 8 output tokens each. Turn 1 stores
  the prefixes; `reset_prefix_cache()` then empties the GPU's prefix cache, so turn 2 (the same prefixes, 32 other
  new tokens) is served by the offloading tier or recomputed. The no-offloading process also times turn 2 without
  the reset (a GPU prefix-cache hit) and measures pinned host -> device memcpy: the floor of a host hit is the GPU
  hit plus the prefix bytes at memcpy speed.
- `noreuse`: prompts that share nothing, each once (stores run, nothing is ever hit); requests a second, the median
  of the repeats.
- `trace`: a Mooncake-format trace (the requests in file order, one at a time, one output token: a request's time is
  its time to first token), every hash id its own block of token ids, prompts capped at `--trace-max-tokens`.
- `l3`: kvtier's Mooncake tier under vLLM's tiering spec, with a local master and holder this starts: one process
  runs turn 1 of the prefix workload and exits; a second, new process then runs turn 2, served from the Store.

Needs vLLM (0.25.1 through 0.34; the GPU machine's torch pins 0.25.1), a CUDA GPU and, for `l3`, Mooncake.
`--json` prints every figure; `--plot` draws turn-2 time (prefix) and TTFT (trace) by configuration.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
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


def parse_lengths(text: str) -> list[tuple[int, int]]:
    """'4096x16,16384x4' -> [(4096, 16), (16384, 4)]: prefix tokens x prompts."""
    out = []
    for part in text.split(","):
        length, _, count = part.strip().partition("x")
        try:
            pair = (int(length), int(count))
        except ValueError:
            raise ValueError(f"--lengths: {part!r} is not TOKENSxPROMPTS (e.g. 4096x16)") from None
        if pair[0] < BLOCK or pair[1] < 1:
            raise ValueError(f"--lengths: {part!r} needs at least {BLOCK} tokens and one prompt")
        out.append(pair)
    return out


# ---- one configuration, in a process of its own ----------------------------------------------------------------


def engine_kwargs(config: str, args: dict[str, Any]) -> dict[str, Any]:
    """vLLM's LLM(...) arguments of a configuration."""
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
    if config == "native":
        kw["kv_offloading_size"] = args["host_gib"]
        kw["kv_offloading_backend"] = "native"
    elif config.startswith("kvtier-"):
        from vllm.config import KVTransferConfig

        extra: dict[str, Any] = {"spec_module_path": "kvtier.vllm", "cpu_bytes_to_use": host}
        if config == "kvtier-l3":
            extra.update(
                spec_name="TieringOffloadingSpec",
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
            del extra["spec_module_path"]
        else:
            extra.update(spec_name="KvtierSpec", eviction_policy=config.split("-", 1)[1])
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
    elif config != "none":
        raise ValueError(f"unknown configuration {config!r}")
    return kw


def _counters(llm: Any) -> dict[str, float]:
    """vLLM's prefix-cache counters (tokens): GPU hits, the offloading connector's hits, prompt tokens."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits", "vllm:prompt_tokens"):
            out[m.name] = out.get(m.name, 0.0) + float(getattr(m, "value", 0.0))
    return {
        "gpu_hit_tokens": out.get("vllm:prefix_cache_hits", 0.0),
        "host_hit_tokens": out.get("vllm:external_prefix_cache_hits", 0.0),
        "prompt_tokens": out.get("vllm:prompt_tokens", 0.0),
    }


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, [list(o.outputs[0].token_ids) for o in outs]


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


def run_prefix(llm: Any, config: str, args: dict[str, Any], turns: str = "12") -> list[dict[str, Any]]:
    """The prefix workload's rows (see the module's text); ``turns`` '1' or '2' runs one turn (the l3 workload)."""
    import numpy as np

    rows = []
    for length, count in parse_lengths(args["lengths"]):
        rng = np.random.default_rng([length, count, 1])
        prefixes = [tokens(rng, length) for _ in range(count)]
        suffixes = [[tokens(rng, NEW_TOKENS) for _ in range(count)] for _ in range(3)]
        turn = [[p + s for p, s in zip(prefixes, suffix, strict=True)] for suffix in suffixes]
        row: dict[str, Any] = {"length": length, "prompts": count}
        before = _counters(llm)
        if "1" in turns:
            row["turn1_s"], row["turn1_tokens"] = _generate(llm, turn[0], OUTPUT_TOKENS)
            if config == "none":
                # A GPU prefix-cache hit: turn 2 right after turn 1.
                row["gpu_hit_s"], row["gpu_hit_tokens_out"] = _generate(llm, turn[1], OUTPUT_TOKENS)
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache")
        if "2" in turns:
            mid = _counters(llm)
            row["turn2_s"], row["turn2_tokens"] = _generate(llm, turn[2], OUTPUT_TOKENS)
            row["turn2_counters"] = _delta(_counters(llm), mid)
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache")
        row["counters"] = _delta(_counters(llm), before)
        row["prefix_bytes"] = length * count * kv_bytes_per_token(args["model"])
        rows.append(row)
    return rows


def run_noreuse(llm: Any, args: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    length, count = parse_lengths(args["noreuse"])[0]
    times, outputs = [], []
    for r in range(args["repeats"]):
        rng = np.random.default_rng([length, count, 2, r])
        dt, out = _generate(llm, [tokens(rng, length) for _ in range(count)], OUTPUT_TOKENS)
        times.append(dt)
        outputs.append(out)
    return {
        "length": length,
        "prompts": count,
        "times_s": times,
        "requests_per_s": count / statistics.median(times),
        "tokens": outputs,
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


def run_trace(llm: Any, args: dict[str, Any]) -> dict[str, Any]:
    prompts = trace_prompts(args["trace"], args["trace_requests"], args["trace_max_tokens"])
    _generate(llm, [prompts[0][: BLOCK * 4]], 1)  # warm-up
    llm.reset_prefix_cache()
    before = _counters(llm)
    times, outputs = [], []
    t0 = time.perf_counter()
    for p in prompts:
        dt, out = _generate(llm, [p], 1)
        times.append(dt)
        outputs.append(out[0])
    total = time.perf_counter() - t0
    c = _delta(_counters(llm), before)
    return {
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "ttft_p50_s": statistics.median(times),
        "ttft_p99_s": sorted(times)[min(len(times) - 1, int(0.99 * len(times)))],
        "requests_per_s": len(prompts) / total,
        "counters": c,
        "tokens": outputs,
    }


def child(config: str, workload: str, args: dict[str, Any]) -> dict[str, Any]:
    """One configuration's figures (this process holds one engine)."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(config, args))
    out: dict[str, Any] = {"config": config, "workload": workload, "init_s": time.perf_counter() - t0}
    _generate(llm, [list(range(1000, 1000 + 4 * BLOCK))], 2)  # warm-up
    if workload == "prefix":
        out["prefix"] = run_prefix(llm, config, args)
        if config == "none":
            out["memcpy_h2d_gbs"] = _memcpy_gbs()
        if args.get("noreuse"):
            out["noreuse"] = run_noreuse(llm, args)
    elif workload == "trace":
        out["trace"] = run_trace(llm, args)
    elif workload == "l3":
        out["prefix"] = run_prefix(llm, config, args, turns=args["turns"])
    return out


# ---- the parent: one process a configuration, then the checks and the table ------------------------------------


def _spawn(config: str, workload: str, args: dict[str, Any], log: str | None) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w+", suffix=".json", delete=False) as f:
        result_path = f.name
    payload = json.dumps({"config": config, "workload": workload, "args": args, "out": result_path})
    cmd = [sys.executable, "-m", "kvtier.tools.bench.serve", "--child", payload]
    with open(log or os.devnull, "a") as logf:
        logf.write(f"==== {config} {workload}\n")
        logf.flush()
        rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT).returncode
    try:
        if rc != 0:
            raise RuntimeError(f"configuration {config} ({workload}) failed with exit status {rc}; see {log}")
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
    return [(row.get("turn1_tokens"), row.get("turn2_tokens")) for row in r["prefix"]]


def summarize_prefix(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per length: turn-2 seconds by configuration, the GPU-hit time, the memcpy floor and the ratios."""
    base = next(r for r in results if r["config"] == "none")
    rows = []
    for i, b in enumerate(base["prefix"]):
        floor = b["gpu_hit_s"] + b["prefix_bytes"] / (base["memcpy_h2d_gbs"] * 1e9)
        row: dict[str, Any] = {
            "length": b["length"],
            "prompts": b["prompts"],
            "prefix_gib": b["prefix_bytes"] / 2**30,
            "recompute_s": b["turn2_s"],
            "gpu_hit_s": b["gpu_hit_s"],
            "floor_s": floor,
        }
        for r in results:
            if r["config"] != "none":
                p = r["prefix"][i]
                row[r["config"]] = {
                    "turn1_s": p["turn1_s"],
                    "turn2_s": p["turn2_s"],
                    "over_floor": p["turn2_s"] / floor,
                    "host_hit_tokens": p["turn2_counters"]["host_hit_tokens"],
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


def main(argv: Sequence[str] | None = None) -> int:
    from kvtier.tools.cli import at_least, parser, plot_file, positive

    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["--child"]:
        spec = json.loads(args_in[1])
        result = child(spec["config"], spec["workload"], spec["args"])
        with open(spec["out"], "w") as f:
            json.dump(result, f)
        return 0

    ap = parser("kvtier bench serve", __doc__)
    ap.add_argument("--workloads", default="prefix,trace", help=f"comma-separated: {', '.join(WORKLOADS)}")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated: {', '.join(CONFIGS)}")
    ap.add_argument("--model", choices=sorted(MODELS), default="8b", help="the model shape of prefix, noreuse, l3")
    ap.add_argument("--trace-model", choices=sorted(MODELS), default="1b-8l", help="the model shape of the trace")
    ap.add_argument("--lengths", default="4096x16,16384x4,32000x2", help="prefix workload: TOKENSxPROMPTS, ...")
    ap.add_argument("--noreuse", default="4096x32", help="the no-reuse workload's TOKENSxPROMPTS ('' skips it)")
    ap.add_argument("--repeats", type=at_least(1), default=3, help="no-reuse runs; the median is reported")
    ap.add_argument("--host-gib", type=positive(float), default=16.0, help="host bytes of every offloading tier")
    ap.add_argument("--trace-host-gib", type=positive(float), default=8.0, help="host bytes for the trace")
    ap.add_argument("--trace", help="Mooncake-format trace for the trace workload")
    ap.add_argument("--trace-requests", type=at_least(1), default=1000, help="the trace's first requests replayed")
    ap.add_argument("--trace-max-tokens", type=at_least(BLOCK), default=16384, help="trace prompts cut here")
    ap.add_argument("--gpu-blocks", type=at_least(16), default=4096, help="vLLM's GPU KV blocks (16 tokens each)")
    ap.add_argument("--trace-gpu-blocks", type=at_least(16), default=2048, help="GPU KV blocks for the trace")
    ap.add_argument("--gpu-memory-utilization", type=positive(float), default=0.5, help="vLLM's setting")
    ap.add_argument("--log", help="append every engine's output here")
    ap.add_argument("--json", metavar="PATH", help="write every figure here as JSON")
    ap.add_argument("--plot", type=plot_file, metavar="PNG", help="draw turn-2 times and trace TTFT here")
    args = ap.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    configs = [c for c in args.configs.split(",") if c]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"--workloads: unknown workload {w!r} ({', '.join(WORKLOADS)})")
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"--configs: unknown configuration {c!r} ({', '.join(CONFIGS)})")
    if "prefix" in workloads and "none" not in configs:
        ap.error("--configs: the prefix workload needs 'none' (its recompute, GPU-hit and memcpy baselines)")
    if "trace" in workloads and not args.trace:
        ap.error("--trace: the trace workload needs a trace file")
    try:
        lengths = parse_lengths(args.lengths)
        if args.noreuse:
            parse_lengths(args.noreuse)
    except ValueError as e:
        ap.error(str(e))
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError as e:
        ap.error(f"needs vLLM and torch ({e})")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")

    work = tempfile.mkdtemp(prefix="kvtier-serve-")
    longest = max(n for n, _ in lengths) + NEW_TOKENS + OUTPUT_TOKENS + BLOCK
    common = {
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_batched_tokens": 8192,
        "lengths": args.lengths,
        "noreuse": args.noreuse,
        "repeats": args.repeats,
    }
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "vllm": vllm.__version__, "configs": configs}
    if "prefix" in workloads:
        model_dir = write_model(os.path.join(work, "prefix-model"), args.model, longest)
        a = {**common, "model": args.model, "model_dir": model_dir, "max_model_len": longest,
             "gpu_blocks": args.gpu_blocks, "host_gib": args.host_gib}  # fmt: skip
        results = [_spawn(c, "prefix", a, args.log) for c in configs]
        check_identical(results, _tokens_of_prefix)
        if args.noreuse:
            check_identical(results, lambda r: r["noreuse"]["tokens"])
        report["prefix"] = summarize_prefix(results)
        report["memcpy_h2d_gbs"] = next(r for r in results if r["config"] == "none")["memcpy_h2d_gbs"]
        print(
            f"{report['device']}, vLLM {report['vllm']}, model {args.model}; memcpy {report['memcpy_h2d_gbs']:.1f} GB/s"
        )
        print_prefix(report["prefix"], configs)
        if args.noreuse:
            report["noreuse"] = {r["config"]: r["noreuse"]["requests_per_s"] for r in results}
            base = report["noreuse"]["none"]
            print("no reuse: requests/s (against no offloading): " + ", ".join(
                f"{c} {v:.2f} ({v / base:.3f})" for c, v in report["noreuse"].items()))  # fmt: skip
        report["prefix_runs"] = [{k: v for k, v in r.items()} for r in results]
    if "trace" in workloads:
        model_dir = write_model(os.path.join(work, "trace-model"), args.trace_model, args.trace_max_tokens + BLOCK)
        a = {**common, "model": args.trace_model, "model_dir": model_dir,
             "max_model_len": args.trace_max_tokens + BLOCK, "gpu_blocks": args.trace_gpu_blocks,
             "host_gib": args.trace_host_gib, "trace": args.trace, "trace_requests": args.trace_requests,
             "trace_max_tokens": args.trace_max_tokens}  # fmt: skip
        results = [_spawn(c, "trace", a, args.log) for c in configs]
        check_identical(results, lambda r: r["trace"]["tokens"])
        report["trace"] = {r["config"]: {k: v for k, v in r["trace"].items() if k != "tokens"} for r in results}
        host_tokens = args.trace_host_gib * 2**30 / kv_bytes_per_token(args.trace_model)
        print(f"trace: first {args.trace_requests} requests, model {args.trace_model}, host {host_tokens:,.0f} tokens")
        for c, t in report["trace"].items():
            cnt = t["counters"]
            print(f"  {c:<16} TTFT p50 {t['ttft_p50_s'] * 1e3:7.1f} ms p99 {t['ttft_p99_s'] * 1e3:7.1f} ms, "
                  f"{t['requests_per_s']:.2f} req/s, hit tokens GPU {cnt['gpu_hit_tokens']:,.0f} "
                  f"host {cnt['host_hit_tokens']:,.0f} of {cnt['prompt_tokens']:,.0f}")  # fmt: skip
    if "l3" in workloads:
        report["l3"] = run_l3(args, common, lengths, work)
    print("greedy token ids identical in every configuration")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report, args.plot)
    return 0


def run_l3(args: Any, common: dict[str, Any], lengths: list[tuple[int, int]], work: str) -> dict[str, Any]:
    """Turn 1 in one process, turn 2 in a new one served from the Store; recompute in a third for the ratio."""
    from kvtier.l3.server import LocalMooncake

    longest = max(n for n, _ in lengths) + NEW_TOKENS + OUTPUT_TOKENS + BLOCK
    model_dir = write_model(os.path.join(work, "l3-model"), args.model, longest)
    need = sum(n * c for n, c in lengths) * kv_bytes_per_token(args.model)
    with LocalMooncake(segment_bytes=int(need * 1.25) + (256 << 20)) as mc:
        a = {**common, "model": args.model, "model_dir": model_dir, "max_model_len": longest,
             "gpu_blocks": args.gpu_blocks, "host_gib": args.host_gib, "l3_master": mc.master_addr}  # fmt: skip
        first = _spawn("kvtier-l3", "l3", {**a, "turns": "1"}, args.log)
        second = _spawn("kvtier-l3", "l3", {**a, "turns": "2"}, args.log)
    recompute = _spawn("none", "l3", {**a, "turns": "2"}, args.log)
    if [r["turn2_tokens"] for r in second["prefix"]] != [r["turn2_tokens"] for r in recompute["prefix"]]:
        raise AssertionError("greedy outputs differ: turn 2 served from the Store against recompute")
    rows = []
    for s, r, f in zip(second["prefix"], recompute["prefix"], first["prefix"], strict=True):
        rows.append({"length": s["length"], "prompts": s["prompts"], "turn1_s": f["turn1_s"],
                     "l3_turn2_s": s["turn2_s"], "recompute_s": r["turn2_s"], "ratio": s["turn2_s"] / r["turn2_s"],
                     "hit_tokens": s["turn2_counters"]["host_hit_tokens"]})  # fmt: skip
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
