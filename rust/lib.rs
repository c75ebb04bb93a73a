//! kvtier's core: the index bookkeeping of a tiered KV-cache (hash chains, host page and state pools, lookup /
//! store planning, L3 keys) and the page copies between a GPU pool and pinned host memory.
pub mod cache;
pub mod chain;
pub mod copy;
pub mod cuda;
pub mod error;
pub mod events;
pub mod executor;
pub mod hostmem;
pub mod index;
pub mod l3;
pub mod l3path;
pub mod l3plan;
pub mod order;
pub mod par;
pub mod policy;
pub mod pool;
pub mod stats;

#[cfg(feature = "python")]
mod py;

pub use chain::{BlockHasher, Chain, HashKind, Key};
pub use error::{Error, Result};
pub use index::{Config, Index, LoadPlan, Lookup, StorePlan};
pub use pool::Pool;
pub use stats::Stats;
