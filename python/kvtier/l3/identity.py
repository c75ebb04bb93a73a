"""The identity of an L3 object's bytes: what goes into the layout fingerprint of its key.

Two caches share an object only when every field agrees: the model (its config and weights, from the engine or
the caller), the shard of each page this process holds (tensor-, pipeline- and context-parallel rank and size),
the page and state geometry, the chain's hash kind and key id, and (added by the core) the object format and the
chain's key scheme.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """The part of each page a process holds. Tensor-parallel ranks hold different heads, pipeline ranks
    different layers, context-parallel ranks different tokens: each is its own L3 identity. ``kv_replicated``:
    the engine's KV is the same on every tensor-parallel rank (MLA's latent KV), so those ranks share objects;
    pipeline and context ranks still differ."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    kv_replicated: bool = False

    def __post_init__(self) -> None:
        for dim in ("tp", "pp", "cp"):
            rank, size = getattr(self, f"{dim}_rank"), getattr(self, f"{dim}_size")
            for name, v in ((f"{dim}_rank", rank), (f"{dim}_size", size)):
                if not isinstance(v, int) or isinstance(v, bool):
                    raise TypeError(f"Shard.{name} must be an int, got {v!r}")
            if not 0 <= rank < size:
                raise ValueError(f"Shard needs 0 <= {dim}_rank < {dim}_size, got {rank} and {size}")
        if not isinstance(self.kv_replicated, bool):
            raise TypeError(f"Shard.kv_replicated must be a bool, got {self.kv_replicated!r}")

    def fields(self) -> dict[str, str]:
        tp = "replicated" if self.kv_replicated else f"{self.tp_rank}/{self.tp_size}"
        return {
            "shard.tp": tp,
            "shard.pp": f"{self.pp_rank}/{self.pp_size}",
            "shard.cp": f"{self.cp_rank}/{self.cp_size}",
        }


def layout_fields(
    *,
    page_bytes: int,
    state_bytes: int,
    block_size: int,
    layout: str,
    hash_kind: str,
    key_id: str,
    shard: Shard,
    model_fields: Mapping[str, object],
) -> dict[str, str]:
    """Every field of a cache's fingerprint; ``model_fields`` are the engine's or caller's (prefixed ``engine.``)."""
    fields = {
        "page_bytes": str(page_bytes),
        "state_bytes": str(state_bytes),
        "block_size": str(block_size),
        "layout": layout,
        "hash_kind": hash_kind,
        "key_id": key_id,
        **shard.fields(),
    }
    fields.update({f"engine.{k}": str(v) for k, v in model_fields.items()})
    return fields
