"""Shared pytest set-up: hypothesis profiles and the gpu marker's skip."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# Quick by default; CI sets KVTIER_HYPOTHESIS_PROFILE=ci for more examples and longer runs.
settings.register_profile("quick", max_examples=40, stateful_step_count=30, deadline=None)
settings.register_profile(
    "ci", max_examples=300, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("KVTIER_HYPOTHESIS_PROFILE", "quick"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
