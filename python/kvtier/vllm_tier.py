"""kvtier's verified Mooncake L3 as a secondary tier of vLLM's ``TieringOffloadingSpec``: ``KvtierMooncakeTier``.

Selected (vLLM 0.33) by the tiering spec's extra config::

    {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": ..., "secondary_tiers": [
        {"type": "KvtierMooncakeTier", "module_path": "kvtier.vllm",
         "l3_master": "10.0.0.5:50051", "model_version": "<checkpoint revision>", "hash_key": "<secret>"}]}

The tier runs in vLLM's scheduler process under vLLM's CPU tier and moves whole CPU chunks (rows of the CPU tier's
shared region: every rank's bytes of the chunk) to and from Mooncake Store. Each chunk is one kvtier object: a
header (format, fingerprint digest, the chunk's key, payload length, digests) before the row's bytes. The
fingerprint covers the model (vLLM's model name and dtype, and ``model_version``), the parallel layout (TP, PP,
context-parallel sizes), the chunk's bytes and tokens; the key is vLLM's ``OffloadKey`` mapped to 128 bits under
``hash_key``. An object that fails its check is removed from the Store and never copied into vLLM's CPU tier: its
chunk's load fails.

Non-blocking as the framework requires: ``submit_store`` / ``submit_load`` queue the job for one background
thread, which stages objects through two registered buffers of its own (nothing of vLLM's memory is registered
with Mooncake); ``get_finished_jobs`` returns what finished. ``lookup`` answers from what this tier stored or
verified in this process (HIT) and MISS otherwise: objects other instances stored are not probed.
What it stores and drops comes out of ``take_events`` with medium STORAGE.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvtier._core import L3_HEADER_BYTES, ObjectFormat, ObjectPath, fingerprint
from kvtier.identity import Shard, layout_fields
from kvtier.l3.store import MooncakeStore, Store, StoreConfig
from kvtier.settings import CacheSettings

log = logging.getLogger("kvtier.vllm")

# kvtier settings a tier's config may carry; vLLM's own keys of a tier config are left to vLLM.
TIER_SETTINGS = (
    "l3_master",
    "l3_metadata_server",
    "l3_protocol",
    "l3_local_hostname",
    "l3_segment_bytes",
    "l3_buffer_bytes",
    "l3_staging_bytes",
    "l3_trusted_store",
    "model_version",
    "hash_key",
)
VLLM_TIER_KEYS = frozenset({"locality"})


def tier_settings(config: Mapping[str, Any]) -> CacheSettings:
    """kvtier's settings of one tier config (``KVTIER_*`` for what it leaves out); refuses keys that are neither
    vLLM's nor these settings, a missing ``l3_master`` or ``model_version``, and (kvtier's settings do) the public
    default ``hash_key`` on a Store not declared trusted."""
    values = {k: v for k, v in config.items() if k not in VLLM_TIER_KEYS}
    unknown = sorted(set(values) - set(TIER_SETTINGS))
    if unknown:
        raise ValueError(
            f"KvtierMooncakeTier: config keys {unknown} are not settings of this tier (it reads "
            f"{', '.join(TIER_SETTINGS)})"
        )
    s = CacheSettings.resolve(l3="mooncake", **values)
    if s.l3_master is None:
        raise ValueError("KvtierMooncakeTier needs l3_master ('host:port' of the Mooncake master)")
    if s.model_version is None:
        raise ValueError(
            "KvtierMooncakeTier needs model_version (the model's revision the deployment vouches for): vLLM's "
            "model name says where the weights came from, not what they are"
        )
    StoreConfig(s.l3_master)  # raises for an address that is not host:port
    return s


def chunk_identity(spec: Any, row_bytes: int, model_version: str) -> dict[str, str]:
    """The fingerprint fields of a vLLM CPU chunk: model, parallel layout, and the chunk's bytes and tokens."""
    config = spec.config
    p = config.parallel
    shard = Shard(tp_rank=0, tp_size=p.tp_size, pp_rank=0, pp_size=p.pp_size, cp_rank=0, cp_size=p.pcp_size)
    tokens = [g.tokens_per_block * config.cache.blocks_per_chunk for g in config.groups]
    return layout_fields(
        page_bytes=row_bytes,
        state_bytes=0,
        block_size=max(tokens) if tokens else 0,
        layout="vllm.cpu_chunk_row",
        hash_kind="vllm.offload_key",
        key_id="vllm",
        shard=shard,
        model_fields={
            "name": "vllm",
            "model": config.model.name,
            "dtype": config.model.dtype,
            "dcp_size": p.dcp_size,
            "world_size": p.world_size,
            "replicated_layout": bool(getattr(spec, "replicated_layout", False)),
            "canonical_layout": bool(config.canonical_layout),
            "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
            "groups": ",".join(f"{g.group_id}:{g.tokens_per_block}:{len(g.layer_names)}" for g in config.groups),
        },
        model_version=model_version,
    )


class KvtierMooncakeTier(SecondaryTierManager):
    """A secondary tier of vLLM's tiering spec on kvtier's verified Mooncake objects (see the module's text)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        store_factory: Any = None,
        **config: Any,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        self.settings = s = tier_settings(config)
        rows = np.asarray(primary_kv_view)
        if rows.ndim != 2 or rows.dtype.itemsize != 1:
            raise ValueError(f"primary_kv_view must be [chunks, bytes] of bytes, got shape {rows.shape} {rows.dtype}")
        self._rows = rows
        self._base = int(rows.ctypes.data)
        self._stride = int(rows.strides[0])
        self._row_bytes = int(rows.shape[1])
        self._num_chunks = int(rows.shape[0])
        self.object_bytes = L3_HEADER_BYTES + self._row_bytes
        if self.object_bytes > s.l3_staging_bytes:
            raise ValueError(
                f"l3_staging_bytes must hold one chunk object ({self.object_bytes} bytes), got {s.l3_staging_bytes}"
            )
        self.fingerprint = fingerprint(chunk_identity(offloading_spec, self._row_bytes, s.model_version))
        self._format = ObjectFormat(self.fingerprint, hash_key=s.hash_key)
        # The one object path (rust/l3path.rs), staged: its staging buffers are the only memory registered.
        self._path = ObjectPath(staging_bytes=s.l3_staging_bytes)
        self.store: Store = (store_factory or MooncakeStore)(StoreConfig.of(s))
        try:
            for ptr, nbytes in self._path.buffers():
                self.store.register(ptr, nbytes)
        except BaseException:
            self.store.close()
            raise
        self._present: set[bytes] = set()
        self._lock = threading.Lock()
        self._finished: deque[JobResult] = deque()
        self._events: deque[OffloadingEvent] = deque()
        # vLLM drains events only when it publishes them.
        events = getattr(offloading_spec, "kv_events_config", None)
        self._record_events = bool(getattr(events, "enable_kv_cache_events", False))
        self._jobs: queue.Queue[tuple[bool, TransferJob] | None] = queue.Queue()
        self._jobs_failed = 0
        self._thread = threading.Thread(target=self._serve, name="kvtier-vllm-tier", daemon=True)
        self._thread.start()
        log.info("KvtierMooncakeTier: fingerprint %s, %d bytes a chunk", self.fingerprint, self._row_bytes)

    # --- the framework's calls (scheduler thread, never blocking) ---

    def store_keys(self, keys: Iterable[OffloadKey]) -> list[str]:
        """The Store key of each vLLM key's object (``object_bytes`` long: header and chunk)."""
        return self._format.store_keys(self._format.keys([bytes(k).hex() for k in keys]))

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        with self._lock:
            return LookupResult.HIT if key in self._present else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._check_job(job_metadata)
        self._jobs.put((True, job_metadata))

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._check_job(job_metadata)
        self._jobs.put((False, job_metadata))

    def _check_job(self, job: TransferJob) -> None:
        chunks = np.asarray(job.chunk_ids)
        if len(job.keys) != len(chunks):
            raise ValueError(f"job {job.job_id}: {len(job.keys)} keys but {len(chunks)} chunk ids")
        if len(chunks) and (chunks.min() < 0 or chunks.max() >= self._num_chunks):
            raise ValueError(f"job {job.job_id}: chunk ids {chunks.tolist()} outside 0..{self._num_chunks - 1}")

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def has_pending_work(self) -> bool:
        return self._jobs.unfinished_tasks > 0 or bool(self._finished)

    def take_events(self) -> Iterable[OffloadingEvent]:
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        self._jobs.join()

    def config_info(self) -> ConfigInfoMapping:
        return {}

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=30)
        self.store.close()
        # vLLM unmaps its region at shutdown only when no view of it is left.
        self._rows = np.empty((0, 0), dtype=np.uint8)

    # --- the background thread ---

    def _serve(self) -> None:
        while True:
            item = self._jobs.get()
            try:
                if item is None:
                    return
                is_store, job = item
                t0 = time.perf_counter()
                try:
                    result = self._store(job) if is_store else self._load(job)
                except Exception:  # a tier failure is a failed job, never an exception in vLLM's scheduler
                    log.exception("KvtierMooncakeTier: job %d failed", job.job_id)
                    self._jobs_failed += 1
                    result = JobResult(job_id=job.job_id, success=False)
                result.transfer_time = time.perf_counter() - t0
                self._finished.append(result)
            finally:
                self._jobs.task_done()

    def stats(self) -> dict[str, int]:
        """The object path's counters, named as kvtier's L3 statistics (``kvtier.STATS``), and the jobs that
        failed (``l3_errors``)."""
        return {**self._path.stats(), "l3_errors": self._jobs_failed}

    @property
    def counters(self) -> dict[str, int]:
        """``stats()`` under the short names of earlier releases: put, present, loaded, missing, rejected, failed."""
        s = self.stats()
        names = ("put", "present", "loaded", "missing", "rejected", "failed")
        keys = ("l3_objects_put", "l3_puts_present", "l3_objects_loaded", "l3_objects_missing", "l3_rejected")
        return dict(zip(names, [*(s[k] for k in keys), self._jobs_failed], strict=True))

    def _pieces(self, job: TransferJob) -> tuple[list[bytes], list[list[tuple[int, int]]]]:
        """Each key of a job (vLLM's key bytes) and its chunk's row in vLLM's CPU tier as the object's payload."""
        keys = [bytes(k) for k in job.keys]
        rows = [[(self._base + int(c) * self._stride, self._row_bytes)] for c in np.asarray(job.chunk_ids)]
        return keys, rows

    def _store(self, job: TransferJob) -> JobResult:
        keys, rows = self._pieces(job)
        outcomes = self._path.put(self.store, self._format, [k.hex() for k in keys], rows)
        stored = [OffloadKey(k) for k, o in zip(keys, outcomes, strict=True) if o.ok]
        with self._lock:
            self._present.update(stored)
        if stored and self._record_events:
            self._events.append(OffloadingEvent(keys=stored, medium=Medium.STORAGE, removed=False))
        failed = [o for o in outcomes if not o.ok]
        if failed:
            log.warning(
                "KvtierMooncakeTier: %d of %d chunks not stored, first code %s", len(failed), len(keys), failed[0].code
            )
        moved = self.object_bytes * sum(o.kind == "stored" for o in outcomes)
        return JobResult(job_id=job.job_id, success=not failed, successful_keys=None, transfer_bytes=moved)

    def _load(self, job: TransferJob) -> JobResult:
        # Each object is copied out of the staging buffer into vLLM's row and checked there: a row that fails its
        # check is reported failed, so vLLM's CPU tier never marks it loadable.
        keys, rows = self._pieces(job)
        outcomes = self._path.get(self.store, self._format, [k.hex() for k in keys], rows)
        for k, o in zip(keys, outcomes, strict=True):
            if o.kind == "rejected":
                log.warning("KvtierMooncakeTier: object of key %s rejected: %s", k.hex(), o.reason)
        # Known gone: not in the Store, or removed after it failed its check (a transient failure is neither).
        gone = [OffloadKey(k) for k, o in zip(keys, outcomes, strict=True) if o.kind == "missing" or o.removed]
        if gone:
            with self._lock:
                self._present.difference_update(gone)
            if self._record_events:
                self._events.append(OffloadingEvent(keys=gone, medium=Medium.STORAGE, removed=True))
        ok = [o.ok for o in outcomes]
        good = [OffloadKey(k) for k, hit in zip(keys, ok, strict=True) if hit]
        return JobResult(
            job_id=job.job_id,
            success=all(ok),
            successful_keys=None if all(ok) else good,
            transfer_bytes=self.object_bytes * len(good),
        )
