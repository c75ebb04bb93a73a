//! Page copies between a GPU pool and a host pool, and the completion queue the engine loop polls.
//!
//! A GPU pool is one tensor per layer (one for page-first): block b's segment of a page is `segment_bytes` at
//! `base + b * stride`. The host page is contiguous, the layer segments back to back. On a CUDA device a batch goes
//! by one of two methods on the caller's stream, never waited for: the copy kernel (one launch, or a few, see
//! cuda/copy.cu) or the copy engine (one `cudaMemcpyBatchAsync` of the batch's pieces, where a piece is a run of
//! segments contiguous on both sides; or one `cudaMemcpy3DBatchAsync` of 2D pieces: a page's segments of layers
//! evenly spaced in one allocation each, or a layer's segments of a run of consecutive blocks and slots each;
//! whichever shape makes the fewest copies). `Method::Auto` takes the copy engine when the batch's mean
//! piece is at least the crossover (docs/PERFORMANCE.md), the kernel otherwise, and always on the legacy default
//! stream, which the copy engine's batch call refuses, and where the driver lacks it. On a CPU pool the copy is a
//! multi-threaded memcpy, complete on return. Every argument is validated before anything is copied.
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use crate::error::{invalid, Error, Result};
use crate::executor::cuda::{self, Copy2d, Event, Launch, Layer};
use crate::executor::hostmem::HostPool;

/// CTAs (CUDA thread blocks) of the copy kernel when none are given: the fewest that reach the link's ceiling
/// (docs/PERFORMANCE.md).
pub const DEFAULT_CTAS: u32 = 8;
/// Threads a CTA.
pub const DEFAULT_THREADS: u32 = 512;
/// Mean piece size from which `Method::Auto` takes the copy engine (measured: docs/PERFORMANCE.md, "Copy engine
/// against kernel").
pub const DEFAULT_CROSSOVER_BYTES: u64 = 64 << 10;
/// What one 2D copy costs the thread that submits it, in 1D pieces: `cudaMemcpy3DBatchAsync` took about 3.5 us of
/// host time a copy, `cudaMemcpyBatchAsync` about 0.8 us a piece (H200, driver 580; docs/PERFORMANCE.md, "2D copies
/// cost four pieces").
const COPY_2D_PIECES: usize = 4;
/// Below this many bytes a CPU copy stays on the calling thread.
const CPU_BYTES_PER_THREAD: u64 = 4 << 20;
const CPU_MAX_THREADS: usize = 8;

/// How a batch is copied on a CUDA device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// The copy engine for large pieces, the kernel for small ones.
    Auto,
    Kernel,
    /// The copy engine (falls back to the kernel where it cannot run: legacy default stream, older driver).
    Dma,
}

impl Method {
    /// Every name `parse` takes.
    pub const NAMES: [&'static str; 3] = ["auto", "kernel", "dma"];

    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "kernel" => Ok(Self::Kernel),
            "dma" => Ok(Self::Dma),
            _ => Err(invalid(format!("copy method must be 'auto', 'kernel' or 'dma', got {s:?}"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Kernel => "kernel",
            Self::Dma => "dma",
        }
    }
}

/// What carried a batch: the kernel, the copy engine, or memcpy on the host (CPU pools, empty batches).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Used {
    Kernel,
    Dma,
    Memcpy,
}

impl Used {
    pub fn name(self) -> &'static str {
        match self {
            Self::Kernel => "kernel",
            Self::Dma => "dma",
            Self::Memcpy => "memcpy",
        }
    }
}

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
    pub segment_bytes: u64,
    pub device: Option<i32>,
}

/// One layer tensor `[num_blocks, segment_bytes]` as its owner describes it (a DLPack capsule, in the bindings).
#[derive(Debug, Clone, Copy)]
pub struct LayerTensor {
    pub layer: Layer,
    pub num_blocks: u64,
    pub segment_bytes: u64,
    pub device: Option<i32>,
}

impl GpuPool {
    /// The pool of these layer tensors: one shape and one device for all (`layers[i]` named in errors).
    pub fn of_layers(layers: &[LayerTensor]) -> Result<Self> {
        let Some(first) = layers.first() else {
            return Err(invalid("layers is an empty list of layer tensors"));
        };
        for (i, t) in layers.iter().enumerate() {
            if (t.num_blocks, t.segment_bytes) != (first.num_blocks, first.segment_bytes) {
                return Err(invalid(format!(
                    "layers[{i}] has shape ({}, {}), layer 0 has ({}, {})",
                    t.num_blocks, t.segment_bytes, first.num_blocks, first.segment_bytes
                )));
            }
            if t.device != first.device {
                return Err(invalid(format!(
                    "all layer tensors must be on one device: layers[{i}] is on {:?}, layer 0 on {:?}",
                    t.device, first.device
                )));
            }
        }
        let num_blocks = u32::try_from(first.num_blocks)
            .map_err(|_| invalid(format!("num_blocks is too large, got {}", first.num_blocks)))?;
        Ok(Self {
            layers: layers.iter().map(|t| t.layer).collect(),
            num_blocks,
            segment_bytes: first.segment_bytes,
            device: first.device,
        })
    }
}

/// How a copier launches: kernel grid, method and crossover. `ctas` and `method` are the loads' (host -> GPU);
/// stores (GPU -> host) take `store_ctas` and `store_method`, equal to them unless set apart: stores run beside the
/// model's kernels, where each CTA they hold is an SM the model waits for, and loads are on a request's critical path.
#[derive(Debug, Clone, Copy)]
pub struct CopyOptions {
    pub ctas: u32,
    pub threads: u32,
    pub method: Method,
    pub store_ctas: u32,
    pub store_method: Method,
    pub crossover_bytes: u64,
    /// The most bytes one copy-engine copy takes: segments contiguous on both sides merge into one piece up to it,
    /// and a 2D copy takes as many rows as fit in it (one at least; a segment is never cut for it), for copy engines
    /// shared with the engine's own copies (2 MiB did not steady the copy engine's loads under vLLM). `u64::MAX`: no
    /// bound.
    pub piece_bytes: u64,
    pub debug_sync: bool,
}

impl CopyOptions {
    /// The kernel grid bound and method of copies in direction `dir`.
    pub fn lane(&self, dir: Direction) -> (u32, Method) {
        match dir {
            Direction::ToHost => (self.store_ctas, self.store_method),
            Direction::ToGpu => (self.ctas, self.method),
        }
    }
}

impl Default for CopyOptions {
    fn default() -> Self {
        Self {
            ctas: DEFAULT_CTAS,
            threads: DEFAULT_THREADS,
            method: Method::Auto,
            store_ctas: DEFAULT_CTAS,
            store_method: Method::Auto,
            crossover_bytes: DEFAULT_CROSSOVER_BYTES,
            piece_bytes: u64::MAX,
            debug_sync: false,
        }
    }
}

/// Copies pages between one GPU pool and one host pool. A clone copies between the same memory (the owner of the
/// GPU pool keeps it alive for every clone, as `new` requires).
#[derive(Clone)]
pub struct PageCopier {
    pool: GpuPool,
    host: Arc<HostPool>,
    opts: CopyOptions,
    dma: bool,
    runs: Vec<LayerRun>,
}

/// Consecutive layers whose tensors are evenly spaced (`spacing` bytes from one base to the next) with one block
/// stride, inside one CUDA allocation (CUDA refuses a 2D copy that spans two: "invalid argument"): a page's
/// segments of these layers are the rows of one 2D copy, back to back in the host page and `spacing` apart on the
/// GPU. The copy engine then takes one piece a page and run instead of one a page and layer.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LayerRun {
    layers: Range<usize>,
    spacing: u64,
}

/// The copy engine's shapes of a batch (`PageCopier::dma_shape`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Shape {
    Pieces,
    PageRows,
    /// With the batch's runs of consecutive blocks and slots.
    BlockRows(Vec<Range<usize>>),
}

/// The maximal runs of a batch's pages whose GPU blocks and host slots both go up by one.
fn block_runs(gpu_ids: &[i32], host_slots: &[i32]) -> Vec<Range<usize>> {
    let mut runs = Vec::new();
    let mut start = 0;
    for i in 1..=gpu_ids.len() {
        if i == gpu_ids.len() || gpu_ids[i] != gpu_ids[i - 1] + 1 || host_slots[i] != host_slots[i - 1] + 1 {
            runs.push(start..i);
            start = i;
        }
    }
    runs
}

/// How many rows of `width` bytes, `pitch` apart from host pool offset `off` on, end inside the pin step `off` is
/// in (0 when the first already reaches into the next).
fn rows_in_step(off: u64, width: u64, pitch: u64, step: u64) -> u64 {
    let step_end = (off / step + 1) * step;
    if off + width > step_end {
        0
    } else {
        (step_end - off - width) / pitch + 1
    }
}

/// One segment (at `off` in the host pool) that crosses a pin step, as one 1-row copy a step it touches.
fn step_row(ops: &mut Vec<Copy2d>, dev: u64, host_base: u64, off: u64, seg: u64, step: u64) {
    for (at, width) in step_cuts(off, seg, step) {
        ops.push(Copy2d { dev: dev + at, host: host_base + off + at, width, height: 1, dev_pitch: 0, host_pitch: 0 });
    }
}

/// The layer runs of a pool's layers, in order (single layers where no spacing repeats); `allocation` names the
/// allocation that holds an address (None: unknown, so no run).
fn layer_runs(layers: &[Layer], segment_bytes: u64, allocation: impl Fn(u64) -> Option<u64>) -> Vec<LayerRun> {
    let allocations: Vec<Option<u64>> = layers.iter().map(|l| allocation(l.base)).collect();
    let step = |i: usize| {
        let (a, b) = (layers[i], layers[i + 1]);
        let one = allocations[i].is_some() && allocations[i] == allocations[i + 1];
        (one && b.base > a.base && b.base - a.base >= segment_bytes && a.stride == b.stride).then(|| b.base - a.base)
    };
    let mut runs = Vec::new();
    let mut start = 0;
    while start < layers.len() {
        let mut end = start + 1;
        let spacing = if end < layers.len() { step(start) } else { None };
        if let Some(d) = spacing {
            while end < layers.len() && step(end - 1) == Some(d) {
                end += 1;
            }
        }
        runs.push(LayerRun { layers: start..end, spacing: spacing.unwrap_or(0) });
        start = end;
    }
    runs
}

impl PageCopier {
    /// # Safety
    /// Every layer range `base .. base + (num_blocks - 1) * stride + segment_bytes` must stay valid memory of
    /// `pool.device` (host memory when None) for the copier's life and until its last copy completes.
    pub unsafe fn new(pool: GpuPool, host: Arc<HostPool>, opts: CopyOptions) -> Result<Self> {
        let CopyOptions { ctas, store_ctas, threads, piece_bytes, .. } = opts;
        let n = pool.layers.len();
        if n == 0 || n > cuda::MAX_LAYERS {
            return Err(invalid(format!("a GPU pool has 1 to {} layer tensors, got {n}", cuda::MAX_LAYERS)));
        }
        if pool.segment_bytes == 0 || !pool.segment_bytes.is_multiple_of(16) {
            return Err(invalid(format!(
                "bytes per block of each layer tensor must be a positive multiple of 16, got {}",
                pool.segment_bytes
            )));
        }
        if pool.num_blocks == 0 || pool.num_blocks > i32::MAX as u32 {
            return Err(invalid(format!("num_blocks must be 1 to 2^31 - 1, got {}", pool.num_blocks)));
        }
        for (i, l) in pool.layers.iter().enumerate() {
            if l.base % 16 != 0 {
                return Err(invalid(format!("layer {i}: data pointer {:#x} is not 16-byte aligned", l.base)));
            }
            if l.stride % 16 != 0 || l.stride < pool.segment_bytes {
                return Err(invalid(format!(
                    "layer {i}: block stride {} must be a multiple of 16 and >= {} bytes",
                    l.stride, pool.segment_bytes
                )));
            }
        }
        let page_bytes = pool.segment_bytes * n as u64;
        if host.slot_bytes() != page_bytes {
            return Err(invalid(format!(
                "host pool slot_bytes = {} differs from the page size {page_bytes} ({n} layer(s) x {} bytes)",
                host.slot_bytes(),
                pool.segment_bytes
            )));
        }
        for (name, value) in [("ctas", ctas), ("store_ctas", store_ctas)] {
            if !(1..=65535).contains(&value) {
                return Err(invalid(format!("{name} must be 1 to 65535, got {value}")));
            }
        }
        if threads == 0 || threads > 1024 || threads % 32 != 0 {
            return Err(invalid(format!("threads must be a multiple of 32 from 32 to 1024, got {threads}")));
        }
        if piece_bytes == 0 {
            return Err(invalid("piece_bytes must be at least 1"));
        }
        if pool.device.is_some() {
            if !cuda::COMPILED {
                return Err(Error::Copy("the GPU pool is on a CUDA device but CUDA is not compiled in".into()));
            }
            if !host.pinned() {
                return Err(invalid("the host pool is not pinned (pin=False), so a CUDA device cannot reach it"));
            }
        }
        let dma = pool.device.is_some() && cuda::dma_supported();
        // On the CPU no copy-engine copy runs, and the runs only shape `dma_ops` (the tests).
        let runs = match pool.device {
            Some(_) => layer_runs(&pool.layers, pool.segment_bytes, cuda::allocation_base),
            None => layer_runs(&pool.layers, pool.segment_bytes, |_| Some(0)),
        };
        Ok(Self { pool, host, opts, dma, runs })
    }

    pub fn pool(&self) -> &GpuPool {
        &self.pool
    }

    pub fn host(&self) -> &Arc<HostPool> {
        &self.host
    }

    pub fn options(&self) -> &CopyOptions {
        &self.opts
    }

    /// The pool's layers as runs of evenly spaced tensors (see `LayerRun`), in order.
    pub fn layer_runs(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        self.runs.iter().map(|r| r.layers.clone())
    }

    /// Whether the copy engine path can run here (a CUDA pool, CUDA 12.8+ runtime and driver).
    pub fn dma_available(&self) -> bool {
        self.dma
    }

    pub fn page_bytes(&self) -> u64 {
        self.pool.segment_bytes * self.pool.layers.len() as u64
    }

    /// GPU blocks `gpu_ids[i]` -> host slots `host_slots[i]`.
    pub fn to_host(&self, gpu_ids: &[i32], host_slots: &[i32], stream: u64) -> Result<Used> {
        self.copy(Direction::ToHost, gpu_ids, host_slots, stream, 0..self.pool.layers.len())
    }

    /// Host slots `host_slots[i]` -> GPU blocks `gpu_ids[i]`.
    pub fn to_gpu(&self, host_slots: &[i32], gpu_ids: &[i32], stream: u64) -> Result<Used> {
        self.copy(Direction::ToGpu, gpu_ids, host_slots, stream, 0..self.pool.layers.len())
    }

    /// The segments of layers `layers` only (a layer-wise load issues one call a layer or group of layers).
    pub fn copy(
        &self,
        dir: Direction,
        gpu_ids: &[i32],
        host_slots: &[i32],
        stream: u64,
        layers: Range<usize>,
    ) -> Result<Used> {
        self.validate(dir, gpu_ids, host_slots)?;
        self.launch(dir, gpu_ids, host_slots, stream, layers)
    }

    /// `copy` of ids `validate` accepted.
    pub(crate) fn launch(
        &self,
        dir: Direction,
        gpu_ids: &[i32],
        host_slots: &[i32],
        stream: u64,
        layers: Range<usize>,
    ) -> Result<Used> {
        let mem = self.host.access()?;
        let n_layers = self.pool.layers.len();
        if layers.start >= layers.end || layers.end > n_layers {
            return Err(invalid(format!(
                "layers {}..{} is not a non-empty range of the pool's {n_layers}",
                layers.start, layers.end
            )));
        }
        if gpu_ids.is_empty() {
            return Ok(Used::Memcpy);
        }
        let result = match self.pool.device {
            Some(device) => {
                let (ctas, method) = self.opts.lane(dir);
                if self.choose_dma(method, gpu_ids, host_slots, stream, &layers) {
                    self.dma_copy(device, dir, gpu_ids, host_slots, stream, layers).map(|()| Used::Dma)
                } else {
                    let launch = Launch {
                        layers: &self.pool.layers[layers.clone()],
                        segment_bytes: self.pool.segment_bytes,
                        host_base: self.host.base_ptr() + layers.start as u64 * self.pool.segment_bytes,
                        slot_bytes: self.host.slot_bytes(),
                        device,
                        ctas,
                        threads: self.opts.threads,
                        to_host: dir == Direction::ToHost,
                        debug_sync: self.opts.debug_sync,
                    };
                    // SAFETY: ids were validated against both pools; the GPU pool stays alive per `new`'s contract
                    // and the host slots are pinned and mapped until close, which the caller orders after completion.
                    unsafe { cuda::copy_pages(&launch, gpu_ids, host_slots, stream) }.map(|()| Used::Kernel)
                }
            }
            None => {
                self.cpu_copy(dir, gpu_ids, host_slots, layers);
                Ok(Used::Memcpy)
            }
        };
        drop(mem);
        result
    }

    /// Pieces the batch makes for the copy engine: runs of pages whose segments are contiguous on both sides.
    fn piece_count(&self, gpu_ids: &[i32], host_slots: &[i32], layers: &Range<usize>) -> usize {
        let seg = self.pool.segment_bytes;
        // A host page holds all its layers' segments, so consecutive slots are contiguous in one layer only when
        // the pool has one layer; the GPU side needs consecutive ids with stride == segment.
        let merges = self.pool.layers.len() == 1 && self.pool.layers[0].stride == seg && self.host.slot_bytes() == seg;
        let runs = if merges {
            1 + gpu_ids
                .windows(2)
                .zip(host_slots.windows(2))
                .filter(|(g, h)| g[1] != g[0] + 1 || h[1] != h[0] + 1)
                .count()
        } else {
            gpu_ids.len()
        };
        runs * layers.len()
    }

    fn choose_dma(
        &self,
        method: Method,
        gpu_ids: &[i32],
        host_slots: &[i32],
        stream: u64,
        layers: &Range<usize>,
    ) -> bool {
        // 0 and 1 are the legacy default stream (cudaStreamLegacy), which cudaMemcpyBatchAsync refuses.
        if !self.dma || stream <= 1 {
            return false;
        }
        match method {
            Method::Kernel => false,
            Method::Dma => true,
            Method::Auto => {
                let bytes = gpu_ids.len() as u64 * self.pool.segment_bytes * layers.len() as u64;
                let pieces = self.piece_count(gpu_ids, host_slots, layers) as u64;
                bytes >= self.opts.crossover_bytes * pieces
            }
        }
    }

    fn dma_copy(
        &self,
        device: i32,
        dir: Direction,
        gpu_ids: &[i32],
        host_slots: &[i32],
        stream: u64,
        layers: Range<usize>,
    ) -> Result<()> {
        let ops = match self.dma_shape(gpu_ids, host_slots, &layers) {
            Shape::Pieces => None,
            Shape::PageRows => Some(self.dma_ops(gpu_ids, host_slots, layers.clone())),
            Shape::BlockRows(runs) => Some(self.dma_block_ops(gpu_ids, host_slots, &runs, layers.clone())),
        };
        if let Some(ops) = ops {
            // SAFETY: as for the kernel: validated ids, live pools, pinned host slots until completion.
            return unsafe {
                cuda::memcpy_2d_batch(device, &ops, dir == Direction::ToHost, stream, self.opts.debug_sync)
            };
        }
        let Pieces { dev, host, size, .. } = self.dma_pieces(gpu_ids, host_slots, layers);
        let (srcs, dsts) = match dir {
            Direction::ToHost => (dev, host),
            Direction::ToGpu => (host, dev),
        };
        // SAFETY: as for the kernel: validated ids, live pools, pinned host slots until completion.
        unsafe { cuda::memcpy_batch(device, &dsts, &srcs, &size, stream, self.opts.debug_sync) }
    }

    /// How the copy engine takes a batch: as 1D pieces, as 2D copies of a page's segments of evenly spaced layers
    /// (`dma_ops`), or as 2D copies of one layer's segments of consecutive blocks and slots (`dma_block_ops`);
    /// whichever costs the submitting thread least, a 2D copy counted as `COPY_2D_PIECES` pieces (ties go to the
    /// simpler), counted before the cuts at pin steps.
    fn dma_shape(&self, gpu_ids: &[i32], host_slots: &[i32], layers: &Range<usize>) -> Shape {
        let pages = gpu_ids.len();
        let rows = |r: &LayerRun| r.layers.end.min(layers.end).saturating_sub(r.layers.start.max(layers.start));
        let pieces = self.piece_count(gpu_ids, host_slots, layers);
        let page_rows = if self.runs.iter().any(|r| rows(r) > 1) {
            pages * self.runs.iter().filter(|r| rows(r) > 0).count() * COPY_2D_PIECES
        } else {
            usize::MAX
        };
        let runs = block_runs(gpu_ids, host_slots);
        let block_rows = if runs.len() < pages { runs.len() * layers.len() * COPY_2D_PIECES } else { usize::MAX };
        if pieces <= page_rows.min(block_rows) {
            Shape::Pieces
        } else if page_rows <= block_rows {
            Shape::PageRows
        } else {
            Shape::BlockRows(runs)
        }
    }

    /// The copy engine's pieces of a batch: runs of segments contiguous on both sides (up to `piece_bytes`), layer by
    /// layer. A host pool registered with CUDA one pin step at a time cannot take a copy-engine piece across two
    /// registrations: pieces are cut at the pool's `copy_span_bytes` (the driver's memory is one span; the kernel,
    /// which reads 16 bytes at a time, is never cut).
    fn dma_pieces(&self, gpu_ids: &[i32], host_slots: &[i32], layers: Range<usize>) -> Pieces {
        let seg = self.pool.segment_bytes;
        let host_base = self.host.base_ptr();
        let slot_bytes = self.host.slot_bytes();
        let step = self.host.copy_span_bytes();
        let cap = gpu_ids.len() * layers.len();
        let mut pieces = Pieces {
            dev: Vec::with_capacity(cap),
            host: Vec::with_capacity(cap),
            size: Vec::with_capacity(cap),
            max: self.opts.piece_bytes,
        };
        for l in layers {
            let layer = self.pool.layers[l];
            for (&g, &h) in gpu_ids.iter().zip(host_slots) {
                let dev = layer.base + g as u64 * layer.stride;
                let off = h as u64 * slot_bytes + l as u64 * seg;
                for (at, len) in step_cuts(off, seg, step) {
                    pieces.push(dev + at, host_base + off + at, len, !(off + at).is_multiple_of(step));
                }
            }
        }
        pieces
    }

    /// The copy engine's 2D copies of a batch, for a pool with layer runs: one a page and run (its segments of
    /// `layers`), cut where the host page crosses a pin step: the rows before the step, the row across it in
    /// pieces, the rows after.
    fn dma_ops(&self, gpu_ids: &[i32], host_slots: &[i32], layers: Range<usize>) -> Vec<Copy2d> {
        let seg = self.pool.segment_bytes;
        let host_base = self.host.base_ptr();
        let slot_bytes = self.host.slot_bytes();
        let step = self.host.copy_span_bytes();
        let mut ops = Vec::with_capacity(gpu_ids.len() * self.runs.len());
        for (&g, &h) in gpu_ids.iter().zip(host_slots) {
            for run in &self.runs {
                let (mut l, end) = (run.layers.start.max(layers.start), run.layers.end.min(layers.end));
                while l < end {
                    let layer = self.pool.layers[l];
                    let dev = layer.base + g as u64 * layer.stride;
                    let off = h as u64 * slot_bytes + l as u64 * seg;
                    let rows = rows_in_step(off, seg, seg, step).min((end - l) as u64).min(self.max_rows());
                    if rows > 0 {
                        ops.push(Copy2d {
                            dev,
                            host: host_base + off,
                            width: seg,
                            height: rows,
                            dev_pitch: run.spacing,
                            host_pitch: seg,
                        });
                        l += rows as usize;
                        continue;
                    }
                    step_row(&mut ops, dev, host_base, off, seg, step);
                    l += 1;
                }
            }
        }
        ops
    }

    /// The copy engine's 2D copies of a batch whose pages come in `runs` of consecutive GPU blocks and host slots
    /// (`block_runs`): one a layer and run, its rows the layer's segments of the run's pages (a block stride apart
    /// on the GPU, a host slot apart on the host), cut where the rows would reach into the next pin step; a row
    /// across a step goes in pieces.
    fn dma_block_ops(
        &self,
        gpu_ids: &[i32],
        host_slots: &[i32],
        runs: &[Range<usize>],
        layers: Range<usize>,
    ) -> Vec<Copy2d> {
        let seg = self.pool.segment_bytes;
        let host_base = self.host.base_ptr();
        let slot_bytes = self.host.slot_bytes();
        let step = self.host.copy_span_bytes();
        let mut ops = Vec::with_capacity(runs.len() * layers.len());
        for l in layers {
            let layer = self.pool.layers[l];
            for run in runs {
                let mut i = run.start;
                while i < run.end {
                    let dev = layer.base + gpu_ids[i] as u64 * layer.stride;
                    let off = host_slots[i] as u64 * slot_bytes + l as u64 * seg;
                    let rows = rows_in_step(off, seg, slot_bytes, step).min((run.end - i) as u64).min(self.max_rows());
                    if rows == 0 {
                        step_row(&mut ops, dev, host_base, off, seg, step);
                        i += 1;
                        continue;
                    }
                    ops.push(Copy2d {
                        dev,
                        host: host_base + off,
                        width: seg,
                        height: rows,
                        dev_pitch: layer.stride,
                        host_pitch: slot_bytes,
                    });
                    i += rows as usize;
                }
            }
        }
        ops
    }

    /// The most rows of segments one 2D copy takes (`piece_bytes`, one row at least).
    fn max_rows(&self) -> u64 {
        (self.opts.piece_bytes / self.pool.segment_bytes).max(1)
    }

    /// Checks a batch before anything is copied: equal lengths, every id inside its pool (host slots below the
    /// usable ones), no destination named twice.
    pub fn validate(&self, dir: Direction, gpu_ids: &[i32], host_slots: &[i32]) -> Result<()> {
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
        let (usable, slots) = (self.host.usable_slots(), self.host.slots());
        for (i, &s) in host_slots.iter().enumerate() {
            if s < 0 || s as u32 >= slots {
                return Err(invalid(format!("host_slots[{i}] = {s} is outside the host pool of {slots} slots")));
            }
            // A slot of the pool not pinned yet: the pool's state, not the caller's mistake.
            if s as u32 >= usable {
                return Err(Error::State(format!(
                    "host_slots[{i}] = {s} is not below usable_slots = {usable} (of {slots} slots)"
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

    /// Both pools are host memory: copy each (page, layer) segment, spread over a few threads for large batches.
    fn cpu_copy(&self, dir: Direction, gpu_ids: &[i32], host_slots: &[i32], layers: Range<usize>) {
        let seg = self.pool.segment_bytes;
        let pool_layers = &self.pool.layers;
        let host_base = self.host.base_ptr();
        let slot_bytes = self.host.slot_bytes();
        let copy_page = |i: usize| {
            for l in layers.clone() {
                let layer = pool_layers[l];
                let dev = layer.base + gpu_ids[i] as u64 * layer.stride;
                let host = host_base + host_slots[i] as u64 * slot_bytes + l as u64 * seg;
                let (src, dst) = match dir {
                    Direction::ToHost => (dev, host),
                    Direction::ToGpu => (host, dev),
                };
                // SAFETY: validated ids inside both pools; destinations are distinct, and the two pools are
                // separate allocations, so no two copies of a batch overlap.
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, seg as usize) };
            }
        };
        let n = gpu_ids.len();
        let threads = crate::par::threads_for(n as u64 * self.page_bytes(), CPU_BYTES_PER_THREAD, n, CPU_MAX_THREADS);
        crate::par::map(n, threads, copy_page);
    }
}

/// `len` bytes at host pool offset `off` as the pieces that each stay inside one pin step of `step` bytes: (offset
/// from `off`, length) in order.
fn step_cuts(off: u64, len: u64, step: u64) -> impl Iterator<Item = (u64, u64)> {
    let mut at = 0;
    std::iter::from_fn(move || {
        (at < len).then(|| {
            let piece = (step - (off + at) % step).min(len - at);
            at += piece;
            (at - piece, piece)
        })
    })
}

/// Copy-engine pieces, merged while contiguous on both sides, inside one copy span of the host pool and up to `max`
/// bytes.
struct Pieces {
    dev: Vec<u64>,
    host: Vec<u64>,
    size: Vec<usize>,
    max: u64,
}

impl Pieces {
    /// `joins`: the piece starts inside the step the previous byte of host memory is in (not at a step boundary).
    fn push(&mut self, dev: u64, host: u64, len: u64, joins: bool) {
        if joins {
            if let (Some(&d), Some(&h), Some(last)) = (self.dev.last(), self.host.last(), self.size.last_mut()) {
                if d + *last as u64 == dev && h + *last as u64 == host && *last as u64 + len <= self.max {
                    *last += len as usize;
                    return;
                }
            }
        }
        self.dev.push(dev);
        self.host.push(host);
        self.size.push(len as usize);
    }
}

/// Tickets of launched work in launch order, each with the event recorded after it; polled without blocking.
pub struct CompletionQueue {
    device: Option<i32>,
    pending: VecDeque<(u64, Option<Event>)>,
    free: Vec<Event>,
}

impl CompletionQueue {
    /// A queue for copies on CUDA device `device`, or for CPU copies (None: every ticket completes at once).
    pub fn new(device: Option<i32>) -> Result<Self> {
        if let Some(d) = device {
            let count = cuda::device_count();
            if d < 0 || d >= count {
                return Err(invalid(format!("device {d} is not a visible CUDA device ({count} visible)")));
            }
        }
        Ok(Self { device, pending: VecDeque::new(), free: Vec::new() })
    }

    /// Record `ticket` as complete once the work launched so far on `stream` is.
    pub fn record(&mut self, ticket: u64, stream: u64) -> Result<()> {
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
        self.pending.push_back((ticket, event));
        Ok(())
    }

    /// Tickets completed since the last poll, in record order, up to the first that is still running.
    pub fn poll(&mut self) -> Result<Vec<u64>> {
        let mut done = Vec::new();
        while let Some((_, ev)) = self.pending.front() {
            if let Some(ev) = ev {
                if !ev.done()? {
                    break;
                }
            }
            let (ticket, ev) = self.pending.pop_front().expect("front exists");
            self.free.extend(ev);
            done.push(ticket);
        }
        Ok(done)
    }

    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Block until everything recorded has completed; returns the tickets not yet returned by `poll`.
    pub fn wait_all(&mut self) -> Result<Vec<u64>> {
        // Every event, not just the last: tickets may have been recorded on different streams.
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

    #[test]
    fn a_pool_of_layer_tensors_has_one_shape_and_one_device() {
        let t = |base: u64, blocks: u64, device: Option<i32>| LayerTensor {
            layer: Layer { base, stride: 64 },
            num_blocks: blocks,
            segment_bytes: 64,
            device,
        };
        let pool = GpuPool::of_layers(&[t(0x1000, 4, Some(0)), t(0x9000, 4, Some(0))]).unwrap();
        assert_eq!((pool.layers.len(), pool.num_blocks, pool.segment_bytes, pool.device), (2, 4, 64, Some(0)));
        let err = |layers: &[LayerTensor]| GpuPool::of_layers(layers).unwrap_err().to_string();
        assert_eq!(err(&[]), "layers is an empty list of layer tensors");
        assert_eq!(err(&[t(0, 4, None), t(0, 5, None)]), "layers[1] has shape (5, 64), layer 0 has (4, 64)");
        assert!(err(&[t(0, 4, None), t(0, 4, Some(1))]).starts_with("all layer tensors must be on one device"));
        assert!(err(&[t(0, 1 << 33, None)]).starts_with("num_blocks is too large"));
    }
    use crate::executor::hostmem::PinMethod;

    fn pool_and_copier(layers: usize, seg: u64, blocks: u32, slots: u32) -> (Vec<Vec<u8>>, PageCopier) {
        let mut mem: Vec<Vec<u8>> =
            (0..layers).map(|l| vec![l as u8; (seg as usize + 16) * blocks as usize + 16]).collect();
        let layer_ptrs = mem
            .iter_mut()
            .map(|m| {
                let base = (m.as_mut_ptr() as u64).next_multiple_of(16);
                Layer { base, stride: seg + 16 }
            })
            .collect();
        let host = Arc::new(HostPool::new(slots, seg * layers as u64, 1 << 16, Some(false), PinMethod::Auto).unwrap());
        host.grow_to(slots).unwrap();
        let pool = GpuPool { layers: layer_ptrs, num_blocks: blocks, segment_bytes: seg, device: None };
        // SAFETY: `mem` is returned to the test and outlives the copier's use.
        let copier = unsafe { PageCopier::new(pool, host, CopyOptions::default()).unwrap() };
        (mem, copier)
    }

    #[test]
    fn stores_and_loads_each_take_their_own_grid_and_method() {
        let opts = CopyOptions { store_ctas: 2, store_method: Method::Dma, ..CopyOptions::default() };
        assert_eq!(opts.lane(Direction::ToHost), (2, Method::Dma));
        assert_eq!(opts.lane(Direction::ToGpu), (DEFAULT_CTAS, Method::Auto));
        let (_mem, c) = pool_and_copier(1, 32, 4, 4);
        let bad = CopyOptions { store_ctas: 0, ..CopyOptions::default() };
        // SAFETY: refused before any memory is reached.
        let err = unsafe { PageCopier::new(c.pool().clone(), Arc::clone(c.host()), bad) }.err().unwrap();
        assert!(err.to_string().contains("store_ctas must be 1 to 65535, got 0"), "{err}");
    }

    #[test]
    fn every_copy_method_name_parses_to_itself() {
        for name in Method::NAMES {
            assert_eq!(Method::parse(name).unwrap().name(), name);
        }
        assert!(Method::parse("fast").is_err());
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
    fn some_layers_only() {
        let (_mem, c) = pool_and_copier(3, 32, 6, 4);
        assert_eq!(c.to_host(&[5], &[1], 0).unwrap(), Used::Memcpy);
        c.host().write(2, &[9u8; 96]).unwrap();
        c.copy(Direction::ToGpu, &[5], &[2], 0, 1..2).unwrap();
        c.to_host(&[5], &[3], 0).unwrap();
        assert_eq!(c.host().read(3).unwrap(), [vec![0u8; 32], vec![9; 32], vec![2; 32]].concat());
        assert!(c.copy(Direction::ToGpu, &[5], &[2], 0, 2..4).unwrap_err().to_string().contains("layers 2..4"));
        assert!(c.copy(Direction::ToGpu, &[5], &[2], 0, 1..1).is_err());
        assert_eq!(Method::parse("dma").unwrap(), Method::Dma);
        assert!(Method::parse("fast").unwrap_err().to_string().contains("\"fast\""));
    }

    #[test]
    fn dma_pieces_merge_runs_and_cut_at_pin_steps() {
        // One layer of 1536-byte pages, contiguous on the GPU side; the host pool registers 4096-byte pin steps.
        let mut mem = vec![0u8; 1536 * 16 + 16];
        let base = (mem.as_mut_ptr() as u64).next_multiple_of(16);
        let host = Arc::new(HostPool::new(16, 1536, 4096, Some(false), PinMethod::Auto).unwrap());
        host.grow_to(16).unwrap();
        let pool =
            GpuPool { layers: vec![Layer { base, stride: 1536 }], num_blocks: 16, segment_bytes: 1536, device: None };
        // SAFETY: `mem` outlives the copier, which copies nothing here.
        let c = unsafe { PageCopier::new(pool, Arc::clone(&host), CopyOptions::default()).unwrap() };
        let ids: Vec<i32> = (0..8).collect();
        let p = c.dma_pieces(&ids, &ids, 0..1);
        // 8 pages = 12288 bytes, one run on both sides, cut at the host steps: three pieces of 4096.
        assert_eq!(p.size, vec![4096, 4096, 4096]);
        assert_eq!(p.host, vec![host.base_ptr(), host.base_ptr() + 4096, host.base_ptr() + 8192]);
        assert_eq!(p.dev, vec![base, base + 4096, base + 8192]);
        // Not consecutive on the GPU side: no merge, though the host side is contiguous; slot 2 straddles a step.
        let p = c.dma_pieces(&[0, 5, 9], &[0, 1, 2], 0..1);
        assert_eq!(p.size, vec![1536, 1536, 1024, 512]);
        assert_eq!(p.dev, vec![base, base + 5 * 1536, base + 9 * 1536, base + 9 * 1536 + 1024]);
        drop(mem);
    }

    #[test]
    fn copy_engine_copies_stop_at_piece_bytes_but_never_cut_a_segment() {
        // One layer of 1536-byte pages, contiguous on both sides, in one pin step: unbounded, one piece.
        let mut mem = vec![0u8; 1536 * 16 + 16];
        let base = (mem.as_mut_ptr() as u64).next_multiple_of(16);
        let host = Arc::new(HostPool::new(16, 1536, 1 << 20, Some(false), PinMethod::Auto).unwrap());
        host.grow_to(16).unwrap();
        let copier = |piece_bytes| {
            let pool = GpuPool {
                layers: vec![Layer { base, stride: 1536 }],
                num_blocks: 16,
                segment_bytes: 1536,
                device: None,
            };
            // SAFETY: `mem` outlives the copiers, which copy nothing here.
            unsafe { PageCopier::new(pool, Arc::clone(&host), CopyOptions { piece_bytes, ..Default::default() }) }
        };
        let ids: Vec<i32> = (0..7).collect();
        assert_eq!(copier(u64::MAX).unwrap().dma_pieces(&ids, &ids, 0..1).size, vec![7 * 1536]);
        // Up to 3072 bytes: two pages a piece, the seventh alone.
        let p = copier(3072).unwrap().dma_pieces(&ids, &ids, 0..1);
        assert_eq!(p.size, vec![3072, 3072, 3072, 1536]);
        assert_eq!(p.dev, vec![base, base + 3072, base + 6144, base + 9216]);
        // A bound below a segment: a page a piece, none cut.
        assert_eq!(copier(1000).unwrap().dma_pieces(&ids, &ids, 0..1).size, vec![1536; 7]);
        assert!(copier(0).map(|_| ()).unwrap_err().to_string().contains("piece_bytes must be at least 1"));
        // 2D copies take as many rows as fit (one at least), in a host pool of one pin step: a run of three blocks
        // of a layer, or a page's three evenly spaced layers, is one copy unbounded, copies of 2 and 1 rows at 3072.
        let layers = vec![
            Layer { base: 0x10000, stride: 1536 },
            Layer { base: 0x20000, stride: 1536 },
            Layer { base: 0x30000, stride: 1536 },
        ];
        let host = Arc::new(HostPool::new(8, 3 * 1536, 1 << 20, Some(false), PinMethod::Auto).unwrap());
        host.grow_to(8).unwrap();
        let two_d = |piece_bytes| {
            let pool = GpuPool { layers: layers.clone(), num_blocks: 16, segment_bytes: 1536, device: None };
            // SAFETY: no copy is made.
            let c =
                unsafe { PageCopier::new(pool, Arc::clone(&host), CopyOptions { piece_bytes, ..Default::default() }) };
            let c = c.unwrap();
            let (ids, slots) = ([3, 4, 5], [0, 1, 2]);
            let heights = |ops: Vec<Copy2d>| ops.iter().map(|o| o.height).collect::<Vec<_>>();
            (
                heights(c.dma_block_ops(&ids, &slots, &block_runs(&ids, &slots), 0..1)),
                heights(c.dma_ops(&ids[..1], &slots[..1], 0..3)),
            )
        };
        assert_eq!(two_d(u64::MAX), (vec![3], vec![3]));
        assert_eq!(two_d(3072), (vec![2, 1], vec![2, 1]));
        assert_eq!(two_d(100), (vec![1, 1, 1], vec![1, 1, 1]));
        drop(mem);
    }

    #[test]
    fn layer_runs_need_one_spacing_one_stride_and_room_for_a_segment() {
        let l = |base, stride| Layer { base, stride };
        let one = |_| Some(0);
        let pool = [l(0x1000, 64), l(0x2000, 64), l(0x3000, 64), l(0x9000, 64), l(0xa000, 32)];
        let got: Vec<_> = layer_runs(&pool, 32, one).iter().map(|r| (r.layers.clone(), r.spacing)).collect();
        assert_eq!(got, vec![(0..3, 0x1000), (3..4, 0), (4..5, 0)]); // 0x9000 -> 0xa000 changes the stride
        let runs = layer_runs(&[l(0x3000, 64), l(0x2000, 64), l(0x1000, 64)], 32, one); // decreasing: no 2D copy
        assert!(runs.iter().all(|r| r.layers.len() == 1));
        let runs = layer_runs(&[l(0x1000, 64), l(0x1010, 64), l(0x1020, 64)], 32, one); // 16 bytes apart: overlap
        assert!(runs.iter().all(|r| r.layers.len() == 1));
        let runs = layer_runs(&[l(0x1000, 96), l(0x1020, 96), l(0x1040, 96)], 32, one); // page-first layer parts
        assert_eq!(runs, vec![LayerRun { layers: 0..3, spacing: 32 }]);
        // Evenly spaced, but the third layer is another allocation; an unknown allocation joins nothing.
        let two = |a: u64| Some(if a < 0x3000 { 1 } else { 2 });
        let got: Vec<_> = layer_runs(&pool[..3], 32, two).iter().map(|r| r.layers.clone()).collect();
        assert_eq!(got, vec![0..2, 2..3]);
        assert!(layer_runs(&pool[..3], 32, |_| None).iter().all(|r| r.layers.len() == 1));
    }

    #[test]
    fn dma_ops_are_a_page_a_run_cut_at_pin_steps() {
        // Four layers of 1536-byte segments: three evenly spaced, a fourth elsewhere; 6144-byte host pages, 8192-byte
        // pin steps. Nothing is copied: the addresses are only arithmetic.
        let layers = vec![
            Layer { base: 0x10000, stride: 1536 },
            Layer { base: 0x20000, stride: 1536 },
            Layer { base: 0x30000, stride: 1536 },
            Layer { base: 0x90000, stride: 1536 },
        ];
        let host = Arc::new(HostPool::new(4, 6144, 8192, Some(false), PinMethod::Auto).unwrap());
        host.grow_to(4).unwrap();
        let pool = GpuPool { layers, num_blocks: 8, segment_bytes: 1536, device: None };
        // SAFETY: no copy is made.
        let c = unsafe { PageCopier::new(pool, Arc::clone(&host), CopyOptions::default()).unwrap() };
        let hb = host.base_ptr();
        let op = |dev, host: u64, width, height, dev_pitch| Copy2d {
            dev,
            host: hb + host,
            width,
            height,
            dev_pitch,
            host_pitch: if dev_pitch > 0 || width == 1536 { 1536 } else { 0 },
        };
        // Slot 0 lies inside the first step: one copy of three rows, one of the fourth layer.
        assert_eq!(
            c.dma_ops(&[2], &[0], 0..4),
            vec![op(0x10000 + 2 * 1536, 0, 1536, 3, 0x10000), op(0x90000 + 2 * 1536, 4608, 1536, 1, 0)]
        );
        // Slot 1 (6144..12288) crosses the step at 8192 inside layer 1's segment (7680..9216).
        let d = 1536;
        assert_eq!(
            c.dma_ops(&[1], &[1], 0..4),
            vec![
                op(0x10000 + d, 6144, 1536, 1, 0x10000),
                op(0x20000 + d, 7680, 512, 1, 0),
                op(0x20000 + d + 512, 8192, 1024, 1, 0),
                op(0x30000 + d, 9216, 1536, 1, 0x10000),
                op(0x90000 + d, 10752, 1536, 1, 0),
            ]
        );
        // Some layers only: the run is cut to them.
        assert_eq!(c.dma_ops(&[0], &[0], 1..3), vec![op(0x20000, 1536, 1536, 2, 0x10000)]);
    }

    #[test]
    fn block_runs_need_both_sides_to_go_up_by_one() {
        assert_eq!(block_runs(&[4, 5, 6, 9, 10, 3], &[0, 1, 2, 3, 5, 6]), vec![0..3, 3..4, 4..5, 5..6]);
        assert_eq!(block_runs(&[7], &[2]), vec![0..1]);
        assert!(block_runs(&[], &[]).is_empty());
    }

    /// Layers of 1536-byte segments whose block strides alternate (2048, 2560 bytes), so no two make a layer run, as
    /// separately allocated layers make none; 6144-byte host pages, 8192-byte pin steps. Nothing is copied: the
    /// addresses are only arithmetic.
    fn separate_layers() -> (Arc<HostPool>, PageCopier) {
        layers_of([(0x100000, 2048), (0x300000, 2560), (0x400000, 2048), (0x900000, 2560)])
    }

    /// A copier of segments of 1536 bytes in the given layers (base, stride), its host pages pinned in steps of the
    /// next power of two above a page (8192 bytes for four layers).
    fn layers_of<const N: usize>(layers: [(u64, u64); N]) -> (Arc<HostPool>, PageCopier) {
        let layers = layers.map(|(base, stride)| Layer { base, stride }).to_vec();
        let page = 1536 * N as u64;
        let host = Arc::new(HostPool::new(8, page, page.next_power_of_two(), Some(false), PinMethod::Auto).unwrap());
        host.grow_to(8).unwrap();
        let pool = GpuPool { layers, num_blocks: 16, segment_bytes: 1536, device: None };
        // SAFETY: no copy is made.
        let c = unsafe { PageCopier::new(pool, Arc::clone(&host), CopyOptions::default()).unwrap() };
        (host, c)
    }

    #[test]
    fn dma_block_ops_are_a_layer_a_run_cut_at_pin_steps() {
        let (host, c) = separate_layers();
        let hb = host.base_ptr();
        // Blocks 3..6 to slots 0..3 (host 0..18432), layer 0 (segments at 0, 6144, 12288): the first two rows end
        // inside step 0 (..8192), the third is in step 1. Layer 1 (1536, 7680, 13824): the second row crosses 8192.
        let (ids, slots) = ([3, 4, 5], [0, 1, 2]);
        let ops = c.dma_block_ops(&ids, &slots, &block_runs(&ids, &slots), 0..2);
        let row = |dev: u64, host: u64, width, height, dev_pitch| Copy2d {
            dev,
            host: hb + host,
            width,
            height,
            dev_pitch,
            host_pitch: if dev_pitch > 0 { 6144 } else { 0 },
        };
        let (l0, l1) = (0x100000 + 3 * 2048, 0x300000 + 3 * 2560);
        assert_eq!(
            ops,
            vec![
                row(l0, 0, 1536, 2, 2048),
                row(l0 + 2 * 2048, 12288, 1536, 1, 2048),
                row(l1, 1536, 1536, 1, 2560),
                row(l1 + 2560, 7680, 512, 1, 0),
                row(l1 + 2560 + 512, 8192, 1024, 1, 0),
                row(l1 + 2 * 2560, 13824, 1536, 1, 2560),
            ]
        );
        // A 2D copy costs four pieces: a run of three pages stays in pieces (12 against 4 x 4), one of five does not.
        assert_eq!(c.dma_shape(&ids, &slots, &(0..4)), Shape::Pieces);
        let (ids, slots) = ([3, 4, 5, 6, 7], [0, 1, 2, 3, 4]);
        assert_eq!(c.dma_shape(&ids, &slots, &(0..4)), Shape::BlockRows(block_runs(&ids, &slots)));
        assert_eq!(block_runs(&ids, &slots).len(), 1);
        // No run: one piece a page and layer is as few.
        assert_eq!(c.dma_shape(&[3, 9, 5], &[0, 1, 2], &(0..4)), Shape::Pieces);
    }

    #[test]
    fn pages_mostly_alone_stay_in_pieces() {
        // A batch of pages mostly alone with a pair among them (as an engine hands out a pool's freed blocks): five
        // runs of six pages are 20 2D copies but 24 pieces, and a 2D copy costs the submitting thread about four pieces.
        let (_host, c) = separate_layers();
        assert_eq!(c.dma_shape(&[0, 2, 3, 6, 9, 12], &[0, 1, 2, 3, 4, 5], &(0..4)), Shape::Pieces);
        // Evenly spaced layers: a page's four segments are one 2D copy, four pieces: still pieces (a tie).
        let (_host, even) = layers_of([(0x100000, 2048), (0x200000, 2048), (0x300000, 2048), (0x400000, 2048)]);
        assert_eq!(even.dma_shape(&[0, 2, 9], &[0, 1, 2], &(0..4)), Shape::Pieces);
        // With more layers than four in the run, the page's rows win.
        let (_host, c) = layers_of(std::array::from_fn::<_, 8, _>(|l| (0x100000 * (l as u64 + 1), 2048)));
        assert_eq!(c.dma_shape(&[0, 2, 9], &[0, 1, 2], &(0..8)), Shape::PageRows);
    }

    /// Each copy's rows as (host address, GPU address, bytes), checking that none spans two pin steps.
    fn rows_of(ops: &[Copy2d], step: u64, host_base: u64) -> Vec<(u64, u64, u64)> {
        let mut rows = Vec::new();
        for op in ops {
            let first = (op.host - host_base) / step;
            let last = (op.host - host_base + (op.height - 1) * op.host_pitch + op.width - 1) / step;
            assert_eq!(first, last, "{op:?} spans two pin steps");
            rows.extend((0..op.height).map(|r| (op.host + r * op.host_pitch, op.dev + r * op.dev_pitch, op.width)));
        }
        rows
    }

    /// Every byte of a batch, host address to GPU address.
    fn byte_map(rows: impl IntoIterator<Item = (u64, u64, u64)>) -> std::collections::BTreeMap<u64, u64> {
        let mut map = std::collections::BTreeMap::new();
        for (host, dev, len) in rows {
            for b in 0..len {
                assert!(map.insert(host + b, dev + b).is_none(), "host byte {:#x} copied twice", host + b);
            }
        }
        map
    }

    #[test]
    fn every_copy_engine_shape_moves_the_same_bytes() {
        // Evenly spaced layers (one layer run) as well as layers that make no run.
        let even = layers_of([(0x100000, 2048), (0x200000, 2048), (0x300000, 2048), (0x400000, 2048)]);
        for (host, c) in [separate_layers(), even] {
            same_bytes_every_shape(&host, &c);
        }
    }

    fn same_bytes_every_shape(host: &HostPool, c: &PageCopier) {
        let (hb, step) = (host.base_ptr(), host.step_bytes());
        let batches: [(&[i32], &[i32]); 4] = [
            (&[3, 4, 5, 6, 7], &[0, 1, 2, 3, 4]),
            (&[0, 1, 2, 9, 10, 15], &[7, 6, 5, 1, 2, 3]),
            (&[8, 9, 10, 11, 12, 13, 14, 15], &[0, 1, 2, 3, 4, 5, 6, 7]),
            (&[2], &[5]),
        ];
        for (ids, slots) in batches {
            for layers in [0..4, 1..3, 3..4] {
                let p = c.dma_pieces(ids, slots, layers.clone());
                for (&h, &size) in p.host.iter().zip(&p.size) {
                    assert_eq!((h - hb) / step, (h - hb + size as u64 - 1) / step, "a piece spans two pin steps");
                }
                let want = byte_map(p.host.iter().zip(&p.dev).zip(&p.size).map(|((&h, &d), &n)| (h, d, n as u64)));
                let runs = block_runs(ids, slots);
                let block = byte_map(rows_of(&c.dma_block_ops(ids, slots, &runs, layers.clone()), step, hb));
                assert_eq!(block, want, "block rows of {ids:?} -> {slots:?}, layers {layers:?}");
                let page = byte_map(rows_of(&c.dma_ops(ids, slots, layers.clone()), step, hb));
                assert_eq!(page, want, "page rows of {ids:?} -> {slots:?}, layers {layers:?}");
            }
        }
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
