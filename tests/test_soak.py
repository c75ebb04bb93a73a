"""The randomized fault and load driver, on a short budget (KVTIER_SOAK_SECONDS for longer runs)."""

from __future__ import annotations

import os

import pytest

from kvtier.soak import soak


def test_soak_cache_on_equals_cache_off_under_faults(caplog):
    seconds = float(os.environ.get("KVTIER_SOAK_SECONDS", "15"))
    with caplog.at_level("ERROR", logger="kvtier"):
        s = soak(seconds, seed=int(os.environ.get("KVTIER_SOAK_SEED", "0")))
    print(s.line())
    assert s.mismatches == 0
    assert s.rounds >= 3 and s.hits > 0 and s.faults > 0 and s.deferred > 0 and s.evicted > 0 and s.forgets > 0
    assert s.steps_checked > 100
    # Each round's pools are closed; what remains is torch's and the allocator's working set after warm-up.
    assert s.rss_growth_mib < 96, f"host memory grew by {s.rss_growth_mib:.1f} MiB"


@pytest.mark.gpu
def test_soak_on_gpu():
    s = soak(float(os.environ.get("KVTIER_SOAK_SECONDS", "20")), seed=1, device="cuda")
    print(s.line())
    assert s.mismatches == 0 and s.hits > 0 and s.faults > 0


@pytest.mark.mooncake
def test_soak_with_l3_faults_and_a_master_restart(caplog):
    pytest.importorskip("mooncake.store", reason="mooncake is not installed", exc_type=ImportError)
    from kvtier.l3.server import LocalMooncake

    # Its own master: the soak restarts it.
    with LocalMooncake(segment_bytes=256 << 20, lease_ttl_ms=200) as server, caplog.at_level("ERROR", "kvtier"):
        s = soak(float(os.environ.get("KVTIER_SOAK_SECONDS", "15")), seed=4, l3=server)
    print(s.line())
    assert s.mismatches == 0
    assert s.l3_hits > 0 and s.l3_restarts == 1 and s.faults > 0
    # Every short or corrupted value a get returned was rejected (and none served: no mismatch).
    assert s.l3_rejected >= s.l3_tampered, s
