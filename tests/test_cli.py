"""The `kvtier` command: the demo and the index benchmark run and report what they promise; every --help works and
shows defaults; bad numbers fail in one line before any work; `kvtier info`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

import kvtier
from kvtier.cli import main
from kvtier.settings import REGISTRY


def test_demo_json_reports_identical_outputs_and_savings(capsys, tmp_path):
    plot = tmp_path / "ttft.png"
    rc = main(
        [
            "demo",
            "--json",
            "--model",
            "tiny",
            "--conversations",
            "3",
            "--turns",
            "3",
            "--system-tokens",
            "64",
            "--user-tokens",
            "24",
            "--answer-tokens",
            "4",
            "--gpu-blocks",
            "48",
            "--plot",
            str(plot),
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["identical"] is True
    for key in ("hit_rate", "prefill_tokens_off", "prefill_tokens_on", "ttft_p50_off_ms", "ttft_p50_on_ms"):
        assert key in out
    assert out["prefill_tokens_on"] < out["prefill_tokens_off"] and out["hit_rate"] > 0.3
    assert plot.stat().st_size > 1000


def test_unknown_command_is_refused(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


SUBCOMMANDS = [
    ["demo"],
    ["soak"],
    ["info"],
    ["bench", "index"],
    ["bench", "copy"],
    ["bench", "overlap"],
    ["bench", "l3"],
    ["bench", "pin"],
]


@pytest.mark.parametrize("command", SUBCOMMANDS, ids=" ".join)
def test_every_help_works_and_shows_defaults(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and f"kvtier {' '.join(command)}" in out
    assert "(default:" in out


@pytest.mark.parametrize("argv", [["bench"], ["bench", "--help"], ["bench", "-h"], ["--help"], []])
def test_command_lists_answer_help(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "usage: kvtier" in out and "index" in out and "pin" in out


BAD = [
    (["demo", "--turns", "-1"], "--turns: must be >= 1, got -1"),
    (["demo", "--turns", "0"], "--turns: must be >= 1, got 0"),
    (["demo", "--conversations", "0"], "--conversations: must be >= 1"),
    (["demo", "--host-mib", "0"], "--host-mib: must be >= 1"),
    (["demo", "--answer-tokens", "1.5"], "--answer-tokens: not an integer"),
    (["demo", "--state-slots", "-1"], "--state-slots: must be >= 0"),
    (["demo", "--model", "huge"], "huge"),
    (["demo", "--model", "large", "--block-size", "32", "--host-mib", "1"], "--host-mib 1 holds no page"),
    (["demo", "--model", "tiny", "--state-slots", "0"], "--state-slots must be > 0"),
    (["demo", "--host-mib", str(1 << 40)], "host_bytes"),
    (["demo", "--chunk-size", "24"], "multiple"),
    (["soak", "--seconds", "-5"], "--seconds: must be > 0, got -5"),
    (["soak", "--seconds", "nan"], "--seconds: must be a finite number"),
    (["soak", "--fault-rate", "1.5"], "--fault-rate: must be <= 1"),
    (["soak", "--rounds", "0"], "--rounds: must be >= 1"),
    (["bench", "index", "--repeat", "0"], "--repeat: must be >= 1"),
    (["bench", "index", "--page-slots", "-3"], "--page-slots: must be >= 1"),
    (["bench", "copy", "--mib", "0"], "--mib: must be >= 1"),
    (["bench", "copy", "--page-sizes", "-4"], "--page-sizes: every value must be >= 1"),
    (["bench", "copy", "--segment-align", "24"], "--segment-align: must be a multiple of 16 bytes, got 24"),
    (["bench", "overlap", "--reps", "0"], "--reps: must be >= 1"),
    (["bench", "overlap", "--prefix-tokens", "8"], "--prefix-tokens: must be >= 16"),
    (["bench", "overlap", "--layouts", "diagonal"], "--layouts: each must be one of layer-first, page-first"),
    (["bench", "overlap", "--method", "fast"], "--method: invalid choice"),
    (["bench", "l3", "--groups", "0"], "--groups: must be >= 1"),
    (["bench", "pin", "--host-gib", "0"], "--host-gib: must be > 0"),
    (["bench", "pin", "--after-seconds", "-1"], "--after-seconds: must be >= 0"),
]


@pytest.mark.parametrize("argv, text", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_numbers_fail_in_one_line_before_any_work(argv, text, capsys):
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert text in err and err.count("\n") == 1, err
    assert time.perf_counter() - t0 < 10, "checked before any work runs"


def run_cli(*args: str, env: dict[str, str] | None = None, pythonpath: str | None = None) -> Any:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")} | (env or {})
    if pythonpath:
        full["PYTHONPATH"] = pythonpath + os.pathsep + full.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, env=full, timeout=120
    )


def test_demo_l3_names_the_extra_before_the_baseline(tmp_path):
    """Mooncake not importable (a package that fails to import stands in for it): one line naming the extra, and
    no baseline run."""
    fake = tmp_path / "mooncake"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('mooncake is not installed here')\n")
    t0 = time.perf_counter()
    r = run_cli("demo", "--l3", "local", pythonpath=str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert 'pip install "kvtier[l3]"' in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "cache off" not in r.stderr and time.perf_counter() - t0 < 60


def test_info_reports_the_build_and_where_each_setting_came_from():
    r = run_cli("info", "--json", env={"KVTIER_HOST_BYTES": "1GiB", "KVTIER_PIN_STEP_BYTES": "8MiB"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["version"] == kvtier.__version__ and out["cuda_kernel"] == kvtier.build_info()["cuda"]
    assert {"cuda_runtime", "cuda_devices", "devices", "mooncake"} <= set(out)
    settings = {s["name"]: s for s in out["settings"]}
    assert set(settings) == {s.name for s in REGISTRY}
    assert settings["host_bytes"]["value"] == "1GiB" and settings["host_bytes"]["source"] == "env"
    assert settings["pin_step_bytes"]["value"] == "8MiB"
    assert settings["keep_tokens"]["source"] == "default"
    text = run_cli("info", env={"KVTIER_HOST_BYTES": "1GiB"})
    assert text.returncode == 0 and "kvtier " + kvtier.__version__ in text.stdout
    assert any(line.split()[:3] == ["host_bytes", "1GiB", "env"] for line in text.stdout.splitlines())


def test_info_names_a_bad_setting_of_the_environment():
    r = run_cli("info", env={"KVTIER_KEEP_TOKENS": "zero"})
    assert r.returncode == 1 and "keep_tokens" in r.stdout and "KVTIER_KEEP_TOKENS='zero'" in r.stdout
