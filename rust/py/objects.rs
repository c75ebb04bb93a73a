//! `kvtier._core.ObjectFormat`: single verified L3 objects named by an engine's own page hashes (SGLang's HiCache
//! pages), sealed and checked by the same format as the L3 tier's groups (rust/l3.rs), and the staging copies of
//! objects that move through a registered buffer of their own.
//!
//! Addresses cross as ints: the caller (python/kvtier/sglang.py) keeps every buffer alive and in place for the
//! duration of the call, and checks that each piece lies inside memory it owns or was handed by the engine.
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::namespace_bytes;
use crate::chain::Key;
use crate::l3::{group_key_string, ObjectFormat, ObjectKind, Reject, HEADER_BYTES};

/// Context of the BLAKE3 key derivation that maps an engine's page hash (its text) to a chain key.
const PAGE_KEY_CONTEXT: &str = "kvtier 2026-12 engine page hash to chain key v1";

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyObjectFormat>()?;
    m.add_function(wrap_pyfunction!(stage_objects, m)?)?;
    m.add_function(wrap_pyfunction!(unstage_objects, m)?)?;
    Ok(())
}

/// The chain key of an engine's page hash: BLAKE3 in key-derivation mode, truncated to 128 bits (little endian).
fn page_key(hash: &str) -> Key {
    let mut h = blake3::Hasher::new_derive_key(PAGE_KEY_CONTEXT);
    h.update(hash.as_bytes());
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    Key::from_le_bytes(out)
}

/// Payload bytes worth a digesting thread of their own (BLAKE3 runs at a few GB/s a core; a thread costs tens of us).
const DIGEST_BYTES_PER_THREAD: u64 = 1 << 20;

/// `(address, bytes)` pieces of each object, checked once at the boundary.
struct Pieces(Vec<Vec<(usize, usize)>>);

impl Pieces {
    fn new(ptrs: Vec<Vec<usize>>, sizes: Vec<Vec<usize>>, objects: usize) -> PyResult<Self> {
        if ptrs.len() != objects || sizes.len() != objects {
            return Err(PyValueError::new_err(format!(
                "need the pieces of {objects} objects, got {} pointer lists and {} size lists",
                ptrs.len(),
                sizes.len()
            )));
        }
        let mut out = Vec::with_capacity(objects);
        for (i, (p, s)) in ptrs.into_iter().zip(sizes).enumerate() {
            if p.len() != s.len() || p.is_empty() {
                return Err(PyValueError::new_err(format!(
                    "object {i}: need as many sizes as pointers, at least one, got {p:?} and {s:?}"
                )));
            }
            if let Some(j) = p.iter().zip(&s).position(|(&a, &n)| a == 0 || n == 0) {
                return Err(PyValueError::new_err(format!(
                    "object {i}: piece {j} has address {:#x} and {} bytes; both must be > 0",
                    p[j], s[j]
                )));
            }
            out.push(p.into_iter().zip(s).collect());
        }
        Ok(Self(out))
    }

    /// As `new`, for objects whose headers are slots at `headers`.
    fn with_headers(headers: usize, ptrs: Vec<Vec<usize>>, sizes: Vec<Vec<usize>>, objects: usize) -> PyResult<Self> {
        if headers == 0 {
            return Err(PyValueError::new_err("headers must be a non-zero address"));
        }
        Self::new(ptrs, sizes, objects)
    }

    /// `f(i)` for every object, spread over a few threads when there are MiBs to digest.
    fn each_object<T: Send>(&self, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
        let n = self.0.len();
        let bytes: usize = (0..n).map(|i| self.bytes(i)).sum();
        crate::par::map(n, crate::par::threads_for(bytes as u64, DIGEST_BYTES_PER_THREAD, n, usize::MAX), f)
    }

    fn bytes(&self, i: usize) -> usize {
        self.0[i].iter().map(|p| p.1).sum()
    }

    /// The payload of object `i` as slices.
    ///
    /// SAFETY: the caller guarantees each piece is readable memory of its size for as long as the slices live.
    unsafe fn slices(&self, i: usize) -> Vec<&[u8]> {
        self.0[i].iter().map(|&(p, n)| unsafe { std::slice::from_raw_parts(p as *const u8, n) }).collect()
    }
}

/// How one engine's objects are written and checked: the layout fingerprint and the deployment's hash key.
#[pyclass(name = "ObjectFormat", module = "kvtier._core", frozen)]
pub struct PyObjectFormat {
    fingerprint: String,
    format: ObjectFormat,
}

#[pymethods]
impl PyObjectFormat {
    #[new]
    #[pyo3(signature = (fingerprint, *, hash_key=None))]
    fn new(fingerprint: &str, hash_key: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        if fingerprint.is_empty() || fingerprint.contains('/') {
            return Err(PyValueError::new_err(format!(
                "fingerprint must be non-empty and without '/', got {fingerprint:?}"
            )));
        }
        let format = ObjectFormat::new(fingerprint, &namespace_bytes(hash_key)?);
        Ok(Self { fingerprint: fingerprint.to_owned(), format })
    }

    #[getter]
    fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The chain key of each page hash (any non-empty text; SGLang's are sha256 hex chains).
    fn keys(&self, page_hashes: Vec<String>) -> PyResult<Vec<u128>> {
        if let Some(i) = page_hashes.iter().position(String::is_empty) {
            return Err(PyValueError::new_err(format!("page_hashes[{i}] is empty")));
        }
        Ok(page_hashes.iter().map(|h| page_key(h)).collect())
    }

    /// The Store key of each chain key: `kvtier/v<format>/<fingerprint>/g1/<hex>`, an object of one page.
    fn store_keys(&self, keys: Vec<u128>) -> Vec<String> {
        keys.into_iter().map(|k| group_key_string(&self.fingerprint, 1, k)).collect()
    }

    /// Writes the header of object `i` (stored under `keys[i]`, payload pieces `ptrs[i]` / `sizes[i]`) at
    /// `headers + i * L3_HEADER_BYTES`. The GIL is released while it digests.
    fn seal(
        &self,
        py: Python<'_>,
        headers: usize,
        keys: Vec<u128>,
        ptrs: Vec<Vec<usize>>,
        sizes: Vec<Vec<usize>>,
    ) -> PyResult<()> {
        let pieces = Pieces::with_headers(headers, ptrs, sizes, keys.len())?;
        py.detach(|| {
            pieces.each_object(|i| {
                // SAFETY: the caller keeps `keys.len()` header slots at `headers` and every payload piece alive and
                // unwritten by others during the call (python/kvtier/sglang.py holds the direction's lock); each
                // object's header slot is written by one thread.
                let (header, payload) =
                    unsafe { (&mut *((headers + i * HEADER_BYTES) as *mut [u8; HEADER_BYTES]), pieces.slices(i)) };
                self.format.seal(header, keys[i], ObjectKind::Group, &payload);
            });
        });
        Ok(())
    }

    /// Checks what a get of each object read (`got[i]`: its bytes, header included, or a negative Store code)
    /// against the header at `headers + i * L3_HEADER_BYTES` and its payload pieces: None when the object is
    /// whole and verified, else why it is rejected. The GIL is released while it digests.
    fn check(
        &self,
        py: Python<'_>,
        headers: usize,
        keys: Vec<u128>,
        ptrs: Vec<Vec<usize>>,
        sizes: Vec<Vec<usize>>,
        got: Vec<i64>,
    ) -> PyResult<Vec<Option<String>>> {
        let pieces = Pieces::with_headers(headers, ptrs, sizes, keys.len())?;
        if got.len() != keys.len() {
            return Err(PyValueError::new_err(format!("need {} results, got {}", keys.len(), got.len())));
        }
        Ok(py.detach(|| {
            pieces.each_object(|i| {
                if got[i] != (HEADER_BYTES + pieces.bytes(i)) as i64 {
                    return Some(Reject::Length(got[i]).to_string());
                }
                // SAFETY: as in `seal`: the header slot and the pieces stay alive and untouched during the call.
                let (header, payload) =
                    unsafe { (&*((headers + i * HEADER_BYTES) as *const [u8; HEADER_BYTES]), pieces.slices(i)) };
                self.format.check(header, keys[i], ObjectKind::Group, &payload).err().map(|r| r.to_string())
            })
        }))
    }
}

/// Copies each object's pieces (header first) one after another into the staging buffer at `staging` of
/// `capacity` bytes, for a put that reads only the staging buffer. The GIL is released while it copies.
#[pyfunction]
fn stage_objects(
    py: Python<'_>,
    staging: usize,
    capacity: usize,
    ptrs: Vec<Vec<usize>>,
    sizes: Vec<Vec<usize>>,
) -> PyResult<()> {
    let n = ptrs.len();
    let pieces = Pieces::new(ptrs, sizes, n)?;
    let total: usize = (0..n).map(|i| pieces.bytes(i)).sum();
    if staging == 0 || total > capacity {
        return Err(PyValueError::new_err(format!(
            "the objects need {total} bytes of staging, the buffer at {staging:#x} has {capacity}"
        )));
    }
    py.detach(|| {
        let mut at = staging;
        for &(p, len) in pieces.0.iter().flatten() {
            // SAFETY: the pieces are readable (see `seal`); the staging buffer holds `capacity >= total` bytes and
            // is the caller's, used by this call alone.
            unsafe { std::ptr::copy_nonoverlapping(p as *const u8, at as *mut u8, len) };
            at += len;
        }
    });
    Ok(())
}

/// After a get into the staging buffer (objects one after another): copies each object whose `got[i]` is its
/// whole size out into its own pieces (header first), where it is checked and served. The GIL is released while
/// it copies.
#[pyfunction]
fn unstage_objects(
    py: Python<'_>,
    staging: usize,
    capacity: usize,
    ptrs: Vec<Vec<usize>>,
    sizes: Vec<Vec<usize>>,
    got: Vec<i64>,
) -> PyResult<()> {
    let n = ptrs.len();
    let pieces = Pieces::new(ptrs, sizes, n)?;
    let total: usize = (0..n).map(|i| pieces.bytes(i)).sum();
    if staging == 0 || total > capacity || got.len() != n {
        return Err(PyValueError::new_err(format!(
            "need {n} results and {total} bytes of staging; got {} results and {capacity} bytes at {staging:#x}",
            got.len()
        )));
    }
    py.detach(|| {
        let mut at = staging;
        for (i, object) in pieces.0.iter().enumerate() {
            let whole = got[i] == pieces.bytes(i) as i64;
            for &(p, len) in object {
                if whole {
                    // SAFETY: the pieces are writable memory the caller owns or was handed for this get; the get
                    // into the staging range has returned.
                    unsafe { std::ptr::copy_nonoverlapping(at as *const u8, p as *mut u8, len) };
                }
                at += len;
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_keys_are_deterministic_and_distinct() {
        assert_eq!(page_key("ab"), page_key("ab"));
        assert_ne!(page_key("ab"), page_key("ba"));
        assert_ne!(page_key(""), page_key("a"));
    }
}
