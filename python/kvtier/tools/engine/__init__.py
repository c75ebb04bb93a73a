"""The reference engine: a small paged-KV decoder in torch that a prefix cache plugs into (see engine.py)."""

from .config import PRESETS, CacheConfig, EngineConfig
from .engine import Engine, PrefixCache
from .scheduler import Scheduler
from .sequence import RequestStats, Sequence, SequenceData

__all__ = [
    "PRESETS",
    "CacheConfig",
    "Engine",
    "EngineConfig",
    "PrefixCache",
    "RequestStats",
    "Scheduler",
    "Sequence",
    "SequenceData",
]
