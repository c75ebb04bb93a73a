//! Host pools: `slots` slots of `slot_bytes`, reserved up front as one virtual range (nothing committed), so a
//! slot's address is `base + slot * slot_bytes` for the pool's whole life; backed and pinned one pin step at a
//! time by `grow_step`, which the cache runs off the engine loop. Only slots below `usable_slots()` may be copied to
//! or from. An unpinned pool (one only CPU code copies) commits nothing ahead: growing it only makes its slots
//! usable, and the kernel commits each page when it is first written, so the whole pool can be usable at once.
//!
//! Pinned pools take their memory from the CUDA driver where it can make host memory (`Pinning::Driver`: each
//! step is created by the driver and mapped into the range, and copies may span steps), else from the process's
//! own pages registered with CUDA step by step (`Pinning::Registered`: a copy may not span two registrations, and a
//! registration holds up every other thread's CUDA launches while it runs, tens of ms at 256 MiB; the driver's steps
//! hold up nothing).
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard};

use crate::error::{invalid, Error, Result};
use crate::executor::cuda;

mod sys {
    use std::ffi::{c_int, c_void};

    pub const PROT_READ_WRITE: c_int = 0x1 | 0x2;
    #[cfg(target_os = "linux")]
    pub const MAP_FLAGS: c_int = 0x02 | 0x20 | 0x4000; // MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
    #[cfg(not(target_os = "linux"))]
    pub const MAP_FLAGS: c_int = 0x02 | 0x1000 | 0x40; // MAP_PRIVATE | MAP_ANON | MAP_NORESERVE (BSD, macOS)
    pub const MADV_HUGEPAGE: c_int = 14;
    pub const MADV_POPULATE_WRITE: c_int = 23;

    extern "C" {
        pub fn mmap(addr: *mut c_void, len: usize, prot: c_int, flags: c_int, fd: c_int, off: i64) -> *mut c_void;
        pub fn munmap(addr: *mut c_void, len: usize) -> c_int;
        pub fn madvise(addr: *mut c_void, len: usize, advice: c_int) -> c_int;
    }
}

const PAGE: u64 = 4096;
/// Default growth step: about a tenth of a second of pinning, off the engine loop.
pub const DEFAULT_STEP_BYTES: u64 = 256 << 20;

/// How a pool's memory is pinned (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pinning {
    /// Plain memory, which only CPU code copies.
    None,
    /// The process's pages, registered with CUDA a step at a time.
    Registered,
    /// Memory made by the CUDA driver a step at a time, mapped into one range.
    Driver,
}

/// How pinned pools should get their memory: `Auto` is `Driver` where the driver can make host memory, else
/// `Register`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinMethod {
    Auto,
    Driver,
    Register,
}

impl PinMethod {
    /// Every name `from_str` takes.
    pub const NAMES: [&'static str; 3] = ["auto", "driver", "register"];
}

impl std::str::FromStr for PinMethod {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "driver" => Ok(Self::Driver),
            "register" => Ok(Self::Register),
            _ => Err(invalid(format!("pin_method must be one of 'auto', 'driver', 'register', got '{s}'"))),
        }
    }
}

impl Pinning {
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Registered => "register",
            Self::Driver => "driver",
        }
    }
}

pub(crate) struct Mapping {
    base: *mut u8,
    len: usize,
    /// Start and length of each step pinned (registered, or mapped by the driver).
    pinned: Vec<(usize, usize)>,
}

// SAFETY: the mapping is plain memory owned by the pool; access is coordinated by the pool's locks.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

/// A host pool; see the module documentation. Thread-safe.
pub struct HostPool {
    slots: u32,
    slot_bytes: u64,
    step_bytes: u64,
    pinning: Pinning,
    base: u64,
    /// Bytes from the base that are usable (backed and pinned, unless `Pinning::None`, whose pages the kernel commits
    /// as they are first written): slots below backed / slot_bytes are usable.
    backed: AtomicU64,
    /// None once closed. Copies hold a read guard while they touch the memory; close takes the write lock.
    mem: RwLock<Option<Mapping>>,
    grow: Mutex<()>,
}

impl HostPool {
    /// Reserve the range. `pin`: pin steps as they grow, the way `method` says (None: when a CUDA device is
    /// visible).
    pub fn new(slots: u32, slot_bytes: u64, step_bytes: u64, pin: Option<bool>, method: PinMethod) -> Result<Self> {
        if slots == 0 {
            return Err(invalid("slots must be > 0, got 0"));
        }
        if slot_bytes == 0 || !slot_bytes.is_multiple_of(16) {
            return Err(invalid(format!("slot_bytes must be a positive multiple of 16, got {slot_bytes}")));
        }
        if step_bytes == 0 {
            return Err(invalid("step_bytes must be > 0, got 0"));
        }
        let has_device = cuda::device_count() > 0;
        let pin = pin.unwrap_or(has_device);
        if pin && !has_device {
            return Err(invalid("pin=True needs a CUDA device, and none is visible"));
        }
        let driver = if pin { cuda::host_vmm_granularity() } else { None };
        let (pinning, unit) =
            match (pin, method, driver) {
                (false, ..) => (Pinning::None, PAGE),
                (true, PinMethod::Auto | PinMethod::Driver, Some(g)) => (Pinning::Driver, g as u64),
                (true, PinMethod::Driver, None) => return Err(invalid(
                    "pin_method='driver' needs host memory made by the CUDA driver (cuMemCreate on a host NUMA node, \
                     a CUDA 12.2+ driver), which this driver or device does not have; use 'register'",
                )),
                (true, _, _) => (Pinning::Registered, PAGE),
            };
        let len = u64::from(slots)
            .checked_mul(slot_bytes)
            .and_then(|b| b.checked_next_multiple_of(unit))
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| invalid(format!("slots * slot_bytes overflows: {slots} * {slot_bytes}")))?;
        let base = if pinning == Pinning::Driver { cuda::host_vmm_reserve(len)? as *mut u8 } else { map(len)? };
        Ok(Self {
            slots,
            slot_bytes,
            step_bytes: step_bytes.next_multiple_of(unit),
            pinning,
            base: base as u64,
            backed: AtomicU64::new(0),
            mem: RwLock::new(Some(Mapping { base, len, pinned: Vec::new() })),
            grow: Mutex::new(()),
        })
    }

    pub fn slots(&self) -> u32 {
        self.slots
    }

    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    pub fn step_bytes(&self) -> u64 {
        self.step_bytes
    }

    /// Whether pin steps are pinned as they grow.
    pub fn pinned(&self) -> bool {
        self.pinning != Pinning::None
    }

    pub fn pinning(&self) -> Pinning {
        self.pinning
    }

    /// No copy-engine copy may cross a multiple of this many bytes from the base: a registered pool's steps are
    /// CUDA registrations of their own; memory made by the driver is one range. (Unpinned pools, which only CPU
    /// code copies, are cut as registered ones.)
    pub fn copy_span_bytes(&self) -> u64 {
        match self.pinning {
            Pinning::Driver => u64::from(self.slots) * self.slot_bytes,
            Pinning::None | Pinning::Registered => self.step_bytes,
        }
    }

    /// The address of slot 0 (fixed for the pool's life).
    pub fn base_ptr(&self) -> u64 {
        self.base
    }

    /// Bytes usable so far (backed and pinned, for a pinned pool).
    pub fn backed_bytes(&self) -> u64 {
        self.backed.load(Ordering::Acquire)
    }

    /// Slots that are usable (backed and pinned, for a pinned pool) and may be copied to or from.
    pub fn usable_slots(&self) -> u32 {
        let usable = self.backed_bytes() / self.slot_bytes;
        u32::try_from(usable.min(u64::from(self.slots))).expect("bounded by slots")
    }

    /// Back and pin the next pin step (an unpinned pool's step only becomes usable: nothing is committed ahead);
    /// returns `usable_slots()` after it (unchanged once the pool is fully grown). Copies of usable slots go on
    /// meanwhile: only `close` waits for a grow.
    pub fn grow_step(&self) -> Result<u32> {
        let _grow = self.grow.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (base, len) = {
            let guard = self.access()?;
            let mem = guard.as_ref().expect("checked open");
            (mem.base, mem.len)
        };
        // The grow lock keeps the mapping alive from here on: close takes it first.
        let start = self.backed.load(Ordering::Acquire) as usize;
        if start >= len {
            return Ok(self.usable_slots());
        }
        let end = (start + self.step_bytes as usize).min(len);
        // SAFETY: [start, end) lies inside the mapping.
        let ptr = unsafe { base.add(start) };
        match self.pinning {
            Pinning::None => {}
            Pinning::Registered => {
                touch(ptr, end - start);
                // SAFETY: the range stays mapped until close/drop, which unregisters it first.
                unsafe { cuda::host_register(ptr, end - start)? };
            }
            // SAFETY: a step of the reserved range, not mapped yet (steps and the range's length are multiples of
            // the granularity); close unmaps it.
            Pinning::Driver => unsafe { cuda::host_vmm_map(ptr as u64, end - start)? },
        }
        if self.pinning != Pinning::None {
            let mut guard = self.mem.write().unwrap_or_else(std::sync::PoisonError::into_inner);
            guard.as_mut().expect("close waits for the grow lock").pinned.push((start, end - start));
        }
        self.backed.store(end as u64, Ordering::Release);
        Ok(self.usable_slots())
    }

    /// Grow until at least `slots` slots are usable (or the pool is full).
    pub fn grow_to(&self, slots: u32) -> Result<u32> {
        let mut usable = self.usable_slots();
        while usable < slots.min(self.slots) {
            usable = self.grow_step()?;
        }
        Ok(usable)
    }

    /// Shared access to the memory for a copy; fails once the pool is closed.
    pub(crate) fn access(&self) -> Result<RwLockReadGuard<'_, Option<Mapping>>> {
        let guard = self.mem.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        if guard.is_none() {
            return Err(Error::State("the host pool is closed".into()));
        }
        Ok(guard)
    }

    /// A copy of slot `slot`'s bytes.
    pub fn read(&self, slot: u32) -> Result<Vec<u8>> {
        let _mem = self.access()?;
        let at = self.slot_offset(slot)?;
        // SAFETY: the slot is usable (backed) and the read guard keeps the mapping alive.
        Ok(unsafe { std::slice::from_raw_parts((self.base + at) as *const u8, self.slot_bytes as usize) }.to_vec())
    }

    /// Overwrite the start of slot `slot` with `data` (at most slot_bytes).
    pub fn write(&self, slot: u32, data: &[u8]) -> Result<()> {
        let _mem = self.access()?;
        let at = self.slot_offset(slot)?;
        if data.len() as u64 > self.slot_bytes {
            return Err(invalid(format!(
                "data of {} bytes does not fit a slot of {} bytes",
                data.len(),
                self.slot_bytes
            )));
        }
        // SAFETY: the slot is usable and the write stays inside it; the guard keeps the mapping alive.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), (self.base + at) as *mut u8, data.len()) };
        Ok(())
    }

    fn slot_offset(&self, slot: u32) -> Result<u64> {
        if slot >= self.slots {
            return Err(invalid(format!("slot {slot} is outside the host pool of {} slots", self.slots)));
        }
        let usable = self.usable_slots();
        if slot >= usable {
            return Err(Error::State(format!(
                "slot {slot} is not below usable_slots = {usable} (of {} slots)",
                self.slots
            )));
        }
        Ok(u64::from(slot) * self.slot_bytes)
    }

    /// Unpin and unmap. No copy may still be in flight on a device. Idempotent.
    pub fn close(&self) -> Result<()> {
        let _grow = self.grow.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut guard = self.mem.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(mem) = guard.take() else { return Ok(()) };
        self.backed.store(0, Ordering::Release);
        let mut first_error = None;
        for &(start, len) in &mem.pinned {
            // SAFETY: pinned by grow_step; the caller guarantees no copy is in flight.
            let done = unsafe {
                match self.pinning {
                    Pinning::Driver => cuda::host_vmm_unmap(mem.base as u64 + start as u64, len),
                    _ => cuda::host_unregister(mem.base.add(start)),
                }
            };
            if let Err(e) = done {
                first_error.get_or_insert(e);
            }
        }
        // SAFETY: the range reserved in `new`, given back once (guard.take()).
        let freed = unsafe {
            if self.pinning == Pinning::Driver {
                cuda::host_vmm_free(mem.base as u64, mem.len)
            } else if sys::munmap(mem.base.cast(), mem.len) != 0 {
                Err(Error::Copy(format!("munmap: {}", std::io::Error::last_os_error())))
            } else {
                Ok(())
            }
        };
        if let Err(e) = freed {
            first_error.get_or_insert(e);
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl Drop for HostPool {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// An anonymous private mapping of `len` bytes, nothing committed, huge pages advised.
fn map(len: usize) -> Result<*mut u8> {
    // SAFETY: an anonymous private mapping with no fixed address; the result is checked below.
    let base = unsafe { sys::mmap(std::ptr::null_mut(), len, sys::PROT_READ_WRITE, sys::MAP_FLAGS, -1, 0) };
    if base as isize == -1 {
        return Err(Error::Copy(format!(
            "mmap of {len} bytes for the host pool failed: {}",
            std::io::Error::last_os_error()
        )));
    }
    // Huge pages make the first touch and the registration cheaper; advice only, so its result is ignored.
    // SAFETY: the range was just mapped.
    unsafe { sys::madvise(base, len, sys::MADV_HUGEPAGE) };
    Ok(base.cast())
}

/// Commit the pages of a range: one madvise where the kernel has MADV_POPULATE_WRITE (5.14+), else a write per page.
fn touch(ptr: *mut u8, len: usize) {
    // SAFETY: the caller passes a range inside the mapping.
    if unsafe { sys::madvise(ptr.cast(), len, sys::MADV_POPULATE_WRITE) } == 0 {
        return;
    }
    for off in (0..len).step_by(PAGE as usize) {
        // SAFETY: inside the range; volatile so the write is not elided.
        unsafe { std::ptr::write_volatile(ptr.add(off), 0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_in_steps_and_reads_back() {
        let pool = HostPool::new(10, 1000 * 16, 3 * 16000, Some(false), PinMethod::Auto).unwrap();
        assert_eq!(pool.usable_slots(), 0);
        assert!(pool.read(0).is_err());
        let first = pool.grow_step().unwrap();
        assert!((3..10).contains(&first), "{first}");
        pool.write(1, &[7; 16]).unwrap();
        assert_eq!(&pool.read(1).unwrap()[..17], &[7u8; 16].iter().copied().chain([0]).collect::<Vec<_>>()[..]);
        assert_eq!(pool.grow_to(10).unwrap(), 10);
        assert_eq!(pool.grow_step().unwrap(), 10);
        pool.close().unwrap();
        assert!(pool.read(1).is_err());
    }

    /// A slot not usable yet and a closed pool are the pool's state, never the caller's bad argument.
    #[test]
    fn a_closed_pool_and_an_unusable_slot_are_states_not_bad_arguments() {
        let pool = HostPool::new(4, 16, 16, Some(false), PinMethod::Auto).unwrap();
        assert!(matches!(pool.read(0), Err(Error::State(_))));
        assert!(matches!(pool.read(4), Err(Error::InvalidArgument(_))), "beyond the pool: the caller's");
        pool.grow_step().unwrap();
        pool.read(0).unwrap();
        pool.close().unwrap();
        assert_eq!(pool.read(0), Err(Error::State("the host pool is closed".into())));
        assert!(matches!(pool.write(0, &[1]), Err(Error::State(_))));
    }

    #[test]
    fn every_pin_method_name_parses() {
        for name in PinMethod::NAMES {
            name.parse::<PinMethod>().unwrap();
        }
        assert!(matches!("pinned".parse::<PinMethod>(), Err(Error::InvalidArgument(_))));
    }
}
