"""The failure policy of the engine-loop calls (docs/INTEGRATION.md).

A caller's bad argument raises to the caller (``OverflowError``, ``TypeError``, ``ValueError``, checked before
anything is planned or copied) and counts nothing. Any other exception inside a call (a failed launch, an engine
callback that raised) is kvtier's failure: it is logged and counted, the request continues uncached, and after
``max_errors`` of them the cache disables itself.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

log = logging.getLogger("kvtier")

T = TypeVar("T")
# What a caller's bad argument raises: re-raised to the caller, never counted towards max_errors.
CALLER_ERRORS = (OverflowError, TypeError, ValueError)


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
        argument is logged and counted in ``bad_arguments``, anything else is kvtier's failure."""
        if isinstance(e, CALLER_ERRORS):
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


class Guarded(Protocol):
    closed: bool
    failures: Failures


def guarded(default: T) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Runs a method of a ``Guarded`` object under the policy: ``default`` once it is closed or disabled; a
    caller's bad argument raises and counts nothing; any other error is counted, logged and answered with
    ``default``, never raised."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        where = fn.__name__.lstrip("_")

        @functools.wraps(fn)
        def call(self: Guarded, *args: Any, **kwargs: Any) -> T:
            if self.closed or self.failures.disabled:
                return default
            try:
                return fn(self, *args, **kwargs)
            except CALLER_ERRORS:
                raise
            except Exception as e:  # noqa: BLE001 - the policy: no cache failure reaches the engine
                self.failures.failed(where, e)
                return default

        return call

    return wrap
