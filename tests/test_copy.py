"""Page copies with a CPU "GPU" pool (the memcpy path): exact bytes, poisoned destinations, both layouts and
directions, states, host pool growth, and every bad argument rejected before anything is copied."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtier import BadArgument, KvtierError  # noqa: E402
from kvtier.copy import CompletionQueue, HostPool, PageCopier, host_array, layer_views  # noqa: E402

POISON = 0xA5


def make_pool(layers: int, segment: int, num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (num_blocks, segment), dtype=torch.uint8, generator=gen) for _ in range(layers)]


def make_host(slots: int, slot_bytes: int) -> HostPool:
    host = HostPool(slots, slot_bytes, step_bytes=1 << 16, pin=False)
    host.grow_to(slots)
    return host


def page(pool: list[torch.Tensor], block: int) -> np.ndarray:
    return torch.cat([t[block] for t in pool]).numpy()


@pytest.mark.parametrize("layers,segment", [(1, 16), (1, 4096), (1, 1 << 20), (61, 272), (5, 2048)])
@pytest.mark.parametrize("seed", range(3))
def test_random_batches_exact_and_poison_kept(layers: int, segment: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_blocks, slots = 40, 30
    pool = make_pool(layers, segment, num_blocks, seed)
    host = make_host(slots, layers * segment)
    copier = PageCopier(pool[0] if layers == 1 else pool, host)
    hv = host_array(host)
    hv[:] = POISON
    before = [t.clone() for t in pool]
    n = int(rng.integers(1, 25))
    gids = rng.choice(num_blocks, n, replace=False).astype(np.int32)
    hslots = rng.choice(slots, n, replace=False).astype(np.int32)
    copier.to_host(gids, hslots)
    for g, s in zip(gids, hslots, strict=False):
        assert np.array_equal(hv[s], page(before, int(g)))
    untouched = np.setdiff1d(np.arange(slots), hslots)
    assert (hv[untouched] == POISON).all()
    assert all(torch.equal(a, b) for a, b in zip(pool, before, strict=False))  # the source is only read

    hv[:] = rng.integers(0, 256, hv.shape, dtype=np.uint8)
    for t in pool:
        t.fill_(POISON)
    dst = rng.choice(num_blocks, n, replace=False).astype(np.int32)
    src = rng.integers(0, slots, n).astype(np.int32)  # a host slot may be read twice
    copier.to_gpu(src, dst)
    for s, g in zip(src, dst, strict=False):
        assert np.array_equal(page(pool, int(g)), hv[s])
    rest = np.setdiff1d(np.arange(num_blocks), dst)
    assert all(bool((t[torch.from_numpy(rest)] == POISON).all()) for t in pool)


@pytest.mark.parametrize("layers,segment", [(4, 64), (61, 272), (2, 16)])
def test_layer_views_copy_a_page_first_pool_a_layer_at_a_time(layers: int, segment: int) -> None:
    """A page-first pool seen as one strided view a layer copies the same host page, whole or a layer at a time."""
    num_blocks, slots = 12, 10
    pool = make_pool(1, layers * segment, num_blocks, seed=layers)[0]
    host = make_host(slots, layers * segment)
    views = layer_views(pool, layers)
    assert [tuple(v.shape) for v in views] == [(num_blocks, segment)] * layers
    parts = PageCopier(views, host)
    assert parts.num_layers == layers and parts.page_bytes == layers * segment
    hv = host_array(host)
    gids, hslots = np.array([7, 2, 9], np.int32), np.array([0, 5, 3], np.int32)
    parts.to_host(gids, hslots)
    assert all(np.array_equal(hv[s], pool[g].numpy()) for g, s in zip(gids, hslots, strict=True))
    hv[:] = np.random.default_rng(0).integers(0, 256, hv.shape, dtype=np.uint8)
    pool.fill_(POISON)
    for layer in range(layers - 1):  # all but the last layer: its part of each block keeps the poison
        parts.to_gpu(hslots, gids, layers=(layer, layer + 1))
    cut = (layers - 1) * segment
    for g, s in zip(gids, hslots, strict=True):
        assert np.array_equal(pool[g, :cut].numpy(), hv[s, :cut]) and (pool[g, cut:] == POISON).all()
    assert (pool[[0, 1, 3]] == POISON).all()


@pytest.mark.parametrize(
    "page_layers,match",
    [(0, "positive int, got 0"), (True, "positive int, got True"), (3, "into 3 layer parts"), (8, "into 8 layer")],
)
def test_layer_views_rejects_parts_that_do_not_split_the_page(page_layers: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        layer_views(torch.zeros(4, 64, dtype=torch.uint8), page_layers)


def test_large_batch_spreads_over_threads() -> None:
    pool = make_pool(1, 64 << 10, 600, seed=1)
    host = make_host(512, 64 << 10)
    copier = PageCopier(pool[0], host)
    ids = np.random.default_rng(1).permutation(600)[:512].astype(np.int32)
    copier.to_host(ids, np.arange(512, dtype=np.int32))
    assert np.array_equal(host_array(host), pool[0].numpy()[ids])


def test_states_are_page_first_slots() -> None:
    state_bytes = 3 * 4096 + 48
    states = make_pool(1, state_bytes, 6, seed=2)[0]
    host = make_host(4, state_bytes)
    copier = PageCopier(states, host)
    copier.to_host([5, 2], [0, 3])
    assert host.read(3) == states[2].numpy().tobytes()
    staged = states.clone()
    states.fill_(POISON)
    copier.to_gpu(np.array([3, 0], np.int32), torch.tensor([1, 4], dtype=torch.int32))
    assert torch.equal(states[1], staged[2]) and torch.equal(states[4], staged[5])
    assert bool((states[[0, 2, 3, 5]] == POISON).all())


def test_host_pool_grows_in_pin_steps() -> None:
    host = HostPool(100, 1000 * 16, step_bytes=64 << 10, pin=False)
    assert (host.slots, host.slot_bytes, host.usable_slots, host.pinned) == (100, 16000, 0, False)
    assert host.base_ptr % 4096 == 0 and host.step_bytes == 64 << 10
    first = host.grow_step()
    assert first == host.usable_slots == (64 << 10) // 16000
    host.write(first - 1, b"\x07" * 16)
    assert host.read(first - 1)[:17] == b"\x07" * 16 + b"\x00"
    with pytest.raises(KvtierError, match=f"slot {first} is not below usable_slots = {first}"):
        host.read(first)  # not pinned yet: the pool's state, kvtier's own
    with pytest.raises(BadArgument, match="slot 100 is outside the host pool of 100 slots"):
        host.read(100)
    assert host.grow_to(100) == 100
    assert host.grow_step() == 100
    assert host.backed_bytes >= 100 * 16000
    assert host_array(host).shape == (100, 16000)
    host.close()
    host.close()
    with pytest.raises(KvtierError, match="closed"):
        host.grow_step()


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((0, 16), ValueError, "slots must be > 0"),
        ((4, 24), ValueError, "slot_bytes must be a positive multiple of 16, got 24"),
        ((4, -16), ValueError, "slot_bytes must be >= 0"),
    ],
)
def test_host_pool_rejects_bad_sizes(args: tuple[int, int], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        HostPool(*args, pin=False)


def test_host_pool_rejects_an_unknown_pin_method() -> None:
    with pytest.raises(ValueError, match="pin_method must be one of 'auto', 'driver', 'register', got 'mlock'"):
        HostPool(4, 16, pin=False, pin_method="mlock")


def test_pin_needs_a_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        HostPool(4, 16, pin=True)
    pool = HostPool(4, 16, pin_method="driver")  # nothing to pin: the method does not matter
    assert (pool.pinned, pool.pinning) == (False, "none")


@pytest.fixture
def setup():  # type: ignore[no-untyped-def]
    pool = make_pool(3, 64, 10, seed=4)
    host = make_host(8, 3 * 64)
    hv = host_array(host)
    hv[:] = POISON
    return pool, host, PageCopier(pool, host)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda c: c.to_host([0, 1], [0]), ValueError, "differ in length: 2 and 1"),
        (lambda c: c.to_host([10], [0]), ValueError, r"gpu_ids\[0\] = 10 is outside the GPU pool of 10 blocks"),
        (lambda c: c.to_host([1, -1], [0, 1]), ValueError, r"gpu_ids\[1\] = -1"),
        (lambda c: c.to_host([1], [8]), BadArgument, r"host_slots\[0\] = 8 is outside the host pool of 8 slots"),
        (lambda c: c.to_host([1, 2, 3], [4, 5, 4]), ValueError, "host_slots names destination 4 twice"),
        (lambda c: c.to_gpu([1, 2], [3, 3]), ValueError, "gpu_ids names destination 3 twice"),
        (lambda c: c.to_host(np.array([1], np.int64), [0]), TypeError, "int32"),
        (lambda c: c.to_host([2**31], [0]), ValueError, "does not fit in int32"),
        (lambda c: c.to_host("ab", [0]), TypeError, "int32 ids"),
        (lambda c: c.to_host([True], [0]), TypeError, r"gpu_ids\[0\] must be an int, got True"),
        (lambda c: c.to_host([1.0], [0]), TypeError, r"gpu_ids\[0\] must be an int"),
        (lambda c: c.to_host({1}, [0]), TypeError, "sequence of ints, got set"),
        (lambda c: c.to_host(np.array([[1]], np.int32), [0]), TypeError, "1-D"),
    ],
)
def test_bad_ids_rejected_before_any_copy(setup, call, exc, match) -> None:  # type: ignore[no-untyped-def]
    pool, host, copier = setup
    before = [t.clone() for t in pool]
    with pytest.raises(exc, match=match):
        call(copier)
    assert (host_array(host) == POISON).all()
    assert all(torch.equal(a, b) for a, b in zip(pool, before, strict=False))


def test_duplicate_sources_are_allowed(setup) -> None:  # type: ignore[no-untyped-def]
    pool, host, copier = setup
    copier.to_host([2, 2], [0, 1])
    assert host.read(0) == host.read(1) == page(pool, 2).tobytes()


@pytest.mark.parametrize(
    "build,exc,match",
    [
        (lambda: (torch.zeros(4, 64, dtype=torch.float16), 128), TypeError, "dtype torch.uint8"),
        (lambda: (torch.zeros(4, 64, 2, dtype=torch.uint8), 128), ValueError, "2-D"),
        (lambda: (torch.zeros(64, 8, dtype=torch.uint8).t(), 64), ValueError, "contiguous"),
        (
            lambda: ([torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(5, 64, dtype=torch.uint8)], 128),
            ValueError,
            r"gpu_pool\[1\] has shape \(5, 64\)",
        ),
        (lambda: (torch.zeros(4, 40, dtype=torch.uint8), 48), ValueError, "multiple of 16, got 40"),
        (lambda: (torch.zeros(4, 72, dtype=torch.uint8)[:, :64], 64), ValueError, "block stride 72 must be a multiple"),
        (lambda: (torch.zeros(4 * 64 + 1, dtype=torch.uint8)[1:].view(4, 64), 64), ValueError, "not 16-byte aligned"),
        (
            lambda: (torch.zeros(4, 64, dtype=torch.uint8), 128),
            ValueError,
            "slot_bytes = 128 differs from the page size 64",
        ),
        (lambda: ([], 64), ValueError, "empty list"),
        (lambda: ([np.zeros((4, 64), np.uint8)], 64), TypeError, "torch.Tensor"),
    ],
)
def test_bad_pools_rejected(build, exc, match) -> None:  # type: ignore[no-untyped-def]
    pool, slot_bytes = build()
    host = make_host(2, slot_bytes)
    with pytest.raises(exc, match=match):
        PageCopier(pool, host)


def test_bad_grid_rejected() -> None:
    pool = make_pool(1, 64, 4, seed=0)[0]
    host = make_host(2, 64)
    with pytest.raises(ValueError, match="threads must be a multiple of 32"):
        PageCopier(pool, host, threads=100)
    with pytest.raises(ValueError, match="ctas must be 1 to 65535, got 0"):
        PageCopier(pool, host, ctas=0)
    with pytest.raises(ValueError, match="method must be one of"):
        PageCopier(pool, host, method="fast")
    with pytest.raises(ValueError, match="store_ctas must be 1 to 65535, got 0"):
        PageCopier(pool, host, store_ctas=0)
    with pytest.raises(ValueError, match="store_method must be one of .*'fast'"):
        PageCopier(pool, host, store_method="fast")
    with pytest.raises(ValueError, match="piece_bytes must be at least 1"):
        PageCopier(pool, host, piece_bytes=0)
    with pytest.raises(ValueError, match="piece_bytes must be >= 0, got -1"):
        PageCopier(pool, host, piece_bytes=-1)


def test_stores_take_the_loads_grid_and_method_unless_set_apart() -> None:
    pool = make_pool(1, 64, 4, seed=0)[0]
    host = make_host(2, 64)
    same = PageCopier(pool, host, ctas=3, method="kernel")
    assert (same.store_ctas, same.store_method) == (3, "kernel")
    apart = PageCopier(pool, host, ctas=3, method="kernel", store_ctas=1, store_method="dma")
    assert (apart.ctas, apart.method, apart.store_ctas, apart.store_method) == (3, "kernel", 1, "dma")
    # The copy engine's copies are unbounded unless piece_bytes bounds them.
    assert same.piece_bytes is None and PageCopier(pool, host, piece_bytes=2 << 20).piece_bytes == 2 << 20


def test_cpu_completion_queue_completes_at_once() -> None:
    pool = make_pool(1, 64, 4, seed=0)[0]
    copier = PageCopier(pool, make_host(2, 64))
    q = copier.completion_queue()
    assert isinstance(q, CompletionQueue)
    for ticket in (7, 3, 9):
        q.record(ticket)
    assert q.pending() == 3
    assert q.poll() == [7, 3, 9]
    assert q.pending() == 0 and q.poll() == [] and q.wait_all() == []
    with pytest.raises(ValueError, match="ticket must be >= 0"):
        q.record(-1)


def test_the_core_copier_takes_layer_tensors_not_addresses_and_holds_their_memory():
    from kvtier import _core

    host = make_host(4, 64)
    with pytest.raises(TypeError, match="__dlpack__"):
        _core.PageCopier([0x7F0000000000], host)
    with pytest.raises(TypeError, match="uint8"):
        _core.PageCopier([torch.zeros(4, 16, dtype=torch.float32)], host)
    with pytest.raises(ValueError, match="2-D"):
        _core.PageCopier([torch.zeros(64, dtype=torch.uint8)], host)
    with pytest.raises(ValueError, match="contiguous rows"):
        _core.PageCopier([torch.zeros(64, 4, dtype=torch.uint8).t()], host)
    with pytest.raises(ValueError, match="shape"):
        _core.PageCopier([torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(5, 64, dtype=torch.uint8)], host)
    [pool] = make_pool(1, 64, 4, seed=7)
    want = pool[2].numpy().tobytes()
    copier = _core.PageCopier([pool], host)
    del pool  # the copier holds the tensor's memory
    assert copier.to_host(np.array([2], np.int32), np.array([1], np.int32)) == "memcpy"
    assert host.read(1) == want
    with pytest.raises(ValueError, match="outside the GPU pool of 4 blocks"):
        copier.to_host(np.array([4], np.int32), np.array([0], np.int32))
