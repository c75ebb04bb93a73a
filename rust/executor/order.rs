//! How copies on kvtier's copy streams are ordered with the engine's stream: CUDA events recorded on one stream
//! and waited for, GPU-side, by another; the host never waits.
//!
//! - A store's copy (device to host stream) waits for the engine's work enqueued before it, which wrote its blocks,
//!   and for a layer-wise load the engine has not waited for yet; the engine does not wait for the store. Before the
//!   engine rewrites blocks it calls `release(blocks)` or `forget(request)`: its stream then waits for the pending
//!   stores that read them.
//! - A load (host to device stream) waits for the engine's work enqueued before it (the blocks' previous owner) and
//!   for a pending store of the same blocks; the engine's stream waits for the load at once (whole loads), or layer by
//!   layer in `wait_layer(l)` (layer-wise loads: one event a layer part).
//! - Work the engine's own kernels do for a ticket (states through the staging buffer) is on the engine's stream:
//!   the ticket is recorded on its copy stream after waiting for it.
//!
//! The rules are written once here, over the `Device` trait, so that a simulated device in the tests checks every
//! happens-before edge without a GPU.
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::error::{invalid, Result};

/// Streams and events of one device, as the ordering rules need them.
pub trait Device {
    type Event;
    /// An event recorded on `stream` after the work enqueued on it so far.
    fn record(&self, stream: u64) -> Result<Self::Event>;
    /// `stream`'s later work waits (GPU-side) for the work before `event`.
    fn wait(&self, event: &Self::Event, stream: u64) -> Result<()>;
    /// Whether the work before `event` has completed; never blocks.
    fn done(&self, event: &Self::Event) -> Result<bool>;
}

/// The ordering state of one cache's copy streams: pending stores (by sequence number, the stream is in order, so
/// waiting for store s covers every store before it), the last store that read each GPU block and each request's
/// last store, and the layer-wise loads the engine has not waited for.
pub struct Order<D: Device> {
    dev: D,
    d2h: u64,
    h2d: u64,
    next_seq: u64,
    done_seq: u64,
    stores: VecDeque<(u64, D::Event)>,
    block_seq: Vec<u64>,
    request_seq: HashMap<String, u64>,
    layers: Vec<Option<Arc<D::Event>>>,
    last_load: Option<Arc<D::Event>>,
}

impl<D: Device> Order<D> {
    /// `d2h` and `h2d`: the copy streams of stores and loads; `num_blocks` GPU blocks; `num_layers` layer parts a
    /// layer-wise load is issued in.
    pub fn new(dev: D, d2h: u64, h2d: u64, num_blocks: u32, num_layers: usize) -> Self {
        Self {
            dev,
            d2h,
            h2d,
            next_seq: 0,
            done_seq: 0,
            stores: VecDeque::new(),
            block_seq: vec![0; num_blocks as usize],
            request_seq: HashMap::new(),
            layers: (0..num_layers.max(1)).map(|_| None).collect(),
            last_load: None,
        }
    }

    pub fn d2h(&self) -> u64 {
        self.d2h
    }
    pub fn h2d(&self) -> u64 {
        self.h2d
    }

    /// Before a store's copies on the device-to-host stream.
    pub fn before_store(&mut self, engine: u64) -> Result<()> {
        self.dev.wait(&self.dev.record(engine)?, self.d2h)?;
        if let Some(load) = &self.last_load {
            self.dev.wait(load, self.d2h)?; // blocks a layer-wise load filled that the engine has not waited for
        }
        Ok(())
    }

    /// After a store's page copies of `blocks` for `request_id` were enqueued.
    pub fn after_store(&mut self, blocks: &[i32], request_id: &str) -> Result<()> {
        self.next_seq += 1;
        let seq = self.next_seq;
        self.stores.push_back((seq, self.dev.record(self.d2h)?));
        for &b in blocks {
            self.block_seq[b as usize] = seq;
        }
        self.request_seq.insert(request_id.to_owned(), seq);
        Ok(())
    }

    /// The latest pending store that read any of `blocks`.
    fn pending_store(&self, blocks: &[i32]) -> Option<&D::Event> {
        let seq = blocks.iter().map(|&b| self.block_seq[b as usize]).max().unwrap_or(0);
        self.pending(seq)
    }

    fn pending(&self, seq: u64) -> Option<&D::Event> {
        if seq <= self.done_seq {
            return None;
        }
        self.stores.iter().find(|(s, _)| *s == seq).map(|(_, ev)| ev)
    }

    /// Before a load's copies into `blocks` on the host-to-device stream.
    pub fn before_load(&mut self, blocks: &[i32], engine: u64) -> Result<()> {
        self.dev.wait(&self.dev.record(engine)?, self.h2d)?;
        if let Some(ev) = self.pending_store(blocks) {
            self.dev.wait(ev, self.h2d)?; // a store still reading these blocks for an earlier owner
        }
        Ok(())
    }

    /// After a whole load: the engine's stream waits for it before its next kernels.
    pub fn after_load(&mut self, engine: u64) -> Result<()> {
        self.dev.wait(&self.dev.record(self.h2d)?, engine)
    }

    /// After the copies of one layer part of a layer-wise load: `wait_layer(layer)` waits for them.
    pub fn after_load_layer(&mut self, layer: usize) -> Result<()> {
        let ev = Arc::new(self.dev.record(self.h2d)?);
        self.layers[layer] = Some(Arc::clone(&ev));
        self.last_load = Some(ev);
        Ok(())
    }

    /// The stream a ticket's completion is recorded on: its copy stream, after the engine's work on it so far
    /// when some of its copies (`engine_work`) ran on the engine's stream.
    pub fn ticket_stream(&mut self, store: bool, engine_work: bool, engine: u64) -> Result<u64> {
        let stream = if store { self.d2h } else { self.h2d };
        if engine_work {
            self.dev.wait(&self.dev.record(engine)?, stream)?;
        }
        Ok(stream)
    }

    /// The engine's stream waits for the pending layer-wise loads of layer part `layer`.
    pub fn wait_layer(&mut self, layer: usize, engine: u64) -> Result<()> {
        let n = self.layers.len();
        let ev = self.layers.get_mut(layer).ok_or_else(|| invalid(format!("layer {layer} of {n}")))?.take();
        match ev {
            Some(ev) => self.dev.wait(&ev, engine),
            None => Ok(()),
        }
    }

    /// Whether a layer-wise load of layer part `layer` (None: of any part) is still to be waited for.
    pub fn waiting(&self, layer: Option<usize>) -> bool {
        match layer {
            Some(l) => self.layers.get(l).is_some_and(Option::is_some),
            None => self.last_load.is_some(),
        }
    }

    /// `wait_layer` for every layer part: the stream is in order, so the last load's event covers all of them.
    pub fn wait_loads(&mut self, engine: u64) -> Result<()> {
        if let Some(ev) = self.last_load.take() {
            self.dev.wait(&ev, engine)?;
        }
        self.layers.iter_mut().for_each(|l| *l = None);
        Ok(())
    }

    /// The engine is about to rewrite `blocks`: its stream waits for the pending stores that read them.
    pub fn release(&self, blocks: &[i32], engine: u64) -> Result<()> {
        match self.pending_store(blocks) {
            Some(ev) => self.dev.wait(ev, engine),
            None => Ok(()),
        }
    }

    /// The request's blocks will be rewritten: the engine's stream waits for its pending stores.
    pub fn forget(&mut self, request_id: &str, engine: u64) -> Result<()> {
        let seq = self.request_seq.remove(request_id).unwrap_or(0);
        match self.pending(seq) {
            Some(ev) => self.dev.wait(ev, engine),
            None => Ok(()),
        }
    }

    /// Retires the stores that completed (never blocks).
    pub fn poll(&mut self) -> Result<()> {
        while let Some((seq, ev)) = self.stores.front() {
            if !self.dev.done(ev)? {
                break;
            }
            self.done_seq = *seq;
            self.stores.pop_front();
        }
        if let Some(load) = &self.last_load {
            if self.dev.done(load)? {
                self.last_load = None;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! A simulated device: every stream is a list of operations; an event is a position in a stream, and a wait
    //! makes a stream's later operations happen after that position. `happens_before` answers whether one copy is
    //! ordered before another, which is what the rules promise.
    use std::cell::RefCell;
    use std::rc::Rc;

    use super::*;

    #[derive(Clone, Debug, PartialEq)]
    enum Op {
        Work(&'static str),
        Wait(u64, usize), // (stream, position) that later operations of this stream follow
    }

    #[derive(Default)]
    struct Sim {
        streams: RefCell<HashMap<u64, Vec<Op>>>,
        completed: RefCell<HashMap<u64, usize>>, // positions executed so far
    }

    #[derive(Clone)]
    struct Dev(Rc<Sim>);

    impl Device for Dev {
        type Event = (u64, usize);
        fn record(&self, stream: u64) -> Result<Self::Event> {
            Ok((stream, self.0.streams.borrow().get(&stream).map_or(0, Vec::len)))
        }
        fn wait(&self, ev: &Self::Event, stream: u64) -> Result<()> {
            self.0.streams.borrow_mut().entry(stream).or_default().push(Op::Wait(ev.0, ev.1));
            Ok(())
        }
        fn done(&self, ev: &Self::Event) -> Result<bool> {
            Ok(self.0.completed.borrow().get(&ev.0).copied().unwrap_or(0) >= ev.1)
        }
    }

    impl Dev {
        fn work(&self, stream: u64, what: &'static str) {
            self.0.streams.borrow_mut().entry(stream).or_default().push(Op::Work(what));
        }
        fn complete_all(&self) {
            let lens: Vec<(u64, usize)> = self.0.streams.borrow().iter().map(|(&s, ops)| (s, ops.len())).collect();
            self.0.completed.borrow_mut().extend(lens);
        }
        /// Whether work `a` is ordered before work `b` (both named once).
        fn happens_before(&self, a: &str, b: &str) -> bool {
            let streams = self.0.streams.borrow();
            let find = |w: &str| {
                streams
                    .iter()
                    .find_map(|(&s, ops)| ops.iter().position(|o| matches!(o, Op::Work(x) if *x == w)).map(|i| (s, i)))
            };
            let (a, b) = (find(a).expect("a is logged"), find(b).expect("b is logged"));
            // Everything b follows: positions reachable backwards from b through program order and waits.
            let mut frontier = vec![(b.0, b.1)];
            let mut seen: HashMap<u64, usize> = HashMap::new();
            while let Some((s, upto)) = frontier.pop() {
                if seen.get(&s).is_some_and(|&p| p >= upto) {
                    continue;
                }
                seen.insert(s, upto);
                for op in &streams[&s][..upto] {
                    if let Op::Wait(other, pos) = *op {
                        frontier.push((other, pos));
                    }
                }
            }
            seen.get(&a.0).is_some_and(|&upto| a.1 < upto)
        }
    }

    const ENGINE: u64 = 7;
    const D2H: u64 = 1;
    const H2D: u64 = 2;

    fn order(layers: usize) -> (Dev, Order<Dev>) {
        let dev = Dev(Rc::new(Sim::default()));
        (dev.clone(), Order::new(dev, D2H, H2D, 16, layers))
    }

    #[test]
    fn a_store_reads_what_the_engine_wrote_and_release_orders_the_rewrite_after_it() {
        let (dev, mut o) = order(1);
        dev.work(ENGINE, "prefill writes blocks 3, 4");
        o.before_store(ENGINE).unwrap();
        dev.work(D2H, "store reads blocks 3, 4");
        o.after_store(&[3, 4], "r").unwrap();
        dev.work(ENGINE, "decode");
        assert!(dev.happens_before("prefill writes blocks 3, 4", "store reads blocks 3, 4"));
        assert!(!dev.happens_before("store reads blocks 3, 4", "decode"), "the engine does not wait for stores");
        o.release(&[9], ENGINE).unwrap();
        dev.work(ENGINE, "another owner writes block 9");
        assert!(!dev.happens_before("store reads blocks 3, 4", "another owner writes block 9"));
        o.release(&[4, 9], ENGINE).unwrap();
        dev.work(ENGINE, "another owner writes block 4");
        assert!(dev.happens_before("store reads blocks 3, 4", "another owner writes block 4"));
    }

    #[test]
    fn forget_orders_every_block_of_the_request_and_completed_stores_need_no_wait() {
        let (dev, mut o) = order(1);
        o.before_store(ENGINE).unwrap();
        dev.work(D2H, "store of r");
        o.after_store(&[1, 2], "r").unwrap();
        o.forget("r", ENGINE).unwrap();
        dev.work(ENGINE, "reuse of r's blocks");
        assert!(dev.happens_before("store of r", "reuse of r's blocks"));
        o.before_store(ENGINE).unwrap();
        dev.work(D2H, "store of s");
        o.after_store(&[5], "s").unwrap();
        dev.complete_all();
        o.poll().unwrap();
        let waits = |dev: &Dev| dev.0.streams.borrow()[&ENGINE].iter().filter(|op| matches!(op, Op::Wait(..))).count();
        let before = waits(&dev);
        o.release(&[5], ENGINE).unwrap();
        o.forget("s", ENGINE).unwrap();
        assert_eq!(waits(&dev), before, "a completed store needs no wait");
    }

    #[test]
    fn a_load_waits_for_the_blocks_previous_store_and_the_engine_waits_for_the_load() {
        let (dev, mut o) = order(1);
        o.before_store(ENGINE).unwrap();
        dev.work(D2H, "store reads block 6 for its old owner");
        o.after_store(&[6], "old").unwrap();
        dev.work(ENGINE, "old owner done");
        o.before_load(&[6, 8], ENGINE).unwrap();
        dev.work(H2D, "load writes blocks 6, 8");
        o.after_load(ENGINE).unwrap();
        dev.work(ENGINE, "prefill reads blocks 6, 8");
        assert!(dev.happens_before("store reads block 6 for its old owner", "load writes blocks 6, 8"));
        assert!(dev.happens_before("old owner done", "load writes blocks 6, 8"));
        assert!(dev.happens_before("load writes blocks 6, 8", "prefill reads blocks 6, 8"));
    }

    #[test]
    fn layer_wise_loads_are_waited_for_a_layer_at_a_time_and_stores_wait_for_them() {
        let (dev, mut o) = order(3);
        o.before_load(&[1], ENGINE).unwrap();
        for (l, name) in ["load layer 0", "load layer 1", "load layer 2"].into_iter().enumerate() {
            dev.work(H2D, name);
            o.after_load_layer(l).unwrap();
        }
        assert!(o.waiting(Some(0)) && o.waiting(Some(2)) && o.waiting(None) && !o.waiting(Some(3)));
        o.wait_layer(0, ENGINE).unwrap();
        assert!(!o.waiting(Some(0)) && o.waiting(Some(1)), "a layer once waited for is not waited for again");
        dev.work(ENGINE, "layer 0 reads");
        assert!(dev.happens_before("load layer 0", "layer 0 reads"));
        assert!(!dev.happens_before("load layer 1", "layer 0 reads"), "layer 0 overlaps the copy of layer 1");
        o.before_store(ENGINE).unwrap();
        dev.work(D2H, "store of the loaded blocks");
        o.after_store(&[1], "r").unwrap();
        assert!(dev.happens_before("load layer 2", "store of the loaded blocks"));
        o.wait_loads(ENGINE).unwrap();
        assert!(!o.waiting(None) && !o.waiting(Some(1)));
        dev.work(ENGINE, "every layer reads");
        assert!(dev.happens_before("load layer 2", "every layer reads"));
        assert!(o.wait_layer(3, ENGINE).is_err());
    }

    #[test]
    fn a_ticket_with_engine_work_completes_after_it() {
        let (dev, mut o) = order(1);
        o.before_store(ENGINE).unwrap();
        dev.work(D2H, "pages to host");
        o.after_store(&[0], "r").unwrap();
        dev.work(ENGINE, "state staged and copied");
        let s = o.ticket_stream(true, true, ENGINE).unwrap();
        assert_eq!(s, D2H);
        dev.work(s, "ticket");
        assert!(dev.happens_before("state staged and copied", "ticket"));
        assert!(dev.happens_before("pages to host", "ticket"));
    }
}
