"""kvtier's vLLM adapter: ``kvtier.vllm.KvtierSpec`` for vLLM's offloading connector (``kvtier.vllm.spec``), the
Mooncake tier ``kvtier.vllm.KvtierMooncakeTier`` (``kvtier.vllm.tier``), what differs between the supported vLLM
releases (``kvtier.vllm.release``) and the worker's copy half (``kvtier.vllm.copy``).

vLLM loads this package by its path (``"spec_module_path": "kvtier.vllm"``, a tier's ``"module_path": "kvtier.vllm"``).
Importing it under a vLLM outside ``SUPPORTED_VLLM`` raises ImportError naming the range. The copy half needs no
vLLM: where vLLM is not installed this package imports without the adapter, so that ``kvtier.vllm.copy`` still
does, and any other name of it raises the ModuleNotFoundError for vLLM.
"""

from __future__ import annotations

from importlib import import_module
from importlib.util import find_spec
from typing import Any

if find_spec("vllm") is not None:
    from kvtier.vllm.spec import (
        SUPPORTED_VLLM,
        KvtierManager,
        KvtierSpec,
        KvtierTieringSpec,
        KvtierWorker,
        check_vllm_version,
        resolve_settings,
    )

__all__ = [
    "SUPPORTED_VLLM",
    "KvtierManager",
    "KvtierSpec",
    "KvtierTieringSpec",
    "KvtierWorker",
    "check_vllm_version",
    "resolve_settings",
]


def __getattr__(name: str) -> Any:
    # The spec module's other names (and the Mooncake tier, imported when vLLM's tier factory asks for it); without
    # vLLM, importing the spec module raises the ModuleNotFoundError an import of this package used to.
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module("kvtier.vllm.spec"), name)
