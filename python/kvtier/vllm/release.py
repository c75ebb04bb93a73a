"""What differs between the vLLM releases that ``kvtier.vllm`` supports, 0.25.1 through 0.34: the one place that knows.

kvtier's spec, manager, worker and Mooncake tier are written once against the interface below; each difference of
a release is a name here, found in the installed vLLM itself wherever it can be (a field, a class, an attribute),
so nothing else in kvtier tests a version number. Importing this module under a vLLM outside the range raises
ImportError naming the range and the version found.

What changed, release by release (``vllm/v1/kv_offload/`` and the offloading connector):

- 0.26: ``OffloadingSpec(config: OffloadingConfig)`` replaced ``OffloadingSpec(vllm_config, kv_cache_config)``
  (``spec_layout`` reads what kvtier needs from either); the CPU metrics gained the write/read usage gauges and
  the allocation-size histogram (``CPU_METRICS``).
- 0.27: an event's medium became the ``Medium`` enum (a string before: ``MEDIUM_CPU``, ``MEDIUM_STORAGE``).
- 0.28: ``OffloadingConfig.canonical_layout``; a secondary tier's job became ``TransferJob`` (``JobMetadata``
  before) and its result gained ``successful_keys`` and ``transfer_time`` (``job_result``).
- 0.29: events gained ``removal_expected`` (``offloading_event`` passes only the fields a release has).
- 0.30: a tier job's primary slots are ``chunk_ids`` (``block_ids`` before: ``job_chunk_ids``).
- 0.31: the scheduler no longer calls ``touch()`` (``SCHEDULER_TOUCHES``); the CPU manager's ``prepare_store``
  counts the ready keys it is offered as a use instead.
- 0.32: ``get_load_source`` and ``CacheHitSource`` arrive; a secondary tier is built with a
  ``backpressure_detector`` (``TIER_BASE_PARAMETERS``).
- 0.33: a failed store releases its keys' event metadata (``metadata_only`` events); the config-info metric
  (``CPUOffloadingInfo``); a tier job's result carries ``transfer_bytes``.
- 0.34: a stored event names its request and promises a removal event (``STORED_EVENT_NAMES_REQUEST``); the
  worker receives ``DevicePointers`` instead of ``GPULoadStoreSpec`` for the GPU side.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_VLLM = ">=0.25.1,<0.35"
_FIRST = (0, 25, 1)
_LAST_MINOR = (0, 34)


def release(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a vLLM version string, or None when it does not start with one."""
    m = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def check_vllm_version(version: str) -> None:
    """Raises ImportError unless ``version`` is a vLLM release kvtier supports (``SUPPORTED_VLLM``)."""
    r = release(version)
    if r is None or not (_FIRST <= r and r[:2] <= _LAST_MINOR):
        raise ImportError(
            f"kvtier.vllm supports vLLM {SUPPORTED_VLLM} (pip install '.[vllm]' from kvtier's source); this "
            f"environment has vLLM {version!r}, whose offloading interface differs"
        )


import vllm  # noqa: E402

VLLM_VERSION = str(getattr(vllm, "__version__", "unknown"))
check_vllm_version(VLLM_VERSION)

from vllm.v1.kv_offload import base as _base  # noqa: E402
from vllm.v1.kv_offload.cpu import common as _cpu_common  # noqa: E402
from vllm.v1.kv_offload.tiering import base as _tiering  # noqa: E402

_EVENT_FIELDS = frozenset(f.name for f in dataclasses.fields(_base.OffloadingEvent))

# The medium of kvtier's events: vLLM's Medium enum from 0.27, its string before.
_Medium = getattr(_base, "Medium", None)
MEDIUM_CPU: Any = _Medium.CPU if _Medium is not None else "CPU"
MEDIUM_STORAGE: Any = _Medium.STORAGE if _Medium is not None else "STORAGE"

# 0.34: stored events name the request that stored the pages and promise a removal event for them, which vLLM's
# event tracker uses to describe the pages and keep their metadata until they leave.
STORED_EVENT_NAMES_REQUEST = "req_context" in _EVENT_FIELDS
# 0.33: a store that fails releases its keys' metadata with a metadata-only event (no public removal).
RELEASES_FAILED_STORES = "metadata_only" in _EVENT_FIELDS

# The CPU tier's metric names this release defines (0.25 has the usage gauge alone).
CPU_METRICS = _cpu_common.CPUOffloadingMetrics
HAS_WRITE_READ_USAGE = hasattr(CPU_METRICS, "CPU_CACHE_WRITE_USAGE_PERC")

# 0.32: the source of a hit (HOST for kvtier's host pool); None before, when vLLM never asks.
try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HOST_HIT_SOURCE: Any = CacheHitSource.HOST
except ImportError:
    HOST_HIT_SOURCE = None


# Up to 0.30 the scheduler calls touch() with every key of a request after its lookups and after each store it
# submits, and vLLM's CPU manager counts no use of the keys a prepare_store is offered that it already holds; from
# 0.31 there are no touches, and prepare_store counts the ready keys offered as a use.
# 0.31 gave requests their keys' positions (ReqContext.get_offload_key_position) in the change that ended touches.
SCHEDULER_TOUCHES = not hasattr(_base.ReqContext, "get_offload_key_position")

# 0.33: the config-info metric's labels (vLLM's CPUOffloadingInfo), None before.
CPUOffloadingInfo: Any = getattr(_cpu_common, "CPUOffloadingInfo", None)


def offloading_event(
    keys: list[Any],
    medium: Any,
    removed: bool,
    *,
    removal_expected: bool = False,
    metadata_only: bool = False,
) -> Any:
    """vLLM's OffloadingEvent with the fields this release has; None for a metadata-only event before 0.33, which
    has nothing to release."""
    if metadata_only and not RELEASES_FAILED_STORES:
        return None
    fields: dict[str, Any] = {"keys": keys, "medium": medium, "removed": removed}
    if removal_expected and "removal_expected" in _EVENT_FIELDS:
        fields["removal_expected"] = True
    if metadata_only:
        fields["metadata_only"] = True
    return _base.OffloadingEvent(**fields)


@dataclass(frozen=True)
class SpecLayout:
    """What kvtier reads of an offloading spec's configuration, whatever the release built it from."""

    extra_config: Mapping[str, Any]
    # Per KV group: (group id, tokens a block, layers).
    groups: tuple[tuple[int, int, int], ...]
    # Bytes of one GPU block on one rank (every layer of every KV tensor).
    worker_kv_bytes_per_block: int
    blocks_per_chunk: int
    enable_kv_cache_events: bool
    model_name: str
    model_dtype: str
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    canonical_layout: bool
    replicated_layout: bool

    @property
    def tokens_per_chunk(self) -> int:
        return max((g[1] for g in self.groups), default=16) * self.blocks_per_chunk


def spec_layout(spec: Any) -> SpecLayout:
    """The layout of an ``OffloadingSpec`` whose base ``__init__`` has run: from its ``OffloadingConfig`` (0.26 on),
    or from the ``VllmConfig`` and ``KVCacheConfig`` it was built with (0.25)."""
    config = getattr(spec, "config", None)
    if config is not None and hasattr(config, "worker_kv_bytes_per_block"):
        p = config.parallel
        return SpecLayout(
            extra_config=config.extra_config,
            groups=tuple(
                (getattr(g, "group_id", i), g.tokens_per_block, len(g.layer_names)) for i, g in enumerate(config.groups)
            ),
            worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
            blocks_per_chunk=config.cache.blocks_per_chunk,
            enable_kv_cache_events=config.enable_kv_cache_events,
            model_name=config.model.name,
            model_dtype=config.model.dtype,
            world_size=p.world_size,
            tp_size=p.tp_size,
            pp_size=p.pp_size,
            pcp_size=p.pcp_size,
            dcp_size=p.dcp_size,
            canonical_layout=bool(getattr(config, "canonical_layout", False)),
            replicated_layout=bool(getattr(spec, "replicated_layout", False)),
        )
    return _layout_025(spec)


def _layout_025(spec: Any) -> SpecLayout:
    # vLLM 0.25: the spec keeps the VllmConfig and KVCacheConfig; this reads them as 0.26's build_offloading_config
    # (and 0.25's own CPU spec) do.
    vllm_config, kv_cache_config = spec.vllm_config, spec.kv_cache_config
    p = vllm_config.parallel_config
    # The KV cache's dtype: the model's unless the cache has its own ("auto" says it has not).
    model_dtype = vllm_config.cache_config.cache_dtype
    if model_dtype == "auto":
        model_dtype = vllm_config.model_config.dtype
    per_block = 0
    if kv_cache_config.num_blocks > 0:
        tensors = kv_cache_config.kv_cache_tensors
        packed = any(getattr(t, "block_stride", 0) for t in tensors)
        total = tensors[0].size if packed else sum(t.size for t in tensors)
        per_block = total // kv_cache_config.num_blocks
    return SpecLayout(
        extra_config=spec.extra_config,
        groups=tuple(
            (i, tokens, len(g.layer_names))
            for i, (tokens, g) in enumerate(zip(spec.gpu_block_size, kv_cache_config.kv_cache_groups, strict=True))
        ),
        worker_kv_bytes_per_block=per_block,
        blocks_per_chunk=int(spec.block_size_factor),
        enable_kv_cache_events=spec.kv_events_config.enable_kv_cache_events,
        model_name=str(vllm_config.model_config.model),
        model_dtype=str(model_dtype).removeprefix("torch."),
        world_size=p.world_size,
        tp_size=p.tensor_parallel_size,
        pp_size=p.pipeline_parallel_size,
        pcp_size=p.prefill_context_parallel_size,
        dcp_size=p.decode_context_parallel_size,
        canonical_layout=False,
        replicated_layout=False,
    )


# ---- secondary tiers (vLLM's tiering spec) ----------------------------------------------------------------------

# The keyword arguments vLLM's SecondaryTierManager.__init__ takes (backpressure_detector from 0.32).
# 0.28: vLLM's tiering manager takes its secondary tiers' KV events (STORAGE); before, a tier's events go nowhere.
TIER_EVENTS = hasattr(_tiering.SecondaryTierManager, "take_events")
TIER_BASE_PARAMETERS = frozenset(inspect.signature(_tiering.SecondaryTierManager.__init__).parameters) - {"self"}
_RESULT_FIELDS = frozenset(f.name for f in dataclasses.fields(_tiering.JobResult))


def job_chunk_ids(job: Any) -> Any:
    """The primary tier's slots of a tier job: ``chunk_ids`` from 0.30, ``block_ids`` before."""
    chunk_ids = getattr(job, "chunk_ids", None)
    return job.block_ids if chunk_ids is None else chunk_ids


def job_result(job_id: int, success: bool, **optional: Any) -> Any:
    """vLLM's JobResult with the optional fields (``successful_keys``, ``transfer_time``, ``transfer_bytes``) this
    release has; the others are left out."""
    return _tiering.JobResult(
        job_id=job_id, success=success, **{k: v for k, v in optional.items() if k in _RESULT_FIELDS}
    )
