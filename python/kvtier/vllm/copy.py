"""The copy half of kvtier's vLLM worker, without vLLM: KV blocks <-> a host pool of vLLM chunks (``ChunkCopier``).

vLLM's offloading worker (``kvtier.vllm.KvtierWorker``) hands this its KV tensors and, for each transfer, the
block ids, KV-group sizes, first-block indices and vLLM chunk ids of vLLM's load/store specs ("chunk" here is
always a vLLM chunk: ``blocks_per_chunk`` KV blocks). The host pool holds ``num_chunks * blocks_per_chunk`` host
blocks: host block ``c * blocks_per_chunk + j`` is block ``j`` of vLLM chunk ``c``, the
bytes of every KV tensor of that block back to back (tensors of one shape share a page copier and a pool).

A transfer is one copy job of the core (``kvtier._core.JobCopier``): on CUDA tensors it runs on one of kvtier's copy
streams (stores, loads, expedited loads), after the work on the caller's current stream so far, and ``finished()``
returns what completed, each lane's jobs in order. On CPU tensors the copies are memcpy and complete before
``submit`` returns.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier._core import BadArgument

log = logging.getLogger("kvtier.vllm")


def byte_rows(t: Any, name: str) -> Any:
    """A ``[num_blocks, bytes]`` uint8 view of a KV tensor whose first dimension is the block (each block's bytes
    contiguous, blocks may be further apart)."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise BadArgument(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 1 or t.shape[0] < 1:
        raise BadArgument(f"{name} must have its blocks in the first dimension, got shape {tuple(t.shape)}")
    if t.dim() > 1 and not t[0].is_contiguous():
        raise BadArgument(f"{name} must have contiguous blocks (one block's bytes back to back), strides {t.stride()}")
    rows = t.shape[0]
    block_bytes = t[0].numel() * t.element_size()
    # A strided uint8 view over the same storage: row b starts at the tensor's block b.
    u8 = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    out = torch.as_strided(u8, (rows, block_bytes), (t.stride(0) * t.element_size(), 1), u8.storage_offset())
    if out.data_ptr() != t.data_ptr():
        raise BadArgument(f"{name} cannot be viewed as [num_blocks, bytes] in place (shape {tuple(t.shape)})")
    return out


@dataclass
class _Run:
    """The part of one copier a KV group copies: its layers [a, b), or all of them (None)."""

    copier: int
    layers: tuple[int, int] | None


class ChunkCopier:
    """KV blocks of ``tensors`` <-> host blocks, by vLLM's specs' numbers (see the module's text).

    ``groups[g]`` lists the tensor indices KV group ``g`` uses; ``copy_options`` are the page copiers' keyword
    arguments (``kvtier.copy.copy_options`` makes them from settings); the host pools are pinned in pin steps of
    ``pin_step_bytes`` the way ``pin_method`` says. The copies run as the core's copy jobs
    (``kvtier._core.JobCopier``): one call a transfer. ``submit`` checks every id before copying and raises
    ``kvtier.BadArgument`` (a ValueError) naming what does not fit; a CUDA failure while copying is a failed job
    (``finished()`` reports it), never an exception into the engine loop.
    """

    def __init__(
        self,
        tensors: Sequence[Any],
        groups: Sequence[Sequence[int]],
        *,
        num_chunks: int,
        blocks_per_chunk: int = 1,
        copy_options: Mapping[str, Any] | None = None,
        copy_streams: bool = True,
        pin_method: str = "auto",
        pin_step_bytes: int | None = None,
    ) -> None:
        from kvtier._core import JobCopier

        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
            raise BadArgument(f"num_chunks must be a positive int, got {num_chunks!r}")
        if isinstance(blocks_per_chunk, bool) or not isinstance(blocks_per_chunk, int) or blocks_per_chunk < 1:
            raise BadArgument(f"blocks_per_chunk must be a positive int, got {blocks_per_chunk!r}")
        if not tensors:
            raise BadArgument("no KV tensors")
        self.num_chunks = num_chunks
        self.blocks_per_chunk = blocks_per_chunk
        rows = [byte_rows(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
        for i, t in enumerate(rows):
            if t.shape[1] % 16:
                raise BadArgument(
                    f"tensors[{i}] has {t.shape[1]} bytes a block; kvtier copies pages of a multiple of 16 bytes"
                )
            if t.device != rows[0].device:
                raise BadArgument(f"tensors[{i}] is on {t.device}, tensors[0] on {rows[0].device}")
        self.device = rows[0].device
        place = self._make_copiers(rows, copy_options or {}, pin_method, pin_step_bytes)
        self.group_runs = [self._group_runs(g, tensor_ids, place, len(rows)) for g, tensor_ids in enumerate(groups)]
        self._cuda = self.device.type == "cuda"
        self._jobs = JobCopier([c.core for c in self.copiers], copy_streams)
        for pool, copier in zip(self.host_pools, self.copiers, strict=True):
            # What a deployment checks first when copies run slow: how the pool was pinned, and by what it copies.
            log.info(
                "kvtier worker: a host pool of %d pages of %d bytes (%d KV tensors of %d bytes a block) on %s, pinned: "
                "%s in %d-byte steps; loads by %s, stores by %s",
                pool.slots,
                pool.slot_bytes,
                copier.num_layers,
                pool.slot_bytes // copier.num_layers,
                self.device,
                pool.pinning,
                pool.step_bytes,
                copier.method,
                copier.store_method,
            )

    def _make_copiers(
        self, rows: list[Any], copy_options: Mapping[str, Any], pin_method: str, pin_step_bytes: int | None
    ) -> dict[int, tuple[int, int]]:
        """A host pool and page copier for each shape of tensor (a host page holds the blocks of all tensors of
        that shape back to back); returns where each tensor is: (copier, layer)."""
        from kvtier.copy import HostPool, PageCopier

        classes: dict[tuple[int, int], list[int]] = {}
        for i, t in enumerate(rows):
            classes.setdefault((int(t.shape[0]), int(t.shape[1])), []).append(i)
        place: dict[int, tuple[int, int]] = {}
        self.host_pools: list[Any] = []
        self.copiers: list[Any] = []
        slots = self.num_chunks * self.blocks_per_chunk
        for c, members in enumerate(classes.values()):
            for layer, i in enumerate(members):
                place[i] = (c, layer)
            page = int(rows[members[0]].shape[1]) * len(members)
            pool = HostPool(
                slots, page, step_bytes=pin_step_bytes, pin=self.device.type == "cuda", pin_method=pin_method
            )
            # vLLM hands out every chunk id from the start: the whole pool is pinned here, at the worker's start.
            pool.grow_to(slots)
            self.host_pools.append(pool)
            self.copiers.append(PageCopier([rows[i] for i in members], pool, **copy_options))
        return place

    def _group_runs(
        self, g: int, tensor_ids: Sequence[int], place: Mapping[int, tuple[int, int]], num_tensors: int
    ) -> list[_Run]:
        """The copier runs KV group ``g`` copies: runs of consecutive layers of a copier, or all of them."""
        used: dict[int, list[int]] = {}
        for i in tensor_ids:
            if not 0 <= i < num_tensors:
                raise BadArgument(f"group {g} refers to tensor {i}; there are {num_tensors}")
            c, layer = place[i]
            if layer not in used.setdefault(c, []):
                used[c].append(layer)
        runs: list[_Run] = []
        for c, layers in used.items():
            layers.sort()
            if len(layers) == self.copiers[c].num_layers:
                runs.append(_Run(c, None))
                continue
            start = prev = layers[0]
            for layer in [*layers[1:], -1]:
                if layer != prev + 1:
                    runs.append(_Run(c, (start, prev + 1)))
                    start = layer
                prev = layer
        return runs

    def pairs(
        self, gpu_ids: Any, group_sizes: Sequence[int], block_indices: Sequence[int], chunk_ids: Any
    ) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """For each KV group with blocks: (group, its block ids, the host blocks they pair with), as vLLM's specs
        say (a group's first block may sit in the middle of its first vLLM chunk: ``block_indices``)."""
        gpu_ids = np.asarray(gpu_ids)
        chunk_ids = np.asarray(chunk_ids)
        if len(group_sizes) != len(self.group_runs) or len(block_indices) != len(self.group_runs):
            raise BadArgument(
                f"the spec has {len(group_sizes)} KV groups ({len(block_indices)} block indices), the KV caches "
                f"{len(self.group_runs)}"
            )
        bpc = self.blocks_per_chunk
        out = []
        g_off = c_off = 0
        for g, (n, first) in enumerate(zip(group_sizes, block_indices, strict=True)):
            if n == 0:
                continue
            skip = int(first) % bpc
            count = -(-(n + skip) // bpc)
            chunks = chunk_ids[c_off : c_off + count].astype(np.int64)
            if len(chunks) != count:
                raise BadArgument(
                    f"group {g} needs {count} chunks from position {c_off}; the host spec has {len(chunk_ids)}"
                )
            if chunks.min() < 0 or chunks.max() >= self.num_chunks:
                raise BadArgument(f"chunk ids {chunks.tolist()} of group {g} are outside 0..{self.num_chunks - 1}")
            slots = (chunks[:, None] * bpc + np.arange(bpc)).ravel()[skip : skip + n].astype(np.int32)
            out.append((g, np.ascontiguousarray(gpu_ids[g_off : g_off + n], dtype=np.int32), slots))
            g_off += n
            c_off += count
        if g_off != len(gpu_ids) or c_off != len(chunk_ids):
            raise BadArgument(
                f"the specs do not match: {len(gpu_ids)} GPU blocks and {len(chunk_ids)} chunks, groups of sizes "
                f"{list(group_sizes)} use {g_off} and {c_off}"
            )
        return out

    def submit(
        self,
        job_id: int,
        to_host: bool,
        gpu_ids: Any,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        chunk_ids: Any,
        lane: str | None = None,
    ) -> None:
        """Copies the blocks to their host blocks (``to_host``) or back; ``lane``: "store", "load" or "expedited"
        (default: "store" for ``to_host``, else "load")."""
        lane = lane or ("store" if to_host else "load")
        pieces = [
            (run.copier, gpu, slots, run.layers)
            for g, gpu, slots in self.pairs(gpu_ids, group_sizes, block_indices, chunk_ids)
            for run in self.group_runs[g]
        ]
        stream = 0
        if self._cuda:
            import torch

            stream = int(torch.cuda.current_stream(self.device).cuda_stream)
        failure = self._jobs.submit(job_id, to_host, lane, pieces, stream)
        if failure is not None:
            log.error("kvtier: %s of job %d failed: %s", "store" if to_host else "load", job_id, failure)

    def finished(self) -> list[tuple[int, bool, int, float | None]]:
        """(job id, success, bytes, seconds) of the jobs completed since the last call; seconds: how long the job's
        copies took on their stream (None when it failed)."""
        return self._jobs.finished()

    def wait(self, job_ids: Iterable[int]) -> None:
        """Returns once the given jobs completed (their results stay for ``finished()``)."""
        self._jobs.wait(list(job_ids))

    def host_view(self, copier: int = 0) -> np.ndarray:
        """One copier's host pool as ``[host blocks, block bytes]`` uint8 (no copy)."""
        from kvtier.copy import host_array

        return host_array(self.host_pools[copier])

    def close(self) -> None:
        self._jobs.wait_all()
        self.copiers.clear()
        for pool in self.host_pools:
            pool.close()
        self.host_pools.clear()
