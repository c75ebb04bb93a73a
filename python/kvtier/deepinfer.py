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

Every call catches its own exceptions (bad arguments included): they are logged and counted, the request
continues uncached, and after ``max_errors`` errors the cache disables itself.
"""

from __future__ import annotations

from typing import Any

from kvtier.cache import HostPrefixCache


class Cache:
    """DeepInfer's host prefix cache surface over ``HostPrefixCache``."""

    def __init__(self, engine: Any, *, size_bytes: int | None = None, num_state_slots: int | None = None,
                 staging_slots: int | None = None, **settings: Any) -> None:  # fmt: skip
        self.engine = engine
        pages = engine.gpu_blocks if getattr(engine, "gpu_blocks", None) is not None else engine.gpu_layers
        has_state = getattr(engine, "gpu_states", None) is not None and getattr(engine, "state_bytes", 0) > 0
        settings.setdefault("ring_slack", getattr(engine, "ring_slack", None))
        # The engine's hash of what decides its page bytes goes into the L3 keys (when it has one).
        model_fp = getattr(engine, "fingerprint", None)
        settings.setdefault("fingerprint_fields", {"model": str(model_fp)} if model_fp is not None else None)
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
        # Prompts of requests seen by try_resume, so the store hashes the same ids.
        self._prompts: dict[str, Any] = {}

    def try_resume(self, seq: Any, request_id: str, prompt_ids: Any) -> int:
        """Cached tokens b (the sequence's blocks and state were filled, ``seq.num_cached_tokens`` set), 0 for
        a miss, -1 when GPU blocks cannot be allocated right now (retry later)."""
        try:
            self._prompts[request_id] = prompt_ids
            hit = self.cache.resume(
                request_id,
                prompt_ids,
                allocate=lambda: self.engine.scheduler.try_allocate_seq(seq),
                block_table=lambda: seq.block_table,
                state=seq,
            )
            if hit > 0:
                seq.num_cached_tokens = seq.cached_hit_tokens = hit
            return hit
        except Exception as e:  # noqa: BLE001 - no cache problem reaches the engine
            self.cache._error("try_resume", e)
            return 0

    def on_prefill_step(self, scheduled: Any, finished: Any) -> None:
        """Stores every scheduled sequence whose last prompt chunk ran this step."""
        for seq in scheduled:
            if seq.chunked_rest_len != 0:
                continue
            try:
                prompt = self._prompts.get(seq.request_id)
                if prompt is None:  # never went through try_resume: hash its own ids
                    ids = seq.data.get_token_ids()
                    prompt = ids[: len(ids) - len(getattr(seq, "output_ids", ()))]
                self.cache.store(seq.request_id, prompt, seq.block_table, seq_len=seq.get_len(), state=seq)
            except Exception as e:  # noqa: BLE001
                self.cache._error("on_prefill_step", e)

    def poll(self) -> None:
        self.cache.poll()

    def wait_layer(self, layer: int) -> None:
        """Before layer ``layer`` reads its KV: the engine's stream waits (GPU-side) for layer-wise loads."""
        self.cache.wait_layer(layer)

    def release(self, blocks: Any) -> None:
        """Before GPU ``blocks`` are rewritten: the engine's stream waits (GPU-side) for stores still reading
        them."""
        try:
            self.cache.release(blocks)
        except Exception as e:  # noqa: BLE001
            self.cache._error("release", e)

    def forget(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)
        try:
            self.cache.forget(request_id)
        except Exception as e:  # noqa: BLE001
            self.cache._error("forget", e)

    def stats_dict(self) -> dict[str, Any]:
        return self.cache.stats()

    def close(self) -> None:
        self.cache.close()
