"""kvtier: a tiered prefix cache for the paged KV cache of LLM serving engines.

The host tier keeps KV pages and per-sequence states in pinned host memory after the GPU pool dropped them and
copies them back on the engine's stream; the optional L3 tier shares them through Mooncake Store.
"""

from kvtier._core import (
    CopyError,
    Index,
    KvtierError,
    L3Planner,
    LoadPlan,
    Lookup,
    Ready,
    StaleLookupError,
    StorePlan,
    __version__,
    build_info,
    fingerprint,
)

__all__ = [
    "CopyError",
    "Index",
    "KvtierError",
    "L3Planner",
    "LoadPlan",
    "Lookup",
    "Ready",
    "StaleLookupError",
    "StorePlan",
    "__version__",
    "build_info",
    "fingerprint",
]
