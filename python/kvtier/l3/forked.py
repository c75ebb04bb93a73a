"""A child made by ``fork()`` of a process that has a Mooncake client.

Mooncake's client registers a C-level exit handler (its resource tracker) that tears down every client of the
process and joins their threads. A forked child has none of those threads, so however it ends (``sys.exit``, an
uncaught exception, the end of its program) that join crashes it (SIGSEGV). A child of a process that set up a
client therefore ends with ``os._exit`` once Python's own exit handlers have run: its exit status is kept (the code
given to ``sys.exit``, 1 after an uncaught exception, else 0) and only the C exit handlers are skipped.
``multiprocessing``'s fork children end with ``os._exit`` anyway. Whatever the child inherited of the parent's
caches it must not use (``HostPrefixCache`` is closed there); it may make caches of its own.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from types import TracebackType
from typing import Any

# The process whose Mooncake client this is (None: no client was set up), and the exit status a child records.
_client_pid: int | None = None
_status = 0


def client_made() -> None:
    """A Mooncake client was set up in this process."""
    global _client_pid
    if _client_pid is None:
        os.register_at_fork(after_in_child=_record_exit_status)
        atexit.register(_end_child)
    _client_pid = os.getpid()


def _record_exit_status() -> None:
    exit_, hook = sys.exit, sys.excepthook

    def recorded_exit(status: Any = None) -> None:
        global _status
        _status = 0 if status is None else status if isinstance(status, int) else 1
        exit_(status)

    def recorded_hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        global _status
        _status = 1
        hook(kind, value, tb)

    sys.exit, sys.excepthook = recorded_exit, recorded_hook  # type: ignore[assignment]


def _end_child() -> None:
    if _client_pid is None or os.getpid() == _client_pid:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing to flush
            pass
    os._exit(_status & 0xFF)
