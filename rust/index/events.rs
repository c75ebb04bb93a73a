//! KV events: what a cache stored into or removed from a tier, for routers that place requests by what each
//! instance holds. One event names pages of one tier (a medium) that became resident or left it, in the order they
//! happened, with a sequence number; the log is bounded (the oldest events are dropped beyond it, and counted).
use std::collections::VecDeque;

use crate::index::chain::Key;

/// The tier an event is about, named as vLLM's KV events name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Medium {
    /// The host page pool.
    Cpu,
    /// L3 (Mooncake Store).
    Storage,
}

impl Medium {
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "CPU",
            Self::Storage => "STORAGE",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// 0, 1, 2, ... per log: a gap in what a reader took means events were dropped.
    pub seq: u64,
    /// Pages left the tier (else they became resident in it).
    pub removed: bool,
    pub medium: Medium,
    /// The pages' keys, in prompt order for a store.
    pub keys: Vec<Key>,
    /// The keys' bytes where engine keys are in use (the engine's key, or a chain key's 16 bytes big-endian);
    /// empty when every key is a chain key.
    pub names: Vec<Vec<u8>>,
}

/// The events not yet taken, at most `bound` of them.
#[derive(Debug, Default)]
pub struct EventLog {
    bound: usize,
    events: VecDeque<Event>,
    next_seq: u64,
    dropped: u64,
}

impl EventLog {
    /// A log of at most `bound` events; 0 records nothing.
    pub fn new(bound: usize) -> Self {
        Self { bound, ..Self::default() }
    }

    /// Records an event (nothing for no keys, or a log of bound 0); beyond the bound the oldest is dropped.
    pub fn record(&mut self, removed: bool, medium: Medium, keys: Vec<Key>, names: Vec<Vec<u8>>) {
        if !self.enabled() || keys.is_empty() {
            return;
        }
        if self.events.len() == self.bound {
            self.events.pop_front();
            self.dropped += 1;
        }
        self.events.push_back(Event { seq: self.next_seq, removed, medium, keys, names });
        self.next_seq += 1;
    }

    /// Whether events are recorded at all (a bound above 0).
    pub fn enabled(&self) -> bool {
        self.bound > 0
    }

    /// The events recorded since the last take, oldest first.
    pub fn take(&mut self) -> Vec<Event> {
        self.events.drain(..).collect()
    }

    /// Events dropped because nobody took them in time.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_log_drops_the_oldest_and_counts_them() {
        let mut log = EventLog::new(2);
        for k in 1..=3 {
            log.record(false, Medium::Cpu, vec![k], Vec::new());
        }
        log.record(true, Medium::Storage, Vec::new(), Vec::new());
        let got = log.take();
        assert_eq!(got.iter().map(|e| (e.seq, e.keys[0])).collect::<Vec<_>>(), vec![(1, 2), (2, 3)]);
        assert_eq!(log.dropped(), 1);
        assert!(log.take().is_empty());
        let mut off = EventLog::new(0);
        off.record(false, Medium::Cpu, vec![1], Vec::new());
        assert!(off.take().is_empty() && off.dropped() == 0);
    }
}
