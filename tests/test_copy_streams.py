"""Copy streams, copy methods and layer-wise loads.

On the GPU: the reference engine's outputs with the cache equal those without it in bfloat16, for both layouts,
with deferrals, for every combination of copy streams, copy method and layer-wise loads, while every copy stream is
held back by a GPU sleep before each load and store, so a missing event (a model reading before its load, a block
rewritten before its store read it) shows as wrong tokens; a control without wait_layer shows that it does. The
copy engine and the kernel give the same bytes, for whole pages and per layer. On the CPU: the same API, with
copies complete on return and every ordering call a no-op.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_engine
from kvtier.copy import CopyEvent, CopyStream, HostPool, PageCopier, dma_supported, host_array, layer_views
from kvtier.deepinfer import Cache
from kvtier.settings import CacheSettings
from kvtier.tools.engine import Engine
from kvtier.tools.workload import Conversations

WORK = Conversations(conversations=4, turns=3, system_tokens=128, user_tokens=24, answer_tokens=6, seed=3)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def engine(layout: str, device: str = "cpu", **kw) -> Engine:
    cfg = dict(num_gpu_blocks=36, layout=layout, layer_pattern="FFS", device=device, num_layers=4)
    cfg.update(kw)
    return tiny_engine(**cfg)


class SlowCopies(Cache):
    """The DeepInfer-shaped adapter with each copy stream held back (GPU sleep) before every load and store."""

    def __init__(self, e: Engine, sleep_cycles: int, **kw) -> None:
        super().__init__(e, size_bytes=8 << 20, num_state_slots=64, preallocate=True, **kw)
        e.cache = self
        self.sleep_cycles = sleep_cycles
        self._streams = [torch.cuda.ExternalStream(h) for h in self.cache.core.streams if h]

    def _hold(self) -> None:
        for s in self._streams:
            with torch.cuda.stream(s):
                torch.cuda._sleep(self.sleep_cycles)

    def try_resume(self, seq, request_id, prompt_ids):  # type: ignore[no-untyped-def]
        self._hold()
        return super().try_resume(seq, request_id, prompt_ids)

    def on_prefill_step(self, scheduled, finished):  # type: ignore[no-untyped-def]
        self._hold()
        super().on_prefill_step(scheduled, finished)


class NoLayerWaits(SlowCopies):
    """A broken engine integration: layer-wise loads, but the model never waits for them."""

    wait_layer = None  # type: ignore[assignment]


COMBOS = [
    # copy_streams, copy_method, layerwise_loads
    (False, "kernel", False),
    (True, "kernel", False),
    (True, "dma", False),
    (True, "auto", False),
    (True, "kernel", True),
    (True, "dma", True),
    (True, "auto", True),
]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("layout", ["page-first", "layer-first"])
@pytest.mark.parametrize("streams,method,layerwise", COMBOS)
def test_outputs_identical_with_held_back_copies(layout: str, streams: bool, method: str, layerwise: bool) -> None:
    kw = dict(device="cuda", dtype="bfloat16")
    off = WORK.run(engine(layout, **kw))
    e = engine(layout, **kw)
    cache = SlowCopies(e, 2_000_000, copy_streams=streams, copy_method=method, layerwise_loads=layerwise)
    assert WORK.run(e) == off
    s = cache.stats_dict()
    assert s["hits"] > 0 and s["errors"] == 0 and s["deferred"] > 0, s
    assert cache.cache.core.num_layers == e.page_layers > 1  # both layouts load a layer at a time
    cache.close()
    cache.cache.index.check()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("layout", ["page-first", "layer-first"])
def test_without_wait_layer_the_model_reads_too_early(layout: str) -> None:
    """The control: the held-back loads do reach the model late, so the tests above can fail."""
    kw = dict(device="cuda", dtype="bfloat16")
    off = WORK.run(engine(layout, **kw))
    e = engine(layout, **kw)
    cache = NoLayerWaits(e, 50_000_000, layerwise_loads=True)
    assert WORK.run(e) != off
    assert cache.stats_dict()["hits"] > 0
    cache.close()


def _pools(
    layers: int,
    segment: int,
    blocks: int,
    slots: int,
    seed: int,
    views: bool = False,
    one: bool = False,
    pin_method: str = "auto",
) -> tuple[list[torch.Tensor], HostPool]:
    """Random layer tensors and a pinned host pool of their pages, pinned in steps of 1 MiB (2 MiB, the driver's
    granularity, with ``pin_method="driver"``); ``views``: the layer parts of one page-first tensor (``layer_views``)
    instead of separate tensors; ``one``: the layers of one layer-first tensor."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if one:
        pool = list(torch.randint(0, 256, (layers, blocks, segment), dtype=torch.uint8, device="cuda", generator=gen))
    elif views:
        pages = torch.randint(0, 256, (blocks, layers * segment), dtype=torch.uint8, device="cuda", generator=gen)
        pool = layer_views(pages, layers)
    else:
        pool = [
            torch.randint(0, 256, (blocks, segment), dtype=torch.uint8, device="cuda", generator=gen)
            for _ in range(layers)
        ]
    host = HostPool(slots, segment * layers, step_bytes=1 << 20, pin_method=pin_method)
    assert host.pinning == ("register" if pin_method == "register" else "driver")
    host.grow_to(slots)
    return pool, host


def _page(pool, block: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    return torch.cat([t[block] for t in pool]).cpu().numpy()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    "layers,segment,alloc",
    [(1, 256 << 10, ""), (1, 48 << 10, ""), (1, 4096, ""), (5, 64 << 10, ""), (3, 272, "")]
    + [(4, 32 << 10, "views"), (61, 272, "views")]  # the layer parts of a page-first pool
    + [(32, 256 << 10, "one"), (5, 64 << 10, "one"), (3, 272, "one")],  # evenly spaced layers: 2D copies
)
@pytest.mark.parametrize("method", ["dma", "kernel", "auto"])
@pytest.mark.parametrize("pin_method", ["driver", "register"])
def test_methods_exact_whole_and_per_layer(layers: int, segment: int, alloc: str, method: str, pin_method: str) -> None:
    rng = np.random.default_rng(layers + segment)
    num_blocks, slots, n = 48, 40, 24
    pool, host = _pools(
        layers,
        segment,
        num_blocks,
        slots,
        seed=layers,
        views=alloc == "views",
        one=alloc == "one",
        pin_method=pin_method,
    )
    copier = PageCopier(pool[0] if layers == 1 else pool, host, method=method)
    if alloc:
        assert copier.layer_runs == [(0, layers)]
    stream = CopyStream(torch.cuda.current_device())
    hv = host_array(host)
    hv[:] = 0xA5
    # Consecutive ids (contiguous runs for the copy engine) and scattered ones.
    gids = np.concatenate([np.arange(4, 12), rng.choice(np.arange(12, num_blocks), n - 8, replace=False)]).astype(
        np.int32
    )
    hslots = np.concatenate([np.arange(0, 8), rng.choice(np.arange(8, slots), n - 8, replace=False)]).astype(np.int32)
    torch.cuda.synchronize()
    used = copier.to_host(gids, hslots, stream.handle)
    # auto: the copy engine when the mean piece (a run of pages contiguous on both sides) reaches the crossover.
    runs = 1 + int(((np.diff(gids) != 1) | (np.diff(hslots) != 1)).sum()) if layers == 1 else n * layers
    large = n * segment * layers >= copier.crossover_bytes * runs
    dma = dma_supported() and (method == "dma" or (method == "auto" and large))
    assert used == ("dma" if dma else "kernel")
    done = CopyEvent(torch.cuda.current_device())
    done.record(stream.handle)
    done.synchronize()
    for g, s in zip(gids, hslots, strict=False):
        assert np.array_equal(hv[s], _page(pool, int(g)))
    written = np.zeros(slots, bool)
    written[hslots] = True
    assert (hv[~written] == 0xA5).all()
    # Back, one layer at a time, into poisoned blocks from fresh host bytes.
    hv[:] = rng.integers(0, 256, hv.shape, dtype=np.uint8)
    for t in pool:
        t.fill_(0x3C)
    torch.cuda.synchronize()
    for layer in range(layers):
        copier.to_gpu(hslots, gids, stream.handle, layers=(layer, layer + 1))
    done.record(stream.handle)
    done.wait_in(torch.cuda.current_stream().cuda_stream)  # GPU-side: the reads below are ordered after it
    for g, s in zip(gids, hslots, strict=False):
        assert np.array_equal(_page(pool, int(g)), hv[s])
    rest = torch.from_numpy(np.setdiff1d(np.arange(num_blocks), gids)).cuda()
    assert all((t[rest] == 0x3C).all() for t in pool)
    host.close()


def _round_trip_by_dma(pool: list[torch.Tensor], pages: list[int], pin_method: str = "auto") -> PageCopier:
    """Copies ``pages`` (block i to slot i) of ``pool`` to a pinned host pool and back into poisoned blocks by the copy
    engine, checking the bytes both ways."""
    segment = pool[0].shape[1]
    host = HostPool(len(pages), segment * len(pool), step_bytes=1 << 20, pin_method=pin_method)
    host.grow_to(len(pages))
    copier = PageCopier(pool, host, method="dma")
    stream = CopyStream(torch.cuda.current_device())
    ids = np.array(pages, dtype=np.int32)
    slots = np.arange(len(pages), dtype=np.int32)
    done = CopyEvent(torch.cuda.current_device())
    torch.cuda.synchronize()
    assert copier.to_host(ids, slots, stream.handle) == "dma"
    done.record(stream.handle)
    done.synchronize()
    hv = host_array(host)
    for g, s in zip(ids, slots, strict=True):
        assert np.array_equal(hv[s], _page(pool, int(g)))
    expect = [_page(pool, int(g)) for g in ids]
    for t in pool:
        t[torch.from_numpy(ids).cuda()] = 0x3C
    torch.cuda.synchronize()
    assert copier.to_gpu(slots, ids, stream.handle) == "dma"
    done.record(stream.handle)
    done.synchronize()
    for g, e in zip(ids, expect, strict=True):
        assert np.array_equal(_page(pool, int(g)), e)
    host.close()
    return copier


@pytest.mark.gpu
@cuda
def test_2d_copies_with_layers_over_2_gib_apart() -> None:
    """Layers of one tensor 2.5 GiB apart (an engine's pool of large layers): the 2D copy's pitch exceeds 2^31."""
    layers, blocks, segment = 3, 10240, 256 << 10  # 2.5 GiB a layer
    big = torch.empty((layers, blocks, segment), dtype=torch.uint8, device="cuda")
    pool = list(big)
    for t in pool:
        t[[0, 5, blocks - 1]] = torch.randint(0, 256, (3, segment), dtype=torch.uint8, device="cuda")
    copier = _round_trip_by_dma(pool, [0, 5, blocks - 1])
    assert copier.layer_runs == [(0, layers)]
    del big, pool


@pytest.mark.gpu
@cuda
def test_2d_copies_across_separate_allocations() -> None:
    """Layer tensors allocated one by one (as vLLM does), each its own CUDA allocation: evenly spaced or not, no 2D
    copy spans two of them (CUDA refuses it), and the bytes are exact."""
    layers, blocks, segment = 6, 64, 1 << 20  # 64 MiB a layer
    torch.cuda.empty_cache()  # no cached segment to carve the layers from: a cudaMalloc each
    pool = [torch.randint(0, 256, (blocks, segment), dtype=torch.uint8, device="cuda") for _ in range(layers)]
    _round_trip_by_dma(pool, [1, 7, 63])  # a 2D copy across two allocations would raise "invalid argument"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("pin_method", ["driver", "register"])
def test_2d_copies_of_runs_of_blocks_in_separate_allocations(pin_method: str) -> None:
    """Layer tensors allocated one by one, pages in runs of consecutive blocks and slots: each layer's segments of a
    run go as one 2D copy (a block stride apart on the GPU, a host page apart on the host), and the bytes are exact
    both ways. Registered in 1 MiB pin steps, the rows are cut where they reach into the next step (CUDA refuses a
    copy across two registrations); the driver's memory is one range, and its rows cross its 2 MiB steps uncut."""
    layers, blocks, segment = 5, 64, 192 << 10  # host pages of 960 KiB: rows cross the pin steps at odd places
    torch.cuda.empty_cache()
    pool = [torch.randint(0, 256, (blocks, segment), dtype=torch.uint8, device="cuda") for _ in range(layers)]
    # Three runs of 10, 6 and 5 pages: 15 2D copies, cheaper than 105 pieces (a 2D copy counts as four).
    _round_trip_by_dma(pool, [*range(3, 13), *range(20, 26), *range(40, 45)], pin_method)


@pytest.mark.gpu
@cuda
def test_auto_chooses_by_piece_size_and_never_dma_on_the_legacy_stream() -> None:
    pool, host = _pools(1, 64 << 10, 64, 64, seed=1)
    copier = PageCopier(pool[0], host, method="auto", crossover_bytes=256 << 10)
    copy_stream = CopyStream(torch.cuda.current_device())  # owns the handle: kept for the whole test
    stream = copy_stream.handle
    run = np.arange(0, 16, dtype=np.int32)  # one contiguous run of 1 MiB
    scattered = np.arange(0, 32, 2, dtype=np.int32)  # 64 KiB pieces
    expect_dma = "dma" if copier.dma_available else "kernel"
    assert copier.to_host(run, run, stream) == expect_dma
    assert copier.to_host(scattered, scattered + 1, stream) == "kernel"
    assert PageCopier(pool[0], host, method="dma").to_host(run, run, 0) == "kernel"  # legacy default stream
    torch.cuda.synchronize()
    host.close()


@pytest.mark.gpu
@cuda
def test_stores_and_loads_take_their_own_method_and_bytes_are_exact() -> None:
    """store_method / store_ctas apart from method / ctas: stores by the copy engine, loads by the kernel (and the
    other way round), the bytes exact both ways."""
    pool, host = _pools(1, 64 << 10, 64, 64, seed=3)
    stream = CopyStream(torch.cuda.current_device())
    ids = np.arange(0, 32, 2, dtype=np.int32)
    slots = np.arange(16, dtype=np.int32)
    hv = host_array(host)
    for store, load in (("dma", "kernel"), ("kernel", "dma")):
        copier = PageCopier(pool[0], host, method=load, ctas=8, store_method=store, store_ctas=1)
        assert (copier.store_method, copier.store_ctas, copier.method, copier.ctas) == (store, 1, load, 8)
        expect = pool[0][torch.from_numpy(ids).cuda()].cpu().numpy()
        assert copier.to_host(ids, slots, stream.handle) == (store if copier.dma_available else "kernel")
        torch.cuda.synchronize()
        assert np.array_equal(hv[slots], expect)
        pool[0][torch.from_numpy(ids).cuda()] = 0x3C
        torch.cuda.synchronize()
        assert copier.to_gpu(slots, ids, stream.handle) == (load if copier.dma_available else "kernel")
        torch.cuda.synchronize()
        assert np.array_equal(pool[0][torch.from_numpy(ids).cuda()].cpu().numpy(), expect)
    host.close()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("layers,alloc", [(1, ""), (4, "one"), (4, "")])  # 1D runs; 2D page rows; 2D block rows
def test_copy_engine_copies_bounded_by_piece_bytes_are_exact(layers: int, alloc: str) -> None:
    """Runs of consecutive blocks and slots the copy engine would take as one copy, cut into copies of at most
    piece_bytes (a segment and a half here: never a whole run, never a cut segment); the bytes exact both ways."""
    segment = 64 << 10
    pool, host = _pools(layers, segment, 64, 48, seed=5, one=alloc == "one")
    copier = PageCopier(pool[0] if layers == 1 else pool, host, method="dma", piece_bytes=segment * 3 // 2)
    assert copier.piece_bytes == segment * 3 // 2
    stream = CopyStream(torch.cuda.current_device())
    ids = np.concatenate([np.arange(8, 20), np.arange(30, 36)]).astype(np.int32)
    slots = np.concatenate([np.arange(0, 12), np.arange(20, 26)]).astype(np.int32)
    hv = host_array(host)
    hv[:] = 0xA5
    expect = [_page(pool, int(g)) for g in ids]
    torch.cuda.synchronize()
    assert copier.to_host(ids, slots, stream.handle) == ("dma" if copier.dma_available else "kernel")
    torch.cuda.synchronize()
    for s, want in zip(slots, expect, strict=True):
        assert np.array_equal(hv[s], want)
    for t in pool:
        t.fill_(0x3C)
    torch.cuda.synchronize()
    copier.to_gpu(slots, ids, stream.handle)
    torch.cuda.synchronize()
    for g, want in zip(ids, expect, strict=True):
        assert np.array_equal(_page(pool, int(g)), want)
    host.close()


@pytest.mark.gpu
@cuda
def test_store_does_not_hold_the_engine_stream_and_release_orders_reuse() -> None:
    """The engine's stream is free while a store's copy is held back; release() makes it wait (GPU-side)."""
    e = engine("page-first", device="cuda", layer_pattern="F", num_gpu_blocks=64)
    cache = Cache(e, size_bytes=8 << 20, preallocate=True)
    d2h = torch.cuda.ExternalStream(cache.cache.core.streams[0])
    prompt = list(range(1, 97))
    blocks = list(range(10, 16))
    with torch.cuda.stream(d2h):
        torch.cuda._sleep(200_000_000)  # ~100 ms
    cache.cache.store("r", prompt, blocks)
    mark = torch.cuda.Event()
    mark.record()
    torch.cuda.current_stream().synchronize()  # the engine's stream finishes at once: it does not wait for the store
    assert mark.query() and cache.stats_dict()["copies_in_flight"] == 1
    cache.release([11])
    mark.record()
    assert not mark.query()  # now the engine's stream waits for the store
    mark.synchronize()
    cache.poll()
    assert cache.stats_dict()["copies_in_flight"] == 0
    cache.close()


def test_cpu_path_same_api() -> None:
    e = engine("layer-first")
    cache = Cache(e, size_bytes=8 << 20, num_state_slots=64, preallocate=True, layerwise_loads=True)
    e.cache = cache
    off = WORK.run(engine("layer-first"))
    assert WORK.run(e) == off
    core = cache.cache.core
    assert not core.copy_streams and not core.layerwise_loads and core.streams == (0, 0)
    cache.wait_layer(0)
    cache.release([1, 2])
    with pytest.raises(ValueError, match="block id 36 is outside the GPU pool of 36 blocks"):
        cache.cache.release([3, 36])
    for bad in ([1.5], [True], ["3"], np.array([2**32 + 3])):  # checked as store's table is: no conversion
        with pytest.raises((TypeError, ValueError)):
            cache.cache.release(bad)
    cache.cache.wait_loads()
    assert cache.stats_dict()["copies_in_flight"] == 0 and cache.stats_dict()["hits"] > 0
    cache.close()


def test_copy_settings() -> None:
    env = {
        "KVTIER_COPY_METHOD": "dma",
        "KVTIER_COPY_STREAMS": "0",
        "KVTIER_LAYERWISE_LOADS": "1",
        "KVTIER_COPY_CROSSOVER_BYTES": "1MiB",
    }
    s = CacheSettings.resolve(env)
    assert (s.copy_method, s.copy_streams, s.layerwise_loads, s.copy_crossover_bytes) == ("dma", False, True, 1 << 20)
    d = CacheSettings.resolve({})
    defaults = (d.copy_method, d.copy_streams, d.layerwise_loads, d.copy_crossover_bytes)
    assert defaults == ("auto", True, False, 64 << 10)
    with pytest.raises(ValueError, match="copy_method: must be one of 'auto', 'kernel', 'dma', got 'fast'"):
        CacheSettings.resolve({}, copy_method="fast")
    with pytest.raises(ValueError, match="KVTIER_COPY_STREAMS"):
        CacheSettings.resolve({"KVTIER_COPY_STREAMS": "maybe"})
