"""Every public entry point with bad input: a clear exception naming the value (or a documented no-op), never
a crash, and the cache still serves correct hits afterwards."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import kvtier
from conftest import tiny_engine
from kvtier.cache import HostPrefixCache
from kvtier.copy import HostPool
from kvtier.deepinfer import Cache
from kvtier.settings import machine_memory
from kvtier.tools.engine import Engine
from kvtier.tools.workload import Conversations

WORK = Conversations(conversations=2, turns=2, system_tokens=48, user_tokens=20, answer_tokens=3, seed=5)
NOOP = "no-op"
# The state handle of calls whose arguments are refused (or that store nothing) before any state is selected.
SEQ = object()


def engine() -> Engine:
    return tiny_engine(num_gpu_blocks=48, max_batch=2)


@pytest.fixture(scope="module")
def setup():
    e = engine()
    cache = Cache(e, size_bytes=4 << 20, num_state_slots=32, preallocate=True)
    e.cache = cache
    return e, cache


def cases(e: Engine, c: HostPrefixCache, p: HostPrefixCache):
    """(name, call, expected exception type or NOOP, text the message must contain). ``c`` has states, ``p``
    (pages only, over the same GPU pool) holds the prompt of request "seen" for the resume cases."""
    ok_prompt = list(range(64))
    ok_table = list(range(4))
    ix = c.index
    allocate = lambda: ok_table  # noqa: E731
    big = 2 * (machine_memory() or 1 << 40)
    return [
        # Index
        ("index float tokens", lambda: ix.lookup("r", np.zeros(8)), TypeError, "dtype float64"),
        ("index 2-D tokens", lambda: ix.lookup("r", np.zeros((2, 8), np.int32)), ValueError, "1-D"),
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
        ("index block_size 0", lambda: kvtier.Index(kvtier.IndexConfig(4, block_size=0)), ValueError, "block_size"),
        ("index page_slots -1", lambda: kvtier.Index(kvtier.IndexConfig(-1)), ValueError, "-1"),
        ("index page_slots 0", lambda: kvtier.Index(kvtier.IndexConfig(0)), ValueError, "page_slots"),
        ("index keep 0", lambda: kvtier.Index(kvtier.IndexConfig(4, keep_tokens=0)), ValueError, "keep_tokens"),
        ("index hash kind", lambda: kvtier.Index(kvtier.IndexConfig(4, hash_kind="sha1")), ValueError, "sha1"),
        (
            "seen-set capacity 0",
            lambda: kvtier.L3Planner(
                kvtier.Index(kvtier.IndexConfig(8)), "fp", group_pages=1, pages=HostPool(8, 64), seen_keys=0
            ),
            ValueError,
            "capacity",
        ),
        ("fingerprint bad field", lambda: kvtier.fingerprint({"a=b": "1"}), ValueError, "a=b"),
        # HostPrefixCache
        ("cache float prompt", lambda: c.store("r", np.ones(40), ok_table, state=SEQ), TypeError, "float64"),
        ("cache 2-D prompt", lambda: c.store("r", np.ones((2, 40), np.int32), ok_table, state=SEQ), ValueError, "1-D"),
        (
            "cache negative prompt id",
            lambda: c.resume("r", [5, -1] * 20, allocate=allocate, state=SEQ),
            ValueError,
            "-1",
        ),
        (
            "cache int64 overflow",
            lambda: c.store("r", np.array([2**40], np.int64), ok_table, state=SEQ),
            ValueError,
            str(2**40),
        ),
        ("cache bad table", lambda: c.store("r", ok_prompt, [[1, 2]], state=SEQ), TypeError, "block_table"),
        ("cache wait_layer negative", lambda: c.wait_layer(-1), ValueError, "got -1"),
        ("cache wait_layer bool", lambda: c.wait_layer(True), ValueError, "got True"),
        ("cache wait_layer float", lambda: c.wait_layer(1.5), ValueError, "got 1.5"),
        ("cache no state handle", lambda: c.store("r", ok_prompt, ok_table), TypeError, "state="),
        ("cache no state to resume", lambda: c.resume("r", ok_prompt, allocate=allocate), TypeError, "state="),
        ("cache empty prompt", lambda: c.store("r", [], [], state=SEQ), NOOP, ""),
        ("cache prompt under a block", lambda: c.store("r", [1, 2, 3], [], state=SEQ), NOOP, ""),
        ("cache empty resume", lambda: c.resume("r", [], allocate=allocate, state=SEQ), NOOP, ""),
        ("cache huge prompt", lambda: c.lookup("huge", np.arange(1 << 20, dtype=np.int32)), NOOP, ""),
        (
            "cache GPU block out of range",
            lambda: c.store("oob", ok_prompt, [0, 1, 2, 10**6], state=SEQ),
            ValueError,
            "1000000",
        ),
        (
            "cache negative host_bytes",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes=-5),
            ValueError,
            "-5",
        ),
        ("cache 1-D pool", lambda: HostPrefixCache(e.gpu_blocks[0], block_size=16), ValueError, "2-D"),
        (
            "cache float pool",
            lambda: HostPrefixCache(e.gpu_blocks.view(torch.float16), block_size=16),
            TypeError,
            "dtype",
        ),
        ("cache strided rows", lambda: HostPrefixCache(e.gpu_blocks[:, ::2], block_size=16), ValueError, "contiguous"),
        (
            "cache page_layers",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, page_layers=7),
            ValueError,
            "into 7 layer parts",
        ),
        (
            "cache page_layers bool",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, page_layers=True),
            ValueError,
            "True",
        ),
        (
            "cache page_layers layer-first",
            lambda: HostPrefixCache([e.gpu_blocks, e.gpu_blocks], block_size=16, page_layers=3),
            ValueError,
            "differs from the 2 tensors",
        ),
        ("cache misaligned pool", lambda: HostPrefixCache(e.gpu_blocks[:, 8:], block_size=16), ValueError, ""),
        (
            "cache mixed layer shapes",
            lambda: HostPrefixCache([e.gpu_blocks, e.gpu_blocks[:, :64].contiguous()], block_size=16),
            ValueError,
            "shape",
        ),
        ("cache no pool", lambda: HostPrefixCache([], block_size=16), TypeError, "pages"),
        (
            "cache state without callbacks",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, state_bytes=64, state_slots=2),
            ValueError,
            "callbacks",
        ),
        (
            "cache negative state slots",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, state_slots=-2),
            ValueError,
            "-2",
        ),
        (
            "cache bad bool env",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, env={"KVTIER_PREALLOCATE": "maybe"}),
            ValueError,
            "maybe",
        ),
        (
            "cache l3 without master",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, l3="mooncake"),
            ValueError,
            "l3_master",
        ),
        ("cache forget unknown", lambda: c.forget("nobody"), NOOP, ""),
        # Block ids are integers in range, checked before any conversion (issue 11's list).
        ("block id 2**40", lambda: p.store("b", ok_prompt, [0, 1, 2, 2**40]), ValueError, str(2**40)),
        (
            "int64 block id wraps to 20",
            lambda: p.store("b", ok_prompt, np.array([0, 1, 2, 2**32 + 20])),
            ValueError,
            str(2**32 + 20),
        ),
        (
            "uint64 block id",
            lambda: p.store("b", ok_prompt, np.array([0, 1, 2, 2**63], np.uint64)),
            ValueError,
            str(2**63),
        ),
        ("float block ids", lambda: p.store("b", ok_prompt, [0, 1, 2, 3.7]), TypeError, "3.7"),
        ("float block array", lambda: p.store("b", ok_prompt, np.arange(4.0)), TypeError, "float64"),
        ("float block tensor", lambda: p.store("b", ok_prompt, torch.arange(4.0)), TypeError, "float32"),
        ("bool block ids", lambda: p.store("b", ok_prompt, [True, False, True, False]), TypeError, "bool"),
        ("bool block array", lambda: p.store("b", ok_prompt, np.ones(4, bool)), TypeError, "bool"),
        ("numeric string block ids", lambda: p.store("b", ok_prompt, ["0", "1", "2", "3"]), TypeError, "'0'"),
        ("string block table", lambda: p.store("b", ok_prompt, "0123"), TypeError, "str"),
        ("None block table", lambda: p.store("b", ok_prompt, None), TypeError, "NoneType"),
        ("seq_len 2**64", lambda: p.store("b", ok_prompt, ok_table, seq_len=2**64), ValueError, str(2**64)),
        ("seq_len float", lambda: p.store("b", ok_prompt, ok_table, seq_len=70.5), TypeError, "70.5"),
        ("seq_len bool", lambda: p.store("b", ok_prompt, ok_table, seq_len=True), TypeError, "bool"),
        ("seq_len under the prompt", lambda: p.store("b", ok_prompt, ok_table, seq_len=3), ValueError, "3"),
        ("request id not a str", lambda: p.store(7, ok_prompt, ok_table), TypeError, "request_id"),
        ("namespace int", lambda: p.store("b", ok_prompt, ok_table, namespace=5), TypeError, "namespace"),
        ("resume allocate not callable", lambda: p.resume("b", ok_prompt, allocate=ok_table), TypeError, "allocate"),
        (
            "resume table 2**40",
            lambda: p.resume("seen", ok_prompt, allocate=lambda: [0, 1, 2**40, 3]),
            ValueError,
            str(2**40),
        ),
        (
            "resume table of floats",
            lambda: p.resume("seen", ok_prompt, allocate=lambda: [0.0, 1.0, 2.0]),
            TypeError,
            "0.0",
        ),
        (
            "resume allocate says True",
            lambda: p.resume("seen", ok_prompt, allocate=lambda: True),
            TypeError,
            "block table or None",
        ),
        ("resume short table", lambda: p.resume("seen", ok_prompt, allocate=lambda: [0]), ValueError, "1 blocks"),
        ("lookup None request", lambda: p.lookup(None, ok_prompt), TypeError, "request_id"),
        # Settings: ValueError naming the setting, before any allocation (no setting aborts the process).
        (
            "setting host_bytes text",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes="lots"),
            ValueError,
            "host_bytes",
        ),
        (
            "setting host_bytes bool",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes=True),
            ValueError,
            "host_bytes",
        ),
        (
            "setting host_bytes float",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes=1.5),
            ValueError,
            "host_bytes",
        ),
        (
            "setting host_bytes over memory",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes=big),
            ValueError,
            "host_bytes",
        ),
        (
            "setting host_bytes 1TiB of 1 KiB pages",
            lambda: HostPrefixCache(
                torch.zeros(4, 1024, dtype=torch.uint8),
                block_size=16,
                host_bytes=f"{big >> 40}TiB" if big >> 40 else "1TiB",
            ),
            ValueError,
            "host_bytes",
        ),
        (
            "setting state_slots 2e9",
            lambda: HostPrefixCache(
                e.gpu_blocks,
                block_size=16,
                state_bytes=e.state_bytes,
                state_slots=2_000_000_000,
                select_state=e.select_state,
                load_state=e.load_state,
            ),
            ValueError,
            "state_slots",
        ),
        (
            "setting state_slots 2**31",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, state_slots=2**31),
            ValueError,
            "state_slots",
        ),
        (
            "setting staging_slots 10**6",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, staging_slots=10**6),
            ValueError,
            "staging_slots",
        ),
        (
            "setting pin_step_bytes 0",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, pin_step_bytes=0),
            ValueError,
            "pin_step_bytes",
        ),
        (
            "setting deadline nan",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, l3_deadline_ms=float("nan")),
            ValueError,
            "l3_deadline_ms",
        ),
        (
            "setting keep_tokens 1.5",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, keep_tokens="1.5"),
            ValueError,
            "keep_tokens",
        ),
        (
            "setting host_bytes inf env",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, env={"KVTIER_HOST_BYTES": "1e999"}),
            ValueError,
            "KVTIER_HOST_BYTES",
        ),
        ("setting l3 kind", lambda: HostPrefixCache(e.gpu_blocks, block_size=16, l3="redis"), ValueError, "l3"),
        ("block_size bool", lambda: HostPrefixCache(e.gpu_blocks, block_size=True), ValueError, "block_size"),
        (
            "state_bytes float",
            lambda: HostPrefixCache(e.gpu_blocks, block_size=16, state_bytes=1.5),
            ValueError,
            "state_bytes",
        ),
    ]


def test_every_bad_input_is_rejected_and_the_cache_still_serves(setup):
    e, adapter = setup
    c = adapter.cache
    tried = 0
    p = HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes="4MiB", preallocate=True)
    p.store("seen", list(range(64)), list(range(4)))  # a hit for the resume cases
    p.poll()
    stored = c.stats()["pages_stored"], p.stats()["pages_stored"]
    for name, call, expected, text in cases(e, c, p):
        tried += 1
        if expected is NOOP:
            call()
            continue
        with pytest.raises(expected) as info:
            call()
            pytest.fail(f"{name}: did not raise {expected.__name__}")
        assert text in str(info.value), f"{name}: {info.value!r} does not name {text!r}"
    for cache, n in zip((c, p), stored, strict=True):
        cache.index.check()
        s = cache.stats()
        assert s["errors"] == 0 and s["bad_arguments"] == 0 and not s["disabled"], "bad input counts nothing"
        assert s["pages_stored"] == n and s["in_flight"] == 0, "no bad input stored or held anything"
    assert p.resume("again", list(range(64)), allocate=lambda: [4, 5, 6, 7]) == 48, "p still serves its hit"
    # The cache still serves correct hits.
    off = WORK.run(engine())
    assert WORK.run(e) == off
    assert adapter.stats_dict()["hits"] > 0
    assert tried >= 80


def test_adapter_swallows_everything(setup):
    """The DeepInfer-shape adapter never raises into the engine: bad input is logged, a miss, and counted in
    bad_arguments only (never towards max_errors)."""
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
    s = a.stats_dict()
    assert s["bad_arguments"] >= 3 and s["errors"] == 0 and not s["disabled"], "bad arguments count nothing"


def test_duplicate_request_ids_get_the_right_pages():
    """A request id reused for another prompt without forget() is refused; forgotten, it hashes afresh: no wrong
    hit either way."""
    e = engine()
    c = HostPrefixCache(
        e.gpu_blocks,
        block_size=16,
        host_bytes=4 << 20,
        preallocate=True,
        state_slots=8,
        state_bytes=e.state_bytes,
        select_state=e.select_state,
        load_state=e.load_state,
    )
    a, b = list(range(64)), list(range(100, 164))
    c.index.plan_store("dup", a)  # chain of a under "dup" (ticket left to complete below)
    with pytest.raises(kvtier.PromptMismatchError, match="dup"):
        c.index.chain("dup", b)
    c.forget("dup")
    assert c.index.chain("dup", b) == c.index.chain("fresh", b)


def test_calls_after_close_are_no_ops():
    e = engine()
    c = HostPrefixCache(
        e.gpu_blocks,
        block_size=16,
        host_bytes=4 << 20,
        state_slots=8,
        state_bytes=e.state_bytes,
        select_state=e.select_state,
        load_state=e.load_state,
        preallocate=True,
    )
    c.close()
    c.close()
    assert c.resume("r", list(range(64)), allocate=lambda: [0, 1, 2, 3], state=SEQ) == 0
    c.store("r", list(range(64)), [0, 1, 2, 3], state=SEQ)
    c.poll()
    assert c.lookup("r", list(range(64))) == 0
    assert c.stats()["pages_stored"] == 0


def test_close_during_calls_on_other_threads_raises_nothing_into_them():
    """Engine threads store, resume, poll, look up and forget while another thread closes the cache: no call
    raises, and every call after close() is a no-op."""
    import threading

    e = engine()
    prompt = list(range(64))
    for rnd in range(12):
        c = HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes=4 << 20, preallocate=True)
        raised: list[BaseException] = []
        go = threading.Barrier(4)

        def calls(
            k: int, c: HostPrefixCache = c, go: threading.Barrier = go, raised: list[BaseException] = raised
        ) -> None:
            go.wait()
            try:
                for i in range(300):
                    rid = f"t{k}-{i}"
                    c.resume(rid, prompt, allocate=lambda: [0, 1, 2, 3])
                    c.store(rid, prompt, [0, 1, 2, 3])
                    c.poll()
                    c.lookup(rid, prompt)
                    c.release([0, 1])
                    c.forget(rid)
            except BaseException as x:  # noqa: BLE001 - what the test looks for
                raised.append(x)

        threads = [threading.Thread(target=calls, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        go.wait()
        time.sleep(0.002 * rnd)
        c.close()
        for t in threads:
            t.join()
        assert not raised, f"round {rnd}: {raised[0]!r}"
        assert c.resume("after", prompt, allocate=lambda: [0, 1, 2, 3]) == 0
        assert c.stats()["errors"] == 0


def test_block_tables_of_any_integer_width_are_fine():
    e = engine()
    c = HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes="4MiB", preallocate=True)
    prompt = list(range(64))
    tables = [np.arange(4, dtype=t) for t in (np.int8, np.uint8, np.int16, np.uint32, np.int64, np.uint64)]
    tables += [torch.arange(4, dtype=torch.int64), (0, 1, 2, 3), [np.int64(0), np.uint16(1), 2, 3], range(4)]
    for i, table in enumerate(tables):
        c.store(f"w{i}", prompt, table)
        c.poll()
    assert c.lookup("q", prompt) == 48 and c.stats()["errors"] == 0
    want = e.gpu_blocks[:3].clone()
    e.gpu_blocks[10:13].zero_()
    assert c.resume("r", prompt, allocate=lambda: np.arange(10, 14, dtype=np.uint64)) == 48
    c.poll()
    assert torch.equal(e.gpu_blocks[10:13], want)


def test_stale_lookup_is_a_miss_not_an_error():
    """The pages of a hit leave the host pool between the lookup and the load (here: other stores evict them
    while the engine allocates): the resume is a miss, counted in stale_lookups, not an error."""
    e = engine()
    c = HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes=4 * e.page_bytes, preallocate=True)
    c.store("a", list(range(64)), [0, 1, 2, 3])
    c.poll()

    def allocate():
        c.store("b", list(range(1000, 1064)), [4, 5, 6, 7])  # four new pages evict all of "a"
        c.poll()
        return [8, 9, 10, 11]

    assert c.resume("a2", list(range(64)), allocate=allocate) == 0
    s = c.stats()
    assert s["stale_lookups"] == 1 and s["errors"] == 0 and s["hits"] == 0
    c.index.check()


def test_lookup_keeps_nothing():
    e = engine()
    c = HostPrefixCache(e.gpu_blocks, block_size=16, host_bytes="4MiB", preallocate=True)
    c.store("a", list(range(64)), [0, 1, 2, 3])
    c.poll()
    before = c.stats()
    for i in range(2000):
        assert c.lookup(f"q{i}", list(range(64))) == 48
    after = c.stats()
    assert after["requests"] == before["requests"] and after["lookups"] == before["lookups"]


def test_l3_settings_that_cannot_fit_are_refused_before_anything_starts():
    e = engine()
    big = 2 * (machine_memory() or 1 << 40)
    for name in ("l3_segment_bytes", "l3_buffer_bytes"):
        with pytest.raises(ValueError, match=name):
            HostPrefixCache(
                e.gpu_blocks,
                block_size=16,
                host_bytes="1MiB",
                l3="mooncake",
                l3_master="127.0.0.1:1",
                hash_key="k",
                **{name: big},
            )


@pytest.mark.gpu
def test_staging_that_cannot_fit_on_the_gpu_is_refused():
    pool = torch.zeros(8, 4096, dtype=torch.uint8, device="cuda")
    free = torch.cuda.mem_get_info()[0]
    state_bytes = (free // 4096 + 16) // 16 * 16  # 4096 staging buffers of it exceed what the GPU has free

    def callback(handle, pos, staging):
        raise AssertionError("not reached")

    with pytest.raises(ValueError, match="staging_slots=4096"):
        HostPrefixCache(
            pool,
            block_size=16,
            host_bytes="1MiB",
            state_bytes=state_bytes,
            state_slots=1,
            staging_slots=4096,
            select_state=callback,
            load_state=callback,
        )


def test_engine_key_calls_name_the_bad_key_and_change_nothing() -> None:
    """The index's calls on the engine's own keys: a key of the wrong length or type is refused, naming it, before
    anything is reserved, reported or counted."""
    from kvtier._core import Index, IndexConfig

    ix = Index(IndexConfig(4, block_size=16))
    ticket, indices, slots, evicted = ix.store_keys([b"a" * 36, b"b" * 36])
    assert (indices, slots.tolist(), evicted) == (None, [0, 1], [])
    before = ix.stats()
    for call, message in [
        (lambda: ix.store_keys([b"c" * 36, b"d" * 65]), "keys[1]: an engine key must be 1 to 64 bytes, got 65"),
        (lambda: ix.complete_keys([b"a" * 36, b""], True), "keys[1]: an engine key must be 1 to 64 bytes, got 0"),
        (lambda: ix.key_state(b""), "1 to 64 bytes, got 0"),
        (lambda: ix.key_answers(0, 1, 2).lookup(b"x" * 65), "1 to 64 bytes, got 65"),
    ]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            call()
    with pytest.raises(TypeError, match=r"keys\[0\] must be bytes, got str"):
        ix.complete_keys(["a" * 36], True)
    with pytest.raises(TypeError):
        ix.key_state("a" * 36)  # type: ignore[arg-type]
    assert ix.stats() == before
    # Nothing was reported: both keys are still owed to the store.
    assert ix.complete_keys([b"a" * 36, b"b" * 36], True) == (2, [(ticket, False)])
    ix.complete(ticket)
    assert [ix.key_state(k) for k in (b"a" * 36, b"c" * 36)] == [2, 0]
    ix.check()


@pytest.mark.parametrize(
    "value, message",
    [
        (2**64, f"{2**64} is out of range"),
        (-(2**70), f"{-(2**70)} is out of range"),
        (1.5, "expected an int, got float 1.5"),
        (True, "expected an int, got bool True"),
        ("4", "expected an int, got str '4'"),
        (None, "expected an int, got NoneType None"),
    ],
)
def test_integer_arguments_of_the_wrong_kind_or_beyond_their_type_name_the_value(value: object, message: str) -> None:
    """The core's integer arguments: what Python would turn into an OverflowError or a TypeError naming neither the
    value nor the argument is a BadArgument naming the value, with the argument's name in its notes; numpy's
    integers are ints."""
    from kvtier._core import Index, IndexConfig, PageCopier

    ix = Index(IndexConfig(4))
    pool = HostPool(4, 4096, pin=False)
    gpu = torch.zeros(4, 4096, dtype=torch.uint8)
    calls = {
        "slots": lambda v: HostPool(v, 4096, pin=False),
        "page_slots": lambda v: IndexConfig(v),
        "block_size": lambda v: IndexConfig(4, block_size=v),
        "slot": lambda v: ix.page_entry(v),
        "ticket": lambda v: ix.complete(v),
        "piece_bytes": lambda v: PageCopier([gpu], pool, piece_bytes=v),
        "stream": lambda v: PageCopier([gpu], pool).to_host([0], [0], stream=v),
    }
    for name, call in calls.items():
        if value is None and name == "piece_bytes":
            continue  # None is its default: no bound
        with pytest.raises(kvtier.BadArgument, match=message.replace("(", r"\(")) as raised:
            call(value)
        assert f"while processing '{name}'" in getattr(raised.value, "__notes__", []), name
    assert HostPool(np.int64(4), np.uint32(4096), pin=False).slots == 4
    assert IndexConfig(np.int32(8), block_size=np.int64(16)).page_slots == 8
    assert ix.page_entry(np.uint8(3)) is None
