"""SGLang's HiCache storage on kvtier's verified Mooncake tier: ``kvtier.sglang.KvtierStore``.

SGLang keeps its own host pool and radix tree; this is its L3 backend, loaded by SGLang's storage-backend factory:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore", "interface_v1": 1,
        "l3_master": "10.0.0.5:50051", "model_version": "<checkpoint revision>", "hash_key": "<deployment secret>"}'

Every other key of the extra config is a kvtier setting (``docs/SGLANG.md`` lists those it reads); the
``KVTIER_*`` environment variables are read for the ones the JSON leaves out.

Objects are kvtier's verified L3 objects (rust/l3/mod.rs): one per SGLang page, a header (format, fingerprint digest,
the page's chain key, payload length, digest of all of it) before the page's bytes in the order of the host pool's
``get_page_buffer_meta``. The chain key is SGLang's page hash mapped to 128 bits (BLAKE3 key derivation); the Store
key ``kvtier/v<format>/<fingerprint>/g1/<key>`` carries the fingerprint, which covers the model (SGLang's model
name and kvtier's ``model_version``), the shard (TP rank and size, or ``replicated`` for MLA, whose one writer
rank SGLang picks; PP and attention-CP rank and size), the page's bytes and tokens, layout, dtype and pieces. An
object that fails its check (a flipped bit, another model's object under this key, a value of another length) is
counted, removed from the Store and never served: its page reads as not found.

Two ways objects move, as in kvtier's own tier (``l3_zero_copy``):
- default: through two staging buffers of their own (puts, gets), the only memory registered with Mooncake; a get
  is copied out into the host pool before it is checked there, so no transfer-engine peer can write memory SGLang
  loads from;
- ``l3_zero_copy``: SGLang's host pool is registered and objects move straight from and into it (SGLang's own
  Mooncake backend always works so: a trusted Mooncake network only); every object is still checked.

The deprecated calls that take tensors or raw pointers (``get``, ``set``, ``batch_get``, ``batch_set``) always move
through the staging buffers.

Hybrid models' extra host pools (Mamba states, SWA, DSA indexers, draft KV; ``register_mem_host_pool_v2``) move
through the ``_v2`` calls: each pool's page is an object of its own, under a fingerprint that adds the pool's name
and the bytes of its page pieces, so a pool's objects never stand in for another's. Every pool is sharded by TP rank
as its KV is, except that Mamba states and MHA-shaped pools of an MLA model stay rank-sharded (as SGLang backs them
up on every rank). ``batch_exists_v2`` applies the ``all_pages`` and ``trailing_pages`` hit policies;
``block_groups`` is refused (ValueError), as SGLang's Mooncake backend refuses it.

Failure policy: bad arguments raise (ValueError / TypeError naming the value); a Store that fails, times out or
is closed makes a call answer "not stored" / "not found" (counted, logged), never an exception into SGLang's
HiCache threads. A Store call that timed out may still use its buffers: the call waits until it returned before
they are used again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvtier._core import BadArgument, ObjectFormat, Outcome
from kvtier.l3.errors import L3Error
from kvtier.l3.store import MooncakeStore, Store, StoreConfig
from kvtier.settings import SGLANG, CacheSettings, for_scope, scope_names
from kvtier.sglang.pools import HostPools, Pieces, check_keys, pool_buffers, pool_name_of

log = logging.getLogger("kvtier.sglang")

# Keys of the extra config that are SGLang's own (the factory's and the cache controller's), not kvtier settings.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "tp_lcm_size",
    }
)
# The kvtier settings this backend reads (kvtier.settings' registry, scope "sglang"; the others are the host
# cache's and have no meaning here).
SETTINGS_READ = scope_names(SGLANG)


def settings_of(extra_config: Mapping[str, Any] | None) -> CacheSettings:
    """The kvtier settings of a HiCache extra config (SGLang's own keys left out; ``KVTIER_*`` variables for what
    it leaves out). kvtier's settings refuse a key that is neither, and a missing ``model_version``."""
    return for_scope(SGLANG, {k: v for k, v in (extra_config or {}).items() if k not in SGLANG_KEYS}, l3="mooncake")


def _hit_policy(transfer: PoolTransfer) -> PoolHitPolicy:
    try:
        policy = PoolHitPolicy(transfer.hit_policy)
    except ValueError:
        policy = None
    if policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
        raise BadArgument(
            f"hit policy {transfer.hit_policy!r} of pool {transfer.name!r} is not supported (all_pages, trailing_pages)"
        )
    return policy


def _tensor_pieces(values: Sequence[Any], what: str) -> Pieces:
    out = []
    for i, v in enumerate(values):
        if not isinstance(v, torch.Tensor) or v.device.type != "cpu" or not v.is_contiguous() or v.numel() == 0:
            raise BadArgument(f"{what}[{i}] must be a non-empty contiguous CPU tensor, got {v!r:.80}")
        out.append([(v.data_ptr(), v.numel() * v.element_size())])
    return out


def _pointer_pieces(locations: Sequence[Any], sizes: Sequence[Any] | None, what: str) -> Pieces:
    if sizes is None or len(sizes) != len(locations):
        raise BadArgument(f"{what}: need one size per location, got {locations!r:.80} and {sizes!r:.80}")
    out = []
    for i, (p, n) in enumerate(zip(locations, sizes, strict=True)):
        ptrs, lens = (p, n) if isinstance(p, (list, tuple)) else ([p], [n])
        if len(ptrs) != len(lens) or not all(isinstance(x, int) and x > 0 for x in (*ptrs, *lens)):
            raise BadArgument(f"{what}[{i}]: need positive int addresses and sizes, got {p!r} and {n!r}")
        out.append(list(zip(ptrs, lens, strict=True)))
    return out


class KvtierStore(HiCacheStorage):
    """A SGLang ``HiCacheStorage`` whose pages are kvtier's verified objects in Mooncake Store.

    Built by SGLang's factory as ``KvtierStore(storage_config, kwargs)``; ``register_mem_pool_host(pool)`` must
    follow before any page moves. ``store_factory(config)`` builds the Store client (kvtier's ``MooncakeStore`` by
    default; a seam for Stores that wrap it).
    """

    def __init__(
        self,
        storage_config: HiCacheStorageConfig,
        kwargs: Mapping[str, Any] | None = None,
        *,
        store_factory: Callable[[StoreConfig], Store] | None = None,
    ) -> None:
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise BadArgument(f"storage_config must be a HiCacheStorageConfig, got {type(storage_config).__name__}")
        self.storage_config = storage_config
        self.settings = settings_of(storage_config.extra_config)
        s = self.settings
        self.zero_copy = bool(s.l3_zero_copy)
        self.store: Store = (store_factory or MooncakeStore)(StoreConfig.of(s))
        self.pools = HostPools(self.store, s, storage_config)
        try:
            self.pools.path(staged=not self.zero_copy)
        except BaseException:
            self.close()
            raise

    # Identity and the host pool

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The host pool KV pages move from and into: the objects' identity is fixed here (its layout and page
        bytes) and, zero-copy, its memory is registered with the Store."""
        kv = getattr(mem_pool_host, "kv_buffer", None)
        if not isinstance(kv, torch.Tensor) or kv.device.type != "cpu":
            raise BadArgument(
                f"kvtier's SGLang backend needs a host pool with a CPU kv_buffer, got {type(mem_pool_host).__name__}"
            )
        if PoolName.KV in self.pools:
            raise BadArgument("kvtier's SGLang backend has a KV host pool already")
        self.pools.add(PoolName.KV.value, mem_pool_host, [kv])
        super().register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """One of a hybrid model's host pools, by SGLang's name (``PoolName``): its pages move through the ``_v2``
        calls as objects of their own. The KV pool is the one ``register_mem_pool_host`` took."""
        name = pool_name_of(host_pool_name)
        if name == PoolName.KV.value:
            if name not in self.pools:
                self.register_mem_pool_host(host_pool)
            elif host_pool is not self.pools.get(name).pool:
                raise BadArgument("the KV pool of register_mem_host_pool_v2 is not the one register_mem_pool_host took")
            return
        if name in self.pools:
            raise BadArgument(f"host pool {name!r} is registered already")
        self.pools.add(name, host_pool, pool_buffers(host_pool))
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the KV pool's objects."""
        return self._fmt().fingerprint

    def _fmt(self) -> ObjectFormat:
        return self.pools.get().fmt

    def object_keys(self, keys: Sequence[str], pool: Any = PoolName.KV) -> list[str]:
        """The Store key of each SGLang page hash in a host pool (SGLang's ``PoolName``, the KV pool unless
        given)."""
        check_keys(keys)
        fmt = self.pools.get(pool).fmt
        return fmt.object_names(fmt.keys(list(keys)))

    # Moving objects: the one object path does it all; a Store failure is an outcome, never an exception

    def _moved(self, what: str, outcomes: list[Outcome]) -> list[bool]:
        rejected = [o for o in outcomes if o.kind == "rejected"]
        if rejected:
            log.warning("kvtier SGLang backend: %d objects rejected, first: %s", len(rejected), rejected[0].reason)
        failed = [o for o in outcomes if o.kind in ("failed", "lost")]
        if failed:
            log.info("kvtier SGLang backend: %s of %d pages not done, first code %s", what, len(failed), failed[0].code)
        return [o.ok for o in outcomes]

    def _move(
        self,
        put: bool,
        fmt: ObjectFormat,
        hashes: Sequence[str],
        pieces: Pieces,
        staged: bool,
        memory: Sequence[Any] = (),
    ) -> list[bool]:
        """Puts each page object unless the Store has it (the first writer wins: True for each page stored or
        present), or gets each into its pieces and checks it there (True only for a whole, verified object). Pieces
        lie in the host pools or in ``memory`` (tensors of the call)."""
        try:
            path = self.pools.path(staged)
        except L3Error as e:
            log.warning("kvtier SGLang backend: registering the staging buffers failed: %s", e)
            return [False] * len(hashes)
        move = path.put if put else path.get
        return self._moved("put" if put else "get", move(self.store, fmt, list(hashes), pieces, memory=list(memory)))

    # HiCacheStorage: zero-copy calls on the registered host pool

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self._move(True, self._fmt(), keys, self.pools.page_pieces(keys, host_indices), not self.zero_copy)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self._move(False, self._fmt(), keys, self.pools.page_pieces(keys, host_indices), not self.zero_copy)

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of the pages, from the first, the Store has."""
        present = self._present(self._fmt(), keys)
        return present.index(False) if False in present else len(present)

    def _present(self, fmt: ObjectFormat, hashes: Sequence[str]) -> list[bool]:
        """Whether the Store has each page's object (none, when the Store fails)."""
        check_keys(hashes)
        skeys = fmt.object_names(fmt.keys(list(hashes)))
        try:
            codes = self.store.exists_many(skeys)
        except L3Error as e:
            log.warning("kvtier SGLang backend: exists failed: %s", e)
            return [False] * len(skeys)
        return [code == 1 for code in codes]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # HiCacheStorage: hybrid models' host pools (the _v2 calls)

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The prefixes of ``keys`` that the KV pool and every transfer's pool can restore, by the pool's hit
        policy: ``all_pages`` needs each page of the prefix, ``trailing_pages`` its last ``len(transfer.keys)``
        pages (Mamba and SWA states). The longest such prefix is the hit; each pool's own longest is reported."""
        transfers = list(pool_transfers or [])
        pools = [self.pools.get(t.name) for t in transfers]
        policies = [_hit_policy(t) for t in transfers]
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for t, pool, policy in zip(transfers, pools, policies, strict=True):
            if not restorable:
                break
            present = self._present(pool.fmt, keys[:kv_pages])
            if policy is PoolHitPolicy.ALL_PAGES:
                last = present.index(False) if False in present else kv_pages
                ok = set(range(1, last + 1))
            else:
                window, run, ok = max(1, len(t.keys or ())), 0, set()
                for pages, here in enumerate(present, 1):
                    run = run + 1 if here else 0
                    if run >= min(window, pages):
                        ok.add(pages)
            if ok:
                hits[t.name] = max(ok)
            restorable = [p for p in restorable if p in ok]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[Any, list[bool]]:
        """Each transfer's pages from the Store into its pool at its host indices: per pool, True for each page
        found and verified."""
        return self._move_v2(transfers, put=False)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[Any, list[bool]]:
        """Each transfer's pages from its pool into the Store: per pool, True for each page stored or present."""
        return self._move_v2(transfers, put=True)

    def _move_v2(self, transfers: list[PoolTransfer], put: bool) -> dict[Any, list[bool]]:
        # Every transfer is checked before any page moves.
        plans = []
        for t in transfers:
            pool = self.pools.get(t.name)
            plans.append((t.name, pool.fmt, t.keys, self.pools.page_pieces(t.keys, t.host_indices, pool)))
        return {name: self._move(put, fmt, keys, pieces, not self.zero_copy) for name, fmt, keys, pieces in plans}

    # HiCacheStorage: the deprecated calls with tensors or raw pointers (always through the staging buffers)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Into a CPU tensor (returns it, or None) or, as SGLang's Mooncake backend takes it, an address and size
        (returns whether it was found and verified)."""
        if isinstance(target_location, torch.Tensor):
            return self.batch_get([key], [target_location])[0]
        return self.batch_get([key], [target_location], [target_sizes]) == 1

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        """Tensors: a list of each tensor filled, or None. Addresses and sizes: how many pages, from the first,
        were found and verified."""
        check_keys(keys)
        if target_locations is None or len(target_locations) != len(keys):
            raise BadArgument(f"need one target location per key, got {target_locations!r:.80}")
        if all(isinstance(t, torch.Tensor) for t in target_locations):
            pieces = _tensor_pieces(target_locations, "target_locations")
            ok = self._move(False, self._fmt(), keys, pieces, staged=True, memory=target_locations)
            return [t if hit else None for t, hit in zip(target_locations, ok, strict=True)]
        ok = self._move(
            False, self._fmt(), keys, _pointer_pieces(target_locations, target_sizes, "target_locations"), staged=True
        )
        return next((i for i, hit in enumerate(ok) if not hit), len(ok))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if value is not None:
            return self.batch_set([key], [value])
        return self.batch_set([key], target_locations=[target_location], target_sizes=[target_sizes])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Puts each tensor of ``values``, or each address and size; True when every page is stored (or was)."""
        check_keys(keys)
        memory: Sequence[Any] = ()
        if values is not None:
            pieces, memory = _tensor_pieces(values, "values"), values
        elif target_locations is not None:
            pieces = _pointer_pieces(target_locations, target_sizes, "target_locations")
        else:
            raise BadArgument("batch_set needs values or target_locations")
        if len(pieces) != len(keys):
            raise BadArgument(f"need one value per key: {len(keys)} keys, {len(pieces)} values")
        return bool(keys) and all(self._move(True, self._fmt(), keys, pieces, staged=True, memory=memory))

    # Statistics and shutdown

    def stats(self) -> dict[str, int]:
        """The object paths' counters, named as kvtier's L3 statistics (``kvtier.STATS``): objects put, present,
        failed, loaded, missing and lost; ``l3_rejected`` objects (failed their check, never served) and how many
        of them were removed."""
        return self.pools.stats()

    def close(self) -> None:
        """Unregisters the buffers and closes the Store client. Idempotent."""
        store = getattr(self, "store", None)
        if store is None:
            return
        pools = getattr(self, "pools", None)
        if pools is not None:
            pools.unregister()
        store.close()
        self.store = None  # type: ignore[assignment]
