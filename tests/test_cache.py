"""The host prefix cache on the reference engine: exactness, deferral, lazy pinning, failure policy, settings."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from conftest import tiny_engine
from kvtier.cache import HostPrefixCache
from kvtier.deepinfer import Cache
from kvtier.tools.engine import Engine
from kvtier.tools.workload import Conversations

WORK = Conversations(conversations=3, turns=3, system_tokens=64, user_tokens=20, answer_tokens=4, seed=1)


def engine(layout: str = "page-first", pattern: str = "FS", device: str = "cpu", **kw) -> Engine:
    return tiny_engine(layout=layout, layer_pattern=pattern, device=device, **kw)


def attach(e: Engine, **settings) -> Cache:
    settings.setdefault("size_bytes", 8 << 20)
    settings.setdefault("num_state_slots", 64 if e.gpu_states is not None else None)
    settings.setdefault("preallocate", True)
    cache = Cache(e, **settings)
    e.cache = cache
    return cache


def page_bytes(e: Engine, block: int) -> torch.Tensor:
    if e.gpu_blocks is not None:
        return e.gpu_blocks[block].clone()
    return torch.cat([layer[block] for layer in e.gpu_layers])


@pytest.mark.parametrize("layout", ["page-first", "layer-first"])
@pytest.mark.parametrize("pattern", ["FS", "F", "SFF"])
def test_outputs_identical_to_cache_off(layout, pattern):
    off = WORK.run(engine(layout, pattern))
    e = engine(layout, pattern)
    cache = attach(e)
    on = WORK.run(e)
    assert on == off
    s = cache.stats_dict()
    assert s["hits"] >= WORK.conversations * (WORK.turns - 1), s
    assert s["errors"] == 0 and not s["disabled"]
    assert e.total_prefill_tokens_computed < sum(st.prompt_tokens for st in e.stats.values())
    cache.cache.index.check()


class Recorder(Cache):
    """Keeps the K/V bytes of each resumed sequence's cached pages right after the load."""

    def __init__(self, e: Engine, **kw) -> None:
        super().__init__(e, size_bytes=8 << 20, num_state_slots=64, preallocate=True, **kw)
        e.cache = self
        self.loaded: dict[str, list[torch.Tensor]] = {}

    def try_resume(self, seq, request_id, prompt_ids):
        hit = super().try_resume(seq, request_id, prompt_ids)
        if hit > 0:
            self.poll()
            self.loaded[request_id] = [page_bytes(self.engine, b) for b in seq.block_table[: hit // 16]]
        return hit


class Snapshot:
    """A cache-off observer that keeps every sequence's pages at the end of its prefill."""

    def __init__(self, e: Engine) -> None:
        self.engine, self.pages = e, {}
        e.cache = self

    def try_resume(self, seq, request_id, prompt_ids):
        return 0

    def on_prefill_step(self, scheduled, finished):
        for seq in scheduled:
            if seq.chunked_rest_len == 0:
                self.pages[seq.request_id] = [page_bytes(self.engine, b) for b in seq.block_table]

    def poll(self):
        pass

    def forget(self, request_id):
        pass


@pytest.mark.parametrize("layout", ["page-first", "layer-first"])
def test_resumed_kv_bytes_equal_recomputed(layout):
    e_off = engine(layout)
    snap = Snapshot(e_off)
    WORK.run(e_off)
    e_on = engine(layout)
    rec = Recorder(e_on)
    WORK.run(e_on)
    assert rec.loaded, "no request was resumed"
    for rid, pages in rec.loaded.items():
        for i, page in enumerate(pages):
            assert torch.equal(page, snap.pages[rid][i]), f"{rid} page {i} differs from the recomputed one"


def test_gpu_exhaustion_defers_and_stays_exact():
    work = Conversations(conversations=4, turns=3, system_tokens=96, user_tokens=24, answer_tokens=4, seed=2)
    off = work.run(engine(num_gpu_blocks=40, max_batch=4))
    e = engine(num_gpu_blocks=40, max_batch=4)
    cache = attach(e)
    assert work.run(e) == off
    s = cache.stats_dict()
    assert s["deferred"] > 0 and s["hits"] > 0
    assert s["lookups"] == work.conversations * work.turns, "a retried request counts once"


def test_tiny_host_pool_evicts_and_stays_exact():
    e = engine()
    cache = attach(e, size_bytes=12 * e.page_bytes, num_state_slots=3)
    assert WORK.run(e) == WORK.run(engine())
    s = cache.stats_dict()
    assert s["pages_evicted"] > 0 and s["pages_used"] <= 12 and s["states_used"] <= 3
    cache.cache.index.check()


@pytest.mark.gpu
def test_host_pool_is_pinned_lazily_off_the_loop():
    e = engine(device="cuda")
    cache = attach(e, preallocate=False, pin_step_bytes=256 << 10)
    assert cache.stats_dict()["host_bytes_pinned"] == 0, "nothing is allocated before the first store"
    off = WORK.run(engine(device="cuda"))
    assert WORK.run(e) == off
    assert cache.cache.wait_pinned(30)
    s = cache.stats_dict()
    assert s["host_bytes_pinned"] == s["page_slots"] * s["page_bytes"] + s["state_slots"] * s["state_bytes"]


def test_a_cpu_pools_host_pool_is_not_pinned_and_keeps_the_first_store(caplog):
    """Over a CPU pool (memcpy) nothing is pinned and nothing waits: every host slot is usable from construction,
    the first store is kept, and nothing is said about pinning."""
    e = engine(pattern="F")
    c = HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes="2MiB", pin_step_bytes="64KiB")
    assert c.host_pools[0].pinning == "none" and c.wait_pinned(0)
    with caplog.at_level(logging.INFO, logger="kvtier"):
        c.store("first", list(range(64)), [0, 1, 2, 3])
    c.poll()
    s = c.stats()
    assert s["store_skipped_pinning"] == 0 and s["pages_stored"] == 4 and s["host_bytes_pinned"] == 0, s
    assert c.lookup("q", list(range(64))) == 48
    assert not [r for r in caplog.records if "pinned" in r.message], caplog.records
    c.close()


def test_failing_state_callback_falls_back_then_disables(caplog):
    e = engine()
    calls = {"n": 0}

    def broken(seq, pos, staging):
        calls["n"] += 1
        raise RuntimeError("state kernel failed")

    e.load_state = broken  # the engine callback the adapter hands to the cache
    cache = attach(e, max_errors=3)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        out = WORK.run(e)
    assert out == WORK.run(engine()), "failed loads recompute: outputs unchanged"
    s = cache.stats_dict()
    assert s["disabled"] and s["errors"] >= 3 and calls["n"] == 3
    assert any("disables itself" in r.message for r in caplog.records)
    cache.cache.index.check()
    assert s["pages_used"] == s["pages_evictable"], "aborted loads released every page"


def test_bad_arguments_raise_before_anything_is_copied():
    e = engine()
    c = HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes=1 << 20)
    with pytest.raises(TypeError, match="dtype float64"):
        c.store("r", np.zeros(40, dtype=np.float64), list(range(3)))
    with pytest.raises(ValueError, match="-3"):
        c.store("r", [1, 2, -3] * 20, list(range(4)))
    with pytest.raises(ValueError, match="block_table has 1 blocks"):
        c.store("r", list(range(40)), [0])
    with pytest.raises(ValueError, match="block id -2 is outside the GPU pool of 64 blocks"):
        c.store("r", list(range(40)), [0, -2, 3])
    with pytest.raises(ValueError, match="host_bytes 10 holds no page"):
        HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes=10)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        HostPrefixCache(e.gpu_blocks, block_size=0)
    with pytest.raises(TypeError, match="dtype"):
        HostPrefixCache(e.gpu_blocks.view(torch.float32), block_size=16)
    with pytest.raises(ValueError, match="needs state_slots > 0"):
        HostPrefixCache(e.gpu_blocks, block_size=16, state_bytes=e.state_bytes)
    assert c.stats()["pages_stored"] == 0 and c.stats()["errors"] == 0


def test_settings_come_from_the_environment_and_are_checked():
    e = engine(pattern="F")
    c = HostPrefixCache(e.gpu_blocks, block_size=16, env={"KVTIER_HOST_BYTES": "1MiB", "KVTIER_KEEP_TOKENS": "5"})
    assert c.page_slots == (1 << 20) // e.page_bytes and c.index.keep_tokens == 5
    c2 = HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes=2 << 20, env={"KVTIER_HOST_BYTES": "1MiB"})
    assert c2.page_slots == (2 << 20) // e.page_bytes, "an argument wins over the environment"
    with pytest.raises(ValueError, match="KVTIER_KEEP_TOKENS='0'"):
        HostPrefixCache(e.gpu_blocks, block_size=16, env={"KVTIER_KEEP_TOKENS": "0"})
    with pytest.raises(ValueError, match="KVTIER_HOST_BYTES='lots'"):
        HostPrefixCache(e.gpu_blocks, block_size=16, env={"KVTIER_HOST_BYTES": "lots"})
    with pytest.raises(ValueError, match="hash_kind"):
        HostPrefixCache(e.gpu_blocks, block_size=16, hash_kind="md5")
    with pytest.raises(TypeError, match="unknown cache settings"):
        HostPrefixCache(e.gpu_blocks, block_size=16, host_byte=1)


def test_namespaces_isolate_tenants():
    e = engine(pattern="F")
    c = HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes=4 << 20, preallocate=True)
    prompt = list(range(100))
    c.store("a", prompt, list(range(7)), namespace="tenant-a")
    c.poll()
    assert c.lookup("x", prompt, namespace="tenant-a") == 96
    assert c.lookup("y", prompt, namespace="tenant-b") == 0
    assert c.lookup("z", prompt) == 0


def test_prometheus_metrics():
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvtier.metrics import register_metrics

    e = engine()
    cache = attach(e)
    WORK.run(e)
    registry = prometheus_client.CollectorRegistry()
    register_metrics(cache, registry, labels={"engine": "ref"})
    hits = registry.get_sample_value("kvtier_hits_total", {"engine": "ref"})
    assert hits == cache.stats_dict()["hits"] > 0
    assert registry.get_sample_value("kvtier_token_hit_rate", {"engine": "ref"}) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["page-first", "layer-first"])
def test_outputs_identical_on_gpu(layout):
    work = Conversations(conversations=4, turns=3, system_tokens=128, user_tokens=24, answer_tokens=6, seed=3)
    kw = dict(device="cuda", dtype="bfloat16", num_gpu_blocks=36)  # three prompts at once do not fit: deferrals
    off = work.run(engine(layout, **kw))
    e = engine(layout, **kw)
    cache = attach(e)
    assert work.run(e) == off
    s = cache.stats_dict()
    assert s["hits"] > 0 and s["errors"] == 0 and s["deferred"] > 0
    cache.close()


@pytest.mark.gpu
def test_stores_skipped_while_pinning_are_logged_once_and_counted(caplog):
    e = engine(pattern="F", device="cuda")
    c = HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes="2MiB", pin_step_bytes="64KiB")
    with caplog.at_level(logging.INFO, logger="kvtier"):
        for i in range(3):
            c.store(f"r{i}", list(range(i * 100, i * 100 + 64)), [0, 1, 2, 3])
    s = c.stats()
    assert 1 <= s["store_skipped_pinning"] <= 3, "the first store of a lazily pinned pool is skipped"
    assert s["store_skipped"] >= s["store_skipped_pinning"] and s["errors"] == 0
    told = [r for r in caplog.records if "still being pinned" in r.message]
    assert len(told) == 1 and told[0].levelno == logging.WARNING, told
    assert "preallocate=True" in told[0].message and "wait_pinned()" in told[0].message
    assert c.wait_pinned(30)
    c.store("after", list(range(64)), [0, 1, 2, 3])
    torch.cuda.synchronize()
    c.poll()
    assert c.lookup("q", list(range(64))) == 48 and c.stats()["store_skipped_pinning"] == s["store_skipped_pinning"]
    c.close()
