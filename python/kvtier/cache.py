"""The host prefix cache: the object a serving engine drives.

It keeps KV pages (and per-sequence states) in host memory after the GPU pool dropped them and copies them back
on a later prompt with the same prefix. Each engine call is one call into the Rust core (``kvtier._core.Cache``,
rust/cache.rs): the index plans (``kvtier.Index``), the executor copies on kvtier's own copy streams, ordered with
the engine's stream by CUDA events (or on the engine's stream with ``copy_streams=False``; memcpy when the pools are
CPU tensors), and completion is tracked with events that ``poll()`` retires without blocking. Engines that rewrite
blocks call ``release(blocks)`` or ``forget`` first, and with ``layerwise_loads`` call ``wait_layer(l)`` before
layer l reads its KV. The host pools are pinned off the engine loop (``kvtier.hostmem``); the L3 tier is
``kvtier.l3.tier``.

The pieces: ``kvtier.geometry`` checks the engine's pool and model, ``kvtier.hostmem`` pins the host pools,
``kvtier.copy`` wraps the copiers, ``kvtier.failures`` holds the failure policy (docs/INTEGRATION.md): a caller's
bad argument raises to the caller and counts nothing; any other exception inside a call is kvtier's failure,
logged and counted in ``stats()["errors"]``, the request continues uncached, and after ``max_errors`` of them the
cache disables itself (``stats()["disabled"]``). A hit whose pages left the host pool before its load began is a
miss (``stats()["stale_lookups"]``), not a failure.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvtier import BadArgument, Index, KvEvent
from kvtier._core import Cache as CoreCache
from kvtier._core import NeverType
from kvtier.copy import HostPool, PageCopier, copy_options
from kvtier.failures import Calls, Failures, guarded
from kvtier.geometry import Geometry
from kvtier.hostmem import HostMemory
from kvtier.settings import CacheSettings

log = logging.getLogger("kvtier")

# Caches alive in this process. A child made by fork() inherits them without their threads, copy streams or Store
# connection: there each is closed and kept, never torn down (`_abandon`).
_LIVE: weakref.WeakSet[HostPrefixCache] = weakref.WeakSet()
_ABANDONED: list[HostPrefixCache] = []


def _abandon_in_child() -> None:
    for cache in list(_LIVE):
        cache._abandon()


os.register_at_fork(after_in_child=_abandon_in_child)

# How long close() waits for engine calls running on other threads (a call is bounded: it never waits for the Store).
_CLOSE_WAIT_S = 30.0

StateFn = Callable[[Any, int, torch.Tensor], None]
BlockTable = Sequence[int] | np.ndarray | torch.Tensor


def _check_call(request_id: Any, namespace: Any) -> None:
    if not isinstance(request_id, str):
        raise BadArgument(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
    if namespace is not None and not isinstance(namespace, (str, bytes)):
        raise BadArgument(f"namespace must be str, bytes or None, got {type(namespace).__name__}")


def _host_ids(table: Any) -> Any:
    """A CUDA tensor of block ids as a CPU one (the core reads ids from host memory); anything else as it is."""
    if isinstance(table, torch.Tensor) and table.device.type == "cuda":
        return table.cpu()
    return table


class HostPrefixCache:
    """A host-memory prefix cache over an engine's paged GPU KV pool.

    ``pages`` is the GPU pool: one uint8 tensor ``[num_blocks, page_bytes]`` (page-first) or a list of per-layer
    uint8 tensors ``[num_blocks, segment_bytes]`` (layer-first). ``page_layers``: the layers a page holds, for
    layer-wise loads; a page-first page must then be that many equal parts back to back in layer order (as
    ``[layers, 2, block_size, heads, head_dim]``), and each load is copied and waited for a part at a time; the
    default is the number of layer tensors (layer-first) or 1 (page-first: a page is one piece, and ``wait_layer``
    waits for all of it). Models with per-sequence state (sliding-window
    rings, SSM states) pass ``state_bytes`` and two engine callbacks: ``select_state(handle, pos, staging)``
    copies the state at token position ``pos`` into ``staging`` (uint8, ``state_bytes``, on the pool's device)
    and ``load_state(handle, pos, staging)`` loads it back; ``handle`` is whatever the engine passes as
    ``state=`` (its sequence object). Settings: see ``CacheSettings`` (arguments or ``KVTIER_*`` variables).
    L3 (``l3="mooncake"``): ``fingerprint_fields`` (a mapping, or a callable of the resolved settings that makes
    one, called only with L3) name what else decides the bytes of a page (the model's config and weights digest,
    the KV cache dtype...) and go into the L3 keys' fingerprint with the ``model_version`` setting, so caches of
    different models never read each other's objects; L3 refuses to start without one of them (pass ``{}`` to say
    that nothing else does). ``shard`` (``kvtier.identity.Shard``) names the parallel ranks whose part of each page this
    process holds.
    ``l3_store(config)`` builds the Store client (default: Mooncake Store).
    """

    def __init__(
        self,
        pages: torch.Tensor | Sequence[torch.Tensor],
        *,
        block_size: int,
        page_layers: int | None = None,
        state_bytes: int = 0,
        select_state: StateFn | None = None,
        load_state: StateFn | None = None,
        env: dict[str, str] | None = None,
        fingerprint_fields: Mapping[str, str] | Callable[[CacheSettings], Mapping[str, str]] | None = None,
        shard: Any = None,
        l3_store: Callable[[Any], Any] | None = None,
        **settings: Any,
    ) -> None:
        self.settings = s = CacheSettings.resolve(env, **settings)
        # Before any allocation: the pool, the model and the host pools they make, checked (and that they fit).
        self.geometry = g = Geometry.of(
            pages, s, block_size=block_size, page_layers=page_layers, state_bytes=state_bytes
        )
        if g.state_slots and (select_state is None or load_state is None):
            raise BadArgument("state_slots > 0 needs both select_state and load_state callbacks")
        self.device, self.block_size, self.page_bytes = g.device, g.block_size, g.page_bytes
        self.page_slots, self.state_bytes = g.page_slots, g.state_bytes
        self.index = Index(g.index_config(s), usable_page_slots=0, usable_state_slots=0)
        if s.model_version is not None:
            self.index.set_model_version(s.model_version)
        self.failures = Failures(s.max_errors, on_failure=self.index.count_error)
        # After close() began, engine-loop calls are no-ops (resume misses, store does nothing); close() waits for
        # the calls running on other threads before it frees anything.
        self.calls = Calls()
        self._told_pinning = False
        self._lock = threading.Lock()
        self._host = self._host_memory()
        self._core = self._core_cache(select_state, load_state)
        # L3 (kvtier.l3.tier): only with l3="mooncake"; otherwise nothing of the L3 tier or Mooncake is imported.
        self._l3: Any = None
        if s.l3 == "mooncake":
            self._l3 = self._l3_tier(fingerprint_fields, shard, l3_store)
        if s.preallocate:
            self._host.pin_all()
        _LIVE.add(self)

    def _host_memory(self) -> HostMemory:
        # A CUDA pool's host pools are pinned, and address space only until they grow (at the first store, or now
        # with preallocate); a CPU pool's are not pinned, and usable now.
        s, g = self.settings, self.geometry
        return HostMemory(
            self.index,
            page_slots=g.page_slots,
            page_bytes=g.page_bytes,
            state_slots=g.state_slots,
            state_bytes=g.state_bytes,
            step_bytes=s.pin_step_bytes,
            pin=g.device.type == "cuda",
            pin_method=s.pin_method,
            on_error=self.failures.failed,
        )

    def _core_cache(self, select_state: StateFn | None, load_state: StateFn | None) -> CoreCache:
        # Building the copiers checks the GPU pool (dtype, shapes, alignment, writable memory) before anything is
        # stored; the copiers keep its tensors alive for as long as the core copies between them.
        s, g = self.settings, self.geometry
        self._copiers = [self._copier(list(g.layers) if g.layer_first else g.layers[0])]
        if g.parts is not None:
            self._copiers.append(self._copier(list(g.parts)))
        state_copier = staging = None
        if self._host.states is not None:
            staging = torch.zeros((s.staging_slots, g.state_bytes), dtype=torch.uint8, device=g.device)
            state_copier = PageCopier(staging, self._host.states)
        self._state_copier = state_copier
        return CoreCache(
            self.index,
            self._copiers[0].core,
            parts=self._copiers[1].core if len(self._copiers) > 1 else None,
            states=state_copier.core if state_copier is not None else None,
            copy_streams=s.copy_streams,
            layerwise_loads=s.layerwise_loads,
            select_state=select_state,
            load_state=load_state,
            staging_rows=list(staging) if staging is not None else None,
        )

    def _l3_tier(
        self,
        fingerprint_fields: Mapping[str, str] | Callable[[CacheSettings], Mapping[str, str]] | None,
        shard: Any,
        l3_store: Callable[[Any], Any] | None,
    ) -> Any:
        from kvtier.l3.tier import L3Tier, cache_fields

        s = self.settings
        return L3Tier(
            s,
            index=self.index,
            page_pool=self._host.pages,
            state_pool=self._host.states,
            fingerprint_fields=cache_fields(s, self.geometry, self.index, fingerprint_fields, shard),
            store_factory=l3_store,
        )

    def _copier(self, pages: torch.Tensor | Sequence[torch.Tensor]) -> PageCopier:
        return PageCopier(pages, self._host.pages, **copy_options(self.settings))

    def _abandon(self) -> None:
        """In a child made by fork(): every call is a no-op and ``close()`` returns at once. The cache's memory,
        streams and Store client belong to the parent: they are kept as they are (never freed, unregistered or
        closed here)."""
        self.calls.closed = True
        if self._l3 is not None:
            self._l3.abandon()
        _ABANDONED.append(self)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self))  # no teardown, even at interpreter exit

    @property
    def closed(self) -> bool:
        """Whether ``close()`` began: every engine-loop call is a no-op from then on."""
        return self.calls.closed

    @property
    def host_pools(self) -> tuple[HostPool, HostPool | None]:
        """The host page pool and state pool (None without states): ``kvtier.copy.host_array`` views their bytes."""
        return self._host.pages, self._host.states

    @property
    def layer_runs(self) -> list[tuple[int, int]]:
        """The GPU pool's layer tensors as runs of evenly spaced tensors in one allocation
        (``kvtier.copy.PageCopier.layer_runs``): the copy engine moves a page's segments of one run as one piece."""
        return self._copiers[0].layer_runs

    @property
    def core(self) -> CoreCache:
        """The core's cache: what each engine call crosses into once (its copy streams, layer parts, blocks)."""
        return self._core

    @property
    def l3(self) -> Any:
        """The L3 tier (``kvtier.l3.tier.L3Tier``: its Store, fingerprint, keys, ``wait_connected`` and ``flush``), or
        None without L3."""
        return self._l3

    def flush_l3(self, timeout_s: float) -> bool:
        """Waits until the L3 tier is connected and the work submitted to it so far (write-behind puts, fetches)
        has run, for tests, benchmarks and demos; returns whether it has (False without L3)."""
        if self._l3 is None:
            return False
        end = time.monotonic() + timeout_s
        return self._l3.wait_connected(timeout_s) and self._l3.flush(max(0.0, end - time.monotonic()))

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Waits until the host pools are fully pinned (at once for a CPU pool's, which are not pinned); returns
        whether they are. Pinning starts at the first store (``preallocate=True``: at construction)."""
        return self._host.wait(timeout)

    # Engine-loop calls: one call into the core each

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0

    def lookup(self, request_id: str, prompt_ids: Any, *, namespace: str | bytes | None = None) -> int:
        """Tokens a resume of this prompt would restore now (0: miss). A pure query: it keeps nothing (no chain,
        no statistics; ``request_id`` is only checked), so it may be called for any number of prompts.
        ``prompt_ids`` as the engine holds them (a list, an integer array, a CPU tensor)."""
        _check_call(request_id, namespace)
        return self._lookup(prompt_ids, namespace)

    @guarded(0)
    def _lookup(self, tokens: Any, namespace: str | bytes | None) -> int:
        return self.index.peek(tokens, namespace=namespace).hit_tokens

    def resume(
        self,
        request_id: str,
        prompt_ids: Any,
        *,
        allocate: Callable[[], BlockTable | NeverType | None],
        state: Any = None,
        namespace: str | bytes | None = None,
    ) -> int:
        """Looks the prompt up and, on a hit, fills the sequence's first blocks (and state) from the host.

        ``prompt_ids`` as the engine holds them (a list, an integer array, a CPU tensor). A request's ids only grow
        until ``forget(request_id)``: before a hit is allocated and loaded, every token is compared with what was
        hashed for the request, and a prompt that does not extend it raises ``PromptMismatchError``
        (docs/INDEX.md); a call for a request already seen costs its new tokens, not the prompt.

        ``allocate()`` is called only on a hit: it allocates the sequence's GPU blocks now and returns its block
        table (GPU block ids, the same value ``store`` takes), None for "not now", or ``kvtier.NEVER`` for "never"
        (a miss). An exception ``allocate()`` raises (a CUDA out-of-memory) reaches the caller as a
        ``BadArgument`` whose cause it is, and counts nothing. Returns the cached tokens, 0 for a miss (or a
        failure: the sequence is then recomputed from scratch, even if it was allocated), or -1 when the sequence
        should retry later (``allocate()`` said not now, or an L3 fetch for it is running; nothing of the sequence
        was touched).
        """
        _check_call(request_id, namespace)
        self._check_state(state)
        if not callable(allocate):
            raise BadArgument(f"allocate must be callable, got {type(allocate).__name__}")
        return self._resume(request_id, prompt_ids, allocate, state, namespace)

    @guarded(0)
    def _resume(self, request_id, tokens, allocate, state, namespace) -> int:  # type: ignore[no-untyped-def]
        # L3: a request whose fetch runs retries later; a host miss starts the request's one fetch (no GPU blocks).
        l3 = self._l3
        if l3 is not None and l3.waiting(request_id):
            return -1
        self._copiers[0].check_memory()
        hit = self._core.resume(
            request_id,
            tokens,
            allocate=lambda: _host_ids(allocate()),
            state=state,
            namespace=namespace,
            stream=self._stream(),
            fetch_group_pages=l3.fetch_group_pages(request_id) if l3 is not None else None,
        )
        if hit == CoreCache.FETCH:
            return -1 if l3.start_fetch(request_id) else 0
        return int(hit)

    def store(
        self,
        request_id: str,
        prompt_ids: Any,
        block_table: BlockTable,
        *,
        seq_len: int | None = None,
        state: Any = None,
        namespace: str | bytes | None = None,
    ) -> None:
        """Write-through store of a prompt whose prefill has run: its full blocks (GPU blocks ``block_table``,
        a sequence of ints or an integer array; ids past the prompt's full blocks are not read) and, for models
        with state, the states at the last few block boundaries still in the ring (``seq_len``: the sequence's
        length now, default the prompt's). Every token is compared with what was hashed for the request first.
        The copies are enqueued (on kvtier's copy stream, after the engine's work enqueued so far) and ``store``
        returns at once; ``poll()`` makes them hits once they finished. Call ``release(blocks)`` or
        ``forget(request_id)`` before the engine rewrites these blocks."""
        _check_call(request_id, namespace)
        self._check_state(state)
        self._store(request_id, prompt_ids, _host_ids(block_table), seq_len, state, namespace)

    def _check_state(self, state: Any) -> None:
        if state is None and self._host.states is not None:
            raise BadArgument(
                "state= must be the engine's handle of the sequence's state (this model has state), got None"
            )

    @guarded(None)
    def _store(self, request_id, tokens, table, seq_len, state, namespace) -> None:  # type: ignore[no-untyped-def]
        self._copiers[0].check_memory()
        outcome = self._core.store(
            request_id, tokens, table, seq_len=seq_len, state=state, namespace=namespace, stream=self._stream()
        )
        self._host.start()  # after planning: the first store of a lazily pinned pool is always skipped
        if outcome == "skipped_pinning" and not self._told_pinning:
            self._told_pinning = True
            log.warning(
                "a store was skipped, so its prompt is not cached: the host pool is still being pinned (%d of %d MiB "
                "so far), and stores use each pin step as it completes. To cache from the first store, build the "
                "cache with preallocate=True (pins the pool at construction); wait_pinned() waits for the pinning "
                "a first store started (stores skipped: stats()['store_skipped_pinning'])",
                self._host.pinned_bytes() >> 20,
                self.page_slots * self.page_bytes >> 20,
            )

    @guarded(None)
    def poll(self) -> None:
        """Retires finished copies: stored entries become ready, loaded ones are released. Never blocks."""
        for ready in self._core.poll():
            if self._l3 is not None:
                self._l3.put(ready)  # L3 write-behind of what the store made ready

    def wait_layer(self, layer: int) -> None:
        """Before layer ``layer`` reads its KV: the engine's stream waits (GPU-side) for the pages of pending
        layer-wise loads of that layer. Cheap; a no-op without layer-wise loads and on the CPU."""
        # The engine's stream is looked up only when there is a load to wait for: the lookup costs more than the
        # call, and an engine calls this for every layer of every forward.
        if self._core.waiting(layer):
            self._order("wait_layer", self._core.wait_layer, layer, stream=self._stream())

    def wait_loads(self) -> None:
        """``wait_layer`` for every layer."""
        if self._core.waiting():
            self._order("wait_loads", self._core.wait_loads, stream=self._stream())

    def release(self, blocks: BlockTable) -> None:
        """Before the engine rewrites ``blocks`` (GPU block ids, checked as ``store`` checks its table): its stream
        waits (GPU-side) for the pending stores that read them. Cheap; a no-op without copy streams and on the
        CPU."""
        self._order("release", self._core.release, _host_ids(blocks), stream=self._stream())

    def _order(self, what: str, fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """Runs a GPU-side ordering call under the failure policy. If it fails, the host waits for the device
        instead, so the engine never reads a block early nor rewrites one a store still reads. A no-op once closed
        (``close()`` waited for every copy)."""
        if not self.calls.enter():
            return
        try:
            fn(*args, **kwargs)
        except BadArgument:
            raise
        except Exception as e:  # noqa: BLE001 - the policy: no cache failure reaches the engine
            self.failures.failed(what, e)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            self.calls.leave()

    def forget(self, request_id: str) -> None:
        """The request is gone: drop its cached chain (call it for every request, hit or not); the engine's stream
        waits (GPU-side) for the request's pending stores, so its blocks may be reused. Runs even when the cache
        disabled itself, so that no chain is kept; a no-op once closed."""
        _check_call(request_id, None)
        if not self.calls.enter():
            return
        try:
            self._core.forget(request_id, stream=self._stream())
            if self._l3 is not None:
                self._l3.forget(request_id)
        except BadArgument:
            raise
        except Exception as e:  # noqa: BLE001 - the policy: no cache failure reaches the engine
            self.failures.failed("forget", e)
        finally:
            self.calls.leave()

    def set_model_version(self, version: str) -> None:
        """The engine updated its weights in place (an RL weight sync, a new checkpoint): nothing stored under the
        old version is served again. Host entries of the old version are dropped (those still in use when their
        copies finish), copies in flight for it make nothing ready, requests seen before this call serve and store
        nothing until forgotten, and L3 objects are named and checked under the new version's fingerprint. Call
        it before the engine runs any prefill on the new weights."""
        if not isinstance(version, str) or not version:
            raise BadArgument(f"version must be a non-empty str, got {type(version).__name__} {version!r}")
        with self._lock:
            if self.index.set_model_version(version) and self._l3 is not None:
                self._l3.set_model_version(version)

    def take_events(self) -> list[KvEvent]:
        """The KV events since the last call, oldest first (none unless `event_buffer` > 0): host pages stored and
        evicted ("CPU"), L3 objects put and found gone ("STORAGE"). `kvtier.events.EventPublisher` sends them to
        routers in vLLM's encoding."""
        return self.index.take_events()

    def stats(self) -> dict[str, Any]:
        """Counters, occupancy, token hit rate, bytes moved, and whether the cache disabled itself."""
        out: dict[str, Any] = dict(self.index.stats())
        out["disabled"] = self.failures.disabled
        out["page_bytes"] = self.page_bytes
        out["state_bytes"] = self.state_bytes
        out["bytes_to_host"] = out["pages_stored"] * self.page_bytes + out["states_stored"] * self.state_bytes
        out["bytes_to_gpu"] = out["pages_loaded"] * self.page_bytes + out["states_loaded"] * self.state_bytes
        out["host_bytes_pinned"] = self._host.pinned_bytes()
        out["copies_in_flight"] = self._core.copies_in_flight
        out["bad_arguments"] = self.failures.bad_arguments
        if self._l3 is not None:
            out.update(self._l3.stats())
        return out

    def close(self) -> None:
        """Waits for the engine calls running on other threads and the copies in flight, stops pinning and
        releases the host pools. Idempotent."""
        ended = self.calls.close(_CLOSE_WAIT_S)
        if ended is None:
            return
        if not ended:
            log.warning("engine calls still running after %.0f s: the host pools are not freed", _CLOSE_WAIT_S)
        self._core.drain()
        # L3: a native Store call may still use the host pools; leaking them is safer than freeing them.
        l3_stopped = self._l3 is None or self._l3.close()
        if not l3_stopped:
            log.warning("the L3 store did not stop in time; the host pools are not freed")
        self._host.close(free=ended and l3_stopped)

    @property
    def disabled(self) -> bool:
        """Whether the cache disabled itself (``max_errors`` failures, or ``disable``): it serves and stores
        nothing more."""
        return self.failures.disabled

    def report_error(self, where: str, e: BaseException) -> None:
        """For adapters that must not raise into their engine: ``e`` was raised by a call at ``where``. A caller's
        mistake (``kvtier.BadArgument``) is logged and counted in ``bad_arguments``, never towards ``max_errors``;
        anything else is kvtier's failure (``errors``)."""
        self.failures.report(where, e)

    def disable(self, reason: str) -> None:
        """Stops serving and storing for good (logged): what an adapter does when it cannot keep the cache exact."""
        self.failures.disable(reason)
