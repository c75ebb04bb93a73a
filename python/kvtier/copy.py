"""Page copies between an engine's GPU KV pool and a host pool: the torch front end of the Rust copy path.

A GPU pool is either one uint8 tensor ``[num_blocks, page_bytes]`` (page-first) or a list of uint8 tensors
``[num_blocks, segment_bytes]``, one per layer (layer-first; a page is one segment of each). A state pool is a
page-first pool of ``[num_states, state_bytes]``. The host page is contiguous, the layer segments back to back.
A block's bytes must be contiguous, blocks may be further apart: a layer's part of a page-first pool,
``pool.view(num_blocks, layers, -1)[:, l]``, is a layer tensor too (``layer_views``).

On a CUDA pool, ``to_host``/``to_gpu`` enqueue the batch on the given stream (torch's current stream by default) and
return at once, by the copy kernel or the copy engine (``method``: "auto" takes the copy engine for pieces of at
least ``crossover_bytes``, see docs/PERFORMANCE.md); record a ticket in a :class:`CompletionQueue` after them and
poll it from the engine loop. On a CPU pool they copy with a multi-threaded memcpy and are complete on return. Every
argument is checked before anything is copied: :class:`kvtier.BadArgument` (a ``ValueError`` and a ``TypeError``)
for a wrong type, dtype, shape, device, alignment, id or length, :class:`kvtier.CopyError` for a CUDA error (with
CUDA's message).
``KVTIER_DEBUG_SYNC=1`` makes every launch wait for its stream and report the kernel's own error.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier._core import (
    COPY_METHODS,
    BadArgument,
    CompletionQueue,
    CopyError,
    CopyEvent,
    CopyStream,
    HostPool,
    dma_supported,
)
from kvtier._core import PageCopier as _CorePageCopier

if TYPE_CHECKING:
    import torch

__all__ = [
    "METHODS",
    "CompletionQueue",
    "CopyError",
    "CopyEvent",
    "CopyStream",
    "HostPool",
    "PageCopier",
    "copy_options",
    "dma_supported",
    "host_array",
    "layer_views",
]

# The copy methods, as the core parses them.
METHODS = tuple(COPY_METHODS)


def host_array(pool: HostPool) -> np.ndarray:
    """A ``[usable_slots, slot_bytes]`` uint8 view of the usable part of ``pool`` (no copy).

    The view reads the pool's memory directly: it is valid while the pool is open and must not be used after
    ``pool.close()``. ``torch.from_numpy(host_array(pool))`` gives a CPU tensor over the same bytes.
    """
    rows = pool.usable_slots
    if rows == 0:
        return np.empty((0, pool.slot_bytes), dtype=np.uint8)
    buf = (ctypes.c_uint8 * (rows * pool.slot_bytes)).from_address(pool.base_ptr)
    return np.ctypeslib.as_array(buf).reshape(rows, pool.slot_bytes)


def is_int(value: Any) -> bool:
    """A Python or numpy integer, and not a bool (an int to Python, never a count or an id)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def layer_views(pool: torch.Tensor, page_layers: int) -> list[torch.Tensor]:
    """A page-first pool ``[num_blocks, page_bytes]`` whose page is ``page_layers`` equal parts back to back, as one
    strided ``[num_blocks, page_bytes / page_layers]`` view a part: the layer-first pool of the same bytes."""
    if not is_int(page_layers) or page_layers < 1:
        raise BadArgument(f"page_layers must be a positive int, got {page_layers!r}")
    page_layers = int(page_layers)
    num_blocks, page_bytes = pool.shape
    if page_bytes % page_layers or (page_bytes // page_layers) % 16:
        raise BadArgument(
            f"a page of {page_bytes} bytes does not split into {page_layers} layer parts of a multiple of 16 bytes"
        )
    return list(pool.view(num_blocks, page_layers, page_bytes // page_layers).unbind(1))


def unwritable(start: int, end: int) -> int | None:
    """The first address of ``[start, end)`` that no writable mapping of this process covers, None when every byte
    is writable (or when the mappings cannot be read: only Linux's /proc/self/maps is consulted)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    pos = start
    for line in lines:  # in address order
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if hi <= pos:
            continue
        if lo > pos or perms[1] != "w":
            return pos
        pos = hi
        if pos >= end:
            return None
    return pos


def _ids(ids: Any, what: str) -> Any:
    """Ids as the core takes them: numpy int32 arrays and int sequences as they are, CPU torch tensors as numpy."""
    if type(ids).__module__.startswith("torch"):
        if ids.device.type != "cpu":
            raise BadArgument(f"{what} must be on the CPU (numpy or a CPU tensor), got a tensor on {ids.device}")
        return ids.numpy()
    return ids


def copy_options(settings: Any) -> dict[str, Any]:
    """A :class:`PageCopier`'s keyword arguments from a cache's settings (``copy_*``, ``store_copy_*``)."""
    return {
        "ctas": settings.copy_ctas,
        "method": settings.copy_method,
        "crossover_bytes": settings.copy_crossover_bytes,
        "store_ctas": settings.store_copy_ctas,
        "store_method": settings.store_copy_method,
        "piece_bytes": settings.copy_piece_bytes,
    }


def layer_tensors(gpu_pool: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A GPU pool's layer tensors, each checked: uint8 ``[num_blocks, bytes per block]`` with contiguous rows, all of
    one shape on one CPU or CUDA device (``kvtier.BadArgument`` naming the first that is not)."""
    import torch

    tensors = [gpu_pool] if isinstance(gpu_pool, torch.Tensor) else list(gpu_pool)
    if not tensors:
        raise BadArgument("gpu_pool is an empty list of layer tensors")
    for i, t in enumerate(tensors):
        name = "gpu_pool" if len(tensors) == 1 and isinstance(gpu_pool, torch.Tensor) else f"gpu_pool[{i}]"
        if not isinstance(t, torch.Tensor):
            raise BadArgument(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.uint8:
            raise BadArgument(f"{name} must have dtype torch.uint8 (view other dtypes as bytes), got {t.dtype}")
        if t.dim() != 2:
            raise BadArgument(f"{name} must be 2-D [num_blocks, bytes per block], got shape {tuple(t.shape)}")
        if t.stride(1) != 1 and t.shape[1] > 1:
            raise BadArgument(f"{name} must have contiguous rows (stride 1 within a block), got strides {t.stride()}")
        if t.device.type not in ("cpu", "cuda"):
            raise BadArgument(f"{name} must be on the CPU or a CUDA device, got {t.device}")
        if t.shape != tensors[0].shape:
            raise BadArgument(f"{name} has shape {tuple(t.shape)}, layer 0 has {tuple(tensors[0].shape)}")
        if t.device != tensors[0].device:
            raise BadArgument(
                f"all layer tensors must be on one device: {name} is on {t.device}, layer 0 on {tensors[0].device}"
            )
    return tensors


class PageCopier:
    """Copies pages between a GPU pool (torch tensors) and a :class:`HostPool` whose slot_bytes is the page size.

    ``ctas`` bounds the kernel's grid of CUDA thread blocks (default 8, see docs/PERFORMANCE.md) so copies leave the
    SMs to the model; ``threads`` is the CTA size (default 512). ``method`` is "auto" (default), "kernel" or "dma".
    ``store_ctas`` and ``store_method`` (default: ``ctas`` and ``method``) are those of stores (GPU -> host) when
    they differ from loads': stores run beside the model, loads on a request's critical path. ``piece_bytes`` bounds
    one copy-engine copy (segments contiguous on both sides merge into one piece up to it; a 2D copy takes as many
    rows as fit; a segment is never cut; default: no bound), for copy engines shared with the engine's own copies (2
    MiB did not steady the copy engine's loads under vLLM, docs/VLLM.md). The copy engine is never used on the
    legacy default stream, which it refuses, nor where the driver lacks ``cudaMemcpyBatchAsync``
    (``dma_available``): the kernel copies instead. The copier holds references to the pool tensors and the host
    pool, so their memory lives as long as it does; the caller keeps it (or them) alive until its last copy
    completes.
    """

    def __init__(
        self,
        gpu_pool: torch.Tensor | Sequence[torch.Tensor],
        host: HostPool,
        *,
        ctas: int | None = None,
        threads: int | None = None,
        method: str = "auto",
        crossover_bytes: int | None = None,
        store_ctas: int | None = None,
        store_method: str | None = None,
        piece_bytes: int | None = None,
    ) -> None:
        import torch

        tensors = layer_tensors(gpu_pool)
        if method not in METHODS:
            raise BadArgument(f"method must be one of {METHODS}, got {method!r}")
        if store_method is not None and store_method not in METHODS:
            raise BadArgument(f"store_method must be one of {METHODS}, got {store_method!r}")
        if not isinstance(host, HostPool):
            raise BadArgument(f"host must be a kvtier HostPool, got {type(host).__name__}")
        dev = tensors[0].device
        self.device: torch.device = dev
        self._cuda_index = (
            None if dev.type == "cpu" else (dev.index if dev.index is not None else torch.cuda.current_device())
        )
        num_blocks, segment_bytes = tensors[0].shape
        # The bytes of each layer tensor the copies reach, from its data pointer: the last block's row ends there.
        spans = [(t.data_ptr(), (num_blocks - 1) * t.stride(0) + segment_bytes) for t in tensors]
        if dev.type == "cpu":
            for i, (ptr, n) in enumerate(spans):
                at = unwritable(ptr, ptr + n)
                if at is not None:
                    raise BadArgument(
                        f"gpu_pool[{i}] is not writable memory at {at:#x} (its {n} bytes from {ptr:#x}): a load "
                        "would write into it"
                    )
        # The core copier reads the tensors through DLPack and holds their memory for its life; `check_memory`
        # refuses a copy once a tensor no longer points at that memory (the engine gave it another storage or
        # resized it), so the copies reach the memory the engine reads.
        self._tensors = tensors
        self._storages = [t.untyped_storage() for t in tensors]
        self._memory = [(ptr, s.data_ptr(), s.nbytes()) for (ptr, _), s in zip(spans, self._storages, strict=True)]
        self._host = host
        self._core = _CorePageCopier(
            tensors,
            host,
            ctas=ctas,
            threads=threads,
            method=method,
            crossover_bytes=crossover_bytes,
            store_ctas=store_ctas,
            store_method=store_method,
            piece_bytes=piece_bytes,
        )

    @property
    def host(self) -> HostPool:
        return self._host

    @property
    def core(self) -> _CorePageCopier:
        """The core's copier over the same memory (a cache's executor copies through it; this object keeps the
        tensors alive)."""
        return self._core

    @property
    def page_bytes(self) -> int:
        return self._core.page_bytes

    @property
    def num_layers(self) -> int:
        return self._core.num_layers

    @property
    def num_blocks(self) -> int:
        return self._core.num_blocks

    @property
    def ctas(self) -> int:
        return self._core.ctas

    @property
    def method(self) -> str:
        return self._core.method

    @property
    def store_ctas(self) -> int:
        return self._core.store_ctas

    @property
    def store_method(self) -> str:
        return self._core.store_method

    @property
    def crossover_bytes(self) -> int:
        return self._core.crossover_bytes

    @property
    def piece_bytes(self) -> int | None:
        return self._core.piece_bytes

    @property
    def dma_available(self) -> bool:
        return self._core.dma_available

    @property
    def layer_runs(self) -> list[tuple[int, int]]:
        """The layer tensors as runs ``(start, end)`` of evenly spaced tensors with one block stride inside one CUDA
        allocation: the copy engine copies a page's segments of a run as one 2D piece, so an engine whose layers
        are views of one tensor costs one piece a page, not one a page and layer (tensors allocated one by one are
        separate allocations, which no 2D copy may span)."""
        return self._core.layer_runs

    @property
    def cuda_index(self) -> int | None:
        """The CUDA device index of the pool, None for a CPU pool."""
        return self._cuda_index

    @property
    def threads(self) -> int:
        return self._core.threads

    def stream_handle(self, stream: Any = None) -> int:
        """The raw cudaStream_t for ``stream``: None is torch's current stream of the pool's device (0 on CPU)."""
        if self._cuda_index is None:
            return 0
        if stream is None:
            import torch

            return int(torch.cuda.current_stream(self._cuda_index).cuda_stream)
        if isinstance(stream, int):
            return stream
        return int(stream.cuda_stream)

    def check_memory(self) -> None:
        """Raises ``BadArgument`` when a pool tensor no longer points at the memory the copier was built over (the
        engine freed or resized its storage, or gave the tensor another one): checked before every copy."""
        for i, (t, storage, (ptr, base, nbytes)) in enumerate(
            zip(self._tensors, self._storages, self._memory, strict=True)
        ):
            if t.data_ptr() != ptr or storage.data_ptr() != base or storage.nbytes() != nbytes:
                raise BadArgument(
                    f"gpu_pool[{i}] changed after the copier was built: data pointer {t.data_ptr():#x} (was {ptr:#x}), "
                    f"storage of {storage.nbytes()} bytes at {storage.data_ptr():#x} (was {nbytes} at {base:#x}); "
                    "the engine must not free, resize or replace its KV pool while a cache uses it"
                )

    def to_host(self, gpu_ids: Any, host_slots: Any, stream: Any = None, layers: tuple[int, int] | None = None) -> str:
        """Copy GPU blocks ``gpu_ids[i]`` into host slots ``host_slots[i]`` (int32 ids); ``layers=(a, b)``: only
        the segments of layers a..b-1. Returns what carried it: "kernel", "dma" or "memcpy"."""
        self.check_memory()
        return self._core.to_host(
            _ids(gpu_ids, "gpu_ids"), _ids(host_slots, "host_slots"), self.stream_handle(stream), layers
        )

    def to_gpu(self, host_slots: Any, gpu_ids: Any, stream: Any = None, layers: tuple[int, int] | None = None) -> str:
        """Copy host slots ``host_slots[i]`` into GPU blocks ``gpu_ids[i]`` (int32 ids); see ``to_host``."""
        self.check_memory()
        return self._core.to_gpu(
            _ids(host_slots, "host_slots"), _ids(gpu_ids, "gpu_ids"), self.stream_handle(stream), layers
        )

    def completion_queue(self) -> CompletionQueue:
        """A completion queue for this copier's device (a CPU queue for a CPU pool)."""
        return CompletionQueue(self._cuda_index)

    def __repr__(self) -> str:
        return (
            f"PageCopier(device={self.device}, layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"page_bytes={self.page_bytes}, ctas={self.ctas}, threads={self.threads}, method={self.method!r})"
        )
