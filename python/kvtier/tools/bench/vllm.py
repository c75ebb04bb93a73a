"""`kvtier bench vllm`: kvtier's vLLM offloading manager against vLLM's own CPUOffloadingManager (lru and arc).

Both managers run side by side in one process on the same keys (vLLM's OffloadKey: a sha256 block hash and a
4-byte group), with as many host slots as keys. Timed, each the median of the repeats: a lookup of every stored key
(vLLM's scheduler calls lookup once a key), a prepare_store of as many new keys (evicting all the stored ones), its
complete_store, the request's on_request_finished, and the store's two calls together (prepare+complete). kvtier's
manager runs with each eviction policy. Needs vLLM 0.25.1 through 0.34 (`pip install ".[vllm]"` from kvtier's source).

With ``--scheduler``: vLLM's own Scheduler stepping a no-reuse workload (``--prompts`` prompts of ``--tokens``
distinct tokens, 8,192 tokens a step, 8 output tokens each) with no offloading, with vLLM's CPU offloading and with
kvtier's spec: the host time of ``schedule()`` and ``update_from_output()`` a step, the scheduler side of the
connector included (no worker: every store is reported complete at once). Medians of the repeats.

With ``--copies`` (needs CUDA, not vLLM): the worker's copy half (``kvtier.vllm.copy.ChunkCopier``) on KV tensors of
vLLM 0.33's CUDA shapes, 256 blocks: stores and loads of every block against a plain pinned memcpy of the same
bytes, whether the round trip is exact, and a bf16 GEMM (8192^3, 20 times) alone and with a store and a load on
kvtier's copy streams beside it (seven of each in turn, medians).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

# vLLM's CPU manager and kvtier's, with each eviction policy.
MANAGERS = ("vllm-lru", "vllm-arc", "kvtier-lru", "kvtier-adaptive")
# GEMMs timed alone and beside the copies, in turn (--copies); the medians of each are reported.
GEMM_PAIRS = 7
STEPS = ("lookup", "prepare_store", "complete_store", "on_request_finished", "prepare+complete")


def run(keys: int, repeat: int) -> dict[str, dict[str, float]]:
    """Median milliseconds of each step, a manager."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvtier.vllm import KvtierManager

    def make(name: str) -> Any:
        side, policy = name.split("-")
        if side == "kvtier":
            return KvtierManager(keys, eviction_policy=policy)
        return CPUOffloadingManager(keys, cache_policy=policy)  # its capacity: num_blocks before 0.30, num_chunks

    def batch(base: int) -> list[Any]:
        return [make_offload_key(hashlib.sha256(str(base + i).encode()).digest(), 0) for i in range(keys)]

    out: dict[str, dict[str, float]] = {}
    for name in MANAGERS:
        times: dict[str, list[float]] = {step: [] for step in STEPS}
        for r in range(repeat):
            m = make(name)
            ctx = ReqContext(req_id=f"fill{r}")
            m.on_new_request(ctx)
            stored = batch(2 * r * keys)
            plan = m.prepare_store(stored, ctx)
            m.complete_store(plan.keys_to_store, ctx)
            m.on_request_finished(ctx)

            ctx = ReqContext(req_id=f"r{r}")
            m.on_new_request(ctx)
            new = batch((2 * r + 1) * keys)  # made before the clock starts: the managers' time only
            t0 = time.perf_counter()
            for k in stored:
                m.lookup(k, ctx)
            t1 = time.perf_counter()
            plan = m.prepare_store(new, ctx)
            t2 = time.perf_counter()
            if plan is None or len(plan.evicted_keys) != keys:
                raise RuntimeError(f"{name}: the store of {keys} new keys did not evict the {keys} stored ones")
            m.complete_store(plan.keys_to_store, ctx)
            t3 = time.perf_counter()
            m.on_request_finished(ctx)
            t4 = time.perf_counter()
            for step, dt in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t3 - t1), strict=True):
                times[step].append(dt * 1e3)
        out[name] = {step: statistics.median(v) for step, v in times.items()}
    return out


SCHEDULER_CONFIGS = ("none", "native", "kvtier")
# The --scheduler workload: tokens a KV block, tokens a step (vLLM's batch), output tokens a request.
SCHEDULER_BLOCK, SCHEDULER_BATCH, SCHEDULER_OUTPUT = 16, 8192, 8


def _vllm_config(config: str, tokens: int, model: str) -> Any:
    """A VllmConfig of a tiny model (its config.json written into the folder ``model``) on the CPU, with
    ``config``'s offloading connector (none, vLLM's CPU offloading or kvtier's spec)."""
    import os

    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64,
                   "num_attention_heads": 4, "num_hidden_layers": 2, "ffn_dim": 128, "vocab_size": 50000,
                   "max_position_embeddings": tokens + 64, "word_embed_proj_dim": 64, "do_layer_norm_before": True,
                   "torch_dtype": "float16", "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2}, f)  # fmt: skip
    cache = CacheConfig(block_size=SCHEDULER_BLOCK, enable_prefix_caching=True)
    if hasattr(cache, "kv_cache_layout"):  # vLLM 0.30 on: the layout a worker would have resolved
        cache.kv_cache_layout = "LBNHC"
    transfer: dict[str, Any] = {}
    if config != "none":
        extra: dict[str, Any] = {"cpu_bytes_to_use": 64 << 20}
        if config == "kvtier":
            extra.update(spec_name="KvtierSpec", spec_module_path="kvtier.vllm")
        transfer["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=model, dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=tokens + 64
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=256,
            max_num_batched_tokens=SCHEDULER_BATCH,
            max_model_len=tokens + 64,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=cache,
        device_config=DeviceConfig("cpu"),
        **transfer,
    )
    vllm_config.scheduler_config.async_scheduling = False
    return vllm_config


def _scheduler(config: str, prompts: int, tokens: int, model: str) -> Any:
    """vLLM's Scheduler with ``config``'s connector (see the module's text), on a one-layer CPU KV cache with room
    for every prompt, the no-reuse prompts added."""
    import numpy as np
    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    try:  # vLLM 0.33 on
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    except ImportError:
        get_kv_cache_config_from_groups = kv_cache_utils.get_kv_cache_config_from_groups

    vllm_config = _vllm_config(config, tokens, model)
    blocks = prompts * (tokens // SCHEDULER_BLOCK + 2) + 64
    spec = FullAttentionSpec(block_size=SCHEDULER_BLOCK, num_kv_heads=1, head_size=4, dtype=torch.float32)
    vllm_config.cache_config.num_gpu_blocks_override = vllm_config.cache_config.num_gpu_blocks = blocks
    groups = [KVCacheGroupSpec(["layer"], spec)]
    kv_config = get_kv_cache_config_from_groups(vllm_config, groups, spec.page_size_bytes * blocks)
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, vllm_config)
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
    )
    init_none_hash(sha256)
    hasher = get_request_block_hasher(SCHEDULER_BLOCK, sha256)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=SCHEDULER_OUTPUT, ignore_eos=True)
    for i in range(prompts):
        ids = rng.integers(1000, 40000, tokens).tolist()
        request = Request(f"r{i}", ids, sampling_params=params, pooling_params=None, block_hasher=hasher)
        scheduler.add_request(request)
    return scheduler


def step_output(running: Sequence[Any], kv_connector_output: Any = None) -> Any:
    """vLLM's ``ModelRunnerOutput`` of a step as a worker returns it: a token for each of the ``running`` requests
    past its prompt (one whose prompt is not all computed yet, in chunked prefill, samples nothing), with the
    connector's output when given."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    o: dict[str, Any] = {
        "req_ids": [r.request_id for r in running],
        "sampled_token_ids": [[7] if r.num_computed_tokens >= r.num_prompt_tokens else [] for r in running],
        "logprobs": None,
        "prompt_logprobs_dict": {},
        "pooler_output": None,
    }
    if kv_connector_output is not None:
        o["kv_connector_output"] = kv_connector_output
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:  # vLLM 0.33 on
        o["req_id_to_index"] = {r.request_id: i for i, r in enumerate(running)}
    return ModelRunnerOutput(**o)


def _model_output(scheduler: Any, out: Any, connector: bool) -> Any:
    """What a worker would return for the step ``out`` scheduled: ``step_output`` with every store job of the step
    complete."""
    if not connector:
        return step_output(scheduler.running)
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.v1.outputs import KVConnectorOutput

    worker = OffloadingWorkerMetadata()
    for job in getattr(out.kv_connector_metadata, "store_jobs", {}):
        worker.mark_completed(job)
    return step_output(
        scheduler.running,
        KVConnectorOutput(
            finished_sending=set(), finished_recving=set(), invalid_block_ids=set(), kv_connector_worker_meta=worker
        ),
    )


def scheduler_steps(config: str, prompts: int, tokens: int) -> tuple[int, float]:
    """Steps vLLM's Scheduler through the no-reuse workload under ``config`` (see the module's text); returns the
    steps and the host milliseconds of ``schedule()`` + ``update_from_output()`` a step."""
    import tempfile

    limit = 100 * prompts * (tokens // SCHEDULER_BATCH + SCHEDULER_OUTPUT + 2)
    steps, seconds = 0, 0.0
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as model:
        scheduler = _scheduler(config, prompts, tokens, model)
        while scheduler.requests:
            t0 = time.perf_counter()
            out = scheduler.schedule()
            seconds += time.perf_counter() - t0
            output = _model_output(scheduler, out, config != "none")
            t0 = time.perf_counter()
            scheduler.update_from_output(out, output)
            seconds += time.perf_counter() - t0
            steps += 1
            if steps > limit:
                raise RuntimeError(f"{config}: the requests did not finish in {steps} steps")
    return steps, seconds * 1e3 / steps


def _best(fn: Any, reps: int = 5) -> float:
    import torch

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def _memcpy(nbytes: int) -> tuple[float, float]:
    """Seconds of a plain device -> pinned host copy of ``nbytes``, and back."""
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return _best(lambda: host.copy_(dev, non_blocking=True)), _best(lambda: dev.copy_(host, non_blocking=True))


# Whole: one measurement set up, timed and checked in the order it runs.
def _copies_row(name: str, tensors: list[Any], copy_method: str = "auto") -> dict[str, Any]:
    """One layout's row of ``copies()``."""
    import torch

    from kvtier.vllm.copy import ChunkCopier, byte_rows

    blocks = int(tensors[0].shape[0])
    copier = ChunkCopier(tensors, [list(range(len(tensors)))], num_chunks=blocks, copy_options={"method": copy_method})
    ids = list(range(blocks))
    total = blocks * sum(byte_rows(t, "t").shape[1] for t in tensors)

    def move(job: int, to_host: bool) -> None:
        copier.submit(job, to_host, ids, [blocks], [0], ids)
        copier.wait([job])
        copier.finished()

    try:
        store, load = _best(lambda: move(1, True)), _best(lambda: move(2, False))
        before = [t.clone() for t in tensors]
        for t in tensors:
            t.zero_()
        move(3, False)
        exact = all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True))
        del before
        d2h, h2d = _memcpy(total)
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def gemm_ms(beside: bool) -> float:
            torch.cuda.synchronize()
            if beside:
                copier.submit(4, True, ids, [blocks], [0], ids)
                copier.submit(5, False, ids, [blocks], [0], ids)
            e0.record()
            for _ in range(20):
                a @ a
            e1.record()
            torch.cuda.synchronize()
            if beside:
                copier.wait([4, 5])
                copier.finished()
            return float(e0.elapsed_time(e1))

        gemm_ms(False)
        # Alone and beside the copies in turn, so that clock drift between runs falls on both alike.
        pairs = [(gemm_ms(False), gemm_ms(True)) for _ in range(GEMM_PAIRS)]
        alone = statistics.median(a for a, _ in pairs)
        with_copies = statistics.median(w for _, w in pairs)
    finally:
        copier.close()
    return {
        "layout": name,
        "piece_bytes": int(tensors[0][0].numel() * tensors[0].element_size()),
        "gib": total / 2**30,
        "exact": exact,
        "store_gbs": total / store / 1e9,
        "memcpy_d2h_gbs": total / d2h / 1e9,
        "load_gbs": total / load / 1e9,
        "memcpy_h2d_gbs": total / h2d / 1e9,
        "gemm_ms": alone,
        "gemm_with_copies_ms": with_copies,
    }


def copies(blocks: int = 256, copy_method: str = "auto") -> list[dict[str, Any]]:
    """The copy half on CUDA, by ``copy_method``: one row a layout (see the module's text)."""
    import torch

    def blocks_first() -> list[Any]:
        return [torch.randn(blocks, 2, 64, 32, 128, device="cuda").to(torch.bfloat16) for _ in range(8)]

    def kv_halves() -> list[Any]:
        layers = [torch.randn(2, blocks, 16, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(8)]
        return [half for layer in layers for half in layer]

    def mla() -> list[Any]:
        return [torch.randn(blocks, 16, 576, device="cuda").to(torch.bfloat16) for _ in range(32)]

    rows = []
    for name, make in (
        ("blocks first [nb, 2, 64, 32, 128] bf16, 8 layers", blocks_first),
        ("K and V halves of [2, nb, 16, 8, 128] bf16, 8 layers", kv_halves),
        ("MLA [nb, 16, 576] bf16, 32 layers", mla),
    ):
        rows.append(_copies_row(name, make(), copy_method))
        torch.cuda.empty_cache()
    return rows


def _scheduler_table(prompts: int, tokens: int, repeat: int, as_json: bool) -> int:
    """``--scheduler``: each configuration in turn, ``repeat`` times (drift falls on all alike); the medians."""
    per_step: dict[str, list[float]] = {c: [] for c in SCHEDULER_CONFIGS}
    steps = 0
    for _ in range(repeat):
        for c in SCHEDULER_CONFIGS:
            steps, ms = scheduler_steps(c, prompts, tokens)
            per_step[c].append(ms)
    ms_per_step = {c: statistics.median(v) for c, v in per_step.items()}
    if as_json:
        print(json.dumps({"steps": steps, "ms_per_step": ms_per_step}, indent=2))
        return 0
    cells = ", ".join(f"{c} {v:.3f}" for c, v in ms_per_step.items())
    print(f"vLLM's Scheduler, {prompts} prompts of {tokens} distinct tokens, {steps} steps: host ms a "
          f"step (median of {repeat}): {cells}")  # fmt: skip
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from kvtier.tools.cli import parser, positive

    ap = parser("kvtier bench vllm", __doc__)
    ap.add_argument("--keys", type=positive(int), default=2048, help="keys stored, looked up and replaced")
    ap.add_argument("--repeat", type=positive(int), default=7, help="runs a manager; the median is reported")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--copies", action="store_true", help="measure the worker's copies on CUDA instead (no vLLM)")
    ap.add_argument("--scheduler", action="store_true", help="time vLLM's Scheduler a step instead (no-reuse prompts)")
    ap.add_argument("--prompts", type=positive(int), default=32, help="prompts of --scheduler")
    ap.add_argument("--tokens", type=positive(int), default=4096, help="tokens a prompt of --scheduler")
    ap.add_argument(
        "--copy-method", choices=("auto", "kernel", "dma"), default="auto", help="the copies' method (with --copies)"
    )
    args = ap.parse_args(argv)
    if args.copies and args.scheduler:
        ap.error("--copies and --scheduler are two other measurements: give one")
    if args.copies:
        import torch

        if not torch.cuda.is_available():
            ap.error("--copies needs a CUDA device")
        table = copies(copy_method=args.copy_method)
        if args.json:
            print(json.dumps(table, indent=2))
            return 0
        for r in table:
            print(
                f"{r['layout']}: pieces of {r['piece_bytes']} B, {r['gib']:.2f} GiB, exact={r['exact']}; "
                f"store {r['store_gbs']:.1f} GB/s ({r['store_gbs'] / r['memcpy_d2h_gbs']:.0%} of memcpy "
                f"{r['memcpy_d2h_gbs']:.1f}), load {r['load_gbs']:.1f} GB/s ({r['load_gbs'] / r['memcpy_h2d_gbs']:.0%} "
                f"of memcpy {r['memcpy_h2d_gbs']:.1f}); GEMM x20 {r['gemm_ms']:.1f} ms alone, "
                f"{r['gemm_with_copies_ms']:.1f} ms with a store and a load beside it"
            )
        return 0
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("kvtier bench vllm: error: needs vLLM 0.25.1 through 0.34 (pip install '.[vllm]' from kvtier's source)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.scheduler:
        return _scheduler_table(args.prompts, args.tokens, args.repeat, args.json)
    result = run(args.keys, args.repeat)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    base = result["vllm-lru"]
    print(f"{args.keys} keys, median of {args.repeat} runs (ms; in brackets: vLLM lru's time / this one's)")
    print(f"{'manager':<16}" + "".join(f"{step:>26}" for step in STEPS))
    for name, row in result.items():
        cells = "".join(f"{row[s]:>16.3f} ({base[s] / row[s]:>6.1f}x)" for s in STEPS)
        print(f"{name:<16}{cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
