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
    pub pages_stored: u64,
    pub pages_loaded: u64,
    pub states_stored: u64,
    pub states_loaded: u64,
    /// Failures the cache handled (a copy that could not be launched, an engine callback that raised).
    pub errors: u64,
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
