"""Prometheus metrics of a cache, read from ``stats()`` at each scrape (needs ``prometheus-client``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

COUNTERS = {
    "lookups": "Requests looked up",
    "hits": "Requests resumed from the cache",
    "hit_tokens": "Prompt tokens served from the cache",
    "lookup_tokens": "Prompt tokens of the requests looked up",
    "deferred": "Hits answered retry-later (no GPU blocks now)",
    "stores": "Prompt stores that copied something",
    "store_skipped": "Prompt stores that found no host slot",
    "pages_stored": "Pages copied GPU to host",
    "pages_loaded": "Pages copied host to GPU",
    "pages_evicted": "Pages evicted from the host pool",
    "states_stored": "States copied GPU to host",
    "states_loaded": "States copied host to GPU",
    "states_evicted": "States evicted from the host pool",
    "errors": "Errors handled by the cache",
    "bytes_to_host": "Bytes copied GPU to host",
    "bytes_to_gpu": "Bytes copied host to GPU",
}
GAUGES = {
    "pages_used": "Host page slots in use",
    "page_slots": "Host page slots in all",
    "states_used": "Host state slots in use",
    "state_slots": "Host state slots in all",
    "host_bytes_pinned": "Host bytes pinned so far",
    "token_hit_rate": "Fraction of looked-up prompt tokens served from the cache",
    "disabled": "1 when the cache disabled itself after repeated errors",
    "copies_in_flight": "Copies launched and not yet retired",
}


class CacheCollector:
    """A collector that reports one cache's statistics under ``<prefix>_...`` names."""

    def __init__(self, stats: Callable[[], dict[str, Any]], prefix: str = "kvtier",
                 labels: dict[str, str] | None = None) -> None:  # fmt: skip
        self.stats = stats
        self.prefix = prefix
        self.labels = dict(labels or {})

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats()
        names, values = list(self.labels), list(self.labels.values())
        for key, doc in COUNTERS.items():
            if key in s:
                m = CounterMetricFamily(f"{self.prefix}_{key}", doc, labels=names)
                m.add_metric(values, float(s[key]))
                yield m
        for key, doc in GAUGES.items():
            if key in s:
                m = GaugeMetricFamily(f"{self.prefix}_{key}", doc, labels=names)
                m.add_metric(values, float(s[key]))
                yield m


def register_metrics(cache: Any, registry: Any = None, *, prefix: str = "kvtier",
                     labels: dict[str, str] | None = None) -> CacheCollector:  # fmt: skip
    """Registers a cache's statistics on ``registry`` (default: prometheus_client's global REGISTRY).

    ``cache`` is anything with ``stats()`` or ``stats_dict()`` (HostPrefixCache, the DeepInfer adapter)."""
    from prometheus_client import REGISTRY

    stats = getattr(cache, "stats_dict", None) or cache.stats
    collector = CacheCollector(stats, prefix, labels)
    (REGISTRY if registry is None else registry).register(collector)
    return collector
