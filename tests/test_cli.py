"""The `kvtier` command: the demo and the index benchmark run and report what they promise."""

from __future__ import annotations

import json

from kvtier.cli import main


def test_demo_json_reports_identical_outputs_and_savings(capsys, tmp_path):
    plot = tmp_path / "ttft.png"
    rc = main(["demo", "--json", "--model", "tiny", "--conversations", "3", "--turns", "3", "--system-tokens", "64",
               "--user-tokens", "24", "--answer-tokens", "4", "--gpu-blocks", "48", "--plot", str(plot)])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["identical"] is True
    for key in ("hit_rate", "prefill_tokens_off", "prefill_tokens_on", "ttft_p50_off_ms", "ttft_p50_on_ms"):
        assert key in out
    assert out["prefill_tokens_on"] < out["prefill_tokens_off"] and out["hit_rate"] > 0.3
    assert plot.stat().st_size > 1000


def test_bench_index_json(capsys):
    rc = main(["bench", "index", "--json", "--conversations", "2", "--turns", "3", "--system-tokens", "256",
               "--turn-tokens", "64", "--repeat", "1"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["tokens"] > 0 and out["hit_tokens"] > 0
    for key in ("rust_lookup_us", "python_lookup_us", "rust_store_us", "python_store_us", "speedup_lookup",
                "speedup_store"):  # fmt: skip
        assert out[key] > 0


def test_unknown_command_is_refused(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
