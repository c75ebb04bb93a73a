"""The L3 tier's threads and its one back-off: a worker thread with a bounded queue, and a circuit breaker."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from kvtier.l3.errors import L3Error, WorkerFull

log = logging.getLogger("kvtier.l3")

R = TypeVar("R")


class Backoff:
    """The wait before the next attempt after a failure: ``initial_s``, doubling on each further failure up to
    ``max_s``; ``due()`` says whether the wait has passed. Not thread-safe: its owner locks."""

    def __init__(self, initial_s: float, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if initial_s <= 0 or max_s < initial_s:
            raise ValueError(f"need 0 < initial_backoff_s <= max_backoff_s, got {initial_s}, {max_s}")
        self._initial, self._max, self._clock = initial_s, max_s, clock
        self.delay_s = initial_s
        self._next = 0.0

    def due(self) -> bool:
        return self._clock() >= self._next

    def wait(self) -> None:
        """The next attempt is one delay away (the delay stays)."""
        self._next = self._clock() + self.delay_s

    def failed(self) -> None:
        """An attempt failed: double the delay and wait it."""
        self.delay_s = min(self.delay_s * 2, self._max)
        self.wait()

    def reset(self) -> None:
        self.delay_s = self._initial
        self._next = 0.0


class Worker:
    """One daemon thread that runs submitted callables in submission order; results come back as Futures.

    `submit` never blocks: it raises WorkerFull when `max_pending` callables wait already, and L3Error after close.
    """

    def __init__(self, name: str = "kvtier-l3", max_pending: int = 1024) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.name = name
        self.max_pending = max_pending
        self._queue: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Callables queued and not yet started."""
        with self._cond:
            return len(self._queue)

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> Future[R]:
        fut: Future[R] = Future()
        with self._cond:
            if self._closed:
                raise L3Error(f"worker {self.name} is closed")
            if len(self._queue) >= self.max_pending:
                raise WorkerFull(f"worker {self.name} has {len(self._queue)} callables queued (max_pending)")
            self._queue.append((fut, fn, args, kwargs))
            self._cond.notify()
        return fut

    def close(self, timeout_s: float = 5.0, *, drain: bool = False) -> bool:
        """Stop accepting work and join the thread within `timeout_s`.

        drain=False cancels the queued callables at once; drain=True lets them run until the deadline and cancels
        what is left then. A callable already running is never interrupted: if it outlives the deadline, close
        returns False and its Future completes whenever it returns (the thread is a daemon). Idempotent.
        """
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        with self._cond:
            self._closed = True
            if not drain:
                self._cancel_queued()
            self._cond.notify()
        self._thread.join(timeout_s)
        with self._cond:
            self._cancel_queued()
        return not self._thread.is_alive()

    def _cancel_queued(self) -> None:
        while self._queue:
            self._queue.popleft()[0].cancel()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                fut, fn, args, kwargs = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - delivered to the submitter through the Future
                fut.set_exception(exc)
                del exc
            else:
                fut.set_result(result)
                del result
            # While waiting for the next callable, the thread keeps nothing of this one alive.
            del fut, fn, args, kwargs


class Breaker:
    """A circuit breaker: closed lets calls through; one failure opens it; while open, `allow()` refuses at once
    until the back-off is due, then runs `probe` on the calling thread (one prober at a time): success closes it,
    failure doubles the back-off (from initial_backoff_s up to max_backoff_s)."""

    def __init__(
        self,
        probe: Callable[[], bool],
        *,
        initial_backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probe = probe
        self._backoff = Backoff(initial_backoff_s, max_backoff_s, clock)
        self._lock = threading.Lock()
        self._open = False
        self._probing = False
        self.reason = ""
        self.times_opened = 0

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def backoff_s(self) -> float:
        """The wait before the next probe (meaningful while open)."""
        return self._backoff.delay_s

    def allow(self) -> bool:
        """True when a call may go to the Store now (probing first if the back-off is due)."""
        with self._lock:
            if not self._open:
                return True
            if self._probing or not self._backoff.due():
                return False
            self._probing = True
        ok = False
        try:
            ok = bool(self._probe())
        except Exception:  # noqa: BLE001 - a probe that raises is a failed probe
            log.exception("L3 breaker probe raised")
        with self._lock:
            self._probing = False
            if ok:
                self._close_locked()
            else:
                self._backoff.failed()
        return ok

    def failure(self, reason: str) -> None:
        """Open the breaker (or, when open, push the next probe one back-off away)."""
        with self._lock:
            if not self._open:
                self._open = True
                self._backoff.reset()
                self.times_opened += 1
                log.warning("L3 store unavailable, breaker open: %s", reason)
            self.reason = reason
            self._backoff.wait()

    def success(self) -> None:
        """A call went through: close the breaker if it was open."""
        with self._lock:
            if self._open:
                self._close_locked()

    def _close_locked(self) -> None:
        log.warning("L3 store available again, breaker closed (was open: %s)", self.reason)
        self._open = False
        self._backoff.reset()
        self.reason = ""
