"""Configuration of the reference engine: model shape, paged pool, state pool, scheduling."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch

LAYOUTS = ("page-first", "layer-first")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FULL, SLIDING = "F", "S"

# Model sizes for demos and benchmarks; any field can still be overridden.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"vocab": 512, "hidden": 64, "num_layers": 2, "heads": 2, "head_dim": 32, "window": 32},
    "small": {"vocab": 1024, "hidden": 128, "num_layers": 4, "heads": 4, "head_dim": 32, "window": 64},
    "medium": {"vocab": 4096, "hidden": 512, "num_layers": 8, "heads": 8, "head_dim": 64, "window": 128},
    "large": {"vocab": 4096, "hidden": 1024, "num_layers": 16, "heads": 16, "head_dim": 64, "window": 256},
}


@dataclass(frozen=True)
class EngineConfig:
    """Shape of the model and of its GPU pools.

    layer_pattern is a string of 'F' (full attention, K/V in the paged pool) and 'S' (sliding window, K/V in
    a per-sequence ring of window + ring_slack positions), repeated cyclically over num_layers: "FS" alternates,
    "F" has no sliding layers (and then no state pool). A sliding layer's query at position p sees keys
    [p - window, p].
    """

    vocab: int = 1024
    hidden: int = 128
    num_layers: int = 4
    layer_pattern: str = "FS"
    heads: int = 4
    head_dim: int = 32
    intermediate: int | None = None  # MLP width; None means 2 * hidden
    window: int = 64
    ring_slack: int = 64
    block_size: int = 16
    num_gpu_blocks: int = 256
    num_state_rings: int = 8  # GPU ring sets: live sequences with sliding layers
    layout: str = "page-first"
    chunk_size: int = 64
    max_batch: int = 8
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_layers()
        self._check_device()
        self._check_bytes()

    def _check_counts(self) -> None:
        for name in (
            "vocab",
            "hidden",
            "num_layers",
            "heads",
            "head_dim",
            "window",
            "block_size",
            "num_gpu_blocks",
            "chunk_size",
            "max_batch",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        for name in ("ring_slack", "num_state_rings", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"EngineConfig.{name} must be a non-negative int, got {value!r}")
        if self.intermediate is not None and (not isinstance(self.intermediate, int) or self.intermediate < 1):
            raise ValueError(f"EngineConfig.intermediate must be a positive int or None, got {self.intermediate!r}")
        if self.vocab < 2:
            raise ValueError(f"EngineConfig.vocab must be at least 2, got {self.vocab!r}")
        if self.head_dim % 2:
            raise ValueError(f"EngineConfig.head_dim must be even (rotary embedding), got {self.head_dim!r}")

    def _check_layers(self) -> None:
        pattern = self.layer_pattern
        if not isinstance(pattern, str) or not pattern or set(pattern) - {FULL, SLIDING}:
            raise ValueError(
                f"EngineConfig.layer_pattern must be a non-empty string of 'F' and 'S', got {self.layer_pattern!r}"
            )
        if FULL not in self.layer_kinds:
            raise ValueError(
                f"EngineConfig.layer_pattern {self.layer_pattern!r} over {self.num_layers} layers "
                f"has no full-attention layer, so no paged pool"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"EngineConfig.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"EngineConfig.chunk_size {self.chunk_size!r} must be a multiple of "
                f"EngineConfig.block_size {self.block_size!r}"
            )

    def _check_device(self) -> None:
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"EngineConfig.device {self.device!r} is not a torch device") from exc
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"EngineConfig.device must be cpu or cuda, got {self.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"EngineConfig.device {self.device!r} asks for CUDA, which is not available")

    def _check_bytes(self) -> None:
        if self.num_sliding_layers and self.ring_size < self.block_size:
            raise ValueError(
                f"window + ring_slack ({self.window!r} + {self.ring_slack!r}) must be at least "
                f"block_size {self.block_size!r}: a ring holds at least one block's positions"
            )
        if self.num_sliding_layers and self.num_state_rings < 1:
            raise ValueError(
                f"EngineConfig.num_state_rings must be at least 1 with sliding layers, got {self.num_state_rings!r}"
            )
        if self.block_bytes_per_layer % 16:
            raise ValueError(
                f"bytes of one layer's block (2 * block_size * heads * head_dim * itemsize = "
                f"{self.block_bytes_per_layer}) must be a multiple of 16"
            )
        if self.num_sliding_layers and (self.state_bytes % 16 or self.state_slot_bytes % 16):
            raise ValueError(
                f"state bytes ({self.state_bytes}) and ring bytes ({self.state_slot_bytes}) must be "
                f"multiples of 16; window={self.window!r}, ring_slack={self.ring_slack!r}"
            )

    @classmethod
    def preset(cls, name: str, **overrides: object) -> EngineConfig:
        """A config of a named model size ("tiny", "small", "medium", "large") with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {tuple(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})  # type: ignore[arg-type]

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(self.layer_pattern[i % len(self.layer_pattern)] for i in range(self.num_layers))

    @property
    def num_full_layers(self) -> int:
        return self.layer_kinds.count(FULL)

    @property
    def num_sliding_layers(self) -> int:
        return self.layer_kinds.count(SLIDING)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def ring_size(self) -> int:
        """Positions in one sliding layer's ring: position p lives at ring index p % ring_size."""
        return self.window + self.ring_slack

    @property
    def block_bytes_per_layer(self) -> int:
        """K and V of one full-attention layer for one block: [2, block_size, heads, head_dim]."""
        return 2 * self.block_size * self.heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        return self.num_full_layers * self.block_bytes_per_layer

    @property
    def state_bytes(self) -> int:
        """One stored state: K and V of the window positions of every sliding layer; 0 without sliding layers."""
        return self.num_sliding_layers * 2 * self.window * self.heads * self.head_dim * self.itemsize

    @property
    def state_slot_bytes(self) -> int:
        """One live sequence's rings: [num_sliding_layers, 2, ring_size, heads, head_dim]."""
        return self.num_sliding_layers * 2 * self.ring_size * self.heads * self.head_dim * self.itemsize

    def fingerprint(self) -> str:
        """Hash of everything that decides the bytes of a page or a state (not pool sizes or scheduling)."""
        fields = dataclasses.asdict(self)
        for name in ("num_gpu_blocks", "num_state_rings", "chunk_size", "max_batch", "device"):
            del fields[name]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CacheConfig:
    """The paged pool's geometry, as an engine exposes it to a prefix cache (engine.cache_config)."""

    block_size: int
    num_gpu_blocks: int
    layout: str
    page_bytes: int
    block_bytes_per_layer: int
    num_state_rings: int
    state_bytes: int
