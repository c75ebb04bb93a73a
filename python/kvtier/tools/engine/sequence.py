"""A request as the engine tracks it, with the fields a prefix cache reads and writes."""

from __future__ import annotations

from dataclasses import dataclass, field


class SequenceData:
    """Token ids of a sequence: the prompt followed by the generated tokens."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self._token_ids = list(prompt_ids)

    def get_token_ids(self) -> list[int]:
        return self._token_ids

    def append_token_id(self, token_id: int) -> None:
        self._token_ids.append(token_id)


@dataclass
class RequestStats:
    """Timing and work of one request; times are time.perf_counter() seconds."""

    request_id: str
    prompt_tokens: int
    arrival_time: float
    first_attempt_time: float | None = None  # first time the engine tried to admit it
    first_token_time: float | None = None
    finish_time: float | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefill_tokens_computed: int = 0
    deferrals: int = 0  # times the cache answered "retry later"

    @property
    def ttft(self) -> float | None:
        """Seconds from the first admission attempt to the first generated token."""
        if self.first_attempt_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_attempt_time


@dataclass
class Sequence:
    """One request. block_table and state_id are set by the scheduler's allocation.

    num_computed_tokens counts positions whose K/V are in the pools (the resume point of the next forward);
    chunked_rest_len counts prompt tokens still to prefill and is 0 once the last prompt chunk ran.
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    data: SequenceData = field(init=False)
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    state_id: int | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    cached_hit_tokens: int = 0
    chunked_rest_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_ids = list(self.prompt_ids)
        self.data = SequenceData(self.prompt_ids)
        self.chunked_rest_len = len(self.prompt_ids)

    def get_len(self) -> int:
        """Tokens so far: prompt plus generated."""
        return len(self.data.get_token_ids())

    @property
    def is_allocated(self) -> bool:
        return bool(self.block_table)

    @property
    def is_finished(self) -> bool:
        return len(self.output_ids) >= self.max_new_tokens

    @property
    def max_tokens(self) -> int:
        """Positions whose K/V can ever be written: the prompt and every generated token but the last."""
        return len(self.prompt_ids) + self.max_new_tokens - 1

    def append_output(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.data.append_token_id(token_id)
