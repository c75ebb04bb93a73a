"""The host prefix cache: the object a serving engine drives.

It keeps KV pages (and per-sequence states) in host memory after the GPU pool dropped them and copies them back
on a later prompt with the same prefix. Bookkeeping is the Rust ``Index``; bytes move through ``PageCopier`` on
kvtier's own copy streams, ordered with the engine's stream by CUDA events (``kvtier.transfer``; or on the engine's
stream with ``copy_streams=False``; memcpy when the pools are CPU tensors), and completion is tracked with events
that ``poll()`` retires without blocking. Engines that rewrite blocks call ``release(blocks)`` or ``forget`` first,
and with ``layerwise_loads`` call ``wait_layer(l)`` before layer l reads its KV.

Engine-loop calls never wait for the GPU or for pinning memory: the host pools are reserved at the first store
and pinned chunk by chunk on a background thread; stores use the slots pinned so far.

Failure policy: bad arguments raise ``ValueError`` / ``TypeError`` before anything is copied. Any other exception
inside a call (a failed launch, an engine callback that raised) is logged and counted, the request continues
uncached, and after ``max_errors`` such errors the cache disables itself (``stats()["disabled"]``).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from kvtier import Index
from kvtier.copy import HostPool, PageCopier
from kvtier.settings import CacheSettings
from kvtier.transfer import Transfers

log = logging.getLogger("kvtier")

T = TypeVar("T")
StateFn = Callable[[Any, int, torch.Tensor], None]


def token_array(prompt_ids: Any) -> np.ndarray:
    """Prompt token ids as a 1-D int32 array (no copy when they already are one)."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.detach().cpu().numpy()
    arr = np.asarray(prompt_ids)
    if arr.ndim != 1:
        raise ValueError(f"prompt_ids must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"prompt_ids must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.int32:
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
            bad = arr[(arr < 0) | (arr > np.iinfo(np.int32).max)][0]
            raise ValueError(f"prompt_ids must be in [0, 2**31), got {bad}")
        arr = arr.astype(np.int32)
    return arr


def _guarded(default: T) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Runs an engine-loop call under the failure policy: errors are logged and counted, never raised."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def call(self: HostPrefixCache, *args: Any, **kwargs: Any) -> T:
            if self.disabled or self.closed:
                return default
            try:
                return fn(self, *args, **kwargs)
            except (ValueError, TypeError, KeyError):
                raise
            except Exception as e:  # noqa: BLE001 - the policy: no cache failure reaches the engine
                self._error(fn.__name__.lstrip("_"), e)
                return default

        return call

    return wrap


class HostPrefixCache:
    """A host-memory prefix cache over an engine's paged GPU KV pool.

    ``pages`` is the GPU pool: one uint8 tensor ``[num_blocks, page_bytes]`` (page-first) or a list of per-layer
    uint8 tensors ``[num_blocks, chunk_bytes]`` (layer-first). Models with per-sequence state (sliding-window
    rings, SSM states) pass ``state_bytes`` and two engine callbacks: ``select_state(handle, pos, staging)``
    copies the state at token position ``pos`` into ``staging`` (uint8, ``state_bytes``, on the pool's device)
    and ``load_state(handle, pos, staging)`` loads it back; ``handle`` is whatever the engine passes as
    ``state=`` (its sequence object). Settings: see ``CacheSettings`` (arguments or ``KVTIER_*`` variables).
    ``fingerprint_fields`` name what else decides the bytes of a page (model config hash, dtype...): they go
    into the L3 keys' fingerprint, so caches of different models never read each other's objects.
    """

    def __init__(
        self,
        pages: torch.Tensor | Sequence[torch.Tensor],
        *,
        block_size: int,
        state_bytes: int = 0,
        select_state: StateFn | None = None,
        load_state: StateFn | None = None,
        env: dict[str, str] | None = None,
        fingerprint_fields: Mapping[str, str] | None = None,
        **settings: Any,
    ) -> None:
        self.settings = s = CacheSettings.resolve(env, **settings)
        layers = [pages] if isinstance(pages, torch.Tensor) else list(pages)
        if not layers or not all(isinstance(t, torch.Tensor) for t in layers):
            raise TypeError("pages must be a uint8 tensor or a non-empty list of uint8 tensors")
        if any(t.dim() != 2 for t in layers):
            shapes = [tuple(t.shape) for t in layers]
            raise ValueError(f"pages must be 2-D [num_blocks, bytes per block], got shapes {shapes}")
        self.device = layers[0].device
        self.page_bytes = sum(int(t.shape[1]) for t in layers)
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.page_slots = s.host_bytes // max(self.page_bytes, 1)
        if self.page_slots < 1:
            raise ValueError(f"host_bytes {s.host_bytes} holds no page of {self.page_bytes} bytes")
        self.state_bytes = int(state_bytes)
        state_slots = s.state_slots
        if state_slots and self.state_bytes <= 0:
            raise ValueError(f"state_slots={state_slots} needs state_bytes > 0, got {state_bytes}")
        if self.state_bytes and not state_slots:
            # Without state slots a hit would restore pages but not the state the model needs.
            raise ValueError(f"a model with state (state_bytes={state_bytes}) needs state_slots > 0")
        if state_slots and (select_state is None or load_state is None):
            raise ValueError("state_slots > 0 needs both select_state and load_state callbacks")
        self._select_state, self._load_state = select_state, load_state
        self.index = Index(
            self.page_slots,
            state_slots=state_slots,
            block_size=block_size,
            keep_tokens=s.keep_tokens,
            min_hit_tokens=s.min_hit_tokens,
            state_lookback_blocks=s.state_lookback_blocks,
            ring_slack=s.ring_slack,
            hash_kind=s.hash_kind,
            hash_key=s.hash_key,
            usable_page_slots=0,
            usable_state_slots=0,
        )
        self.disabled = False
        self.closed = False  # after close(), engine-loop calls are no-ops: resume misses, store does nothing
        self.errors = 0
        self._lock = threading.Lock()
        # The host pools are address space only until they grow (at the first store, or now with preallocate);
        # building the copiers here checks the GPU pool (dtype, shapes, alignment) before anything is stored.
        self._host_pages = HostPool(self.page_slots, self.page_bytes, chunk_bytes=s.pin_chunk_bytes)
        self._copy_pages = PageCopier(pages, self._host_pages, method=s.copy_method,
                                      crossover_bytes=s.copy_crossover_bytes)  # fmt: skip
        self._host_states: HostPool | None = None
        self._copy_states: PageCopier | None = None
        self._staging: torch.Tensor | None = None
        if state_slots:
            self._host_states = HostPool(state_slots, self.state_bytes, chunk_bytes=s.pin_chunk_bytes)
            self._staging = torch.zeros((s.staging_slots, self.state_bytes), dtype=torch.uint8, device=self.device)
            self._copy_states = PageCopier(self._staging, self._host_states)
        # The copy streams and their ordering with the engine's stream (kvtier.transfer).
        self.transfers = self._xfer = Transfers(self._copy_pages, copy_streams=s.copy_streams,
                                                layerwise_loads=s.layerwise_loads)  # fmt: skip
        self._completions = self._xfer
        self._grower: threading.Thread | None = None
        self._closing = threading.Event()
        # L3 (kvtier.l3.tier): only with l3="mooncake"; otherwise nothing of the L3 tier or Mooncake is imported.
        self._l3: Any = None
        if s.l3 == "mooncake":
            from kvtier.l3.tier import L3Tier

            layout = "page-first" if isinstance(pages, torch.Tensor) else f"layer-first/{len(layers)}"
            fields = {"page_bytes": str(self.page_bytes), "state_bytes": str(self.state_bytes),
                      "block_size": str(block_size), "layout": layout, "hash_kind": self.index.hash_kind,
                      "key_id": self.index.key_id}  # fmt: skip
            fields.update({f"engine.{k}": str(v) for k, v in (fingerprint_fields or {}).items()})
            self._l3 = L3Tier(s, index=self.index, page_pool=self._host_pages, state_pool=self._host_states,
                              block_size=block_size, fingerprint_fields=fields)  # fmt: skip
        if s.preallocate:
            self._grow_all()

    # Host memory

    def _grow_all(self) -> None:
        """Pins the host pools chunk by chunk, making each chunk's slots usable as soon as it is pinned."""
        pools = [p for p in (self._host_pages, self._host_states) if p is not None]
        try:
            for pool in pools:
                while not self._closing.is_set() and pool.usable_slots < pool.slots:
                    pool.grow_chunk()
                    self.index.grow(self._usable(self._host_pages), self._usable(self._host_states))
        except Exception as e:  # noqa: BLE001 - the cache keeps serving from what is pinned
            self._error("pin", e)

    @staticmethod
    def _usable(pool: HostPool | None) -> int:
        return 0 if pool is None else pool.usable_slots

    def _start_growing(self) -> None:
        if self._grower is None:
            self._grower = threading.Thread(target=self._grow_all, name="kvtier-pin", daemon=True)
            self._grower.start()

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Waits until the host pools are fully pinned (for tests and benchmarks); returns whether they are."""
        if self._grower is not None:
            self._grower.join(timeout)
            return not self._grower.is_alive()
        return self._host_pages.usable_slots == self._host_pages.slots

    # Engine-loop calls

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0

    def lookup(self, request_id: str, prompt_ids: Any, *, namespace: str | bytes | None = None) -> int:
        """Tokens a resume of this prompt would restore now (0: miss). Touches nothing."""
        if self.disabled or self.closed:
            return 0
        return self.index.lookup(request_id, token_array(prompt_ids), namespace=namespace).hit_tokens

    def resume(
        self,
        request_id: str,
        prompt_ids: Any,
        *,
        allocate: Callable[[], bool],
        block_table: Callable[[], Sequence[int]],
        state: Any = None,
        namespace: str | bytes | None = None,
    ) -> int:
        """Looks the prompt up and, on a hit, fills the sequence's first blocks (and state) from the host.

        ``allocate()`` allocates the sequence's GPU blocks now (False: not now; RuntimeError: never) and
        ``block_table()`` then gives its block ids. Returns the cached tokens, 0 for a miss (or a failure: the
        sequence is then recomputed from scratch, even if it was allocated), or -1 when ``allocate()`` said not now
        (retry later; nothing was touched).
        """
        tokens = token_array(prompt_ids)
        return self._resume(request_id, tokens, allocate, block_table, state, namespace)

    @_guarded(0)
    def _resume(self, request_id, tokens, allocate, block_table, state, namespace) -> int:  # type: ignore[no-untyped-def]
        # L3: a request whose fetch runs retries later; a host miss starts the request's one fetch (no GPU blocks).
        if self._l3 is not None and self._l3.waiting(request_id):
            return -1
        look = self.index.lookup(request_id, tokens, namespace=namespace)
        if self._l3 is not None and look.ready_pages < look.limit_pages:
            if self._l3.start_fetch(request_id, lambda: self.index.keys(request_id), look.ready_pages,
                                    look.limit_pages):  # fmt: skip
                return -1
        hit = look.hit_tokens
        if hit == 0:
            return 0
        try:
            if not allocate():
                self.index.defer(request_id)
                return -1
        except RuntimeError:
            return 0  # can never fit: let the scheduler reject the request
        plan = self.index.begin_load(request_id, hit)
        try:
            n = hit // self.block_size
            table = np.asarray(block_table(), dtype=np.int32)
            if table.ndim != 1 or len(table) < n:
                raise ValueError(f"block_table has {table.size} blocks, a hit of {hit} tokens needs {n}")
            self._xfer.load_pages(plan.page_slots, table[:n])
            stream = self._stream()
            if plan.state_slot is not None:
                assert self._copy_states is not None and self._staging is not None and self._load_state
                self._copy_states.to_gpu(np.array([plan.state_slot], np.int32), np.zeros(1, np.int32), stream)
                self._load_state(state, hit, self._staging[0])
            self._xfer.finish(plan.ticket, store=False, engine_work=plan.state_slot is not None)
        except BaseException:
            self.index.abort(plan.ticket)
            raise
        return hit

    def store(
        self,
        request_id: str,
        prompt_ids: Any,
        block_table: Sequence[int] | np.ndarray,
        *,
        seq_len: int | None = None,
        state: Any = None,
        namespace: str | bytes | None = None,
    ) -> None:
        """Write-through store of a prompt whose prefill has run: its full blocks (GPU blocks ``block_table``)
        and, for models with state, the states at the last few block boundaries still in the ring
        (``seq_len``: the sequence's length now)."""
        tokens = token_array(prompt_ids)
        table = np.asarray(block_table, dtype=np.int32)
        self._check_blocks(table[: len(tokens) // self.block_size])
        self._store(request_id, tokens, table, seq_len, state, namespace)

    def _check_blocks(self, table: np.ndarray) -> None:
        """GPU block ids must be inside the pool: checked before anything is planned or copied."""
        if table.ndim != 1:
            return  # the index names the shape
        num_blocks = self._copy_pages.num_blocks
        bad = table[(table < 0) | (table >= num_blocks)]
        if bad.size:
            raise ValueError(f"block id {int(bad[0])} is outside the GPU pool of {num_blocks} blocks")

    @_guarded(None)
    def _store(self, request_id, tokens, table, seq_len, state, namespace) -> None:  # type: ignore[no-untyped-def]
        self._start_growing()
        plan = self.index.plan_store(request_id, tokens, seq_len=seq_len, namespace=namespace, block_table=table)
        if len(plan.page_slots) == 0 and len(plan.state_slots) == 0:
            self.index.complete(plan.ticket)  # nothing to copy: present entries were only touched
            return
        if self._l3 is not None:  # L3: put what this ticket stores once its copies complete
            self._l3.note_store(plan.ticket, self.index.keys(request_id), plan.state_boundaries)
        try:
            stream = self._stream()
            if len(plan.page_slots):
                assert plan.src_blocks is not None
                self._xfer.store_pages(plan.src_blocks, plan.page_slots, request_id)
            if len(plan.state_slots):
                assert self._copy_states is not None and self._staging is not None and self._select_state
                per_round = len(self._staging)
                bounds, slots = plan.state_boundaries, plan.state_slots
                for start in range(0, len(bounds), per_round):
                    part = slice(start, start + per_round)
                    for j, b in enumerate(bounds[part]):
                        self._select_state(state, b, self._staging[j])
                    n = len(bounds[part])
                    self._copy_states.to_host(np.arange(n, dtype=np.int32), slots[part], stream)
            self._xfer.finish(plan.ticket, store=True, engine_work=len(plan.state_slots) > 0)
        except BaseException:
            self.index.abort(plan.ticket)
            if self._l3 is not None:
                self._l3.dropped(plan.ticket)
            raise

    @_guarded(None)
    def poll(self) -> None:
        """Retires finished copies: stored entries become ready, loaded ones are released. Never blocks."""
        for ticket in self._completions.poll():
            self.index.complete(ticket)
            if self._l3 is not None:
                self._l3.completed(ticket)

    def wait_layer(self, layer: int) -> None:
        """Before layer ``layer`` reads its KV: the engine's stream waits (GPU-side) for the pages of pending
        layer-wise loads of that layer. Cheap; a no-op without layer-wise loads and on the CPU."""
        try:
            self._xfer.wait_layer(layer)
        except (ValueError, TypeError):
            raise
        except Exception as e:  # noqa: BLE001 - the policy; the host then waits, so the model never reads early
            self._error("wait_layer", e)
            torch.cuda.synchronize(self.device)

    def wait_loads(self) -> None:
        """``wait_layer`` for every layer."""
        self._xfer.wait_loads()

    def release(self, blocks: Sequence[int] | np.ndarray) -> None:
        """Before the engine rewrites ``blocks`` (GPU block ids): its stream waits (GPU-side) for the pending
        stores that read them. Cheap; a no-op without copy streams and on the CPU."""
        self._xfer.release(blocks)

    def forget(self, request_id: str) -> None:
        """The request is gone: drop its cached chain; the engine's stream waits (GPU-side) for its pending stores,
        so its blocks may be reused."""
        self._xfer.forget(request_id)
        self.index.forget(request_id)
        if self._l3 is not None:
            self._l3.forget(request_id)

    def stats(self) -> dict[str, Any]:
        """Counters, occupancy, token hit rate, bytes moved, and whether the cache disabled itself."""
        out: dict[str, Any] = dict(self.index.stats())
        out["disabled"] = self.disabled
        out["page_bytes"] = self.page_bytes
        out["state_bytes"] = self.state_bytes
        out["bytes_to_host"] = out["pages_stored"] * self.page_bytes + out["states_stored"] * self.state_bytes
        out["bytes_to_gpu"] = out["pages_loaded"] * self.page_bytes + out["states_loaded"] * self.state_bytes
        out["host_bytes_pinned"] = self._usable(self._host_pages) * self.page_bytes + self._usable(
            self._host_states
        ) * self.state_bytes
        out["copies_in_flight"] = self._completions.pending()
        if self._l3 is not None:
            out.update(self._l3.stats())
        return out

    def close(self) -> None:
        """Waits for copies in flight, stops pinning and releases the host pools."""
        if self.closed:
            return
        self.closed = True
        self._closing.set()
        if self._grower is not None:
            self._grower.join()
        for ticket in self._completions.wait_all():
            self.index.complete(ticket)
        if self._l3 is not None and not self._l3.close():
            # L3: a native Store call may still use the host pools; leaking them is safer than freeing them.
            log.warning("kvtier: the L3 store did not stop in time; the host pools are not freed")
            return
        for pool in (self._host_pages, self._host_states):
            if pool is not None:
                pool.close()

    def _error(self, where: str, e: BaseException) -> None:
        with self._lock:
            self.errors += 1
            self.index.count_error()
            log.warning("kvtier: %s failed (%s: %s); the request continues uncached", where, type(e).__name__, e)
            if self.errors >= self.settings.max_errors and not self.disabled:
                self.disabled = True
                log.error("kvtier: %d errors, the host prefix cache disables itself", self.errors)
