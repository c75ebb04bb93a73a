"""The one L3 object path (rust/l3/path.rs) as SGLang's KvtierStore and vLLM's KvtierMooncakeTier drive it: one
object a page under the engine's page hash, staged or zero-copy, through a Store seam that fails as Mooncake does.
No engine and no Mooncake needed: kvtier's own tier runs the same path (rust/l3/plan.rs's tests, test_l3_tier.py)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from kvtier._core import L3_CODES, L3_HEADER_BYTES, ObjectFormat, ObjectPath
from kvtier.l3.errors import L3Error, L3Timeout
from kvtier.l3.store import FAILURE_CODES, STORE_RAISED, WRONG_LENGTH

PAGE = 512


class DictStore:
    """A Store in a dict, as Mooncake answers: a longer value -600, a shorter one WRONG_LENGTH (kvtier's client
    asks its size), a missing one -704. ``answer[key]`` replaces a get's code; ``raises`` is raised by gets."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.answer: dict[str, int] = {}
        self.raises: BaseException | None = None
        self.removed: list[str] = []

    def exists_many(self, keys: list[str]) -> list[int]:
        return [int(k in self.values) for k in keys]

    def put_many(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        for k, p, s in zip(keys, ptrs, sizes, strict=True):
            self.values.setdefault(
                k, b"".join(bytes(np.ctypeslib.as_array(_u8(a), (n,))) for a, n in zip(p, s, strict=False))
            )
        return [0] * len(keys)

    def get_many(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        if self.raises is not None:
            raise self.raises
        out = []
        for k, p, s in zip(keys, ptrs, sizes, strict=True):
            if k in self.answer:
                out.append(self.answer[k])
                continue
            v = self.values.get(k)
            if v is None:
                out.append(-704)
            elif len(v) != sum(s):
                out.append(-600 if len(v) > sum(s) else WRONG_LENGTH)
            else:
                at = 0
                for a, n in zip(p, s, strict=True):
                    np.ctypeslib.as_array(_u8(a), (n,))[:] = np.frombuffer(v[at : at + n], np.uint8)
                    at += n
                out.append(len(v))
        return out

    def remove(self, key: str, force: bool = False) -> int:
        self.removed.append(key)
        return 0 if self.values.pop(key, None) is not None else -704


def _u8(addr: int) -> Any:
    import ctypes

    return ctypes.cast(addr, ctypes.POINTER(ctypes.c_uint8))


def pages(n: int, fill: int | None = None) -> np.ndarray:
    rows = np.zeros((n, PAGE), np.uint8)
    for i in range(n):
        rows[i] = i + 1 if fill is None else fill
    return rows


def pieces(rows: np.ndarray) -> list[list[tuple[int, int]]]:
    """The rows' addresses: the caller keeps ``rows`` alive for the call that reads or writes them."""
    return [[(int(rows[i].ctypes.data), PAGE)] for i in range(len(rows))]


HASHES = [f"{i:064x}" for i in range(6)]
# SGLang's KvtierStore (staged by default, zero-copy with l3_zero_copy) and vLLM's tier (staged).
PATHS = {"staged": 3 * (L3_HEADER_BYTES + PAGE), "zero_copy": None}


@pytest.fixture(params=list(PATHS))
def path(request: pytest.FixtureRequest) -> ObjectPath:
    return ObjectPath(staging_bytes=PATHS[request.param])


def test_every_code_is_read_once_and_each_class_has_its_way() -> None:
    classes = {name: cls for _, name, cls, _ in L3_CODES}
    assert len({code for code, *_ in L3_CODES}) == len(L3_CODES)
    assert classes["OBJECT_NOT_FOUND"] == "missing"
    assert classes["INVALID_PARAMS"] == classes["WRONG_LENGTH"] == "wrong_length"
    assert classes["NO_SPACE"] == "no_space"
    for name in ("TRANSFER_FAIL", "LEASE_EXPIRED", "RPC_FAIL", "RPC_TIMEOUT", "STORE_RAISED"):
        assert classes[name] == "transient", name
    assert {code for code, *_ in L3_CODES if code in FAILURE_CODES} == {-800, -900, -901}


def test_pages_round_trip_and_present_ones_are_not_sent_again(path: ObjectPath) -> None:
    store, fmt, src = DictStore(), ObjectFormat("fp"), pages(6)
    assert [o.kind for o in path.put(store, fmt, HASHES, pieces(src), memory=[src])] == ["stored"] * 6
    assert [o.kind for o in path.put(store, fmt, HASHES, pieces(src), memory=[src])] == ["present"] * 6
    dst = pages(6, fill=0)
    assert all(o.ok for o in path.get(store, fmt, HASHES, pieces(dst), memory=[dst]))
    assert (dst == src).all()
    s = path.stats()
    assert (s["l3_objects_put"], s["l3_puts_present"], s["l3_objects_loaded"]) == (6, 6, 6)


@pytest.mark.parametrize("code", [-800, -707, -900, -901])
def test_transient_codes_never_remove_an_object(path: ObjectPath, code: int) -> None:
    store, fmt, src, dst = DictStore(), ObjectFormat("fp"), pages(6), pages(6, fill=0)
    path.put(store, fmt, HASHES, pieces(src), memory=[src])
    store.answer = dict.fromkeys(store.values, code)
    out = path.get(store, fmt, HASHES, pieces(dst), memory=[dst])
    assert [(o.kind, o.code) for o in out] == [("lost", code)] * 6
    assert store.removed == [] and len(store.values) == 6
    assert path.stats()["l3_rejected"] == 0


def test_a_store_call_that_times_out_or_raises_removes_nothing_and_waits_for_the_call(path: ObjectPath) -> None:
    store, fmt, src, dst = DictStore(), ObjectFormat("fp"), pages(6), pages(6, fill=0)
    path.put(store, fmt, HASHES, pieces(src), memory=[src])
    pending: Future[None] = Future()
    pending.set_result(None)  # the native call returned: the path may reuse its buffers
    for raised, code in ((L3Timeout("get timed out", pending), -901), (L3Error("down", -900), -900)):
        store.raises = raised
        out = path.get(store, fmt, HASHES, pieces(dst), memory=[dst])
        assert [(o.kind, o.code) for o in out] == [("lost", code)] * 6
    store.raises = RuntimeError("a bug")
    assert {o.code for o in path.get(store, fmt, HASHES, pieces(dst), memory=[dst])} == {STORE_RAISED}
    calls = 3 if path.zero_copy else 6  # staged, 6 pages take two calls
    assert store.removed == [] and path.stats()["l3_store_errors"] == calls


def test_values_of_any_wrong_length_are_rejected_removed_and_put_again(path: ObjectPath) -> None:
    store, fmt, src = DictStore(), ObjectFormat("fp"), pages(6)
    path.put(store, fmt, HASHES, pieces(src), memory=[src])
    keys = fmt.object_names(fmt.keys(HASHES))
    store.values[keys[0]] += b"\0"  # one byte longer: Mooncake answers -600
    store.values[keys[1]] = store.values[keys[1]][:-1]  # one byte shorter
    store.values[keys[2]] = store.values[keys[2]][:L3_HEADER_BYTES]  # a header alone
    dst = pages(6, fill=0)
    out = path.get(store, fmt, HASHES, pieces(dst), memory=[dst])
    assert [o.kind for o in out] == ["rejected"] * 3 + ["loaded"] * 3
    assert all(o.removed for o in out[:3])
    if not path.zero_copy:
        assert (dst[:3] == 0).all(), "staged, a wrong object never reaches the engine's memory"
    assert [o.kind for o in path.put(store, fmt, HASHES, pieces(src), memory=[src])] == ["stored"] * 3 + ["present"] * 3
    assert all(o.ok for o in path.get(store, fmt, HASHES, pieces(dst), memory=[dst]))


def test_an_object_sealed_by_another_format_is_never_loaded() -> None:
    store, path = DictStore(), ObjectPath(staging_bytes=PATHS["staged"])
    src = pages(1)
    path.put(store, ObjectFormat("a"), HASHES[:1], pieces(src), memory=[src])
    a_key = ObjectFormat("a").object_names(ObjectFormat("a").keys(HASHES[:1]))[0]
    b = ObjectFormat("b")
    store.values[b.object_names(b.keys(HASHES[:1]))[0]] = store.values[a_key]  # moved under another model's key
    dst = pages(1, fill=0)
    (out,) = path.get(store, b, HASHES[:1], pieces(dst), memory=[dst])
    assert (out.kind, out.ok, out.removed) == ("rejected", False, True) and "fingerprint" in (out.reason or "")


def test_bad_pieces_name_the_value() -> None:
    path, fmt = ObjectPath(staging_bytes=L3_HEADER_BYTES + PAGE), ObjectFormat("fp")
    big = np.zeros(PAGE + 1, np.uint8)
    with pytest.raises(ValueError, match="l3_staging_bytes"):
        path.put(DictStore(), fmt, HASHES[:1], [[(int(big.ctypes.data), PAGE + 1)]], memory=[big])
    with pytest.raises(ValueError, match="pieces of 2 pages"):
        path.put(DictStore(), fmt, HASHES[:2], [[(1 << 20, PAGE)]])
    with pytest.raises(ValueError, match="page_hashes\\[0\\] is empty"):
        path.get(DictStore(), fmt, [""], [[(1 << 20, PAGE)]])
    with pytest.raises(ValueError, match="staging"):
        ObjectPath(staging_bytes=L3_HEADER_BYTES)


def test_pieces_outside_the_memory_registered_with_the_path_never_move() -> None:
    store, path, fmt = DictStore(), ObjectPath(staging_bytes=PATHS["staged"]), ObjectFormat("fp")
    src, dst = pages(2), pages(2, fill=0)
    with pytest.raises(ValueError, match="outside the memory registered"):
        path.put(store, fmt, HASHES[:2], pieces(src))
    path.add_memory(src)
    assert [o.kind for o in path.put(store, fmt, HASHES[:2], pieces(src))] == ["stored"] * 2
    one_past = [[(int(src.ctypes.data) + PAGE, PAGE + 1)]]
    with pytest.raises(ValueError, match="outside the memory registered"):
        path.put(store, fmt, HASHES[:1], one_past)
    with pytest.raises(ValueError, match="outside the memory registered"):
        path.get(store, fmt, HASHES[:2], pieces(dst))
    assert all(o.ok for o in path.get(store, fmt, HASHES[:2], pieces(dst), memory=[dst]))
    assert (dst == src).all() and path.stats()["l3_objects_loaded"] == 2
    with pytest.raises(TypeError, match="__dlpack__"):
        path.add_memory(int(src.ctypes.data))
