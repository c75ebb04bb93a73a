"""The engine loop: admission (through the prefix cache when one is plugged in), chunked prefill, greedy decode.

How a prefix cache is wired (the DeepInfer engine shape):
- Admission: for each waiting request, while the running set has room, `cache.try_resume(seq, request_id,
  prompt_ids)`. r > 0: the cache allocated the sequence through `scheduler.try_allocate_seq`, filled the K/V
  pages of its first r tokens and its state, and prefill starts at r. r == 0: a miss; the engine allocates.
  r == -1: retry later; the request keeps its place at the head of the queue and admission stops for this step.
- After a step's GPU work is enqueued: `cache.on_prefill_step(scheduled, finished)`, with the sequences that ran
  prefill chunks and those that finished this step (called on every step that has either). Finished sequences
  still own their blocks during the call.
- Every step: `cache.poll()`. Before a finished sequence's blocks are freed: `cache.release(block_table)` (when
  the cache has it); after: `cache.forget(request_id)`.
- Layer-wise loads (when the cache has `wait_layer`): before a full-attention layer writes or reads its K/V, the
  model calls `cache.wait_layer(l)` (l: the layer's index in the paged pool).

Block reuse never waits on the host for the cache's GPU->host copies: on CUDA the cache copies on its own stream,
and `release`/`forget` make the engine's stream wait (GPU-side) for the pending copies of those blocks, so every
kernel that writes a later owner's K/V runs after them; on the CPU the cache copies synchronously inside
on_prefill_step.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Protocol

import torch

from .config import CacheConfig, EngineConfig
from .model import Model
from .pools import PagedKV, RingStates
from .scheduler import Scheduler
from .sequence import RequestStats, Sequence


class PrefixCache(Protocol):
    """What the engine calls; `release(blocks)` and `wait_layer(l)` are optional."""

    def try_resume(self, seq: Sequence, request_id: str, prompt_ids: list[int]) -> int: ...
    def on_prefill_step(self, scheduled: list[Sequence], finished: list[Sequence]) -> None: ...
    def poll(self) -> None: ...
    def forget(self, request_id: str) -> None: ...


class Engine:
    """A paged-KV decoder serving requests with chunked prefill and greedy decode.

    Exposed to a prefix cache: cache_config, scheduler, gpu_blocks (page-first) or gpu_layers (layer-first),
    gpu_states / state_bytes / ring_slack (None / 0 / ring_slack without sliding layers), select_state and
    load_state.

    A cache is built from the engine's pools, so it may be attached after construction: `engine.cache = cache`.
    Timing is honest on CUDA: every emitted token is read back to the host, which waits for the GPU.
    """

    def __init__(self, config: EngineConfig, cache: PrefixCache | None = None) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.cache_config = CacheConfig(
            block_size=config.block_size,
            num_gpu_blocks=config.num_gpu_blocks,
            layout=config.layout,
            page_bytes=config.page_bytes,
            block_bytes_per_layer=config.block_bytes_per_layer,
            num_state_rings=config.num_state_rings if config.num_sliding_layers else 0,
            state_bytes=config.state_bytes,
        )
        self.layout = config.layout
        self.page_bytes = config.page_bytes
        self.block_bytes_per_layer = config.block_bytes_per_layer
        self.num_full_layers = config.num_full_layers
        self.page_layers = config.num_full_layers  # a page holds these layers' K/V, in layer order (both layouts)
        self.num_sliding_layers = config.num_sliding_layers
        self.window = config.window
        self.ring_slack = config.ring_slack
        self.state_bytes = config.state_bytes
        self.model = Model(config, self.device)
        self.pages = PagedKV(config, self.device)
        self.gpu_blocks = self.pages.gpu_blocks
        self.gpu_layers = self.pages.gpu_layers
        self.rings = RingStates(config, self.device) if config.num_sliding_layers else None
        self.gpu_states = self.rings.gpu_states if self.rings is not None else None
        self.scheduler = Scheduler(config)
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.outputs: dict[str, list[int]] = {}
        self.stats: dict[str, RequestStats] = {}
        self.num_steps = 0
        self.total_prefill_tokens_computed = 0
        self.total_cached_tokens = 0
        self.total_decode_tokens = 0
        self._block_ids: dict[str, torch.Tensor] = {}

    @property
    def fingerprint(self) -> str:
        """Hash of what decides page and state bytes (model config, weights seed, layout, dtype)."""
        return self.config.fingerprint()

    # Requests

    def add_request(self, request_id: str, prompt_ids: list[int], max_new_tokens: int) -> Sequence:
        """Queue a request. ValueError for a bad argument, RuntimeError if it could never fit in the pool."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.stats:
            raise ValueError(f"request_id {request_id!r} was already added")
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.config.vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: token id {bad[0]!r} outside [0, {self.config.vocab})")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        seq = Sequence(request_id, prompt_ids, max_new_tokens)
        self.scheduler.check_fits(seq)
        self.stats[request_id] = RequestStats(request_id, len(prompt_ids), time.perf_counter())
        self.waiting.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts: dict[str, list[int]], max_new_tokens: int) -> dict[str, list[int]]:
        """Queue every prompt, run to completion, and return {request_id: generated token ids}."""
        for request_id, prompt_ids in prompts.items():
            self.add_request(request_id, prompt_ids, max_new_tokens)
        self.run_until_done()
        return {request_id: self.outputs[request_id] for request_id in prompts}

    def run_until_done(self, max_steps: int | None = None) -> dict[str, list[int]]:
        """Step until no request is left; return the outputs of the requests that finished meanwhile."""
        done_before = set(self.outputs)
        steps = 0
        while self.has_unfinished():
            if max_steps is not None and steps >= max_steps:
                raise RuntimeError(
                    f"requests still unfinished after {max_steps} steps: "
                    f"{len(self.waiting)} waiting, {len(self.running)} running"
                )
            self.step()
            steps += 1
        return {rid: out for rid, out in self.outputs.items() if rid not in done_before}

    # The loop

    def step(self) -> None:
        """One iteration: poll the cache, admit, run one prefill chunk or one decode token per running
        sequence, report to the cache, and free finished sequences."""
        if self.cache is not None:
            self.cache.poll()
        self._admit()
        scheduled: list[Sequence] = []
        finished: list[Sequence] = []
        for seq in self.running:
            if seq.chunked_rest_len > 0:
                scheduled.append(seq)
                self._prefill_chunk(seq)
            else:
                self._decode(seq)
            if seq.is_finished:
                finished.append(seq)
        if self.cache is not None and (scheduled or finished):
            self.cache.on_prefill_step(scheduled, finished)
        for seq in finished:
            self._finish(seq)
        self.num_steps += 1

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_batch:
            seq = self.waiting[0]
            stats = self.stats[seq.request_id]
            if stats.first_attempt_time is None:
                stats.first_attempt_time = time.perf_counter()
            hit = 0
            if self.cache is not None:
                hit = self.cache.try_resume(seq, seq.request_id, seq.prompt_ids)
                if hit == -1:
                    stats.deferrals += 1
                    return
                self._check_hit(seq, hit)
            if hit == 0 and not self.scheduler.try_allocate_seq(seq):
                return
            self.waiting.popleft()
            seq.num_computed_tokens = seq.num_cached_tokens = hit
            seq.chunked_rest_len = len(seq.prompt_ids) - hit
            stats.cached_tokens = hit
            self.total_cached_tokens += hit
            self._block_ids[seq.request_id] = torch.tensor(seq.block_table, dtype=torch.long, device=self.device)
            self.running.append(seq)

    def _check_hit(self, seq: Sequence, hit: int) -> None:
        n = len(seq.prompt_ids)
        if not isinstance(hit, int) or hit < -1 or hit >= n or hit % self.config.block_size:
            raise RuntimeError(
                f"cache.try_resume returned {hit!r} for request {seq.request_id!r} "
                f"(prompt of {n} tokens): expected -1, 0, or a block boundary below {n}"
            )
        if hit > 0 and not seq.is_allocated:
            raise RuntimeError(
                f"cache.try_resume returned {hit} for request {seq.request_id!r} without allocating the sequence"
            )

    def _forward(self, seq: Sequence, token_ids: list[int], start: int) -> torch.Tensor:
        wait_layer = getattr(self.cache, "wait_layer", None) if self.cache is not None else None
        return self.model.forward(
            token_ids,
            start,
            self.pages,
            seq.block_table,
            self._block_ids[seq.request_id],
            self.rings,
            seq.state_id,
            wait_layer=wait_layer,
        )

    def _prefill_chunk(self, seq: Sequence) -> None:
        """Prefill up to chunk_size prompt tokens from the resume point, one block-aligned span at a time."""
        bs = self.config.block_size
        start = seq.num_computed_tokens
        end = min(len(seq.prompt_ids), start + self.config.chunk_size)
        logits = None
        for span_start in range(start, end, bs):
            span_end = min(end, (span_start // bs + 1) * bs)
            logits = self._forward(seq, seq.prompt_ids[span_start:span_end], span_start)
        seq.num_computed_tokens = end
        seq.chunked_rest_len = len(seq.prompt_ids) - end
        self.stats[seq.request_id].prefill_tokens_computed += end - start
        self.total_prefill_tokens_computed += end - start
        if seq.chunked_rest_len == 0:
            assert logits is not None
            self._emit(seq, logits)

    def _decode(self, seq: Sequence) -> None:
        pos = seq.get_len() - 1
        logits = self._forward(seq, [seq.output_ids[-1]], pos)
        seq.num_computed_tokens = pos + 1
        self.total_decode_tokens += 1
        self._emit(seq, logits)

    def _emit(self, seq: Sequence, logits: torch.Tensor) -> None:
        seq.append_output(int(logits.argmax()))  # .item() waits for the GPU: the token is really there
        stats = self.stats[seq.request_id]
        if stats.first_token_time is None:
            stats.first_token_time = time.perf_counter()

    def _finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        release = getattr(self.cache, "release", None) if self.cache is not None else None
        if release is not None:
            release(seq.block_table)
        self.scheduler.free_seq(seq)
        del self._block_ids[seq.request_id]
        self.outputs[seq.request_id] = list(seq.output_ids)
        self.stats[seq.request_id].finish_time = time.perf_counter()
        if self.cache is not None:
            self.cache.forget(seq.request_id)

    # State kernels (called by a prefix cache)

    def _state_ring(self, seq: Sequence) -> int:
        if self.rings is None:
            raise RuntimeError("this model has no sliding-window layers, so no state")
        if seq.state_id is None:
            raise ValueError(f"sequence {seq.request_id!r} has no state ring (not allocated)")
        return seq.state_id

    def select_state(self, seq: Sequence, pos: int, staging: torch.Tensor) -> None:
        """Copy the window of positions [pos - window, pos) of every sliding layer from the sequence's rings into
        staging (uint8, state_bytes, on the engine's device), in position order, as
        [num_sliding_layers, 2 (K, V), window, heads, head_dim]; positions below 0 are zeros. The window must
        still be in the ring: num_computed_tokens - ring_slack <= pos <= num_computed_tokens."""
        slot = self._state_ring(seq)
        done = seq.num_computed_tokens
        if not isinstance(pos, int) or not max(0, done - self.ring_slack) <= pos <= done:
            raise ValueError(
                f"select_state at pos {pos!r} for {seq.request_id!r}: the ring holds windows ending "
                f"in [{max(0, done - self.ring_slack)}, {done}]"
            )
        self.rings.select(slot, pos, staging)  # type: ignore[union-attr]

    def load_state(self, seq: Sequence, pos: int, staging: torch.Tensor) -> None:
        """Write a staged window (as select_state makes it) into the sequence's rings, so that the sequence
        resumes at pos exactly as if it had computed positions [0, pos)."""
        slot = self._state_ring(seq)
        if not isinstance(pos, int) or not 0 <= pos < len(seq.prompt_ids):
            raise ValueError(f"load_state at pos {pos!r} for {seq.request_id!r}: must be in [0, {len(seq.prompt_ids)})")
        self.rings.load(slot, pos, staging)  # type: ignore[union-attr]
