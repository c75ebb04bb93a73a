"""`kvtier bench sglang`: SGLang HiCache's zero-copy calls through kvtier's backend against SGLang's own Mooncake one.

Needs SGLang (its storage interface, backend factory and host pools import on a CPU machine) and Mooncake. Starts a
Mooncake master and holder on loopback, builds one real SGLang host pool (``MHATokenToKVPoolHost``, page-first, on
the CPU; by default an 8B-class model's: pages of 64 tokens, 32 layers, 8 KV heads x 128, float16, 8 MiB a page) and
five backends through SGLang's own factory on that master: SGLang's Mooncake backend (``--hicache-storage-backend
mooncake``), and kvtier's (``dynamic`` with ``kvtier.sglang.KvtierStore``) four ways: "trusted"
(``l3_trusted_store`` and ``l3_zero_copy``: the mode SGLang's backend always runs in, a trusted network and the host
pool registered; objects still verified, with xxh3-128 digests), "zero-copy" (``l3_zero_copy`` with a ``hash_key``:
keyed BLAKE3 digests nobody without the key can forge), "staged" (kvtier's default with a ``hash_key``: only its
staging buffers registered) and "trusted staged" (``l3_trusted_store`` alone: each object gathered into a staging
buffer and put as one piece, what the staging copy costs or saves against zero-copy). Each round, every backend in
turn stores ``--pages`` fresh pages with ``batch_set_v1`` (the same host pages, keys of its own) and reads them back
into other host pages with ``batch_get_v1``; the bytes read are compared with those written. The calls come from one
I/O thread, as SGLang's cache controller makes them (its backup and prefetch threads, never the scheduler's own);
``--main-thread`` makes them from the main thread instead. The backends take turns going first, round by round.
Throughput is page bytes per second (GB/s, 1e9 bytes/s; kvtier's 80-byte headers not counted), medians over the
rounds. Run: ``kvtier bench sglang [--json]``.

``--shapes``: no backend, only a plain Mooncake client on the same kind of master and the same kind of host pool,
putting ``--pages`` pages and getting them into other pages (headers in a buffer of their own) in the shape of each
backend's objects: SGLang's
(two single-piece objects a page, ``batch_put_from`` / ``batch_get_into``) and kvtier's (one object a page of three
pieces, an 80-byte header then K and V, ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``), so what
the object shape costs in Mooncake itself is told apart from what the backends add.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import uuid
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

KVTIER_BACKEND = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore"}


def host_pool(
    *,
    mla: bool = False,
    layout: str = "page_first",
    pages: int = 64,
    page_size: int = 16,
    layers: int = 4,
    heads: int = 4,
    head_dim: int = 64,
    dtype: Any = None,
) -> Any:
    """A real SGLang host KV pool on the CPU (``MHATokenToKVPoolHost`` or, ``mla``, ``MLATokenToKVPoolHost``) of
    at least ``pages`` pages, built from CPU "device" buffers as SGLang's pool assembler builds it from GPU ones."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang warns on import that its GPU quantization kernels are absent
        from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dtype = dtype or torch.float16
    tokens = pages * page_size
    cpu = torch.device("cpu")

    def ptrs(ts: tuple[Any, ...]) -> Any:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    common = dict(pin_memory=False, device="cpu", device_capacity_tokens=tokens, start_layer=0, end_layer=layers)
    if mla:
        rows = tuple(torch.zeros(tokens, 1, head_dim, dtype=dtype) for _ in range(layers))
        info = MLABufferInfo(
            buffers=rows,
            data_ptrs=ptrs(rows),
            layer_indices=tuple(range(layers)),
            device_layer_num=layers,
            page_size=page_size,
            kv_lora_rank=head_dim - head_dim // 4,
            qk_rope_head_dim=head_dim // 4,
            kv_cache_dim=head_dim,
            dtype=dtype,
            device=cpu,
        )
        return MLATokenToKVPoolHost(info, 1.0, 0, page_size, layout, target_layer_num=layers, **common)
    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    buffers = KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD)
    mha = MHABufferInfo(
        buffers=buffers,
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=cpu,
    )
    return MHATokenToKVPoolHost(mha, 1.0, 0, page_size, layout, **common)


def storage_config(extra_config: dict[str, Any] | None, *, model_name: str = "bench-model", **ranks: Any) -> Any:
    """SGLang's ``HiCacheStorageConfig`` of one rank (rank 0 of 1 unless ``ranks`` say otherwise)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    fields: dict[str, Any] = dict(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model_name,
    )
    fields.update(ranks)
    return HiCacheStorageConfig(**fields, extra_config=extra_config)


def sglang_mooncake_config(master_addr: str) -> dict[str, Any]:
    """The extra config of SGLang's own Mooncake backend on a loopback master (no memory of its own)."""
    return {
        "master_server_address": master_addr,
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "device_name": "",
        "local_hostname": "127.0.0.1",
        "global_segment_size": 0,
    }


def backend_configs(master_addr: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """The benchmark's backends on the master at ``master_addr``: name -> (SGLang's backend name, extra config)."""
    kvtier = {**KVTIER_BACKEND, "interface_v1": 1, "model_version": "bench", "l3_master": master_addr}
    keyed = {**kvtier, "hash_key": "kvtier bench"}
    return {
        "sglang mooncake": ("mooncake", sglang_mooncake_config(master_addr)),
        "kvtier trusted": ("dynamic", {**kvtier, "l3_trusted_store": True, "l3_zero_copy": True}),
        "kvtier zero-copy": ("dynamic", {**keyed, "l3_zero_copy": True}),
        "kvtier staged": ("dynamic", keyed),
        "kvtier trusted staged": ("dynamic", {**kvtier, "l3_trusted_store": True}),
    }


def build(backend: str, extra_config: dict[str, Any], pool: Any, **ranks: Any) -> Any:
    """A backend built by SGLang's own factory, as its cache controller builds it, with the host pool registered.
    ``backend``: ``"dynamic"`` (the extra config names the class) or a built-in name such as ``"mooncake"``."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    config = storage_config(extra_config, **ranks)
    storage = StorageBackendFactory.create_backend(backend, config, pool)
    storage.register_mem_pool_host(pool)
    return storage


def page_bytes_of(pool: Any, index: int) -> Any:
    """The bytes of the host page at token ``index`` (compared as bytes: random float16 bits include NaNs)."""
    import torch

    return pool.get_data_page(index).contiguous().view(torch.uint8)


# Whole: one measurement set up, timed and checked in the order it runs.
def shapes(pool: Any, pages: int, rounds: int, segment_bytes: int) -> dict[str, dict[str, float]]:
    """Median seconds of a put and a get of ``pages`` pages of a SGLang host pool in each object shape, by a plain
    Mooncake client (see the module's text): pages ``0..pages`` are put, and got into pages ``pages..2 pages``."""
    import torch

    from kvtier._core import L3_HEADER_BYTES
    from kvtier.l3.store import import_mooncake
    from kvtier.tools.mooncake import LocalMooncake

    mc = import_mooncake()
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(2 * pages * pool.page_size))
    per = len(ptrs) // (2 * pages)  # pieces a page: K and V of a page-first MHA pool
    pieces = [list(zip(ptrs[i : i + per], sizes[i : i + per], strict=True)) for i in range(0, len(ptrs), per)]
    with LocalMooncake(segment_bytes=segment_bytes, lease_ttl_ms=10_000) as server:
        store = mc.MooncakeDistributedStore()
        if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", server.master_addr) != 0:
            raise RuntimeError("Mooncake setup failed")
        try:
            kv = pool.kv_buffer
            headers = torch.zeros(2 * pages * L3_HEADER_BYTES, dtype=torch.uint8)
            for b in (kv, headers):
                if store.register_buffer(b.data_ptr(), b.numel() * b.element_size()) != 0:
                    raise RuntimeError("Mooncake register_buffer failed")
            hdr = [headers.data_ptr() + p * L3_HEADER_BYTES for p in range(2 * pages)]
            put_pages, get_pages = range(pages), range(pages, 2 * pages)

            def sglang(keys: list[str]) -> tuple[Any, Any]:
                names = [f"{key}_{j}" for key in keys for j in range(per)]
                src = [a for p in put_pages for a, _ in pieces[p]]
                dst = [a for p in get_pages for a, _ in pieces[p]]
                lens = [n for p in put_pages for _, n in pieces[p]]
                return (lambda: store.batch_put_from(names, src, lens)), (
                    lambda: store.batch_get_into(names, dst, lens)
                )

            def kvtier(keys: list[str]) -> tuple[Any, Any]:
                src = [[hdr[p], *(a for a, _ in pieces[p])] for p in put_pages]
                dst = [[hdr[p], *(a for a, _ in pieces[p])] for p in get_pages]
                lens = [[L3_HEADER_BYTES, *(n for _, n in pieces[p])] for p in put_pages]
                return (lambda: store.batch_put_from_multi_buffers(keys, src, lens, mc.ReplicateConfig())), (
                    lambda: store.batch_get_into_multi_buffers(keys, dst, lens, False)
                )

            times: dict[str, list[tuple[float, float]]] = {"sglang shape": [], "kvtier shape": []}
            for r in range(rounds + 1):
                for name, make in (("sglang shape", sglang), ("kvtier shape", kvtier)):
                    kv.view(torch.uint8).random_(0, 256)  # fresh bytes, as the backends' rounds
                    put, get = make([uuid.uuid4().hex for _ in range(pages)])
                    t0 = time.perf_counter()
                    codes = list(put())
                    t1 = time.perf_counter()
                    got = list(get())
                    t2 = time.perf_counter()
                    if any(c != 0 for c in codes) or any(c <= 0 for c in got):
                        raise RuntimeError(f"{name}: put {codes[:4]}..., get {got[:4]}...")
                    if r:
                        times[name].append((t1 - t0, t2 - t1))
            return {
                name: {
                    "put_s": statistics.median(t[0] for t in ts),
                    "get_s": statistics.median(t[1] for t in ts),
                }
                for name, ts in times.items()
            }
        finally:
            store.close()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from kvtier.tools.cli import at_least, parser

    ap = parser("kvtier bench sglang", __doc__)
    ap.add_argument("--pages", type=at_least(1), default=16, help="pages a batch_set_v1 / batch_get_v1 call moves")
    ap.add_argument("--page-size", type=at_least(1), default=64, help="tokens a page")
    ap.add_argument("--layers", type=at_least(1), default=32, help="layers of the pool")
    ap.add_argument("--heads", type=at_least(1), default=8, help="KV heads of the pool")
    ap.add_argument("--head-dim", type=at_least(1), default=128, help="head dimension (float16)")
    ap.add_argument("--rounds", type=at_least(1), default=20, help="timed rounds")
    ap.add_argument(
        "--segment-mib",
        type=at_least(1),
        default=None,
        help="the holder's segment (default: what the run puts, nothing being removed during a run, with a fifth to "
        "spare; a smaller one is refused)",
    )
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--shapes", action="store_true", help="the object shapes in plain Mooncake, no backend")
    ap.add_argument(
        "--main-thread", action="store_true", help="call the backends from the main thread, not from an I/O thread"
    )
    a = ap.parse_args(argv)
    if a.shapes and a.main_thread:
        ap.error("--main-thread chooses the backends' caller; --shapes calls plain Mooncake, no backend")
    return a


def segment_mib(a: argparse.Namespace, page_bytes: int, copies: int) -> int:
    """The holder's segment of a run: every round (and the warm-up) puts each page ``copies`` times, once a
    backend or object shape, and nothing is removed; Mooncake needs room beyond the bytes it holds. Raises
    ValueError when ``--segment-mib`` is too small for that."""
    from kvtier._core import L3_HEADER_BYTES
    from kvtier.tools.mooncake import segment_mib_for

    return segment_mib_for(copies * (a.rounds + 1) * a.pages * (page_bytes + L3_HEADER_BYTES), a.segment_mib)


def _round(storage: Any, keys: list[str], src: Any, dst: Any) -> tuple[float, float, bool]:
    t0 = time.perf_counter()
    put = storage.batch_set_v1(keys, src)
    t1 = time.perf_counter()
    got = storage.batch_get_v1(keys, dst)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, all(put) and all(got)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        import torch

        from kvtier.l3.store import import_mooncake
        from kvtier.tools.mooncake import LocalMooncake

        import_mooncake()
        pool = host_pool(pages=2 * a.pages, page_size=a.page_size, layers=a.layers, heads=a.heads, head_dim=a.head_dim)
    except ImportError as e:
        print(f"kvtier bench sglang: needs SGLang and Mooncake ({e})", file=sys.stderr)
        return 2
    page_bytes = sum(pool.get_page_buffer_meta(torch.arange(a.page_size))[1])
    try:
        segment = segment_mib(a, page_bytes, 2 if a.shapes else len(backend_configs("")))  # --shapes: two shapes
    except ValueError as e:
        print(f"kvtier bench sglang: {e}", file=sys.stderr)
        return 2
    if a.shapes:
        return _print_shapes(a, pool, segment)
    tokens = a.pages * a.page_size
    src, dst = torch.arange(tokens), torch.arange(tokens, 2 * tokens)
    results: dict[str, Any] = {}
    with (
        LocalMooncake(segment_bytes=segment << 20, lease_ttl_ms=10_000) as server,
        ThreadPoolExecutor(1, thread_name_prefix="storage-io") as io,
    ):
        backends = {
            name: build(kind, config, pool) for name, (kind, config) in backend_configs(server.master_addr).items()
        }
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in backends}
        order = list(backends.items())
        for r in range(a.rounds + 1):  # round 0 warms every path up and is not timed
            for name, storage in order[r % len(order) :] + order[: r % len(order)]:  # each first in turn
                pool.kv_buffer.view(torch.uint8).random_(0, 256)  # fresh bytes: a stale page cannot pass
                keys = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(a.pages)]
                call = (storage, keys, src, dst)
                put_s, get_s, ok = _round(*call) if a.main_thread else io.submit(_round, *call).result()
                same = all(
                    torch.equal(page_bytes_of(pool, int(s)), page_bytes_of(pool, int(d)))
                    for s, d in zip(src[:: a.page_size], dst[:: a.page_size], strict=True)
                )
                if not (ok and same):
                    print(f"kvtier bench sglang: {name} did not round-trip the pages (round {r})", file=sys.stderr)
                    return 1
                if r:
                    times[name].append((put_s, get_s))
        for name, storage in backends.items():
            put = statistics.median(t[0] for t in times[name])
            get = statistics.median(t[1] for t in times[name])
            results[name] = {
                "batch_set_v1_GBps": round(a.pages * page_bytes / put / 1e9, 3),
                "batch_get_v1_GBps": round(a.pages * page_bytes / get / 1e9, 3),
            }
            if hasattr(storage, "stats"):
                results[name]["rejected"] = storage.stats()["l3_rejected"]
            if hasattr(storage, "close"):
                storage.close()
    return _report(a, results, page_bytes)


def _report(a: argparse.Namespace, results: dict[str, Any], page_bytes: int) -> int:
    """Prints each backend's rates and their ratios to SGLang's own backend (one JSON object with --json)."""
    base = results["sglang mooncake"]
    for r in results.values():
        for op in ("batch_set_v1_GBps", "batch_get_v1_GBps"):
            r[op.replace("_GBps", "_vs_sglang")] = round(r[op] / base[op], 3)
    out = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {platform.node()}",
        "pages": a.pages,
        "page_bytes": page_bytes,
        "rounds": a.rounds,
        "caller": "main thread" if a.main_thread else "I/O thread",
        "results": results,
    }
    if a.json:
        print(json.dumps(out))
        return 0
    print(
        f"{a.pages} pages of {page_bytes} bytes a call from {out['caller']}, medians of {a.rounds} rounds "
        "(GB/s; ratio to SGLang's):"
    )
    print(f"{'backend':<22}{'batch_set_v1':>16}{'batch_get_v1':>16}")
    for name, r in results.items():
        cells = [f"{r[f'{op}_GBps']:.3f} ({r[f'{op}_vs_sglang']:.2f})" for op in ("batch_set_v1", "batch_get_v1")]
        print(f"{name:<22}{cells[0]:>16}{cells[1]:>16}")
    return 0


def _print_shapes(a: argparse.Namespace, pool: Any, segment: int) -> int:
    result = shapes(pool, a.pages, a.rounds, segment << 20)
    base = result["sglang shape"]
    for r in result.values():
        r["put_vs_sglang"] = round(base["put_s"] / r["put_s"], 3)
        r["get_vs_sglang"] = round(base["get_s"] / r["get_s"], 3)
    if a.json:
        print(json.dumps({"pages": a.pages, "rounds": a.rounds, "results": result}))
        return 0
    print(f"{a.pages} pages of a SGLang host pool a call, plain Mooncake, medians of {a.rounds} rounds (ms; ratio):")
    for name, r in result.items():
        print(
            f"{name:<14} put {r['put_s'] * 1e3:7.2f} ({r['put_vs_sglang']:.2f})   "
            f"get {r['get_s'] * 1e3:7.2f} ({r['get_vs_sglang']:.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
