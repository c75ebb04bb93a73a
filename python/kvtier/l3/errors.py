"""The L3 tier's exceptions."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from kvtier._core import L3_CODES, KvtierError

# kvtier's code of a Store call that did not return in time (it may still run).
RPC_TIMEOUT = next(code for code, name, _, _ in L3_CODES if name == "RPC_TIMEOUT")


class L3Error(KvtierError):
    """A Mooncake Store call failed; `code` is Mooncake's return code when there is one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class L3Unavailable(L3Error):
    """The Store cannot be reached (no master, setup failed, or a call timed out)."""


class L3Timeout(L3Unavailable):
    """A native call did not return within its bound. It may still be running: until `pending` is done, a put may
    still read and a get may still write the buffers it was given, so they must stay allocated and untouched."""

    def __init__(self, message: str, pending: Future[Any]) -> None:
        super().__init__(message, RPC_TIMEOUT)
        self.pending = pending


class WorkerFull(L3Error):
    """A worker's queue is full; the submission was not accepted."""
