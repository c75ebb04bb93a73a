"""`kvtier bench serve` (real vLLM on a GPU): what runs without a GPU. Its arguments are checked in one line before any
engine starts; the trace's prompts keep the trace's prefix sharing; the outputs check fails loudly; each
configuration gives vLLM the arguments it names."""

from __future__ import annotations

import json
import re
from importlib.util import find_spec
from pathlib import Path

import pytest

from kvtier.tools.bench import serve
from kvtier.tools.cli import main


def test_help_shows_every_option_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "kvtier bench serve" in out and "(default: prefix,trace)" in " ".join(out.split())


BAD = [
    (["--workloads", "prefix,chat"], "--workloads: unknown workload 'chat'"),
    (["--configs", "none,lmcache"], "--configs: unknown configuration 'lmcache'"),
    (["--configs", "native", "--workloads", "prefix"], "the prefix workload needs 'none'"),
    (["--workloads", "trace", "--trace", "/nonexistent/t.jsonl"], "--trace: no trace file '/nonexistent/t.jsonl'"),
    (["--workloads", "prefix", "--lengths", "4096"], "--lengths: '4096' is not TOKENSxPROMPTS"),
    (["--workloads", "prefix", "--lengths", "8x2"], "needs at least 16 tokens and one prompt"),
    (["--workloads", "prefix", "--noreuse", "4096x0"], "--noreuse: '4096x0' needs at least 16 tokens and one prompt"),
    (["--noreuse", "4096x32,8192x16"], "--noreuse: '4096x32,8192x16' names more than one TOKENSxPROMPTS"),
    (["--workloads", "noreuse", "--noreuse", ""], "--noreuse '' leaves it nothing to run"),
    (["--workloads", "noreuse", "--configs", "native"], "the noreuse workload needs 'none'"),
    (["--workloads", ""], "--workloads: name at least one of prefix, noreuse, trace, l3"),
    (["--configs", ","], "--configs: name at least one of none, native"),
    (["--configs", "none,native,none"], "--configs: ['none'] named more than once"),
    (["--configs", "none,kvtier-lru:eviction_policy=adaptive"], "the configuration's name sets the eviction policy"),
    (["--workloads", "noreuse", "--plot", "x.png"], "--plot draws the prefix and trace workloads"),
    (["--gpu-memory-utilization", "5"], "--gpu-memory-utilization: must be <= 1.0, got 5"),
    (["--configs", "none:copy_method=kernel"], "only kvtier's configurations take kvtier settings"),
    (["--configs", "none,kvtier-lru:kernel"], "'kernel' in 'kvtier-lru:kernel' is not SETTING=VALUE"),
    (["--think-s", "-1"], "--think-s: must be >= 0"),
    (["--host-gib", "0"], "--host-gib: must be > 0"),
    (["--repeats", "0"], "--repeats: must be >= 1"),
    (["--plot", "x.txt"], "matplotlib writes no .txt files"),
]


@pytest.mark.parametrize("argv, text", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_fail_in_one_line_before_any_engine(
    argv: list[str], text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert text in err and err.count("\n") == 1, err


@pytest.mark.skipif(find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_it_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", "--workloads", "prefix"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "needs vLLM and torch" in err and err.count("\n") == 1


def test_trace_prompts_share_exactly_the_prefixes_the_trace_shares(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    records = [
        {"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 2]},
        {"timestamp": 1, "input_length": 700, "output_length": 1, "hash_ids": [0, 5]},
        {"timestamp": 2, "input_length": 1500, "output_length": 1, "hash_ids": [0, 1, 7]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    a, b, c = serve.trace_prompts(str(trace), 3, max_tokens=1024)
    assert (len(a), len(b), len(c)) == (1024, 700, 1024), "cut at max_tokens, else the request's length"

    def common(x: list[int], y: list[int]) -> int:
        return next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))

    assert common(a, b) == 512 and common(a, c) == 1024, "one shared hash id is 512 shared tokens"
    assert all(1000 <= t < serve.VOCAB - 1000 for t in a + b + c)
    assert serve.trace_prompts(str(trace), 1, max_tokens=4096) == [serve.trace_prompts(str(trace), 3, 4096)[0]]


def test_outputs_that_differ_fail_loudly_naming_the_configuration() -> None:
    same = [{"config": c, "workload": "prefix", "t": [[1, 2], [3]]} for c in ("none", "native")]
    serve.check_identical(same, lambda r: r["t"])
    other = [*same, {"config": "kvtier-lru", "workload": "prefix", "t": [[1, 2], [4]]}]
    with pytest.raises(AssertionError, match="kvtier-lru"):
        serve.check_identical(other, lambda r: r["t"])


def test_the_model_folder_is_a_llama_config_of_the_shape_named(tmp_path: Path) -> None:
    folder = serve.write_model(str(tmp_path / "m"), "8b", 40000)
    config = json.loads((Path(folder) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 32
    assert config["max_position_embeddings"] == 40000
    # 32 layers x 8 KV heads x 128 dims x K and V x 2 bytes: an 8B model's 128 KiB a token.
    assert serve.kv_bytes_per_token("8b") == 128 << 10


ARGS = {
    "model_dir": "/m",
    "max_model_len": 8192,
    "gpu_memory_utilization": 0.5,
    "gpu_blocks": 4096,
    "max_num_batched_tokens": 8192,
    "host_gib": 16.0,
    "l3_master": "127.0.0.1:50051",
}


def test_no_offloading_and_native_offloading_arguments() -> None:
    none = serve.engine_kwargs("none", ARGS)
    assert "kv_transfer_config" not in none and "kv_offloading_size" not in none
    assert none["load_format"] == "dummy" and none["seed"] == 0 and none["enable_prefix_caching"]
    native = serve.engine_kwargs("native", ARGS)
    assert (native["kv_offloading_size"], native["kv_offloading_backend"]) == (16.0, "native")
    with pytest.raises(ValueError, match="unknown configuration 'arc'"):
        serve.engine_kwargs("arc", ARGS)


@pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed (see .ci/vllm)")
def test_kvtier_configurations_name_kvtiers_spec_and_the_same_host_bytes() -> None:
    lru = serve.engine_kwargs("kvtier-lru", ARGS)["kv_transfer_config"]
    extra = lru.kv_connector_extra_config
    assert (lru.kv_connector, extra["spec_name"], extra["spec_module_path"]) == (
        "OffloadingConnector",
        "KvtierSpec",
        "kvtier.vllm",
    )
    assert extra["cpu_bytes_to_use"] == 16 << 30 and extra["eviction_policy"] == "lru"
    l3 = serve.engine_kwargs("kvtier-l3", ARGS)["kv_transfer_config"].kv_connector_extra_config
    assert (l3["spec_name"], l3["spec_module_path"]) == ("KvtierTieringSpec", "kvtier.vllm")
    assert l3["secondary_tiers"][0]["type"] == "KvtierMooncakeTier"
    assert l3["secondary_tiers"][0]["l3_master"] == "127.0.0.1:50051"


def test_a_repeated_turn_is_its_median_with_every_run_kept() -> None:
    def run(s: float, tier: int, token: int) -> dict[str, object]:
        return {"s": s, "tokens": [[token]], "prompt_tokens": 64, "gpu_hit_tokens": 16, "tier_hit_tokens": tier}

    jobs = [{"kind": "load", "submit_ms": 1.0}]
    steps = {"longest_step_ms": 12.5}
    out = serve.repeated([run(0.5, 48, 1), {**run(0.3, 48, 2), "jobs": jobs, **steps}, run(0.9, 32, 3)])
    assert out["s"] == 0.5 and out["runs_s"] == [0.5, 0.3, 0.9]
    assert out["runs_jobs"] == [[], jobs, []], "each run's transfers, in run order"
    assert out["runs_longest_step_ms"] == [None, 12.5, None]
    assert out["tokens"] == [[[1]], [[2]], [[3]]]
    # The fewest hit tokens of any run: one run that missed is not hidden by the others.
    assert (out["prompt_tokens"], out["gpu_hit_tokens"], out["tier_hit_tokens"]) == (64, 16, 32)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_the_busiest_threads_are_found_by_their_cpu_time_and_named() -> None:
    import threading
    import time

    spun, release = threading.Event(), threading.Event()

    def spin() -> None:
        end = time.thread_time() + 0.1
        while time.thread_time() < end:
            pass
        spun.set()
        release.wait()

    before = serve.thread_cpu_s()
    assert threading.main_thread().name in {name for name, _ in before.values()}
    spinner = threading.Thread(target=spin, name="spinner")
    waiter = threading.Thread(target=release.wait, name="waiter")
    spinner.start()
    waiter.start()
    try:
        assert spun.wait(30)
        after = serve.thread_cpu_s()  # both still alive: an ended thread is no longer in /proc
    finally:
        release.set()
        spinner.join()
        waiter.join()
    spent = serve.busiest(before, after)
    assert spent["spinner"] >= 0.05, spent  # 0.1 s on its CPU, read in clock ticks
    assert "waiter" not in spent, "an idle thread is left out"
    assert list(spent.values()) == sorted(spent.values(), reverse=True)
    # By name, threads of one name summed; a thread not seen before counts from zero.
    before = {1: ("a", 1.0), 2: ("b", 5.0)}
    assert serve.busiest(before, {1: ("a", 1.5), 2: ("b", 5.0), 3: ("a", 0.25), 4: ("c", 2)}) == {"c": 2, "a": 0.75}


def test_a_repeated_turn_keeps_each_threads_median_cpu() -> None:
    def run(threads: dict[str, float]) -> dict[str, object]:
        return {"s": 0.5, "tokens": [], "prompt_tokens": 1, "gpu_hit_tokens": 0, "tier_hit_tokens": 1,
                "threads_cpu_s": threads}  # fmt: skip

    out = serve.repeated([run({"main": 0.3, "cuda": 0.1}), run({"main": 0.2}), run({"main": 0.4, "cuda": 0.2})])
    assert out["threads_cpu_s"] == {"main": pytest.approx(0.3), "cuda": pytest.approx(0.1)}
    assert list(out["threads_cpu_s"]) == ["main", "cuda"], "busiest first"
    assert serve.repeated([run({"x": 0.1}), run({}), run({})])["threads_cpu_s"] == {}, "a median of none: left out"


class _Result:
    def __init__(self, job_id: int, size: int, seconds: float | None) -> None:
        self.job_id, self.success, self.transfer_size, self.transfer_time = job_id, True, size, seconds


class _Worker:
    """An offloading worker as vLLM's connector calls it: jobs submitted, then reported by get_finished."""

    def __init__(self) -> None:
        self.done: list[_Result] = []

    def submit_load(self, job_id: int, src: object, dst: object) -> bool:
        self.done.append(_Result(job_id, 4 << 30, 0.08))
        return True

    def submit_store(self, job_id: int, src: object, dst: object) -> bool:
        self.done.append(_Result(job_id, 1 << 30, 0.5))
        return True

    def get_finished(self) -> list[_Result]:
        done, self.done = self.done, []
        return done


class _Spec:
    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids


def test_transfers_sum_the_loads_alone_and_keep_every_jobs_timeline() -> None:
    worker = _Worker()
    transfers = serve.Transfers(worker)
    assert worker.submit_load(1, None, _Spec([7, 8, 9, 3])) and worker.submit_store(2, _Spec([5]), None)
    assert worker.submit_load(3, None, None)
    assert [r.job_id for r in worker.get_finished()] == [1, 2, 3], "the connector still gets every result"
    f = transfers.figures()
    assert (f["load_jobs"], f["load_bytes"]) == (2, 8 << 30) and f["load_s"] == pytest.approx(0.16)
    assert f["load_gbs"] == pytest.approx((8 << 30) / 0.16 / 1e9)
    jobs = f["jobs"]
    assert [(j["kind"], j["blocks"], j["runs"], j["bytes"]) for j in jobs] == [
        ("load", 4, 2, 4 << 30),  # the load's GPU blocks are its destination: 7-9, then 3
        ("store", 1, 1, 1 << 30),  # the store's are its source
        ("load", 0, 0, 4 << 30),
    ]
    assert [j["copy_ms"] for j in jobs] == pytest.approx([80.0, 500.0, 80.0])
    assert all(0 <= j["submit_ms"] <= j["done_ms"] for j in jobs)
    worker.submit_store(6, _Spec([1, 2]), None)  # submitted before the clear, seen done after it
    transfers.clear()
    worker.done.append(_Result(4, 1 << 20, None))  # a job it did not submit: not counted, not in the timeline
    worker.submit_load(5, None, _Spec([4]))
    worker.done[-1].transfer_time = None  # an untimed load: no rate rather than a wrong one
    worker.get_finished()
    f = transfers.figures()
    assert (f["load_jobs"], f["load_bytes"], f["load_s"], f["load_gbs"]) == (1, 4 << 30, None, None)
    assert [(j["kind"], j["submit_ms"] < 0, j["copy_ms"]) for j in f["jobs"]] == [
        ("store", True, pytest.approx(500.0)),
        ("load", False, None),
    ]
    empty = serve.Transfers(None).figures()
    assert (empty["load_jobs"], empty["jobs"]) == (0, [])


def test_every_engine_step_is_timed_a_failing_one_too(monkeypatch: pytest.MonkeyPatch) -> None:
    class Core:
        def __init__(self) -> None:
            self.calls = 0

        def step_fn(self) -> tuple[str, bool]:
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("the model failed")
            return "outputs", True

    class Engine:
        engine_core = type("Client", (), {"engine_core": Core()})()

    llm = type("LLM", (), {"llm_engine": Engine()})()
    monkeypatch.setattr(serve, "offloading_worker", lambda: None)
    hits = serve.Hits(llm)
    core = llm.llm_engine.engine_core.engine_core
    assert core.step_fn() == ("outputs", True), "the step's result passes through"
    with pytest.raises(RuntimeError, match="the model failed"):
        core.step_fn()
    core.step_fn()
    assert core.calls == 3 and len(hits.steps) == 3 and all(s >= 0 for s in hits.steps)
    # An engine without a step function (another vLLM's core) is left alone: no steps, no longest step.
    bare = type("LLM", (), {"llm_engine": type("E", (), {"engine_core": None})()})()
    assert serve.Hits(bare).steps == []


def test_transfers_time_the_engine_threads_submit_calls_and_its_cpu_there() -> None:
    import time

    class Blocking(_Worker):
        def submit_load(self, job_id: int, src: object, dst: object) -> bool:
            time.sleep(0.02)  # waits (a lock, the GIL): its thread's CPU stays idle
            return super().submit_load(job_id, src, dst)

        def submit_store(self, job_id: int, src: object, dst: object) -> bool:
            end = time.thread_time() + 0.02  # works (or spins) on its CPU
            while time.thread_time() < end:
                pass
            return super().submit_store(job_id, src, dst)

    worker = Blocking()
    transfers = serve.Transfers(worker)
    worker.submit_load(1, None, _Spec([1]))
    worker.submit_store(2, _Spec([2]), None)
    worker.submit_load(3, None, _Spec([3]))
    worker.get_finished()
    f = transfers.figures()
    load, store, _ = f["jobs"]
    assert load["submit_call_ms"] >= 20 and load["submit_cpu_ms"] < 5, load
    assert store["submit_cpu_ms"] >= 20 and store["submit_call_ms"] >= 19, store  # two clocks: no finer comparison
    # The turn's figures sum the calls of each direction.
    loads = [j for j in f["jobs"] if j["kind"] == "load"]
    assert f["load_submit_ms"] == pytest.approx(sum(j["submit_call_ms"] for j in loads)) and f["load_submit_ms"] >= 40
    assert f["load_submit_cpu_ms"] == pytest.approx(sum(j["submit_cpu_ms"] for j in loads))
    assert (f["store_submit_ms"], f["store_submit_cpu_ms"]) == (store["submit_call_ms"], store["submit_cpu_ms"])
    # Calls made since the last clear, whether or not their jobs were seen done.
    transfers.clear()
    worker.submit_store(5, _Spec([4]), None)
    f = transfers.figures()
    assert f["jobs"] == [] and f["store_submit_cpu_ms"] >= 20 and f["load_submit_ms"] == 0.0

    class Failing(_Worker):
        def submit_load(self, job_id: int, src: object, dst: object) -> bool:
            raise RuntimeError("refused")

    worker = Failing()
    transfers = serve.Transfers(worker)
    with pytest.raises(RuntimeError, match="refused"):
        worker.submit_load(4, None, _Spec([1]))
    assert "submit_call_ms" in transfers.submitted[4][0], "a call that raised is timed too"


def test_transfers_keep_each_jobs_ids_when_asked() -> None:
    worker = _Worker()
    plain = serve.Transfers(worker)
    worker.submit_load(1, _Spec([40, 41]), _Spec([7, 8, 9, 3]))
    worker.get_finished()
    assert [sorted(j) for j in plain.figures()["jobs"]] == [
        ["blocks", "bytes", "copy_ms", "done_ms", "kind", "runs", "submit_call_ms", "submit_cpu_ms", "submit_ms"]
    ], "ids are kept only when asked for"
    worker = _Worker()
    transfers = serve.Transfers(worker, ids=True)
    worker.submit_load(2, _Spec([40, 41]), _Spec([7, 8, 9, 3]))
    worker.submit_store(3, _Spec([5, 6]), _Spec([12]))
    worker.submit_load(4, None, None)
    worker.get_finished()
    jobs = transfers.figures()["jobs"]
    assert [(j["kind"], j["gpu_ids"], j["host_ids"]) for j in jobs] == [
        ("load", [7, 8, 9, 3], [40, 41]),  # a load's GPU side is its destination, the host side its source
        ("store", [5, 6], [12]),
        ("load", [], []),
    ]
    assert transfers.submitted == {}, "ids leave with their job"


def test_the_prefix_table_says_each_turns_spread_and_its_loads_rates(capsys: pytest.CaptureFixture[str]) -> None:
    def turn(s: float, runs: list[float], rates: list[float | None], calls: list[float] | None = None) -> dict:
        gbs = sorted(r for r in rates if r)
        return {"s": s, "runs_s": runs, "tier_hit_tokens": 64, "load_gbs": gbs[len(gbs) // 2] if gbs else None,
                "runs_load_gbs": rates, "runs_load_submit_ms": calls or [],
                "runs_load_submit_cpu_ms": [c / 10 for c in calls or []]}  # fmt: skip

    none = {
        "config": "none",
        "memcpy_h2d_gbs": 50.0,
        "prefix": [
            {
                "length": 4096,
                "prompts": 2,
                "prefix_bytes": 10**9,
                "gpu_hit": {"s": 0.1, "gpu_hit_tokens": 8192},
                "turn2": {"s": 1.0},
            }
        ],
    }
    native = {
        "config": "native",
        "prefix": [{"turn1": {"s": 1.1}, "turn2": turn(0.2, [0.21, 0.2, 0.19], [40, 50, 45], [80, 90, 20])}],
    }
    native["prefix"][0]["turn2"]["runs_longest_step_ms"] = [130.0, None, 90.0, 95.5]
    lru = {"config": "kvtier-lru", "prefix": [{"turn1": {"s": 1.1}, "turn2": turn(0.3, [0.3, 0.32], [None, None])}]}
    lru["prefix"][0]["turn2"]["threads_cpu_s"] = {"MainThread": 0.31, "cuda-EvtHandlr": 0.02, "a": 0.01, "b": 0.01,
                                                  "c": 0.001}  # fmt: skip
    rows = serve.summarize_prefix([none, native, lru])
    assert rows[0]["floor_s"] == pytest.approx(0.12)
    assert rows[0]["native"]["over_floor"] == pytest.approx(0.2 / 0.12)
    serve.print_prefix(rows, ["none", "native", "kvtier-lru"])
    out = capsys.readouterr().out
    assert "turn-2 runs, seconds: native 0.190-0.210, kvtier-lru 0.300-0.320" in out
    # Rates only where the worker timed its loads, each with its runs' range; submit calls where they were watched.
    assert "medians, runs): native 45.0 (40.0-50.0)\n" in out
    assert "(medians of the turns' sums): native 80.0 (8.0 on its CPU)\n" in out
    assert "a token (medians of the turns): native 95.5\n" in out, "steps where they were timed, runs without left out"
    busiest = "(medians of the turns): kvtier-lru: MainThread 0.31, cuda-EvtHandlr 0.02, a 0.01, b 0.01"
    assert out.rstrip().endswith(busiest), "the busiest four threads"


def test_the_no_reuse_lines_say_each_configurations_rate_and_store_submits(capsys: pytest.CaptureFixture[str]) -> None:
    def result(config: str, rate: float, **calls: float) -> dict[str, object]:
        return {"config": config, "noreuse": {"requests_per_s": rate, **calls}}

    serve.print_noreuse([
        result("none", 10.0),
        result("native", 9.9, store_submit_ms=41.25, store_submit_cpu_ms=3.0),
        result("kvtier-lru", 9.8, store_submit_ms=2.0, store_submit_cpu_ms=1.9),
    ])  # fmt: skip
    first, second = capsys.readouterr().out.splitlines()
    assert first == "no reuse: requests/s (against no offloading): none 10.00 (1.000), native 9.90 (0.990), " \
        "kvtier-lru 9.80 (0.980)"  # fmt: skip
    assert second.endswith("(medians; of it on its CPU): native 41.2 (3.0), kvtier-lru 2.0 (1.9)")
    serve.print_noreuse([result("none", 10.0), result("native", 9.9)])  # a run recorded before the calls were timed
    assert capsys.readouterr().out.count("\n") == 1


def test_the_engine_log_carries_kvtiers_lines_through_vllms_logging_config(tmp_path: Path, monkeypatch) -> None:
    import logging.config
    import subprocess
    import sys

    seen = {}

    def fake_run(cmd, stdout, stderr, timeout, env):
        path = env["VLLM_LOGGING_CONFIG_PATH"]
        if Path(path).exists():
            seen["config"] = json.loads(Path(path).read_text())
        seen["path"] = path
        payload = json.loads(cmd[-1])
        Path(payload["out"]).write_text(json.dumps({"config": payload["config"], "workload": payload["workload"]}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.setattr(serve.subprocess, "run", fake_run)
    log = tmp_path / "engine.log"
    result = serve._spawn("kvtier-lru", "prefix", {}, str(log))
    assert result == {"config": "kvtier-lru", "workload": "prefix"}
    config = seen["config"]
    assert config["loggers"]["kvtier"]["level"] == "INFO" and config["loggers"]["vllm"]["level"] == "INFO"
    assert not Path(seen["path"]).exists()  # removed once the configuration's process ended
    # A config logging can take, whose kvtier lines reach the engine log's stream.
    logging.config.dictConfig(config)
    try:
        assert logging.getLogger("kvtier.vllm").isEnabledFor(logging.INFO)
        assert logging.getLogger("kvtier").handlers[0].stream is sys.stdout
    finally:
        for name in ("kvtier", "vllm"):
            logging.getLogger(name).handlers.clear()
            logging.getLogger(name).propagate = True
            logging.getLogger(name).setLevel(logging.NOTSET)

    # A deployment's own config is left as it is.
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", "/etc/mine.json")
    serve._spawn("kvtier-lru", "prefix", {}, str(log))
    assert seen["path"] == "/etc/mine.json"


@pytest.mark.parametrize("log", [None, "engine.log"])
def test_a_failed_configuration_says_where_its_output_went(tmp_path: Path, monkeypatch, log: str | None) -> None:
    import subprocess

    monkeypatch.setattr(serve.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    path = str(tmp_path / log) if log else None
    with pytest.raises(RuntimeError, match="failed with exit status 1") as failed:
        serve._spawn("native", "prefix", {}, path)
    assert (f"see {path}" if log else "--log FILE keeps the engine's output") in str(failed.value)
    assert "None" not in str(failed.value)


def test_replay_loads_copies_each_recorded_load_again_into_its_blocks() -> None:
    torch = pytest.importorskip("torch")
    from kvtier.vllm.copy import ChunkCopier

    g = torch.Generator().manual_seed(0)
    # Two shapes of tensor: two page copiers, so no scratch tensor (its layout would be neither of theirs).
    tensors = [torch.randn(32, 2, 16, n, 64, generator=g).to(torch.float16) for n in (2, 4)]
    copier = ChunkCopier(tensors, [[0, 1]], num_chunks=8, blocks_per_chunk=2)
    blocks, chunks = [9, 3, 4, 20], [6, 1]  # chunk 6's two slots, then chunk 1's
    ((group, ids, slots),) = copier.pairs(blocks, [4], [0], chunks)
    assert slots.tolist() == [12, 13, 2, 3]
    for run in copier.group_runs[group]:
        copier.copiers[run.copier].to_host(ids, slots, layers=run.layers)
    kept = [t[blocks].clone() for t in tensors]
    for t in tensors:
        t.zero_()
    load = {"kind": "load", "submit_ms": 3.0, "blocks": 4, "runs": 3, "bytes": 4 << 20, "copy_ms": 0.5,
            "gpu_ids": blocks, "host_ids": chunks}  # fmt: skip
    untimed = {**load, "submit_ms": 1.0, "copy_ms": None}
    store = {**load, "kind": "store"}
    prefix = [{"turn2": {"runs_jobs": [[store, load], [], [untimed]]}}]
    rows = serve.replay_loads(copier, prefix)
    assert [(r["turn"], r["blocks"], r["runs"]) for r in rows] == [(0, 4, 3), (2, 4, 3)], "loads only, by turn"
    assert rows[0]["under_vllm_gbs"] == pytest.approx((4 << 20) / 0.5 / 1e6) and rows[1]["under_vllm_gbs"] is None
    assert all(r["gbs"] > 0 for r in rows)
    for t, k in zip(tensors, kept, strict=True):
        assert torch.equal(t[blocks], k), "the recorded blocks hold the recorded chunks' pages again"
    summary = serve.replay_summary(rows)
    assert summary.startswith("1 loads below 30 GB/s under vLLM: ") and summary.endswith(" GB/s here; 8.4 there")
    assert serve.replay_summary([]) == "no timed loads"


@pytest.mark.parametrize("layers", [1, 4])
def test_replay_of_one_page_copier_also_copies_into_a_scratch_tensor(layers: int) -> None:
    """vLLM's KV caches in tensors of one shape (one page copier: one tensor across layers, or a view of each layer
    in it): each load is copied again into a scratch tensor of the process's own, and its rate reported beside the
    one into vLLM's blocks."""
    torch = pytest.importorskip("torch")
    from kvtier.vllm.copy import ChunkCopier

    kv = torch.arange(32 * 4096, dtype=torch.int32).view(32, 4096)
    width = 4096 // layers
    copier = ChunkCopier([kv[:, i * width : (i + 1) * width] for i in range(layers)], [[*range(layers)]], num_chunks=8)
    assert copier.copiers[0].num_layers == layers
    blocks, chunks = [9, 10, 3, 20], [6, 7, 1, 2]
    ((_, ids, slots),) = copier.pairs(blocks, [4], [0], chunks)
    copier.copiers[0].to_host(ids, slots)
    kept = kv[blocks].clone()
    kv.zero_()
    load = {"kind": "load", "submit_ms": 1.0, "blocks": 4, "runs": 3, "bytes": 4 * 16384, "copy_ms": 0.01,
            "gpu_ids": blocks, "host_ids": chunks}  # fmt: skip
    (row,) = serve.replay_loads(copier, [{"turn2": {"runs_jobs": [[load]]}}])
    assert row["gbs"] > 0 and row["scratch_gbs"] > 0 and row["alternate_gbs"] > 0
    assert torch.equal(kv[blocks], kept), "the alternate pages' copies are the recorded pages too"
    summary = serve.replay_summary([row])
    assert " into a scratch tensor, " in summary and summary.endswith(" in alternate pages; 6.6 there")
    # With the worker's submit call timed under vLLM, the replay's own submit time stands beside it.
    (row,) = serve.replay_loads(copier, [{"turn2": {"runs_jobs": [[{**load, "submit_call_ms": 12.0}]]}}])
    assert row["submit_ms"] > 0 and row["under_vllm_submit_ms"] == 12.0
    assert re.search(r"6\.6 there; a submit \d+\.\d\d ms here, 12\.00 there$", serve.replay_summary([row]))


def _fake_vllm(monkeypatch: pytest.MonkeyPatch) -> list[list[list[int]]]:
    """A stand-in for vLLM's LLM in this process: each generate's prompts recorded, 8 output tokens each."""
    import sys
    import types

    calls: list[list[list[int]]] = []

    class LLM:
        def __init__(self, **kwargs: object) -> None:
            self.llm_engine = types.SimpleNamespace(engine_core=None)

        def generate(self, prompts: list[dict[str, list[int]]], params: object, use_tqdm: bool) -> list[object]:
            calls.append([p["prompt_token_ids"] for p in prompts])
            out = types.SimpleNamespace(token_ids=[1] * 8)
            return [types.SimpleNamespace(num_cached_tokens=0, outputs=[out]) for _ in prompts]

        def reset_prefix_cache(self) -> bool:
            return True

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=lambda **kw: kw))
    for name in ("VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ENABLE_V1_MULTIPROCESSING", "PYTHONHASHSEED"):
        monkeypatch.setenv(name, "0")  # what a child sets, undone after the test
    monkeypatch.setattr(serve, "offloading_worker", lambda: None)
    monkeypatch.setattr(serve, "_memcpy_gbs", lambda: 50.0)
    return calls


ENGINE_ARGS = {"model": "8b", "model_dir": "/m", "max_model_len": 4096 + 200, "gpu_memory_utilization": 0.5,
               "gpu_blocks": 4608, "max_num_batched_tokens": 8192, "host_gib": 1.0, "kv_bytes": 131072,
               "repeats": 2, "think_s": 0.0, "noreuse": "64x3"}  # fmt: skip


def test_a_process_without_prefix_lengths_runs_the_no_reuse_workload_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_vllm(monkeypatch)
    out = serve.child("none", "prefix", {**ENGINE_ARGS, "lengths": ""})
    assert "prefix" not in out and "memcpy_h2d_gbs" not in out
    assert [len(c) for c in calls] == [1, 3, 3], "the warm-up, then the no-reuse workload's two runs of 3 prompts"
    assert all(len(p) == 64 for c in calls[1:] for p in c) and calls[1] != calls[2], "other prompts each run"
    assert out["noreuse"]["prompts"] == 3 and len(out["noreuse"]["times_s"]) == 2

    calls.clear()
    out = serve.child("none", "prefix", {**ENGINE_ARGS, "lengths": "32x2"})
    assert [r["length"] for r in out["prefix"]] == [32] and out["memcpy_h2d_gbs"] == 50.0
    assert [len(c) for c in calls[-2:]] == [3, 3], "the no-reuse workload after the prefix one, in the same process"


def test_the_no_reuse_workload_alone_spawns_each_configuration_and_compares_with_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    spawned: list[tuple[str, str, dict]] = []

    def spawn(config: str, workload: str, args: dict, log: str | None) -> dict:
        spawned.append((config, workload, args))
        rate = {"none": 10.0, "kvtier-lru": 9.95}[config]
        return {"config": config, "workload": workload, "noreuse": {"requests_per_s": rate, "tokens": [[1]]}}

    monkeypatch.setattr(serve, "_spawn", spawn)
    args = argparse.Namespace(noreuse="4096x32", model="8b", gpu_blocks=4608, host_gib=16.0, log=None)
    report: dict = {"device": "GPU", "vllm": "0.25.1"}
    serve._prefix(report, args, {"lengths": "4096x16,32000x2"}, ["none", "kvtier-lru"], [], str(tmp_path))
    assert [(c, w) for c, w, _ in spawned] == [("none", "prefix"), ("kvtier-lru", "prefix")]
    assert all(a["lengths"] == "" for _, _, a in spawned), "no prefix turns run"
    assert spawned[0][2]["max_model_len"] == 4096 + serve.NEW_TOKENS + serve.OUTPUT_TOKENS + serve.BLOCK
    assert "prefix" not in report and report["noreuse"] == {"none": 10.0, "kvtier-lru": 9.95}
    assert "kvtier-lru 9.95 (0.995)" in capsys.readouterr().out


def test_the_l3_workload_without_mooncake_fails_in_one_line_before_any_engine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvtier.l3.store

    def missing() -> None:
        raise ImportError("no module named 'mooncake'")

    monkeypatch.setattr(kvtier.l3.store, "import_mooncake", missing)
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", "--workloads", "prefix,l3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--workloads l3 needs Mooncake, which is not importable" in err, err
    assert err.count("\n") == 1
