"""What a host prefix cache reads of the engine's GPU KV pool and model, checked once, before anything is allocated:
the pool's layout and page bytes, the block size, the per-sequence state, and the host slots they make."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier import BadArgument, IndexConfig
from kvtier.copy import is_int, layer_views
from kvtier.settings import CacheSettings, check_fits


@dataclass(frozen=True)
class Geometry:
    """The GPU pool (``layers``: one uint8 tensor ``[num_blocks, page_bytes]`` page-first, or one
    ``[num_blocks, segment_bytes]`` a layer), the layer parts of a page-first pool that layer-wise loads copy a part
    at a time (``parts``, None when a page is one piece), and the sizes of the host pools."""

    layers: tuple[torch.Tensor, ...]
    layer_first: bool
    parts: tuple[torch.Tensor, ...] | None
    block_size: int
    page_bytes: int
    page_slots: int
    state_bytes: int
    state_slots: int

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    @property
    def layout(self) -> str:
        """The layout as the L3 identity names it."""
        return f"layer-first/{len(self.layers)}" if self.layer_first else "page-first"

    @classmethod
    def of(
        cls,
        pages: torch.Tensor | Sequence[torch.Tensor],
        settings: CacheSettings,
        *,
        block_size: int,
        page_layers: int | None = None,
        state_bytes: int = 0,
    ) -> Geometry:
        """Checks the engine's pool and model against the settings (and this machine's memory); raises
        ``BadArgument`` naming the bad value."""
        s = settings
        layers = [pages] if isinstance(pages, torch.Tensor) else list(pages)
        if not layers or not all(isinstance(t, torch.Tensor) for t in layers):
            raise BadArgument("pages must be a uint8 tensor or a non-empty list of uint8 tensors")
        if any(t.dim() != 2 for t in layers):
            shapes = [tuple(t.shape) for t in layers]
            raise BadArgument(f"pages must be 2-D [num_blocks, bytes per block], got shapes {shapes}")
        page_bytes = sum(int(t.shape[1]) for t in layers)
        if page_layers is not None and len(layers) > 1 and page_layers != len(layers):
            raise BadArgument(
                f"page_layers={page_layers!r} differs from the {len(layers)} tensors of a layer-first pool"
            )
        parts = None if page_layers is None or len(layers) > 1 else layer_views(layers[0], page_layers)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 0 < block_size <= 2**31 - 1:
            raise BadArgument(f"block_size must be a positive int, got {block_size!r}")
        page_slots = s.host_bytes // max(page_bytes, 1)
        if page_slots < 1:
            raise BadArgument(f"host_bytes {s.host_bytes} holds no page of {page_bytes} bytes")
        if not is_int(state_bytes) or state_bytes < 0:
            raise BadArgument(f"state_bytes must be an int >= 0, got {state_bytes!r}")
        state_bytes, state_slots = int(state_bytes), s.state_slots
        if state_slots and state_bytes <= 0:
            raise BadArgument(f"state_slots={state_slots} needs state_bytes > 0, got {state_bytes}")
        if state_bytes and not state_slots:
            # Without state slots a hit would restore pages but not the state the model needs.
            raise BadArgument(f"a model with state (state_bytes={state_bytes}) needs state_slots > 0")
        # The pools, their bookkeeping and the L3 buffers must fit in this machine.
        check_fits(s, page_slots=page_slots, page_bytes=page_bytes, state_bytes=state_bytes)
        device = layers[0].device
        if state_slots and device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
            if s.staging_slots * state_bytes > free:
                raise BadArgument(
                    f"setting staging_slots={s.staging_slots} needs {s.staging_slots * state_bytes} bytes of "
                    f"GPU memory ({state_bytes} per state); {device} has {free} bytes free"
                )
        return cls(
            layers=tuple(layers),
            layer_first=not isinstance(pages, torch.Tensor),
            parts=tuple(parts) if parts is not None and len(parts) > 1 else None,
            block_size=block_size,
            page_bytes=page_bytes,
            page_slots=page_slots,
            state_bytes=state_bytes,
            state_slots=state_slots,
        )

    def index_config(self, settings: CacheSettings) -> IndexConfig:
        """The index of these pools under the settings."""
        s = settings
        return IndexConfig(
            self.page_slots,
            state_slots=self.state_slots,
            block_size=self.block_size,
            keep_tokens=s.keep_tokens,
            min_hit_tokens=s.min_hit_tokens,
            state_lookback_blocks=s.state_lookback_blocks,
            ring_slack=s.ring_slack,
            hash_kind=s.hash_kind,
            hash_key=s.hash_key,
            eviction_policy=s.eviction_policy,
            event_buffer=s.event_buffer,
        )
