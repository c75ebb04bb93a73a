"""Exact whatever the engine gets wrong: reused request ids, weights changed in place, peers that write registered
memory, caller errors, pools the engine frees or never let kvtier write, and fork()."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import kvtier
from conftest import needs_mooncake, tiny_engine
from kvtier.cache import HostPrefixCache
from kvtier.deepinfer import Cache
from kvtier.identity import engine_settings, model_identity, weights_identity
from kvtier.tools.engine import Engine
from kvtier.tools.workload import Conversations

BS = 16
PAGE = 1024


def pool(blocks: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(blocks)
    return torch.randint(0, 256, (blocks, PAGE), dtype=torch.uint8, generator=g)


def host_cache(gpu: torch.Tensor, **settings) -> HostPrefixCache:  # type: ignore[no-untyped-def]
    return HostPrefixCache(gpu, block_size=BS, host_bytes=64 * PAGE, preallocate=True, min_hit_tokens=BS, **settings)


def engine(**kw) -> Engine:  # type: ignore[no-untyped-def]
    cfg = dict(num_gpu_blocks=96, num_state_rings=6)
    cfg.update(kw)
    return tiny_engine(**cfg)


WORK = Conversations(conversations=3, turns=3, system_tokens=64, user_tokens=40, answer_tokens=4, seed=11)


# 1. Exact request chains


def test_a_reused_request_id_never_loads_or_stores_another_prompts_kv():
    """Request R looked up with P1, then used for P2 = P1 with one token of block 2 changed, without forget():
    its resume and its store are refused before anything is touched, and an innocent request with P1 still gets
    P1's bytes."""
    gpu = pool()
    cache = host_cache(gpu)
    p1 = list(range(100, 100 + 6 * BS + 5))
    cache.store("innocent", p1, list(range(6)))
    cache.poll()
    want = gpu[:6].clone()
    assert cache.resume("R", p1, allocate=lambda: list(range(10, 16))) == 6 * BS
    cache.poll()
    p2 = list(p1)
    p2[2 * BS + 3] += 1
    allocated = []
    with pytest.raises(kvtier.PromptMismatchError, match=r"token 35 \(in its block at tokens 32\.\.48\)"):
        cache.resume("R", p2, allocate=lambda: allocated.append(1) or list(range(20, 26)))
    assert not allocated, "nothing is allocated for a refused prompt"
    gpu[20:26] = 0xAB
    with pytest.raises(kvtier.PromptMismatchError):
        cache.store("R", p2, list(range(20, 26)))
    cache.poll()
    s = cache.stats()
    assert (s["prompt_mismatches"], s["pages_stored"], s["errors"], s["disabled"]) == (2, 6, 0, False)
    gpu[26:32] = 0
    assert cache.resume("other", p1, allocate=lambda: list(range(26, 32))) == 6 * BS
    assert torch.equal(gpu[26:32], want), "the innocent prefix is P1's bytes"
    cache.close()


class Renamed:
    """An engine's sequence seen under one request id for every request: an engine that reuses ids."""

    def __init__(self, seq) -> None:  # type: ignore[no-untyped-def]
        object.__setattr__(self, "_seq", seq)

    request_id = "R"

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return getattr(self._seq, name)

    def __setattr__(self, name, value) -> None:  # type: ignore[no-untyped-def]
        setattr(self._seq, name, value)


class ReusingEngine:
    """Drives the adapter as an engine would that sends every request under one id and never forgets it."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache
        self.renamed: dict[int, Renamed] = {}

    def _as(self, seq) -> Renamed:  # type: ignore[no-untyped-def]
        return self.renamed.setdefault(id(seq), Renamed(seq))

    def try_resume(self, seq, request_id, prompt_ids) -> int:  # type: ignore[no-untyped-def]
        return self.cache.try_resume(self._as(seq), "R", prompt_ids)

    def on_prefill_step(self, scheduled, finished) -> None:  # type: ignore[no-untyped-def]
        self.cache.on_prefill_step([self._as(s) for s in scheduled], [self._as(s) for s in finished])

    def poll(self) -> None:
        self.cache.poll()

    def release(self, blocks) -> None:  # type: ignore[no-untyped-def]
        self.cache.release(blocks)

    def forget(self, request_id) -> None:  # type: ignore[no-untyped-def]
        pass


@pytest.mark.parametrize("pattern", ["F", "FS"])
def test_an_engine_that_reuses_one_request_id_gets_the_outputs_of_cache_off(pattern):
    off = WORK.run(engine(layer_pattern=pattern))
    e = engine(layer_pattern=pattern)
    cache = Cache(e, size_bytes=8 << 20, num_state_slots=64, preallocate=True)
    e.cache = ReusingEngine(cache)  # type: ignore[assignment]
    assert WORK.run(e) == off
    s = cache.stats_dict()
    assert s["prompt_mismatches"] > 0 and s["bad_arguments"] == s["prompt_mismatches"]
    assert s["errors"] == 0 and not s["disabled"]
    cache.close()


def test_bools_are_not_token_ids():
    ix = kvtier.Index(kvtier.IndexConfig(8, block_size=2))
    for ids in ([True, False], [1, True], (0, False), np.array([True, False]), torch.tensor([True, False])):
        with pytest.raises(TypeError):
            ix.lookup("r", ids)
    assert not ix.forget("r")


# 2. A model identity the engine vouches for


def test_the_weights_identity_covers_every_byte():
    weights = {"w": torch.zeros(1 << 20, dtype=torch.uint8), "b": torch.zeros(7, dtype=torch.float32)}
    before = weights_identity(weights)
    weights["w"][300_001] = 1  # far from the start, the middle and the end
    assert weights_identity(weights) != before
    weights["w"][300_001] = 0
    assert weights_identity(weights) == before
    weights["b"][3] = -0.0  # the bytes of -0.0 differ from those of 0.0
    assert weights_identity(weights) != before


def test_kv_settings_outside_the_config_change_the_identity():
    e = engine()
    base = model_identity(e, None)
    assert "model_weights" in base and "model_config" in base
    e.kv_cache_dtype = "fp8_e4m3"
    e4m3 = model_identity(e, None)
    e.kv_cache_dtype = "fp8_e5m2"
    e5m2 = model_identity(e, None)
    e.rope_scaling = {"type": "yarn", "factor": 4.0}
    rope = model_identity(e, None)
    assert len({str(sorted(x.items())) for x in (base, e4m3, e5m2, rope)}) == 4
    assert engine_settings(e)["kv.kv_cache_dtype"] == '"fp8_e5m2"'
    named = model_identity(e, "ckpt-sha256:abc")
    assert "model_weights" not in named, "a revision the deployment vouches for replaces the weights digest"


@pytest.mark.parametrize("layout", ["page-first", "layer-first"])
def test_weights_updated_in_place_are_never_served_old_kv(layout):
    """The reference engine updates its weights in place after the first turn (an RL weight sync): with
    set_model_version its outputs stay those of cache-off; without it the cache serves KV of the old weights."""

    def run(cache_on: bool, announce: bool) -> tuple[dict[str, list[int]], dict]:
        e = engine(layout=layout)
        cache = None
        if cache_on:
            cache = Cache(e, size_bytes=8 << 20, num_state_slots=64, preallocate=True)
            e.cache = cache

        def update(turn: int) -> None:
            if turn == 0:
                for layer in e.model.layers:
                    layer.w["wk"].mul_(1.5)
                if cache is not None and announce:
                    cache.set_model_version("step-1")

        out = WORK.run(e, on_turn=update)
        stats = cache.stats_dict() if cache is not None else {}
        if cache is not None:
            cache.close()
        return out, stats

    off, _ = run(False, False)
    on, s = run(True, True)
    assert on == off
    assert s["model_versions"] == 1 and s["pages_retired"] > 0 and s["hits"] > 0
    stale, _ = run(True, False)
    assert stale != off, "the control: without set_model_version the old KV is served"


# 5. Caller errors never disable the cache


def test_every_adapter_entry_point_takes_none_and_wrong_types_without_raising():
    e = engine()
    cache = Cache(e, size_bytes=8 << 20, num_state_slots=64, preallocate=True)
    e.cache = cache
    calls = [
        lambda: cache.try_resume(None, None, None),
        lambda: cache.try_resume(object(), "r", [1, 2, 3]),
        lambda: cache.try_resume(object(), 7, "abc"),
        lambda: cache.on_prefill_step(None, None),
        lambda: cache.on_prefill_step([None, 3, object()], []),
        lambda: cache.on_prefill_step(5, "x"),
        lambda: cache.release(None),
        lambda: cache.release(["a"]),
        lambda: cache.wait_layer(None),
        lambda: cache.wait_layer("0"),
        lambda: cache.forget(None),
        lambda: cache.forget(["unhashable"]),
    ]
    for call in calls:
        call()
    s = cache.stats_dict()
    assert s["bad_arguments"] >= len(calls) and s["errors"] == 0 and not s["disabled"]
    assert WORK.run(e) == WORK.run(engine()), "the cache still serves exactly"
    cache.close()


def test_an_allocate_that_returns_a_meta_tensor_is_the_callers_error():
    cache = host_cache(pool())
    prompt = list(range(3 * BS + 1))
    cache.store("a", prompt, [0, 1, 2])
    cache.poll()
    for _ in range(3):
        with pytest.raises(TypeError, match="meta"):
            cache.resume("b", prompt, allocate=lambda: torch.zeros(3, dtype=torch.int64, device="meta"))
    s = cache.stats()
    assert (s["errors"], s["disabled"]) == (0, False)
    assert cache.resume("c", prompt, allocate=lambda: [5, 6, 7]) == 3 * BS
    cache.close()


def test_a_sequence_without_get_len_is_a_bad_argument():
    e = engine()
    cache = Cache(e, size_bytes=8 << 20, num_state_slots=64, preallocate=True)

    class Data:
        def get_token_ids(self) -> list[int]:
            return list(range(3 * 16 + 1))

    class NoLen:
        request_id, chunked_rest_len, block_table, data = "x", 0, [0, 1, 2], Data()

    for _ in range(4):
        cache.on_prefill_step([NoLen()], [])
    s = cache.stats_dict()
    assert (s["bad_arguments"], s["errors"], s["disabled"]) == (4, 0, False)
    cache.close()


# 6. No signal from the engine's memory


def test_a_pool_freed_resized_or_swapped_after_construction_is_refused():
    prompt = list(range(2 * BS + 1))
    for change in ("free", "resize", "swap"):
        gpu = pool()
        cache = host_cache(gpu)
        cache.store("a", prompt, [0, 1])
        cache.poll()
        if change == "free":
            gpu.untyped_storage().resize_(0)
        elif change == "resize":
            gpu.resize_(4, PAGE)
            gpu.untyped_storage().resize_(4 * PAGE)
        else:
            gpu.set_(torch.zeros((32, PAGE), dtype=torch.uint8))
        with pytest.raises(ValueError, match="changed after the copier was built"):
            cache.resume("b", prompt, allocate=lambda: [3, 4])
        with pytest.raises(ValueError, match="changed after the copier was built"):
            cache.store("c", list(range(500, 500 + 2 * BS)), [5, 6])
        assert not cache.stats()["disabled"]
        cache.close()


def test_a_read_only_cpu_pool_is_refused_at_construction():
    m = mmap.mmap(-1, 32 * PAGE, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch says the buffer is not writable, and makes a tensor of it anyway
        ro = torch.frombuffer(m, dtype=torch.uint8).view(32, PAGE)
    with pytest.raises(ValueError, match="not writable memory"):
        host_cache(ro)
    del ro
    m.close()


@pytest.mark.parametrize("end", ["sys.exit(3)", "os._exit(4)", "pass", "raise RuntimeError('boom')"])
def test_a_forked_child_neither_crashes_nor_blocks(end, tmp_path):
    """A child of a process whose cache has a live L3 Store: the inherited cache is closed there (calls are
    no-ops, close() returns at once) and the child ends as it says, however it exits."""
    needs_mooncake()
    code = textwrap.dedent(f"""
        import os, sys, time, torch
        from kvtier.cache import HostPrefixCache
        from kvtier.tools.mooncake import LocalMooncake
        with LocalMooncake(segment_bytes=64 << 20) as server:
            c = HostPrefixCache(torch.zeros((16, 4096), dtype=torch.uint8), block_size=16, host_bytes=16 * 4096,
                preallocate=True, l3="mooncake", l3_master=server.master_addr, hash_key="k", fingerprint_fields={{}})
            assert c.flush_l3(20)
            pid = os.fork()
            if pid == 0:
                t0 = time.monotonic()
                assert c.resume("r", list(range(64)), allocate=lambda: [0, 1, 2]) == 0
                c.close()
                assert time.monotonic() - t0 < 1.0, "close() of an inherited cache returns at once"
                {end}
            else:
                _, status = os.waitpid(pid, 0)
                print("signal" if os.WIFSIGNALED(status) else "exit", os.WTERMSIG(status) if os.WIFSIGNALED(status)
                      else os.WEXITSTATUS(status))
                c.close()
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    want = {"sys.exit(3)": "exit 3", "os._exit(4)": "exit 4", "pass": "exit 0"}.get(end, "exit 1")
    assert out.stdout.strip().splitlines()[-1] == want, out.stdout + out.stderr[-2000:]


# 3 and 4. L3: nothing a peer can write is served; no forger wins for good


def l3_cache(e: Engine, master: str, **settings) -> Cache:  # type: ignore[no-untyped-def]
    settings.setdefault("hash_key", "kvtier exactness tests")
    cache = Cache(
        e, size_bytes=8 << 20, num_state_slots=64, preallocate=True, l3="mooncake", l3_master=master, **settings
    )
    e.cache = cache
    assert cache.cache.flush_l3(20)
    return cache


class Peer:
    """The Store of this instance, and another process on the Mooncake network that writes 0xEE into every
    buffer this instance registered just before each of its exists() calls (any transfer-engine peer can)."""

    def __init__(self, config) -> None:  # type: ignore[no-untyped-def]
        from kvtier.l3 import MooncakeStore
        from kvtier.tools.faults import StoreWrapper

        class Scribbled(StoreWrapper):
            def register(inner, ptr: int, size: int) -> None:  # noqa: N805
                self.regions.append((ptr, size))
                StoreWrapper.register(inner, ptr, size)

            def exists_many(inner, keys):  # type: ignore[no-untyped-def]  # noqa: N805
                for ptr, size in self.regions:
                    ctypes.memset(ptr, 0xEE, size)
                return StoreWrapper.exists_many(inner, keys)

        self.regions: list[tuple[int, int]] = []
        self.store = Scribbled(MooncakeStore(config))


@pytest.mark.mooncake
@pytest.mark.parametrize("zero_copy", [False, True])
def test_memory_a_peer_can_write_is_never_served(mooncake_server, zero_copy):
    off = WORK.run(engine())
    writer = l3_cache(engine(), mooncake_server.master_addr, fingerprint_fields={"model": f"peer-{zero_copy}"})
    WORK.run(writer.engine)
    assert writer.cache.flush_l3(30)
    peers: list[Peer] = []

    def scribbled(config):  # type: ignore[no-untyped-def]
        peers.append(Peer(config))
        return peers[-1].store

    reader = l3_cache(
        engine(),
        mooncake_server.master_addr,
        fingerprint_fields={"model": f"peer-{zero_copy}"},
        l3_zero_copy=zero_copy,
        l3_store=scribbled,
    )
    got = WORK.run(reader.engine)
    assert reader.cache.flush_l3(30)
    s = reader.stats_dict()
    if zero_copy:
        assert got != off, "the control: zero-copy, the peer's bytes reach the engine"
    else:
        assert got == off and s["l3_hits"] > 0, s
        assert all(peers[0].regions), "only the staging buffers are registered"
    writer.close()
    reader.close()


def test_l3_with_the_public_default_key_is_refused_unless_the_store_is_trusted():
    gpu = pool()
    with pytest.raises(ValueError, match="public default hash_key"):
        HostPrefixCache(gpu, block_size=BS, l3="mooncake", l3_master="127.0.0.1:1", fingerprint_fields={})
    with pytest.raises(ValueError, match="public default hash_key"):
        HostPrefixCache(gpu, block_size=BS, env={"KVTIER_L3": "mooncake", "KVTIER_L3_MASTER": "127.0.0.1:1"})
    trusted = HostPrefixCache(
        gpu, block_size=BS, l3="mooncake", l3_master="127.0.0.1:1", l3_trusted_store=True, fingerprint_fields={}
    )
    trusted.close()


@pytest.mark.mooncake
def test_a_forged_object_is_removed_and_put_again_by_the_next_honest_store(mooncake_server, mooncake_store):
    from kvtier.l3 import MooncakeStore
    from kvtier.tools.faults import StoreWrapper

    off = WORK.run(engine())
    put_keys: list[str] = []

    class Recorded(StoreWrapper):
        def put_many(self, keys, ptrs, sizes):  # type: ignore[no-untyped-def]
            put_keys.extend(keys)
            return super().put_many(keys, ptrs, sizes)

    fields = {"fingerprint_fields": {"model": "forgery"}}
    a = l3_cache(engine(), mooncake_server.master_addr, l3_store=lambda c: Recorded(MooncakeStore(c)), **fields)
    WORK.run(a.engine)
    assert a.cache.flush_l3(30)
    # A writer without the deployment's key replaces every page group with bytes of its own of the same length
    # (a put never replaces an object: it removes each first).
    groups = [k for k in put_keys if "/g4/" in k]
    forged = np.full(80 + 4 * a.engine.page_bytes, 0x5A, dtype=np.uint8)
    mooncake_store.register(forged.ctypes.data, forged.nbytes)
    for group in groups:
        assert mooncake_store.remove(group, True) == 0
        assert mooncake_store.put_many([group], [[forged.ctypes.data]], [[forged.nbytes]]) == [0]
    b = l3_cache(engine(), mooncake_server.master_addr, **fields)
    assert WORK.run(b.engine) == off
    assert b.cache.flush_l3(30)
    sb = b.stats_dict()
    assert sb["l3_rejected"] >= 1 and sb["l3_rejected_removed"] >= 1, str({k: v for k, v in sb.items() if "l3" in k})
    # b computed the prefix itself and its store put the right bytes under the removed key: the next reader hits.
    c = l3_cache(engine(), mooncake_server.master_addr, **fields)
    assert WORK.run(c.engine) == off
    sc = c.stats_dict()
    assert sc["l3_hits"] > 0 and sc["l3_rejected"] == 0, sc
    for x in (a, b, c):
        x.close()
    mooncake_store.unregister(forged.ctypes.data)
