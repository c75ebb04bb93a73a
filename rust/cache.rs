//! One engine call, one call into the core: a resume, a store, a poll of a cache whose index and executor live in
//! one process. Each call checks its arguments, plans with the index, has the executor order and launch the copies
//! with the engine's stream, records the ticket and, when anything fails after the plan, aborts the ticket itself.
//! The engine's own work during a call (allocating blocks, its state kernels) comes back through `Hooks`.
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{invalid, Error, Result};
use crate::executor::Executor;
use crate::index::chain::{Check, TokenIds};
use crate::index::{Index, Lookup, Ready};
use crate::l3::plan::wants_fetch;

/// The index of a cache, shared with the L3 tier's planner.
pub type SharedIndex = Arc<Mutex<Index>>;

/// Locks an index (a panic while holding the lock would be a bug; the bookkeeping is still consistent to read).
pub fn lock(index: &SharedIndex) -> MutexGuard<'_, Index> {
    index.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the engine's allocation of a hit's GPU blocks answered.
pub enum Allocation {
    /// The sequence's block table (its first blocks receive the hit).
    Blocks(Vec<i32>),
    /// Not now: retry later.
    NotNow,
    /// Never: the sequence cannot fit (the scheduler rejects it).
    Never,
}

/// The engine's work during a call.
pub trait Hooks {
    /// Allocates the sequence's GPU blocks for a hit.
    fn allocate(&mut self) -> Result<Allocation>;
    /// Fills staging row `row` with the sequence's state at token `boundary` (the engine's kernel).
    fn select_state(&mut self, row: usize, boundary: usize) -> Result<()>;
    /// Loads staging row `row` into the sequence's state at token `boundary` (the engine's kernel).
    fn load_state(&mut self, row: usize, boundary: usize) -> Result<()>;
}

/// A prompt's ids as the engine holds them, read as a call needs them: `Check::Ends` needs the first and last of
/// the `hashed` tokens and those after them, `Check::Full` every id.
pub trait Prompt {
    fn ids(&mut self, check: Check, hashed: usize) -> Result<&dyn TokenIds>;
}

/// A prompt held as ids in memory (an array): every check reads it in place.
impl<T: TokenIds> Prompt for T {
    fn ids(&mut self, _check: Check, _hashed: usize) -> Result<&dyn TokenIds> {
        Ok(self)
    }
}

/// The request an engine call is for: its id and the namespace its chain is rooted in.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    pub id: &'a str,
    pub namespace: &'a [u8],
}

/// What a resume of this prompt would restore now (`Index::lookup`): the prompt's ends are compared with the
/// request's chain and its new blocks hashed; with `verify` (a hit is loaded next) a hit also compares every
/// token. The prompt is read before the index is locked: reading a list takes the GIL, and no lock may be held
/// while waiting for it.
pub fn lookup(index: &SharedIndex, request: Request<'_>, prompt: &mut dyn Prompt, verify: bool) -> Result<Lookup> {
    let hashed = lock(index).hashed_tokens(request.id);
    let ids = prompt.ids(Check::Ends, hashed)?;
    let look = lock(index).lookup(request.id, request.namespace, ids)?;
    if verify && look.hit_tokens > 0 {
        verify_prompt(index, request, prompt)?;
    }
    Ok(look)
}

/// Compares every token hashed for the request with the prompt (`Error::PromptMismatch` when it does not extend
/// them), before anything is loaded from the request's chain.
pub fn verify_prompt(index: &SharedIndex, request: Request<'_>, prompt: &mut dyn Prompt) -> Result<()> {
    let ids = prompt.ids(Check::Full, 0)?;
    lock(index).verify(request.id, request.namespace, ids)
}

/// What a resume did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resumed {
    /// The first tokens restored (their copies enqueued).
    Hit(usize),
    /// Nothing to restore, or a hit whose pages left the host before the load (a stale lookup), or a sequence that
    /// can never be allocated.
    Miss,
    /// The engine could not allocate blocks now: retry later (the request is counted as deferred).
    Retry,
    /// Ask L3 first: whole groups lie beyond the host's ready run (nothing was allocated).
    Fetch { ready_pages: usize, limit_pages: usize },
}

/// What a store did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    /// Copies enqueued: pages and states that become hits once they complete (`poll`).
    Copying,
    /// Nothing to copy: every page and state was present (only touched), or the prompt is below a hit.
    Present,
    /// Something to store found no host slot; `pinning`: the host pool was still being pinned.
    Skipped { pinning: bool },
}

/// A cache's index and executor, driven one engine call at a time. No lock is held while the engine's callbacks
/// run, so a callback may call the cache again (an allocation that frees and releases another sequence's blocks).
pub struct Cache {
    index: SharedIndex,
    exec: Mutex<Executor>,
}

impl Cache {
    pub fn new(index: SharedIndex, exec: Executor) -> Result<Self> {
        {
            let ix = lock(&index);
            let page_bytes = exec.pages().page_bytes();
            if ix.config().page_slots > exec.pages().host().slots() {
                return Err(invalid(format!(
                    "the index has {} page slots, the host pool {}",
                    ix.config().page_slots,
                    exec.pages().host().slots()
                )));
            }
            if page_bytes != exec.pages().host().slot_bytes() {
                return Err(invalid("the host page pool's slots are not pages of the GPU pool"));
            }
            if (ix.config().state_slots > 0) != exec.states().is_some() {
                return Err(invalid("a cache has a state pool exactly when its index has state slots"));
            }
        }
        Ok(Self { index, exec: Mutex::new(exec) })
    }

    pub fn index(&self) -> &SharedIndex {
        &self.index
    }
    /// The executor, locked for one step of a call (never across an engine callback).
    pub fn executor(&self) -> MutexGuard<'_, Executor> {
        self.exec.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Looks a prompt up and, on a hit, fills the sequence's first blocks (and state) from the host.
    ///
    /// `fetch_group_pages`: the L3 tier's group size while the request has not consulted it; a lookup whose
    /// ready run stops before whole groups within the cap answers `Fetch` (nothing is allocated). A hit compares
    /// every token of the prompt with the request's chain before the engine allocates anything.
    pub fn resume(
        &self,
        request: Request<'_>,
        prompt: &mut dyn Prompt,
        hooks: &mut dyn Hooks,
        engine: u64,
        fetch_group_pages: Option<usize>,
    ) -> Result<Resumed> {
        let look = lookup(&self.index, request, prompt, false)?;
        if fetch_group_pages.is_some_and(|g| wants_fetch(g, look.ready_pages, look.limit_pages)) {
            return Ok(Resumed::Fetch { ready_pages: look.ready_pages, limit_pages: look.limit_pages });
        }
        let hit = look.hit_tokens;
        if hit == 0 {
            return Ok(Resumed::Miss);
        }
        verify_prompt(&self.index, request, prompt)?;
        let request_id = request.id;
        let table = match hooks.allocate()? {
            Allocation::Never => return Ok(Resumed::Miss),
            Allocation::NotNow => {
                lock(&self.index).defer(request_id)?;
                return Ok(Resumed::Retry);
            }
            Allocation::Blocks(table) => table,
        };
        let bs = lock(&self.index).config().block_size;
        let blocks = first_blocks(&table, hit / bs, "allocate()'s block table")?;
        self.executor().check_blocks(blocks, "allocate()'s block table")?;
        let plan = match lock(&self.index).begin_load(request_id, hit) {
            Err(Error::Stale(_)) => return Ok(Resumed::Miss), // an L3 fetch evicted the pages since the lookup
            other => other?,
        };
        let slots: Vec<i32> = plan.page_slots.iter().map(|&s| s as i32).collect();
        let copied = (|| {
            self.executor().load_pages(&slots, blocks, engine)?;
            if let Some(state) = plan.state_slot {
                self.executor().states_to_gpu(&[state as i32], &[0], engine)?;
                hooks.load_state(0, hit)?;
            }
            self.executor().record(plan.ticket, false, plan.state_slot.is_some(), engine)
        })();
        self.abort_on_error(plan.ticket, copied)?;
        Ok(Resumed::Hit(hit))
    }

    /// The write-through store of a prompt whose prefill has run: its full blocks (GPU blocks `table`, of which
    /// the first `tokens / block_size` are read) and the states at the last boundaries still in the ring
    /// (`seq_len`: the sequence's length now, default the prompt's). The copies are enqueued; `poll` makes them
    /// hits once they completed.
    pub fn store(
        &self,
        request: Request<'_>,
        prompt: &mut dyn Prompt,
        table: &[i32],
        seq_len: Option<usize>,
        hooks: &mut dyn Hooks,
        engine: u64,
    ) -> Result<Stored> {
        let Request { id: request_id, namespace } = request;
        let tokens = prompt.ids(Check::Full, 0)?;
        let n = tokens.len();
        let (plan, pinning, skipped) = {
            let mut ix = lock(&self.index);
            let blocks = full_blocks(table, n, ix.config().block_size, "block_table")?;
            self.executor().check_blocks(blocks, "block_table")?;
            let before = ix.stats().store_skipped;
            let plan = ix.plan_store(request_id, namespace, tokens, seq_len.unwrap_or(n))?;
            (plan, ix.pinning(), ix.stats().store_skipped > before)
        };
        if plan.page_slots.is_empty() && plan.state_slots.is_empty() {
            lock(&self.index).complete(plan.ticket)?; // present entries were only touched
            return Ok(if skipped { Stored::Skipped { pinning } } else { Stored::Present });
        }
        let copied = (|| {
            let src: Vec<i32> = plan.page_indices.iter().map(|&i| table[i as usize]).collect();
            let dst: Vec<i32> = plan.page_slots.iter().map(|&s| s as i32).collect();
            if !src.is_empty() {
                self.executor().store_pages(&src, &dst, request_id, engine)?;
            }
            let rows = self.executor().staging_rows().max(1);
            for (bounds, slots) in plan.state_boundaries.chunks(rows).zip(plan.state_slots.chunks(rows)) {
                for (row, &b) in bounds.iter().enumerate() {
                    hooks.select_state(row, b)?;
                }
                let rows: Vec<i32> = (0..bounds.len() as i32).collect();
                let slots: Vec<i32> = slots.iter().map(|&s| s as i32).collect();
                self.executor().states_to_host(&rows, &slots, engine)?;
            }
            self.executor().record(plan.ticket, true, !plan.state_slots.is_empty(), engine)
        })();
        self.abort_on_error(plan.ticket, copied)?;
        Ok(Stored::Copying)
    }

    /// A failure after planning aborts the plan's ticket (its new entries are discarded, held ones released)
    /// before the error is returned.
    fn abort_on_error(&self, ticket: u64, result: Result<()>) -> Result<()> {
        if result.is_err() {
            lock(&self.index).abort(ticket)?;
        }
        result
    }

    /// Retires finished copies: stored entries become ready, loaded ones are released. Returns what each completed
    /// store made ready (what an L3 tier puts). Never blocks.
    pub fn poll(&self) -> Result<Vec<Ready>> {
        let done = self.executor().poll()?;
        self.complete(done)
    }

    fn complete(&self, tickets: Vec<u64>) -> Result<Vec<Ready>> {
        if tickets.is_empty() {
            return Ok(Vec::new());
        }
        let mut ix = lock(&self.index);
        let mut ready = Vec::new();
        for t in tickets {
            ready.extend(ix.complete(t)?);
        }
        Ok(ready)
    }

    /// Before layer part `layer` reads its KV: the engine's stream waits for its pending layer-wise loads.
    pub fn wait_layer(&self, layer: i64, engine: u64) -> Result<()> {
        self.executor().wait_layer(layer, engine)
    }

    /// Whether `wait_layer(layer)` (None: `wait_loads`) has a load to wait for: an engine asks before it looks
    /// its stream up, which costs more than this.
    pub fn waiting(&self, layer: Option<i64>) -> Result<bool> {
        self.executor().waiting(layer)
    }

    /// `wait_layer` for every layer part.
    pub fn wait_loads(&self, engine: u64) -> Result<()> {
        self.executor().wait_loads(engine)
    }

    /// Before the engine rewrites `blocks`: its stream waits for the pending stores that read them.
    pub fn release(&self, blocks: &[i32], engine: u64) -> Result<()> {
        self.executor().release(blocks, engine)
    }

    /// The request is gone: the engine's stream waits for its pending stores, and its chain is dropped. Returns
    /// whether the index knew it.
    pub fn forget(&self, request_id: &str, engine: u64) -> Result<bool> {
        self.executor().forget(request_id, engine)?;
        Ok(lock(&self.index).forget(request_id))
    }

    /// Waits for every copy in flight and completes its ticket (closing the cache).
    pub fn drain(&self) -> Result<Vec<Ready>> {
        let done = self.executor().wait_all()?;
        self.complete(done)
    }
}

/// The first `needed` ids of a block table.
fn first_blocks<'a>(table: &'a [i32], needed: usize, what: &str) -> Result<&'a [i32]> {
    table.get(..needed).ok_or_else(|| invalid(format!("{what} has {} blocks, {needed} are needed", table.len())))
}

/// The GPU blocks of a prompt's full blocks in a block table: its first `tokens / block_size` ids, none negative.
/// An executor that copies them checks them against its pool too (`Executor::check_blocks`).
pub fn full_blocks<'a>(table: &'a [i32], tokens: usize, block_size: usize, what: &str) -> Result<&'a [i32]> {
    let blocks = first_blocks(table, tokens / block_size, what)?;
    match blocks.iter().position(|&b| b < 0) {
        Some(i) => Err(invalid(format!("{what}[{i}] = {} is negative", blocks[i]))),
        None => Ok(blocks),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc as StdArc;

    use super::*;
    use crate::executor::block_table;
    use crate::executor::copy::{CopyOptions, GpuPool, PageCopier};
    use crate::executor::cuda::Layer;
    use crate::executor::hostmem::{HostPool, PinMethod};
    use crate::index::Config;

    const BS: usize = 4;
    const PAGE: u64 = 64;

    /// A CPU "GPU pool" of `blocks` pages (block b filled with b + 1), a cache over it and its memory.
    fn setup(blocks: u32, page_slots: u32, state_slots: u32) -> (Vec<u8>, Vec<u8>, Cache) {
        let mut gpu: Vec<u8> = (0..blocks as usize * PAGE as usize).map(|i| (i / PAGE as usize + 1) as u8).collect();
        let copier = |base: u64, n: u32, bytes: u64, host: StdArc<HostPool>| {
            let pool = GpuPool {
                layers: vec![Layer { base, stride: bytes }],
                num_blocks: n,
                segment_bytes: bytes,
                device: None,
            };
            // SAFETY: the test's vectors outlive the cache.
            unsafe { PageCopier::new(pool, host, CopyOptions::default()).unwrap() }
        };
        let pages = StdArc::new(HostPool::new(page_slots, PAGE, 1 << 16, Some(false), PinMethod::Auto).unwrap());
        pages.grow_to(page_slots).unwrap();
        let mut staging = vec![0u8; 2 * 16];
        let states = (state_slots > 0).then(|| {
            let host = StdArc::new(HostPool::new(state_slots, 16, 1 << 16, Some(false), PinMethod::Auto).unwrap());
            host.grow_to(state_slots).unwrap();
            copier(staging.as_mut_ptr() as u64, 2, 16, host)
        });
        let exec =
            Executor::new(copier(gpu.as_mut_ptr() as u64, blocks, PAGE, pages), None, states, true, false).unwrap();
        let cfg = Config {
            min_hit_tokens: BS,
            state_lookback_blocks: 2,
            ring_slack: 100,
            ..Config::new(page_slots, state_slots, BS)
        };
        let index = StdArc::new(Mutex::new(Index::new(cfg, page_slots, state_slots).unwrap()));
        (gpu, staging, Cache::new(index, exec).unwrap())
    }

    struct Engine {
        table: Option<Vec<i32>>,
        fail_state: bool,
        states: Vec<(String, usize, usize)>,
    }

    impl Hooks for Engine {
        fn allocate(&mut self) -> Result<Allocation> {
            Ok(self.table.clone().map_or(Allocation::NotNow, Allocation::Blocks))
        }
        fn select_state(&mut self, row: usize, boundary: usize) -> Result<()> {
            if self.fail_state {
                return Err(Error::Copy("the engine's state kernel failed".into()));
            }
            self.states.push(("select".into(), row, boundary));
            Ok(())
        }
        fn load_state(&mut self, row: usize, boundary: usize) -> Result<()> {
            self.states.push(("load".into(), row, boundary));
            Ok(())
        }
    }

    fn req(id: &str) -> Request<'_> {
        Request { id, namespace: b"" }
    }

    fn engine(table: Option<Vec<i32>>) -> Engine {
        Engine { table, fail_state: false, states: Vec::new() }
    }

    #[test]
    fn a_store_then_a_resume_restores_the_pages_in_one_call_each() {
        let (mut gpu, _staging, c) = setup(16, 8, 0);
        let mut prompt: Vec<i32> = (0..13).collect();
        let mut e = engine(None);
        assert_eq!(c.store(req("a"), &mut prompt, &[0, 1, 2, 9], None, &mut e, 0).unwrap(), Stored::Copying);
        assert_eq!(c.poll().unwrap().len(), 1, "a CPU copy completes at once");
        gpu[10 * PAGE as usize..13 * PAGE as usize].fill(0);
        let mut e = engine(Some(vec![10, 11, 12, 15]));
        assert_eq!(c.resume(req("b"), &mut prompt, &mut e, 0, None).unwrap(), Resumed::Hit(12));
        for (i, want) in [1u8, 2, 3].iter().enumerate() {
            assert!(gpu[(10 + i) * PAGE as usize..(11 + i) * PAGE as usize].iter().all(|b| b == want));
        }
        c.poll().unwrap();
        lock(c.index()).check().unwrap();
        assert_eq!(c.store(req("b"), &mut prompt, &[0, 1, 2], None, &mut e, 0).unwrap(), Stored::Present);
    }

    #[test]
    fn a_miss_a_deferral_and_an_l3_consultation_allocate_nothing() {
        let (_gpu, _staging, c) = setup(16, 8, 0);
        let mut prompt: Vec<i32> = (0..13).collect();
        let mut none = engine(None);
        assert_eq!(c.resume(req("a"), &mut prompt, &mut none, 0, None).unwrap(), Resumed::Miss);
        assert_eq!(
            c.resume(req("a"), &mut prompt, &mut none, 0, Some(2)).unwrap(),
            Resumed::Fetch { ready_pages: 0, limit_pages: 3 }
        );
        c.store(req("s"), &mut prompt, &[0, 1, 2], None, &mut none, 0).unwrap();
        c.poll().unwrap();
        assert_eq!(c.resume(req("a"), &mut prompt, &mut none, 0, None).unwrap(), Resumed::Retry);
        assert_eq!(lock(c.index()).stats().deferred, 1);
    }

    #[test]
    fn a_bad_block_table_is_refused_before_anything_is_planned_or_copied() {
        let (_gpu, _staging, c) = setup(16, 8, 0);
        let mut prompt: Vec<i32> = (0..13).collect();
        let mut e = engine(None);
        let err = c.store(req("a"), &mut prompt, &[0, 1], None, &mut e, 0).unwrap_err();
        assert!(err.to_string().contains("block_table has 2 blocks, 3 are needed"), "{err}");
        let err = c.store(req("a"), &mut prompt, &[0, 1, 16], None, &mut e, 0).unwrap_err();
        assert!(err.to_string().contains("block id 16 is outside the GPU pool of 16 blocks"), "{err}");
        let err = full_blocks(&[0, -1, 2, 3], 13, BS, "block_table").unwrap_err();
        assert_eq!(err.to_string(), "block_table[1] = -1 is negative");
        assert_eq!(full_blocks(&[0, 1, 2, -1], 13, BS, "block_table").unwrap(), &[0, 1, 2], "ids past the prompt's");
        let ix = lock(c.index());
        assert_eq!((ix.requests(), ix.in_flight()), (0, 0));
        drop(ix);
        c.store(req("a"), &mut prompt, &[0, 1, 2], None, &mut e, 0).unwrap();
        c.poll().unwrap();
        let mut short = engine(Some(vec![3, 4]));
        let err = c.resume(req("b"), &mut prompt, &mut short, 0, None).unwrap_err();
        assert!(err.to_string().contains("allocate()'s block table has 2 blocks, 3 are needed"), "{err}");
        assert_eq!(lock(c.index()).in_flight(), 0);
    }

    #[test]
    fn a_block_table_beyond_int32_or_negative_is_refused_with_the_pools_message() {
        assert_eq!(block_table([0, 5, 1 << 20], "block_table", 16).unwrap(), vec![0, 5, 1 << 20]);
        for bad in [-1, 1 << 31] {
            let err = block_table([0, bad], "allocate()'s block table", 16).unwrap_err();
            let want = format!("allocate()'s block table: block id {bad} is outside the GPU pool of 16 blocks");
            assert_eq!(err.to_string(), want);
        }
    }

    /// A prompt that records which checks a call read it for.
    struct Recorded {
        ids: Vec<i32>,
        reads: Vec<Check>,
    }

    impl Prompt for Recorded {
        fn ids(&mut self, check: Check, _hashed: usize) -> Result<&dyn TokenIds> {
            self.reads.push(check);
            Ok(&self.ids)
        }
    }

    #[test]
    fn a_lookup_compares_the_ends_and_with_verify_every_token_of_a_hit() {
        let (_gpu, _staging, c) = setup(16, 8, 0);
        let mut prompt: Vec<i32> = (0..13).collect();
        let mut p = Recorded { ids: prompt.clone(), reads: Vec::new() };
        assert_eq!(lookup(c.index(), req("a"), &mut p, true).unwrap().hit_tokens, 0);
        assert_eq!(p.reads, vec![Check::Ends], "a miss is never verified");
        c.store(req("s"), &mut prompt, &[0, 1, 2], None, &mut engine(None), 0).unwrap();
        c.poll().unwrap();
        p.reads.clear();
        assert_eq!(lookup(c.index(), req("a"), &mut p, false).unwrap().hit_tokens, 12);
        assert_eq!(p.reads, vec![Check::Ends]);
        p.reads.clear();
        assert_eq!(lookup(c.index(), req("a"), &mut p, true).unwrap().hit_tokens, 12);
        assert_eq!(p.reads, vec![Check::Ends, Check::Full]);
        // A token in the middle changed: the ends agree, every token does not.
        p.ids[5] = 99;
        assert_eq!(lookup(c.index(), req("a"), &mut p, false).unwrap().hit_tokens, 12);
        let err = lookup(c.index(), req("a"), &mut p, true).unwrap_err();
        assert!(matches!(err, Error::PromptMismatch { .. }), "{err}");
    }

    #[test]
    fn states_go_through_the_staging_rows_and_a_failing_state_kernel_aborts_the_ticket() {
        let (_gpu, _staging, c) = setup(16, 8, 4);
        let mut prompt: Vec<i32> = (0..13).collect();
        let mut e = engine(None);
        c.store(req("a"), &mut prompt, &[0, 1, 2], Some(13), &mut e, 0).unwrap();
        assert_eq!(e.states, vec![("select".into(), 0, 12), ("select".into(), 1, 8)]);
        c.poll().unwrap();
        let mut e = engine(Some(vec![5, 6, 7]));
        assert_eq!(c.resume(req("b"), &mut prompt, &mut e, 0, None).unwrap(), Resumed::Hit(12));
        assert_eq!(e.states, vec![("load".into(), 0, 12)]);
        let mut failing = engine(None);
        failing.fail_state = true;
        let other: Vec<i32> = (100..113).collect();
        assert!(c.store(req("c"), &mut other.clone(), &[3, 4, 5], Some(13), &mut failing, 0).is_err());
        let ix = lock(c.index());
        assert_eq!(ix.in_flight(), 1, "only b's load is in flight: c's ticket was aborted");
        ix.check().unwrap();
    }
}
