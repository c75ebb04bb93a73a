"""The `kvtier` command: the demo and the index benchmark run and report what they promise; every --help works and
shows defaults; bad numbers fail in one line before any work; `kvtier info`."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier
from conftest import needs_mooncake
from kvtier.settings import REGISTRY, SECRET, TEXT
from kvtier.tools.cli import main

# A demo that runs in seconds: 3 conversations x 3 turns of the tiny model.
TINY = [
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
]


def test_demo_json_reports_identical_outputs_and_savings(capsys, tmp_path):
    plot = tmp_path / "ttft.png"
    rc = main(["demo", "--json", *TINY, "--plot", str(plot)])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert rc == 0 and out["identical"] is True
    for key in ("hit_rate", "prefill_tokens_off", "prefill_tokens_on", "ttft_off_ms", "ttft_on_ms", "noise"):
        assert key in out
    assert out["prefill_tokens_on"] < out["prefill_tokens_off"] and out["hit_rate"] > 0.3
    # Every time figure is a median over its requests with an interval around it (9 requests: enough for 95%).
    for key in ("ttft_off_ms", "ttft_on_ms", "ttft_speedup"):
        lo, hi = out[key]["interval"]
        assert out[key]["n"] == 9 and lo <= out[key]["median"] <= hi, out[key]
    assert [f["n"] for f in out["ttft_per_turn_off_ms"]] == [3, 3, 3]
    assert set(out["ttft_each_on_ms"]) == {f"c{c}-t{t}" for c in range(3) for t in range(3)}
    assert plot.stat().st_size > 1000
    # --json shows progress too, on stderr: one line a turn of each engine (stderr is no terminal here).
    progress = [line for line in captured.err.splitlines() if line.startswith("[")]
    assert len(progress) == 6 and progress[-1].startswith("[6/6]"), captured.err


def test_demo_alternates_which_engine_goes_first(capsys):
    assert main(["demo", *TINY, "--turns", "4"]) == 0
    err = capsys.readouterr().err
    firsts = [line.split("] ")[1].split(",")[0] for line in err.splitlines() if line.startswith("[")][::2]
    assert firsts == ["cache off", "cache on", "cache off", "cache on"], err


def test_demo_reports_counts_first_and_times_with_their_intervals(capsys):
    assert main(["demo", *TINY, "--quiet"]) == 0
    out = capsys.readouterr().out
    counts, times = out.split("times (wall clock")
    assert "prefill tokens computed" in counts and "token hit rate" in counts and "identical" in counts
    # A CPU run says where its "GPU" pool is and what the copy and deferral rows mean.
    assert "GPU" not in counts and "the engine's KV pool is a CPU tensor (--device cpu)" in counts, counts
    assert "pages / states to host" in counts and "hits deferred (KV pool full)" in counts
    ttft = next(line for line in times.splitlines() if line.startswith("TTFT (ms)"))
    assert ttft.count("[") == 2, ttft  # a median and its interval for each engine
    # Whether the machine was quiet is the run's business; what the demo says about it is not.
    assert "WARNING: these times" in times or "waited for a CPU" in times


def test_demo_takes_an_empty_system_prompt(capsys):
    assert main(["demo", *TINY, "--system-tokens", "0", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] and out["prompt_tokens"] > 0


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
    ["bench", "trace"],
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
    (["demo", "--l3", "local", "--plot", "ttft.png"], "--plot draws the cache off/on run; --l3 local prints its table"),
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
    (["soak", "--rounds", "1"], "--rounds: must be >= 2"),
    (["bench", "index", "--repeat", "0"], "--repeat: must be >= 1"),
    (["bench", "index", "--trace", "--tokens", "5"], "--tokens: only the long-prompt case (without --trace) reads it"),
    (["bench", "index", "--turns", "3"], "--turns: only --trace reads it"),
    (["bench", "loop", "--tokens", "100", "--block-size", "64"], "--tokens: every length must hold two blocks of"),
    (["bench", "loop", "--methods", "dma,dma"], "--layouts and --methods: each name once"),
    (["bench", "trace", "--requests", "10"], "--requests: only --synthetic reads it"),
    (["bench", "trace", "--pools", "100,1M"], "--pools: 100 tokens hold no block of 512"),
    (["bench", "index", "--page-slots", "-3"], "--page-slots: must be >= 1"),
    (["bench", "copy", "--mib", "0"], "--mib: must be >= 1"),
    (["bench", "copy", "--page-sizes", "-4"], "--page-sizes: every value must be >= 1"),
    (["bench", "copy", "--segment-align", "24"], "--segment-align: must be a multiple of 16 bytes, got 24"),
    (["bench", "copy", "--layouts", "layer-first"], "--layouts: each of page, layer at most once, got ['layer-first']"),
    (["bench", "copy", "--methods", ""], "--methods: each of kernel, dma, auto at most once, got []"),
    (["bench", "copy", "--directions", "h2d,h2d"], "--directions: each of h2d, d2h, both at most once"),
    (["bench", "copy", "--crossover", "1K,2K"], "--crossover: one size in bytes, got [1024, 2048]"),
    (["bench", "copy", "--pin-gib", "0.001"], "--pin-gib: 0.001 GiB holds no 2 MiB slot"),
    (["bench", "overlap", "--reps", "0"], "--reps: must be >= 1"),
    (["bench", "overlap", "--prefix-tokens", "16"], "--prefix-tokens: must be >= 32"),
    (["bench", "overlap", "--prefix-tokens", "40"], "--prefix-tokens: 40 is not a multiple of the block size, 16"),
    (["bench", "overlap", "--layouts", "diagonal"], "--layouts: each must be one of layer-first, page-first"),
    (["bench", "overlap", "--method", "fast"], "--method: invalid choice"),
    (["bench", "l3", "--groups", "0"], "--groups: must be >= 1"),
    (["bench", "pin", "--host-gib", "0"], "--host-gib: must be > 0"),
    (["bench", "pin", "--after-seconds", "-1"], "--after-seconds: must be >= 0"),
    (["bench", "pin", "--device", "cpu"], "--device cpu: only a CUDA pool's host pool is pinned"),
    (["demo", "--plot", "/nonexistent/dir/x.png"], "--plot: '/nonexistent/dir/x.png': no folder /nonexistent/dir"),
    # A folder where nothing can be written, even by root (whom a permission check lets through).
    (["demo", "--plot", "/proc/kvtier-ttft.png"], "--plot: '/proc/kvtier-ttft.png' cannot be written: "),
    (["demo", "--plot", "x.txt"], "--plot: 'x.txt': matplotlib writes no .txt files (it writes "),
    (["demo", "--plot", "ttft"], "matplotlib writes no extension-less files"),
    (["demo", "--gpu-blocks", "1"], "--gpu-blocks 1 cannot hold the last turn's request: 992 tokens need 62 blocks"),
    (["demo", "--device", "tpu"], "--device 'tpu' is not a torch device"),
    (["demo", "--chunk-size", "20"], "--chunk-size 20 must be a multiple of --block-size 16"),
    (["bench", "copy", "--plot", "gbps.doc"], "matplotlib writes no .doc files"),
    (["bench", "index", "--page-slots", "1"], "--page-slots must hold the prompt's 2048 pages (every page cached)"),
    (["bench", "index", "--seed", "-1"], "--seed: must be >= 0, got -1"),
    (["bench", "vllm", "--keys", "2.5"], "--keys: not an integer: '2.5'"),
    (["bench", "vllm", "--repeat", "0"], "--repeat: must be > 0, got 0"),
    (["bench", "vllm", "--copies", "--scheduler"], "--copies and --scheduler are two other measurements: give one"),
    (["bench", "sglang", "--shapes", "--main-thread"], "--main-thread chooses the backends' caller"),
    (["bench", "l3", "--master", "nohost:1"], "--master nohost:1: no Mooncake master accepts connections there"),
    (["bench", "l3", "--segment-mib", "100"], "--segment-mib 100 is too small: this run puts 320 MiB, which needs 401"),
    (["bench", "l3", "--master", "nohost:1", "--segment-mib", "64"], "--segment-mib sizes the holder of the master"),
    (["bench", "l3", "--master", "nohost"], "--master must be host:port, got 'nohost'"),
    (["soak", "--device", "tpu"], "--device 'tpu' is not a torch device"),
    (["bench", "trace", "t.jsonl", "--synthetic", "agents"], "give a trace file or --synthetic, not both"),
    (["bench", "trace", "--plot", "/proc/hits.png"], "--plot: '/proc/hits.png' cannot be written"),
    (["bench", "trace", "--synthetic", "zigzag"], "--synthetic: invalid choice"),
    (["bench", "trace", "--synthetic", "agents", "--pools", "1X"], "--pools: not a token count: '1X'"),
    (["bench", "trace", "--synthetic", "agents", "--policies", "lru,arc"], "--policies: each of lru, adaptive"),
    (["bench", "trace", "--synthetic", "agents", "--requests", "0"], "--requests: must be >= 1"),
    (["bench", "trace", "/nonexistent/trace.jsonl"], "No such file"),
]


@pytest.mark.parametrize("argv, text", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_fail_in_one_line_before_any_work(argv, text, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    # One line and nothing else: no progress line, no log record, so no work began.
    assert exit_.value.code == 2
    assert text in err and err.count("\n") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
@pytest.mark.parametrize(
    "command",
    [
        ["bench", "pin"],
        ["bench", "copy"],
        ["bench", "overlap"],
        ["demo", "--device", "cuda"],
        ["soak", "--device", "cuda"],
    ],
    ids=" ".join,
)
def test_cuda_asked_for_without_cuda_is_one_line(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(command)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "CUDA" in err and err.count("\n") == 1, err


def bad_value(setting: Any) -> str | None:
    """A value of the setting's variable that its parser refuses (None: any text is accepted)."""
    if setting.kind in (TEXT, SECRET):
        return "nonsense" if setting.choices else None
    return "garbage"


# The commands that build caches. Each checks every variable, those its own arguments override included (a bad
# KVTIER_HOST_BYTES once went unnoticed by the demo, whose --host-mib default won over it).
CACHE_COMMANDS = ["demo", "soak", "soak --l3", "bench l3", "bench overlap --device cpu"]
CACHE_COMMANDS += ["bench pin", "bench loop"] if torch.cuda.is_available() else []
READ = [(command, setting) for command in CACHE_COMMANDS for setting in REGISTRY if bad_value(setting) is not None]


@pytest.mark.parametrize("command, setting", READ, ids=[f"{c} {s.variable}" for c, s in READ])
def test_every_bad_kvtier_variable_stops_a_command_before_its_first_request(command, setting, capsys, monkeypatch):
    if "l3" in command:
        needs_mooncake()
    for s in REGISTRY:
        monkeypatch.delenv(s.variable, raising=False)
    monkeypatch.setenv(setting.variable, bad_value(setting))
    with pytest.raises(SystemExit) as exit_:
        main(command.split())
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and setting.variable in err and err.count("\n") == 1, err


def test_the_hash_kind_of_the_issue_stops_the_demo_at_once():
    r = run_cli("demo", env={"KVTIER_HASH_KIND": "md5"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "hash_kind (from KVTIER_HASH_KIND='md5'): must be one of 'blake3', 'xxh3'" in r.stderr


def run_cli(*args: str, env: dict[str, str] | None = None, pythonpath: str | None = None) -> Any:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")} | (env or {})
    if pythonpath:
        full["PYTHONPATH"] = pythonpath + os.pathsep + full.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "kvtier.tools.cli", *args], capture_output=True, text=True, env=full, timeout=120
    )


def test_demo_l3_names_the_extra_before_the_baseline(tmp_path):
    """Mooncake not importable (a package that fails to import stands in for it): one line naming the extra, and
    no baseline run."""
    fake = tmp_path / "mooncake"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('mooncake is not installed here')\n")
    r = run_cli("demo", "--l3", "local", pythonpath=str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert 'pip install "mooncake-transfer-engine' in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "cache off" not in r.stderr


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


def test_info_names_a_bad_setting_of_the_environment_and_lists_the_others():
    r = run_cli("info", env={"KVTIER_KEEP_TOKENS": "zero", "KVTIER_HOST_BYTES": "1GiB"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("kvtier info: error: bad setting keep_tokens (from KVTIER_KEEP_TOKENS='zero')")
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines() if line.startswith("  ")}
    assert {s.name for s in REGISTRY} <= set(rows), r.stdout
    assert rows["keep_tokens"] == ["zero", "bad", "KVTIER_KEEP_TOKENS"] and rows["host_bytes"][:2] == ["1GiB", "env"]
    out = json.loads(run_cli("info", "--json", env={"KVTIER_KEEP_TOKENS": "zero"}).stdout)
    assert len(out["settings"]) == len(REGISTRY) and len(out["settings_errors"]) == 1


def test_the_demo_takes_its_host_pool_from_the_variable_unless_told(capsys, monkeypatch):
    r = run_cli("demo", env={"KVTIER_HOST_BYTES": "lots"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "bad setting host_bytes (from KVTIER_HOST_BYTES='lots')" in r.stderr
    # 1 MiB from the variable (not the demo's 256 MiB), and --host-mib over the variable.
    monkeypatch.setenv("KVTIER_HOST_BYTES", "1MiB")
    assert main(["demo", *TINY, "--json", "--quiet"]) == 0
    slots = json.loads(capsys.readouterr().out)["host_page_slots"]
    assert main(["demo", *TINY, "--json", "--quiet", "--host-mib", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["host_page_slots"] == 2 * slots


@pytest.mark.gpu
def test_bench_pin_reports_when_the_pool_was_pinned(capsys):
    """The pinning is watched on the engine loop's thread (a watcher thread once met the pinning thread created but
    not started, and crashed the benchmark)."""
    argv = ["bench", "pin", "--model", "tiny", "--host-gib", "0.25", "--after-seconds", "0"]
    for _ in range(3):
        assert main([*argv, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["pinned"] is True and out["pin_seconds"] > 0 and out["calls_while_pinning"] > 0, out
        assert out["calls_after"] > 0 and out["max_ms_by_call"]["poll"] > 0


def test_bench_overlap_runs_on_the_cpu(capsys):
    """The quick CPU run of the script: every row, both layouts (whole loads only: layer-wise loads need copy
    streams), a suffix of any length; a model with state resumes and stores with its state handle."""
    argv = ["bench", "overlap", "--device", "cpu", "--model", "tiny", "--reps", "1", "--stores", "2"]
    assert main([*argv, "--prefix-tokens", "64", "--suffix-tokens", "9", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ttft = [r for r in rows if r["kind"] == "ttft"]
    assert sorted(r["layout"] for r in ttft) == ["layer-first", "page-first"], rows
    assert all(r["whole_loads_ms"] > 0 and r["reps"] == 1 for r in ttft), ttft
    assert any(r["kind"] == "decode" and r["pages_stored"] > 0 for r in rows), rows


def test_bench_index_agrees_at_the_smallest_pool_it_takes(capsys):
    assert main(["bench", "index", "--json", "--tokens", "1024", "--repeat", "2", "--page-slots", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hit_tokens"] == 1024 - 64, "every page but the last (keep_tokens) is a hit"


@pytest.mark.parametrize("command", [c for c in SUBCOMMANDS if c != ["info"]], ids=" ".join)
def test_every_option_has_help_and_the_description_is_whole_sentences(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = capsys.readouterr().out
    usage, description, options = text.split("\n\n", 2)
    assert " ".join(description.split()).endswith("."), description
    # An option's entry: its names, then its help after two spaces or on the next line, indented further.
    lines = options.splitlines()[1:]
    for i, line in enumerate(lines):
        if not re.match(r"^  -", line) or line.strip().startswith("-h, --help"):
            continue
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        after = lines[i + 1] if i + 1 < len(lines) else ""
        assert len(parts) == 2 or re.match(r"^ {4,}\S", after), f"{parts[0]} has no help"
    if command == ["bench", "copy"]:
        assert "and what each costs the model." in " ".join(description.split())


def test_soak_says_what_bound_the_memory_growth_is_judged_against(capsys):
    level = logging.getLogger("kvtier").level
    assert main(["soak", "--rounds", "2"]) == 0
    assert logging.getLogger("kvtier").level == level, "the soak's quiet logging outlived it"
    line = capsys.readouterr().out.strip()
    assert "rss_bound_mib=96.0" in line and line.endswith("memory growth within its bound)"), line
    assert main(["soak", "--rounds", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rss_within_bound"] is True and out["passed"] is True and out["rss_bound_mib"] == 96.0


def test_the_library_log_on_the_command_line_has_one_prefix():
    r = run_cli("soak", "--rounds", "2", "--fault-rate", "0.5", "--verbose")
    assert r.returncode == 0, r.stderr
    records = [line for line in r.stderr.splitlines() if " failed (" in line]
    assert records and all(line.startswith("kvtier: ") for line in records), r.stderr
    assert "kvtier: kvtier:" not in r.stderr


GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d", re.M)


@pytest.mark.mooncake
def test_mooncake_logs_to_files_and_not_stderr_unless_told(tmp_path):
    needs_mooncake()
    demo = ("demo", "--l3", "local", "--quiet", *TINY, "--conversations", "2", "--turns", "2")  # the last ones win
    r = run_cli(*demo, env={"TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert not GLOG.search(r.stderr) and "InitGoogleLogging" not in r.stderr, r.stderr
    # The statistics by what they mean, and what the machine's load means for the times.
    assert "pages loaded from L3" in r.stdout and "l3_pages_loaded" not in r.stdout, r.stdout
    assert "WARNING: these times" in r.stdout or "waited for a CPU" in r.stdout, r.stdout
    logs = tmp_path / "kvtier-mooncake-log"
    assert any(p.name.startswith("mooncake-transfer-engine") for p in logs.iterdir())
    # The deployment's choice: Mooncake logs to stderr as it does by itself, and nothing goes to kvtier's folder.
    told = tmp_path / "told"
    told.mkdir()
    r = run_cli(*demo, env={"TMPDIR": str(told), "MC_LOG_LEVEL": "INFO"})
    assert r.returncode == 0 and GLOG.search(r.stderr), r.stderr
    assert not (told / "kvtier-mooncake-log").exists()


def test_the_package_metadata_names_the_license_project_and_authors():
    from importlib.metadata import metadata

    md = metadata("kvtier")
    assert md["License"] == "Apache-2.0" and md.get_all("Author") == ["kvtier maintainers"]
    urls = dict(u.split(", ", 1) for u in md.get_all("Project-URL"))
    assert {"Homepage", "Repository", "Issues", "Documentation"} <= set(urls)
    root = Path(__file__).resolve().parent.parent
    assert urls["Repository"] in (root / "README.md").read_text()
    assert "License :: OSI Approved :: Apache Software License" in md.get_all("Classifier")
    assert (root / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]


def test_build_info_names_the_nvcc_by_version_and_source():
    info = kvtier.build_info()
    if not info["cuda"]:
        assert info["nvcc"] is None and info["nvcc_source"] is None
        return
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", info["nvcc"]), info
    assert info["nvcc_source"] in ("NVCC", "CUDA_HOME", "nvidia-cuda-nvcc wheel", "PATH"), info


def test_the_library_imports_none_of_the_tools() -> None:
    library = "kvtier, kvtier.cache, kvtier.copy, kvtier.hostmem, kvtier.settings, kvtier.metrics, kvtier.events"
    code = f"import sys, {library}, kvtier.identity, kvtier.l3, kvtier.deepinfer\n" + (
        "assert not [m for m in sys.modules if m.startswith('kvtier.tools')], sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
