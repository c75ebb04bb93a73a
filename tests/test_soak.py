"""The randomized fault and load driver, a seeded number of rounds (KVTIER_SOAK_ROUNDS for longer runs): what it
checks does not depend on how fast the machine is."""

from __future__ import annotations

import os

import pytest

from conftest import needs_mooncake
from kvtier.tools.soak import soak


def rounds(default: int) -> int:
    return int(os.environ.get("KVTIER_SOAK_ROUNDS", str(default)))


def test_soak_cache_on_equals_cache_off_under_faults(caplog):
    with caplog.at_level("ERROR", logger="kvtier"):
        s = soak(None, seed=int(os.environ.get("KVTIER_SOAK_SEED", "0")), max_rounds=rounds(30))
    print(s.line())
    assert s.mismatches == 0
    assert s.rounds == rounds(30) and s.hits > 0 and s.faults > 0 and s.deferred > 0 and s.evicted > 0
    assert s.forgets > 0 and s.steps_checked > 100
    # Each round's pools are closed; what remains is torch's and the allocator's working set after warm-up.
    assert s.rss_within_bound, f"host memory grew by {s.rss_growth_mib:.1f} MiB, over {s.rss_bound_mib} MiB"
    assert s.passed


@pytest.mark.gpu
def test_soak_on_gpu():
    s = soak(None, seed=1, device="cuda", max_rounds=rounds(30))
    print(s.line())
    assert s.mismatches == 0 and s.hits > 0 and s.faults > 0


@pytest.mark.mooncake
def test_soak_with_l3_faults_and_a_master_restart(caplog, timed):
    needs_mooncake()
    from kvtier.tools.mooncake import LocalMooncake

    # Its own master: the soak restarts it.
    with LocalMooncake(segment_bytes=256 << 20, lease_ttl_ms=200) as server, caplog.at_level("ERROR", "kvtier"):
        s = soak(None, seed=4, l3=server, max_rounds=rounds(12))
    print(s.line())
    assert s.mismatches == 0
    assert s.l3_restarts == 1 and s.faults > 0
    # Every short or corrupted value a get returned was rejected (and none served: no mismatch).
    assert s.l3_rejected >= s.l3_tampered, s
    if timed:
        # Whether a fetch beats its deadline (5, 50 or 500 ms, drawn per round) depends on the machine's load.
        assert s.l3_hits > 0, s
