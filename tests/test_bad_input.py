"""Every public entry point with bad input: a clear exception naming the value (or a documented no-op), never
a crash, and the cache still serves correct hits afterwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvtier
from kvtier.cache import HostPrefixCache
from kvtier.deepinfer import Cache
from kvtier.engine import Engine, EngineConfig
from kvtier.workload import Conversations

WORK = Conversations(conversations=2, turns=2, system_tokens=48, user_tokens=20, answer_tokens=3, seed=5)
NOOP = "no-op"


def engine() -> Engine:
    return Engine(EngineConfig.preset("tiny", num_gpu_blocks=48, num_state_slots=4, chunk_size=32, max_batch=2))


@pytest.fixture(scope="module")
def setup():
    e = engine()
    cache = Cache(e, size_bytes=4 << 20, num_state_slots=32, preallocate=True)
    e.cache = cache
    return e, cache


def cases(e: Engine, c: HostPrefixCache):
    """(name, call, expected exception type or NOOP, text the message must contain)."""
    ok_prompt = list(range(64))
    ok_table = list(range(4))
    ix = c.index
    allocate, table = (lambda: True), (lambda: ok_table)
    return [
        # Index
        ("index float tokens", lambda: ix.lookup("r", np.zeros(8)), TypeError, "dtype float64"),
        ("index 2-D tokens", lambda: ix.lookup("r", np.zeros((2, 8), np.int32)), TypeError, "2 dimension"),
        ("index strided tokens", lambda: ix.lookup("r", np.arange(64, dtype=np.int32)[::2]), ValueError, "contiguous"),
        ("index negative id", lambda: ix.lookup("r", [1, -7]), ValueError, "-7"),
        ("index id over int32", lambda: ix.lookup("r", [2**31]), ValueError, "2147483648"),
        ("index string tokens", lambda: ix.lookup("r", "hello"), TypeError, "str"),
        ("index None tokens", lambda: ix.lookup("r", None), TypeError, "NoneType"),
        ("index bad namespace", lambda: ix.lookup("r", [1], namespace=3), TypeError, "namespace"),
        ("index unknown request", lambda: ix.begin_load("nobody", 16), KeyError, "nobody"),
        ("index unknown defer", lambda: ix.defer("nobody"), KeyError, "nobody"),
        ("index unknown ticket", lambda: ix.complete(10**9), KeyError, "1000000000"),
        ("index abort unknown", lambda: ix.abort(10**9), KeyError, "1000000000"),
        ("index bad hit", lambda: (ix.chain("h", ok_prompt), ix.begin_load("h", 17)), ValueError, "17"),
        ("index hit beyond chain", lambda: ix.begin_load("h", 4096), ValueError, "4096"),
        ("index negative seq_len", lambda: ix.plan_store("r", ok_prompt, seq_len=-1), ValueError, "-1"),
        ("index short seq_len", lambda: ix.plan_store("r", ok_prompt, seq_len=3), ValueError, "3"),
        ("index short table", lambda: ix.plan_store("r", ok_prompt, block_table=[1]), ValueError, "1 blocks"),
        ("index negative block", lambda: ix.plan_store("r", ok_prompt, block_table=[0, -1, 2, 3]), ValueError, "-1"),
        ("index forget unknown", lambda: ix.forget("nobody"), NOOP, ""),
        ("index block_size 0", lambda: kvtier.Index(4, block_size=0), ValueError, "block_size"),
        ("index page_slots -1", lambda: kvtier.Index(-1), ValueError, "-1"),
        ("index page_slots 0", lambda: kvtier.Index(0), ValueError, "page_slots"),
        ("index keep 0", lambda: kvtier.Index(4, keep_tokens=0), ValueError, "keep_tokens"),
        ("index hash kind", lambda: kvtier.Index(4, hash_kind="sha1"), ValueError, "sha1"),
        ("seen-set capacity 0", lambda: kvtier.L3Planner(kvtier.Index(8), "fp", group_pages=1, page_base=1,
                                                          page_bytes=1, seen_keys=0), ValueError, "capacity"),
        ("fingerprint bad field", lambda: kvtier.fingerprint({"a=b": "1"}), ValueError, "a=b"),
        # HostPrefixCache
        ("cache float prompt", lambda: c.store("r", np.ones(40), ok_table), TypeError, "float64"),
        ("cache 2-D prompt", lambda: c.store("r", np.ones((2, 40), np.int32), ok_table), ValueError, "1-D"),
        ("cache negative prompt id", lambda: c.resume("r", [5, -1] * 20, allocate=allocate, block_table=table),
         ValueError, "-1"),
        ("cache int64 overflow", lambda: c.store("r", np.array([2**40], np.int64), ok_table), ValueError, str(2**40)),
        ("cache bad table", lambda: c.store("r", ok_prompt, [[1, 2]]), TypeError, "block_table"),
        ("cache empty prompt", lambda: c.store("r", [], []), NOOP, ""),
        ("cache prompt under a block", lambda: c.store("r", [1, 2, 3], []), NOOP, ""),
        ("cache empty resume", lambda: c.resume("r", [], allocate=allocate, block_table=table), NOOP, ""),
        ("cache huge prompt", lambda: c.lookup("huge", np.arange(1 << 20, dtype=np.int32)), NOOP, ""),
        ("cache GPU block out of range", lambda: c.store("oob", ok_prompt, [0, 1, 2, 10**6]), ValueError, "1000000"),
        ("cache CUDA tensor on CPU cache", lambda: HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes=-5),
         ValueError, "-5"),
        ("cache 1-D pool", lambda: HostPrefixCache(e.gpu_blocks[0], block_size=16), ValueError, "2-D"),
        ("cache float pool", lambda: HostPrefixCache(e.gpu_blocks.view(torch.float16), block_size=16), TypeError,
         "dtype"),
        ("cache strided pool", lambda: HostPrefixCache(e.gpu_blocks[::2], block_size=16), ValueError, "contiguous"),
        ("cache misaligned pool", lambda: HostPrefixCache(e.gpu_blocks[:, 8:], block_size=16), ValueError, ""),
        ("cache mixed layer shapes", lambda: HostPrefixCache([e.gpu_blocks, e.gpu_blocks[:, :64].contiguous()], block_size=16),
         ValueError, "shape"),
        ("cache no pool", lambda: HostPrefixCache([], block_size=16), TypeError, "pages"),
        ("cache state without callbacks", lambda: HostPrefixCache(e.gpu_blocks, block_size=16, state_bytes=64,
                                                                  state_slots=2), ValueError, "callbacks"),
        ("cache negative state slots", lambda: HostPrefixCache(e.gpu_blocks, block_size=16, state_slots=-2),
         ValueError, "-2"),
        ("cache bad bool env", lambda: HostPrefixCache(e.gpu_blocks, block_size=16,
                                                       env={"KVTIER_PREALLOCATE": "maybe"}), ValueError, "maybe"),
        ("cache l3 without master", lambda: HostPrefixCache(e.gpu_blocks, block_size=16, l3="mooncake"),
         ValueError, "l3_master"),
        ("cache forget unknown", lambda: c.forget("nobody"), NOOP, ""),
    ]


def test_every_bad_input_is_rejected_and_the_cache_still_serves(setup):
    e, adapter = setup
    c = adapter.cache
    tried = 0
    for name, call, expected, text in cases(e, c):
        tried += 1
        if expected is NOOP:
            call()
            continue
        with pytest.raises(expected) as info:
            call()
        assert text in str(info.value), f"{name}: {info.value!r} does not name {text!r}"
    c.index.check()
    assert c.stats()["errors"] == 0 and not c.stats()["disabled"], "bad input is the caller's error, not the cache's"
    # The cache still serves correct hits.
    off = WORK.run(engine())
    assert WORK.run(e) == off
    assert adapter.stats_dict()["hits"] > 0
    assert tried >= 45


def test_adapter_swallows_everything(setup):
    """The DeepInfer-shape adapter never raises into the engine: bad input is logged, counted, a miss."""
    e = engine()
    a = Cache(e, size_bytes=4 << 20, num_state_slots=8, preallocate=True, max_errors=100)

    class BadSeq:
        request_id = "bad"
        block_table = "not a table"
        chunked_rest_len = 0

        def get_len(self):
            return -1

    assert a.try_resume(BadSeq(), "bad", np.zeros(40)) == 0
    a.on_prefill_step([BadSeq()], [])
    a.forget(object())  # type: ignore[arg-type]
    a.poll()
    assert a.stats_dict()["errors"] >= 2


def test_duplicate_request_ids_get_the_right_pages():
    """A request id reused for another prompt rehashes from the first differing block: no wrong hit."""
    e = engine()
    c = HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes=4 << 20, preallocate=True,
                        state_slots=8, state_bytes=e.state_bytes, select_state=e.select_state,
                        load_state=e.load_state)  # fmt: skip
    a, b = list(range(64)), list(range(100, 164))
    c.index.plan_store("dup", a)  # chain of a under "dup" (ticket left to complete below)
    assert c.index.chain("dup", b) == c.index.chain("fresh", b)


def test_calls_after_close_are_no_ops():
    e = engine()
    c = HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes=4 << 20, state_slots=8, state_bytes=e.state_bytes,
                        select_state=e.select_state, load_state=e.load_state, preallocate=True)  # fmt: skip
    c.close()
    c.close()
    assert c.resume("r", list(range(64)), allocate=lambda: True, block_table=lambda: [0, 1, 2, 3]) == 0
    c.store("r", list(range(64)), [0, 1, 2, 3])
    c.poll()
    assert c.lookup("r", list(range(64))) == 0
    assert c.stats()["pages_stored"] == 0
