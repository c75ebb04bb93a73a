"""The host prefix cache: the object a serving engine drives.

It keeps KV pages (and per-sequence states) in host memory after the GPU pool dropped them and copies them back
on a later prompt with the same prefix. Bookkeeping is the Rust ``Index``; bytes move through ``PageCopier`` on
kvtier's own copy streams, ordered with the engine's stream by CUDA events (``kvtier.transfer``; or on the engine's
stream with ``copy_streams=False``; memcpy when the pools are CPU tensors), and completion is tracked with events
that ``poll()`` retires without blocking. Engines that rewrite blocks call ``release(blocks)`` or ``forget`` first,
and with ``layerwise_loads`` call ``wait_layer(l)`` before layer l reads its KV.

Engine-loop calls never wait for the GPU or for pinning memory: the host pools are reserved at the first store
and pinned in pin steps on a background thread; stores use the slots pinned so far (a store that finds none is
skipped, logged once at INFO and counted in ``stats()["store_skipped_pinning"]``).

Failure policy (docs/INTEGRATION.md): a caller's bad argument raises to the caller (``OverflowError``,
``TypeError``, ``ValueError``, checked before anything is planned or copied) and counts nothing. Any other
exception inside a call (a failed launch, an engine callback that raised) is kvtier's failure: it is logged and
counted in ``stats()["errors"]``, the request continues uncached, and after ``max_errors`` of them the cache
disables itself (``stats()["disabled"]``). A hit whose pages left the host pool before its load began is a miss
(``stats()["stale_lookups"]``), not a failure.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from kvtier import Index, IndexConfig, StaleLookupError
from kvtier.copy import HostPool, PageCopier, is_int, layer_views
from kvtier.settings import CacheSettings, check_fits
from kvtier.transfer import Transfers

log = logging.getLogger("kvtier")

T = TypeVar("T")
StateFn = Callable[[Any, int, torch.Tensor], None]
BlockTable = Sequence[int] | np.ndarray | torch.Tensor
# What a caller's bad argument raises: re-raised to the caller, never counted towards max_errors.
CALLER_ERRORS = (OverflowError, TypeError, ValueError)
SEQ_LEN_LIMIT = 2**63


def _old_allocate(allocate: Callable[[], Any], block_table: Callable[[], BlockTable]) -> Callable[[], Any]:
    """The deprecated resume form (``allocate() -> bool`` and a ``block_table()`` callable) as the new one."""

    def new() -> Any:
        return block_table() if allocate() else None

    return new


def _guarded(default: T) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Runs an engine-loop call under the failure policy: a caller's bad argument raises and counts nothing; any
    other error is kvtier's failure, logged and counted, never raised."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def call(self: HostPrefixCache, *args: Any, **kwargs: Any) -> T:
            if self.disabled or self.closed:
                return default
            try:
                return fn(self, *args, **kwargs)
            except CALLER_ERRORS:
                raise
            except Exception as e:  # noqa: BLE001 - the policy: no cache failure reaches the engine
                self._error(fn.__name__.lstrip("_"), e)
                return default

        return call

    return wrap


def block_ids(table: Any, needed: int, num_blocks: int, what: str = "block_table") -> np.ndarray:
    """The first ``needed`` GPU block ids of ``table`` as int32, checked as integers in ``[0, num_blocks)`` before
    any conversion: no wrap of wide integers, no truncated floats, no bools, no numeric strings. A numpy or torch
    integer array of any width, or a sequence of ints; ids past ``needed`` are only type-checked."""
    if isinstance(table, torch.Tensor):
        if table.dtype.is_floating_point or table.dtype.is_complex or table.dtype == torch.bool:
            raise TypeError(f"{what} must hold integers, got a tensor of {table.dtype}")
        table = table.detach().cpu().numpy()
    if isinstance(table, np.ndarray):
        if table.dtype.kind not in "iu":
            raise TypeError(f"{what} must hold integers, got dtype {table.dtype}")
        if table.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got shape {table.shape}")
        head: Any = table[:needed]
    elif isinstance(table, (str, bytes)) or not isinstance(table, Sequence):
        raise TypeError(f"{what} must be a sequence of ints or an integer array, got {type(table).__name__}")
    else:
        if set(map(type, table)) != {int}:  # the common case (plain ints) is one quick pass
            for i, b in enumerate(table):
                if not is_int(b):
                    raise TypeError(f"{what}[{i}] must be an int, got {type(b).__name__} {b!r}")
        head = table[:needed]
    if len(head) < needed:
        raise ValueError(f"{what} has {len(table)} blocks, {needed} are needed")
    if not isinstance(head, np.ndarray):
        try:
            head = np.asarray(head, dtype=np.int64)
        except OverflowError:
            head = [b for b in head if not 0 <= b < num_blocks][:1]  # an int beyond int64: name it below
    bad = head[(head < 0) | (head >= num_blocks)] if isinstance(head, np.ndarray) else head
    if len(bad):
        raise ValueError(f"block id {int(bad[0])} is outside the GPU pool of {num_blocks} blocks")
    return head.astype(np.int32)


def _check_call(request_id: Any, namespace: Any) -> None:
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
    if namespace is not None and not isinstance(namespace, (str, bytes)):
        raise TypeError(f"namespace must be str, bytes or None, got {type(namespace).__name__}")


def _seq_len(seq_len: Any) -> int | None:
    if seq_len is None:
        return None
    if not is_int(seq_len):
        raise TypeError(f"seq_len must be an int, got {type(seq_len).__name__} {seq_len!r}")
    if not 0 <= int(seq_len) < SEQ_LEN_LIMIT:
        raise ValueError(f"seq_len must be in [0, 2**63), got {int(seq_len)}")
    return int(seq_len)


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
    L3 (``l3="mooncake"``): ``fingerprint_fields`` name what else decides the bytes of a page (the model's
    config and weights identity, dtype...) and go into the L3 keys' fingerprint, so caches of different models
    never read each other's objects; L3 refuses to start without them (pass ``{}`` to say that nothing else
    does). ``shard`` (``kvtier.l3.Shard``) names the parallel ranks whose part of each page this process holds.
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
        fingerprint_fields: Mapping[str, str] | None = None,
        shard: Any = None,
        l3_store: Callable[[Any], Any] | None = None,
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
        if page_layers is not None and len(layers) > 1 and page_layers != len(layers):
            raise ValueError(
                f"page_layers={page_layers!r} differs from the {len(layers)} tensors of a layer-first pool"
            )
        # A page-first pool that layer-wise loads copy a layer part at a time: its parts, as layer tensors.
        parts = None if page_layers is None or len(layers) > 1 else layer_views(layers[0], page_layers)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 0 < block_size <= 2**31 - 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.page_slots = s.host_bytes // max(self.page_bytes, 1)
        if self.page_slots < 1:
            raise ValueError(f"host_bytes {s.host_bytes} holds no page of {self.page_bytes} bytes")
        if not is_int(state_bytes) or state_bytes < 0:
            raise ValueError(f"state_bytes must be an int >= 0, got {state_bytes!r}")
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
        # Before any allocation: the pools, their bookkeeping and the L3 buffers must fit in this machine.
        check_fits(s, page_slots=self.page_slots, page_bytes=self.page_bytes, state_bytes=self.state_bytes)
        if state_slots and self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            if s.staging_slots * self.state_bytes > free:
                raise ValueError(
                    f"setting staging_slots={s.staging_slots} needs {s.staging_slots * self.state_bytes} bytes of "
                    f"GPU memory ({self.state_bytes} per state); {self.device} has {free} bytes free"
                )
        config = IndexConfig(
            self.page_slots,
            state_slots=state_slots,
            block_size=block_size,
            keep_tokens=s.keep_tokens,
            min_hit_tokens=s.min_hit_tokens,
            state_lookback_blocks=s.state_lookback_blocks,
            ring_slack=s.ring_slack,
            hash_kind=s.hash_kind,
            hash_key=s.hash_key,
        )
        self.index = Index(config, usable_page_slots=0, usable_state_slots=0)
        self.disabled = False
        self.closed = False  # after close(), engine-loop calls are no-ops: resume misses, store does nothing
        self.errors = 0
        self._counts = {"store_skipped_pinning": 0, "stale_lookups": 0, "bad_arguments": 0}
        self._told_pinning = False
        self._lock = threading.Lock()
        # The host pools are address space only until they grow (at the first store, or now with preallocate);
        # building the copiers here checks the GPU pool (dtype, shapes, alignment) before anything is stored.
        self._host_pages = HostPool(self.page_slots, self.page_bytes, step_bytes=s.pin_step_bytes)
        self._copy_pages = self._copier(pages, s)
        self._host_states: HostPool | None = None
        self._copy_states: PageCopier | None = None
        self._staging: torch.Tensor | None = None
        if state_slots:
            self._host_states = HostPool(state_slots, self.state_bytes, step_bytes=s.pin_step_bytes)
            self._staging = torch.zeros((s.staging_slots, self.state_bytes), dtype=torch.uint8, device=self.device)
            self._copy_states = PageCopier(self._staging, self._host_states)
        # The copy streams and their ordering with the engine's stream (kvtier.transfer).
        self.transfers = Transfers(
            self._copy_pages,
            layers=self._copier(parts, s) if parts is not None and len(parts) > 1 else None,
            copy_streams=s.copy_streams,
            layerwise_loads=s.layerwise_loads,
        )
        self._grower: threading.Thread | None = None
        self._closing = threading.Event()
        # L3 (kvtier.l3.tier): only with l3="mooncake"; otherwise nothing of the L3 tier or Mooncake is imported.
        self._l3: Any = None
        if s.l3 == "mooncake":
            from kvtier.l3.identity import Shard, layout_fields
            from kvtier.l3.tier import L3Tier

            if fingerprint_fields is None:
                raise ValueError(
                    "l3='mooncake' needs fingerprint_fields naming the model (its config and weights "
                    "identity), or fingerprint_fields={} to say that the page geometry alone decides "
                    "the bytes"
                )
            if shard is not None and not isinstance(shard, Shard):
                raise TypeError(f"shard must be a kvtier.l3.Shard, got {type(shard).__name__}")
            layout = "page-first" if isinstance(pages, torch.Tensor) else f"layer-first/{len(layers)}"
            fields = layout_fields(
                page_bytes=self.page_bytes,
                state_bytes=self.state_bytes,
                block_size=block_size,
                layout=layout,
                hash_kind=self.index.hash_kind,
                key_id=self.index.key_id,
                shard=shard or Shard(),
                model_fields=fingerprint_fields,
            )
            self._l3 = L3Tier(
                s,
                index=self.index,
                page_pool=self._host_pages,
                state_pool=self._host_states,
                fingerprint_fields=fields,
                store_factory=l3_store,
            )
        if s.preallocate:
            self._grow_all()

    # Host memory

    def _grow_all(self) -> None:
        """Pins the host pools in pin steps, making each step's slots usable as soon as it is pinned."""
        pools = [p for p in (self._host_pages, self._host_states) if p is not None]
        try:
            for pool in pools:
                while not self._closing.is_set() and pool.usable_slots < pool.slots:
                    pool.grow_step()
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
        """Tokens a resume of this prompt would restore now (0: miss). A pure query: it keeps nothing (no chain,
        no statistics; ``request_id`` is only checked), so it may be called for any number of prompts.
        ``prompt_ids`` as the engine holds them (a list, an integer array, a CPU tensor)."""
        _check_call(request_id, namespace)
        return self._lookup(prompt_ids, namespace)

    @_guarded(0)
    def _lookup(self, tokens: Any, namespace: str | bytes | None) -> int:
        return self.index.peek(tokens, namespace=namespace).hit_tokens

    def resume(
        self,
        request_id: str,
        prompt_ids: Any,
        *,
        allocate: Callable[[], BlockTable | None],
        state: Any = None,
        namespace: str | bytes | None = None,
        block_table: Callable[[], BlockTable] | None = None,
    ) -> int:
        """Looks the prompt up and, on a hit, fills the sequence's first blocks (and state) from the host.

        ``prompt_ids`` as the engine holds them (a list, an integer array, a CPU tensor). A request's ids only grow
        until ``forget(request_id)``: a prompt that does not extend them raises ``PromptMismatchError``
        (docs/INDEX.md); a call for a request already seen costs its new tokens, not the prompt.

        ``allocate()`` is called only on a hit: it allocates the sequence's GPU blocks now and returns its block
        table (GPU block ids, the same value ``store`` takes), or None for "not now"; a RuntimeError means
        "never". Returns the cached tokens, 0 for a miss (or a failure: the sequence is then recomputed from
        scratch, even if it was allocated), or -1 when the sequence should retry later (``allocate()`` said not
        now, or an L3 fetch for it is running; nothing of the sequence was touched).

        ``block_table=`` (a callable, with ``allocate()`` returning a bool) is the old form: deprecated.
        """
        _check_call(request_id, namespace)
        if not callable(allocate):
            raise TypeError(f"allocate must be callable, got {type(allocate).__name__}")
        if block_table is not None:
            warnings.warn(
                "resume(block_table=...) is deprecated: let allocate() return the block table (or None for not now)",
                DeprecationWarning,
                stacklevel=2,
            )
            allocate = _old_allocate(allocate, block_table)
        return self._resume(request_id, prompt_ids, allocate, state, namespace)

    @_guarded(0)
    def _resume(self, request_id, tokens, allocate, state, namespace) -> int:  # type: ignore[no-untyped-def]
        # L3: a request whose fetch runs retries later; a host miss starts the request's one fetch (no GPU blocks).
        if self._l3 is not None and self._l3.waiting(request_id):
            return -1
        look = self.index.lookup(request_id, tokens, namespace=namespace)
        if self._l3 is not None and self._l3.start_fetch(request_id, look.ready_pages, look.limit_pages):
            return -1
        hit = look.hit_tokens
        if hit == 0:
            return 0
        try:
            table = allocate()
        except RuntimeError:
            return 0  # can never fit: let the scheduler reject the request
        if table is None:
            self.index.defer(request_id)
            return -1
        if isinstance(table, (bool, np.bool_)):
            raise TypeError(
                "allocate() must return the block table or None, got a bool (the old form passes block_table= as well)"
            )
        n = hit // self.block_size
        ids = block_ids(table, n, self._copy_pages.num_blocks, "allocate()'s block table")
        try:
            plan = self.index.begin_load(request_id, hit)
        except StaleLookupError:
            self._count("stale_lookups")  # an L3 fetch evicted the pages since the lookup: a miss
            return 0
        try:
            self.transfers.load_pages(plan.page_slots, ids)
            stream = self._stream()
            if plan.state_slot is not None:
                assert self._copy_states is not None and self._staging is not None and self._load_state
                self._copy_states.to_gpu(np.array([plan.state_slot], np.int32), np.zeros(1, np.int32), stream)
                self._load_state(state, hit, self._staging[0])
            self.transfers.finish(plan.ticket, store=False, engine_work=plan.state_slot is not None)
        except BaseException:
            self.index.abort(plan.ticket)
            raise
        return hit

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
        length now, default the prompt's). The copies are enqueued (on kvtier's copy stream, after the engine's work
        enqueued so far) and ``store`` returns at once; ``poll()`` makes them hits once they finished. Call
        ``release(blocks)`` or ``forget(request_id)`` before the engine rewrites these blocks."""
        _check_call(request_id, namespace)
        table = block_ids(block_table, len(prompt_ids) // self.block_size, self._copy_pages.num_blocks)
        self._store(request_id, prompt_ids, table, _seq_len(seq_len), state, namespace)

    @_guarded(None)
    def _store(self, request_id, tokens, table, seq_len, state, namespace) -> None:  # type: ignore[no-untyped-def]
        pinning = any(p.usable_slots < p.slots for p in (self._host_pages, self._host_states) if p is not None)
        skipped = self.index.stats()["store_skipped"] if pinning else 0
        plan = self.index.plan_store(request_id, tokens, seq_len=seq_len, namespace=namespace, block_table=table)
        self._start_growing()  # after planning: the first store of a lazily pinned pool is always skipped
        if len(plan.page_slots) == 0 and len(plan.state_slots) == 0:
            self.index.complete(plan.ticket)  # nothing to copy: present entries were only touched
            if pinning and self.index.stats()["store_skipped"] > skipped:
                self._skipped_while_pinning()
            return
        try:
            stream = self._stream()
            if len(plan.page_slots):
                assert plan.src_blocks is not None
                self.transfers.store_pages(plan.src_blocks, plan.page_slots, request_id)
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
            self.transfers.finish(plan.ticket, store=True, engine_work=len(plan.state_slots) > 0)
        except BaseException:
            self.index.abort(plan.ticket)
            raise

    def _copier(self, pages: torch.Tensor | Sequence[torch.Tensor], s: CacheSettings) -> PageCopier:
        return PageCopier(pages, self._host_pages, method=s.copy_method, crossover_bytes=s.copy_crossover_bytes)

    def _skipped_while_pinning(self) -> None:
        self._count("store_skipped_pinning")
        if not self._told_pinning:
            self._told_pinning = True
            pinned = self._usable(self._host_pages) * self.page_bytes >> 20
            log.info(
                "a store was skipped: the host pool is still being pinned (%d of %d MiB so far); "
                "stores use each pin step as it completes (preallocate=True pins at construction, "
                "wait_pinned() waits for it)",
                pinned,
                self.page_slots * self.page_bytes >> 20,
            )

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    @_guarded(None)
    def poll(self) -> None:
        """Retires finished copies: stored entries become ready, loaded ones are released. Never blocks."""
        for ticket in self.transfers.poll():
            ready = self.index.complete(ticket)
            if ready is not None and self._l3 is not None:
                self._l3.put(ready)  # L3 write-behind of what the store made ready

    def wait_layer(self, layer: int) -> None:
        """Before layer ``layer`` reads its KV: the engine's stream waits (GPU-side) for the pages of pending
        layer-wise loads of that layer. Cheap; a no-op without layer-wise loads and on the CPU."""
        self._order("wait_layer", self.transfers.wait_layer, layer)

    def wait_loads(self) -> None:
        """``wait_layer`` for every layer."""
        self._order("wait_loads", self.transfers.wait_loads)

    def release(self, blocks: BlockTable) -> None:
        """Before the engine rewrites ``blocks`` (GPU block ids, checked as ``store`` checks its table): its stream
        waits (GPU-side) for the pending stores that read them. Cheap; a no-op without copy streams and on the
        CPU."""
        ids = block_ids(blocks, len(blocks), self._copy_pages.num_blocks, "blocks")
        self._order("release", self.transfers.release, ids)

    def _order(self, what: str, fn: Callable[..., None], *args: Any) -> None:
        """Runs a GPU-side ordering call under the failure policy. If it fails, the host waits for the device
        instead, so the engine never reads a block early nor rewrites one a store still reads."""
        try:
            fn(*args)
        except CALLER_ERRORS:
            raise
        except Exception as e:  # noqa: BLE001 - the policy: no cache failure reaches the engine
            self._error(what, e)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def forget(self, request_id: str) -> None:
        """The request is gone: drop its cached chain (call it for every request, hit or not); the engine's stream
        waits (GPU-side) for the request's pending stores, so its blocks may be reused. Runs even when the cache
        disabled itself, so that no chain is kept."""
        _check_call(request_id, None)
        try:
            self.transfers.forget(request_id)
            self.index.forget(request_id)
            if self._l3 is not None:
                self._l3.forget(request_id)
        except CALLER_ERRORS:
            raise
        except Exception as e:  # noqa: BLE001 - the policy: no cache failure reaches the engine
            self._error("forget", e)

    def stats(self) -> dict[str, Any]:
        """Counters, occupancy, token hit rate, bytes moved, and whether the cache disabled itself."""
        out: dict[str, Any] = dict(self.index.stats())
        out["disabled"] = self.disabled
        out["page_bytes"] = self.page_bytes
        out["state_bytes"] = self.state_bytes
        out["bytes_to_host"] = out["pages_stored"] * self.page_bytes + out["states_stored"] * self.state_bytes
        out["bytes_to_gpu"] = out["pages_loaded"] * self.page_bytes + out["states_loaded"] * self.state_bytes
        out["host_bytes_pinned"] = (
            self._usable(self._host_pages) * self.page_bytes + self._usable(self._host_states) * self.state_bytes
        )
        out["copies_in_flight"] = self.transfers.pending()
        with self._lock:
            out.update(self._counts)
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
        for ticket in self.transfers.wait_all():
            self.index.complete(ticket)
        if self._l3 is not None and not self._l3.close():
            # L3: a native Store call may still use the host pools; leaking them is safer than freeing them.
            log.warning("the L3 store did not stop in time; the host pools are not freed")
            return
        for pool in (self._host_pages, self._host_states):
            if pool is not None:
                pool.close()

    def report_error(self, where: str, e: BaseException) -> None:
        """For adapters that must not raise into their engine: ``e`` was raised by a call at ``where``. A caller's
        bad argument (``OverflowError``, ``TypeError``, ``ValueError``) is logged and counted in
        ``bad_arguments``, never towards ``max_errors``; anything else is kvtier's failure (``errors``)."""
        if isinstance(e, CALLER_ERRORS):
            self._count("bad_arguments")
            log.warning(
                "%s refused a bad argument (%s: %s); the request continues uncached", where, type(e).__name__, e
            )
        else:
            self._error(where, e)

    def _error(self, where: str, e: BaseException) -> None:
        with self._lock:
            self.errors += 1
            self.index.count_error()
            log.warning("%s failed (%s: %s); the request continues uncached", where, type(e).__name__, e)
            if self.errors >= self.settings.max_errors and not self.disabled:
                self.disabled = True
                log.error("%d errors, the host prefix cache disables itself", self.errors)
