"""The engine's GPU pools: paged K/V of the full-attention layers and rings of the sliding-window layers.

Both are raw uint8 tensors (what a prefix cache copies) viewed with the model dtype for compute.

Paged pool. A page is one block of block_size tokens across all full-attention layers; one layer's part of a
page is [2 (K, V), block_size, heads, head_dim].
- page-first: one contiguous tensor gpu_blocks [num_blocks, page_bytes]; a page is one region, laid out
  [num_full_layers, 2, block_size, heads, head_dim].
- layer-first: gpu_layers, one tensor per full-attention layer [num_blocks, block_bytes_per_layer]; a page is
  num_full_layers segments, one per tensor.

State pool. gpu_states [num_state_rings, state_slot_bytes] holds each live sequence's rings, laid out
[num_sliding_layers, 2, ring_size, heads, head_dim]; position p lives at ring index p % ring_size. A stored
state is the window of positions [pos - window, pos) of every sliding layer, [num_sliding_layers, 2, window,
heads, head_dim] in position order, with positions below 0 as zeros.
"""

from __future__ import annotations

import torch

from .config import EngineConfig


class PagedKV:
    """The paged K/V of the full-attention layers, in either layout."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        c = config
        self.layout = c.layout
        shape = (c.num_gpu_blocks, 2, c.block_size, c.heads, c.head_dim)
        self.gpu_blocks: torch.Tensor | None = None
        self.gpu_layers: list[torch.Tensor] | None = None
        # Zeroed so that the bytes past a sequence's last token are defined.
        if c.layout == "page-first":
            self.gpu_blocks = torch.zeros(c.num_gpu_blocks, c.page_bytes, dtype=torch.uint8, device=device)
            typed = self.gpu_blocks.view(c.torch_dtype).view(c.num_gpu_blocks, c.num_full_layers, *shape[1:])
            self._layers = [typed[:, i] for i in range(c.num_full_layers)]
        else:
            self.gpu_layers = [
                torch.zeros(c.num_gpu_blocks, c.block_bytes_per_layer, dtype=torch.uint8, device=device)
                for _ in range(c.num_full_layers)
            ]
            self._layers = [t.view(c.torch_dtype).view(shape) for t in self.gpu_layers]
        self.block_size = c.block_size

    def write(self, layer: int, block_id: int, offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [T, heads, head_dim] of T consecutive positions starting at `offset` inside one block."""
        t = k.shape[0]
        self._layers[layer][block_id, 0, offset : offset + t] = k
        self._layers[layer][block_id, 1, offset : offset + t] = v

    def gather(self, layer: int, block_ids: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_tokens, heads, head_dim] of positions [0, num_tokens) through a block table."""
        kv = self._layers[layer].index_select(0, block_ids)  # [nb, 2, bs, H, D]
        kv = kv.transpose(0, 1).flatten(1, 2)[:, :num_tokens]
        return kv[0], kv[1]


class RingStates:
    """The sliding-window layers' rings, one slot per live sequence, and the two state kernels."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        c = config
        self.window = c.window
        self.ring_size = c.ring_size
        self.state_bytes = c.state_bytes
        self.dtype = c.torch_dtype
        self.gpu_states = torch.zeros(c.num_state_rings, c.state_slot_bytes, dtype=torch.uint8, device=device)
        self._rings = self.gpu_states.view(c.torch_dtype).view(
            c.num_state_rings, c.num_sliding_layers, 2, c.ring_size, c.heads, c.head_dim
        )
        self._state_shape = (c.num_sliding_layers, 2, c.window, c.heads, c.head_dim)

    def _ring_index(self, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, device=self.gpu_states.device) % self.ring_size

    def write(self, slot: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [T, heads, head_dim] of positions [start, start + T) into a ring."""
        idx = self._ring_index(start, start + k.shape[0])
        ring = self._rings[slot, layer]
        ring[0].index_copy_(0, idx, k)
        ring[1].index_copy_(0, idx, v)

    def gather(self, slot: int, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [end - start, heads, head_dim] of positions [start, end); they must still be in the ring."""
        ring = self._rings[slot, layer].index_select(1, self._ring_index(start, end))
        return ring[0], ring[1]

    def _staged(self, staging: torch.Tensor) -> torch.Tensor:
        if not isinstance(staging, torch.Tensor) or staging.dtype != torch.uint8:
            raise TypeError(f"staging must be a uint8 tensor, got {getattr(staging, 'dtype', type(staging))}")
        if staging.numel() != self.state_bytes or not staging.is_contiguous():
            raise ValueError(
                f"staging must be {self.state_bytes} contiguous bytes, got {staging.numel()} bytes "
                f"(contiguous={staging.is_contiguous()})"
            )
        if staging.device != self.gpu_states.device:
            raise ValueError(f"staging is on {staging.device}, the state pool on {self.gpu_states.device}")
        return staging.view(-1).view(self.dtype).view(self._state_shape)

    def select(self, slot: int, pos: int, staging: torch.Tensor) -> None:
        """Copy the window [pos - window, pos) of a slot's rings into staging; positions below 0 are zeros."""
        staged = self._staged(staging)
        first = max(0, pos - self.window)
        if pos < self.window:
            staged[:, :, : self.window - pos].zero_()
        staged[:, :, self.window - (pos - first) :] = self._rings[slot].index_select(2, self._ring_index(first, pos))

    def load(self, slot: int, pos: int, staging: torch.Tensor) -> None:
        """Write a staged window back into a slot's rings, so the positions [pos - window, pos) are present."""
        staged = self._staged(staging)
        first = max(0, pos - self.window)
        self._rings[slot].index_copy_(2, self._ring_index(first, pos), staged[:, :, self.window - (pos - first) :])
