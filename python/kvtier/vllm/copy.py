"""The copy half of kvtier's vLLM worker, without vLLM: KV blocks <-> a host pool of vLLM chunks (``ChunkCopier``).

vLLM's offloading worker (``kvtier.vllm.KvtierWorker``) hands this its KV tensors and, for each transfer, the
block ids, KV-group sizes, first-block indices and vLLM chunk ids of vLLM's load/store specs ("chunk" here is
always a vLLM chunk: ``blocks_per_chunk`` KV blocks). The host pool holds ``num_chunks * blocks_per_chunk`` host
blocks: host block ``c * blocks_per_chunk + j`` is block ``j`` of vLLM chunk ``c``, the
bytes of every KV tensor of that block back to back (tensors of one shape share a page copier and a pool).

On CUDA tensors a transfer is enqueued on one of kvtier's copy streams (stores, loads, expedited loads), after an
event recorded on the caller's current stream, and its completion recorded in a completion queue; ``finished()``
returns what completed. On CPU tensors the copies are memcpy and complete before ``submit`` returns.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier._core import BadArgument, CopyError

log = logging.getLogger("kvtier.vllm")

LANES = ("store", "load", "expedited")


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
    arguments (``kvtier.copy.copy_options`` makes them from settings). ``submit`` checks every id before copying and
    raises ``kvtier.BadArgument`` (a ValueError) naming what does not fit; a CUDA failure while copying is a failed
    job (``finished()`` reports it), never an exception into the engine loop.
    """

    # Whole: this copier redoes the core executor's setup (host pools, streams, events) and goes once the vLLM
    # worker runs on that executor.
    def __init__(
        self,
        tensors: Sequence[Any],
        groups: Sequence[Sequence[int]],
        *,
        num_chunks: int,
        blocks_per_chunk: int = 1,
        copy_options: Mapping[str, Any] | None = None,
        copy_streams: bool = True,
    ) -> None:
        import torch

        from kvtier.copy import CompletionQueue, CopyEvent, CopyStream, HostPool, PageCopier

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
        device = rows[0].device
        # Tensors of one shape share a copier: a host page holds their blocks back to back.
        classes: dict[tuple[int, int], list[int]] = {}
        for i, t in enumerate(rows):
            classes.setdefault((int(t.shape[0]), int(t.shape[1])), []).append(i)
        place: dict[int, tuple[int, int]] = {}
        self.host_pools: list[Any] = []
        self.copiers: list[Any] = []
        layer_bytes: list[int] = []
        slots = num_chunks * blocks_per_chunk
        for c, members in enumerate(classes.values()):
            for layer, i in enumerate(members):
                place[i] = (c, layer)
            layer_bytes.append(int(rows[members[0]].shape[1]))
            pool = HostPool(slots, layer_bytes[-1] * len(members), pin=device.type == "cuda")
            pool.grow_to(slots)
            self.host_pools.append(pool)
            self.copiers.append(PageCopier([rows[i] for i in members], pool, **(copy_options or {})))
        self.group_runs: list[list[_Run]] = []
        self.group_bytes: list[int] = []
        for g, tensor_ids in enumerate(groups):
            used: dict[int, list[int]] = {}
            for i in tensor_ids:
                if not 0 <= i < len(rows):
                    raise BadArgument(f"group {g} refers to tensor {i}; there are {len(rows)}")
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
            self.group_runs.append(runs)
            self.group_bytes.append(sum(len(layers) * layer_bytes[c] for c, layers in used.items()))
        self.device = device
        self._done: list[tuple[int, bool, int]] = []
        self._sizes: dict[int, int] = {}
        self._cuda = device.type == "cuda"
        self._copy_streams = bool(copy_streams)
        if self._cuda:
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._device_index = index
            if self._copy_streams:
                self._streams = {lane: CopyStream(index) for lane in LANES}
                self._order = CopyEvent(index)
            self._queue = CompletionQueue(index)

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
        if lane not in LANES:
            raise BadArgument(f"lane must be one of {LANES}, got {lane!r}")
        pairs = self.pairs(gpu_ids, group_sizes, block_indices, chunk_ids)
        nbytes = sum(len(gpu) * self.group_bytes[g] for g, gpu, _ in pairs)
        stream = 0
        if self._cuda:
            import torch

            current = int(torch.cuda.current_stream(self._device_index).cuda_stream)
            if self._copy_streams:
                # Stores read what the model wrote, loads overwrite blocks the engine may still be zeroing: both
                # start after the work on the caller's stream so far.
                stream = self._streams[lane].handle
                self._order.record(current)
                self._order.wait_in(stream)
            else:
                stream = current
        try:
            for g, gpu, slots in pairs:
                for run in self.group_runs[g]:
                    copier = self.copiers[run.copier]
                    if to_host:
                        copier.to_host(gpu, slots, stream, run.layers)
                    else:
                        copier.to_gpu(slots, gpu, stream, run.layers)
        except CopyError as e:
            log.error("kvtier: %s of job %d failed: %s", "store" if to_host else "load", job_id, e)
            self._done.append((job_id, False, 0))
            return
        if self._cuda:
            self._sizes[job_id] = nbytes
            self._queue.record(job_id, stream)
        else:
            self._done.append((job_id, True, nbytes))

    def _collect(self, job_ids: Iterable[int]) -> None:
        for job_id in job_ids:
            self._done.append((job_id, True, self._sizes.pop(job_id, 0)))

    def finished(self) -> list[tuple[int, bool, int]]:
        """(job id, success, bytes) of the jobs completed since the last call."""
        if self._cuda:
            self._collect(self._queue.poll())
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: Iterable[int]) -> None:
        """Returns once the given jobs completed (their results stay for ``finished()``)."""
        if self._cuda and any(j in self._sizes for j in job_ids):
            self._collect(self._queue.wait_all())

    def host_view(self, copier: int = 0) -> np.ndarray:
        """One copier's host pool as ``[host blocks, block bytes]`` uint8 (no copy)."""
        from kvtier.copy import host_array

        return host_array(self.host_pools[copier])

    def close(self) -> None:
        if self._cuda and self._sizes:
            self._collect(self._queue.wait_all())
        self.copiers.clear()
        for pool in self.host_pools:
            pool.close()
        self.host_pools.clear()
