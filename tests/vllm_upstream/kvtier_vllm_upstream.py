"""A pytest plugin that runs vLLM's own offloading tests with kvtier's manager in place of vLLM's CPU manager.

vLLM's released tests (its sdist's ``tests/``) build ``CPUOffloadingManager`` by name in the test modules: the
manager's own tests (``tests/v1/kv_offload/cpu/test_manager.py``), the offloading connector's scheduler and events
tests, which drive a real manager through ``OffloadingConnectorScheduler``, and the tiering poll-thread test. This
plugin rebinds that name, in each collected test module, to ``KvtierAsCPUManager``: kvtier's ``KvtierManager``
built from the CPU manager's arguments. vLLM's own classes elsewhere are untouched.

Only the tests that built kvtier's manager say anything about kvtier. The others test vLLM's code alone (some of
them need a Hugging Face model config, which an offline machine does not have), so their outcome is reported as
skipped. Where kvtier differs from vLLM's CPU manager on purpose, the test is an expected failure (strict: one
that starts passing fails the run, so the list stays true), with the reason in ``KNOWN_DIFFERENCES``. A run in
which fewer than ``--kvtier-min-tests`` tests built kvtier's manager fails: the rebinding cannot silently stop.

    cd <vLLM's sdist> && python -m pytest -p kvtier_vllm_upstream --confcutdir=tests/v1/kv_offload <test files>

(with this directory on ``PYTHONPATH``; ``.ci/vllm`` does this for each supported vLLM release).
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvtier.vllm import KvtierManager

_POLICY = (
    "vLLM's LRU ranks a request's chunks by token position and by when the request finished; kvtier's policy "
    "is its own (the pages of one store age deepest first, by completion), as its contract test with vLLM says"
)
_INTERNALS = "reads or patches private attributes of vLLM's CPU manager"
_SLOTS = (
    "besides the keys stored, evicted and kept (kvtier's are vLLM's), it checks which host chunk each new key "
    "gets; kvtier hands a store's slots out in ascending order, so a prompt lands in runs of slots that copy "
    "in fewer pieces"
)

# Test function name (or one parametrization's) -> why kvtier's manager fails it on purpose.
KNOWN_DIFFERENCES: dict[str, str] = {
    "test_cpu_manager": _POLICY,
    "test_late_old_completion_does_not_override_newer_request_recency": _POLICY,
    "test_request_key_positions_order_tails_across_kv_groups": _POLICY,
    "test_unfinished_lru_prefix_survives_pressure_across_store_batches[False-1]": _POLICY,
    "test_unfinished_lru_prefix_survives_pressure_across_store_batches[False-2]": _POLICY,
    "test_unfinished_lru_prefix_survives_pressure_across_store_batches[False-3]": _POLICY,
    "test_unfinished_lru_prefix_survives_pressure_across_store_batches[True-3]": _POLICY,
    "test_unfinished_lru_reused_prefix_outlives_new_tail": _POLICY,
    "test_unfinished_lru_backfill_orders_by_token_position": _POLICY,
    "test_lru_failed_store_retry_preserves_prefix_order": _POLICY,
    "test_lru_incremental_stores_do_not_rescan_the_prefix": _POLICY + " (it counts token-position lookups)",
    "test_already_stored_chunk_not_evicted_during_prepare_store": _SLOTS,
    "test_already_stored_block_not_evicted_during_prepare_store": _SLOTS,  # its name before vLLM 0.30
    "test_cpu_manager_reports_cache_usage_gauge": (
        "it builds a manager of zero chunks; kvtier refuses an empty pool with a ValueError"
    ),
    "test_cpu_manager_reports_allocation_size_on_allocation_failure": _INTERNALS,
    "test_evictable_cache_chunk_count": _INTERNALS,
    "test_evictable_cache_block_count": _INTERNALS,  # its name before vLLM 0.30
    "test_failed_store_records_access_once_and_uses_store_miss_hook": _INTERNALS,
    "test_lru_batch_eviction_failure_is_atomic": _INTERNALS,
    "test_lru_repeated_pin_cycles_compact_lazy_heap_entries": _INTERNALS,
    "test_request_finish_forwards_grouped_deduplicated_accesses": _INTERNALS,
    "test_touch_forwards_req_context_to_policy": _INTERNALS,
}

_built: set[str] = set()  # the tests that built kvtier's manager
_current: list[str] = [""]
_outcomes: dict[str, str] = {}  # of those tests: passed, known differences or failed


class KvtierAsCPUManager(KvtierManager):
    """kvtier's manager, built from the arguments of vLLM's ``CPUOffloadingManager`` (its capacity is ``num_blocks``
    before vLLM 0.30, ``num_chunks`` after)."""

    def __init__(
        self,
        num_chunks: int | None = None,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
        *,
        num_blocks: int | None = None,
        **rest: Any,
    ) -> None:
        capacity = num_chunks if num_chunks is not None else num_blocks
        if capacity is None:
            raise TypeError("KvtierAsCPUManager: no capacity (num_chunks or num_blocks)")
        if cache_policy != "lru" or cache_policy_module_path is not None:
            pytest.skip(f"vLLM's {cache_policy!r} cache policy: kvtier's manager has its own policies")
        if store_threshold >= 2:  # vLLM: 0 and 1 both store every offer
            pytest.skip("vLLM's store_threshold (store a key only once it is reused): kvtier stores every offer")
        _built.add(_current[0])
        super().__init__(capacity, enable_events=enable_events)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kvtier-min-tests",
        type=int,
        default=1,
        help="fail unless at least this many of vLLM's tests built kvtier's manager",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        if getattr(module, "CPUOffloadingManager", None) is CPUOffloadingManager:
            module.CPUOffloadingManager = KvtierAsCPUManager  # type: ignore[union-attr]
        reason = KNOWN_DIFFERENCES.get(item.name) or KNOWN_DIFFERENCES.get(getattr(item, "originalname", ""))
        if reason:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))


@pytest.hookimpl(tryfirst=True)  # before the fixtures, which may build a manager
def pytest_runtest_setup(item: pytest.Item) -> None:
    _current[0] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = (yield).get_result()
    if report.when == "teardown" or (report.skipped and not hasattr(report, "wasxfail")):
        return
    if item.nodeid not in _built:
        if report.passed and report.when == "setup":
            return
        # vLLM's code alone: not a statement about kvtier.
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, "Skipped: did not build a manager")
    elif report.failed:
        _outcomes[item.nodeid] = "failed"
    elif report.when == "call":
        _outcomes[item.nodeid] = "known differences" if report.skipped else "passed"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    minimum = session.config.getoption("--kvtier-min-tests")
    if len(_built) < minimum and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    minimum = config.getoption("--kvtier-min-tests")
    counts = list(_outcomes.values())
    terminalreporter.write_sep("=", "kvtier in vLLM's tests")
    terminalreporter.write_line(
        f"{len(_built)} of vLLM's tests built kvtier's manager in place of CPUOffloadingManager: "
        + ", ".join(f"{counts.count(what)} {what}" for what in ("passed", "known differences", "failed"))
    )
    if len(_built) < minimum:
        terminalreporter.write_line(f"fewer than --kvtier-min-tests={minimum}: the rebinding did not take", red=True)
