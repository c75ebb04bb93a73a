"""GPU block and state-slot allocation. There is no GPU prefix cache: a sequence gets fresh blocks for its
whole prompt and generation at admission and gives them back when it finishes."""

from __future__ import annotations

from collections import deque

from .config import EngineConfig
from .sequence import Sequence


class FreeList:
    """Ids 0..n-1, handed out in the order they were freed; a request gets all it asks for or none."""

    def __init__(self, n: int) -> None:
        self._free = deque(range(n))
        self.capacity = n

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def give_back(self, ids: list[int]) -> None:
        self._free.extend(ids)


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.block_size = config.block_size
        self.blocks = FreeList(config.num_gpu_blocks)
        self.state_rings = FreeList(config.num_state_rings if config.num_sliding_layers else 0)
        self._needs_state = config.num_sliding_layers > 0

    def blocks_needed(self, seq: Sequence) -> int:
        return -(-seq.max_tokens // self.block_size)

    def check_fits(self, seq: Sequence) -> None:
        """Raise RuntimeError when the sequence could never be allocated, even on an idle engine."""
        need = self.blocks_needed(seq)
        if need > self.blocks.capacity:
            raise RuntimeError(
                f"request {seq.request_id!r} needs {need} GPU blocks "
                f"({seq.max_tokens} tokens), the pool has {self.blocks.capacity}"
            )

    def try_allocate_seq(self, seq: Sequence) -> bool:
        """Allocate the blocks of the whole prompt and generation (and a state ring when the model has sliding
        layers) now. False if that cannot be done right now; RuntimeError if it never can. True at once for a
        sequence that is already allocated."""
        if seq.is_allocated:
            return True
        self.check_fits(seq)
        if self._needs_state and self.state_rings.num_free < 1:
            return False
        blocks = self.blocks.take(self.blocks_needed(seq))
        if blocks is None:
            return False
        seq.block_table = blocks
        state = self.state_rings.take(1) if self._needs_state else None
        seq.state_id = state[0] if state else None
        return True

    def free_seq(self, seq: Sequence) -> None:
        """Give a sequence's blocks and state ring back. The engine has already ordered their reuse after any
        pending store of them (``cache.release`` before, ``cache.forget`` after this)."""
        self.blocks.give_back(seq.block_table)
        seq.block_table = []
        if seq.state_id is not None:
            self.state_rings.give_back([seq.state_id])
            seq.state_id = None
