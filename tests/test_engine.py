"""The reference engine: determinism, layouts, chunking, exact resume from a prefix cache, allocation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier.tools.engine import Engine, EngineConfig, Sequence

TINY = EngineConfig.preset("tiny", num_gpu_blocks=32, num_state_rings=4, chunk_size=32)

PREFIX = [(7 * i + 3) % 512 for i in range(48)]
PROMPT_A = PREFIX + [11, 22, 33, 44, 55]
PROMPT_B = PREFIX + [(5 * i + 1) % 512 for i in range(21)]


def read_page(engine: Engine, block_id: int) -> torch.Tensor:
    """All bytes of one page, from either layout, as one contiguous host page."""
    if engine.gpu_blocks is not None:
        return engine.gpu_blocks[block_id].clone()
    return torch.cat([layer[block_id] for layer in engine.gpu_layers])


def write_page(engine: Engine, block_id: int, page: torch.Tensor) -> None:
    if engine.gpu_blocks is not None:
        engine.gpu_blocks[block_id].copy_(page)
        return
    for i, layer in enumerate(engine.gpu_layers):
        layer[block_id].copy_(page[i * engine.block_bytes_per_layer : (i + 1) * engine.block_bytes_per_layer])


class FakeCache:
    """A dict-backed prefix cache with the DeepInfer surface. It stores every full page of a prompt and the
    states at the boundaries still in the ring, resumes from the longest stored prefix that has a state, and
    records the K/V bytes of every sequence at the end of its prefill and when it finishes."""

    def __init__(self, engine: Engine, *, hits: bool = True, defer: dict[str, int] | None = None) -> None:
        self.engine = engine
        self.bs = engine.cache_config.block_size
        self.hits = hits
        self.defer = dict(defer or {})
        self.pages: dict[tuple[int, ...], torch.Tensor] = {}
        self.states: dict[tuple[int, ...], torch.Tensor] = {}
        self.prefill_snapshots: dict[str, dict[str, object]] = {}
        self.final_pages: dict[str, list[torch.Tensor]] = {}
        self.calls: list[str] = []
        engine.cache = self

    def _staging(self) -> torch.Tensor:
        return torch.empty(self.engine.state_bytes, dtype=torch.uint8, device=self.engine.device)

    def try_resume(self, seq: Sequence, request_id: str, prompt_ids: list[int]) -> int:
        self.calls.append(f"resume:{request_id}")
        if self.defer.get(request_id, 0) > 0:
            self.defer[request_id] -= 1
            return -1
        if not self.hits:
            return 0
        limit = (len(prompt_ids) - 1) // self.bs * self.bs
        hit = 0
        while hit + self.bs <= limit and tuple(prompt_ids[: hit + self.bs]) in self.pages:
            hit += self.bs
        if self.engine.state_bytes:
            while hit > 0 and tuple(prompt_ids[:hit]) not in self.states:
                hit -= self.bs
        if hit == 0:
            return 0
        if not self.engine.scheduler.try_allocate_seq(seq):
            return -1
        for i in range(hit // self.bs):
            write_page(self.engine, seq.block_table[i], self.pages[tuple(prompt_ids[: (i + 1) * self.bs])])
        if self.engine.state_bytes:
            self.engine.load_state(seq, hit, self.states[tuple(prompt_ids[:hit])])
        seq.num_cached_tokens = seq.cached_hit_tokens = hit
        return hit

    def on_prefill_step(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        self.calls.append("step")
        for seq in scheduled:
            if seq.chunked_rest_len:
                continue
            prompt = seq.prompt_ids
            n = len(prompt)
            pages = [read_page(self.engine, seq.block_table[i]) for i in range(n // self.bs)]
            for i, page in enumerate(pages):
                self.pages.setdefault(tuple(prompt[: (i + 1) * self.bs]), page)
            window = None
            if self.engine.state_bytes:
                first = max(self.bs, -(-(n - self.engine.ring_slack) // self.bs) * self.bs)
                for b in range(first, n + 1, self.bs):
                    staging = self._staging()
                    self.engine.select_state(seq, b, staging)
                    self.states.setdefault(tuple(prompt[:b]), staging)
                window = self._staging()
                self.engine.select_state(seq, n, window)
            self.prefill_snapshots[seq.request_id] = {"pages": pages, "window": window}
        for seq in finished:
            full = seq.num_computed_tokens // self.bs
            self.final_pages[seq.request_id] = [read_page(self.engine, seq.block_table[i]) for i in range(full)]

    def poll(self) -> None:
        self.calls.append("poll")

    def forget(self, request_id: str) -> None:
        self.calls.append(f"forget:{request_id}")


def assert_same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=False):
        assert torch.equal(x, y)


def run_one(config: EngineConfig, prompt: list[int], max_new: int = 6) -> tuple[list[int], FakeCache]:
    """Cache off (a recording cache that never hits): the oracle."""
    engine = Engine(config)
    recorder = FakeCache(engine, hits=False)
    return engine.generate({"r": prompt}, max_new)["r"], recorder


def test_deterministic_for_seed() -> None:
    prompts = {"a": PROMPT_A, "b": PROMPT_B}
    first = Engine(TINY).generate(prompts, 8)
    assert Engine(TINY).generate(prompts, 8) == first
    assert Engine(dataclasses.replace(TINY, seed=1)).generate(prompts, 8) != first
    assert all(len(out) == 8 for out in first.values())


def test_batched_requests_match_running_alone() -> None:
    together = Engine(TINY).generate({"a": PROMPT_A, "b": PROMPT_B}, 6)
    assert together["a"] == run_one(TINY, PROMPT_A)[0]
    assert together["b"] == run_one(TINY, PROMPT_B)[0]


def test_layouts_give_same_tokens_and_bytes() -> None:
    page_first, rec_p = run_one(TINY, PROMPT_B)
    layer_first, rec_l = run_one(dataclasses.replace(TINY, layout="layer-first"), PROMPT_B)
    assert page_first == layer_first
    assert_same_bytes(rec_p.prefill_snapshots["r"]["pages"], rec_l.prefill_snapshots["r"]["pages"])
    assert_same_bytes(rec_p.final_pages["r"], rec_l.final_pages["r"])


def test_layer_first_pools() -> None:
    engine = Engine(dataclasses.replace(TINY, layout="layer-first"))
    assert engine.gpu_blocks is None
    assert len(engine.gpu_layers) == TINY.num_full_layers
    assert engine.page_bytes == sum(t.shape[1] for t in engine.gpu_layers)
    assert all(t.shape == (TINY.num_gpu_blocks, engine.block_bytes_per_layer) for t in engine.gpu_layers)
    page_first = Engine(TINY)
    assert page_first.gpu_layers is None
    assert page_first.gpu_blocks.shape == (TINY.num_gpu_blocks, engine.page_bytes)
    assert page_first.gpu_blocks.is_contiguous() and page_first.gpu_blocks.dtype == torch.uint8
    assert engine.page_bytes % 16 == 0 and engine.state_bytes % 16 == 0


@pytest.mark.parametrize("chunk_size", [16, 48])
def test_chunked_prefill_matches_unchunked(chunk_size: int) -> None:
    whole, rec_whole = run_one(dataclasses.replace(TINY, chunk_size=128), PROMPT_B)
    chunked, rec_chunked = run_one(dataclasses.replace(TINY, chunk_size=chunk_size), PROMPT_B)
    assert chunked == whole
    assert_same_bytes(rec_chunked.prefill_snapshots["r"]["pages"], rec_whole.prefill_snapshots["r"]["pages"])
    assert torch.equal(rec_chunked.prefill_snapshots["r"]["window"], rec_whole.prefill_snapshots["r"]["window"])
    assert_same_bytes(rec_chunked.final_pages["r"], rec_whole.final_pages["r"])


@pytest.mark.parametrize(
    ("layout", "pattern", "prefix_len", "first_max_new"),
    [
        ("page-first", "FS", 48, 4),
        ("layer-first", "FS", 48, 1),
        ("page-first", "SF", 20, 3),
        ("layer-first", "F", 48, 2),
        ("page-first", "FSS", 33, 2),
    ],
)
def test_resume_from_cache_is_exact(layout: str, pattern: str, prefix_len: int, first_max_new: int) -> None:
    config = dataclasses.replace(TINY, layout=layout, layer_pattern=pattern, num_layers=len(pattern) + 1)
    prefix = PREFIX[:prefix_len]
    prompt_a, prompt_b = prefix + [1, 2, 3, 4, 5], prefix + [(5 * i + 1) % 512 for i in range(21)]
    expected, oracle = run_one(config, prompt_b)

    engine = Engine(config)
    cache = FakeCache(engine)
    engine.generate({"a": prompt_a}, first_max_new)
    assert engine.scheduler.blocks.num_free == config.num_gpu_blocks  # a's blocks are gone from the GPU
    assert engine.generate({"b": prompt_b}, 6)["b"] == expected

    hit = prefix_len // 16 * 16
    stats = engine.stats["b"]
    assert stats.cached_tokens == hit > 0
    assert stats.prefill_tokens_computed == len(prompt_b) - hit
    assert engine.stats["a"].prefill_tokens_computed == len(prompt_a)
    assert_same_bytes(cache.prefill_snapshots["b"]["pages"], oracle.prefill_snapshots["r"]["pages"])
    assert_same_bytes(cache.final_pages["b"], oracle.final_pages["r"])
    if engine.state_bytes:
        assert torch.equal(cache.prefill_snapshots["b"]["window"], oracle.prefill_snapshots["r"]["window"])


def test_hook_order() -> None:
    engine = Engine(TINY)
    cache = FakeCache(engine)
    engine.generate({"a": PROMPT_A}, 2)
    # 53 prompt tokens in chunks of 32: two prefill steps (the second emits the first token), then one decode
    # step that finishes the request; the cache sees the finish before the blocks are freed and forgotten.
    assert cache.calls == ["poll", "resume:a", "step", "poll", "step", "poll", "step", "forget:a"]


def test_allocator_exhaustion_makes_requests_wait() -> None:
    # Each request needs 5 blocks (69 prompt + 5 generated tokens); 9 blocks hold only one at a time.
    config = dataclasses.replace(TINY, num_gpu_blocks=9)
    prompts = {f"r{i}": PROMPT_B[i:] + PROMPT_B[:i] for i in range(3)}
    engine = Engine(config)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, 6)
    max_running, waited = 0, False
    while engine.has_unfinished():
        engine.step()
        max_running = max(max_running, len(engine.running))
        waited |= bool(engine.running and engine.waiting)
    assert max_running == 1 and waited
    assert engine.outputs == Engine(TINY).generate(prompts, 6)
    assert engine.scheduler.blocks.num_free == 9


def test_state_slots_run_out_too() -> None:
    config = dataclasses.replace(TINY, num_state_rings=1)
    prompts = {"a": PROMPT_A, "b": PROMPT_B}
    engine = Engine(config)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, 4)
    engine.step()
    assert [s.request_id for s in engine.running] == ["a"] and len(engine.waiting) == 1
    engine.run_until_done()
    assert engine.outputs == Engine(TINY).generate(prompts, 4)


def test_retry_later_defers_the_request() -> None:
    engine = Engine(TINY)
    FakeCache(engine, defer={"b": 2})
    engine.add_request("b", PROMPT_B, 5)
    engine.add_request("a", PROMPT_A, 5)
    engine.step()
    assert not engine.running and len(engine.waiting) == 2  # the head of the queue holds its place
    engine.run_until_done()
    assert engine.stats["b"].deferrals == 2
    assert engine.outputs == Engine(TINY).generate({"a": PROMPT_A, "b": PROMPT_B}, 5)


def test_cache_without_room_answers_retry() -> None:
    config = dataclasses.replace(TINY, num_gpu_blocks=9)
    engine = Engine(config)
    cache = FakeCache(engine)
    engine.generate({"a": PROMPT_A}, 2)
    engine.add_request("b", PROMPT_B, 6)
    engine.add_request("c", PROMPT_B[::-1], 6)
    outputs = engine.run_until_done()
    assert engine.stats["b"].cached_tokens == 48
    assert outputs["b"] == run_one(config, PROMPT_B)[0]
    assert cache.calls.count("resume:c") >= 1


def test_no_sliding_layers() -> None:
    engine = Engine(dataclasses.replace(TINY, layer_pattern="F"))
    assert engine.gpu_states is None and engine.state_bytes == 0
    assert len(engine.generate({"a": PROMPT_A}, 3)["a"]) == 3
    seq = engine.add_request("b", PROMPT_B, 2)
    with pytest.raises(RuntimeError, match="no sliding"):
        engine.select_state(seq, 16, torch.empty(16, dtype=torch.uint8))


def test_state_kernels_validate() -> None:
    engine = Engine(TINY)
    seq = engine.add_request("a", PROMPT_B, 4)
    staging = torch.empty(engine.state_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="no state ring"):
        engine.select_state(seq, 16, staging)
    engine.step()  # prefills 32 tokens
    assert seq.num_computed_tokens == 32
    with pytest.raises(ValueError, match="pos 48"):
        engine.select_state(seq, 48, staging)
    with pytest.raises(ValueError, match="bytes"):
        engine.select_state(seq, 16, staging[:-16])
    with pytest.raises(TypeError, match="uint8"):
        engine.select_state(seq, 16, staging.view(torch.float32))
    engine.select_state(seq, 16, staging)
    # The window [16 - 32, 16) of a 32-token window: the 16 positions below 0 are zeros.
    window = staging.view(torch.float32).view(TINY.num_sliding_layers, 2, TINY.window, -1)
    assert torch.count_nonzero(window[:, :, :16]) == 0
    assert torch.count_nonzero(window[:, :, 16:]) > 0
    with pytest.raises(ValueError, match="load_state at pos 99"):
        engine.load_state(seq, 99, staging)


def test_state_window_leaves_the_ring() -> None:
    config = dataclasses.replace(TINY, ring_slack=16)
    engine = Engine(config)
    seq = engine.add_request("a", PROMPT_B, 2)
    engine.step()
    engine.step()  # 64 prompt tokens computed
    staging = torch.empty(engine.state_bytes, dtype=torch.uint8)
    engine.select_state(seq, 48, staging)
    with pytest.raises(ValueError, match=r"pos 32 .*\[48, 64\]"):
        engine.select_state(seq, 32, staging)


def test_timing_and_counters() -> None:
    engine = Engine(TINY)
    engine.generate({"a": PROMPT_A, "b": PROMPT_B}, 3)
    for rid, prompt in (("a", PROMPT_A), ("b", PROMPT_B)):
        stats = engine.stats[rid]
        assert stats.ttft is not None and stats.ttft > 0
        assert stats.prefill_tokens_computed == len(prompt) and stats.cached_tokens == 0
        assert stats.finish_time >= stats.first_token_time
    assert engine.total_prefill_tokens_computed == len(PROMPT_A) + len(PROMPT_B)
    assert engine.total_decode_tokens == 4


def test_request_that_never_fits() -> None:
    engine = Engine(dataclasses.replace(TINY, num_gpu_blocks=4))
    with pytest.raises(RuntimeError, match="needs 5 GPU blocks"):
        engine.add_request("a", PROMPT_B, 6)
    with pytest.raises(RuntimeError, match="needs 5 GPU blocks"):
        engine.scheduler.try_allocate_seq(Sequence("b", PROMPT_B, 6))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("layout", "row-major"),
        ("dtype", "float64"),
        ("layer_pattern", "FX"),
        ("layer_pattern", "S"),
        ("block_size", 0),
        ("chunk_size", 24),
        ("head_dim", 31),
        ("num_gpu_blocks", -3),
        ("device", "tpu"),
        ("ring_slack", -1),
        ("window", 1.5),
    ],
)
def test_bad_config_names_the_value(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=repr(value).replace("[", r"\[").replace(".", r"\.")):
        dataclasses.replace(TINY, **{field: value})


def test_bad_requests() -> None:
    engine = Engine(TINY)
    with pytest.raises(ValueError, match="600"):
        engine.add_request("a", [1, 600], 2)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request("a", [], 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request("a", [1], 0)
    engine.add_request("a", [1], 1)
    with pytest.raises(ValueError, match="already added"):
        engine.add_request("a", [1], 1)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["page-first", "layer-first"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resume_from_cache_is_exact_on_gpu(layout: str, dtype: str) -> None:
    config = EngineConfig.preset(
        "small", device="cuda", layout=layout, dtype=dtype, num_gpu_blocks=64, num_state_rings=4
    )
    prompt_b = PREFIX * 3 + [9, 8, 7]
    expected, oracle = run_one(config, prompt_b, 8)
    engine = Engine(config)
    cache = FakeCache(engine)
    engine.generate({"a": PREFIX * 3 + [1]}, 2)
    assert engine.generate({"b": prompt_b}, 8)["b"] == expected
    assert engine.stats["b"].cached_tokens == 144
    assert_same_bytes(cache.prefill_snapshots["b"]["pages"], oracle.prefill_snapshots["r"]["pages"])
    assert torch.equal(cache.prefill_snapshots["b"]["window"], oracle.prefill_snapshots["r"]["window"])
    assert_same_bytes(cache.final_pages["b"], oracle.final_pages["r"])


@pytest.mark.gpu
@gpu
def test_gpu_matches_chunking_and_layouts() -> None:
    config = EngineConfig.preset("small", device="cuda", num_gpu_blocks=64)
    prompts = {"a": PROMPT_A, "b": PROMPT_B}
    out = Engine(config).generate(prompts, 8)
    assert Engine(dataclasses.replace(config, chunk_size=16)).generate(prompts, 8) == out
    assert Engine(dataclasses.replace(config, layout="layer-first")).generate(prompts, 8) == out
