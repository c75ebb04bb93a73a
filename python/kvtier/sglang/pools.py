"""SGLang's host pools as kvtier's object paths reach them (``kvtier.sglang.KvtierStore``'s memory).

Each registered host pool has its objects' format (its fingerprint: model, shard, the page's layout and bytes) and
the byte ranges its pages must lie in; the staged and zero-copy object paths (rust/l3/path.rs) move pages over that
memory only; what is registered with the Store (the staging buffers, and zero-copy the pools) is unregistered by
``unregister``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName

from kvtier._core import L3_HEADER_BYTES, BadArgument, ObjectFormat, ObjectPath, fingerprint
from kvtier.identity import Shard, layout_fields
from kvtier.l3.errors import L3Error
from kvtier.l3.store import Store
from kvtier.settings import CacheSettings

log = logging.getLogger("kvtier.sglang")

Pieces = list[list[tuple[int, int]]]


def storage_identity(
    config: HiCacheStorageConfig, pool: Any, model_version: str, pool_name: str = PoolName.KV.value
) -> dict[str, str]:
    """The fingerprint fields of the pages a SGLang rank stores from one host pool: model, shard, and the page's
    bytes as the pool lays them out (``pool.get_page_buffer_meta`` of one page). ``pool_name`` is SGLang's name of
    the pool (``PoolName``): the KV pool's fields are those of the ``_v1`` calls; another pool's add its name and the
    bytes of each page piece."""
    if config.should_split_heads:
        raise BadArgument("kvtier's SGLang backend does not split heads across TP sizes (tp_lcm_size); unset it")
    if config.dcp_size > 1:
        raise BadArgument(
            f"kvtier's SGLang backend does not support decode context parallelism, dcp_size={config.dcp_size}"
        )
    _, sizes = pool.get_page_buffer_meta(torch.arange(pool.page_size))
    kv = pool_name == PoolName.KV.value
    # MLA KV is the same on every TP rank (one writer rank stores it); Mamba states and MHA-shaped pools (K and V
    # buffers of their own heads) are each rank's own even in an MLA model.
    replicated = bool(config.is_mla_model) and (
        kv or (pool_name != PoolName.MAMBA.value and not hasattr(pool, "v_buffer"))
    )
    shard = Shard(
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        pp_rank=config.pp_rank,
        pp_size=config.pp_size,
        cp_rank=config.attn_cp_rank,
        cp_size=config.attn_cp_size,
        kv_replicated=replicated,
    )
    model_fields = {
        "name": "sglang",
        "model_name": config.model_name or "",
        "dtype": str(getattr(pool, "dtype", "")),
        "pieces": len(sizes),
    }
    if not kv:
        model_fields.update(pool=pool_name, piece_bytes=",".join(str(int(n)) for n in sizes))
    return layout_fields(
        page_bytes=sum(sizes),
        state_bytes=0,
        block_size=pool.page_size,
        layout=f"sglang.{getattr(pool, 'layout', '')}",
        hash_kind="sglang.page_hash",
        key_id="sglang",
        shard=shard,
        model_fields=model_fields,
        model_version=model_version,
    )


def pool_name_of(name: Any) -> str:
    """SGLang's pool name (a ``PoolName`` or its value) as a plain string."""
    value = name.value if isinstance(name, Enum) else name
    if not isinstance(value, str) or not value:
        raise BadArgument(f"a pool name must be a PoolName or a non-empty string, got {name!r}")
    return value


def pool_buffers(pool: Any) -> list[torch.Tensor]:
    """The CPU tensors of a SGLang host pool that its pages lie in (what SGLang's Mooncake backend registers)."""
    get = getattr(pool, "get_hybrid_pool_buffer", None)
    buffers = get() if get is not None else [getattr(pool, "kv_buffer", None)]
    out = [b for b in buffers if b is not None and (not isinstance(b, torch.Tensor) or b.numel() > 0)]
    if not out or any(not isinstance(b, torch.Tensor) or b.device.type != "cpu" for b in out):
        raise BadArgument(f"kvtier's SGLang backend needs a host pool of CPU tensors, got {type(pool).__name__}")
    return out


def byte_ranges(buffers: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """The memory of the tensors as disjoint ``(start, end)`` ranges (overlapping or touching ones merged)."""
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers)
    out: list[tuple[int, int]] = []
    for start, end in spans:
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _inside(ranges: Sequence[tuple[int, int]], ptrs: Sequence[int], sizes: Sequence[int]) -> bool:
    """Whether every piece lies inside one of the ranges."""
    if len(ranges) == 1:
        ((start, end),) = ranges
        return min(ptrs) >= start and max(p + n for p, n in zip(ptrs, sizes, strict=True)) <= end
    return all(any(s <= p and p + n <= e for s, e in ranges) for p, n in zip(ptrs, sizes, strict=True))


@dataclass
class RegisteredPool:
    """A registered SGLang host pool: its object format and the memory its pages must lie in."""

    pool: Any
    fmt: ObjectFormat
    ranges: list[tuple[int, int]]


def check_keys(keys: Sequence[str]) -> None:
    if not isinstance(keys, (list, tuple)):
        raise BadArgument(f"keys must be a list of page hashes, got {type(keys).__name__}")
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not key:
            raise BadArgument(f"keys[{i}] must be a non-empty page hash string, got {key!r}")


class HostPools:
    """The registered host pools by SGLang's name ("kv" from ``register_mem_pool_host``, hybrid models' others),
    the object paths over their memory, and the memory registered with ``store``."""

    def __init__(self, store: Store, settings: CacheSettings, storage_config: HiCacheStorageConfig) -> None:
        self._store = store
        self.settings = settings
        self.storage_config = storage_config
        self.zero_copy = bool(settings.l3_zero_copy)
        self._pools: dict[str, RegisteredPool] = {}
        # The object paths: staged, through two staging buffers of their own, the only memory registered; zero-copy
        # straight from and into the registered host pools. Each made and registered when first needed (zero-copy,
        # the staged one only if a deprecated call comes); the lock orders that.
        self._lock = threading.Lock()
        self._paths: dict[bool, ObjectPath] = {}
        # The host pools' buffers: the memory every object path may move pages from and into (checked in the core).
        self._memory: list[torch.Tensor] = []
        self._registered: list[int] = []

    def __contains__(self, name: Any) -> bool:
        return pool_name_of(name) in self._pools

    def _register(self, ptr: int, nbytes: int) -> None:
        self._store.register(ptr, nbytes)
        self._registered.append(ptr)

    def path(self, staged: bool) -> ObjectPath:
        """The staged or zero-copy object path, its buffers registered with the Store."""
        with self._lock:
            path = self._paths.get(staged)
            if path is None:
                path = ObjectPath(staging_bytes=self.settings.l3_staging_bytes if staged else None)
                for buffer in self._memory:
                    path.add_memory(buffer)
                for ptr, nbytes in path.buffers():
                    self._register(ptr, nbytes)
                self._paths[staged] = path
            return path

    def add(self, name: str, pool: Any, buffers: Sequence[torch.Tensor]) -> None:
        """Registers host pool ``name``: its objects' format is fixed here (its layout and page bytes) and, zero-copy,
        its memory is registered with the Store."""
        fields = storage_identity(self.storage_config, pool, self.settings.model_version, name)
        largest = L3_HEADER_BYTES + int(fields["page_bytes"])
        if largest > self.settings.l3_staging_bytes:
            raise BadArgument(
                f"l3_staging_bytes must hold one page object of host pool {name!r} ({largest} bytes), got "
                f"{self.settings.l3_staging_bytes}"
            )
        ranges = byte_ranges(buffers)
        if self.zero_copy:
            for start, end in ranges:
                self._register(start, end - start)
        fmt = ObjectFormat(fingerprint(fields), hash_key=self.settings.hash_key)
        with self._lock:
            self._memory.extend(buffers)
            for path in self._paths.values():
                for buffer in buffers:
                    path.add_memory(buffer)
        self._pools[name] = RegisteredPool(pool, fmt, ranges)
        log.info(
            "kvtier SGLang backend: host pool %s, fingerprint %s, %s, %d bytes a page",
            name,
            fmt.fingerprint,
            "zero-copy" if self.zero_copy else "staged",
            int(fields["page_bytes"]),
        )

    def get(self, name: Any = PoolName.KV) -> RegisteredPool:
        """A registered host pool by SGLang's name (the KV pool unless given)."""
        key = pool_name_of(name)
        pool = self._pools.get(key)
        if pool is None:
            if key == PoolName.KV.value:
                raise RuntimeError("KvtierStore: register_mem_pool_host(pool) must come before any page moves")
            raise BadArgument(
                f"host pool {key!r} is not registered (register_mem_host_pool_v2); have {list(self._pools)}"
            )
        return pool

    def page_pieces(self, keys: Sequence[str], host_indices: Any, pool: RegisteredPool | None = None) -> Pieces:
        """Each page's ``(address, bytes)`` pieces in a host pool (the KV pool unless given), checked to lie inside
        its memory."""
        check_keys(keys)
        pool = pool or self.get()
        host = pool.pool
        if (
            not isinstance(host_indices, torch.Tensor)
            or host_indices.dim() != 1
            or host_indices.dtype.is_floating_point
            or host_indices.dtype.is_complex
            or host_indices.dtype == torch.bool
        ):
            raise BadArgument(f"host_indices must be a 1-D tensor of integers, got {host_indices!r:.80}")
        if host_indices.numel() != len(keys) * host.page_size:
            raise BadArgument(
                f"host_indices must hold {len(keys)} pages of {host.page_size} tokens, got {host_indices.numel()}"
            )
        if len(keys) == 0:
            return []
        lo, hi = int(host_indices.min()), int(host_indices.max())
        size = getattr(host, "size", None)
        if lo < 0 or (size is not None and hi >= size):
            raise BadArgument(f"host_indices must lie in [0, {size}), got {lo}..{hi}")
        ptrs, sizes = host.get_page_buffer_meta(host_indices)
        per = len(ptrs) // len(keys)
        if per * len(keys) != len(ptrs) or len(sizes) != len(ptrs):
            raise BadArgument(f"the host pool gave {len(ptrs)} pieces for {len(keys)} pages")
        if not _inside(pool.ranges, ptrs, sizes):
            raise BadArgument("the host pool gave page pieces outside its buffers")
        return [list(zip(ptrs[i : i + per], sizes[i : i + per], strict=True)) for i in range(0, len(ptrs), per)]

    def stats(self) -> dict[str, int]:
        """The object paths' counters, summed."""
        out: dict[str, int] = {}
        with self._lock:
            paths = list(self._paths.values())
        for path in paths:
            for k, v in path.stats().items():
                out[k] = out.get(k, 0) + v
        return out

    def unregister(self) -> None:
        """Unregisters every buffer this registered with the Store (a failure is logged)."""
        for ptr in self._registered:
            try:
                self._store.unregister(ptr)
            except L3Error as e:
                log.warning("kvtier SGLang backend: unregister failed: %s", e)
        self._registered.clear()
