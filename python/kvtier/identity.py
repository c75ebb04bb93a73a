"""The identity of an L3 object's bytes: what goes into the layout fingerprint of its key.

Two caches share an object only when every field agrees: the model (its revision, or its config and the digest of
every weight byte, and the engine's settings that change KV bytes, from the engine or the caller), the shard of
each page this process holds (tensor-, pipeline- and context-parallel rank and size), the page and state geometry,
the chain's hash kind and key id, and (added by the core) the object format and the chain's key scheme.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier._core import DIGEST_PART_BYTES, BadArgument, part_digests

# Engine settings that change the bytes of a page or a state besides the model's config and weights: the KV
# cache's dtype and scales, the quantization, the positional encoding, the window. Each is read from the engine,
# its `config` or its `cache_config`, the first that has it (docs/RELIABILITY.md lists them).
KV_ATTRIBUTES = (
    "dtype",
    "kv_cache_dtype",
    "kv_scales",
    "quantization",
    "rope_scaling",
    "rope_theta",
    "partial_rotary_factor",
    "max_position_embeddings",
    "sliding_window",
)
# Bytes of a GPU tensor copied to the host at a time for its digest: a whole number of digest parts.
_COPY_BYTES = (256 << 20) // DIGEST_PART_BYTES * DIGEST_PART_BYTES


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
                    raise BadArgument(f"Shard.{name} must be an int, got {v!r}")
            if not 0 <= rank < size:
                raise BadArgument(f"Shard needs 0 <= {dim}_rank < {dim}_size, got {rank} and {size}")
        if not isinstance(self.kv_replicated, bool):
            raise BadArgument(f"Shard.kv_replicated must be a bool, got {self.kv_replicated!r}")

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
    model_version: str | None,
) -> dict[str, str]:
    """Every field of a cache's fingerprint; ``model_fields`` are the engine's or caller's (prefixed ``engine.``),
    ``model_version`` the deployment's revision of the model (``set_model_version`` replaces it)."""
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
    if model_version is not None:
        fields["model_version"] = model_version
    return fields


def _tensors(obj: Any, prefix: str, seen: set[int]) -> Iterator[tuple[str, Any]]:
    """Every tensor reachable from a model object, by a dotted name, each once."""
    import torch

    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, torch.nn.Module):
        yield from ((f"{prefix}{k}", v) for k, v in obj.state_dict(keep_vars=True).items())
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k], f"{prefix}{k}.", seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}{i}.", seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for k, v in sorted(vars(obj).items()):
            yield from _tensors(v, f"{prefix}{k}.", seen)


def tensor_digest(t: Any) -> bytes:
    """The part digests of every byte of a tensor (a GPU tensor is copied to the host a few hundred MiB at a
    time)."""
    import torch

    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        return part_digests(flat.numpy())
    return b"".join(part_digests(flat[i : i + _COPY_BYTES].cpu().numpy()) for i in range(0, flat.numel(), _COPY_BYTES))


def weights_identity(model: Any) -> str:
    """A digest of every byte of a model's weights, with each tensor's name, shape and dtype (every tensor reachable
    from ``model``: a torch module, a dict or list of tensors, or an object holding them)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in _tensors(model, "", set()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
        h.update(tensor_digest(t))
    return h.hexdigest()


def config_identity(config: Any) -> str:
    """A digest of a model config (a dataclass, an object with ``to_dict()``, or its attributes)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        fields = dataclasses.asdict(config)
    elif hasattr(config, "to_dict"):
        fields = config.to_dict()
    else:
        fields = dict(vars(config))
    return hashlib.blake2b(json.dumps(fields, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


def _value(v: Any) -> str:
    import torch

    if isinstance(v, torch.Tensor):
        return hashlib.blake2b(tensor_digest(v), digest_size=16).hexdigest()
    if isinstance(v, np.ndarray):
        return hashlib.blake2b(v.tobytes(), digest_size=16).hexdigest()
    return json.dumps(v, sort_keys=True, default=str)


def engine_settings(engine: Any) -> dict[str, str]:
    """The `KV_ATTRIBUTES` an engine has (on itself, its ``config`` or its ``cache_config``), as fingerprint
    fields ``kv.<name>``."""
    out = {}
    holders = [engine, getattr(engine, "config", None), getattr(engine, "cache_config", None)]
    for name in KV_ATTRIBUTES:
        for holder in holders:
            if holder is not None and getattr(holder, name, None) is not None:
                out[f"kv.{name}"] = _value(getattr(holder, name))
                break
    return out


def model_identity(engine: Any, model_version: str | None) -> dict[str, str]:
    """The fingerprint fields of an engine's model: its config (``engine.fingerprint`` when the engine has one,
    else a digest of ``engine.config``), the digest of every byte of its weights (``engine.model``) unless the
    deployment names a ``model_version``, and the engine settings that change KV bytes (``engine_settings``)."""
    config = getattr(engine, "fingerprint", None) or config_identity(engine.config)
    fields = {"model_config": str(config), **engine_settings(engine)}
    if model_version is None:
        fields["model_weights"] = weights_identity(engine.model)
    return fields
