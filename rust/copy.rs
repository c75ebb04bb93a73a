//! Page copies between a GPU pool and a host pool, and the completion queue the engine loop polls.
//!
//! A GPU pool is one tensor per layer (one for page-first): block b's chunk of a page is `chunk_bytes` at
//! `base + b * stride`. The host page is contiguous, the layer chunks back to back. On a CUDA device the batch is
//! one kernel launch (or a few, see cuda/copy.cu) on the caller's stream, never waited for; on a CPU pool the
//! copy is a multi-threaded memcpy, complete on return. Every argument is validated before anything is copied.
use std::collections::VecDeque;
use std::sync::Arc;

use crate::cuda::{self, Event, Layer, Launch};
use crate::error::{invalid, Error, Result};
use crate::hostmem::HostPool;

/// Blocks of the copy kernel when none are given: the fewest that reach the link's ceiling (docs/PERFORMANCE.md).
pub const DEFAULT_BLOCKS: u32 = 8;
/// Threads a block.
pub const DEFAULT_THREADS: u32 = 512;
/// Below this many bytes a CPU copy stays on the calling thread.
const CPU_BYTES_PER_THREAD: u64 = 4 << 20;
const CPU_MAX_THREADS: usize = 8;

/// Which way a batch goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    ToHost,
    ToGpu,
}

/// The GPU side of the copies: where its layer tensors are, and on which device (None: host memory).
#[derive(Debug, Clone)]
pub struct GpuPool {
    pub layers: Vec<Layer>,
    pub num_blocks: u32,
    pub chunk_bytes: u64,
    pub device: Option<i32>,
}

/// Copies pages between one GPU pool and one host pool.
pub struct PageCopier {
    pool: GpuPool,
    host: Arc<HostPool>,
    blocks: u32,
    threads: u32,
    debug_sync: bool,
}

impl PageCopier {
    /// # Safety
    /// Every layer range `base .. base + (num_blocks - 1) * stride + chunk_bytes` must stay valid memory of
    /// `pool.device` (host memory when None) for the copier's life and until its last copy completes.
    pub unsafe fn new(pool: GpuPool, host: Arc<HostPool>, blocks: u32, threads: u32, debug_sync: bool) -> Result<Self> {
        let n = pool.layers.len();
        if n == 0 || n > cuda::MAX_LAYERS {
            return Err(invalid(format!("a GPU pool has 1 to {} layer tensors, got {n}", cuda::MAX_LAYERS)));
        }
        if pool.chunk_bytes == 0 || pool.chunk_bytes % 16 != 0 {
            return Err(invalid(format!(
                "bytes per block of each layer tensor must be a positive multiple of 16, got {}",
                pool.chunk_bytes
            )));
        }
        if pool.num_blocks == 0 || pool.num_blocks > i32::MAX as u32 {
            return Err(invalid(format!("num_blocks must be 1 to 2^31 - 1, got {}", pool.num_blocks)));
        }
        for (i, l) in pool.layers.iter().enumerate() {
            if l.base % 16 != 0 {
                return Err(invalid(format!("layer {i}: data pointer {:#x} is not 16-byte aligned", l.base)));
            }
            if l.stride % 16 != 0 || l.stride < pool.chunk_bytes {
                return Err(invalid(format!(
                    "layer {i}: block stride {} must be a multiple of 16 and >= {} bytes",
                    l.stride, pool.chunk_bytes
                )));
            }
        }
        let page_bytes = pool.chunk_bytes * n as u64;
        if host.slot_bytes() != page_bytes {
            return Err(invalid(format!(
                "host pool slot_bytes = {} differs from the page size {page_bytes} ({n} layer(s) x {} bytes)",
                host.slot_bytes(),
                pool.chunk_bytes
            )));
        }
        if !(1..=65535).contains(&blocks) {
            return Err(invalid(format!("blocks must be 1 to 65535, got {blocks}")));
        }
        if threads == 0 || threads > 1024 || threads % 32 != 0 {
            return Err(invalid(format!("threads must be a multiple of 32 from 32 to 1024, got {threads}")));
        }
        if pool.device.is_some() {
            if !cuda::COMPILED {
                return Err(Error::Copy("the GPU pool is on a CUDA device but CUDA is not compiled in".into()));
            }
            if !host.pinned() {
                return Err(invalid("the host pool is not pinned (pin=False), so a CUDA device cannot reach it"));
            }
        }
        Ok(Self { pool, host, blocks, threads, debug_sync })
    }

    pub fn pool(&self) -> &GpuPool {
        &self.pool
    }

    pub fn host(&self) -> &Arc<HostPool> {
        &self.host
    }

    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    pub fn threads(&self) -> u32 {
        self.threads
    }

    pub fn page_bytes(&self) -> u64 {
        self.pool.chunk_bytes * self.pool.layers.len() as u64
    }

    /// GPU blocks `gpu_ids[i]` -> host slots `host_slots[i]`.
    pub fn to_host(&self, gpu_ids: &[i32], host_slots: &[i32], stream: u64) -> Result<()> {
        self.copy(Direction::ToHost, gpu_ids, host_slots, stream)
    }

    /// Host slots `host_slots[i]` -> GPU blocks `gpu_ids[i]`.
    pub fn to_gpu(&self, host_slots: &[i32], gpu_ids: &[i32], stream: u64) -> Result<()> {
        self.copy(Direction::ToGpu, gpu_ids, host_slots, stream)
    }

    fn copy(&self, dir: Direction, gpu_ids: &[i32], host_slots: &[i32], stream: u64) -> Result<()> {
        let mem = self.host.access()?;
        self.validate(dir, gpu_ids, host_slots)?;
        if gpu_ids.is_empty() {
            return Ok(());
        }
        let result = match self.pool.device {
            Some(device) => {
                let launch = Launch {
                    layers: &self.pool.layers,
                    chunk_bytes: self.pool.chunk_bytes,
                    host_base: self.host.base_ptr(),
                    slot_bytes: self.host.slot_bytes(),
                    device,
                    blocks: self.blocks,
                    threads: self.threads,
                    to_host: dir == Direction::ToHost,
                    debug_sync: self.debug_sync,
                };
                // SAFETY: ids were validated against both pools; the GPU pool stays alive per `new`'s contract and
                // the host slots are pinned and mapped until close, which the caller orders after completion.
                unsafe { cuda::copy_pages(&launch, gpu_ids, host_slots, stream) }
            }
            None => {
                self.cpu_copy(dir, gpu_ids, host_slots);
                Ok(())
            }
        };
        drop(mem);
        result
    }

    fn validate(&self, dir: Direction, gpu_ids: &[i32], host_slots: &[i32]) -> Result<()> {
        if gpu_ids.len() != host_slots.len() {
            return Err(invalid(format!(
                "gpu_ids and host_slots differ in length: {} and {}",
                gpu_ids.len(),
                host_slots.len()
            )));
        }
        let blocks = self.pool.num_blocks;
        for (i, &id) in gpu_ids.iter().enumerate() {
            if id < 0 || id as u32 >= blocks {
                return Err(invalid(format!("gpu_ids[{i}] = {id} is outside the GPU pool of {blocks} blocks")));
            }
        }
        let usable = self.host.usable_slots();
        for (i, &s) in host_slots.iter().enumerate() {
            if s < 0 || s as u32 >= usable {
                return Err(invalid(format!(
                    "host_slots[{i}] = {s} is not below usable_slots = {usable} (of {} slots)",
                    self.host.slots()
                )));
            }
        }
        let (name, dst) = match dir {
            Direction::ToHost => ("host_slots", host_slots),
            Direction::ToGpu => ("gpu_ids", gpu_ids),
        };
        let mut sorted: Vec<(i32, usize)> = dst.iter().copied().zip(0..).collect();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(invalid(format!(
                "{name} names destination {} twice in one batch (at {} and {})",
                w[0].0, w[0].1, w[1].1
            )));
        }
        Ok(())
    }

    /// Both pools are host memory: copy each (page, layer) chunk, spread over a few threads for large batches.
    fn cpu_copy(&self, dir: Direction, gpu_ids: &[i32], host_slots: &[i32]) {
        let chunk = self.pool.chunk_bytes;
        let layers = &self.pool.layers;
        let host_base = self.host.base_ptr();
        let slot_bytes = self.host.slot_bytes();
        let copy_page = |i: usize| {
            for (l, layer) in layers.iter().enumerate() {
                let dev = layer.base + gpu_ids[i] as u64 * layer.stride;
                let host = host_base + host_slots[i] as u64 * slot_bytes + l as u64 * chunk;
                let (src, dst) = match dir {
                    Direction::ToHost => (dev, host),
                    Direction::ToGpu => (host, dev),
                };
                // SAFETY: validated ids inside both pools; destinations are distinct, and the two pools are
                // separate allocations, so no two copies of a batch overlap.
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, chunk as usize) };
            }
        };
        let n = gpu_ids.len();
        let bytes = n as u64 * self.page_bytes();
        let threads = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .min(CPU_MAX_THREADS)
            .min(usize::try_from(bytes / CPU_BYTES_PER_THREAD).unwrap_or(usize::MAX))
            .min(n)
            .max(1);
        if threads == 1 {
            (0..n).for_each(copy_page);
            return;
        }
        let per = n.div_ceil(threads);
        std::thread::scope(|s| {
            for t in 0..threads {
                let copy_page = &copy_page;
                s.spawn(move || (t * per..((t + 1) * per).min(n)).for_each(copy_page));
            }
        });
    }
}

/// Tokens of launched work in launch order, each with the event recorded after it; polled without blocking.
pub struct CompletionQueue {
    device: Option<i32>,
    pending: VecDeque<(u64, Option<Event>)>,
    free: Vec<Event>,
}

impl CompletionQueue {
    /// A queue for copies on CUDA device `device`, or for CPU copies (None: every token completes at once).
    pub fn new(device: Option<i32>) -> Result<Self> {
        if let Some(d) = device {
            let count = cuda::device_count();
            if d < 0 || d >= count {
                return Err(invalid(format!("device {d} is not a visible CUDA device ({count} visible)")));
            }
        }
        Ok(Self { device, pending: VecDeque::new(), free: Vec::new() })
    }

    /// Record `token` as complete once the work launched so far on `stream` is.
    pub fn record(&mut self, token: u64, stream: u64) -> Result<()> {
        let event = match self.device {
            None => None,
            Some(d) => {
                let ev = match self.free.pop() {
                    Some(ev) => ev,
                    None => Event::new(d)?,
                };
                if let Err(e) = ev.record(stream) {
                    self.free.push(ev);
                    return Err(e);
                }
                Some(ev)
            }
        };
        self.pending.push_back((token, event));
        Ok(())
    }

    /// Tokens completed since the last poll, in record order, up to the first that is still running.
    pub fn poll(&mut self) -> Result<Vec<u64>> {
        let mut done = Vec::new();
        while let Some((_, ev)) = self.pending.front() {
            if let Some(ev) = ev {
                if !ev.done()? {
                    break;
                }
            }
            let (token, ev) = self.pending.pop_front().expect("front exists");
            self.free.extend(ev);
            done.push(token);
        }
        Ok(done)
    }

    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Block until everything recorded has completed; returns the tokens not yet returned by `poll`.
    pub fn wait_all(&mut self) -> Result<Vec<u64>> {
        // Every event, not just the last: tokens may have been recorded on different streams.
        for (_, ev) in &self.pending {
            if let Some(ev) = ev {
                ev.wait()?;
            }
        }
        self.poll()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool_and_copier(layers: usize, chunk: u64, blocks: u32, slots: u32) -> (Vec<Vec<u8>>, PageCopier) {
        let mut mem: Vec<Vec<u8>> = (0..layers).map(|l| vec![l as u8; (chunk as usize + 16) * blocks as usize + 16]).collect();
        let layer_ptrs = mem
            .iter_mut()
            .map(|m| {
                let base = (m.as_mut_ptr() as u64).next_multiple_of(16);
                Layer { base, stride: chunk + 16 }
            })
            .collect();
        let host = Arc::new(HostPool::new(slots, chunk * layers as u64, 1 << 16, Some(false)).unwrap());
        host.grow_to(slots).unwrap();
        let pool = GpuPool { layers: layer_ptrs, num_blocks: blocks, chunk_bytes: chunk, device: None };
        // SAFETY: `mem` is returned to the test and outlives the copier's use.
        let copier = unsafe { PageCopier::new(pool, host, 8, 512, false).unwrap() };
        (mem, copier)
    }

    #[test]
    fn round_trip_layer_first() {
        let (_mem, c) = pool_and_copier(3, 32, 6, 4);
        c.to_host(&[5, 0], &[1, 3], 0).unwrap();
        let slot = c.host().read(1).unwrap();
        assert_eq!(slot, [vec![0u8; 32], vec![1; 32], vec![2; 32]].concat());
        c.to_gpu(&[1], &[2], 0).unwrap();
        assert!(c.to_gpu(&[1, 3], &[2, 2], 0).unwrap_err().to_string().contains("twice"));
        assert!(c.to_host(&[6], &[0], 0).unwrap_err().to_string().contains("gpu_ids[0] = 6"));
    }

    #[test]
    fn cpu_queue_completes_at_once() {
        let mut q = CompletionQueue::new(None).unwrap();
        q.record(3, 0).unwrap();
        q.record(4, 0).unwrap();
        assert_eq!(q.pending(), 2);
        assert_eq!(q.poll().unwrap(), vec![3, 4]);
        assert_eq!(q.pending(), 0);
    }
}
