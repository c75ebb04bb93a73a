//! Counters kept the way DeepInfer's host cache keeps them.

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Requests looked up (a request deferred and retried counts once).
    pub lookups: u64,
    /// Loads begun (a hit that was resumed).
    pub hits: u64,
    pub hit_tokens: u64,
    /// Prompt tokens of the requests looked up.
    pub lookup_tokens: u64,
    /// Hits answered "retry later" because GPU blocks could not be allocated now.
    pub deferred: u64,
    /// Store plans that reserved at least one page or state.
    pub stores: u64,
    /// Store plans that had something to store but found no slot for it.
    pub store_skipped: u64,
    /// Of those, the ones made while the host pools were still being pinned.
    pub store_skipped_pinning: u64,
    /// Hits whose pages or state left the host pool between the lookup and the load (served as misses).
    pub stale_lookups: u64,
    pub pages_stored: u64,
    pub pages_loaded: u64,
    pub states_stored: u64,
    pub states_loaded: u64,
    /// Failures the cache handled (a copy that could not be launched, an engine callback that raised).
    pub errors: u64,
    /// Calls refused because the prompt does not extend what was hashed for the request id (an id reused without
    /// `forget`).
    pub prompt_mismatches: u64,
    /// Times the model version changed (`Index::set_model_version`).
    pub model_versions: u64,
    /// Lookups and stores of requests first seen under an earlier model version (they serve and store nothing).
    pub stale_version_calls: u64,
}

impl Stats {
    /// Fraction of looked-up prompt tokens served from the cache.
    pub fn token_hit_rate(&self) -> f64 {
        if self.lookup_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.lookup_tokens as f64
        }
    }
}

/// Whether a statistic only grows (a Prometheus counter) or goes up and down (a gauge).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
        }
    }
}

/// One statistic a cache reports in `stats()`: its key, kind and meaning.
#[derive(Clone, Copy, Debug)]
pub struct StatInfo {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
}

const fn stat(name: &'static str, kind: Kind, help: &'static str) -> StatInfo {
    StatInfo { name, kind, help }
}

use Kind::{Counter, Gauge};

/// Every statistic of `HostPrefixCache.stats()`, one line each: the index's counters and pool occupancy, what the
/// Python cache adds (bytes, pinning, failure policy) and the L3 tier's. `stats()` reports no key outside this
/// table and the Prometheus export (`kvtier.metrics`) exports every key of it; the tests check both.
pub const TABLE: &[StatInfo] = &[
    stat("lookups", Counter, "Requests looked up (a retried request counts once)"),
    stat("hits", Counter, "Requests resumed from the host pool"),
    stat("hit_tokens", Counter, "Prompt tokens served from the host pool"),
    stat("lookup_tokens", Counter, "Prompt tokens of the requests looked up"),
    stat("deferred", Counter, "Hits answered retry-later (no GPU blocks now)"),
    stat("stores", Counter, "Store plans that reserved at least one page or state"),
    stat("store_skipped", Counter, "Store plans that had something to store but found no host slot"),
    stat("store_skipped_pinning", Counter, "Stores skipped while the host pool was still being pinned"),
    stat("pages_stored", Counter, "Pages copied GPU to host"),
    stat("pages_loaded", Counter, "Pages copied host to GPU"),
    stat("pages_evicted", Counter, "Pages evicted from the host pool"),
    stat("states_stored", Counter, "States copied GPU to host"),
    stat("states_loaded", Counter, "States copied host to GPU"),
    stat("states_evicted", Counter, "States evicted from the host pool"),
    stat("errors", Counter, "kvtier's own failures handled by the cache (these disable it at max_errors)"),
    stat("stale_lookups", Counter, "Hits whose pages left the host pool before the load began (served as misses)"),
    stat(
        "prompt_mismatches",
        Counter,
        "Calls refused: the prompt does not extend the tokens hashed for its request id (reused without forget)",
    ),
    stat("model_versions", Counter, "Times the model version changed (weights updated in place)"),
    stat("pages_retired", Counter, "Host pages dropped because the model version changed"),
    stat("states_retired", Counter, "Host states dropped because the model version changed"),
    stat(
        "stale_version_calls",
        Counter,
        "Lookups and stores of requests first seen under an earlier model version (nothing served or stored)",
    ),
    stat("bad_arguments", Counter, "Adapter calls refused for a bad argument (never towards max_errors)"),
    stat("bytes_to_host", Counter, "Bytes copied GPU to host"),
    stat("bytes_to_gpu", Counter, "Bytes copied host to GPU"),
    stat("page_slots", Gauge, "Host page slots in all"),
    stat("page_slots_usable", Gauge, "Host page slots pinned and usable so far"),
    stat("pages_used", Gauge, "Host page slots in use"),
    stat("pages_evictable", Gauge, "Host pages no copy holds (evictable)"),
    stat("state_slots", Gauge, "Host state slots in all"),
    stat("state_slots_usable", Gauge, "Host state slots pinned and usable so far"),
    stat("states_used", Gauge, "Host state slots in use"),
    stat("states_evictable", Gauge, "Host states no copy holds (evictable)"),
    stat("in_flight", Gauge, "Index tickets (copies and L3 transfers) not yet completed"),
    stat("requests", Gauge, "Requests whose chain the index keeps (until forget)"),
    stat("events_dropped", Counter, "KV events dropped from a full event_buffer because nobody took them"),
    stat("token_hit_rate", Gauge, "Fraction of looked-up prompt tokens served from the cache"),
    stat("disabled", Gauge, "1 when the cache disabled itself after max_errors failures"),
    stat("page_bytes", Gauge, "Bytes of one page (all layers of one KV block)"),
    stat("state_bytes", Gauge, "Bytes of one per-sequence state"),
    stat("host_bytes_pinned", Gauge, "Host bytes pinned so far"),
    stat("copies_in_flight", Gauge, "Copies launched and not yet retired"),
    stat("l3_lookups", Counter, "Requests that looked for missing pages in L3"),
    stat("l3_hits", Counter, "L3 fetches that brought pages into the host pool"),
    stat("l3_misses", Counter, "L3 lookups that found nothing to fetch, or no room"),
    stat("l3_pages_loaded", Counter, "Pages fetched from L3"),
    stat("l3_states_loaded", Counter, "States fetched from L3"),
    stat("l3_gets_failed", Counter, "L3 fetches that failed (an object not read or wrong, or the Store failing)"),
    stat("l3_deadline_passed", Counter, "L3 fetches not ready within l3_deadline_ms"),
    stat("l3_puts_submitted", Counter, "L3 objects submitted for a put"),
    stat("l3_errors", Counter, "Failures of the L3 tier"),
    stat("l3_get_seconds", Counter, "Seconds spent in L3 gets"),
    stat("l3_exists_seconds", Counter, "Seconds spent asking L3 which objects exist"),
    // The object path's counters (rust/l3/path.rs), the same for kvtier's tier, SGLang's and vLLM's.
    stat("l3_objects_put", Counter, "L3 objects put"),
    stat("l3_puts_present", Counter, "L3 puts skipped: the Store has the object"),
    stat("l3_puts_failed", Counter, "L3 objects (or put jobs) not stored"),
    stat("l3_bytes_put", Counter, "Bytes put to L3"),
    stat("l3_objects_loaded", Counter, "L3 objects got whole and verified"),
    stat("l3_bytes_loaded", Counter, "Bytes got from L3, verified"),
    stat("l3_objects_missing", Counter, "L3 objects not in the Store when got"),
    stat("l3_objects_lost", Counter, "L3 objects not read for a transient Store failure (never removed)"),
    stat("l3_rejected", Counter, "L3 objects that failed their header, length or digest check (never served)"),
    stat("l3_rejected_removed", Counter, "Rejected L3 objects removed from the Store so an honest writer can put them"),
    stat("l3_store_errors", Counter, "L3 Store calls that failed as a whole"),
    stat("l3_connected", Gauge, "1 while the L3 Store is connected"),
    stat("l3_breaker_open", Gauge, "1 while the L3 breaker is open (Store calls skipped)"),
];

#[cfg(test)]
mod table_tests {
    use super::TABLE;

    #[test]
    fn names_are_unique_snake_case_and_helped() {
        let mut names: Vec<&str> = TABLE.iter().map(|s| s.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), TABLE.len(), "a statistic is listed twice");
        for s in TABLE {
            assert!(s.name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'), "{}", s.name);
            assert!(!s.help.is_empty(), "{} has no help", s.name);
        }
    }
}
