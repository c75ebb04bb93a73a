//! Copy jobs an engine names itself (vLLM's offloading worker): a job is a batch of pieces, each a copier's GPU
//! blocks paired with host slots (of some of its layers or all), copied on one of three lanes: stores, loads and
//! expedited loads. With copy streams each lane is a copy stream of its own that starts a job after the work the
//! engine launched on its stream so far (an event between them); without, the job runs on the engine's stream. A job
//! completes once its copies have; `finished` returns the completed jobs of each lane in submission order, so a load
//! never waits behind a store still running on the store lane.
//!
//! Every piece is checked before anything is copied (the caller's error); a copy that fails afterwards (a CUDA
//! error) fails the job, reported by `finished` once the copies launched before it are done: a failed load's
//! blocks are not written after the engine is told. A completed job says how long its copies took (timing events
//! around them on their stream; the host's clock for CPU copies), what vLLM's transfer metrics record.
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::time::Instant;

use crate::error::{invalid, Error, Result};
use crate::executor::copy::{CompletionQueue, Direction, PageCopier};
use crate::executor::cuda::{Event, Stream};

/// The lanes' names, in `Lane` order.
pub const LANES: [&str; 3] = ["store", "load", "expedited"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    Store,
    Load,
    Expedited,
}

impl Lane {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "store" => Ok(Self::Store),
            "load" => Ok(Self::Load),
            "expedited" => Ok(Self::Expedited),
            _ => Err(invalid(format!("lane must be one of {LANES:?}, got {name:?}"))),
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Copier `copier`'s GPU blocks `gpu_ids[i]` <-> host slots `host_slots[i]`, the segments of layers `layers` only
/// (None: every layer).
pub struct Piece<'a> {
    pub copier: usize,
    pub gpu_ids: &'a [i32],
    pub host_slots: &'a [i32],
    pub layers: Option<Range<usize>>,
}

/// A completed job: its id, whether every copy succeeded, the bytes it moved (0 when it failed) and the seconds its
/// copies took, from their start on their stream (after the engine's work and the lane's earlier jobs) to their end
/// (None when the job failed or could not be timed).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finished {
    pub job: u64,
    pub ok: bool,
    pub bytes: u64,
    pub seconds: Option<f64>,
}

/// How a job in flight is timed.
enum Clock {
    /// CPU copies, complete when `submit` returned: their seconds.
    Host(f64),
    /// Timing events recorded on the job's stream before and after its copies.
    Device(Event, Event),
    Off,
}

struct Running {
    bytes: u64,
    clock: Clock,
}

struct LaneQueue {
    stream: Option<Stream>,
    queue: CompletionQueue,
}

pub struct Jobs {
    copiers: Vec<PageCopier>,
    lanes: Vec<LaneQueue>,
    /// Recorded on the engine's stream and waited for by a lane's stream before a job (with copy streams).
    order: Option<Event>,
    /// Jobs in flight: their bytes and clocks.
    running: HashMap<u64, Running>,
    /// Timing events not in use.
    timers: Vec<Event>,
    failed: HashSet<u64>,
    done: Vec<Finished>,
}

impl Jobs {
    /// Jobs over `copiers` (one device, or all on the CPU); copy streams only on a CUDA device and when asked for.
    pub fn new(copiers: Vec<PageCopier>, copy_streams: bool) -> Result<Self> {
        let first = copiers.first().ok_or_else(|| invalid("no page copiers"))?;
        let device = first.pool().device;
        if let Some(c) = copiers.iter().find(|c| c.pool().device != device) {
            return Err(invalid(format!("every copier must be on one device: {:?} and {:?}", device, c.pool().device)));
        }
        let streams = copy_streams && device.is_some();
        let lanes = LANES
            .iter()
            .map(|_| {
                let stream = match device {
                    Some(d) if streams => Some(Stream::new(d)?),
                    _ => None,
                };
                Ok(LaneQueue { stream, queue: CompletionQueue::new(device)? })
            })
            .collect::<Result<Vec<_>>>()?;
        let order = match device {
            Some(d) if streams => Some(Event::new(d)?),
            _ => None,
        };
        Ok(Self {
            copiers,
            lanes,
            order,
            running: HashMap::new(),
            timers: Vec::new(),
            failed: HashSet::new(),
            done: Vec::new(),
        })
    }

    /// The copiers' CUDA device (None: CPU pools; `new` checked they share one).
    fn device(&self) -> Option<i32> {
        self.copiers[0].pool().device
    }

    /// Whether jobs run on kvtier's own copy streams (else on the engine's).
    pub fn copy_streams(&self) -> bool {
        self.order.is_some()
    }

    /// The raw stream of `lane` (None without copy streams).
    pub fn lane_stream(&self, lane: Lane) -> Option<u64> {
        self.lanes[lane.index()].stream.as_ref().map(Stream::handle)
    }

    /// Checks every piece, then copies them all (GPU to host when `to_host`) on `lane`, after the work launched so
    /// far on `engine_stream` (a raw cudaStream_t; ignored on the CPU, where the copies finish before this returns).
    /// Returns the CUDA error that failed the job, if one did (`finished` reports the job failed).
    pub fn submit(
        &mut self,
        job: u64,
        to_host: bool,
        lane: Lane,
        pieces: &[Piece<'_>],
        engine_stream: u64,
    ) -> Result<Option<Error>> {
        if self.running.contains_key(&job) {
            return Err(invalid(format!("job {job} is in flight already")));
        }
        let dir = if to_host { Direction::ToHost } else { Direction::ToGpu };
        let mut ranges = Vec::with_capacity(pieces.len());
        let mut bytes = 0u64;
        for (i, p) in pieces.iter().enumerate() {
            let copier = self.copiers.get(p.copier).ok_or_else(|| {
                invalid(format!("piece {i} names copier {}; there are {}", p.copier, self.copiers.len()))
            })?;
            let n = copier.pool().layers.len();
            let layers = p.layers.clone().unwrap_or(0..n);
            if layers.start >= layers.end || layers.end > n {
                return Err(invalid(format!(
                    "piece {i}: layers {}..{} is not a non-empty range of the copier's {n}",
                    layers.start, layers.end
                )));
            }
            copier.validate(dir, p.gpu_ids, p.host_slots).map_err(|e| match e {
                Error::InvalidArgument(m) => invalid(format!("piece {i}: {m}")),
                other => other,
            })?;
            bytes += p.gpu_ids.len() as u64 * copier.pool().segment_bytes * layers.len() as u64;
            ranges.push(layers);
        }
        let lane = lane.index();
        let stream = self.lanes[lane].stream.as_ref().map_or(engine_stream, Stream::handle);
        let mut failure = match &self.order {
            // Stores read what the engine wrote; loads overwrite blocks the engine may still be zeroing: both start
            // after the engine's work so far.
            Some(order) => order.record(engine_stream).and_then(|()| order.wait_in(stream)).err(),
            None => None,
        };
        let mut clock = Clock::Off;
        if failure.is_none() {
            let start = self.timer(stream);
            let t0 = Instant::now();
            for (p, layers) in pieces.iter().zip(ranges) {
                if let Err(e) = self.copiers[p.copier].launch(dir, p.gpu_ids, p.host_slots, stream, layers) {
                    failure = Some(e);
                    break;
                }
            }
            if self.device().is_none() {
                clock = Clock::Host(t0.elapsed().as_secs_f64());
            } else if let Some(start) = start {
                match self.timer(stream) {
                    Some(end) => clock = Clock::Device(start, end),
                    None => self.timers.push(start),
                }
            }
        }
        if let Err(e) = self.lanes[lane].queue.record(job, stream) {
            // The job's completion cannot be recorded (the device is failing): the lane's earlier jobs are waited
            // for and reported, and this one fails.
            if let Ok(done) = self.lanes[lane].queue.wait_all() {
                self.settle(done);
            }
            self.done.push(Finished { job, ok: false, bytes: 0, seconds: None });
            return Ok(Some(failure.unwrap_or(e)));
        }
        if failure.is_some() {
            self.failed.insert(job);
        }
        self.running.insert(job, Running { bytes, clock });
        Ok(failure)
    }

    /// A timing event recorded on `stream` (None on the CPU, or when CUDA refuses one: the job goes untimed).
    fn timer(&mut self, stream: u64) -> Option<Event> {
        let ev = match self.timers.pop() {
            Some(ev) => ev,
            None => Event::timing(self.device()?).ok()?,
        };
        match ev.record(stream) {
            Ok(()) => Some(ev),
            Err(_) => {
                self.timers.push(ev);
                None
            }
        }
    }

    /// The jobs completed since the last call (and those `wait` waited for), each lane's in submission order.
    pub fn finished(&mut self) -> Result<Vec<Finished>> {
        for lane in 0..self.lanes.len() {
            let jobs = self.lanes[lane].queue.poll()?;
            self.settle(jobs);
        }
        Ok(std::mem::take(&mut self.done))
    }

    /// Returns once every job in `jobs` that is in flight has completed (their results stay for `finished`).
    pub fn wait(&mut self, jobs: &[u64]) -> Result<()> {
        for lane in 0..self.lanes.len() {
            if jobs.iter().any(|j| self.running.contains_key(j)) {
                let done = self.lanes[lane].queue.wait_all()?;
                self.settle(done);
            }
        }
        Ok(())
    }

    /// Waits for every job in flight (before the host pools go).
    pub fn wait_all(&mut self) -> Result<()> {
        for lane in 0..self.lanes.len() {
            let done = self.lanes[lane].queue.wait_all()?;
            self.settle(done);
        }
        Ok(())
    }

    /// Jobs in flight.
    pub fn pending(&self) -> usize {
        self.running.len()
    }

    fn settle(&mut self, jobs: Vec<u64>) {
        for job in jobs {
            let Running { bytes, clock } = self.running.remove(&job).unwrap_or(Running { bytes: 0, clock: Clock::Off });
            let seconds = match clock {
                Clock::Host(s) => Some(s),
                Clock::Device(start, end) => {
                    let s = start.elapsed_s(&end).ok();
                    self.timers.extend([start, end]);
                    s
                }
                Clock::Off => None,
            };
            let ok = !self.failed.remove(&job);
            self.done.push(Finished { job, ok, bytes: if ok { bytes } else { 0 }, seconds: seconds.filter(|_| ok) });
        }
    }
}

impl Drop for Jobs {
    fn drop(&mut self) {
        // The copies reach the copiers' memory, which may go right after: let them finish first.
        let _ = self.wait_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::copy::{CopyOptions, GpuPool};
    use crate::executor::cuda::Layer;
    use crate::executor::hostmem::{HostPool, PinMethod};
    use std::sync::Arc;

    /// A CPU "GPU pool" of `layers` tensors of `blocks` blocks of `seg` bytes (block b of layer l filled with
    /// l * 16 + b), its host pool of `slots` pages, and one copier.
    fn copier(layers: usize, seg: u64, blocks: u32, slots: u32) -> (Vec<Vec<u8>>, PageCopier) {
        let mut mem: Vec<Vec<u8>> = (0..layers)
            .map(|l| {
                let mut v = vec![0u8; (blocks as u64 * seg + 16) as usize];
                let base = (v.as_ptr() as u64).next_multiple_of(16) - v.as_ptr() as u64;
                for b in 0..blocks as usize {
                    let at = base as usize + b * seg as usize;
                    v[at..at + seg as usize].fill((l * 16 + b) as u8);
                }
                v
            })
            .collect();
        let layer_ptrs =
            mem.iter_mut().map(|m| Layer { base: (m.as_mut_ptr() as u64).next_multiple_of(16), stride: seg }).collect();
        let host = Arc::new(HostPool::new(slots, seg * layers as u64, 1 << 16, Some(false), PinMethod::Auto).unwrap());
        host.grow_to(slots).unwrap();
        let pool = GpuPool { layers: layer_ptrs, num_blocks: blocks, segment_bytes: seg, device: None };
        // SAFETY: `mem` is returned to the test and outlives the copier's use.
        (mem, unsafe { PageCopier::new(pool, host, CopyOptions::default()).unwrap() })
    }

    #[test]
    fn jobs_copy_every_piece_and_report_their_bytes() {
        let (_a, c0) = copier(2, 32, 8, 4);
        let (_b, c1) = copier(1, 64, 8, 4);
        let (h0, h1) = (Arc::clone(c0.host()), Arc::clone(c1.host()));
        let mut jobs = Jobs::new(vec![c0, c1], true).unwrap();
        assert!(!jobs.copy_streams()); // a CPU pool: the engine's "stream", memcpy
        let pieces = [
            Piece { copier: 0, gpu_ids: &[3, 5], host_slots: &[0, 1], layers: None },
            Piece { copier: 1, gpu_ids: &[7], host_slots: &[2], layers: None },
            Piece { copier: 0, gpu_ids: &[6], host_slots: &[3], layers: Some(1..2) },
        ];
        assert!(jobs.submit(9, true, Lane::Store, &pieces, 0).unwrap().is_none());
        assert_eq!(h0.read(1).unwrap(), [vec![5u8; 32], vec![21; 32]].concat());
        assert_eq!(h1.read(2).unwrap(), vec![7u8; 64]);
        assert_eq!(h0.read(3).unwrap()[32..], vec![22u8; 32]);
        let done = jobs.finished().unwrap();
        assert_eq!(done.len(), 1);
        let Finished { job, ok, bytes, seconds } = done[0];
        assert_eq!((job, ok, bytes), (9, true, 2 * 64 + 64 + 32));
        assert!(seconds.is_some_and(|s| s >= 0.0), "{seconds:?}");
        assert_eq!(jobs.finished().unwrap(), vec![]);
        assert_eq!(jobs.pending(), 0);
    }

    #[test]
    fn a_bad_piece_is_refused_before_anything_is_copied() {
        let (_a, c0) = copier(2, 32, 8, 4);
        let host = Arc::clone(c0.host());
        let mut jobs = Jobs::new(vec![c0], false).unwrap();
        for (pieces, message) in [
            (vec![Piece { copier: 1, gpu_ids: &[0], host_slots: &[0], layers: None }], "piece 0 names copier 1"),
            (
                vec![
                    Piece { copier: 0, gpu_ids: &[1], host_slots: &[0], layers: None },
                    Piece { copier: 0, gpu_ids: &[8], host_slots: &[1], layers: None },
                ],
                "piece 1: gpu_ids[0] = 8 is outside the GPU pool of 8 blocks",
            ),
            (vec![Piece { copier: 0, gpu_ids: &[1], host_slots: &[0], layers: Some(1..3) }], "layers 1..3"),
            (vec![Piece { copier: 0, gpu_ids: &[1], host_slots: &[0], layers: Some(1..1) }], "layers 1..1"),
        ] {
            let err = jobs.submit(1, true, Lane::Store, &pieces, 0).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)) && err.to_string().contains(message), "{err}");
            assert_eq!(host.read(0).unwrap(), vec![0u8; 64], "nothing copied");
        }
        assert_eq!(jobs.finished().unwrap(), vec![]);
        assert!(Lane::parse("sideways").unwrap_err().to_string().contains("\"sideways\""));
        assert!(Jobs::new(vec![], true).map(|_| ()).unwrap_err().to_string().contains("no page copiers"));
    }

    #[test]
    fn loads_complete_apart_from_stores_and_wait_keeps_results() {
        let (_a, c0) = copier(1, 32, 8, 4);
        let mut jobs = Jobs::new(vec![c0], true).unwrap();
        let store = [Piece { copier: 0, gpu_ids: &[2], host_slots: &[1], layers: None }];
        let load = [Piece { copier: 0, gpu_ids: &[4], host_slots: &[1], layers: None }];
        jobs.submit(1, true, Lane::Store, &store, 0).unwrap();
        jobs.submit(2, false, Lane::Expedited, &load, 0).unwrap();
        assert!(jobs
            .submit(2, false, Lane::Load, &load, 0)
            .map(|_| ())
            .unwrap_err()
            .to_string()
            .contains("job 2 is in flight"));
        jobs.wait(&[2]).unwrap();
        let mut done: Vec<_> = jobs.finished().unwrap().iter().map(|f| (f.job, f.ok, f.bytes)).collect();
        done.sort_unstable();
        assert_eq!(done, vec![(1, true, 32), (2, true, 32)]);
        assert_eq!(jobs.lane_stream(Lane::Load), None);
    }
}
