"""Page copies on a CUDA device: exact bytes with random data and ids on torch's current stream while another
stream writes elsewhere in the pool, both layouts, states, batches larger than one launch, completion polling, host
memory made by the driver in a process that has not used CUDA yet.
Run under compute-sanitizer (memcheck, racecheck) on the GPU machine."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtier import CopyError  # noqa: E402
from kvtier.copy import CompletionQueue, HostPool, PageCopier, host_array  # noqa: E402

pytestmark = pytest.mark.gpu

POISON = 0xA5
OTHER = 0x3C


def make(layers: int, segment: int, num_blocks: int, slots: int, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pool = [
        torch.randint(0, 256, (num_blocks, segment), dtype=torch.uint8, device="cuda", generator=gen)
        for _ in range(layers)
    ]
    host = HostPool(slots, segment * layers, step_bytes=1 << 20)
    assert host.pinned
    host.grow_to(slots)
    return pool, host


def gpu_page(pool, block: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    return torch.cat([t[block] for t in pool]).cpu().numpy()


def split(rng: np.random.Generator, total: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n random ids to copy and the rest (written by another stream meanwhile)."""
    perm = rng.permutation(total).astype(np.int32)
    return perm[:n], perm[n:]


@pytest.mark.parametrize("layers,segment", [(1, 4096), (1, 16 << 10), (61, 272), (7, 1024), (3, 16)])
@pytest.mark.parametrize("ctas", [1, 8, 132])
def test_round_trip_exact_with_concurrent_writer(layers: int, segment: int, ctas: int) -> None:
    rng = np.random.default_rng(layers * 1000 + ctas)
    num_blocks, slots, n = 96, 80, 40
    pool, host = make(layers, segment, num_blocks, slots, seed=ctas)
    copier = PageCopier(pool[0] if layers == 1 else pool, host, ctas=ctas)
    hv = host_array(host)
    hv[:] = POISON
    before = [t.clone() for t in pool]
    gids, others = split(rng, num_blocks, n)
    hslots = rng.choice(slots, n, replace=False).astype(np.int32)
    side = torch.cuda.Stream()
    other_idx = torch.from_numpy(others.astype(np.int64)).cuda()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for t in pool:
            for _ in range(3):
                t.index_fill_(0, other_idx, OTHER)
    copier.to_host(gids, hslots)  # torch's current stream
    torch.cuda.synchronize()
    written = np.zeros(slots, bool)
    written[hslots] = True
    for g, s in zip(gids, hslots, strict=False):
        assert np.array_equal(hv[s], before_page(before, g)), f"slot {s} from block {g}"
    assert (hv[~written] == POISON).all()
    for t, b in zip(pool, before, strict=False):
        idx = torch.from_numpy(gids.astype(np.int64)).cuda()
        assert torch.equal(t[idx], b[idx])
        assert (t[other_idx] == OTHER).all()

    # Back the other way into poisoned blocks, from fresh random host bytes.
    hv[:] = rng.integers(0, 256, hv.shape, dtype=np.uint8)
    for t in pool:
        t.fill_(POISON)
    dst, rest = split(rng, num_blocks, n)
    src = rng.choice(slots, n, replace=False).astype(np.int32)
    rest_idx = torch.from_numpy(rest.astype(np.int64)).cuda()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for t in pool:
            t.index_fill_(0, rest_idx, OTHER)
    copier.to_gpu(src, dst)
    torch.cuda.synchronize()
    for s, g in zip(src, dst, strict=False):
        assert np.array_equal(gpu_page(pool, int(g)), hv[s])
    for t in pool:
        assert (t[rest_idx] == OTHER).all()
    host.close()


def before_page(before, block: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    return gpu_page(before, int(block))


def test_batches_larger_than_one_launch_and_poisoned_gaps() -> None:
    rng = np.random.default_rng(7)
    pool, host = make(1, 32, 20000, 12000, seed=3)
    copier = PageCopier(pool[0], host)
    hv = host_array(host)
    hv[:] = POISON
    gids = rng.choice(20000, 9000, replace=False).astype(np.int32)
    hslots = rng.choice(12000, 9000, replace=False).astype(np.int32)
    copier.to_host(gids, hslots, torch.cuda.current_stream())
    torch.cuda.synchronize()
    ref = pool[0].cpu().numpy()
    assert np.array_equal(hv[hslots], ref[gids])
    mask = np.ones(12000, bool)
    mask[hslots] = False
    assert (hv[mask] == POISON).all()
    host.close()


def test_states_use_the_page_first_path() -> None:
    rng = np.random.default_rng(11)
    state_bytes = 3 * 4096 + 48
    states = torch.randint(0, 256, (6, state_bytes), dtype=torch.uint8, device="cuda")
    host = HostPool(4, state_bytes)
    host.grow_to(4)
    copier = PageCopier(states, host)
    copier.to_host([5, 2], [0, 3])
    staging = states.clone()
    states.fill_(POISON)
    copier.to_gpu([3, 0], [1, 4])
    torch.cuda.synchronize()
    assert torch.equal(states[1], staging[2]) and torch.equal(states[4], staging[5])
    assert (states[[0, 2, 3, 5]] == POISON).all()
    del rng
    host.close()


def test_completion_queue_polls_in_order_without_blocking() -> None:
    pool, host = make(1, 1 << 20, 64, 64, seed=5)
    copier = PageCopier(pool[0], host, ctas=2)
    q = copier.completion_queue()
    assert isinstance(q, CompletionQueue)
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(50_000_000)  # keep the stream busy so the first poll sees nothing complete
    for ticket in range(4):
        ids = np.arange(ticket * 16, ticket * 16 + 16, dtype=np.int32)
        copier.to_host(ids, ids, stream)
        q.record(ticket, stream.cuda_stream)
    assert q.poll() == []
    assert q.pending() == 4
    assert q.wait_all() == [0, 1, 2, 3]
    assert q.pending() == 0 and q.poll() == []
    hv = host_array(host)
    assert np.array_equal(hv, pool[0].cpu().numpy())
    host.close()


def test_debug_sync_and_bad_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_DEBUG_SYNC", "1")
    pool, host = make(2, 64, 8, 8, seed=9)
    copier = PageCopier(pool, host, ctas=3, threads=128)
    copier.to_host([1, 2], [3, 4])  # waits for the stream inside
    assert np.array_equal(host_array(host)[4], gpu_page(pool, 2))
    with pytest.raises(ValueError, match="one device"):
        PageCopier([pool[0], pool[1].cpu()], host)
    unpinned = HostPool(8, 128, pin=False)
    unpinned.grow_to(8)
    with pytest.raises(ValueError, match="not pinned"):
        PageCopier(pool, unpinned)
    with pytest.raises(TypeError, match="on the CPU"):
        copier.to_host(torch.tensor([1], dtype=torch.int32, device="cuda"), [0])
    with pytest.raises(ValueError, match="not a visible CUDA device"):
        CompletionQueue(1000)
    assert issubclass(CopyError, Exception)
    host.close()


@pytest.mark.parametrize("layers,segment", [(1, 16 << 10), (1, 80 << 10), (61, 272), (3, 16), (2, 40 << 10)])
def test_round_trips_across_segment_shapes(layers: int, segment: int) -> None:
    """Exact bytes both ways for segments from one vector to several warp spans, and a batch longer than the
    small-batch launch."""
    rng = np.random.default_rng(layers * 100 + segment)
    num_blocks, slots, n = 300, 280, 200
    pool, host = make(layers, segment, num_blocks, slots, seed=layers)
    copier = PageCopier(pool[0] if layers == 1 else pool, host, ctas=3)
    hv = host_array(host)
    hv[:] = POISON
    gids = rng.choice(num_blocks, n, replace=False).astype(np.int32)
    hslots = rng.choice(slots, n, replace=False).astype(np.int32)
    copier.to_host(gids, hslots)
    torch.cuda.synchronize()
    before = [t.clone() for t in pool]
    for g, s in zip(gids, hslots, strict=False):
        assert np.array_equal(hv[s], gpu_page(before, int(g)))
    written = np.zeros(slots, bool)
    written[hslots] = True
    assert (hv[~written] == POISON).all()
    hv[:] = rng.integers(0, 256, hv.shape, dtype=np.uint8)
    for t in pool:
        t.fill_(POISON)
    dst = rng.choice(num_blocks, n, replace=False).astype(np.int32)
    src = rng.choice(slots, n, replace=False).astype(np.int32)
    copier.to_gpu(src, dst)
    torch.cuda.synchronize()
    for s, g in zip(src, dst, strict=False):
        assert np.array_equal(gpu_page(pool, int(g)), hv[s])
    untouched = np.setdiff1d(np.arange(num_blocks), dst)
    for t in pool:
        assert (t[torch.from_numpy(untouched.astype(np.int64)).cuda()] == POISON).all()
    host.close()


def test_driver_memory_before_anything_else_uses_cuda() -> None:
    """A pool of the driver's memory in a process where nothing has used CUDA yet, grown on another thread (as a
    cache's pinning thread grows it): the CPU reads back what it wrote, across a step boundary."""
    code = """
import threading
from kvtier.copy import HostPool
pool = HostPool(8, 3 << 20, step_bytes=1, pin_method="driver")  # steps of the driver's granularity, 2 MiB
grow = threading.Thread(target=pool.grow_to, args=(8,))
grow.start()
grow.join()
assert (pool.pinning, pool.usable_slots) == ("driver", 8), pool
pool.write(7, bytes(range(256)) * 8192)  # slot 7 spans 21-24 MiB: a step boundary at 22 MiB
assert pool.read(7)[: 2 << 20] == bytes(range(256)) * 8192
pool.close()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (out.returncode, out.stdout.strip()) == (0, "ok"), out.stderr
