"""Prometheus metrics of a cache, read from ``stats()`` at each scrape (needs ``prometheus-client``).

What is exported is the statistics table of the Rust core (``kvtier._core.stat_table()``, rust/index/stats.rs): every
statistic a cache reports, with its kind (counter or gauge) and help. A statistic a cache does not report (the
``l3_*`` ones without L3) is not exported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kvtier._core import stat_table

TABLE: list[tuple[str, str, str]] = stat_table()
COUNTERS = {name: help_text for name, kind, help_text in TABLE if kind == "counter"}
GAUGES = {name: help_text for name, kind, help_text in TABLE if kind == "gauge"}


class CacheCollector:
    """A collector that reports one cache's statistics under ``<prefix>_...`` names."""

    def __init__(
        self, stats: Callable[[], dict[str, Any]], prefix: str = "kvtier", labels: dict[str, str] | None = None
    ) -> None:
        self.stats = stats
        self.prefix = prefix
        self.labels = dict(labels or {})

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats()
        names, values = list(self.labels), list(self.labels.values())
        for key, kind, doc in TABLE:
            if key not in s:
                continue
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            m = family(f"{self.prefix}_{key}", doc, labels=names)
            m.add_metric(values, float(s[key]))
            yield m


def register_metrics(
    cache: Any, registry: Any = None, *, prefix: str = "kvtier", labels: dict[str, str] | None = None
) -> CacheCollector:
    """Registers a cache's statistics on ``registry`` (default: prometheus_client's global REGISTRY).

    ``cache`` is anything with ``stats()`` or ``stats_dict()`` (HostPrefixCache, the DeepInfer adapter)."""
    from prometheus_client import REGISTRY

    stats = getattr(cache, "stats_dict", None) or cache.stats
    collector = CacheCollector(stats, prefix, labels)
    (REGISTRY if registry is None else registry).register(collector)
    return collector
