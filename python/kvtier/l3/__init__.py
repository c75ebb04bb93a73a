"""The L3 tier: KV pages and states shared through Mooncake Store.

Nothing of mooncake is imported until a MooncakeStore is constructed.
"""

from kvtier.l3.errors import L3Error, L3Timeout, L3Unavailable, WorkerFull
from kvtier.l3.store import ERROR_NAMES, FAILURE_CODES, MooncakeStore, Store, StoreConfig, error_name, port_open
from kvtier.l3.worker import Backoff, Breaker, Worker

__all__ = [
    "ERROR_NAMES",
    "FAILURE_CODES",
    "Backoff",
    "Breaker",
    "L3Error",
    "L3Timeout",
    "L3Unavailable",
    "MooncakeStore",
    "Store",
    "StoreConfig",
    "Worker",
    "WorkerFull",
    "error_name",
    "port_open",
]
