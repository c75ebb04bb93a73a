//! kvtier's core: the index bookkeeping of a tiered KV-cache (hash chains, host page and state pools, lookup /
//! store planning, L3 keys) and the page copies between a GPU pool and pinned host memory.
pub mod cache;
pub mod error;
pub mod executor;
pub mod index;
pub mod l3;
pub mod par;

pub use error::{Error, Result};
pub use index::chain::{BlockHasher, Chain, HashKind, Key};
pub use index::pool::Pool;
pub use index::stats::Stats;
pub use index::{Config, Index, LoadPlan, Lookup, StorePlan};
