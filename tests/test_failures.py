"""Whose error is it: a caller's mistake raises ``kvtier.BadArgument`` and counts nothing (a bad argument, and
whatever the caller's own objects raise while kvtier reads them: ``allocate()``, a block table, a prompt);
kvtier's own failures (a closed host pool, a slot not pinned yet) raise ``kvtier.KvtierError`` and count toward
``max_errors``; ``allocate()`` says "never" with ``kvtier.NEVER``; a bad setting names the setting."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvtier
from kvtier import NEVER, BadArgument, KvtierError
from kvtier._core import COPY_METHODS, EVICTION_POLICIES, HASH_KINDS, PIN_METHODS
from kvtier.cache import HostPrefixCache
from kvtier.copy import HostPool
from kvtier.deepinfer import Cache
from kvtier.settings import (
    INT64_MAX,
    REGISTRY,
    SCOPES,
    SETTINGS,
    SGLANG,
    VLLM,
    VLLM_TIER,
    CacheSettings,
    for_scope,
    scope_names,
)

BLOCK, PAGE, BLOCKS = 16, 4096, 32
PROMPT = list(range(100))  # 6 full blocks: a hit of 96 tokens
TABLE = [3, 7, 1, 9, 4, 2, 5]


def cache(**settings: Any) -> HostPrefixCache:
    pool = torch.zeros(BLOCKS, PAGE, dtype=torch.uint8)
    return HostPrefixCache(pool, block_size=BLOCK, host_bytes="1MiB", preallocate=True, env={}, **settings)


def stored(**settings: Any) -> HostPrefixCache:
    """A cache that holds PROMPT's pages."""
    c = cache(**settings)
    c.store("first", PROMPT, TABLE)
    c.poll()
    c.forget("first")
    assert c.lookup("any", PROMPT) == 96
    return c


def oom() -> list[int]:
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_the_exception_kinds() -> None:
    assert issubclass(BadArgument, ValueError) and issubclass(BadArgument, TypeError)
    assert issubclass(kvtier.PromptMismatchError, BadArgument)
    assert issubclass(KvtierError, RuntimeError) and not issubclass(KvtierError, (ValueError, TypeError))
    assert issubclass(kvtier.CopyError, KvtierError) and issubclass(kvtier.StaleLookupError, KvtierError)
    assert repr(NEVER) == "kvtier.NEVER"


def test_an_out_of_memory_in_allocate_reaches_the_caller_and_counts_nothing() -> None:
    c = stored(max_errors=1)
    with pytest.raises(BadArgument, match="allocate\\(\\) raised OutOfMemoryError: CUDA out of memory") as raised:
        c.resume("b", PROMPT, allocate=oom)
    assert isinstance(raised.value.__cause__, torch.cuda.OutOfMemoryError)
    s = c.stats()
    assert (s["errors"], s["disabled"], s["pages_loaded"]) == (0, False, 0)
    # Nothing of the hit was kept: the next resume of the request is served.
    free = [20, 21, 22, 23, 24, 25, 26]
    assert c.resume("b", PROMPT, allocate=lambda: free) == 96
    c.close()


def test_any_exception_of_allocate_is_the_callers() -> None:
    c = stored(max_errors=1)

    class EngineFault(Exception):
        pass

    def fails() -> list[int]:
        raise EngineFault("the scheduler lost its free list")

    for _ in range(3):
        with pytest.raises(BadArgument, match="allocate\\(\\) raised EngineFault") as raised:
            c.resume("b", PROMPT, allocate=fails)
        assert isinstance(raised.value.__cause__, EngineFault)
    assert (c.stats()["errors"], c.disabled) == (0, False)
    c.close()


def test_never_is_a_miss_and_none_is_retry_later() -> None:
    c = stored()
    assert c.resume("b", PROMPT, allocate=lambda: NEVER) == 0
    assert c.resume("c", PROMPT, allocate=lambda: None) == -1
    s = c.stats()
    assert (s["pages_loaded"], s["errors"], s["bad_arguments"]) == (0, 0, 0)
    assert c.resume("c", PROMPT, allocate=lambda: TABLE) == 96
    c.close()


def test_a_runtime_error_from_allocate_is_no_longer_never() -> None:
    c = stored()

    def cannot_fit() -> list[int]:
        raise RuntimeError("the sequence cannot fit")

    with pytest.raises(BadArgument, match=r"allocate\(\) raised RuntimeError: the sequence cannot fit") as raised:
        c.resume("b", PROMPT, allocate=cannot_fit)
    assert type(raised.value.__cause__) is RuntimeError
    c.close()


class LenRaises(list[int]):
    def __len__(self) -> int:
        raise RuntimeError("__len__ failed")


class IterRaises(list[int]):
    def __iter__(self) -> Any:
        raise RuntimeError("__iter__ failed")


class ItemRaises:
    """A sequence numpy reads item by item."""

    def __len__(self) -> int:
        return 7

    def __getitem__(self, i: int) -> int:
        raise RuntimeError("__getitem__ failed")


@pytest.mark.parametrize("table", [LenRaises(TABLE), IterRaises(TABLE), ItemRaises()], ids=["len", "iter", "item"])
def test_a_block_table_that_raises_is_the_callers_and_counts_nothing(table: Any) -> None:
    c = cache(max_errors=1)
    for _ in range(3):
        with pytest.raises(BadArgument, match="block_table") as raised:
            c.store("a", PROMPT, table)
        assert isinstance(raised.value.__cause__, RuntimeError), raised.value.__cause__
    with pytest.raises(BadArgument, match="blocks"):
        c.release(table)
    s = c.stats()
    assert (s["errors"], s["disabled"], s["pages_stored"]) == (0, False, 0)
    c.store("a", PROMPT, TABLE)  # still serving
    c.poll()
    assert c.lookup("any", PROMPT) == 96
    c.close()


@pytest.mark.parametrize("table", [LenRaises(TABLE), IterRaises(TABLE)], ids=["len", "iter"])
def test_a_table_from_allocate_that_raises_is_the_callers(table: Any) -> None:
    c = stored(max_errors=1)
    with pytest.raises(BadArgument, match="allocate\\(\\)'s block table raised RuntimeError"):
        c.resume("b", PROMPT, allocate=lambda: table)
    assert (c.stats()["errors"], c.disabled) == (0, False)
    c.close()


def test_a_prompt_whose_len_raises_is_the_callers() -> None:
    c = stored(max_errors=1)

    class Prompt(list[int]):
        def __len__(self) -> int:
            raise RuntimeError("__len__ failed")

    with pytest.raises(BadArgument, match="token_ids raised RuntimeError") as raised:
        c.resume("b", Prompt(PROMPT), allocate=lambda: TABLE)
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert (c.stats()["errors"], c.disabled) == (0, False)
    c.close()


def test_a_closed_host_pool_is_kvtiers_failure_and_counts_toward_max_errors(caplog: pytest.LogCaptureFixture) -> None:
    c = stored(max_errors=2)
    pages, _ = c.host_pools
    pages.close()  # the pool's memory is gone under the cache
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        c.store("b", list(range(500, 600)), TABLE)  # no exception reaches the engine
        assert c.stats()["errors"] == 1 and not c.disabled
        assert c.resume("c", PROMPT, allocate=lambda: TABLE) == 0
    s = c.stats()
    assert (s["errors"], s["disabled"]) == (2, True)
    assert "KvtierError" in caplog.text
    c.close()


def test_the_host_pools_own_states_raise_kvtier_error() -> None:
    pool = HostPool(4, 16, step_bytes=16, pin=False)
    with pytest.raises(KvtierError, match="slot 0 is not below usable_slots = 0"):
        pool.read(0)  # nothing pinned yet
    with pytest.raises(BadArgument, match="slot 4 is outside the host pool of 4 slots"):
        pool.read(4)
    pool.grow_to(4)
    pool.close()
    with pytest.raises(KvtierError, match="the host pool is closed"):
        pool.write(0, b"x")


def test_the_adapter_counts_a_raising_allocate_as_a_bad_argument_never_silently() -> None:
    """kvtier.deepinfer never raises into the engine: an out-of-memory in try_allocate_seq is logged and counted
    in bad_arguments, the request recomputed (0), and it never counts toward max_errors."""

    class Scheduler:
        def try_allocate_seq(self, seq: Any) -> bool:
            oom()
            return True

    pool = torch.zeros(BLOCKS, PAGE, dtype=torch.uint8)
    engine = SimpleNamespace(
        gpu_blocks=pool, cache_config=SimpleNamespace(block_size=BLOCK), scheduler=Scheduler(), ring_slack=0
    )
    adapter = Cache(engine, size_bytes=1 << 20, preallocate=True, max_errors=1)
    adapter.cache.store("first", PROMPT, TABLE)
    adapter.poll()
    seq = SimpleNamespace(request_id="b")
    assert adapter.try_resume(seq, "b", PROMPT) == 0
    assert adapter.try_resume(seq, "b", PROMPT) == 0
    s = adapter.stats_dict()
    assert (s["bad_arguments"], s["errors"], s["disabled"]) == (2, 0, False)
    adapter.close()


def test_report_error_decides_by_bad_argument_alone() -> None:
    c = cache(max_errors=2)
    c.report_error("call", BadArgument("the caller's"))
    assert (c.stats()["bad_arguments"], c.stats()["errors"]) == (1, 0)
    c.report_error("call", ValueError("a plain ValueError of kvtier's own code"))
    c.report_error("call", OverflowError("an overflow inside kvtier"))
    s = c.stats()
    assert (s["bad_arguments"], s["errors"], s["disabled"]) == (1, 2, True)
    c.close()


# ---- settings ---------------------------------------------------------------------------------------------------

NUMERIC = [s for s in REGISTRY if s.kind in ("bytes", "int", "float")]
HUGE = "9" * 400


@pytest.mark.parametrize("setting", NUMERIC, ids=[s.name for s in NUMERIC])
def test_a_400_digit_value_names_the_setting(setting: Any) -> None:
    for given in (HUGE, int(HUGE)):
        with pytest.raises(BadArgument, match=f"bad setting {setting.name}: must be ") as raised:
            CacheSettings(**{setting.name: given})
        assert len(str(raised.value)) < 200, "the message stays one short line"
    with pytest.raises(BadArgument, match=f"bad setting {setting.name} \\(from {setting.variable}="):
        CacheSettings.resolve({setting.variable: HUGE})


def test_a_size_beyond_64_bits_names_the_setting_at_construction() -> None:
    env = {"KVTIER_PIN_STEP_BYTES": "18446744073709551616"}
    with pytest.raises(ValueError, match="bad setting pin_step_bytes \\(from KVTIER_PIN_STEP_BYTES="):
        HostPrefixCache(torch.zeros(BLOCKS, PAGE, dtype=torch.uint8), block_size=BLOCK, env=env)
    assert CacheSettings(pin_step_bytes=INT64_MAX).pin_step_bytes == INT64_MAX
    assert CacheSettings(host_bytes="1.5KiB").host_bytes == 1536
    assert CacheSettings(host_bytes="8388607TiB").host_bytes == 8388607 << 40  # exactly, not through a float


@pytest.mark.parametrize("master", ["nohost", "host:", ":50051", "host:0", "host:65536", "host:123456789012345678901"])
def test_a_bad_l3_master_names_l3_master(master: str) -> None:
    with pytest.raises(BadArgument, match="bad setting l3_master: must be 'host:port'") as raised:
        CacheSettings(l3="mooncake", l3_master=master, hash_key="k")
    assert "master_addr" not in str(raised.value)
    with pytest.raises(BadArgument, match="l3_master \\(from KVTIER_L3_MASTER="):
        CacheSettings.resolve({"KVTIER_L3_MASTER": master})


def test_unknown_settings_and_bad_kinds_are_bad_arguments() -> None:
    with pytest.raises(BadArgument, match="unknown cache settings: \\['host_byte'\\]"):
        CacheSettings(host_byte=1)
    with pytest.raises(BadArgument, match="bad setting copy_streams"):
        CacheSettings(copy_streams="sometimes")
    with pytest.raises(BadArgument, match="bad setting l3_deadline_ms: must be a finite number"):
        CacheSettings(l3_deadline_ms=float("nan"))


def test_choice_lists_are_the_cores_parsers() -> None:
    assert SETTINGS["hash_kind"].choices == tuple(HASH_KINDS)
    assert SETTINGS["pin_method"].choices == tuple(PIN_METHODS)
    assert SETTINGS["copy_method"].choices == tuple(COPY_METHODS)
    assert SETTINGS["eviction_policy"].choices == tuple(EVICTION_POLICIES)
    pool = torch.zeros(BLOCKS, PAGE, dtype=torch.uint8)
    for hash_kind in HASH_KINDS:
        for copy_method in COPY_METHODS:
            c = cache(hash_kind=hash_kind, copy_method=copy_method)
            assert c.index.hash_kind == hash_kind
            c.close()
    for pin_method in PIN_METHODS:
        HostPool(4, 16, pin=False, pin_method=pin_method).close()
    with pytest.raises(BadArgument, match="bad setting hash_kind: must be one of 'blake3', 'xxh3', got 'md5'"):
        HostPrefixCache(pool, block_size=BLOCK, hash_kind="md5")


# ---- settings by scope -----------------------------------------------------------------------------------------


def test_every_setting_is_the_caches_and_the_adapters_take_theirs() -> None:
    assert scope_names("cache") == tuple(SETTINGS)
    assert scope_names(VLLM) == (
        "host_bytes",
        "eviction_policy",
        "event_buffer",
        "pin_step_bytes",
        "pin_method",
        "copy_method",
        "copy_crossover_bytes",
        "copy_piece_bytes",
        "copy_ctas",
        "store_copy_method",
        "store_copy_ctas",
        "copy_streams",
    )
    l3 = {"hash_key", "model_version", "l3_master", "l3_metadata_server", "l3_protocol", "l3_local_hostname"}
    l3 |= {"l3_segment_bytes", "l3_buffer_bytes", "l3_staging_bytes", "l3_trusted_store"}
    assert set(scope_names(VLLM_TIER)) == l3
    assert set(scope_names(SGLANG)) == l3 | {"l3_zero_copy"}
    with pytest.raises(BadArgument, match="scope must be one of"):
        scope_names("trtllm")


@pytest.mark.parametrize("scope", [VLLM_TIER, SGLANG])
def test_an_l3_adapter_says_once_what_it_requires(scope: str) -> None:
    config = {"l3_master": "127.0.0.1:1", "model_version": "r", "hash_key": "k"}
    assert for_scope(scope, config, env={}, l3="mooncake").model_version == "r"
    without = {k: v for k, v in config.items() if k != "model_version"}
    with pytest.raises(BadArgument, match=re.escape(f"{SCOPES[scope]} needs model_version (or KVTIER_MODEL_VERSION)")):
        for_scope(scope, without, env={}, l3="mooncake")
    assert for_scope(scope, without, env={"KVTIER_MODEL_VERSION": "r2"}, l3="mooncake").model_version == "r2"
    with pytest.raises(BadArgument, match="needs l3_master"):
        for_scope(scope, {"model_version": "r", "hash_key": "k"}, env={}, l3="mooncake")
    with pytest.raises(BadArgument, match=r"config keys \['host_bytes'\] are not settings of "):
        for_scope(scope, {**config, "host_bytes": "1GiB"}, env={}, l3="mooncake")


def test_an_adapter_reads_only_its_own_variables() -> None:
    env = {"KVTIER_HOST_BYTES": "64KiB", "KVTIER_L3": "mooncake", "KVTIER_STAGING_SLOTS": "lots"}
    s = for_scope(VLLM, {}, env=env)
    assert (s.host_bytes, s.l3, s.sources["staging_slots"]) == (64 << 10, None, "default")
    with pytest.raises(BadArgument, match="bad setting host_bytes \\(from KVTIER_HOST_BYTES="):
        for_scope(VLLM, {}, env={"KVTIER_HOST_BYTES": HUGE})
