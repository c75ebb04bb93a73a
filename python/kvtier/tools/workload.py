"""Multi-turn conversation workloads over the reference engine (the demo's, the tests' and the soak's)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from kvtier.tools.engine import Engine


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

    @property
    def max_tokens(self) -> int:
        """The longest sequence: the last turn's prompt and its answer."""
        return self.system_tokens + self.turns * (self.user_tokens + self.answer_tokens)

    def turn_by_turn(self, engine: Engine) -> Iterator[dict[str, list[int]]]:
        """Each ``next()`` runs one more turn to completion and returns its requests' generated tokens by request
        id, so that several engines can take turns."""
        vocab = engine.config.vocab
        rng = np.random.default_rng(self.seed)
        system = rng.integers(0, vocab, size=self.system_tokens).tolist()
        histories = [list(system) for _ in range(self.conversations)]
        for turn in range(self.turns):
            rids = []
            for c in range(self.conversations):
                histories[c] += rng.integers(0, vocab, size=self.user_tokens).tolist()
                rid = f"{self.prefix}c{c}-t{turn}"
                engine.add_request(rid, list(histories[c]), self.answer_tokens)
                rids.append((c, rid))
            engine.run_until_done()
            outputs = {rid: engine.outputs[rid] for _, rid in rids}
            for c, rid in rids:
                histories[c] += outputs[rid]
            yield outputs

    def run(self, engine: Engine, on_turn: Callable[[int], None] | None = None) -> dict[str, list[int]]:
        """Runs every turn to completion; returns each request's generated tokens by request id."""
        outputs: dict[str, list[int]] = {}
        for turn, done in enumerate(self.turn_by_turn(engine)):
            outputs.update(done)
            if on_turn is not None:
                on_turn(turn)
        return outputs
