"""`kvtier bench trace`: the replay's rules, its output, the synthetic shapes, and the shipped trace's LRU figures."""

from __future__ import annotations

import json

import pytest

import kvtier
from kvtier.tools.bench.trace import SHIPPED_TRACE, Request, block_size_of, replay, synthetic
from kvtier.tools.cli import main
from kvtier.tools.pyindex import PyIndex


def run_json(argv: list[str], capsys) -> dict:  # type: ignore[no-untyped-def]
    assert main(["bench", "trace", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_written_synthetic_trace_replays_the_same_from_its_file(capsys, tmp_path):
    path, png = tmp_path / "agents.jsonl", tmp_path / "hits.png"
    argv = ["--pools", "20k,100k", "--requests", "300"]
    generated = run_json(["--synthetic", "agents", *argv, "--write", str(path)], capsys)
    replayed = run_json([str(path), "--pools", "20k,100k", "--plot", str(png)], capsys)
    assert generated["results"] == replayed["results"] and replayed["block_size"] == 512
    rows = replayed["results"]
    assert [(r["policy"], r["pool_tokens"]) for r in rows] == [("unbounded", None)] + [
        (p, t) for p in kvtier.EVICTION_POLICIES for t in (20_000, 100_000)
    ]
    assert rows[0]["pages_evicted"] == 0
    assert all(0 <= r["token_hit_rate"] <= rows[0]["token_hit_rate"] for r in rows)
    assert all(r["pages_evicted"] > 0 for r in rows[1:3]), "the small pools evict"
    assert png.stat().st_size > 1000
    assert main(["bench", "trace", str(path), "--pools", "20k"]) == 0
    table = capsys.readouterr().out
    assert "unbounded pool" in table and "adaptive" in table and "vs lru" in table


@pytest.mark.parametrize("shape", ["agents", "recency", "scans"])
def test_the_lru_replay_follows_the_plain_model(shape):
    """The replay's rules (a hit capped at floor((n - 1) / bs) blocks and loaded, every full block stored), on
    the plain-Python index: the same hit tokens as the Rust index's replay."""
    trace = synthetic(shape, 150, seed=4, block_size=16)
    got = replay(trace, 16, [800], ["lru", "adaptive"])["results"]
    for policy, row in zip(["lru", "adaptive"], got[1:], strict=True):
        model = PyIndex(kvtier.IndexConfig(50, block_size=16, min_hit_tokens=0, eviction_policy=policy))
        hit = total = 0
        for i, r in enumerate(trace):
            tokens = [(h * 16 + j) for h in r.hash_ids for j in range(16)][: r.tokens]
            h = model.lookup(str(i), tokens)[0]
            if h:
                model.complete(model.begin_load(str(i), h)[0])
            model.complete(model.plan_store(str(i), tokens)[0])
            model.forget(str(i))
            hit, total = hit + h, total + len(tokens)
        assert row["token_hit_rate"] == hit / total, policy


def test_the_block_size_is_the_traces():
    assert block_size_of([Request(1000, [1, 2]), Request(512, [3])]) == 512
    assert block_size_of([Request(33, [1, 2]), Request(16, [3])]) == 17
    with pytest.raises(ValueError, match="not a Mooncake-format trace"):
        block_size_of([Request(100, [1, 2]), Request(100, [1, 2, 3, 4, 5])])


@pytest.mark.parametrize(
    "argv, text",
    [
        (
            ["--block-size", "16"],
            "--block-size: 16 does not give the trace's requests their numbers of hash ids (17 to",
        ),
        (["--block-size", "40"], "(17 to 32 tokens a block does)"),
        (["--synthetic", "agents", "--seed", "-1"], "--seed: must be >= 0, got -1"),
    ],
)
def test_a_block_size_the_trace_was_not_made_with_is_refused(tmp_path, capsys, argv, text):
    # Block sizes 17-32 give 33 tokens two hash ids and 16 one: any other would replay other prompts than the trace's.
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_length": 33, "hash_ids": [1, 2]}\n{"input_length": 16, "hash_ids": [3]}\n')
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "trace", *([] if "--synthetic" in argv else [str(path)]), *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and text in err and err.count("\n") == 1, err
    assert main(["bench", "trace", str(path), "--block-size", "32", "--pools", "1k", "--json"]) == 0


def test_a_bad_record_is_named_by_its_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_length": 10, "hash_ids": [0]}\n{"input_length": 5}\n')
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "trace", str(path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "bad.jsonl:2: not a trace record" in err and err.count("\n") == 1


def test_the_shipped_trace_is_the_default_and_gives_its_lru_figures(capsys):
    """Without a trace the benchmark replays the one kvtier ships: the first ten minutes of Mooncake's FAST'25
    conversation trace, with its source, licence and changes beside it (docs/EVICTION.md quotes these figures)."""
    out = run_json(["--policies", "lru"], capsys)
    rows = out["results"]
    assert out["trace"] == SHIPPED_TRACE.name == "conversation_10min.jsonl.gz"
    assert (out["requests"], out["block_size"]) == (1750, 512)
    assert [round(100 * r["token_hit_rate"], 1) for r in rows] == [28.9, 4.7, 14.6, 27.3, 28.9]
    notice = (SHIPPED_TRACE.parent / "README.md").read_text()
    assert "kvcache-ai/Mooncake" in notice and "Apache License 2.0" in notice and "Changed from the original" in notice
