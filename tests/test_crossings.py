"""One engine call, one call into the core: the calls a store, a resume, a poll, a release and a forget make from
Python into `kvtier._core`, counted by the interpreter's profiler (every call of a function of the extension
module), for both pool layouts, on the CPU and on a GPU with copy streams."""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.cache import HostPrefixCache

BLOCK = 4
BLOCKS = 32
PAGE_BYTES = 256


def core_calls(fn: Callable[[], Any]) -> collections.Counter[str]:
    """The calls into `kvtier._core` that `fn()` makes, by class and method."""
    seen: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "c_call":
            return
        owner = getattr(arg, "__self__", None)
        module = type(owner).__module__ if owner is not None else getattr(arg, "__module__", "")
        if module == "kvtier._core":
            seen[f"{type(owner).__name__}.{arg.__name__}"] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def pools(layout: str, device: str) -> torch.Tensor | list[torch.Tensor]:
    if layout == "page-first":
        return torch.zeros((BLOCKS, PAGE_BYTES), dtype=torch.uint8, device=device)
    return [torch.zeros((BLOCKS, PAGE_BYTES // 4), dtype=torch.uint8, device=device) for _ in range(4)]


def check_one_crossing_each(layout: str, device: str) -> None:
    cache = HostPrefixCache(
        pools(layout, device), block_size=BLOCK, host_bytes=64 * PAGE_BYTES, min_hit_tokens=0, preallocate=True
    )
    try:
        prompt = np.arange(8 * BLOCK + 1, dtype=np.int32)
        table = list(range(9))
        assert core_calls(lambda: cache.store("a", prompt, table)) == {"Cache.store": 1}
        if device == "cuda":
            torch.cuda.synchronize()
        assert core_calls(cache.poll) == {"Cache.poll": 1}
        hits: list[int] = []
        calls = core_calls(lambda: hits.append(cache.resume("b", prompt, allocate=lambda: table)))
        assert calls == {"Cache.resume": 1} and hits == [8 * BLOCK], (calls, hits)
        assert core_calls(lambda: cache.release(table)) == {"Cache.release": 1}
        assert core_calls(lambda: cache.forget("a")) == {"Cache.forget": 1}
        if device == "cuda":
            torch.cuda.synchronize()
        assert core_calls(cache.poll) == {"Cache.poll": 1}
        assert cache.stats()["pages_loaded"] == 8
    finally:
        cache.close()


@pytest.mark.parametrize("layout", ["page-first", "layer-first"])
def test_each_engine_call_is_one_call_into_the_core(layout):
    check_one_crossing_each(layout, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["page-first", "layer-first"])
def test_each_engine_call_is_one_call_into_the_core_with_copy_streams(layout):
    check_one_crossing_each(layout, "cuda")
