"""The failure policy of the engine-loop calls (docs/INTEGRATION.md).

Whose error it is decided by one exception class. A caller's mistake raises ``kvtier.BadArgument`` to the caller
and counts nothing: a bad argument, checked before anything is planned or copied, and any exception the caller's
own objects raise while kvtier reads them (``allocate()``, a block table whose ``__len__`` or ``__iter__`` raises),
kept as the ``BadArgument``'s cause. Any other exception inside a call (a failed launch, an engine state callback
that raised, a closed host pool) is kvtier's failure: it is logged and counted, the request continues uncached,
and after ``max_errors`` of them the cache disables itself.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from kvtier._core import BadArgument

log = logging.getLogger("kvtier")

T = TypeVar("T")


class Failures:
    """kvtier's failures and a caller's refused arguments, counted; disabled after ``max_errors`` failures.
    ``on_failure`` is called (under the lock) for each failure counted, e.g. to count it in the index too."""

    def __init__(self, max_errors: int, on_failure: Callable[[], None] | None = None) -> None:
        self.max_errors = max_errors
        self.errors = 0
        self.bad_arguments = 0
        self.disabled = False
        self._on_failure = on_failure
        self._lock = threading.Lock()

    def failed(self, where: str, e: BaseException) -> None:
        """``e``, raised inside the call ``where``, is kvtier's failure: logged and counted."""
        with self._lock:
            self.errors += 1
            if self._on_failure is not None:
                self._on_failure()
            log.warning("%s failed (%s: %s); the request continues uncached", where, type(e).__name__, e)
            if self.errors >= self.max_errors and not self.disabled:
                self.disabled = True
                log.error("%d errors, the host prefix cache disables itself", self.errors)

    def report(self, where: str, e: BaseException) -> None:
        """An adapter that must not raise into its engine caught ``e`` from the call ``where``: a caller's bad
        argument (``BadArgument``) is logged and counted in ``bad_arguments``, anything else is kvtier's failure."""
        if isinstance(e, BadArgument):
            with self._lock:
                self.bad_arguments += 1
            log.warning(
                "%s refused a bad argument (%s: %s); the request continues uncached", where, type(e).__name__, e
            )
        else:
            self.failed(where, e)

    def disable(self, reason: str) -> None:
        """Stops serving and storing for good (logged)."""
        with self._lock:
            if not self.disabled:
                self.disabled = True
                log.error("the host prefix cache disables itself: %s", reason)


class Calls:
    """The engine calls running now, so that closing never tears anything down under one: a call that begins
    after ``close`` began is refused (``enter`` is False) and ``close`` waits for those running to end. A call
    that closes its own cache (from an engine callback) is not waited for."""

    def __init__(self) -> None:
        self.closed = False
        self._running = 0
        self._cond = threading.Condition()
        self._mine = threading.local()

    def enter(self) -> bool:
        with self._cond:
            if self.closed:
                return False
            self._running += 1
        self._mine.depth = getattr(self._mine, "depth", 0) + 1
        return True

    def leave(self) -> None:
        self._mine.depth -= 1
        with self._cond:
            self._running -= 1
            self._cond.notify_all()

    def close(self, timeout_s: float | None = None) -> bool | None:
        """Refuses new calls and waits for the running ones (other threads'); returns whether they ended, or None
        when it was closed already."""
        with self._cond:
            if self.closed:
                return None
            self.closed = True
            own = getattr(self._mine, "depth", 0)
            return self._cond.wait_for(lambda: self._running <= own, timeout_s)


class Guarded(Protocol):
    calls: Calls
    failures: Failures


def guarded(default: T) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Runs a method of a ``Guarded`` object under the policy: ``default`` once it is closed (or closing) or
    disabled; a caller's bad argument (``BadArgument``) raises and counts nothing; any other error is counted,
    logged and answered with ``default``, never raised."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        where = fn.__name__.lstrip("_")

        @functools.wraps(fn)
        def call(self: Guarded, *args: Any, **kwargs: Any) -> T:
            if self.failures.disabled or not self.calls.enter():
                return default
            try:
                return fn(self, *args, **kwargs)
            except BadArgument:
                raise
            except Exception as e:  # noqa: BLE001 - the policy: no cache failure reaches the engine
                self.failures.failed(where, e)
                return default
            finally:
                self.calls.leave()

        return call

    return wrap
