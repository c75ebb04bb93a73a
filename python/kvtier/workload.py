"""Multi-turn conversation workloads over the reference engine (the demo's, the tests' and the soak's)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtier.engine import Engine


@dataclass(frozen=True)
class Conversations:
    """Conversations that share one system prompt; each turn's prompt is the whole history so far (earlier
    prompts, the engine's own answers, a new user message). Turn t of every conversation is submitted together,
    so conversations interleave in the engine."""

    conversations: int = 4
    turns: int = 4
    system_tokens: int = 256
    user_tokens: int = 48
    answer_tokens: int = 8
    seed: int = 0
    prefix: str = ""  # request ids are ``<prefix>c<C>-t<T>``: distinct prefixes let one engine run several

    def run(self, engine: Engine, on_turn: Callable[[int], None] | None = None) -> dict[str, list[int]]:
        """Runs every turn to completion; returns each request's generated tokens by request id."""
        vocab = engine.config.vocab
        rng = np.random.default_rng(self.seed)
        system = rng.integers(0, vocab, size=self.system_tokens).tolist()
        histories = [list(system) for _ in range(self.conversations)]
        outputs: dict[str, list[int]] = {}
        for turn in range(self.turns):
            rids = []
            for c in range(self.conversations):
                histories[c] += rng.integers(0, vocab, size=self.user_tokens).tolist()
                rid = f"{self.prefix}c{c}-t{turn}"
                engine.add_request(rid, list(histories[c]), self.answer_tokens)
                rids.append((c, rid))
            engine.run_until_done()
            for c, rid in rids:
                outputs[rid] = engine.outputs[rid]
                histories[c] += outputs[rid]
            if on_turn is not None:
                on_turn(turn)
        return outputs
