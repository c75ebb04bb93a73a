"""kvtier's verified Mooncake L3 as a secondary tier of vLLM's ``TieringOffloadingSpec``: ``KvtierMooncakeTier``.

Selected (vLLM 0.25.1 through 0.34) by the tiering spec's extra config::

    {"spec_name": "KvtierTieringSpec", "spec_module_path": "kvtier.vllm", "cpu_bytes_to_use": ..., "secondary_tiers": [
        {"type": "KvtierMooncakeTier", "module_path": "kvtier.vllm",
         "l3_master": "10.0.0.5:50051", "model_version": "<checkpoint revision>", "hash_key": "<secret>"}]}

The tier runs in vLLM's scheduler process under vLLM's CPU tier and moves whole vLLM chunks (rows of the CPU tier's
shared region: every rank's bytes of the vLLM chunk; "chunk" in this module is always a vLLM chunk) to and from
Mooncake Store. Each vLLM chunk is one kvtier object: a header (format, fingerprint digest, the vLLM chunk's key,
payload length, digests) before the row's bytes. The fingerprint covers the model (vLLM's model name and dtype, and
``model_version``), the parallel layout (TP, PP, context-parallel sizes), the vLLM chunk's bytes and tokens; the
key is vLLM's ``OffloadKey`` mapped to 128 bits under ``hash_key``. An object that fails its check is removed from
the Store and never copied into vLLM's CPU tier: its vLLM chunk's load fails.

Non-blocking as the framework requires: ``submit_store`` / ``submit_load`` queue the job for one background
thread, which stages objects through two registered buffers of its own (nothing of vLLM's memory is registered
with Mooncake); ``get_finished_jobs`` returns what finished. ``lookup`` answers HIT for what this tier stored or
found in the Store; a key it has not seen is answered RETRY and asked of the Store (``batch_is_exist``, one call for
every key a scheduler step asked about, on the background thread), so objects that another instance, or this
one before a restart, stored are found a step later; a key the Store does not have is MISS until the request that
asked finishes. What it stores and drops comes out of ``take_events`` with medium STORAGE (vLLM takes a tier's
events from 0.28 on; before, none are recorded).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import numpy as np

# isort: off
# The release check first; what differs between releases comes from kvtier.vllm.release.
from kvtier.vllm.release import (
    MEDIUM_STORAGE,
    TIER_BASE_PARAMETERS,
    TIER_EVENTS,
    job_chunk_ids,
    job_result,
    offloading_event,
    spec_layout,
)
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

# isort: on
from kvtier._core import L3_HEADER_BYTES, BadArgument, ObjectFormat, ObjectPath, fingerprint
from kvtier.identity import Shard, layout_fields
from kvtier.l3.store import MooncakeStore, Store, StoreConfig
from kvtier.settings import VLLM_TIER, CacheSettings, for_scope, scope_names

log = logging.getLogger("kvtier.vllm")
# vLLM seeds its block hashes, the keys of this tier's objects, at random in each process unless PYTHONHASHSEED is set.
UNSEEDED_HASHES = (
    "KvtierMooncakeTier: PYTHONHASHSEED is not set, so vLLM seeds its block hashes (the Store's keys) at random in "
    "this process: no other instance, and not this one after a restart, will find the objects it stores. Set "
    "PYTHONHASHSEED to the same value on every instance that shares the Store."
)

# kvtier settings a tier's config may carry (kvtier.settings' registry, scope "vllm_tier"); vLLM's own keys of a
# tier config are left to vLLM.
TIER_SETTINGS = scope_names(VLLM_TIER)
VLLM_TIER_KEYS = frozenset({"locality", "module_path"})


def tier_settings(config: Mapping[str, Any]) -> CacheSettings:
    """kvtier's settings of one tier config (``KVTIER_*`` for what it leaves out); kvtier's settings refuse keys
    that are neither vLLM's nor settings of the tier, a missing ``l3_master`` or ``model_version``, and the public
    default ``hash_key`` on a Store not declared trusted."""
    return for_scope(VLLM_TIER, {k: v for k, v in config.items() if k not in VLLM_TIER_KEYS}, l3="mooncake")


def chunk_identity(spec: Any, row_bytes: int, model_version: str) -> dict[str, str]:
    """The fingerprint fields of a vLLM chunk in vLLM's CPU tier: model, parallel layout, its bytes and tokens."""
    layout = spec_layout(spec)
    shard = Shard(tp_rank=0, tp_size=layout.tp_size, pp_rank=0, pp_size=layout.pp_size, cp_rank=0,
                  cp_size=layout.pcp_size)  # fmt: skip
    return layout_fields(
        page_bytes=row_bytes,
        state_bytes=0,
        block_size=layout.tokens_per_chunk if layout.groups else 0,
        layout="vllm.cpu_chunk_row",
        hash_kind="vllm.offload_key",
        key_id="vllm",
        shard=shard,
        model_fields={
            "name": "vllm",
            "model": layout.model_name,
            "dtype": layout.model_dtype,
            "dcp_size": layout.dcp_size,
            "world_size": layout.world_size,
            "replicated_layout": layout.replicated_layout,
            "canonical_layout": layout.canonical_layout,
            "worker_kv_bytes_per_block": layout.worker_kv_bytes_per_block,
            "groups": ",".join(f"{g}:{tokens}:{layers}" for g, tokens, layers in layout.groups),
        },
        model_version=model_version,
    )


def _stop(jobs: queue.Queue[Any], thread: threading.Thread, store: Store) -> None:
    """Ends the tier's thread once the jobs queued before it are done (30 s at most), then closes the Store client."""
    if thread.is_alive():
        jobs.put(None)
        thread.join(timeout=30)
    store.close()


class KvtierMooncakeTier(SecondaryTierManager):
    """A secondary tier of vLLM's tiering spec on kvtier's verified Mooncake objects (see the module's text)."""

    medium: ClassVar[Any] = MEDIUM_STORAGE

    # Whole: vLLM's view checked, the object path and the Store made, the job thread started, in the order each
    # needs the one before (a Store that fails to register is closed here).
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
        base = {
            "offloading_spec": offloading_spec,
            "primary_kv_view": primary_kv_view,
            "tier_type": tier_type,
            "backpressure_detector": backpressure_detector,
        }
        super().__init__(**{k: v for k, v in base.items() if k in TIER_BASE_PARAMETERS})
        self.settings = s = tier_settings(config)
        if os.environ.get("PYTHONHASHSEED") is None:
            log.warning(UNSEEDED_HASHES)
        rows = np.asarray(primary_kv_view)
        if rows.ndim != 2 or rows.dtype.itemsize != 1:
            raise BadArgument(f"primary_kv_view must be [chunks, bytes] of bytes, got shape {rows.shape} {rows.dtype}")
        self._rows = rows
        self._base = int(rows.ctypes.data)
        self._stride = int(rows.strides[0])
        self._row_bytes = int(rows.shape[1])
        self._num_chunks = int(rows.shape[0])
        self.object_bytes = L3_HEADER_BYTES + self._row_bytes
        if self.object_bytes > s.l3_staging_bytes:
            raise BadArgument(
                f"l3_staging_bytes must hold one chunk object ({self.object_bytes} bytes), got {s.l3_staging_bytes}"
            )
        self.fingerprint = fingerprint(chunk_identity(offloading_spec, self._row_bytes, s.model_version))
        self._format = ObjectFormat(self.fingerprint, hash_key=s.hash_key)
        # The one object path (rust/l3/path.rs), staged: its staging buffers are the only memory registered with
        # the Store. The chunk rows are the memory the path may move objects from and into (checked in the core).
        self._path = ObjectPath(staging_bytes=s.l3_staging_bytes)
        self._path.add_memory(rows)
        self.store: Store = (store_factory or MooncakeStore)(StoreConfig.of(s))
        try:
            for ptr, nbytes in self._path.buffers():
                self.store.register(ptr, nbytes)
        except BaseException:
            self.store.close()
            raise
        self._present: set[bytes] = set()
        # What the Store said of keys this process had not stored: False (not there), None (asked); the keys each
        # request asked about, forgotten when it finishes, and those to ask at the step's end.
        self._probed: dict[bytes, bool | None] = {}
        self._probe_requests: dict[str, set[bytes]] = {}
        self._to_probe: list[bytes] = []
        self._lock = threading.Lock()
        self._finished: deque[Any] = deque()
        self._events: deque[Any] = deque()
        events = getattr(offloading_spec, "kv_events_config", None)
        # vLLM drains a tier's events (from 0.28 on) only when it publishes them; else they would pile up here.
        self._record_events = TIER_EVENTS and bool(getattr(events, "enable_kv_cache_events", False))
        self._jobs: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._jobs_failed = 0
        self._probes = {"probed": 0, "found": 0}
        self._thread = threading.Thread(target=self._serve, name="kvtier-vllm-tier", daemon=True)
        self._thread.start()
        # Also at interpreter exit, for a tier whose engine was never shut down: a vLLM process that exited with the
        # Store client open while its jobs ran was ended by std::terminate (measured under vLLM 0.25.1).
        self._finalizer = weakref.finalize(self, _stop, self._jobs, self._thread, self.store)
        log.info("KvtierMooncakeTier: fingerprint %s, %d bytes a chunk", self.fingerprint, self._row_bytes)

    # --- the framework's calls (scheduler thread, never blocking) ---

    def object_keys(self, keys: Iterable[OffloadKey]) -> list[str]:
        """The Store key of each vLLM key's object (``object_bytes`` long: header and vLLM chunk)."""
        return self._format.object_names(self._format.keys([bytes(k).hex() for k in keys]))

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        with self._lock:
            if key in self._present:
                return LookupResult.HIT
            asked = key in self._probed
            state = self._probed.get(key)
        self._probe_requests.setdefault(req_context.req_id, set()).add(key)
        if state is False:
            return LookupResult.MISS
        if not asked:
            with self._lock:
                self._probed[key] = None
            self._to_probe.append(key)
        return LookupResult.RETRY

    def on_schedule_end(self, context: Any) -> None:
        if self._to_probe:
            self._jobs.put(("probe", self._to_probe))
            self._to_probe = []

    def on_request_finished(self, req_context: ReqContext) -> None:
        keys = self._probe_requests.pop(req_context.req_id, ())
        with self._lock:
            for key in keys:
                # A key still being asked about stays until its answer; a later request asks again.
                if self._probed.get(key) is not None:
                    del self._probed[key]

    def submit_store(self, job_metadata: Any) -> None:
        self._check_job(job_metadata)
        self._jobs.put(("store", job_metadata))

    def submit_load(self, job_metadata: Any) -> None:
        self._check_job(job_metadata)
        self._jobs.put(("load", job_metadata))

    def _check_job(self, job: Any) -> None:
        chunks = np.asarray(job_chunk_ids(job))
        if len(job.keys) != len(chunks):
            raise BadArgument(f"job {job.job_id}: {len(job.keys)} keys but {len(chunks)} chunk ids")
        if len(chunks) and (chunks.min() < 0 or chunks.max() >= self._num_chunks):
            raise BadArgument(f"job {job.job_id}: chunk ids {chunks.tolist()} outside 0..{self._num_chunks - 1}")

    def get_finished_jobs(self) -> Iterable[Any]:
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def has_pending_work(self) -> bool:
        return self._jobs.unfinished_tasks > 0 or bool(self._finished)

    def take_events(self) -> Iterable[Any]:
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        self._jobs.join()

    def config_info(self) -> Mapping[str, Any]:
        return {}

    def shutdown(self) -> None:
        self._finalizer()
        # vLLM unmaps its region at shutdown only when no view of it is left.
        self._rows = np.empty((0, 0), dtype=np.uint8)

    # --- the background thread ---

    def _serve(self) -> None:
        while True:
            item = self._jobs.get()
            try:
                if item is None:
                    return
                kind, job = item
                if kind == "probe":
                    self._probe(job)
                    continue
                t0 = time.perf_counter()
                try:
                    result = self._store(job) if kind == "store" else self._load(job)
                except Exception:  # a tier failure is a failed job, never an exception in vLLM's scheduler
                    log.exception("KvtierMooncakeTier: job %d failed", job.job_id)
                    self._jobs_failed += 1
                    result = {"success": False}
                self._finished.append(job_result(job.job_id, transfer_time=time.perf_counter() - t0, **result))
            finally:
                self._jobs.task_done()

    def stats(self) -> dict[str, int]:
        """The object path's counters, named as kvtier's L3 statistics (``kvtier.STATS``), and the jobs that
        failed (``l3_errors``)."""
        return {**self._path.stats(), "l3_errors": self._jobs_failed}

    @property
    def counters(self) -> dict[str, int]:
        """``stats()`` under short names: put, present, loaded, missing, rejected, failed; and the keys asked of the
        Store (probed) and found there."""
        s = self.stats()
        names = ("put", "present", "loaded", "missing", "rejected", "failed")
        keys = ("l3_objects_put", "l3_puts_present", "l3_objects_loaded", "l3_objects_missing", "l3_rejected")
        return {**dict(zip(names, [*(s[k] for k in keys), self._jobs_failed], strict=True)), **self._probes}

    def _probe(self, keys: list[bytes]) -> None:
        """Asks the Store which of ``keys`` it has; an error answers 'not there' (the request goes on without)."""
        try:
            codes = self.store.exists_many(self.object_keys(keys))
        except Exception as e:  # a Store failure is a miss, never an exception in vLLM's scheduler
            log.warning("KvtierMooncakeTier: asking the Store about %d keys failed: %s", len(keys), e)
            codes = [0] * len(keys)
        found = [code == 1 for code in codes]
        self._probes["probed"] += len(keys)
        self._probes["found"] += sum(found)
        with self._lock:
            for key, there in zip(keys, found, strict=True):
                if there:
                    # As good as stored here: HIT until a get finds it gone.
                    self._present.add(key)
                    self._probed.pop(key, None)
                elif key in self._probed:
                    self._probed[key] = False

    def _pieces(self, job: Any) -> tuple[list[bytes], list[list[tuple[int, int]]]]:
        """Each key of a job (vLLM's key bytes) and its vLLM chunk's row in vLLM's CPU tier as the object's payload."""
        keys = [bytes(k) for k in job.keys]
        rows = [[(self._base + int(c) * self._stride, self._row_bytes)] for c in np.asarray(job_chunk_ids(job))]
        return keys, rows

    def _store(self, job: Any) -> dict[str, Any]:
        keys, rows = self._pieces(job)
        outcomes = self._path.put(self.store, self._format, [k.hex() for k in keys], rows)
        stored = [OffloadKey(k) for k, o in zip(keys, outcomes, strict=True) if o.ok]
        with self._lock:
            self._present.update(stored)
        if stored and self._record_events:
            self._events.append(offloading_event(stored, MEDIUM_STORAGE, False))
        failed = [o for o in outcomes if not o.ok]
        if failed:
            log.warning(
                "KvtierMooncakeTier: %d of %d chunks not stored, first code %s", len(failed), len(keys), failed[0].code
            )
        moved = self.object_bytes * sum(o.kind == "stored" for o in outcomes)
        return {"success": not failed, "successful_keys": None, "transfer_bytes": moved}

    def _load(self, job: Any) -> dict[str, Any]:
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
                self._events.append(offloading_event(gone, MEDIUM_STORAGE, True))
        ok = [o.ok for o in outcomes]
        good = [OffloadKey(k) for k, hit in zip(keys, ok, strict=True) if hit]
        return {
            "success": all(ok),
            "successful_keys": None if all(ok) else good,
            "transfer_bytes": self.object_bytes * len(good),
        }
