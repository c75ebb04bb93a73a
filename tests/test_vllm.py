"""kvtier under vLLM's offloading connector (kvtier.vllm): vLLM's own config classes, KV cache planner and
offloading factory build the spec from the one config line, as the installed release's connector does; the manager
is driven as vLLM's scheduler drives it; the worker round-trips KV bytes on CPU tensors, in this process and in a
separate worker process; kvtier's Mooncake tier runs under vLLM's tiering spec.

Needs vLLM 0.25.1 through 0.34 (its own venv: .ci/vllm); skipped where vLLM is not importable.
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import json
import logging
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HAVE_VLLM = find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (see .ci/vllm)")

# The one line, as a user passes it to `--kv-transfer-config`.
ONE_LINE = (
    '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": '
    '{"spec_name": "KvtierSpec", "spec_module_path": "kvtier.vllm", "cpu_bytes_to_use": 1048576}}'
)

PAGE = 256  # bytes of one block of one KV tensor in these tests
LAYERS = 3
GPU_BLOCKS = 32
BLOCK_TOKENS = 16


def test_import_kvtier_never_imports_vllm() -> None:
    code = "import sys, kvtier, kvtier.copy, kvtier.settings; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


if HAVE_VLLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        from vllm.config import KVTransferConfig
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
            GPULoadStoreSpec,
            LookupResult,
            OffloadKey,
            ReqContext,
            make_offload_key,
        )
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        import kvtier.vllm as kv
        import kvtier.vllm.release as release

        try:  # where the release's KV cache planner lives (0.33 moved it)
            from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
        except ImportError:
            from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
        try:  # vLLM 0.26 on: the connector builds an OffloadingConfig and the spec from it
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
        except ImportError:  # vLLM 0.25: the spec is built from the VllmConfig and the KVCacheConfig
            build_offloading_config = None

    pytestmark = [needs_vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
else:
    pytestmark = [needs_vllm]

# A model config vLLM's ModelConfig reads (no weights: nothing here runs the model).
TINY_OPT = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "ffn_dim": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 64,
    "do_layer_norm_before": True,
    "torch_dtype": "float16",
    "pad_token_id": 1,
    "bos_token_id": 2,
    "eos_token_id": 2,
}
_MODEL_DIR: list[str] = []


def model_dir() -> str:
    """A directory with TINY_OPT's config.json, made once a process."""
    if not _MODEL_DIR:
        path = tempfile.mkdtemp(prefix="kvtier-vllm-model-")
        atexit.register(shutil.rmtree, path, True)
        Path(path, "config.json").write_text(json.dumps(TINY_OPT))
        _MODEL_DIR.append(path)
    return _MODEL_DIR[0]


def vllm_config(line: str = ONE_LINE, *, world_size: int = 1, rank: int = 0, events: bool = False) -> Any:
    """vLLM's VllmConfig for the tiny model with the `--kv-transfer-config` line (parsed by vLLM's KVTransferConfig),
    ``world_size`` tensor-parallel ranks, this process being ``rank``."""
    from vllm.config import CacheConfig, DeviceConfig, KVEventsConfig, ModelConfig, ParallelConfig, VllmConfig

    transfer = KVTransferConfig(**json.loads(line))
    assert transfer.kv_connector == "OffloadingConnector"
    config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir(), dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=512
        ),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=world_size),
        kv_transfer_config=transfer,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=events, publisher="null"),
        device_config=DeviceConfig("cpu"),
    )
    config.parallel_config.rank = rank
    if hasattr(config.cache_config, "kv_cache_layout"):
        # vLLM 0.30 on: the layout the engine core resolves from what the workers' attention backends support
        # (FlashAttention's layer-major one here), which build_offloading_config reads.
        config.cache_config.kv_cache_layout = "LBNHC"
    return config


def attention_spec(page: int = PAGE) -> Any:
    """vLLM's full-attention KV spec of one float16 KV head whose block takes ``page`` bytes a layer."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=page // (2 * BLOCK_TOKENS * 2), dtype=torch.float16
    )
    assert spec.page_size_bytes == page
    return spec


def kv_cache_config(
    config: Any, *, groups: int = 1, layers: int = LAYERS, page: int = PAGE, blocks: int = GPU_BLOCKS
) -> Any:
    """vLLM's KVCacheConfig as its planner lays ``groups`` KV cache groups of ``layers`` layers out over ``blocks``
    GPU blocks (several groups share one allocation, as a hybrid model's do)."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    spec = attention_spec(page)
    specs = [KVCacheGroupSpec([f"g{g}.layer{i}" for i in range(layers)], spec) for g in range(groups)]
    config.cache_config.num_gpu_blocks_override = blocks
    kvc = get_kv_cache_config_from_groups(config, specs, blocks * page * layers)
    assert kvc.num_blocks == blocks
    return kvc


def connector_spec(config: Any, kvc: Any) -> Any:
    """The spec this release's OffloadingConnector builds: from build_offloading_config's OffloadingConfig (0.26 on),
    from the VllmConfig and the KVCacheConfig (0.25)."""
    if build_offloading_config is not None:
        return OffloadingSpecFactory.create_spec(build_offloading_config(config, kvc))
    return OffloadingSpecFactory.create_spec(config, kvc)


def spec_from_line(
    line: str = ONE_LINE,
    *,
    blocks_per_chunk: int = 1,
    groups: int = 1,
    layers: int = LAYERS,
    page: int = PAGE,
    world_size: int = 1,
    rank: int = 0,
    events: bool = False,
) -> Any:
    """The spec vLLM's factory builds from a `--kv-transfer-config` line for the tiny model's KV caches; chunks of
    ``blocks_per_chunk`` blocks through the extra config's ``block_size`` (tokens a chunk), as a user asks for them."""
    if blocks_per_chunk != 1:
        parsed = json.loads(line)
        parsed["kv_connector_extra_config"]["block_size"] = BLOCK_TOKENS * blocks_per_chunk
        line = json.dumps(parsed)
    config = vllm_config(line, world_size=world_size, rank=rank, events=events)
    return connector_spec(config, kv_cache_config(config, groups=groups, layers=layers, page=page))


def key(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), group)


def kv_caches(num_blocks: int = GPU_BLOCKS, layers: int = LAYERS, groups: int = 1, seed: int = 0) -> Any:
    """CPU KV caches in vLLM's canonical form: one int8 [num_blocks, page] tensor a layer, random bytes; with
    several groups every group's layers use all the tensors (hybrid models share one allocation)."""
    g = torch.Generator().manual_seed(seed)
    tensors = [
        CanonicalKVCacheTensor(
            tensor=torch.randint(-128, 128, (num_blocks, PAGE), dtype=torch.int8, generator=g), page_size_bytes=PAGE
        )
        for _ in range(layers)
    ]
    refs = [[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in range(layers)] for _ in range(groups)]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def block_bytes(caches: Any, block: int) -> list[bytes]:
    return [t.tensor[block].numpy().tobytes() for t in caches.tensors]


def finish(worker: Any, job_ids: set[int]) -> None:
    worker.wait(job_ids)
    results = {r.job_id: r for r in worker.get_finished()}
    assert set(results) == job_ids
    assert all(r.success for r in results.values())
    # vLLM's transfer metrics record each job's bytes and seconds.
    assert all(r.transfer_size > 0 and r.transfer_time is not None and r.transfer_time >= 0 for r in results.values())


# ---- the factory and the settings -----------------------------------------------------------------------------


def test_vllms_factory_builds_kvtiers_spec_manager_and_worker_from_the_one_line() -> None:
    spec = spec_from_line()
    assert type(spec) is kv.KvtierSpec
    # What kvtier read of the configuration, whichever the release built the spec from.
    layout = spec.layout
    assert (layout.groups, layout.worker_kv_bytes_per_block, layout.blocks_per_chunk) == (((0, 16, 3),), 768, 1)
    assert (layout.model_name, layout.model_dtype, layout.world_size) == (model_dir(), "float16", 1)
    # 1 MiB over chunks of 3 layers x 256 bytes.
    assert spec.num_chunks == (1 << 20) // (PAGE * LAYERS)
    manager = spec.get_manager()
    assert isinstance(manager, kv.KvtierManager)
    assert manager.index.page_slots == spec.num_chunks
    assert manager.index.eviction_policy == "lru"
    (info,) = manager.config_info()
    if release.CPUOffloadingInfo is not None:  # vLLM 0.33 on: the config-info metric
        assert info["cpu_num_chunks"] == spec.num_chunks
    else:
        assert info == {}
    worker = spec.get_worker(kv_caches())
    assert isinstance(worker, kv.KvtierWorker)
    assert worker.host_view().shape == (spec.num_chunks, PAGE * LAYERS)
    assert spec.get_worker(kv_caches()) is worker  # one worker a spec, as vLLM's CPU spec
    worker.shutdown()


def test_kvtier_settings_come_from_the_extra_config() -> None:
    line = json.loads(ONE_LINE)
    line["kv_connector_extra_config"].update(
        host_bytes="64KiB", eviction_policy="adaptive", copy_method="kernel", copy_piece_bytes="2MiB"
    )
    spec = spec_from_line(json.dumps(line))
    assert spec.num_chunks == (64 << 10) // (PAGE * LAYERS)  # host_bytes wins over cpu_bytes_to_use
    assert spec.get_manager().index.eviction_policy == "adaptive"
    assert spec.settings.copy_method == "kernel"
    # The copy settings reach the worker's page copiers.
    worker = spec.get_worker(kv_caches())
    assert {(c.method, c.piece_bytes) for c in worker.copier.copiers} == {("kernel", 2 << 20)}
    worker.shutdown()


def test_tensor_parallel_ranks_divide_the_host_bytes() -> None:
    spec = spec_from_line(world_size=4, rank=2)
    assert spec.num_chunks == (1 << 20) // (PAGE * LAYERS * 4)
    spec = spec_from_line(blocks_per_chunk=4)
    assert spec.num_chunks == (1 << 20) // (PAGE * LAYERS * 4)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"eviction_policy": "arc"}, "arc"),
        ({"host_bytes": "lots"}, "lots"),
        ({"cpu_bytes_to_use": 100}, "host_bytes=100 holds no chunk of 768 bytes"),
        ({"cpu_bytes_to_use": [1]}, r"cpu_bytes_to_use must be a number of bytes, got \[1\]"),
        ({"copy_method": "fast"}, "fast"),
        # More than any machine has: refused before anything is pinned, as the cache refuses it.
        ({"host_bytes": "1024GiB"}, r"setting host_bytes=1099511627776 needs \d+ bytes .* this machine has"),
    ],
)
def test_bad_settings_are_refused_naming_the_value(extra: dict[str, Any], message: str) -> None:
    line = json.loads(ONE_LINE)
    line["kv_connector_extra_config"].update(extra)
    with pytest.raises(ValueError, match=message):
        spec_from_line(json.dumps(line))


def test_other_vllm_versions_are_refused_naming_the_range() -> None:
    for version in ("0.25.1", "0.25.2", "0.30.0", "0.33.0", "0.33.2rc1", "0.34.0", "0.34.1"):
        kv.check_vllm_version(version)
    for version in ("0.25.0", "0.24.3", "0.35.0", "1.0", "unknown"):
        with pytest.raises(ImportError, match=r"vLLM >=0\.25\.1,<0\.35.*" + re.escape(repr(version))):
            kv.check_vllm_version(version)
    assert kv.SUPPORTED_VLLM == ">=0.25.1,<0.35"


# ---- the manager, driven as vLLM's scheduler drives it --------------------------------------------------------


def allocations(stats: Any) -> tuple[int, int] | None:
    """The count and sum of vLLM's allocation-size histogram in a manager's ``get_stats()``; None where the release
    defines no such histogram (before 0.26), and then the statistics have none."""
    reduced = stats.reduce()
    assert release.CPU_METRICS.CPU_CACHE_USAGE_PERC in reduced
    if not release.HAS_WRITE_READ_USAGE:
        assert not any("allocation" in name for name in reduced), reduced
        return None
    name = release.CPU_METRICS.CPU_ALLOCATION_SIZE
    return int(reduced.get(f"{name}_count", 0)), int(reduced.get(f"{name}_sum", 0))


def histogram(count: int, total: int) -> tuple[int, int] | None:
    """What ``allocations`` reads in this release for ``count`` calls asking for ``total`` slots."""
    return (count, total) if release.HAS_WRITE_READ_USAGE else None


def test_the_manager_stores_loads_and_evicts_as_vllms_scheduler_expects() -> None:
    spec = spec_from_line(
        """{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KvtierSpec", "spec_module_path": "kvtier.vllm",
        "cpu_bytes_to_use": 3072}}""",
        events=True,
    )
    manager = spec.get_manager()
    assert manager.num_slots == 4
    ctx = ReqContext(req_id="r1")
    manager.on_new_request(ctx)
    a, b, c, d, e = (key(i) for i in range(5))
    assert manager.lookup(a, ctx) is LookupResult.MISS

    out = manager.prepare_store([a, b, c], ctx)
    assert out is not None and out.keys_to_store == [a, b, c] and out.evicted_keys == []
    slots = out.store_spec.block_ids.tolist()
    assert sorted(slots) == sorted(set(slots)) and all(0 <= s < 4 for s in slots)
    assert manager.lookup(a, ctx) is LookupResult.HIT_PENDING
    stats = manager.get_stats()
    assert stats is not None
    assert allocations(stats) == histogram(1, 3)  # vLLM's histogram of the slots each prepare_store asked for
    manager.complete_store({a, b, c}, ctx)  # vLLM reports a job's keys as a set
    assert [manager.lookup(k, ctx) for k in (a, b, c, d)] == [LookupResult.HIT] * 3 + [LookupResult.MISS]

    # Stored keys are skipped; a ready one offered again is held by the call, never evicted by it.
    out = manager.prepare_store([a, d], ctx)
    assert out is not None and out.keys_to_store == [d] and out.evicted_keys == []
    manager.complete_store([d], ctx)

    load = manager.prepare_load([a, b], ctx)
    assert load.block_ids.tolist() == slots[:2]
    # The pool is full; a and b are held by the load: the store evicts the least recently used of c and d.
    out = manager.prepare_store([e], ctx)
    assert out is not None and out.keys_to_store == [e] and len(out.evicted_keys) == 1
    evicted = out.evicted_keys[0]
    assert evicted in (c, d)
    assert manager.lookup(evicted, ctx) is LookupResult.MISS
    manager.complete_store([e], ctx)
    # Everything left is held or pending: no room, nothing changes.
    manager.prepare_load([e], ctx)
    survivor = d if evicted == c else c
    manager.prepare_load([survivor], ctx)
    assert manager.prepare_store([key(9)], ctx) is None
    assert allocations(manager.get_stats()) == histogram(3, 3)  # d, e and the refused key(9)
    assert allocations(manager.get_stats()) == histogram(0, 0)
    manager.complete_load([a, b], ctx)
    manager.complete_load([e], ctx)
    manager.complete_load([survivor], ctx)
    manager.on_request_finished(ctx)

    events = list(manager.take_events())
    assert all(ev.medium == release.MEDIUM_CPU for ev in events)
    stored = [k for ev in events if not ev.removed for k in ev.keys]
    removed = [k for ev in events if ev.removed for k in ev.keys]
    assert sorted(stored) == sorted([a, b, c, d, e]) and removed == [evicted]
    assert list(manager.take_events()) == []

    s = manager.stats()
    assert (s["pages_stored"], s["pages_evicted"]) == (5, 1)
    # Each one-key lookup counts as a lookup of one slot's tokens; the class's lookup answers as the instance's.
    assert (s["lookups"], s["lookup_tokens"]) == (7, 7 * 16)
    assert [kv.KvtierManager.lookup(manager, k, ctx) for k in (a, evicted)] == [LookupResult.HIT, LookupResult.MISS]
    assert manager.lookup(key=a, req_context=ctx) is LookupResult.HIT
    with pytest.raises(ValueError, match="65 bytes"):
        manager.lookup(b"x" * 65, ctx)
    manager.reset_cache()
    assert manager.lookup(a, ctx) is LookupResult.MISS
    assert manager.index.stats()["pages_used"] == 0


def test_a_failed_store_leaves_nothing_loadable_and_frees_its_slots() -> None:
    manager = spec_from_line().get_manager()
    ctx = ReqContext(req_id="r")
    out = manager.prepare_store([key(1), key(2)], ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx, success=False)
    assert manager.lookup(key(1), ctx) is LookupResult.MISS
    assert manager.index.stats()["pages_used"] == 0


def test_overlapping_loads_hold_their_pages_until_each_completes() -> None:
    spec = spec_from_line(
        '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config":'
        ' {"spec_name": "KvtierSpec", "spec_module_path": "kvtier.vllm", "cpu_bytes_to_use": 1536}}'
    )
    manager = spec.get_manager()  # 2 slots
    ctx = ReqContext(req_id="r")
    out = manager.prepare_store([key(1), key(2)], ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    manager.prepare_load([key(1), key(2)], ctx)
    manager.prepare_load([key(1)], ctx)
    manager.complete_load([key(1)], ctx)
    manager.complete_load([key(1), key(2)], ctx)
    # Both loads done: both pages can go.
    out = manager.prepare_store([key(3), key(4)], ctx)
    assert out is not None and sorted(out.evicted_keys) == [key(1), key(2)]
    with pytest.raises(ValueError, match="has no load in flight"):
        manager.complete_load([key(1)], ctx)


# ---- the worker: KV bytes through kvtier's host pool ----------------------------------------------------------


def test_worker_round_trips_kv_bytes_through_the_slots_the_manager_chose() -> None:
    spec = spec_from_line()
    manager, caches = spec.get_manager(), kv_caches()
    worker = spec.get_worker(caches)
    ctx = ReqContext(req_id="r")
    keys = [key(i) for i in range(6)]
    src_blocks = [3, 7, 1, 30, 12, 5]
    expected = [block_bytes(caches, b) for b in src_blocks]

    out = manager.prepare_store(keys, ctx)
    assert out is not None
    assert worker.submit_store(1, GPULoadStoreSpec(src_blocks, group_sizes=[6], block_indices=[0]), out.store_spec)
    finish(worker, {1})
    manager.complete_store(out.keys_to_store, ctx)
    # The host slot the manager chose holds the block's layers back to back.
    host = worker.host_view()
    for slot, want in zip(out.store_spec.block_ids.tolist(), expected, strict=True):
        assert host[slot].tobytes() == b"".join(want)

    for t in caches.tensors:  # the GPU blocks are reused by other requests
        t.tensor.zero_()
    dst_blocks = [20, 21, 22, 0, 2, 4]
    load = manager.prepare_load(keys, ctx)
    assert worker.submit_load(2, load, GPULoadStoreSpec(dst_blocks, group_sizes=[6], block_indices=[0]))
    finish(worker, {2})
    manager.complete_load(keys, ctx)
    assert [block_bytes(caches, b) for b in dst_blocks] == expected
    assert all(not t.tensor[8].any() for t in caches.tensors), "a block outside the load was written"
    worker.shutdown()


def test_worker_handles_chunks_of_several_blocks_and_several_kv_groups() -> None:
    # Chunks of 2 blocks; 2 KV groups over one allocation (a hybrid model); the first group's first block starts
    # in the middle of a chunk (block index 1), as vLLM's GPU spec says with block_indices.
    spec = spec_from_line(blocks_per_chunk=2, groups=2)
    manager, caches = spec.get_manager(), kv_caches(groups=2, seed=3)
    worker = spec.get_worker(caches)
    ctx = ReqContext(req_id="r")
    keys = [key(1, 0), key(2, 0), key(1, 1)]
    out = manager.prepare_store(keys, ctx)
    assert out is not None and len(out.store_spec.block_ids) == 3
    g0, g1 = [4, 9, 10], [17, 18]
    expected = [block_bytes(caches, b) for b in g0 + g1]
    src = GPULoadStoreSpec(g0 + g1, group_sizes=[3, 2], block_indices=[1, 0])
    worker.submit_store(5, src, out.store_spec)
    finish(worker, {5})
    manager.complete_store(out.keys_to_store, ctx)
    for t in caches.tensors:
        t.tensor.zero_()
    load = manager.prepare_load(keys, ctx)
    d0, d1 = [0, 1, 2], [3, 6]
    worker.submit_load(6, load, GPULoadStoreSpec(d0 + d1, group_sizes=[3, 2], block_indices=[1, 0]), expedited=True)
    finish(worker, {6})
    assert [block_bytes(caches, b) for b in d0 + d1] == expected
    worker.shutdown()


def test_worker_refuses_specs_that_do_not_match_naming_them() -> None:
    spec = spec_from_line()
    worker = spec.get_worker(kv_caches())
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    with pytest.raises(ValueError, match=r"chunk ids \[99999\] of group 0 are outside"):
        worker.submit_store(1, GPULoadStoreSpec([1], group_sizes=[1], block_indices=[0]), CPULoadStoreSpec([99999]))
    with pytest.raises(ValueError, match="the specs do not match: 1 GPU blocks and 2 chunks"):
        worker.submit_store(1, GPULoadStoreSpec([1], group_sizes=[1], block_indices=[0]), CPULoadStoreSpec([0, 1]))
    with pytest.raises(ValueError, match=r"2 KV groups \(2 block indices\), the KV caches 1"):
        worker.submit_store(
            1, GPULoadStoreSpec([1, 2], group_sizes=[1, 1], block_indices=[0, 0]), CPULoadStoreSpec([0])
        )
    with pytest.raises(TypeError, match="GPULoadStoreSpec"):
        worker.submit_store(1, CPULoadStoreSpec([1]), CPULoadStoreSpec([0]))
    assert worker.get_finished() == []
    worker.shutdown()
    odd = kv_caches()
    odd.tensors[0] = CanonicalKVCacheTensor(tensor=torch.zeros(GPU_BLOCKS, 100, dtype=torch.int8), page_size_bytes=100)
    with pytest.raises(ValueError, match="has 100 bytes a block"):
        kv.KvtierWorker(odd, num_chunks=4)


def test_worker_maps_vllm_034_device_pointers_back_to_blocks() -> None:
    try:
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers
    except ImportError:
        pytest.skip("this vLLM (before 0.34) hands the worker block ids, not device pointers")
    spec = spec_from_line(groups=2)
    manager, caches = spec.get_manager(), kv_caches(groups=2, seed=5)
    worker = spec.get_worker(caches)
    ctx = ReqContext(req_id="r")
    keys = [key(1, 0), key(2, 0), key(1, 1)]
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    src = GPULoadStoreSpec([4, 9, 17], group_sizes=[2, 1], block_indices=[0, 0])
    expected = [block_bytes(caches, b) for b in (4, 9, 17)]
    # vLLM 0.34's connector resolves the GPU spec to device pointers before calling the worker.
    worker.submit_store(1, resolve_device_pointers(src, caches), out.store_spec)
    finish(worker, {1})
    manager.complete_store(out.keys_to_store, ctx)
    for t in caches.tensors:
        t.tensor.zero_()
    dst = GPULoadStoreSpec([0, 1, 2], group_sizes=[2, 1], block_indices=[0, 0])
    worker.submit_load(2, manager.prepare_load(keys, ctx), resolve_device_pointers(dst, caches))
    finish(worker, {2})
    assert [block_bytes(caches, b) for b in (0, 1, 2)] == expected
    bad = resolve_device_pointers(dst, caches)
    bad.ptrs[0] += 1
    with pytest.raises(ValueError, match="device pointers of data ref 0 are not blocks of its tensor"):
        worker.submit_store(3, bad, out.store_spec)
    worker.shutdown()


# ---- vLLM's process split: the manager here, the worker in a process of its own ------------------------------


def _worker_process(conn: Any, rank: int) -> None:
    """A vLLM worker process: builds the spec from the same line, gets only the specs' block ids from the
    scheduler process, stores, then loads into other blocks and reports whether the bytes came back."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = spec_from_line(world_size=2, rank=rank)
    caches = kv_caches(seed=10 + rank)
    worker = spec.get_worker(caches)
    (src, store_spec) = conn.recv()
    expected = [block_bytes(caches, b) for b in src.block_ids.tolist()]
    worker.submit_store(1, src, store_spec)
    finish(worker, {1})
    conn.send("stored")
    for t in caches.tensors:
        t.tensor.zero_()
    (dst, load_spec) = conn.recv()
    worker.submit_load(2, load_spec, dst)
    finish(worker, {2})
    conn.send([block_bytes(caches, b) for b in dst.block_ids.tolist()] == expected)
    worker.shutdown()


def test_manager_and_workers_in_separate_processes_share_only_block_ids() -> None:
    spec = spec_from_line(world_size=2, rank=0)
    manager = spec.get_manager()
    ctx = ReqContext(req_id="r")
    mp = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    env = dict(os.environ)
    try:
        for rank in range(2):
            mine, theirs = mp.Pipe()
            p = mp.Process(target=_worker_process, args=(theirs, rank))
            p.start()
            pipes.append(mine)
            procs.append(p)
        keys = [key(i) for i in range(4)]
        out = manager.prepare_store(keys, ctx)
        assert out is not None
        src = GPULoadStoreSpec([2, 4, 6, 8], group_sizes=[4], block_indices=[0])
        for conn in pipes:
            conn.send((src, out.store_spec))
        for conn in pipes:
            assert conn.recv() == "stored"
        manager.complete_store(out.keys_to_store, ctx)
        load = manager.prepare_load(keys, ctx)
        dst = GPULoadStoreSpec([11, 12, 13, 14], group_sizes=[4], block_indices=[0])
        for conn in pipes:
            conn.send((dst, load))
        assert [conn.recv() for conn in pipes] == [True, True]
        manager.complete_load(keys, ctx)
    finally:
        for p in procs:
            p.join(timeout=300)  # a loaded 2-core machine starts and ends them slowly
            if p.is_alive():
                p.kill()
        os.environ.clear()
        os.environ.update(env)
    assert [p.exitcode for p in procs] == [0, 0]


def test_index_hits_equal_the_keys_vllms_lookup_walk_finds() -> None:
    manager = spec_from_line().get_manager()
    ctx = ReqContext(req_id="r")
    keys = [key(i) for i in range(10)]
    out = manager.prepare_store(keys[:6], ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    walk = 0
    for k in keys:  # the scheduler looks up key by key until a miss
        if manager.lookup(k, ctx) is not LookupResult.HIT:
            break
        walk += 1
    assert walk == 6
    assert manager.index.lookup_keys(keys) == (6, False)
    assert np.array_equal(manager.prepare_load(keys[:6], ctx).block_ids, out.store_spec.block_ids)


# ---- vLLM's own scheduler and connector, with the one line in a VllmConfig ------------------------------------


class Engine:
    """vLLM's scheduler (with the OffloadingConnector's scheduler side) and a worker's OffloadingConnector over one
    CPU KV cache, stepped as vLLM's engine core steps them; the model's forward pass is left out (its KV bytes are
    whatever the blocks hold)."""

    BLOCK = 16
    BLOCKS = 64
    HEAD = 4

    def __init__(self, model_dir: str, line: str = ONE_LINE, batched_tokens: int = 256) -> None:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVEventsConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
            set_current_vllm_config,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        cache = CacheConfig(block_size=self.BLOCK, enable_prefix_caching=True)
        if hasattr(cache, "kv_cache_layout"):  # vLLM 0.30 on: the layout the worker resolved, read by the connector
            cache.kv_cache_layout = "LBNHC"
        self.config = VllmConfig(
            model_config=ModelConfig(model=model_dir, dtype="float16", seed=0, skip_tokenizer_init=True),
            scheduler_config=SchedulerConfig(
                max_num_seqs=4,
                max_num_batched_tokens=batched_tokens,
                max_model_len=1024,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            cache_config=cache,
            kv_transfer_config=KVTransferConfig(**json.loads(line)),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
            device_config=DeviceConfig("cpu"),
        )
        self.config.scheduler_config.async_scheduling = False
        spec = FullAttentionSpec(block_size=self.BLOCK, num_kv_heads=1, head_size=self.HEAD, dtype=torch.float32)
        # vLLM's planner lays the one layer's KV cache out (its KVCacheTensor fields differ between releases).
        self.config.cache_config.num_gpu_blocks_override = self.BLOCKS
        kv_config = get_kv_cache_config_from_groups(
            self.config, [KVCacheGroupSpec(["layer"], spec)], spec.page_size_bytes * self.BLOCKS
        )
        assert kv_config.num_blocks == self.BLOCKS
        self.config.cache_config.num_gpu_blocks = self.BLOCKS
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, self.config)
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=kv_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=block_size,
            hash_block_size=hash_block_size,
        )
        self.worker = OffloadingConnector(self.config, KVConnectorRole.WORKER, kv_config)
        # FlashAttention's layout, [num_blocks, 2, block_size, kv_heads, head_size]
        self.kv = torch.randn(self.BLOCKS, 2, self.BLOCK, 1, self.HEAD, generator=torch.Generator().manual_seed(1))
        with set_current_vllm_config(self.config):
            self.worker.register_kv_caches({"layer": self.kv})
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(self.BLOCK, sha256)
        # What vLLM publishes as KV events (its publisher here is the null one, which drops them).
        self.published: list[Any] = []
        self.scheduler.kv_event_publisher.publish = self.published.append

    @property
    def connector_scheduler(self) -> Any:
        return self.scheduler.connector.connector_scheduler

    def run(self, req_id: str, prompt: list[int], max_tokens: int) -> list[int]:
        """Runs one request to its end (and its transfers to theirs); returns the GPU blocks it held."""
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.forward_context import ForwardContext
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.request import Request

        from kvtier.tools.bench.vllm import step_output

        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, TINY_OPT["eos_token_id"])
        self.scheduler.add_request(
            Request(
                request_id=req_id,
                prompt_token_ids=prompt,
                sampling_params=params,
                pooling_params=None,
                block_hasher=self.hasher,
            )
        )
        forward = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        blocks: list[int] = []
        for _ in range(100):
            if not (self.scheduler.requests or self.connector_scheduler._jobs or self.scheduler.finished_req_ids):
                return blocks
            out = self.scheduler.schedule()
            if req_id in self.scheduler.requests:
                blocks = list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])
            meta = out.kv_connector_metadata
            self.worker.handle_preemptions(meta)
            self.worker.bind_connector_metadata(meta)
            self.worker.start_load_kv(forward)
            self.worker.wait_for_save()
            sending, receiving = self.worker.get_finished(out.finished_req_ids)
            worker_meta = self.worker.build_connector_worker_meta() or OffloadingWorkerMetadata()
            self.worker.clear_connector_metadata()
            connector_output = KVConnectorOutput(
                finished_sending=sending,
                finished_recving=receiving,
                invalid_block_ids=set(),
                kv_connector_worker_meta=worker_meta,
            )
            self.scheduler.update_from_output(out, step_output(self.scheduler.running, connector_output))
        raise AssertionError(f"request {req_id} did not finish in 100 steps")


def test_vllms_scheduler_and_connector_offload_to_kvtier_and_load_the_same_bytes_back(tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_OPT))
    engine = Engine(str(tmp_path))
    # vLLM's connector built kvtier's manager (scheduler side) and worker (worker side) from the config's line.
    manager = engine.connector_scheduler.manager
    assert isinstance(manager, kv.KvtierManager)
    assert isinstance(engine.worker.connector_worker.worker, kv.KvtierWorker)

    prompt = list(range(100, 100 + 4 * Engine.BLOCK + 3))  # 4 full blocks and 3 tokens
    first = engine.run("a", prompt, max_tokens=3)
    assert manager.stats()["pages_stored"] == 4
    stored = [engine.kv[b].clone() for b in first[:4]]
    # kvtier's stores reached vLLM's published KV events as BlockStored with medium CPU, one a block.
    cpu = [e for batch in engine.published for e in batch.events if getattr(e, "medium", None) == "CPU"]
    assert [type(e).__name__ for e in cpu] == ["BlockStored"] * len(cpu)
    assert sum(len(e.block_hashes) for e in cpu) == 4

    # The GPU prefix cache forgets the prompt and its blocks are overwritten: only kvtier's host pool has the KV.
    assert engine.scheduler.reset_prefix_cache()
    engine.kv.zero_()
    second = engine.run("b", prompt, max_tokens=2)
    s = manager.stats()
    assert (s["hits"], s["hit_tokens"], s["pages_loaded"]) == (1, 4 * Engine.BLOCK, 4)
    for b, want in zip(second[:4], stored, strict=True):
        assert torch.equal(engine.kv[b], want), f"GPU block {b} does not hold the bytes stored from the first run"


def test_chunks_of_two_blocks_under_chunked_prefill_store_and_load_the_same_bytes(tmp_path: Any) -> None:
    # The extra config's block_size asks for chunks of two GPU blocks; prefill runs 24 tokens a step, so the prompt's
    # blocks are computed (and offered for storing) over several steps, a chunk's two blocks in different ones.
    (tmp_path / "config.json").write_text(json.dumps(TINY_OPT))
    line = json.loads(ONE_LINE)
    line["kv_connector_extra_config"]["block_size"] = 2 * Engine.BLOCK
    engine = Engine(str(tmp_path), json.dumps(line), batched_tokens=24)
    manager = engine.connector_scheduler.manager
    assert isinstance(manager, kv.KvtierManager)
    assert manager.index.block_size == 2 * Engine.BLOCK

    prompt = list(range(200, 200 + 5 * Engine.BLOCK + 3))  # 2 whole chunks, a block and 3 tokens
    first = engine.run("a", prompt, max_tokens=2)
    assert manager.stats()["pages_stored"] == 2
    stored = [engine.kv[b].clone() for b in first[:4]]

    assert engine.scheduler.reset_prefix_cache()
    engine.kv.zero_()
    second = engine.run("b", prompt, max_tokens=2)
    s = manager.stats()
    assert (s["hit_tokens"], s["pages_loaded"]) == (4 * Engine.BLOCK, 2)
    for b, want in zip(second[:4], stored, strict=True):
        assert torch.equal(engine.kv[b], want), f"GPU block {b} does not hold the bytes stored from the first run"


# ---- contract: kvtier's manager against vLLM's CPUOffloadingManager (LRU, same capacity) ---------------------


def scheduler_touches() -> bool:
    """Whether this release's offloading scheduler calls the manager's ``touch`` (vLLM up to 0.30 does: after each
    lookup and each store it submits, with every key of the request)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler

    return re.search(r"\bmanager\.touch\(", inspect.getsource(scheduler)) is not None


def cpu_manager(capacity: int) -> Any:
    """vLLM's CPUOffloadingManager (LRU, events on); its capacity is ``num_blocks`` before 0.30 and ``num_chunks``
    after, so it goes positionally."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(capacity, cache_policy="lru", enable_events=True)


def event_rows(events: Any) -> list[tuple[Any, ...]]:
    """Events as comparable rows (a field a release lacks reads as its later default)."""
    return sorted(
        (e.removed, getattr(e, "metadata_only", False), getattr(e, "removal_expected", False), sorted(e.keys))
        for e in events
    )


def replay(seed: int, *, capacity: int, keys: int, batch: int, steps: int = 200) -> int:
    """Random requests, each one store or one lookup-and-load, completed and finished before the next, on both
    managers: the same lookups, keys to store, refusals, evictions and events (with the metadata-only releases of
    failed stores). Where the release's scheduler calls ``touch``, the replay does too, where it would: after the
    lookups, and after a store that copies anything. Returns the number of evictions seen."""
    import random

    rnd = random.Random(seed)
    touches = scheduler_touches()
    ref = cpu_manager(capacity)
    ours = kv.KvtierManager(capacity, enable_events=True)
    evictions = 0
    for step in range(steps):
        where = f"seed {seed} step {step}"
        contexts = (ReqContext(req_id=str(step)), ReqContext(req_id=str(step)))
        for m, ctx in zip((ref, ours), contexts, strict=True):
            m.on_new_request(ctx)
        offered = list(dict.fromkeys(key(rnd.randrange(keys)) for _ in range(rnd.randint(1, batch))))
        if rnd.random() < 0.5:
            a, b = (m.prepare_store(offered, ctx) for m, ctx in zip((ref, ours), contexts, strict=True))
            assert (a is None) == (b is None), where
            if a is not None and b is not None:
                assert a.keys_to_store == b.keys_to_store, where
                assert sorted(a.evicted_keys) == sorted(b.evicted_keys), where
                evictions += len(a.evicted_keys)
                if touches and a.keys_to_store:
                    for m, ctx in zip((ref, ours), contexts, strict=True):
                        m.touch(offered, ctx)
                ok = rnd.random() < 0.9
                ref.complete_store(a.keys_to_store, contexts[0], ok)
                ours.complete_store(b.keys_to_store, contexts[1], ok)
        else:
            found = [[m.lookup(k, ctx) for k in offered] for m, ctx in zip((ref, ours), contexts, strict=True)]
            assert found[0] == found[1], where
            hits = [k for k, r in zip(offered, found[0], strict=True) if r is LookupResult.HIT]
            if touches:
                for m, ctx in zip((ref, ours), contexts, strict=True):
                    m.touch(offered, ctx)
            if hits:
                for m, ctx in zip((ref, ours), contexts, strict=True):
                    m.prepare_load(hits, ctx)
                    m.complete_load(hits, ctx)
        for m, ctx in zip((ref, ours), contexts, strict=True):
            m.on_request_finished(ctx)
        # The manager's one-key lookups (the index's KeyAnswers) agree with the index's lookup of each key alone.
        for k in (key(i) for i in range(keys)):
            hits, pending = ours.index.lookup_keys([k])
            want = LookupResult.HIT if hits else LookupResult.HIT_PENDING if pending else LookupResult.MISS
            assert ours.lookup(k, contexts[1]) is want, where
        assert event_rows(ref.take_events()) == event_rows(ours.take_events()), where
    return evictions


def test_contract_one_block_requests_match_vllms_lru_hit_for_hit_and_eviction_for_eviction() -> None:
    assert sum(replay(seed, capacity=6, keys=14, batch=1) for seed in range(40)) > 500


def test_contract_batches_match_vllms_manager_until_the_pool_is_full() -> None:
    # The order in which the pages of one batch age differs (kvtier releases a batch deepest first, vLLM 0.33's LRU
    # ranks pages by request and position), so batches are compared where nothing is evicted.
    for seed in range(40):
        assert replay(seed, capacity=16, keys=16, batch=4) == 0


def test_contract_touch_ranks_pages_as_vllms_lru() -> None:
    # The pages of one-key stores age in store order; a touch makes its ready keys the most recent, its first key
    # the most recent of all (vLLM's LRU moves them to the end in reverse order), and passes over keys being stored
    # and keys not on the host. Evicting one page a store then shows the whole order on both managers.
    if not scheduler_touches():
        pytest.skip("this release's scheduler never calls touch (vLLM 0.31 on)")
    ref, ours = cpu_manager(6), kv.KvtierManager(6, enable_events=True)
    ctx = ReqContext(req_id="r")
    both = (ref, ours)
    for i in range(5):
        for m in both:
            out = m.prepare_store([key(i)], ctx)
            assert out is not None
            m.complete_store(out.keys_to_store, ctx)
    for m in both:
        assert m.prepare_store([key(5)], ctx) is not None  # pending: a touch leaves it alone
        m.touch([key(3), key(9), key(5), key(1), key(4), key(3)], ctx)
        m.complete_store([key(5)], ctx)
    evicted: list[list[Any]] = [[], []]
    for i in range(6):
        for m, got in zip(both, evicted, strict=True):
            out = m.prepare_store([key(100 + i)], ctx)
            assert out is not None
            got.extend(out.evicted_keys)
            m.complete_store(out.keys_to_store, ctx)
    assert evicted[0] == [key(0), key(2), key(4), key(1), key(3), key(5)]
    assert evicted[1] == evicted[0]
    assert event_rows(ref.take_events()) == event_rows(ours.take_events())


# ---- KvtierMooncakeTier under vLLM's TieringOffloadingSpec, on a real Mooncake master -------------------------

HAVE_MOONCAKE = find_spec("mooncake") is not None


def vllm_tier() -> Any:
    """kvtier.vllm.tier, or a skip where it cannot work yet: it is written against vLLM 0.33's tiering interface
    (TransferJob, take_events, ConfigInfoMapping), which earlier releases lack or shape otherwise."""
    try:
        import kvtier.vllm.tier as tier
    except ImportError as e:
        pytest.skip(f"kvtier.vllm.tier does not support this vLLM ({release.VLLM_VERSION}) yet: {e}")
    return tier


@pytest.fixture
def mooncake_master() -> Any:
    vllm_tier()
    if not HAVE_MOONCAKE:
        pytest.skip("mooncake is not installed")
    from kvtier.tools.mooncake import LocalMooncake

    with LocalMooncake(segment_bytes=64 << 20) as server:
        yield server.master_addr


def tiering_spec(master: str, chunks: int = 4, **tier: Any) -> Any:
    # vLLM's tiering spec through kvtier.vllm, which registers kvtier's tier with vLLM's tier factory (before 0.28 the
    # factory reads no module_path: only this way works there); vLLM passes the tier's module_path on to it then.
    extra = {
        "spec_name": "KvtierTieringSpec",
        "spec_module_path": "kvtier.vllm",
        "cpu_bytes_to_use": chunks * 4096,
        "secondary_tiers": [
            {
                "type": "KvtierMooncakeTier",
                "module_path": "kvtier.vllm",
                "l3_master": master,
                "model_version": "test-revision",
                "hash_key": "test-deployment-secret",
                **tier,
            }
        ],
    }
    # One layer of 4096 bytes a block; vLLM's KVTransferConfig gives each config an engine id of its own.
    line = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra})
    return spec_from_line(line, layers=1, page=4096, events=True)


def settle(manager: Any, until: Any, what: str) -> None:
    """Steps the tiering manager (as the scheduler does at each step's end) until ``until()``."""
    from vllm.v1.kv_offload.base import ScheduleEndContext

    for _ in range(500):
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        if until():
            return
        import time

        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_mooncake_tier_warns_when_vllm_seeds_its_block_hashes_at_random(
    mooncake_master: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without PYTHONHASHSEED vLLM's block hashes (the Store's keys) differ in every process: an instance started
    # later never finds what an earlier one stored, which the tier says when it is built.
    tier_module = vllm_tier()
    handler = _Messages()
    logger = logging.getLogger("kvtier.vllm")
    logger.addHandler(handler)
    try:
        for seed in (None, "0"):
            if seed is None:
                monkeypatch.delenv("PYTHONHASHSEED", raising=False)
            else:
                monkeypatch.setenv("PYTHONHASHSEED", seed)
            handler.messages.clear()
            tiering_spec(mooncake_master).get_manager().shutdown()
            assert (tier_module.UNSEEDED_HASHES in handler.messages) == (seed is None), seed
    finally:
        logger.removeHandler(handler)


def test_mooncake_tier_keeps_chunks_vllms_cpu_tier_evicted_and_serves_them_back_verified(mooncake_master: str) -> None:
    KvtierMooncakeTier = vllm_tier().KvtierMooncakeTier

    spec = tiering_spec(mooncake_master)
    manager = spec.get_manager()
    (tier,) = manager.secondary_tiers
    assert isinstance(tier, KvtierMooncakeTier)
    rows = np.asarray(manager.primary_tier.get_kv_memoryview())
    assert rows.shape == (4, 4096)
    rng = np.random.default_rng(0)
    try:
        ctx = ReqContext(req_id="a")
        manager.on_new_request(ctx)
        keys = [key(i) for i in range(4)]
        out = manager.prepare_store(keys, ctx)
        assert out is not None
        chunks = out.store_spec.block_ids.tolist()
        data = {k: rng.integers(0, 256, 4096, dtype=np.uint8) for k in keys}
        for k, c in zip(keys, chunks, strict=True):  # what the workers copy into the CPU tier
            rows[c] = data[k]
        manager.complete_store(keys, ctx)  # cascades to the Mooncake tier
        settle(manager, lambda: tier.counters["put"] == 4 and not tier.has_pending_work(), "the puts")
        manager.on_request_finished(ctx)
        events = list(manager.take_events())
        stored = sorted(k for e in events if e.medium == release.MEDIUM_STORAGE and not e.removed for k in e.keys)
        assert stored == (keys if release.TIER_EVENTS else []), "vLLM takes a tier's events from 0.28"

        # Four new chunks push the first four out of the CPU tier; the Mooncake tier still has them.
        ctx = ReqContext(req_id="b")
        manager.on_new_request(ctx)
        out = manager.prepare_store([key(i) for i in range(10, 14)], ctx)
        assert out is not None and sorted(out.evicted_keys) == keys
        for c in out.store_spec.block_ids.tolist():
            rows[c] = 0
        manager.complete_store(out.keys_to_store, ctx)
        settle(manager, lambda: tier.counters["put"] == 8 and not tier.has_pending_work(), "the second puts")
        manager.on_request_finished(ctx)

        # A lookup of an evicted key promotes it back from Mooncake into a CPU chunk, bytes checked.
        ctx = ReqContext(req_id="c")
        manager.on_new_request(ctx)
        # The promotion starts: HIT_PENDING (RETRY before 0.28's tiering manager).
        assert manager.lookup(keys[0], ctx) in (LookupResult.HIT_PENDING, LookupResult.RETRY)
        settle(manager, lambda: manager.lookup(keys[0], ctx) is LookupResult.HIT, "the promotion")
        load = manager.prepare_load([keys[0]], ctx)
        (chunk,) = load.block_ids.tolist()
        assert np.array_equal(rows[chunk].view(np.uint8), data[keys[0]])
        manager.complete_load([keys[0]], ctx)
        manager.on_request_finished(ctx)
        assert tier.counters["loaded"] == 1 and tier.counters["rejected"] == 0
    finally:
        manager.shutdown()


def tier_job(job_id: int, keys: list[Any], chunks: list[int], promotion: bool, req_id: str) -> Any:
    """vLLM's job for a secondary tier: TransferJob with chunk ids (0.30 on; block ids in 0.28-0.29), JobMetadata
    before."""
    from vllm.v1.kv_offload.tiering import base

    cls = getattr(base, "TransferJob", None) or base.JobMetadata
    slots = "chunk_ids" if "chunk_ids" in {f.name for f in dataclasses.fields(cls)} else "block_ids"
    return cls(job_id=job_id, keys=keys, is_promotion=promotion, req_context=ReqContext(req_id=req_id),
               **{slots: np.array(chunks)})  # fmt: skip


def probe(tier: Any, k: Any, what: str) -> Any:
    """The tier's answer for ``k`` once the Store has been asked (a key it has not seen is RETRY until then)."""
    from vllm.v1.kv_offload.base import ScheduleEndContext

    ctx = ReqContext(req_id=f"probe-{what}")
    answer = tier.lookup(k, ctx)
    for _ in range(500):
        if answer is not LookupResult.RETRY:
            return answer
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        tier.drain_jobs()
        answer = tier.lookup(k, ctx)
    raise AssertionError(f"the tier kept answering RETRY for {what}")


@contextmanager
def chunk_in_the_store(master: str) -> Iterator[tuple[Any, np.ndarray]]:
    """vLLM's tiering spec with kvtier's Mooncake tier on ``master``, chunk 1 (every byte 7) put into the Store under
    ``key(1)``: yields the tier and the CPU tier's chunk rows."""
    manager = tiering_spec(master).get_manager()
    (tier,) = manager.secondary_tiers
    rows = np.asarray(manager.primary_tier.get_kv_memoryview())
    try:
        rows[1] = 7
        assert [r.success for r in run_job(tier, tier.submit_store, tier_job(1, [key(1)], [1], False, "a"))] == [True]
        yield tier, rows
    finally:
        manager.shutdown()


def run_job(tier: Any, submit: Any, job: Any) -> list[Any]:
    """Submits ``job`` to the tier, runs it and returns the tier's finished jobs."""
    submit(job)
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def test_mooncake_tier_refuses_a_forged_object_and_reports_it_removed(mooncake_master: str) -> None:
    with chunk_in_the_store(mooncake_master) as (tier, rows):
        # Someone with Store access overwrites the object's payload (same length, header kept).
        (skey,), size = tier.object_keys([key(1)]), tier.object_bytes
        buf = np.zeros(size, dtype=np.uint8)
        assert tier.store.get_many([skey], [[int(buf.ctypes.data)]], [[size]]) == [size]
        buf[-100:] ^= 0xFF
        assert tier.store.remove(skey, True) == 0
        assert tier.store.put_many([skey], [[int(buf.ctypes.data)]], [[size]]) == [0]

        rows[2] = 0
        (result,) = run_job(tier, tier.submit_load, tier_job(2, [key(1)], [2], True, "b"))
        assert result.success is False and list(getattr(result, "successful_keys", None) or []) == []
        assert tier.counters["rejected"] == 1
        # Forgotten here, and the Store, asked, has it no more.
        assert probe(tier, key(1), "the forged key") is LookupResult.MISS
        removed = [k for e in tier.take_events() if e.removed for k in e.keys]
        assert removed == ([key(1)] if release.TIER_EVENTS else [])
        assert tier.store.exists_many([skey]) == [0], "the forged object is removed from the Store"


def test_mooncake_tier_removes_a_value_one_byte_longer_and_puts_it_again(mooncake_master: str) -> None:
    with chunk_in_the_store(mooncake_master) as (tier, rows):
        (skey,), size = tier.object_keys([key(1)]), tier.object_bytes
        buf = np.zeros(size + 1, dtype=np.uint8)
        assert tier.store.get_many([skey], [[int(buf.ctypes.data)]], [[size]]) == [size]
        assert tier.store.remove(skey, True) == 0
        assert tier.store.put_many([skey], [[int(buf.ctypes.data)]], [[size + 1]]) == [0]
        rows[2] = 0
        assert [r.success for r in run_job(tier, tier.submit_load, tier_job(2, [key(1)], [2], True, "b"))] == [False]
        assert tier.counters["rejected"] == 1
        assert tier.store.exists_many([skey]) == [0], "the wrong value is removed from the Store"
        # Forgotten as put: the next store of the chunk puts it again, and it is served.
        assert [r.success for r in run_job(tier, tier.submit_store, tier_job(3, [key(1)], [1], False, "c"))] == [True]
        assert tier.store.exists_many([skey]) == [1]
        assert [r.success for r in run_job(tier, tier.submit_load, tier_job(4, [key(1)], [2], True, "d"))] == [True]
        assert (rows[2] == 7).all()


@pytest.mark.parametrize("code", [-800, -707, -900])
def test_mooncake_tier_a_transient_get_failure_removes_nothing(mooncake_master: str, code: int) -> None:
    """A get that fails for a passing reason (a transfer failure, an expired lease, an RPC failure) fails that load
    only: the object stays in the Store, no removal is published, and the next load serves it."""
    from kvtier.tools.faults import StoreWrapper

    class FailsOnce(StoreWrapper):
        failed = False

        def get_many(self, keys: Any, ptrs_per_key: Any, sizes_per_key: Any) -> list[int]:
            if not self.failed:
                self.failed = True
                return [code] * len(keys)
            return self.inner.get_many(keys, ptrs_per_key, sizes_per_key)

    with chunk_in_the_store(mooncake_master) as (tier, rows):
        tier.store = FailsOnce(tier.store)
        rows[2] = 0
        assert [r.success for r in run_job(tier, tier.submit_load, tier_job(2, [key(1)], [2], True, "b"))] == [False]
        assert tier.counters["rejected"] == 0
        assert not [k for e in tier.take_events() if e.removed for k in e.keys]
        (skey,) = tier.object_keys([key(1)])
        assert tier.store.exists_many([skey]) == [1], "the object is still in the Store"
        assert [r.success for r in run_job(tier, tier.submit_load, tier_job(3, [key(1)], [2], True, "c"))] == [True]
        assert (rows[2] == 7).all()


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        ({"model_version": None}, "needs model_version"),
        ({"l3_master": None}, "needs l3_master"),
        ({"hash_key": None}, "public default hash_key"),
        ({"root_dir": "/tmp"}, r"config keys \['root_dir'\] are not settings of kvtier.vllm.KvtierMooncakeTier"),
        ({"l3_master": "nohost"}, "nohost"),
        ({"l3_protocol": "carrier-pigeon"}, "carrier-pigeon"),
    ],
)
def test_mooncake_tier_refuses_bad_configs_naming_them(tier: dict[str, Any], message: str) -> None:
    tier_settings = vllm_tier().tier_settings

    config = {"l3_master": "127.0.0.1:1", "model_version": "r", "hash_key": "k", **tier}
    with pytest.raises(ValueError, match=message):
        tier_settings({k: v for k, v in config.items() if v is not None})


def test_a_new_instance_finds_in_the_store_what_an_earlier_one_stored(mooncake_master: str) -> None:
    # Instance A stores four chunks and exits; instance B, new, finds them by asking the Store and promotes them.
    rng = np.random.default_rng(3)
    keys = [key(i) for i in range(4)]
    data = {k: rng.integers(0, 256, 4096, dtype=np.uint8) for k in keys}
    first = tiering_spec(mooncake_master).get_manager()
    try:
        (tier,) = first.secondary_tiers
        rows = np.asarray(first.primary_tier.get_kv_memoryview())
        ctx = ReqContext(req_id="a")
        first.on_new_request(ctx)
        out = first.prepare_store(keys, ctx)
        assert out is not None
        for k, c in zip(keys, out.store_spec.block_ids.tolist(), strict=True):
            rows[c] = data[k]
        first.complete_store(keys, ctx)
        settle(first, lambda: tier.counters["put"] == 4 and not tier.has_pending_work(), "the puts")
        first.on_request_finished(ctx)
        del rows
    finally:
        first.shutdown()

    second = tiering_spec(mooncake_master).get_manager()
    try:
        (tier,) = second.secondary_tiers
        rows = np.asarray(second.primary_tier.get_kv_memoryview())
        ctx = ReqContext(req_id="b")
        second.on_new_request(ctx)
        # Not known here: the tier asks the Store at the step's end, then vLLM promotes the chunk.
        assert second.lookup(keys[0], ctx) is LookupResult.RETRY
        settle(second, lambda: second.lookup(keys[0], ctx) is LookupResult.HIT, "the probe and the promotion")
        load = second.prepare_load([keys[0]], ctx)
        (chunk,) = load.block_ids.tolist()
        assert np.array_equal(rows[chunk].view(np.uint8), data[keys[0]])
        second.complete_load([keys[0]], ctx)
        second.on_request_finished(ctx)
        assert (tier.counters["found"], tier.counters["loaded"], tier.counters["rejected"]) == (1, 1, 0)
        # A key nobody stored: asked once, then a miss.
        assert probe(tier, key(99), "a key nobody stored") is LookupResult.MISS
        del rows
    finally:
        second.shutdown()


class _ClosingStore:
    """A Store that writes a file when it is closed (and answers nothing else the test needs)."""

    def __init__(self, config: Any) -> None:
        self.path = os.environ["KVTIER_TEST_CLOSED"]

    def register(self, addr: int, nbytes: int) -> None:
        return

    def close(self) -> None:
        Path(self.path).write_text("closed")


def test_the_tier_closes_its_store_client_at_exit_when_vllm_never_shut_it_down(tmp_path: Any) -> None:
    vllm_tier()
    # Under vLLM 0.25.1 a process that ended with the Store client open while the tier's jobs ran was ended by
    # std::terminate: the tier closes its client at interpreter exit too.
    closed = tmp_path / "closed"
    code = (
        "import numpy as np, test_vllm as t\n"
        "from kvtier.vllm.tier import KvtierMooncakeTier\n"
        "spec = t.spec_from_line(layers=1, page=4096)\n"
        "tier = KvtierMooncakeTier(spec, memoryview(np.zeros((4, 4096), np.uint8)), 'KvtierMooncakeTier',\n"
        "    store_factory=t._ClosingStore, l3_master='127.0.0.1:1', model_version='r', hash_key='k')\n"
    )
    path = os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "KVTIER_TEST_CLOSED": str(closed), "PYTHONPATH": path}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    assert closed.read_text() == "closed"


def test_the_worker_copies_with_the_kernel_unless_told_otherwise() -> None:
    # On a real engine (vLLM 0.25.1, H100) the copy engine's loads took 1.2-1.9x the kernel's time at 16K and 32K
    # tokens, and its stores cost a no-reuse run 7-10% of its throughput (docs/VLLM.md).
    assert kv.resolve_settings({}, env={}).copy_method == "kernel"
    assert kv.resolve_settings({"copy_method": "auto"}, env={}).copy_method == "auto"
    assert kv.resolve_settings({}, env={"KVTIER_COPY_METHOD": "dma"}).copy_method == "dma"


def test_the_worker_stores_with_two_ctas_and_loads_with_eight_unless_told_otherwise() -> None:
    # Stores run beside the model's GEMMs: on a real engine 2 CTAs cost a no-reuse run 0.6% of its throughput,
    # 8 cost 4.7%; loads are on the request's critical path and 2 CTAs halved their rate (docs/VLLM.md).
    settings = kv.resolve_settings({}, env={})
    assert (settings.store_copy_ctas, settings.copy_ctas) == (kv.WORKER_STORE_COPY_CTAS, 8) == (2, 8)
    # A copy_ctas the deployment sets bounds both directions; store_copy_ctas stores only.
    both = kv.resolve_settings({"copy_ctas": 4, "copy_method": "dma"}, env={})
    assert (both.copy_ctas, both.store_copy_ctas) == (4, None)
    settings = kv.resolve_settings({"copy_method": "dma"}, env={"KVTIER_COPY_CTAS": "4"})
    assert (settings.copy_ctas, settings.copy_method, settings.sources["copy_ctas"]) == (4, "dma", "env")
    assert kv.resolve_settings({"store_copy_ctas": 1}, env={}).store_copy_ctas == 1
    for bad in ({"copy_ctas": 0}, {"store_copy_ctas": 0}, {"store_copy_method": "fast"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            kv.resolve_settings(bad, env={})


def test_bench_vllm_steps_vllms_scheduler_through_the_same_workload_in_each_configuration() -> None:
    # `kvtier bench vllm --scheduler`: vLLM's own Scheduler with no offloading, vLLM's CPU offloading and kvtier's
    # spec; the same prompts take the same steps in each (nothing is reused), every request finishing.
    from kvtier.tools.bench import vllm as bench

    runs = {c: bench.scheduler_steps(c, prompts=3, tokens=300) for c in bench.SCHEDULER_CONFIGS}
    steps = {s for s, _ in runs.values()}
    assert len(steps) == 1 and steps.pop() >= 8, runs  # at least the 8 output tokens' steps
    assert all(ms > 0 for _, ms in runs.values())
