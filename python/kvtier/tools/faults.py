"""The base of the Stores the soak and the tests inject faults with."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.l3.store import Store


class StoreWrapper:
    """A Store that passes every call to another one: the base of Stores that change a few calls (fault
    injection in the soak and the tests)."""

    def __init__(self, store: Store) -> None:
        self.inner = store

    @property
    def breaker_open(self) -> bool:
        return self.inner.breaker_open

    def register(self, ptr: int, size: int) -> None:
        self.inner.register(ptr, size)

    def unregister(self, ptr: int) -> None:
        self.inner.unregister(ptr)

    def put_many(
        self, keys: Sequence[str], ptrs_per_key: Sequence[Sequence[int]], sizes_per_key: Sequence[Sequence[int]]
    ) -> list[int]:
        return self.inner.put_many(keys, ptrs_per_key, sizes_per_key)

    def exists_many(self, keys: Sequence[str]) -> list[int]:
        return self.inner.exists_many(keys)

    def get_many(
        self, keys: Sequence[str], ptrs_per_key: Sequence[Sequence[int]], sizes_per_key: Sequence[Sequence[int]]
    ) -> list[int]:
        return self.inner.get_many(keys, ptrs_per_key, sizes_per_key)

    def remove(self, key: str, force: bool = False) -> int:
        return self.inner.remove(key, force)

    def close(self, timeout_s: float = 10.0) -> None:
        self.inner.close(timeout_s)


__all__ = ["StoreWrapper"]
