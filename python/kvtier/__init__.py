"""kvtier: a tiered prefix cache for the paged KV cache of LLM serving engines.

The host tier keeps KV pages and per-sequence states in pinned host memory after the GPU pool dropped them and
copies them back on the engine's stream; the optional L3 tier shares them through Mooncake Store.

Exceptions: a caller's mistake raises ``BadArgument`` (a ``ValueError`` and a ``TypeError``; its ``__cause__`` is the
exception the caller's own object raised, if one did); kvtier's own failures raise ``KvtierError`` (a
``RuntimeError``) or one of its subclasses.
"""

from kvtier._core import (
    EVICTION_POLICIES,
    KEY_SCHEME,
    NEVER,
    BadArgument,
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
    "NEVER",
    "BadArgument",
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
