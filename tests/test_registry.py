"""The two registries: statistics (rust/index/stats.rs, exported to Prometheus) and settings (kvtier.settings)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from kvtier import BadArgument, stat_table
from kvtier.cache import HostPrefixCache
from kvtier.settings import BOOL, REGISTRY, SECRET, TEXT, CacheSettings, markdown_table

README = Path(__file__).resolve().parent.parent / "README.md"
TABLE = {name: kind for name, kind, _ in stat_table()}


def cache(**settings) -> HostPrefixCache:
    return HostPrefixCache(
        torch.zeros(32, 256, dtype=torch.uint8), block_size=4, host_bytes="8KiB", preallocate=True, **settings
    )


def exported(c: HostPrefixCache) -> dict[str, float]:
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvtier.metrics import register_metrics

    registry = prometheus_client.CollectorRegistry()
    register_metrics(c, registry)
    out = {}
    for family in registry.collect():
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                out[sample.name.removeprefix("kvtier_").removesuffix("_total")] = sample.value
    return out


def check_stats(c: HostPrefixCache, *, l3: bool) -> None:
    s = c.stats()
    assert set(s) <= set(TABLE), f"stats() keys missing from rust/index/stats.rs: {sorted(set(s) - set(TABLE))}"
    want = {name for name in TABLE if l3 or not name.startswith("l3_")}
    assert want <= set(s), f"statistics of the table that stats() does not report: {sorted(want - set(s))}"
    out = exported(c)
    assert set(out) == set(s), f"not exported: {sorted(set(s) - set(out))}"
    for name, value in s.items():
        assert out[name] == float(value), name


def test_every_statistic_is_in_the_table_and_exported():
    c = cache()
    c.store("a", list(range(20)), list(range(5)))
    c.poll()
    check_stats(c, l3=False)
    assert c.stats()["pages_stored"] == 5


def test_table_kinds():
    assert set(TABLE.values()) == {"counter", "gauge"}
    assert TABLE["hits"] == "counter" and TABLE["pages_used"] == "gauge" and TABLE["l3_hits"] == "counter"


@pytest.mark.mooncake
def test_every_l3_statistic_is_in_the_table_and_exported(mooncake_server):
    c = cache(
        l3="mooncake",
        l3_master=mooncake_server.master_addr,
        hash_key="registry-test",
        fingerprint_fields={"model": "registry-test"},
    )
    try:
        # Read once the tier is connected: until then the gauges (l3_connected) change between two reads.
        deadline = time.monotonic() + 60
        while not c.stats()["l3_connected"]:
            assert time.monotonic() < deadline, "the L3 tier did not connect"
            time.sleep(0.05)
        check_stats(c, l3=True)
    finally:
        c.close()


def test_readme_settings_table_is_the_registry():
    text = README.read_text()
    m = re.search(r"^\| setting \|.*?(?=\n\n)", text, re.S | re.M)
    assert m is not None, "README.md has no settings table"
    assert m.group(0) == markdown_table(), "README's settings table differs: paste kvtier.settings.markdown_table()"


def test_settings_come_from_argument_env_or_default():
    s = CacheSettings.resolve(
        {"KVTIER_HOST_BYTES": "1GiB", "KVTIER_KEEP_TOKENS": "5", "KVTIER_L3": ""}, keep_tokens=7, preallocate="yes"
    )
    assert (s.host_bytes, s.keep_tokens, s.preallocate, s.l3) == (1 << 30, 7, True, None)
    assert s.sources["host_bytes"] == "env" and s.sources["keep_tokens"] == "argument"
    assert s.sources["state_slots"] == "default" and s.sources["preallocate"] == "argument"
    assert CacheSettings(host_bytes="64GiB").host_bytes == 64 << 30
    assert CacheSettings(host_bytes="1.5GiB", l3_deadline_ms="20").l3_deadline_ms == 20.0
    assert s.replace(keep_tokens=2).keep_tokens == 2 and s.replace(keep_tokens=2).host_bytes == 1 << 30


BAD_VALUES = {
    "bytes": ["lots", -1, True, 1.5, "1e9", [1]],
    "int": ["many", -1, 1.5, "1.5", False, None],
    "float": ["soon", float("inf"), True, -1],
    "bool": ["maybe", 2, 1.0],
    "text": [5, b"x"],
    "secret": [5],
    "address": [5, b"x", "nohost", "host:0", "host:65536", ":1"],
}


@pytest.mark.parametrize("setting", REGISTRY, ids=lambda s: s.name)
def test_every_bad_value_is_a_value_error_naming_the_setting(setting):
    bad = [v for v in BAD_VALUES[setting.kind] if v is not None]
    if setting.kind == TEXT and setting.choices:
        bad.append("nonsense")
    for value in bad:
        if setting.minimum is not None and setting.minimum <= -1 and value == -1:
            continue
        with pytest.raises(BadArgument, match=setting.name):
            CacheSettings(**{setting.name: value})
    if setting.kind not in (TEXT, SECRET):
        with pytest.raises(BadArgument, match=f"{setting.name} \\(from {setting.variable}='garbage'\\)"):
            CacheSettings.resolve({setting.variable: "garbage"})
    if setting.kind == BOOL:
        assert CacheSettings(**{setting.name: "off"}).__getattr__(setting.name) is False


def test_an_unknown_setting_is_refused():
    with pytest.raises(TypeError, match="unknown cache settings"):
        CacheSettings(pin_chunk_bytes="1MiB")


def test_secrets_are_not_shown():
    s = CacheSettings(hash_key="hunter2")
    assert "hunter2" not in repr(s) and "hunter2" not in str(s.explain())
