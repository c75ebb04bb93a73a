"""Shared pytest set-up: hypothesis profiles, the gpu marker's skip, the `timed` fixture, the Mooncake fixtures and
the tiny reference engine the cache tests drive (`tiny_engine`).

The default run has no assertion on wall time, nor on how much work fits in a time budget, so that it passes on a
loaded machine: a test whose bounds are part of what it checks takes `timed` and asserts them only in the slow run
(`pytest -m slow`).
"""

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


def tiny_engine(**overrides: object):  # type: ignore[no-untyped-def]
    """The tiny reference engine (``EngineConfig.preset("tiny")``) with the small pools the cache tests use, on the
    CPU unless ``overrides`` say otherwise."""
    from kvtier.tools.engine import Engine, EngineConfig

    cfg: dict[str, object] = dict(num_gpu_blocks=64, num_state_rings=4, chunk_size=32, max_batch=3, ring_slack=32)
    cfg.update(overrides)
    return Engine(EngineConfig.preset("tiny", **cfg))


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


@pytest.fixture(params=[False, pytest.param(True, marks=pytest.mark.slow)], ids=["untimed", "timed"])
def timed(request: pytest.FixtureRequest) -> bool:
    """True in the slow run's copy of a test, which also asserts its time bounds; False in the default run's."""
    return bool(request.param)


# ---- Mooncake fixtures (L3 tier) -------------------------------------------------------------------------------
# Self-contained: a real master and holder on free loopback ports, and one Store client, shared per test module.
# Tests that kill or restart the master start their own LocalMooncake instead.

# The read lease a get is granted: a get whose transfer outlasts it fails (LEASE_EXPIRED), which a loaded machine
# makes likely with a lease of a few hundred ms. Every test removes objects by force, so a long lease holds none up.
LEASE_TTL_MS = 10_000


def needs_mooncake() -> None:
    """Skips the test, or the module at its top, where Mooncake is not installed; imports it as kvtier does, so
    that its log goes where the README says."""
    from kvtier.l3.store import import_mooncake

    try:
        import_mooncake()
    except ImportError:
        pytest.skip("mooncake is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def mooncake_server():  # type: ignore[no-untyped-def]
    needs_mooncake()
    from kvtier.tools.mooncake import LocalMooncake

    with LocalMooncake(segment_bytes=256 << 20, lease_ttl_ms=LEASE_TTL_MS) as server:
        yield server


@pytest.fixture(scope="module")
def mooncake_store(mooncake_server):  # type: ignore[no-untyped-def]
    from kvtier.l3.store import MooncakeStore, StoreConfig

    store = MooncakeStore(StoreConfig(mooncake_server.master_addr))
    try:
        yield store
    finally:
        store.close()


# ---- end of Mooncake fixtures ----------------------------------------------------------------------------------
