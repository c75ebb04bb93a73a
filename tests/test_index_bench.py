"""`kvtier bench index`: the figures it promises, both cases, and its option checks."""

from __future__ import annotations

import json

import pytest

from kvtier.tools.cli import main

KEYS = (
    "tokens",
    "rust_lookup_us",
    "python_lookup_us",
    "rust_store_us",
    "python_store_us",
    "speedup_lookup",
    "speedup_store",
    "hash_gbps_blake3",
    "hash_gbps_xxh3",
    "first_lookup_us",
    "rust_lookup_list_us",
    "rust_store_list_us",
)


def test_the_long_prompt_case_reports_every_figure(capsys):
    assert main(["bench", "index", "--json", "--tokens", "4096", "--repeat", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in KEYS:
        assert out[key] > 0, key
    assert out["tokens"] == 4096 and out["block_size"] == 64
    assert out["hit_tokens"] == 4096 - 64, "every page but the last (keep_tokens) is a hit"


def test_the_trace_case_stays_available(capsys):
    assert (
        main(
            [
                "bench",
                "index",
                "--trace",
                "--json",
                "--conversations",
                "2",
                "--turns",
                "3",
                "--system-tokens",
                "256",
                "--turn-tokens",
                "64",
                "--repeat",
                "1",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["ops"] == 6 and out["hit_tokens"] > 0 and out["speedup_lookup"] > 0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--tokens", "0"], "--tokens: must be >= 1, got 0"),
        (["--repeat", "-2"], "--repeat: must be >= 1, got -2"),
        (["--block-size", "x"], "--block-size: not an integer: 'x'"),
        (["--tokens", "100"], "--tokens must be > 2 x --block-size (128)"),
    ],
)
def test_bad_numbers_are_one_line_and_exit_2(capsys, args, says):
    with pytest.raises(SystemExit) as e:
        main(["bench", "index", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and says in err, err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "index", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "(default: 131072)" in out and "(default: 64, --trace: 16)" in out
