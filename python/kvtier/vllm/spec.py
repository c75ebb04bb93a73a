"""vLLM's offloading connector on kvtier: ``kvtier.vllm.KvtierSpec``.

One line selects it (vLLM 0.25.1 through 0.34)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KvtierSpec", "spec_module_path": "kvtier.vllm",
                                    "cpu_bytes_to_use": 64000000000}}'

(``--kv-offloading-size`` fills ``cpu_bytes_to_use``; kvtier's ``host_bytes`` setting may be given instead.)

vLLM offloads KV in **vLLM chunks** (``blocks_per_chunk`` GPU blocks under one ``OffloadKey``; vLLM's own names
``chunk_ids``, ``num_chunks``, ``blocks_per_chunk`` are kept in code, where "chunk" always means a vLLM chunk).
vLLM builds the spec in the scheduler process and in every worker process; they share nothing but what the
connector passes between them, the vLLM chunk ids in the load/store specs. So:

- ``get_manager()`` (scheduler) is kvtier's index keyed by vLLM's own ``OffloadKey`` bytes (block hash + group):
  it decides which host slot (one vLLM chunk) each key goes to, what to evict (kvtier's policy: ``lru`` or
  ``adaptive``) and reports vLLM's KV events with medium CPU. It never touches KV bytes.
- ``get_worker(kv_caches)`` (every worker) copies between vLLM's KV caches and a pinned host pool of its own rank:
  vLLM chunk ``c`` of that pool holds this rank's bytes of the manager's host slot ``c``. Both sides size the
  pool from the same config (host bytes / (bytes of a vLLM chunk on every rank)), so their ranges agree. Copies run
  through kvtier's page copier (copy engine or kernel by piece size) on kvtier's own streams, ordered after vLLM's
  current stream by events; completions come back through ``get_finished``. On CPU tensors copies are memcpy and
  complete at once.

The extra config (or the ``KVTIER_*`` variables) may give the kvtier settings of scope ``vllm`` in
``kvtier.settings`` (``SETTING_KEYS``): ``host_bytes``, ``eviction_policy``, ``event_buffer``, the copy settings
(``copy_*``, ``store_copy_*``, ``copy_streams``) and the pin settings (``pin_step_bytes``, ``pin_method``). Any bad
value raises ``kvtier.BadArgument`` (a ``ValueError``) naming it when vLLM builds the spec.

Supported vLLM: ``SUPPORTED_VLLM``, 0.25.1 through 0.34. What differs between those releases (the spec's
constructor, event fields, metrics, ``touch``, 0.34's device pointers for the GPU side) is named in one module,
``kvtier.vllm.release``; importing this module under any other vLLM raises ImportError naming the range.
``import kvtier`` never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

# isort: off
# The release check first (kvtier.vllm.release refuses a vLLM outside the range by name); the names imported from
# vLLM after it are in every supported release.
from kvtier.vllm.release import (
    CPU_METRICS,
    HAS_WRITE_READ_USAGE,
    HOST_HIT_SOURCE,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    SCHEDULER_TOUCHES,
    STORED_EVENT_NAMES_REQUEST,
    SUPPORTED_VLLM,
    CPUOffloadingInfo,
    SpecLayout,
    check_vllm_version,
    offloading_event,
    spec_layout,
)

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

# isort: on
from kvtier._core import BadArgument, Index, IndexConfig
from kvtier.copy import copy_options
from kvtier.settings import VLLM, CacheSettings, check_fits, for_scope, scope_names
from kvtier.vllm.copy import ChunkCopier

__all__ = [
    "SUPPORTED_VLLM",
    "KvtierManager",
    "KvtierSpec",
    "KvtierTieringSpec",
    "KvtierWorker",
    "check_vllm_version",
    "resolve_settings",
]

# The kvtier settings the extra config may carry (kvtier.settings' registry, scope "vllm"); its other keys are the
# engine's or vLLM's own.
SETTING_KEYS = scope_names(VLLM)
# Lookup answers, bound once (an Enum member read through its class costs more than the rest of a lookup).
_HIT, _HIT_PENDING, _MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS
# Index.key_state's answers for a key with no page on the host and one whose page is ready.
_ABSENT, _READY = 0, 2
# The worker's copy method unless the extra config or KVTIER_COPY_METHOD says otherwise. Under vLLM 0.25.1 on H100s
# (8B shape; vLLM lays the KV cache out across layers for the offloading connector, a block's 32 layers in one
# 2 MiB page), the kernel's loads ran at a steady 33 GB/s on one machine and 51 on another (the host's ceiling for a
# kernel reading its memory), the copy engine's at 16-55 GB/s on some machines and at native's rate with the same
# blocks on another; where they were fast, the copy engine's turns beat the kernel's by 0.02-0.06 s, where they were
# slow the kernel's beat them by up to 0.33 s: no one method leads on every machine, and the kernel's losses are the
# smaller. Copy-engine stores cost a no-reuse run 7-11% of its throughput against 1.6-3% for the kernel's
# (docs/VLLM.md, "Serving a model" and "Runs K, L and M").
WORKER_COPY_METHOD = "kernel"
# The worker's kernel grid bound for stores unless set otherwise: stores run beside the model's GEMMs, and each CTA
# they hold is an SM the model waits for. Under vLLM 0.25.1 on an H100 (8B shape), 2 CTAs against the cache's 8 took
# a no-reuse run from 0.953 to 0.994 of no offloading's throughput in one run (0.976 and 0.980 in two later ones,
# 0.967 with 8 earlier). Loads keep copy_ctas (8): with 2 CTAs, 7.8 GiB of 32K prefixes loaded at about 22 GB/s
# against 53 GB/s with 8 (docs/VLLM.md, "Serving a model").
WORKER_STORE_COPY_CTAS = 2
# KV events kept between two drains when vLLM publishes events and event_buffer is not set.
DEFAULT_EVENT_BUFFER = 1 << 16


def resolve_settings(extra_config: Mapping[str, Any], env: Mapping[str, str] | None = None) -> CacheSettings:
    """kvtier's settings from vLLM's kv_connector_extra_config (then ``KVTIER_*``, then defaults). vLLM's
    ``cpu_bytes_to_use`` (what ``--kv-offloading-size`` sets) is the host size unless ``host_bytes`` is given."""
    if not isinstance(extra_config, Mapping):
        raise BadArgument(f"kv_connector_extra_config must be a mapping, got {type(extra_config).__name__}")
    arguments = {k: extra_config[k] for k in SETTING_KEYS if extra_config.get(k) is not None}
    cpu_bytes = extra_config.get("cpu_bytes_to_use")
    if "host_bytes" not in arguments and cpu_bytes is not None:
        if isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, (int, float, str)):
            raise BadArgument(f"cpu_bytes_to_use must be a number of bytes, got {cpu_bytes!r}")
        arguments["host_bytes"] = int(cpu_bytes) if isinstance(cpu_bytes, float) else cpu_bytes
    settings = for_scope(VLLM, arguments, env)
    defaults: dict[str, Any] = {}
    if settings.sources["copy_method"] == "default":
        defaults["copy_method"] = WORKER_COPY_METHOD
    # A copy_ctas the deployment sets bounds stores too, as it does everywhere.
    if settings.sources["store_copy_ctas"] == settings.sources["copy_ctas"] == "default":
        defaults["store_copy_ctas"] = WORKER_STORE_COPY_CTAS
    return for_scope(VLLM, {**arguments, **defaults}, env) if defaults else settings


def _key_name(key: bytes) -> str:
    return bytes(key).hex()


class KvtierManager(OffloadingManager):
    """vLLM's scheduler-side offloading manager on kvtier's index: host slots keyed by vLLM's ``OffloadKey`` bytes.

    ``prepare_load``/``prepare_store`` take an index ticket each; vLLM reports completion by keys
    (``complete_load``/``complete_store``), and a ticket completes once every one of its keys is reported (a store
    that failed for any key is aborted: its reserved slots are freed, nothing of it becomes loadable).

    vLLM asks about one key a call; ``lookup`` is the index's own ``KeyAnswers.lookup``, one call into the core
    that answers with vLLM's ``LookupResult`` members and counts the lookup in the index's statistics
    (``stats()``).
    """

    medium = MEDIUM_CPU  # the medium of the events it reports

    def __init__(
        self,
        num_slots: int,
        *,
        eviction_policy: str = "lru",
        enable_events: bool = False,
        event_buffer: int = 0,
        tokens_per_slot: int = 16,
        info: Any = None,
    ) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise BadArgument(f"num_slots must be a positive int, got {num_slots!r}")
        if isinstance(tokens_per_slot, bool) or not isinstance(tokens_per_slot, int) or tokens_per_slot < 1:
            raise BadArgument(f"tokens_per_slot must be a positive int, got {tokens_per_slot!r}")
        self.num_slots = num_slots
        self.enable_events = bool(enable_events)
        if self.enable_events and event_buffer == 0:
            event_buffer = DEFAULT_EVENT_BUFFER
        self._config = IndexConfig(
            num_slots,
            block_size=tokens_per_slot,
            eviction_policy=eviction_policy,
            event_buffer=event_buffer if self.enable_events else 0,
        )
        self._config_info: Mapping[str, Any] = info.as_config_info() if info is not None else {}
        # Slots each prepare_store asked for since the last get_stats (vLLM's allocation-size histogram).
        self._allocation_sizes: list[int] = []
        self._reset_state()

    def _reset_state(self) -> None:
        self.index = Index(self._config)
        # vLLM calls lookup once a key: the core answers it directly, without a Python frame in between.
        self.lookup = self.index.key_answers(_MISS, _HIT_PENDING, _HIT).lookup  # type: ignore[method-assign,assignment]
        # The keys each store in flight copies (what a failed store's event names).
        self._store_keys: dict[int, list[bytes]] = {}
        self._pending_store_keys = 0
        # Events taken from the index early, to keep them ahead of a failed store's release (``_settle_store``).
        self._events: list[Any] = []

    # --- lookups and loads ---

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # Replaced on each instance by the index's KeyAnswers.lookup (``_reset_state``); the same answer.
        return (_MISS, _HIT_PENDING, _HIT)[self.index.key_state(key)]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        # vLLM 0.32 on asks where a hit comes from: kvtier's host pool.
        return HOST_HIT_SOURCE

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        # vLLM up to 0.30 calls this for the blocks a request reuses: the ready pages count as a use, the first key
        # the most recent (a store of keys all on the host holds them and releases them deepest first).
        ready = [k for k in dict.fromkeys(keys) if self.index.key_state(k) == _READY]
        plan = self.index.store_keys(ready) if ready else None
        if plan is not None:
            self.index.complete(plan[0])

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        if not keys:
            return CPULoadStoreSpec([])
        _, slots = self.index.load_keys(keys)
        return CPULoadStoreSpec(slots)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        # Each key's report goes to the oldest load of it in flight; a load completes once each of its keys is
        # reported (the core keeps the load tickets by key, as it keeps the stores').
        self.index.complete_load_keys(keys)

    # --- stores ---

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        if not keys or (SCHEDULER_TOUCHES and all(map(self.index.key_state, keys))):
            # Nothing to store. Where vLLM's scheduler touches the keys it reuses (up to 0.30), a prepare_store of
            # keys all on the host counts no use, as vLLM's CPU manager there: its touches rank the pages.
            return PrepareStoreOutput(keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=[])
        plan = self.index.store_keys(keys)
        if plan is None:
            self._allocation_sizes.append(len({k for k in keys if self.index.key_state(k) == _ABSENT}))
            return None
        # vLLM's OffloadKey is a NewType of bytes: the evicted keys' bytes are vLLM's keys as they are.
        ticket, indices, slots, evicted = plan
        if indices is not None and not indices:
            # Everything is on the host already: the ready pages the call held count as a use, and go back now
            # (vLLM reports no completion for a store with nothing to copy).
            self.index.complete(ticket)
            return PrepareStoreOutput(keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=evicted)
        # The positions of distinct keys not on the host, in order (None: every key).
        keys_to_store = keys if indices is None else list(map(keys.__getitem__, indices))
        self._allocation_sizes.append(len(keys_to_store))
        self._store_keys[ticket] = keys_to_store
        self._pending_store_keys += len(keys_to_store)
        return PrepareStoreOutput(keys_to_store=keys_to_store, store_spec=CPULoadStoreSpec(slots), evicted_keys=evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        # A key not being stored, already reported or stored by an earlier call belongs to no store. The stores
        # whose keys are all reported settle oldest first, whatever the order of the keys (vLLM passes a set):
        # what completes in one call ages the same in every process.
        matched, due = self.index.complete_keys(keys, success)
        self._pending_store_keys -= matched
        for ticket, failed in due:
            self._settle_store(ticket, failed, req_context)

    def _settle_store(self, ticket: int, failed: bool, req_context: ReqContext) -> None:
        keys = self._store_keys.pop(ticket)
        # A store's own events are told apart from the index's earlier ones where they carry something of it.
        own_events = self.enable_events and (failed or STORED_EVENT_NAMES_REQUEST)
        if own_events:
            self._events.extend(self._index_events())
        if failed:
            self.index.abort(ticket)
            # vLLM's event tracker (0.33 on) keeps each pending key's metadata until an event releases it; a store
            # that never completes is released without a public removal, as vLLM's CPU manager does.
            release = offloading_event(keys, MEDIUM_CPU, True, metadata_only=True) if own_events else None
            if release is not None:
                self._events.append(release)
        else:
            self.index.complete(ticket)
            if own_events:
                for event in self._index_events():
                    event.req_context = req_context
                    self._events.append(event)

    # --- requests, events, statistics ---

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        # kvtier keeps nothing a request for engine keys: its loads and stores settle by their completions.
        return

    def take_events(self) -> Iterable[Any]:
        if not self.enable_events:
            return
        # The whole batch leaves at the first step, so a drain stopped early replays nothing.
        events, self._events = self._events + self._index_events(), []
        for event in events:
            if getattr(event, "metadata_only", False):
                # A key stored again since its failed store is owned by the new store: its metadata stays.
                keys = [k for k in event.keys if self.index.key_state(k) == _ABSENT]
                if not keys:
                    continue
                event.keys = keys
            yield event

    def _index_events(self) -> list[Any]:
        return [
            offloading_event(
                [OffloadKey(bytes(k)) for k in event.keys],
                MEDIUM_CPU if event.medium == "CPU" else MEDIUM_STORAGE,
                event.removed,
                # Every page stored on the host is announced again when it leaves (0.34's stored events say so).
                removal_expected=STORED_EVENT_NAMES_REQUEST and not event.removed,
            )
            for event in self.index.take_events()
        ]

    def reset_cache(self) -> None:
        # vLLM never completes a job issued before the reset, so every ticket and slot goes with the old index.
        self._reset_state()

    def stats(self) -> dict[str, int | float]:
        """kvtier's own statistics of the index (lookups, hits, pages stored, evicted, ...)."""
        return self.index.stats()

    def get_stats(self) -> OffloadingConnectorStats | None:
        s = self.index.stats()
        used, evictable = int(s["pages_used"]), int(s["pages_evictable"])
        usage = (used - evictable) / self.num_slots
        write_usage = self._pending_store_keys / self.num_slots
        stats = OffloadingConnectorStats()
        stats.set_gauge(CPU_METRICS.CPU_CACHE_USAGE_PERC, usage)
        if HAS_WRITE_READ_USAGE:
            stats.set_gauge(CPU_METRICS.CPU_CACHE_WRITE_USAGE_PERC, write_usage)
            stats.set_gauge(CPU_METRICS.CPU_CACHE_READ_USAGE_PERC, max(usage - write_usage, 0.0))
            for size in self._allocation_sizes:
                stats.observe_histogram(CPU_METRICS.CPU_ALLOCATION_SIZE, size)
        self._allocation_sizes.clear()
        return stats

    def config_info(self) -> Sequence[Mapping[str, Any]]:
        return [self._config_info]


# --- worker side ---------------------------------------------------------------------------------------------


class KvtierWorker(OffloadingWorker):
    """vLLM's offloading worker on kvtier's page copier: vLLM's KV caches (CUDA, or CPU tensors) <-> this rank's
    pinned host pool, the manager's vLLM chunk ``c`` in host blocks ``c * blocks_per_chunk ..``
    (``kvtier.vllm.copy``); ``settings``: the copy and pin settings (default: the worker's defaults and
    ``KVTIER_*``)."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        *,
        num_chunks: int,
        blocks_per_chunk: int = 1,
        settings: CacheSettings | None = None,
    ) -> None:
        if not isinstance(kv_caches, CanonicalKVCaches):
            raise BadArgument(f"kv_caches must be vLLM's CanonicalKVCaches, got {type(kv_caches).__name__}")
        s = settings if settings is not None else resolve_settings({})
        self._tensors = [t.tensor for t in kv_caches.tensors]
        self._group_tensors = [[r.tensor_idx for r in refs] for refs in kv_caches.group_data_refs]
        self.copier = ChunkCopier(
            self._tensors,
            self._group_tensors,
            num_chunks=num_chunks,
            blocks_per_chunk=blocks_per_chunk,
            copy_options=copy_options(s),
            copy_streams=s.copy_streams,
            pin_method=s.pin_method,
            pin_step_bytes=s.pin_step_bytes,
        )

    def device_blocks(self, device_ptrs: Any) -> np.ndarray:
        """The block ids of vLLM 0.34's ``DevicePointers`` (a pointer for each group, data ref and block): each
        pointer must be the start of a block of the tensor its data ref names, the same block for every data ref
        of a group."""
        ptrs = np.asarray(device_ptrs.ptrs, dtype=np.uint64)
        counts, refs = list(device_ptrs.group_block_counts), list(device_ptrs.group_data_ref_counts)
        if len(counts) != len(self._group_tensors) or len(refs) != len(self._group_tensors):
            raise BadArgument(
                f"the device pointers have {len(counts)} KV groups, the KV caches {len(self._group_tensors)}"
            )
        out, at = [], 0
        for g, (n, n_refs) in enumerate(zip(counts, refs, strict=True)):
            if n == 0:
                continue
            tensor_ids = self._group_tensors[g]
            if n_refs != len(tensor_ids):
                raise BadArgument(f"group {g} has {n_refs} data refs in the device pointers, {len(tensor_ids)} here")
            blocks = None
            for j, t_idx in enumerate(tensor_ids):
                t = self._tensors[t_idx]
                stride = t.stride(0) * t.element_size()
                rel = ptrs[at + j * n : at + (j + 1) * n].astype(np.int64) - np.int64(t.data_ptr())
                ids = rel // stride
                if len(rel) != n or (rel % stride).any() or ids.min() < 0 or ids.max() >= t.shape[0]:
                    raise BadArgument(f"group {g}: device pointers of data ref {j} are not blocks of its tensor")
                if blocks is None:
                    blocks = ids
                elif not np.array_equal(ids, blocks):
                    raise BadArgument(f"group {g}: data ref {j} points at other blocks than data ref 0")
            assert blocks is not None
            out.append(blocks)
            at += n * n_refs
        if at != len(ptrs):
            raise BadArgument(f"{len(ptrs)} device pointers, the groups account for {at}")
        return np.concatenate(out).astype(np.int32) if out else np.empty(0, dtype=np.int32)

    def _submit(self, job_id: int, to_host: bool, gpu_spec: Any, chunk_spec: Any, lane: str) -> bool:
        chunk_ids = getattr(chunk_spec, "block_ids", None)
        if not isinstance(chunk_ids, np.ndarray):
            raise BadArgument(f"the host side must be a spec of chunk ids, got {type(chunk_spec).__name__}")
        if isinstance(gpu_spec, GPULoadStoreSpec):
            ids, sizes, firsts = gpu_spec.block_ids, gpu_spec.group_sizes, gpu_spec.block_indices
        elif hasattr(gpu_spec, "ptrs") and hasattr(gpu_spec, "group_block_counts"):  # vLLM 0.34's DevicePointers
            ids, sizes, firsts = self.device_blocks(gpu_spec), gpu_spec.group_block_counts, gpu_spec.block_indices
        else:
            raise BadArgument(
                f"the GPU side must be a GPULoadStoreSpec or vLLM's DevicePointers, got {type(gpu_spec).__name__}"
            )
        self.copier.submit(job_id, to_host, ids, sizes, firsts, chunk_ids, lane)
        return True

    # vLLM 0.33 passes the GPU side as a GPULoadStoreSpec, 0.34 as DevicePointers (positionally, so the names of
    # 0.33's parameters serve both).
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, True, src_spec, dst_spec, "store")

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: Any, expedited: bool = False) -> bool:
        return self._submit(job_id, False, dst_spec, src_spec, "expedited" if expedited else "load")

    def get_finished(self) -> list[TransferResult]:
        return [
            TransferResult(job_id=job_id, success=ok, transfer_size=nbytes, transfer_time=seconds)
            for job_id, ok, nbytes, seconds in self.copier.finished()
        ]

    def wait(self, job_ids: set[int]) -> None:
        self.copier.wait(job_ids)

    def host_view(self, copier: int = 0) -> np.ndarray:
        """One copier's host pool as ``[host blocks, block bytes]`` uint8 (no copy): host block
        ``c * blocks_per_chunk + j`` holds block ``j`` of vLLM chunk ``c``."""
        return self.copier.host_view(copier)

    def shutdown(self) -> None:
        self.copier.close()


# --- the spec ------------------------------------------------------------------------------------------------


class KvtierSpec(OffloadingSpec):
    """vLLM's offloading spec on kvtier: ``{"spec_name": "KvtierSpec", "spec_module_path": "kvtier.vllm"}``."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        definitions: dict[str, OffloadingMetricMetadata] = {
            CPU_METRICS.CPU_CACHE_USAGE_PERC: OffloadingGaugeMetadata(
                documentation="Fraction of kvtier's host slots held by transfers in flight (0.0 idle, 1.0 full)."
            ),
        }
        if HAS_WRITE_READ_USAGE:
            definitions[CPU_METRICS.CPU_CACHE_WRITE_USAGE_PERC] = OffloadingGaugeMetadata(
                documentation="Fraction of kvtier's host slots held by stores in flight."
            )
            definitions[CPU_METRICS.CPU_CACHE_READ_USAGE_PERC] = OffloadingGaugeMetadata(
                documentation="Fraction of kvtier's host slots held by loads in flight."
            )
            definitions[CPU_METRICS.CPU_ALLOCATION_SIZE] = OffloadingHistogramMetadata(
                documentation="Host slots each prepare_store asked for (refused calls included).",
                buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144),
            )
        return definitions

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return CPUOffloadingInfo.config_info_keys() if CPUOffloadingInfo is not None else ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # vLLM builds the spec from an OffloadingConfig (0.26 on) or a VllmConfig and a KVCacheConfig (0.25):
        # vLLM's base class takes either, and spec_layout reads what kvtier needs from what it kept.
        super().__init__(*args, **kwargs)
        self.layout: SpecLayout = spec_layout(self)
        if self.layout.canonical_layout:
            raise BadArgument(
                "kvtier.vllm.KvtierSpec stores each rank's own bytes; the canonical layout "
                "(canonical_layout=true in the extra config) is not supported"
            )
        self.settings = resolve_settings(self.extra_config)
        world_size = self.layout.world_size
        per_block = self.layout.worker_kv_bytes_per_block
        if per_block <= 0 or world_size <= 0:
            raise BadArgument(
                f"vLLM gave worker_kv_bytes_per_block={per_block} and world_size={world_size}: "
                "kvtier sizes its host pool from both"
            )
        self.blocks_per_chunk = self.layout.blocks_per_chunk
        # A vLLM chunk's bytes on every rank: each rank keeps its part in a pool of its own, at the same slot.
        self.kv_bytes_per_chunk = per_block * world_size * self.blocks_per_chunk
        self.num_chunks = int(self.settings.host_bytes) // self.kv_bytes_per_chunk
        if self.num_chunks < 1:
            raise BadArgument(
                f"host_bytes={self.settings.host_bytes} holds no chunk of {self.kv_bytes_per_chunk} bytes "
                f"({per_block} bytes a block x {world_size} ranks x {self.blocks_per_chunk} blocks a chunk)"
            )
        # Every rank's pool on this machine: host_bytes in all, with the index's bookkeeping of each chunk.
        check_fits(self.settings, page_slots=self.num_chunks, page_bytes=self.kv_bytes_per_chunk, state_bytes=0)
        self.info = (
            CPUOffloadingInfo.from_config(self.config, self.num_chunks, self.kv_bytes_per_chunk)
            if CPUOffloadingInfo is not None
            else None
        )
        self._manager: KvtierManager | None = None
        self._worker: KvtierWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            s = self.settings
            self._manager = KvtierManager(
                self.num_chunks,
                eviction_policy=s.eviction_policy,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                event_buffer=s.event_buffer,
                tokens_per_slot=self.layout.tokens_per_chunk,
                info=self.info,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            s = self.settings
            self._worker = KvtierWorker(
                kv_caches,
                num_chunks=self.num_chunks,
                blocks_per_chunk=self.blocks_per_chunk,
                settings=s,
            )
        return self._worker


class KvtierTieringSpec(TieringOffloadingSpec):
    """vLLM's own tiering spec (its CPU tier and the secondary tiers of ``secondary_tiers``), selected through this
    module so that kvtier's Mooncake tier is registered with vLLM's tier factory first: vLLM before 0.28 builds a
    tier from its registry only (``"type": "KvtierMooncakeTier"``; 0.28 on also reads a tier's ``module_path``).
    ``{"spec_name": "KvtierTieringSpec", "spec_module_path": "kvtier.vllm", "secondary_tiers": [...]}``."""


def _register_tier() -> None:
    try:
        SecondaryTierFactory.register_tier("KvtierMooncakeTier", "kvtier.vllm.tier", "KvtierMooncakeTier")
    except ValueError:  # registered already (this module imported again)
        pass


_register_tier()


def __getattr__(name: str) -> Any:
    # The Mooncake tier (kvtier.vllm.tier) is imported when vLLM's tier factory asks for it, not with the spec.
    if name == "KvtierMooncakeTier":
        from kvtier.vllm.tier import KvtierMooncakeTier

        return KvtierMooncakeTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
