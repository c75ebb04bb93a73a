"""kvtier's SGLang HiCache backend (``kvtier.sglang.KvtierStore``), built by SGLang's own storage-backend factory from
the flag's JSON, on real SGLang host pools and a real Mooncake master; SGLang's own Mooncake backend beside it.

Runs where SGLang is installed (``.ci/sglang`` makes a venv with it); skipped elsewhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from conftest import needs_mooncake

needs_mooncake()
pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory", reason="SGLang is not installed")

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402

from kvtier._core import L3_FORMAT_VERSION  # noqa: E402
from kvtier.l3.store import import_mooncake  # noqa: E402
from kvtier.sglang import KvtierStore  # noqa: E402
from kvtier.tools.bench.sglang import build, host_pool, page_bytes_of, sglang_mooncake_config, storage_config  # noqa: E402

pytestmark = pytest.mark.mooncake

# The flag's JSON as a deployment writes it: `--hicache-storage-backend dynamic --hicache-storage-backend-extra-config`.
FLAG = '{"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore", "interface_v1": 1}'
KEY = "kvtier test deployment"
PAGES = 4
PAGE_SIZE = 16  # tokens a page of the pools built here (host_pool's default)


def extra(server: Any, **settings: Any) -> dict[str, Any]:
    return {
        **json.loads(FLAG),
        "l3_master": server.master_addr,
        "model_version": "rev-a",
        "hash_key": KEY,
        "l3_staging_bytes": "4MiB",
        **settings,
    }


def page_hashes(n: int) -> list[str]:
    """SGLang-like page hashes (sha256 hex), fresh for each call: the master is shared by the module's tests."""
    salt = uuid.uuid4().hex
    return [hashlib.sha256(f"{salt}/{i}".encode()).hexdigest() for i in range(n)]


def tokens(first_page: int, pages: int = PAGES) -> torch.Tensor:
    return torch.arange(first_page * PAGE_SIZE, (first_page + pages) * PAGE_SIZE)


def page(pool: Any, p: int) -> torch.Tensor:
    return page_bytes_of(pool, p * PAGE_SIZE).clone()


class Raw:
    """A plain Mooncake client that plants values under any key (what anyone who can write to the Store can do)."""

    def __init__(self, master_addr: str) -> None:
        self.store = import_mooncake().MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master_addr)
        assert rc == 0, rc

    def get(self, key: str) -> bytes:
        value = self.store.get(key)
        assert value, f"no value under {key}"
        return bytes(value)

    def plant(self, key: str, value: bytes) -> None:
        assert self.store.remove(key, True) == 0, key
        assert self.store.put(key, value) == 0, key


@pytest.fixture(scope="module")
def raw(mooncake_server: Any) -> Iterator[Raw]:
    r = Raw(mooncake_server.master_addr)
    yield r
    r.store.close()


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Backends a test built, closed after it."""
    built: list[Any] = []
    yield built
    for b in built:
        b.close()


@pytest.mark.parametrize(
    ("mla", "layout", "zero_copy"),
    [
        (False, "page_first", False),
        (False, "page_first", True),
        (False, "layer_first", False),
        (False, "layer_first", True),
        (True, "page_first", False),
        (True, "layer_first", True),
    ],
)
def test_factory_builds_it_from_the_flag_and_pages_round_trip(
    mooncake_server: Any, closing: list[Any], mla: bool, layout: str, zero_copy: bool
) -> None:
    pool = host_pool(mla=mla, layout=layout, pages=16)
    storage = build("dynamic", extra(mooncake_server, l3_zero_copy=zero_copy), pool, is_mla_model=mla)
    closing.append(storage)
    assert type(storage) is KvtierStore and storage.zero_copy is zero_copy
    pool.kv_buffer.view(torch.uint8).random_(0, 256)
    keys = page_hashes(PAGES)

    assert storage.batch_set_v1(keys, tokens(0)) == [True] * PAGES
    assert storage.batch_exists(keys) == PAGES
    assert storage.batch_exists([*keys[:2], page_hashes(1)[0], *keys[2:]]) == 2
    assert storage.exists(keys[3]) and not storage.exists(page_hashes(1)[0])
    assert storage.batch_get_v1(keys, tokens(8)) == [True] * PAGES
    for p in range(PAGES):
        assert torch.equal(page(pool, 8 + p), page(pool, p)), p
    assert storage.batch_set_v1(keys, tokens(0)) == [True] * PAGES  # present: nothing is put again
    stats = storage.stats()
    assert (stats["l3_objects_put"], stats["l3_puts_present"]) == (PAGES, PAGES)
    assert (stats["l3_objects_loaded"], stats["l3_rejected"], stats["l3_store_errors"]) == (PAGES, 0, 0)
    assert storage.object_keys(keys)[0].startswith(f"kvtier/v{L3_FORMAT_VERSION}/{storage.fingerprint}/g1/")


def test_keys_name_the_model_and_the_shard(mooncake_server: Any, closing: list[Any]) -> None:
    pool = host_pool(pages=16)
    pool.kv_buffer.view(torch.uint8).random_(0, 256)
    keys = page_hashes(PAGES)

    def backend(mla: bool = False, **ranks: Any) -> Any:
        version = ranks.pop("model_version", "rev-a")
        b = build("dynamic", extra(mooncake_server, model_version=version), pool, is_mla_model=mla, **ranks)
        closing.append(b)
        return b

    writer = backend(tp_rank=0, tp_size=2)
    assert all(writer.batch_set_v1(keys, tokens(0)))
    assert backend(tp_rank=1, tp_size=2).batch_exists(keys) == 0, "another TP rank holds other heads"
    assert backend(tp_rank=0, tp_size=2, model_version="rev-b").batch_exists(keys) == 0, "another model revision"
    assert backend(tp_rank=0, tp_size=2, pp_rank=0, pp_size=2).batch_exists(keys) == 0, "another PP split"

    # MLA's KV is the same on every TP rank: one writer's objects serve every rank.
    mla_pool = host_pool(mla=True, pages=16)
    mla_pool.kv_buffer.view(torch.uint8).random_(0, 256)
    mla_writer = build("dynamic", extra(mooncake_server), mla_pool, is_mla_model=True, tp_rank=0, tp_size=2)
    mla_reader = build("dynamic", extra(mooncake_server), mla_pool, is_mla_model=True, tp_rank=1, tp_size=2)
    closing += [mla_writer, mla_reader]
    assert mla_writer.storage_config.is_storage_writer and not mla_reader.storage_config.is_storage_writer
    assert all(mla_writer.batch_set_v1(keys, tokens(0)))
    assert mla_reader.batch_get_v1(keys, tokens(8)) == [True] * PAGES
    assert all(torch.equal(page(mla_pool, 8 + p), page(mla_pool, p)) for p in range(PAGES))


@pytest.mark.parametrize("zero_copy", [False, True])
def test_planted_values_are_rejected_counted_and_removed(
    mooncake_server: Any, raw: Raw, closing: list[Any], zero_copy: bool
) -> None:
    pool = host_pool(pages=16)
    a = build("dynamic", extra(mooncake_server, l3_zero_copy=zero_copy), pool, model_name="model-a")
    b = build("dynamic", extra(mooncake_server, model_version="rev-b"), pool, model_name="model-b")
    closing += [a, b]
    pool.kv_buffer.view(torch.uint8).random_(0, 256)
    keys = page_hashes(PAGES)
    assert all(a.batch_set_v1(keys, tokens(0))) and all(b.batch_set_v1(keys, tokens(4)))
    ka, kb = a.object_keys(keys), b.object_keys(keys)

    flipped = bytearray(raw.get(ka[0]))
    flipped[len(flipped) // 2] ^= 0x10
    raw.plant(ka[0], bytes(flipped))  # a bit flip in a value of the same size
    raw.plant(ka[1], raw.get(kb[1]))  # another model's object of this page under this key
    raw.plant(ka[2], raw.get(ka[2])[:-4096])  # a short value

    before = [page(pool, 8 + p) for p in range(PAGES)]
    assert a.batch_get_v1(keys, tokens(8)) == [False, False, False, True]
    stats = a.stats()
    assert (stats["l3_rejected"], stats["l3_rejected_removed"], stats["l3_objects_loaded"]) == (3, 3, 1)
    assert torch.equal(page(pool, 11), page(pool, 3))
    if not zero_copy:  # staged: a value of the wrong length never reaches the host pool
        assert torch.equal(page(pool, 10), before[2])
    # Rejected objects were removed: the next backup puts the right bytes, and they are served.
    assert a.batch_exists(keys) == 0
    assert all(a.batch_set_v1(keys, tokens(0)))
    assert a.batch_get_v1(keys, tokens(8)) == [True] * PAGES
    assert all(torch.equal(page(pool, 8 + p), page(pool, p)) for p in range(PAGES))


@pytest.mark.parametrize("code", [-800, -707, -900, "raise"])
def test_a_transient_get_failure_removes_nothing(mooncake_server: Any, closing: list[Any], code: int | str) -> None:
    """A get that fails for a passing reason (a transfer failure, an expired lease, an RPC failure, a client that
    raises) is a miss this time only: the objects stay in the Store and the next get serves them."""
    from kvtier.l3.errors import L3Error
    from kvtier.l3.store import MooncakeStore
    from kvtier.tools.faults import StoreWrapper

    class FailsOnce(StoreWrapper):
        failed = False

        def get_many(self, keys: Any, ptrs_per_key: Any, sizes_per_key: Any) -> list[int]:
            if not self.failed:
                self.failed = True
                if code == "raise":
                    raise L3Error("the client lost its connection")
                return [int(code)] * len(keys)
            return self.inner.get_many(keys, ptrs_per_key, sizes_per_key)

    pool = host_pool(pages=16)
    store = KvtierStore(storage_config(extra(mooncake_server)), store_factory=lambda c: FailsOnce(MooncakeStore(c)))
    closing.append(store)
    store.register_mem_pool_host(pool)
    pool.kv_buffer.view(torch.uint8).random_(0, 256)
    keys = page_hashes(PAGES)
    assert all(store.batch_set_v1(keys, tokens(0)))
    assert store.batch_get_v1(keys, tokens(8)) == [False] * PAGES
    assert store.stats()["l3_rejected_removed"] == 0
    assert store.batch_exists(keys) == PAGES
    assert store.batch_get_v1(keys, tokens(8)) == [True] * PAGES
    assert all(torch.equal(page(pool, 8 + p), page(pool, p)) for p in range(PAGES))


def test_a_value_one_byte_longer_is_removed_and_put_again(mooncake_server: Any, raw: Raw, closing: list[Any]) -> None:
    pool = host_pool(pages=16)
    a = build("dynamic", extra(mooncake_server), pool)
    closing.append(a)
    pool.kv_buffer.view(torch.uint8).random_(0, 256)
    keys = page_hashes(PAGES)
    assert all(a.batch_set_v1(keys, tokens(0)))
    key = a.object_keys(keys)[1]
    raw.plant(key, raw.get(key) + b"\0")
    assert a.batch_get_v1(keys, tokens(8)) == [True, False, True, True]
    assert a.stats()["l3_rejected_removed"] == 1
    assert a.batch_exists(keys[1:2]) == 0  # removed: SGLang's next backup of the page puts it again
    assert all(a.batch_set_v1(keys, tokens(0)))
    assert a.batch_get_v1(keys, tokens(8)) == [True] * PAGES
    assert torch.equal(page(pool, 9), page(pool, 1))


def test_the_same_planted_values_are_served_by_sglangs_mooncake_backend(
    mooncake_server: Any, raw: Raw, closing: list[Any]
) -> None:
    pool = host_pool(pages=16)
    cfg = sglang_mooncake_config(mooncake_server.master_addr)
    a = build("mooncake", cfg, pool, model_name="model-a")
    b = build("mooncake", cfg, pool, model_name="model-b")
    pool.kv_buffer.view(torch.uint8).random_(0, 256)
    keys = page_hashes(PAGES)
    assert all(a.batch_set_v1(keys, tokens(0))) and all(b.batch_set_v1(keys, tokens(4)))

    # SGLang's keys: <model>_<page hash>_<tp rank>_k|_v.
    def k(model: str, p: int, part: str) -> str:
        return f"{model}_{keys[p]}_0_{part}"

    flipped = bytearray(raw.get(k("model-a", 0, "k")))
    flipped[len(flipped) // 2] ^= 0x10
    raw.plant(k("model-a", 0, "k"), bytes(flipped))
    for part in ("k", "v"):
        raw.plant(k("model-a", 1, part), raw.get(k("model-b", 1, part)))
    raw.plant(k("model-a", 2, "k"), raw.get(k("model-a", 2, "k"))[:-4096])

    assert a.batch_get_v1(keys, tokens(8)) == [True] * PAGES, "every planted value is served"
    assert not torch.equal(page(pool, 8), page(pool, 0)), "the flipped bit reached the host pool"
    assert torch.equal(page(pool, 9), page(pool, 5)), "model B's page was loaded as model A's"
    assert not torch.equal(page(pool, 10), page(pool, 2)), "the short value was loaded as a whole page"
    assert torch.equal(page(pool, 11), page(pool, 3))


def test_sglangs_own_mooncake_tests_pass_on_this_master(mooncake_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's CPU-runnable storage tests (sglang/srt/mem_cache/storage/mooncake_store/test_mooncake_store.py of
    the release) against SGLang's own backend, configured by its environment variables."""
    from sglang.srt.mem_cache.storage.mooncake_store import test_mooncake_store as theirs

    for var, value in {
        "MOONCAKE_MASTER": mooncake_server.master_addr,
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_DEVICE": "",
        "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
        "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0",
    }.items():
        monkeypatch.setenv(var, value)
    run_sglang_mooncake_tests(theirs)


def test_sglangs_own_mooncake_tests_pass_on_kvtier(
    mooncake_server: Any, monkeypatch: pytest.MonkeyPatch, closing: list[Any]
) -> None:
    """The same tests of SGLang's, with kvtier's backend as the store they build."""
    from sglang.srt.mem_cache.storage.mooncake_store import test_mooncake_store as theirs

    def kvtier_store(config: Any) -> KvtierStore:
        store = KvtierStore(dataclasses.replace(config, extra_config=extra(mooncake_server, l3_zero_copy=True)))
        closing.append(store)
        return store

    monkeypatch.setattr(theirs, "MooncakeStore", kvtier_store)
    run_sglang_mooncake_tests(theirs)
    assert len(closing) == 5 and all(s.stats()["l3_rejected"] == 0 for s in closing)


def run_sglang_mooncake_tests(theirs: Any) -> None:
    """What the module's ``__main__`` runs: the single operation and the batch one on four rank configurations."""
    theirs.test_single_operation()
    for mla, rank, size in ((False, 0, 1), (True, 0, 1), (False, 1, 4), (True, 3, 8)):
        theirs.test_batch_operation(theirs.make_hicache_storage_config(is_mla_model=mla, tp_rank=rank, tp_size=size))


def mamba_pool(slots: int = 8, layers: int = 2) -> Any:
    """A real SGLang Mamba state pool on the CPU (``MambaPoolHost``, page-first: one slot a page), built from CPU
    "device" states as SGLang's hybrid pool assembler builds it from GPU ones."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, 4, 8, dtype=torch.float32),
        conv=(torch.zeros(layers, slots, 3, 16, dtype=torch.bfloat16),),
    )
    return MambaPoolHost(info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")


def state(pool: Any, slot: int) -> list[torch.Tensor]:
    """The bytes of one Mamba slot, a tensor per state buffer."""
    return [b[slot].reshape(-1).view(torch.uint8).clone() for b in pool.get_hybrid_pool_buffer()]


def hybrid(server: Any, closing: list[Any], zero_copy: bool = False, mla: bool = False, **ranks: Any) -> Any:
    """A backend built by SGLang's factory with a KV pool (MLA's, ``mla``) and a Mamba pool registered as SGLang's
    hybrid cache controller registers them (``register_mem_pool_host``, then ``register_mem_host_pool_v2`` for
    each): the backend, the KV pool and the Mamba pool."""
    kv, mamba = host_pool(mla=mla, pages=16), mamba_pool()
    storage = build("dynamic", extra(server, l3_zero_copy=zero_copy), kv, is_mla_model=mla, **ranks)
    closing.append(storage)
    storage.register_mem_host_pool_v2(kv, PoolName.KV)
    storage.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    storage.on_host_pools_registered()
    kv.kv_buffer.view(torch.uint8).random_(0, 256)
    for b in mamba.get_hybrid_pool_buffer():
        b.view(torch.uint8).random_(0, 256)
    return storage, kv, mamba


@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_hybrid_models_states_round_trip_through_the_v2_calls(
    mooncake_server: Any, closing: list[Any], zero_copy: bool
) -> None:
    storage, kv, mamba = hybrid(mooncake_server, closing, zero_copy)
    keys = page_hashes(PAGES)
    # SGLang backs up the KV pages of a node and the Mamba state at its end (the last page).
    written = storage.batch_set_v2(
        [
            PoolTransfer(name=PoolName.KV, keys=keys, host_indices=tokens(0)),
            PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], host_indices=torch.tensor([2])),
        ]
    )
    assert written == {PoolName.KV: [True] * PAGES, PoolName.MAMBA: [True]}

    trailing = PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    hit = storage.batch_exists_v2([*keys, page_hashes(1)[0]], [trailing])
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (PAGES, [PAGES])
    assert hit.extra_pool_hit_pages == {PoolName.KV: PAGES, PoolName.MAMBA: PAGES}
    # Only the state of the last page exists: every page's (all_pages) restores nothing, nor does a shorter prefix.
    every = PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    assert storage.batch_exists_v2(keys, [every]).restorable_prefix_pages == []
    assert storage.batch_exists_v2(keys[:-1], [trailing]).kv_hit_pages == 0

    got = storage.batch_get_v2(
        [
            PoolTransfer(name=PoolName.KV, keys=keys, host_indices=tokens(8)),
            PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], host_indices=torch.tensor([5])),
        ]
    )
    assert got == {PoolName.KV: [True] * PAGES, PoolName.MAMBA: [True]}
    assert all(torch.equal(page(kv, 8 + p), page(kv, p)) for p in range(PAGES))
    assert all(torch.equal(a, b) for a, b in zip(state(mamba, 5), state(mamba, 2), strict=True))
    # A page's KV object never stands in for its state: the Mamba pool's objects have keys of their own.
    assert storage.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys[:1], host_indices=torch.tensor([6]))]) == {
        PoolName.MAMBA: [False]
    }
    assert set(storage.object_keys(keys, PoolName.MAMBA)).isdisjoint(storage.object_keys(keys))
    stats = storage.stats()
    assert (stats["l3_objects_put"], stats["l3_objects_loaded"], stats["l3_rejected"]) == (5, 5, 0)


def test_planted_states_are_rejected_and_mamba_states_stay_rank_sharded_in_an_mla_model(
    mooncake_server: Any, raw: Raw, closing: list[Any]
) -> None:
    storage, _, mamba = hybrid(mooncake_server, closing)
    keys = page_hashes(2)
    assert storage.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=torch.tensor([0, 1]))])
    skeys = storage.object_keys(keys, PoolName.MAMBA)
    flipped = bytearray(raw.get(skeys[0]))
    flipped[-1] ^= 0x01
    raw.plant(skeys[0], bytes(flipped))
    raw.plant(skeys[1], raw.get(skeys[1])[:-64])
    before = state(mamba, 4)
    got = storage.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=torch.tensor([3, 4]))])
    assert got == {PoolName.MAMBA: [False, False]}
    assert storage.stats()["l3_rejected"] == 2
    assert all(torch.equal(a, b) for a, b in zip(state(mamba, 4), before, strict=True)), "staged: never loaded"

    # An MLA model's KV is one object for every TP rank; its Mamba states are each rank's own.
    ranks = [hybrid(mooncake_server, closing, mla=True, tp_rank=r, tp_size=2)[0] for r in range(2)]
    assert ranks[0].object_keys(keys) == ranks[1].object_keys(keys)
    assert ranks[0].object_keys(keys, PoolName.MAMBA) != ranks[1].object_keys(keys, PoolName.MAMBA)


def test_bad_v2_calls_name_the_bad_value(mooncake_server: Any, closing: list[Any]) -> None:
    storage, _, _ = hybrid(mooncake_server, closing)
    keys = page_hashes(2)
    with pytest.raises(ValueError, match="'swa' is not registered"):
        storage.batch_get_v2([PoolTransfer(name=PoolName.SWA, keys=keys, host_indices=tokens(0, 2))])
    with pytest.raises(ValueError, match="block_groups"):
        storage.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, hit_policy=PoolHitPolicy.BLOCK_GROUPS)])
    with pytest.raises(ValueError, match=r"host_indices must hold 2 pages of 1 tokens, got 3"):
        storage.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=torch.tensor([0, 1, 2]))])
    with pytest.raises(ValueError, match="registered already"):
        storage.register_mem_host_pool_v2(mamba_pool(), PoolName.MAMBA)
    with pytest.raises(ValueError, match="not the one register_mem_pool_host took"):
        storage.register_mem_host_pool_v2(host_pool(pages=16), PoolName.KV)
    # A call refused for one transfer moves no page of the others.
    bad = PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=torch.tensor([0]))
    with pytest.raises(ValueError):
        storage.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=keys, host_indices=tokens(0, 2)), bad])
    assert storage.stats()["l3_objects_put"] == 0 and storage.batch_exists(keys) == 0


def test_bad_settings_are_refused_before_connecting(mooncake_server: Any) -> None:
    cfg = extra(mooncake_server)
    with pytest.raises(ValueError, match="bogus"):
        KvtierStore(storage_config({**cfg, "bogus": 1}))
    with pytest.raises(ValueError, match="l3_group_pages"):
        KvtierStore(storage_config({**cfg, "l3_group_pages": 4}))
    with pytest.raises(ValueError, match="model_version"):
        KvtierStore(storage_config({k: v for k, v in cfg.items() if k != "model_version"}))
    with pytest.raises(ValueError, match="hash_key"):
        KvtierStore(storage_config({k: v for k, v in cfg.items() if k != "hash_key"}))
    with pytest.raises(ValueError, match="l3_staging_bytes"):
        KvtierStore(storage_config({**cfg, "l3_staging_bytes": "nonsense"}))
    with pytest.raises(TypeError, match="HiCacheStorageConfig"):
        KvtierStore(cfg)  # type: ignore[arg-type]


def test_bad_calls_name_the_bad_value(mooncake_server: Any, closing: list[Any]) -> None:
    store = KvtierStore(storage_config(extra(mooncake_server)))
    closing.append(store)
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        store.batch_exists(page_hashes(1))
    pool = host_pool(pages=16)
    with pytest.raises(ValueError, match="tp_lcm_size"):
        build("dynamic", extra(mooncake_server), pool, should_split_heads=True, tp_lcm_size=2)
    store.register_mem_pool_host(pool)
    keys = page_hashes(2)
    with pytest.raises(ValueError, match=r"host_indices must hold 2 pages of 16 tokens, got 16"):
        store.batch_set_v1(keys, tokens(0, 1))
    with pytest.raises(ValueError, match=r"host_indices must lie in \[0, "):
        store.batch_get_v1(keys, tokens(10_000, 2))
    with pytest.raises(ValueError, match=r"keys\[1\]"):
        store.batch_set_v1([keys[0], ""], tokens(0, 2))
    with pytest.raises(TypeError, match="host_indices"):
        store.batch_get_v1(keys, [0, 1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="host_indices must be a 1-D tensor of integers"):
        store.batch_set_v1(keys, tokens(0, 2).float())
    with pytest.raises(ValueError, match=r"values\[0\]"):
        store.batch_set(keys[:1], [torch.zeros(4, 4).t()])
    assert store.stats()["l3_objects_put"] == 0


def test_the_deprecated_tensor_calls_round_trip(mooncake_server: Any, closing: list[Any]) -> None:
    """SGLang's controller without ``interface_v1`` moves flat page tensors through get / set / batch_*."""
    pool = host_pool(pages=16)
    storage = build("dynamic", {**extra(mooncake_server), "interface_v1": 0}, pool)
    closing.append(storage)
    pool.kv_buffer.view(torch.uint8).random_(0, 256)
    keys = page_hashes(PAGES)
    pages = [pool.get_data_page(p * PAGE_SIZE) for p in range(PAGES)]
    assert storage.batch_set(keys, pages) and storage.set(page_hashes(1)[0], pages[0])
    out = storage.batch_get([*keys, page_hashes(1)[0]], [pool.get_dummy_flat_data_page() for _ in range(PAGES + 1)])
    assert out[-1] is None
    assert all(torch.equal(o.view(torch.uint8), p.view(torch.uint8)) for o, p in zip(out, pages, strict=False))
    one = pool.get_dummy_flat_data_page()
    assert storage.get(keys[1], one) is one and torch.equal(one.view(torch.uint8), pages[1].view(torch.uint8))


def test_zero_copy_registers_staging_buffers_only_when_a_deprecated_call_needs_them(
    mooncake_server: Any, closing: list[Any]
) -> None:
    """The zero-copy calls move pages straight from and into the host pool: no staging memory is made or
    registered with the Store (pinned, on RDMA) until a tensor call, which goes through it, comes."""
    from kvtier.l3.store import MooncakeStore
    from kvtier.tools.faults import StoreWrapper

    registered: list[int] = []

    class Recording(StoreWrapper):
        def register(self, ptr: int, size: int) -> None:
            registered.append(size)
            super().register(ptr, size)

    pool = host_pool(pages=16)
    config = storage_config(extra(mooncake_server, l3_zero_copy=True))
    storage = KvtierStore(config, store_factory=lambda c: Recording(MooncakeStore(c)))
    closing.append(storage)
    storage.register_mem_pool_host(pool)
    staging = storage.settings.l3_staging_bytes
    pool.kv_buffer.view(torch.uint8).random_(0, 256)
    keys = page_hashes(PAGES)
    assert all(storage.batch_set_v1(keys, tokens(0))) and all(storage.batch_get_v1(keys, tokens(PAGES)))
    assert staging not in registered
    pages = [pool.get_data_page(p * PAGE_SIZE) for p in range(PAGES)]
    more = page_hashes(PAGES)
    assert storage.batch_set(more, pages)
    out = storage.batch_get(more, [pool.get_dummy_flat_data_page() for _ in range(PAGES)])
    assert all(torch.equal(o.view(torch.uint8), p.view(torch.uint8)) for o, p in zip(out, pages, strict=True))
    assert registered.count(staging) == 2  # one buffer a direction, made once


def test_kvtier_imports_without_sglang() -> None:
    code = (
        "import sys, kvtier, kvtier.l3, kvtier.tools.cli\nassert not [m for m in sys.modules if m.startswith('sglang')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
