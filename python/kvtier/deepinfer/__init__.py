"""A drop-in adapter with the engine shape of DeepInfer's host prefix cache.

    cache = Cache(engine, size_bytes=64 << 30, num_state_slots=4096)
    hit = cache.try_resume(seq, request_id, prompt_ids)   # b > 0 cached tokens, 0 miss, -1 retry later
    cache.on_prefill_step(scheduled, finished)            # write-through store of finished prompts
    cache.poll(); cache.release(block_table); cache.forget(request_id); cache.stats_dict()
    cache.wait_layer(layer)                               # with layerwise_loads, before layer l reads its KV

What it needs from the engine: ``engine.cache_config.block_size``; the GPU pools ``engine.gpu_blocks``
(page-first) or ``engine.gpu_layers`` (layer-first), ``engine.gpu_states`` and ``engine.state_bytes`` when the
model has state, with ``engine.select_state`` / ``engine.load_state`` and ``engine.ring_slack``;
``engine.scheduler.try_allocate_seq(seq)``; and on a sequence ``block_table``, ``request_id``,
``chunked_rest_len``, ``get_len()``, ``data.get_token_ids()``, ``num_cached_tokens``, ``cached_hit_tokens``.
Optionally ``engine.page_layers``: the layers a page-first page holds, back to back in layer order; layer-wise
loads then copy and wait a layer at a time (without it, a page is one piece).

With L3, the objects' fingerprint covers the model (``kvtier.identity.model_identity``): the engine's config
(``engine.fingerprint``, or a digest of ``engine.config``: a dataclass, ``to_dict()`` or attributes), the engine
settings that change KV bytes (``KV_ATTRIBUTES``: KV cache dtype and scales, quantization, positional settings,
window; on the engine, its ``config`` or ``cache_config``), and either the ``model_version`` setting (a revision the
deployment vouches for) or a digest of every byte of every tensor of ``engine.model``; unless the caller passes
``fingerprint_fields``. The shard comes from ``engine.tp_rank`` / ``tp_size`` / ``pp_rank`` / ``pp_size`` /
``cp_rank`` / ``cp_size`` and ``engine.kv_replicated`` (MLA) where the engine has them, unless the caller passes
``shard``. Weights updated in place: ``set_model_version(v)``.

Every call catches its own exceptions (bad arguments included) and never raises into the engine: the engine's
mistakes (a ``kvtier.BadArgument``: a bad argument, or what its own objects raised while the adapter read them,
``scheduler.try_allocate_seq`` included, such as a CUDA out-of-memory) are logged with their cause and counted in
``bad_arguments``; any other failure is kvtier's, counted in ``errors``, and after ``max_errors`` of them the cache
disables itself. The request continues uncached either way.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier import BadArgument
from kvtier.cache import HostPrefixCache
from kvtier.identity import Shard, model_identity


def engine_shard(engine: Any) -> Shard:
    """The engine's parallel ranks (``tp_rank``... attributes; 0 of 1 where absent) and KV replication."""
    dims = {
        f"{d}_{w}": int(getattr(engine, f"{d}_{w}", 0 if w == "rank" else 1))
        for d in ("tp", "pp", "cp")
        for w in ("rank", "size")
    }
    return Shard(**dims, kv_replicated=bool(getattr(engine, "kv_replicated", False)))


def _field(seq: Any, path: str) -> Any:
    """``seq.<path>`` of an engine sequence (``"get_len()"`` calls it); whatever goes wrong reading it is the
    engine's argument: a ``BadArgument``, whose cause is what the engine's sequence raised."""
    try:
        value = seq
        for part in path.split("."):
            value = getattr(value, part.removesuffix("()"))
            if part.endswith("()"):
                value = value()
        return value
    except Exception as e:  # noqa: BLE001 - any failure to read the engine's sequence is a bad argument
        raise BadArgument(f"the sequence ({type(seq).__name__}) has no usable {path}: {type(e).__name__}: {e}") from e


def _sequences(seqs: Any, what: str) -> list[Any]:
    if seqs is None or isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__iter__"):
        raise BadArgument(f"{what} must be a list of the engine's sequences, got {type(seqs).__name__}")
    return list(seqs)


class Cache:
    """DeepInfer's host prefix cache surface over ``HostPrefixCache``."""

    def __init__(
        self,
        engine: Any,
        *,
        size_bytes: int | None = None,
        num_state_slots: int | None = None,
        staging_slots: int | None = None,
        **settings: Any,
    ) -> None:
        self.engine = engine
        pages = engine.gpu_blocks if getattr(engine, "gpu_blocks", None) is not None else engine.gpu_layers
        has_state = getattr(engine, "gpu_states", None) is not None and getattr(engine, "state_bytes", 0) > 0
        settings.setdefault("ring_slack", getattr(engine, "ring_slack", None))
        settings.setdefault("page_layers", getattr(engine, "page_layers", None))
        # L3 keys name the model and the shard: the caller's, or what the engine has (read only with L3).
        if settings.get("fingerprint_fields") is None:
            settings["fingerprint_fields"] = lambda s: model_identity(engine, s.model_version)
        if settings.get("shard") is None:
            settings["shard"] = engine_shard(engine)
        self.cache = HostPrefixCache(
            pages,
            block_size=engine.cache_config.block_size,
            state_bytes=engine.state_bytes if has_state else 0,
            select_state=engine.select_state if has_state else None,
            load_state=engine.load_state if has_state else None,
            host_bytes=size_bytes,
            state_slots=num_state_slots if has_state else 0,
            staging_slots=staging_slots,
            **settings,
        )

    def try_resume(self, seq: Any, request_id: str, prompt_ids: Any) -> int:
        """Cached tokens b (the sequence's blocks and state were filled, ``seq.num_cached_tokens`` set), 0 for
        a miss, -1 when GPU blocks cannot be allocated right now (retry later)."""
        try:
            hit = self.cache.resume(request_id, prompt_ids, allocate=lambda: self._allocate(seq), state=seq)
            if hit > 0:
                seq.num_cached_tokens = seq.cached_hit_tokens = hit
            return hit
        except Exception as e:  # noqa: BLE001 - no cache problem reaches the engine
            self.cache.report_error("try_resume", e)
            return 0

    def _allocate(self, seq: Any) -> Any:
        if not self.engine.scheduler.try_allocate_seq(seq):
            return None
        return _field(seq, "block_table")

    def on_prefill_step(self, scheduled: Any, finished: Any) -> None:
        """Stores every scheduled sequence whose last prompt chunk ran this step. ``finished`` (the sequences
        that finished this step) is only checked: their blocks are ordered by ``release`` and ``forget``."""
        try:
            _sequences(finished, "finished")
        except BadArgument as e:
            self.cache.report_error("on_prefill_step", e)
        try:
            seqs = _sequences(scheduled, "scheduled")
        except BadArgument as e:
            self.cache.report_error("on_prefill_step", e)
            return
        for seq in seqs:
            try:
                if _field(seq, "chunked_rest_len") != 0:
                    continue
                # The sequence's own prompt ids: the tokens whose KV its blocks hold, whatever its request id
                # was used for before.
                ids = _field(seq, "data.get_token_ids()")
                prompt = ids[: len(ids) - len(getattr(seq, "output_ids", ()))]
                request_id, table = _field(seq, "request_id"), _field(seq, "block_table")
                self.cache.store(request_id, prompt, table, seq_len=_field(seq, "get_len()"), state=seq)
            except Exception as e:  # noqa: BLE001
                self.cache.report_error("on_prefill_step", e)

    def poll(self) -> None:
        self.cache.poll()

    def wait_layer(self, layer: int) -> None:
        """Before layer ``layer`` reads its KV: the engine's stream waits (GPU-side) for layer-wise loads."""
        if not self._shielded("wait_layer", self.cache.wait_layer, layer):
            self._sync()  # the model must not read a block early

    def release(self, blocks: Any) -> None:
        """Before GPU ``blocks`` are rewritten: the engine's stream waits (GPU-side) for stores still reading
        them."""
        if not self._shielded("release", self.cache.release, blocks):
            self._sync()  # a stored page must not read a block the engine rewrites

    def forget(self, request_id: str) -> None:
        self._shielded("forget", self.cache.forget, request_id)

    def _shielded(self, where: str, fn: Any, *args: Any) -> bool:
        """Runs a cache call that must not raise into the engine; False (logged, counted) if it raised."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - the adapter never raises into the engine
            self.cache.report_error(where, e)
            return False
        return True

    def _sync(self) -> None:
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize(self.cache.device)

    def set_model_version(self, version: str) -> None:
        """The engine updated its weights in place: nothing stored under the old version is served again (see
        ``HostPrefixCache.set_model_version``). If the change cannot be made, the cache disables itself rather
        than serve KV of the old weights."""
        try:
            self.cache.set_model_version(version)
        except Exception as e:  # noqa: BLE001 - the adapter never raises into the engine
            self.cache.report_error("set_model_version", e)
            self.cache.disable("the model version could not be changed")

    def stats_dict(self) -> dict[str, Any]:
        return self.cache.stats()

    def close(self) -> None:
        self.cache.close()
