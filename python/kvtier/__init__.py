"""kvtier: a tiered prefix cache for the paged KV cache of LLM serving engines.

The host tier keeps KV pages and per-sequence states in pinned host memory after the GPU pool dropped them and
copies them back on the engine's stream; the optional L3 tier shares them through Mooncake Store.
"""

from kvtier._core import (
    EVICTION_POLICIES,
    KEY_SCHEME,
    CopyError,
    Index,
    IndexConfig,
    KvEvent,
    KvtierError,
    L3Planner,
    LoadPlan,
    Lookup,
    PromptMismatchError,
    Ready,
    StaleLookupError,
    StorePlan,
    __version__,
    build_info,
    fingerprint,
    stat_table,
)

__all__ = [
    "EVICTION_POLICIES",
    "KEY_SCHEME",
    "CopyError",
    "Index",
    "IndexConfig",
    "KvEvent",
    "KvtierError",
    "L3Planner",
    "LoadPlan",
    "Lookup",
    "PromptMismatchError",
    "Ready",
    "StaleLookupError",
    "StorePlan",
    "__version__",
    "build_info",
    "fingerprint",
    "stat_table",
]
