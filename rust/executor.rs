//! The worker half of a cache: the host pools and their copiers, kvtier's copy streams ordered with the engine's
//! (`order`), and the completion queue. It holds no bookkeeping of keys: it copies what a plan names and records
//! the plan's ticket, which completes once its copies have.
//!
//! Three copiers share it: `pages` (the GPU pool and the host page pool), `parts` (a page-first pool seen as one
//! tensor a layer part, for layer-wise loads; without it layer-wise loads go through `pages`, a layer-first pool
//! being one tensor a layer already) and `states` (a GPU staging buffer, which the engine's own kernels fill and
//! drain, and the host state pool). Without copy streams, or on a CPU pool, every copy runs on the engine's stream
//! (a memcpy on the CPU, complete on return) and the ordering calls do nothing.
//!
//! With copy streams the engine loop does not launch the copies itself: a batch of 16,384 copy-engine pieces (a
//! 32K-token layer-first prompt) costs the launching thread 12-16 ms (docs/PERFORMANCE.md). The executor's
//! launcher thread (`Launcher`) launches them on streams of its own, and the engine-loop call only enqueues the
//! ordering on kvtier's copy streams, as before: each copy stream records a gate event the launcher's stream waits
//! for, then waits, on the GPU, for a flag the launcher's stream writes after the copies. Every event of `Order`
//! and of the completion queue is recorded on the copy streams by the engine-loop call, so the ordering rules are
//! unchanged whichever thread launches.
use std::ops::Range;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::copy::{CompletionQueue, Direction, PageCopier};
use crate::cuda::{self, Event, Flag, Stream};
use crate::error::{invalid, Error, Result};
use crate::order::{Device, Order};

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

/// Which copier a launch uses.
#[derive(Clone, Copy)]
enum Copier {
    Pages,
    Parts,
}

/// One engine call's copies for the launcher: after `gate`, the groups of layers in order, each followed by its
/// flag value on the launcher's stream of `lane` (0: stores, 1: loads).
struct Job {
    lane: usize,
    copier: Copier,
    dir: Direction,
    gpu_ids: Vec<i32>,
    host_slots: Vec<i32>,
    gate: Event,
    groups: Vec<(Range<usize>, u32)>,
}

/// What the engine loop and the launcher share: jobs sent and done, the first failure, and the fault seam.
#[derive(Default)]
struct Progress {
    sent: u64,
    done: u64,
    failure: Option<String>,
    /// Fail the n-th job from now (0: none), as a failed launch does.
    fault_in: u64,
}

#[derive(Default)]
struct Shared {
    progress: Mutex<Progress>,
    idle: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
    fn fail(&self, e: &Error) {
        self.lock().failure.get_or_insert_with(|| e.to_string());
    }
    /// Whether a job may launch: nothing failed before, and the fault seam does not fail it.
    fn may_launch(&self) -> bool {
        let mut p = self.lock();
        if p.fault_in > 0 {
            p.fault_in -= 1;
            if p.fault_in == 0 {
                p.failure.get_or_insert_with(|| "an injected launch fault".into());
            }
        }
        p.failure.is_none()
    }
}

/// Pages a launch takes at most: a job's copies go in several launches, so the first copies start before the
/// last are launched (a copy-engine batch starts once its call returns, at about 0.8 us a piece).
const LAUNCH_PIECES: usize = 2048;

/// One direction's launcher stream and the flag it writes after each group of copies.
struct Lane {
    stream: Stream,
    flag: Arc<Flag>,
    last: u32,
}

/// The launcher thread: launches each job's copies on its own stream, in the order they were sent. A copy stream
/// waits for a job's flag values, so every value is written, on the stream or from the host, whether the copies
/// failed or not: a failure never leaves the GPU waiting. The first failure is kept, and every later call of the
/// executor returns it (copies a ticket counted on may be missing).
struct Launcher {
    device: i32,
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
    lanes: [Lane; 2],
}

impl Launcher {
    fn new(device: i32, pages: &PageCopier, parts: Option<&PageCopier>) -> Result<Self> {
        let lane = || -> Result<Lane> {
            Ok(Lane { stream: Stream::new(device)?, flag: Arc::new(Flag::new(device)?), last: 0 })
        };
        let lanes = [lane()?, lane()?];
        let shared = Arc::new(Shared::default());
        let (tx, rx) = mpsc::channel::<Job>();
        let ends: Vec<(u64, Arc<Flag>)> = lanes.iter().map(|l| (l.stream.handle(), Arc::clone(&l.flag))).collect();
        let (pages, parts, state) = (pages.clone(), parts.cloned(), Arc::clone(&shared));
        let thread = std::thread::Builder::new()
            .name("kvtier-copies".into())
            .spawn(move || {
                for job in rx {
                    let (stream, flag) = &ends[job.lane];
                    let copier = match job.copier {
                        Copier::Parts => parts.as_ref().unwrap_or(&pages),
                        Copier::Pages => &pages,
                    };
                    launch(job, copier, *stream, flag, &state);
                    state.lock().done += 1;
                    state.idle.notify_all();
                }
            })
            .map_err(|e| Error::Copy(format!("starting the copy launcher thread: {e}")))?;
        Ok(Self { device, jobs: Some(tx), thread: Some(thread), shared, lanes })
    }

    /// The first failure of a launch, if any.
    fn failed(&self) -> Result<()> {
        match &self.shared.lock().failure {
            Some(msg) => {
                Err(Error::Copy(format!("a copy launched off the engine loop failed; the copies are unusable: {msg}")))
            }
            None => Ok(()),
        }
    }

    /// Sends the copies of `layers` (one group each) to the launcher, after the work enqueued so far on `stream`,
    /// the copy stream of `lane`; returns the flag value each group writes once its copies have completed.
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &mut self,
        lane: usize,
        copier: Copier,
        dir: Direction,
        gpu_ids: &[i32],
        host_slots: &[i32],
        stream: u64,
        layers: impl Iterator<Item = Range<usize>>,
    ) -> Result<Vec<u32>> {
        let gate = Event::new(self.device)?;
        gate.record(stream)?;
        let last = &mut self.lanes[lane].last;
        let groups: Vec<(Range<usize>, u32)> = layers
            .map(|r| {
                *last = last.wrapping_add(1);
                (r, *last)
            })
            .collect();
        let values = groups.iter().map(|g| g.1).collect();
        let job = Job { lane, copier, dir, gpu_ids: gpu_ids.to_vec(), host_slots: host_slots.to_vec(), gate, groups };
        self.shared.lock().sent += 1;
        if self.jobs.as_ref().is_none_or(|tx| tx.send(job).is_err()) {
            let e = Error::Copy("the copy launcher thread has stopped".into());
            self.shared.fail(&e);
            return Err(e);
        }
        Ok(values)
    }

    /// After a job was sent, a failure to order the copy streams around it leaves them in an unknown state: it
    /// makes the executor unusable, as a failed launch does.
    fn after_send(&self, result: Result<()>) -> Result<()> {
        if let Err(e) = &result {
            self.shared.fail(e);
        }
        result
    }

    /// `stream` (a copy stream) waits on the GPU for the group that writes `value` on `lane`.
    fn wait(&self, lane: usize, value: u32, stream: u64) -> Result<()> {
        self.lanes[lane].flag.wait(stream, value)
    }

    /// Fails the n-th job sent from now (0: none) as a failed launch does (fault tests).
    fn set_fault(&self, n: u64) {
        self.shared.lock().fault_in = n;
    }

    /// Blocks until the launcher has launched every job sent.
    fn flush(&self) {
        let mut p = self.shared.lock();
        while p.done < p.sent {
            p = self.shared.idle.wait(p).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        self.jobs = None; // the thread launches what was sent and ends
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The launcher's work for one job: after the gate, each group's copies in launches of at most `LAUNCH_PIECES`
/// pieces, then the group's flag value, written whatever happened before it.
fn launch(job: Job, copier: &PageCopier, stream: u64, flag: &Flag, state: &Shared) {
    let mut ok = state.may_launch() && job.gate.wait_in(stream).map_err(|e| state.fail(&e)).is_ok();
    for (layers, value) in job.groups {
        let pages = (LAUNCH_PIECES / layers.len()).max(1);
        for (gpu_ids, host_slots) in job.gpu_ids.chunks(pages).zip(job.host_slots.chunks(pages)) {
            if !ok {
                break;
            }
            if let Err(e) = copier.launch(job.dir, gpu_ids, host_slots, stream, layers.clone()) {
                state.fail(&e);
                ok = false;
            }
        }
        if let Err(e) = flag.write(stream, value) {
            state.fail(&e);
            let _ = flag.set_after(stream, value);
        }
    }
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
    // Declared after `streams`: dropped after them, its thread launching what was sent first.
    launcher: Option<Launcher>,
}

impl Executor {
    /// Copy streams are used only on a CUDA pool and when asked for; layer-wise loads only with copy streams; the
    /// launcher thread (`copy_thread`) only with copy streams and where the driver has stream memory operations.
    pub fn new(
        pages: PageCopier,
        parts: Option<PageCopier>,
        states: Option<PageCopier>,
        copy_streams: bool,
        layerwise_loads: bool,
        copy_thread: bool,
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
        let launcher = match device {
            Some(d) if streams.is_some() && copy_thread && cuda::stream_flags_supported() => {
                Some(Launcher::new(d, &pages, parts.as_ref())?)
            }
            _ => None,
        };
        Ok(Self {
            launcher,
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

    /// Fault tests: the launcher thread fails the `n`-th copy job sent from now (0: none), as a failed launch off
    /// the engine loop does: the call that sent it has returned, and the executor becomes unusable.
    pub fn set_launch_fault(&mut self, n: u64) -> Result<()> {
        let l = self.launcher.as_ref().ok_or_else(|| invalid("this cache launches its copies without a thread"))?;
        l.set_fault(n);
        Ok(())
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
            Some(b) => Err(invalid(format!("{what}: block id {b} is outside the GPU pool of {n} blocks"))),
            None => Ok(()),
        }
    }

    /// GPU blocks to host slots, after the engine's work enqueued so far; the engine does not wait.
    pub fn store_pages(&mut self, gpu_ids: &[i32], host_slots: &[i32], request_id: &str, engine: u64) -> Result<()> {
        self.usable()?;
        self.pages.validate(Direction::ToHost, gpu_ids, host_slots)?;
        self.inject()?;
        let all = 0..self.pages.pool().layers.len();
        let Some(s) = &mut self.streams else {
            return self.pages.launch(Direction::ToHost, gpu_ids, host_slots, engine, all).map(drop);
        };
        s.order.before_store(engine)?;
        let d2h = s.order.d2h();
        match &mut self.launcher {
            Some(l) => {
                let v =
                    l.submit(0, Copier::Pages, Direction::ToHost, gpu_ids, host_slots, d2h, std::iter::once(all))?;
                l.after_send(l.wait(0, v[0], d2h).and_then(|()| s.order.after_store(gpu_ids, request_id)))
            }
            None => {
                self.pages.launch(Direction::ToHost, gpu_ids, host_slots, d2h, all)?;
                s.order.after_store(gpu_ids, request_id)
            }
        }
    }

    /// Host slots to GPU blocks, after the blocks' previous users; the engine's stream waits for them before its
    /// next kernels (whole loads), or a layer part at a time in `wait_layer` (layer-wise loads).
    pub fn load_pages(&mut self, host_slots: &[i32], gpu_ids: &[i32], engine: u64) -> Result<()> {
        self.usable()?;
        self.pages.validate(Direction::ToGpu, gpu_ids, host_slots)?;
        self.inject()?;
        let all = 0..self.pages.pool().layers.len();
        let Some(s) = &mut self.streams else {
            return self.pages.launch(Direction::ToGpu, gpu_ids, host_slots, engine, all).map(drop);
        };
        s.order.before_load(gpu_ids, engine)?;
        let h2d = s.order.h2d();
        if !self.layerwise {
            return match &mut self.launcher {
                Some(l) => {
                    let v =
                        l.submit(1, Copier::Pages, Direction::ToGpu, gpu_ids, host_slots, h2d, std::iter::once(all))?;
                    l.after_send(l.wait(1, v[0], h2d).and_then(|()| s.order.after_load(engine)))
                }
                None => {
                    self.pages.launch(Direction::ToGpu, gpu_ids, host_slots, h2d, all)?;
                    s.order.after_load(engine)
                }
            };
        }
        let (copier, by_layer) = match &self.parts {
            Some(p) => (Copier::Parts, p),
            None => (Copier::Pages, &self.pages),
        };
        let n = by_layer.pool().layers.len();
        match &mut self.launcher {
            Some(l) => {
                let values =
                    l.submit(1, copier, Direction::ToGpu, gpu_ids, host_slots, h2d, (0..n).map(|i| i..i + 1))?;
                let ordered = values.into_iter().enumerate().try_for_each(|(layer, v)| {
                    l.wait(1, v, h2d)?;
                    s.order.after_load_layer(layer)
                });
                l.after_send(ordered)
            }
            None => (0..n).try_for_each(|layer| {
                by_layer.launch(Direction::ToGpu, gpu_ids, host_slots, h2d, layer..layer + 1)?;
                s.order.after_load_layer(layer)
            }),
        }
    }

    /// The first failure of a copy launched off the engine loop, as an error (the executor is then unusable).
    fn usable(&self) -> Result<()> {
        self.launcher.as_ref().map_or(Ok(()), Launcher::failed)
    }

    /// Whether the copies of copy streams are launched by the executor's own thread.
    pub fn copy_thread(&self) -> bool {
        self.launcher.is_some()
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
        self.states.as_ref().ok_or_else(|| invalid("this cache has no state pool"))
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
        let done = self.queue.poll()?;
        // After the queue: a ticket's event completes only after its launches' flags were written, and a launch
        // records its failure before writing its flag.
        self.usable()?;
        Ok(done)
    }

    /// Copies launched and not yet retired.
    pub fn pending(&self) -> usize {
        self.queue.pending()
    }

    /// Blocks until every copy has completed (closing); returns the tickets not yet polled.
    pub fn wait_all(&mut self) -> Result<Vec<u64>> {
        if let Some(l) = &self.launcher {
            l.flush();
        }
        let done = self.queue.wait_all()?;
        self.usable()?;
        Ok(done)
    }
}
