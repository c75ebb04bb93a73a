//! The worker half of a cache: the host pools and their copiers, kvtier's copy streams ordered with the engine's
//! (`order`), and the completion queue. It holds no bookkeeping of keys: it copies what a plan names and records
//! the plan's ticket, which completes once its copies have.
//!
//! Three copiers share it: `pages` (the GPU pool and the host page pool), `parts` (a page-first pool seen as one
//! tensor a layer part, for layer-wise loads; without it layer-wise loads go through `pages`, a layer-first pool
//! being one tensor a layer already) and `states` (a GPU staging buffer, which the engine's own kernels fill and
//! drain, and the host state pool). Without copy streams, or on a CPU pool, every copy runs on the engine's stream
//! (a memcpy on the CPU, complete on return) and the ordering calls do nothing.
pub mod copy;
pub mod cuda;
pub mod hostmem;
pub mod jobs;
pub mod order;

use crate::error::{invalid, Error, Result};
use crate::executor::copy::{CompletionQueue, Direction, PageCopier, Used};
use crate::executor::cuda::{Event, Stream};
use crate::executor::order::{Device, Order};

/// A block table as the engine holds it (any integers), as the int32 GPU block ids the copies take. An id that is
/// negative or beyond int32 is refused here; `Executor::check_blocks` checks the ids a call uses against the pool
/// of `num_blocks` blocks, with the same message.
pub fn block_table(ids: impl IntoIterator<Item = i64>, what: &str, num_blocks: u32) -> Result<Vec<i32>> {
    ids.into_iter()
        .map(|v| i32::try_from(v).ok().filter(|&b| b >= 0).ok_or_else(|| outside_pool(what, v, num_blocks)))
        .collect()
}

fn outside_pool(what: &str, id: i64, num_blocks: u32) -> Error {
    invalid(format!("{what}: block id {id} is outside the GPU pool of {num_blocks} blocks"))
}

/// A CUDA device as `Order` needs it.
pub struct Cuda(i32);

impl Device for Cuda {
    type Event = Event;
    fn record(&self, stream: u64) -> Result<Event> {
        let ev = Event::new(self.0)?;
        ev.record(stream)?;
        Ok(ev)
    }
    fn wait(&self, event: &Event, stream: u64) -> Result<()> {
        event.wait_in(stream)
    }
    fn done(&self, event: &Event) -> Result<bool> {
        event.done()
    }
}

/// kvtier's two copy streams (stores, loads) and their ordering with the engine's stream.
struct CopyStreams {
    order: Order<Cuda>,
    // Owned here: `order` holds their raw handles. Declared after it, so dropped after it.
    _streams: [Stream; 2],
}

/// A seam for fault tests: asked before each copy batch; `true` makes the batch fail as a failed launch does.
pub type CopyFault = Box<dyn FnMut() -> Result<bool> + Send>;

pub struct Executor {
    pages: PageCopier,
    parts: Option<PageCopier>,
    states: Option<PageCopier>,
    queue: CompletionQueue,
    streams: Option<CopyStreams>,
    layerwise: bool,
    fault: Option<CopyFault>,
}

impl Executor {
    /// Copy streams are used only on a CUDA pool and when asked for; layer-wise loads only with copy streams.
    pub fn new(
        pages: PageCopier,
        parts: Option<PageCopier>,
        states: Option<PageCopier>,
        copy_streams: bool,
        layerwise_loads: bool,
    ) -> Result<Self> {
        let device = pages.pool().device;
        if let Some(p) = &parts {
            if p.pool().device != device || p.pool().num_blocks != pages.pool().num_blocks {
                return Err(invalid("the layer parts of a pool must be on its device and have its blocks"));
            }
        }
        let streams = match device {
            Some(d) if copy_streams => {
                let (d2h, h2d) = (Stream::new(d)?, Stream::new(d)?);
                let layers = parts.as_ref().unwrap_or(&pages).pool().layers.len();
                let order = Order::new(Cuda(d), d2h.handle(), h2d.handle(), pages.pool().num_blocks, layers);
                Some(CopyStreams { order, _streams: [d2h, h2d] })
            }
            _ => None,
        };
        Ok(Self {
            queue: CompletionQueue::new(device)?,
            layerwise: layerwise_loads && streams.is_some(),
            streams,
            pages,
            parts,
            states,
            fault: None,
        })
    }

    /// Installs a fault seam (tests and the soak): see `CopyFault`.
    pub fn set_copy_fault(&mut self, fault: Option<CopyFault>) {
        self.fault = fault;
    }

    /// Switches layer-wise loads on or off between loads (they need copy streams).
    pub fn set_layerwise_loads(&mut self, on: bool) -> Result<()> {
        if on && self.streams.is_none() {
            return Err(invalid("layer-wise loads need copy streams (a CUDA pool and copy_streams=true)"));
        }
        self.layerwise = on;
        Ok(())
    }

    fn inject(&mut self) -> Result<()> {
        let injected = match &mut self.fault {
            Some(f) => f()?,
            None => false,
        };
        if injected {
            return Err(Error::Copy("an injected copy fault".into()));
        }
        Ok(())
    }

    pub fn pages(&self) -> &PageCopier {
        &self.pages
    }
    pub fn states(&self) -> Option<&PageCopier> {
        self.states.as_ref()
    }
    /// Whether copies run on kvtier's own streams.
    pub fn copy_streams(&self) -> bool {
        self.streams.is_some()
    }
    pub fn layerwise_loads(&self) -> bool {
        self.layerwise
    }
    /// The raw stream handles of stores and loads (0 without copy streams).
    pub fn stream_handles(&self) -> (u64, u64) {
        self.streams.as_ref().map_or((0, 0), |s| (s.order.d2h(), s.order.h2d()))
    }

    /// The layer parts a layer-wise load is issued in (and `wait_layer` takes).
    pub fn num_layers(&self) -> usize {
        self.parts.as_ref().unwrap_or(&self.pages).pool().layers.len()
    }

    /// Checks that the first ids of a block table name blocks of the GPU pool.
    pub fn check_blocks(&self, blocks: &[i32], what: &str) -> Result<()> {
        let n = self.pages.pool().num_blocks;
        match blocks.iter().find(|&&b| b < 0 || b as u32 >= n) {
            Some(&b) => Err(outside_pool(what, b.into(), n)),
            None => Ok(()),
        }
    }

    /// GPU blocks to host slots, after the engine's work enqueued so far; the engine does not wait.
    pub fn store_pages(&mut self, gpu_ids: &[i32], host_slots: &[i32], request_id: &str, engine: u64) -> Result<Used> {
        self.pages.validate(Direction::ToHost, gpu_ids, host_slots)?;
        self.inject()?;
        let all = 0..self.pages.pool().layers.len();
        let Some(s) = &mut self.streams else {
            return self.pages.launch(Direction::ToHost, gpu_ids, host_slots, engine, all);
        };
        s.order.before_store(engine)?;
        let used = self.pages.launch(Direction::ToHost, gpu_ids, host_slots, s.order.d2h(), all)?;
        s.order.after_store(gpu_ids, request_id)?;
        Ok(used)
    }

    /// Host slots to GPU blocks, after the blocks' previous users; the engine's stream waits for them before its
    /// next kernels (whole loads), or a layer part at a time in `wait_layer` (layer-wise loads).
    pub fn load_pages(&mut self, host_slots: &[i32], gpu_ids: &[i32], engine: u64) -> Result<Used> {
        self.pages.validate(Direction::ToGpu, gpu_ids, host_slots)?;
        self.inject()?;
        let all = 0..self.pages.pool().layers.len();
        let Some(s) = &mut self.streams else {
            return self.pages.launch(Direction::ToGpu, gpu_ids, host_slots, engine, all);
        };
        s.order.before_load(gpu_ids, engine)?;
        if !self.layerwise {
            let used = self.pages.launch(Direction::ToGpu, gpu_ids, host_slots, s.order.h2d(), all)?;
            s.order.after_load(engine)?;
            return Ok(used);
        }
        let by_layer = self.parts.as_ref().unwrap_or(&self.pages);
        let mut used = Used::Memcpy;
        for layer in 0..by_layer.pool().layers.len() {
            used = by_layer.launch(Direction::ToGpu, gpu_ids, host_slots, s.order.h2d(), layer..layer + 1)?;
            s.order.after_load_layer(layer)?;
        }
        Ok(used)
    }

    /// Staging rows to host state slots, on the engine's stream (the engine's kernels filled the rows).
    pub fn states_to_host(&self, rows: &[i32], slots: &[i32], engine: u64) -> Result<()> {
        self.state_copier()?.to_host(rows, slots, engine).map(drop)
    }

    /// Host state slots to staging rows, on the engine's stream (the engine's kernels drain the rows).
    pub fn states_to_gpu(&self, slots: &[i32], rows: &[i32], engine: u64) -> Result<()> {
        self.state_copier()?.to_gpu(slots, rows, engine).map(drop)
    }

    /// Staging rows for states.
    pub fn staging_rows(&self) -> usize {
        self.states.as_ref().map_or(0, |s| s.pool().num_blocks as usize)
    }

    fn state_copier(&self) -> Result<&PageCopier> {
        self.states.as_ref().ok_or_else(|| Error::State("this cache has no state pool".into()))
    }

    /// Records `ticket` as complete once its copies are. `engine_work`: some of them (states) ran on the engine's
    /// stream.
    pub fn record(&mut self, ticket: u64, store: bool, engine_work: bool, engine: u64) -> Result<()> {
        let stream = match &mut self.streams {
            Some(s) => s.order.ticket_stream(store, engine_work, engine)?,
            None => engine,
        };
        self.queue.record(ticket, stream)
    }

    /// Before layer part `layer` reads its KV: the engine's stream waits for its pending layer-wise loads.
    pub fn wait_layer(&mut self, layer: i64, engine: u64) -> Result<()> {
        let part = self.layer_part(layer)?;
        match &mut self.streams {
            Some(s) if self.layerwise => s.order.wait_layer(part, engine),
            _ => Ok(()),
        }
    }

    /// The layer part an engine's layer index names (a pool of one part serves every layer from it).
    fn layer_part(&self, layer: i64) -> Result<usize> {
        let n = self.num_layers();
        if layer < 0 || (n > 1 && layer as usize >= n) {
            let bound = if n > 1 { format!("0 to {} (the pool's layer parts)", n - 1) } else { ">= 0".to_owned() };
            return Err(invalid(format!("layer must be an int {bound}, got {layer}")));
        }
        Ok(if n > 1 { layer as usize } else { 0 })
    }

    /// Whether `wait_layer(layer)` (None: `wait_loads`) has anything to wait for; the layer is checked as there.
    pub fn waiting(&self, layer: Option<i64>) -> Result<bool> {
        let part = layer.map(|l| self.layer_part(l)).transpose()?;
        Ok(match &self.streams {
            Some(s) => s.order.waiting(part),
            None => false,
        })
    }

    /// `wait_layer` for every layer part.
    pub fn wait_loads(&mut self, engine: u64) -> Result<()> {
        match &mut self.streams {
            Some(s) => s.order.wait_loads(engine),
            None => Ok(()),
        }
    }

    /// The engine is about to rewrite `blocks`: its stream waits for the pending stores that read them.
    pub fn release(&self, blocks: &[i32], engine: u64) -> Result<()> {
        self.check_blocks(blocks, "blocks")?;
        match &self.streams {
            Some(s) => s.order.release(blocks, engine),
            None => Ok(()),
        }
    }

    /// The request's blocks will be rewritten: the engine's stream waits for its pending stores.
    pub fn forget(&mut self, request_id: &str, engine: u64) -> Result<()> {
        match &mut self.streams {
            Some(s) => s.order.forget(request_id, engine),
            None => Ok(()),
        }
    }

    /// Tickets whose copies completed, in record order (never blocks).
    pub fn poll(&mut self) -> Result<Vec<u64>> {
        if let Some(s) = &mut self.streams {
            s.order.poll()?;
        }
        self.queue.poll()
    }

    /// Copies launched and not yet retired.
    pub fn pending(&self) -> usize {
        self.queue.pending()
    }

    /// Blocks until every copy has completed (closing); returns the tickets not yet polled.
    pub fn wait_all(&mut self) -> Result<Vec<u64>> {
        self.queue.wait_all()
    }
}
