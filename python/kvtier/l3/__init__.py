"""The L3 tier: KV pages and states shared through Mooncake Store.

Nothing of mooncake is imported until a MooncakeStore is constructed.
"""

from kvtier.l3.server import LocalMooncake, MooncakeServerError, free_port, port_open
from kvtier.l3.store import (
    ERROR_NAMES,
    FAILURE_CODES,
    Breaker,
    L3Error,
    L3Timeout,
    L3Unavailable,
    MooncakeStore,
    StoreConfig,
    Worker,
    WorkerFull,
    error_name,
)

__all__ = [
    "ERROR_NAMES",
    "FAILURE_CODES",
    "Breaker",
    "L3Error",
    "L3Timeout",
    "L3Unavailable",
    "LocalMooncake",
    "MooncakeServerError",
    "MooncakeStore",
    "StoreConfig",
    "Worker",
    "WorkerFull",
    "error_name",
    "free_port",
    "port_open",
]
