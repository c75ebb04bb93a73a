"""The host pools of a cache, and their pinning off the engine loop.

Pools a CUDA pool copies to and from are pinned. They are address space only until they grow: at the first store
(or at construction with ``preallocate``) a background thread pins them in pin steps, and each step's slots become
usable in the index as soon as it is pinned, so a pool of hundreds of GiB never stalls the engine loop. Until then
stores use the slots pinned so far.

Pools a CPU pool copies to and from (memcpy) are not pinned: every slot is usable from construction and nothing waits,
while the kernel commits their memory only as it is first written (an unused cache costs no memory).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvtier import Index
from kvtier.copy import HostPool


class HostMemory:
    """A cache's page pool (``pages``) and state pool (``states``, None without state slots), pinned into
    ``index`` a pin step at a time (``pin``), or usable at once (not ``pin``). A failure while pinning is passed to
    ``on_error``; the cache keeps serving from what is pinned."""

    def __init__(
        self,
        index: Index,
        *,
        page_slots: int,
        page_bytes: int,
        state_slots: int,
        state_bytes: int,
        step_bytes: int,
        pin: bool,
        pin_method: str,
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self._index = index
        self.pages = HostPool(page_slots, page_bytes, step_bytes=step_bytes, pin=pin, pin_method=pin_method)
        self.states = (
            HostPool(state_slots, state_bytes, step_bytes=step_bytes, pin=pin, pin_method=pin_method)
            if state_slots
            else None
        )
        self._pools = [p for p in (self.pages, self.states) if p is not None]
        self._on_error = on_error
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        if not pin:
            self.pin_all()  # no pinning: growing only makes the slots usable, at once

    def pin_all(self) -> None:
        """Grows (and pins) both pools whole now, on the calling thread (``preallocate``, the pinning thread, and
        unpinned pools at construction)."""
        try:
            for pool in self._pools:
                while not self._stop.is_set() and pool.usable_slots < pool.slots:
                    pool.grow_step()
                    self._index.grow(self.pages.usable_slots, self.states.usable_slots if self.states else 0)
        except Exception as e:  # noqa: BLE001 - the cache keeps serving from what is pinned
            self._on_error("pin", e)

    def start(self) -> None:
        """Starts pinning on a background thread, once (not at all when the pools are grown already)."""
        if self._thread is None and not self.grown():
            thread = threading.Thread(target=self.pin_all, name="kvtier-pin", daemon=True)
            thread.start()
            self._thread = thread  # published once started, so that wait() never joins a thread not yet started

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until both pools are pinned; returns whether they are."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.grown()

    def grown(self) -> bool:
        """Whether every slot of both pools is usable."""
        return all(p.usable_slots == p.slots for p in self._pools)

    @property
    def pinned(self) -> bool:
        """Whether the pools are pinned (those of a CUDA pool), so that stores may wait for their pin steps."""
        return self.pages.pinned

    def pinned_bytes(self) -> int:
        return sum(p.usable_slots * p.slot_bytes for p in self._pools if p.pinned)

    def close(self, *, free: bool = True) -> None:
        """Stops pinning and, with ``free``, unmaps the pools (no copy may still be in flight; without ``free``
        they are kept: a native call may still use them)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if free:
            for pool in self._pools:
                pool.close()
