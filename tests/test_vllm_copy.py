"""The copy half of kvtier's vLLM worker (kvtier.vllm.copy.ChunkCopier), without vLLM: KV tensors in vLLM 0.33's
layouts (a layer's K and V halves of [2, num_blocks, block_size, kv_heads, head_dim], one tensor a layer with the
blocks first, MLA's [num_blocks, block_size, 576]) round-trip exactly through the host slots of the chunks a
manager chose, on CPU tensors and (marked gpu) on CUDA tensors through kvtier's copy streams."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtier.vllm.copy import ChunkCopier, byte_rows  # noqa: E402


def split_kv_layers(layers: int, blocks: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    """Each layer a [2, blocks, 16, 8, 128] bf16 tensor, given as its K and V halves (blocks first)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(layers):
        t = torch.randn(2, blocks, 16, 8, 128, generator=g, device=device).to(torch.bfloat16)
        out += [t[0], t[1]]
    return out


def blocks_first_layers(layers: int, blocks: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(blocks, 2, 16, 2, 64, generator=g, device=device).to(torch.float16) for _ in range(layers)]


def mla_layers(layers: int, blocks: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(blocks, 16, 576, generator=g, device=device).to(torch.bfloat16) for _ in range(layers)]


def snapshot(tensors: list[torch.Tensor], blocks: list[int]) -> list[torch.Tensor]:
    return [t[blocks].clone() for t in tensors]


def round_trip(device: str, tensors: list[torch.Tensor], bpc: int = 1, groups: int = 1) -> ChunkCopier:
    """Stores blocks of every group into the chunks a manager would pick, wipes the KV, loads them into other
    blocks (the first block of group 0 in the middle of its chunk when bpc > 1) and checks every byte."""
    num_blocks = tensors[0].shape[0]
    members = list(range(len(tensors)))
    copier = ChunkCopier(tensors, [members] * groups, num_chunks=16, blocks_per_chunk=bpc)
    n = 3 * bpc if bpc > 1 else 5
    skip = 1 if bpc > 1 else 0
    src = [list(range(7 + 23 * g, 7 + 23 * g + n)) for g in range(groups)]
    dst = [list(range(num_blocks - 1 - 23 * g, num_blocks - 1 - 23 * g - n, -1)) for g in range(groups)]
    sizes, firsts = [n] * groups, [skip] + [0] * (groups - 1)
    # Chunks of each group: ceil((n + first % bpc) / bpc), in a manager's scattered order.
    chunks = [15 - c for c in range(sum(-(-(n + f) // bpc) for f in firsts))]
    expected = [snapshot(tensors, s) for s in src]
    flat = lambda ids: [b for g in ids for b in g]  # noqa: E731
    copier.submit(1, True, flat(src), sizes, firsts, chunks)
    copier.wait([1])
    [(job, ok, nbytes, seconds)] = copier.finished()
    assert (job, ok, nbytes) == (1, True, n * groups * sum(byte_rows(t, "t").shape[1] for t in tensors))
    assert seconds is not None and seconds >= 0  # how long the copies took (timing events on CUDA)
    for t in tensors:
        t.zero_()
    copier.submit(2, False, flat(dst), sizes, firsts, chunks, lane="expedited")
    copier.wait([2])
    assert [job for job, ok, *_ in copier.finished() if ok] == [2]
    for g in range(groups):
        for t, want in zip(tensors, expected[g], strict=True):
            assert torch.equal(t[dst[g]], want), f"group {g}: loaded bytes differ"
    untouched = [b for b in range(num_blocks) if b not in set(flat(dst))]
    assert all(not t[untouched].any() for t in tensors), "a block outside the load was written"
    return copier


@pytest.mark.parametrize("layout", [split_kv_layers, blocks_first_layers, mla_layers])
@pytest.mark.parametrize(("bpc", "groups"), [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_round_trip_on_cpu_tensors(layout, bpc: int, groups: int) -> None:
    round_trip("cpu", layout(3, 96, "cpu"), bpc=bpc, groups=groups).close()


def test_byte_rows_views_each_block_in_place() -> None:
    t = torch.arange(2 * 4 * 32, dtype=torch.int16).reshape(2, 4, 32)
    k = byte_rows(t[1], "k")
    assert k.shape == (4, 64) and k.data_ptr() == t[1].data_ptr()
    assert bytes(k[2].numpy()) == t[1, 2].numpy().tobytes()
    with pytest.raises(ValueError, match="contiguous blocks"):
        byte_rows(t.transpose(1, 2)[0], "kt")
    with pytest.raises(TypeError, match="torch.Tensor"):
        byte_rows(np.zeros((4, 16)), "np")


def test_the_worker_says_how_its_host_pool_is_pinned_and_copied(caplog: pytest.LogCaptureFixture) -> None:
    tensors = blocks_first_layers(2, 16, "cpu")
    with caplog.at_level(logging.INFO, logger="kvtier.vllm"):
        copier = ChunkCopier(tensors, [[0, 1]], num_chunks=4, copy_options={"method": "kernel", "store_method": "dma"})
    page = 2 * tensors[0][0].numel() * tensors[0].element_size()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvtier.vllm"]
    assert (
        f"a host pool of 4 pages of {page} bytes (2 KV tensors of {page // 2} bytes a block) on cpu, pinned: none in "
        in line
    )
    assert line.endswith("loads by kernel, stores by dma")
    copier.close()


def test_bad_numbers_are_refused_naming_them() -> None:
    tensors = blocks_first_layers(2, 16, "cpu")
    with pytest.raises(ValueError, match="num_chunks must be a positive int, got 0"):
        ChunkCopier(tensors, [[0, 1]], num_chunks=0)
    with pytest.raises(ValueError, match="group 0 refers to tensor 5"):
        ChunkCopier(tensors, [[0, 5]], num_chunks=4)
    copier = ChunkCopier(tensors, [[0, 1]], num_chunks=4)
    with pytest.raises(ValueError, match="lane must be one of"):
        copier.submit(1, True, [1], [1], [0], [0], lane="fast")
    with pytest.raises(ValueError, match=r"chunk ids \[4\] of group 0 are outside 0..3"):
        copier.submit(1, True, [1], [1], [0], [4])
    assert copier.finished() == []
    copier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [split_kv_layers, blocks_first_layers, mla_layers])
@pytest.mark.parametrize(("bpc", "groups"), [(1, 1), (2, 1), (4, 2)])
def test_round_trip_on_cuda_through_kvtiers_copy_streams(layout, bpc: int, groups: int) -> None:
    tensors = layout(4, 256, "cuda")
    copier = round_trip("cuda", tensors, bpc=bpc, groups=groups)
    assert copier.host_pools[0].pinned
    copier.close()


@pytest.mark.gpu
def test_cuda_copies_start_after_the_callers_stream_writes() -> None:
    # The model writes the KV on its stream; a store submitted right after must see the write.
    tensors = blocks_first_layers(2, 64, "cuda")
    copier = ChunkCopier(tensors, [[0, 1]], num_chunks=8)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the write lands late
        for t in tensors:
            t[3].fill_(7)
        copier.submit(1, True, [3], [1], [0], [5])
    copier.wait([1])
    assert copier.finished()[0][1]
    page = copier.host_view()[5]
    assert (page.view(np.float16) == 7).all()
    copier.close()


@pytest.mark.gpu
def test_a_load_completes_while_a_store_waits_for_the_engines_stream() -> None:
    # Each lane completes on its own: a load is reported as soon as its copies are done, whatever runs on the store
    # lane (a store held back behind the engine's work here).
    tensors = blocks_first_layers(2, 64, "cuda")
    copier = ChunkCopier(tensors, [[0, 1]], num_chunks=8)
    copier.submit(1, True, [2], [1], [0], [1])
    copier.wait([1])
    assert [job for job, ok, *_ in copier.finished() if ok] == [1]
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(400_000_000)  # the engine's work the store waits for (a fraction of a second)
        copier.submit(2, True, [3], [1], [0], [2])
    copier.submit(3, False, [5], [1], [0], [1])  # on the idle current stream
    done: list[int] = []
    while 3 not in done:
        done += [job for job, ok, *_ in copier.finished() if ok]
    assert 2 not in done, "the load was reported only after the store"
    copier.wait([2])
    done += [job for job, ok, *_ in copier.finished() if ok]
    assert sorted(done) == [2, 3]
    torch.cuda.synchronize()
    assert all(torch.equal(t[5], t[2]) for t in tensors)
    copier.close()


@pytest.mark.skipif(find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_only_the_copy_half_of_the_package_imports() -> None:
    import kvtier.vllm

    with pytest.raises(ModuleNotFoundError, match="vllm"):
        kvtier.vllm.KvtierSpec  # noqa: B018


def test_the_adapter_names_the_supported_range_under_another_vllm(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text('__version__ = "0.10.0"\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    r = subprocess.run([sys.executable, "-c", "import kvtier.vllm"], env=env, capture_output=True, text=True)
    assert r.returncode == 1
    assert "ImportError: kvtier.vllm supports vLLM >=0.25.1,<0.35" in r.stderr and "'0.10.0'" in r.stderr, r.stderr
