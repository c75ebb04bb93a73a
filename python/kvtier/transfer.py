"""Where the cache's copies run and how they are ordered with the engine's stream.

With copy streams (the default on CUDA) kvtier copies on two non-blocking streams of its own, one a direction, and
orders them with the engine's stream by CUDA events on both sides, never by the host waiting:

- a store's copy waits (GPU-side) for the engine's work enqueued before the store, which wrote its blocks; the
  engine does not wait for it. Before the engine rewrites a block it calls ``release(blocks)`` or
  ``forget(request_id)``: the engine's stream then waits (GPU-side) for the pending stores that read those blocks.
- a load waits for the engine's work enqueued before it (the blocks' previous owner) and for pending stores of the
  same blocks; the engine's stream waits for the load before the model reads the blocks: at once for whole loads,
  or layer by layer when the engine calls ``wait_layer(l)`` before layer l reads its KV (layer-wise loads: the
  load is issued one layer a time, one event a layer, so prefill of layer l overlaps the copy of layer l + 1).
- states go through a staging buffer that the engine's own kernels fill and drain, so their copies stay on the
  engine's stream; a ticket completes when both its pages and its state have.

Without copy streams every copy runs on the engine's current stream, as the engine's own kernels do, and
``release``/``wait_layer`` cost nothing. On a CPU pool copies are memcpy, complete on return, and every ordering
call is a no-op.
"""

from __future__ import annotations

import numpy as np

from kvtier.copy import CompletionQueue, CopyEvent, CopyStream, PageCopier, is_int


class Transfers:
    """The copy streams and events of one cache (one device).

    ``pages`` copies the page pool. ``layerwise_loads`` issues each load a layer at a time through ``layers``, the
    same pool as one tensor a layer: by default ``pages`` (a layer-first pool is that already; a page-first pool then
    loads as one piece, and ``wait_layer`` waits for all of it), or a copier over ``copy.layer_views`` of a
    page-first pool.
    """

    def __init__(
        self,
        pages: PageCopier,
        *,
        layers: PageCopier | None = None,
        copy_streams: bool = True,
        layerwise_loads: bool = False,
    ) -> None:
        self._pages = pages
        self._layers = layers if layers is not None else pages
        self._device: int = pages.cuda_index if pages.cuda_index is not None else -1  # -1: a CPU pool
        self.completions: CompletionQueue = pages.completion_queue()
        on_gpu = pages.cuda_index is not None
        self.copy_streams = copy_streams and on_gpu
        self.layerwise_loads = layerwise_loads and self.copy_streams
        self._num_layers = self._layers.num_layers
        # The stream objects own the handles: keep them for the life of the cache.
        self._streams = [CopyStream(self._device), CopyStream(self._device)] if self.copy_streams else []
        self._d2h = self._streams[0].handle if self._streams else 0
        self._h2d = self._streams[1].handle if self._streams else 0
        # Pending stores: sequence number -> event after its copy on the d2h stream; the stream is in order, so
        # waiting for store s covers every store before it. _block_seq[b]: the last store that read block b.
        self._store_seq = 0
        self._done_seq = 0
        self._store_events: dict[int, CopyEvent] = {}
        self._block_seq = np.zeros(pages.num_blocks, dtype=np.int64)
        self._request_seq: dict[str, int] = {}
        # Layer-wise loads: the event after the latest load of each layer that the engine has not waited for yet.
        self._layer_events: list[CopyEvent | None] = [None] * self._num_layers
        self._last_load: CopyEvent | None = None

    @property
    def num_layers(self) -> int:
        """The layer parts a layer-wise load issues one at a time (and ``wait_layer`` takes)."""
        return self._num_layers

    # Streams

    @property
    def d2h_stream(self) -> int:
        """The raw cudaStream_t of stores (0 without copy streams)."""
        return self._d2h

    @property
    def h2d_stream(self) -> int:
        """The raw cudaStream_t of loads (0 without copy streams)."""
        return self._h2d

    def engine_stream(self) -> int:
        """The engine's current stream on the pool's device (0 on the CPU)."""
        return self._pages.stream_handle()

    def _event(self, stream: int) -> CopyEvent:
        ev = CopyEvent(self._device)
        ev.record(stream)
        return ev

    def _pending_store(self, blocks: np.ndarray) -> CopyEvent | None:
        if not self._store_events or blocks.size == 0:
            return None
        seq = int(self._block_seq[blocks].max())
        return self._store_events.get(seq) if seq > self._done_seq else None

    # Copies

    def store_pages(self, gpu_ids: np.ndarray, host_slots: np.ndarray, request_id: str) -> str:
        """Copy GPU blocks to host slots after the engine's work so far; the engine does not wait."""
        if not self.copy_streams:
            return self._pages.to_host(gpu_ids, host_slots, self.engine_stream())
        eng = self.engine_stream()
        self._event(eng).wait_in(self._d2h)
        if self._last_load is not None:
            self._last_load.wait_in(self._d2h)  # blocks a layer-wise load filled that the engine has not waited for
        used = self._pages.to_host(gpu_ids, host_slots, self._d2h)
        self._store_seq += 1
        self._store_events[self._store_seq] = self._event(self._d2h)
        self._block_seq[gpu_ids] = self._store_seq
        self._request_seq[request_id] = self._store_seq
        return used

    def load_pages(self, host_slots: np.ndarray, gpu_ids: np.ndarray) -> str:
        """Copy host slots to GPU blocks after the blocks' previous users; the engine's stream waits for them
        before its next kernels (whole loads) or per layer in ``wait_layer`` (layer-wise loads)."""
        eng = self.engine_stream()
        if not self.copy_streams:
            return self._pages.to_gpu(host_slots, gpu_ids, eng)
        self._event(eng).wait_in(self._h2d)
        pending = self._pending_store(gpu_ids)
        if pending is not None:
            pending.wait_in(self._h2d)  # a store still reading these blocks for an earlier owner
        if not self.layerwise_loads:
            used = self._pages.to_gpu(host_slots, gpu_ids, self._h2d)
            self._event(self._h2d).wait_in(eng)
            return used
        used = ""
        for layer in range(self._num_layers):
            used = self._layers.to_gpu(host_slots, gpu_ids, self._h2d, layers=(layer, layer + 1))
            self._layer_events[layer] = self._last_load = self._event(self._h2d)
        return used

    def finish(self, ticket: int, *, store: bool, engine_work: bool) -> None:
        """Record ``ticket`` as complete once its copies are; ``engine_work``: some of them (states) ran on the
        engine's stream after the pages were issued."""
        eng = self.engine_stream()
        if not self.copy_streams:
            self.completions.record(ticket, eng)
            return
        stream = self._d2h if store else self._h2d
        if engine_work:
            self._event(eng).wait_in(stream)
        self.completions.record(ticket, stream)

    # Ordering calls of the engine loop (GPU-side waits; never block the host)

    def wait_layer(self, layer: int) -> None:
        """Make the engine's stream wait for the pending loads of ``layer`` before the model reads its KV."""
        n = self._num_layers
        if not is_int(layer) or layer < 0 or 1 < n <= layer:
            bound = f"0 to {n - 1} (the pool's layer parts)" if n > 1 else ">= 0"
            raise ValueError(f"layer must be an int {bound}, got {layer!r}")
        if not self.layerwise_loads:
            return
        i = int(layer) if n > 1 else 0
        ev = self._layer_events[i]
        if ev is not None:
            self._layer_events[i] = None
            ev.wait_in(self.engine_stream())

    def wait_loads(self) -> None:
        """``wait_layer`` for every layer."""
        if self._last_load is None:
            return
        eng = self.engine_stream()
        self._last_load.wait_in(eng)  # the h2d stream is in order: the last load's event covers every layer
        self._layer_events = [None] * self._num_layers
        self._last_load = None

    def release(self, blocks: np.ndarray) -> None:
        """The engine is about to reuse ``blocks`` (int32 ids, checked by the caller): its stream waits for the
        pending stores that read them."""
        if not self.copy_streams:
            return
        ev = self._pending_store(blocks)
        if ev is not None:
            ev.wait_in(self.engine_stream())

    def forget(self, request_id: str) -> None:
        """The request's blocks will be reused: the engine's stream waits for its pending stores."""
        seq = self._request_seq.pop(request_id, 0)
        if seq > self._done_seq and seq in self._store_events:
            self._store_events[seq].wait_in(self.engine_stream())

    def poll(self) -> list[int]:
        """Tickets whose copies completed (never blocks); retires finished stores."""
        while self._store_events:
            seq = next(iter(self._store_events))
            if not self._store_events[seq].done():
                break
            del self._store_events[seq]
            self._done_seq = seq
        if self._last_load is not None and self._last_load.done():
            self._last_load = None
        return self.completions.poll()

    def pending(self) -> int:
        return self.completions.pending()

    def wait_all(self) -> list[int]:
        """Block until every copy has completed (close); returns the tickets not yet polled."""
        return self.completions.wait_all()
