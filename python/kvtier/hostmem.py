"""The host pools of a cache, and their pinning off the engine loop.

The pools are address space only until they grow: at the first store (or at construction with ``preallocate``) a
background thread pins them in pin steps, and each step's slots become usable in the index as soon as it is pinned,
so a pool of hundreds of GiB never stalls the engine loop. Until then stores use the slots pinned so far.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvtier import Index
from kvtier.copy import HostPool


class HostMemory:
    """A cache's page pool (``pages``) and state pool (``states``, None without state slots), pinned into
    ``index`` a pin step at a time. A failure while pinning is passed to ``on_error``; the cache keeps serving from
    what is pinned."""

    def __init__(
        self,
        index: Index,
        *,
        page_slots: int,
        page_bytes: int,
        state_slots: int,
        state_bytes: int,
        step_bytes: int,
        pin_method: str,
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self._index = index
        self.pages = HostPool(page_slots, page_bytes, step_bytes=step_bytes, pin_method=pin_method)
        self.states = (
            HostPool(state_slots, state_bytes, step_bytes=step_bytes, pin_method=pin_method) if state_slots else None
        )
        self._pools = [p for p in (self.pages, self.states) if p is not None]
        self._on_error = on_error
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def pin_all(self) -> None:
        """Pins both pools now, on the calling thread (``preallocate``, and the pinning thread)."""
        try:
            for pool in self._pools:
                while not self._stop.is_set() and pool.usable_slots < pool.slots:
                    pool.grow_step()
                    self._index.grow(self.pages.usable_slots, self.states.usable_slots if self.states else 0)
        except Exception as e:  # noqa: BLE001 - the cache keeps serving from what is pinned
            self._on_error("pin", e)

    def start(self) -> None:
        """Starts pinning on a background thread, once."""
        if self._thread is None:
            thread = threading.Thread(target=self.pin_all, name="kvtier-pin", daemon=True)
            thread.start()
            self._thread = thread  # published once started, so that wait() never joins a thread not yet started

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until both pools are pinned; returns whether they are."""
        if self._thread is not None:
            self._thread.join(timeout)
        return all(p.usable_slots == p.slots for p in self._pools)

    def pinned_bytes(self) -> int:
        return sum(p.usable_slots * p.slot_bytes for p in self._pools)

    def close(self, *, free: bool = True) -> None:
        """Stops pinning and, with ``free``, unmaps the pools (no copy may still be in flight; without ``free``
        they are kept: a native call may still use them)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if free:
            for pool in self._pools:
                pool.close()
