"""Cache settings from constructor arguments or ``KVTIER_*`` environment variables.

An explicit argument wins over the environment, the environment over the default. A bad value raises
``ValueError`` naming the setting (and the variable it came from) at construction, never later.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def _parse_bytes(text: str) -> int:
    """``123``, ``64MiB``, ``1.5GiB``, ``2GB``..."""
    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
             "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}  # fmt: skip
    s = text.strip().lower().replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :].strip()
    if unit not in units or not num:
        raise ValueError(f"not a size in bytes: {text!r}")
    return int(float(num) * units[unit])


def _parse_bool(text: str) -> bool:
    s = text.strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


@dataclass(frozen=True)
class Setting:
    env: str
    parse: Any
    minimum: int | None = None


# name -> (environment variable, parser, minimum)
SETTINGS: Mapping[str, Setting] = {
    "host_bytes": Setting("KVTIER_HOST_BYTES", _parse_bytes, 0),
    "state_slots": Setting("KVTIER_STATE_SLOTS", int, 0),
    "keep_tokens": Setting("KVTIER_KEEP_TOKENS", int, 1),
    "min_hit_tokens": Setting("KVTIER_MIN_HIT_TOKENS", int, 0),
    "state_lookback_blocks": Setting("KVTIER_STATE_LOOKBACK", int, 0),
    "ring_slack": Setting("KVTIER_RING_SLACK", int, 0),
    "hash_kind": Setting("KVTIER_HASH_KIND", str),
    "hash_key": Setting("KVTIER_HASH_KEY", str),
    "staging_slots": Setting("KVTIER_STAGING_SLOTS", int, 1),
    "pin_chunk_bytes": Setting("KVTIER_PIN_CHUNK_BYTES", _parse_bytes, 1),
    "preallocate": Setting("KVTIER_PREALLOCATE", _parse_bool),
    "max_errors": Setting("KVTIER_MAX_ERRORS", int, 1),
    "l3": Setting("KVTIER_L3", str),
    "l3_master": Setting("KVTIER_L3_MASTER", str),
    "l3_metadata_server": Setting("KVTIER_L3_METADATA_SERVER", str),
    "l3_protocol": Setting("KVTIER_L3_PROTOCOL", str),
    "l3_segment_bytes": Setting("KVTIER_L3_SEGMENT_BYTES", _parse_bytes, 0),
    "l3_buffer_bytes": Setting("KVTIER_L3_BUFFER_BYTES", _parse_bytes, 0),
    "l3_group_pages": Setting("KVTIER_L3_GROUP_PAGES", int, 1),
    "l3_deadline_ms": Setting("KVTIER_L3_DEADLINE_MS", float, 0),
    "l3_seen_keys": Setting("KVTIER_L3_SEEN_KEYS", int, 1),
    "copy_method": Setting("KVTIER_COPY_METHOD", str),
    "copy_crossover_bytes": Setting("KVTIER_COPY_CROSSOVER_BYTES", _parse_bytes, 16),
    "copy_streams": Setting("KVTIER_COPY_STREAMS", _parse_bool),
    "layerwise_loads": Setting("KVTIER_LAYERWISE_LOADS", _parse_bool),
}


@dataclass(frozen=True)
class CacheSettings:
    """Every setting of a cache; see README.md for what each one does."""

    host_bytes: int = 4 << 30
    state_slots: int = 0
    keep_tokens: int = 1
    min_hit_tokens: int | None = None  # default: two blocks
    state_lookback_blocks: int = 4
    ring_slack: int = 0
    hash_kind: str = "blake3"
    hash_key: str | None = None
    staging_slots: int = 16
    # Each chunk's registration holds the driver and stalls launches on the engine loop: docs/PERFORMANCE.md.
    pin_chunk_bytes: int = 16 << 20
    preallocate: bool = False
    max_errors: int = 3
    l3: str | None = None  # None or "mooncake"
    l3_master: str | None = None
    l3_metadata_server: str = "P2PHANDSHAKE"
    l3_protocol: str = "tcp"
    l3_segment_bytes: int = 0
    l3_buffer_bytes: int = 64 << 20
    l3_group_pages: int = 4
    l3_deadline_ms: float = 50.0
    l3_seen_keys: int = 1 << 20
    # Copies: "auto" takes the copy engine for pieces >= copy_crossover_bytes, the kernel below (docs/PERFORMANCE.md).
    copy_method: str = "auto"
    copy_crossover_bytes: int = 64 << 10
    copy_streams: bool = True  # False: every copy on the engine's current stream
    layerwise_loads: bool = False  # True: the engine calls wait_layer(l) before layer l reads its KV

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> CacheSettings:
        """Settings from ``overrides`` (None means unset), then ``env`` (default ``os.environ``), then defaults."""
        env = os.environ if env is None else env
        unknown = set(overrides) - set(SETTINGS)
        if unknown:
            raise TypeError(f"unknown cache settings: {sorted(unknown)}")
        values: dict[str, Any] = {}
        for name, s in SETTINGS.items():
            value = overrides.get(name)
            source = name
            if value is None and s.env in env:
                source = f"{name} (from {s.env}={env[s.env]!r})"
                try:
                    value = s.parse(env[s.env])
                except ValueError as e:
                    raise ValueError(f"bad setting {source}: {e}") from None
            if value is None:
                continue
            if s.minimum is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError(f"setting {source} must be a number, got {type(value).__name__}")
                if value < s.minimum:
                    raise ValueError(f"setting {source} must be >= {s.minimum}, got {value}")
            values[name] = value
        out = cls(**values)
        if out.hash_kind not in ("blake3", "xxh3"):
            raise ValueError(f"setting hash_kind must be 'blake3' or 'xxh3', got {out.hash_kind!r}")
        if out.l3 not in (None, "", "mooncake"):
            raise ValueError(f"setting l3 must be unset or 'mooncake', got {out.l3!r}")
        if out.copy_method not in ("auto", "kernel", "dma"):
            raise ValueError(f"setting copy_method must be 'auto', 'kernel' or 'dma', got {out.copy_method!r}")
        if out.l3 == "mooncake" and not out.l3_master:
            raise ValueError("setting l3='mooncake' needs l3_master (KVTIER_L3_MASTER=host:port)")
        return dataclasses.replace(out, l3=out.l3 or None)
