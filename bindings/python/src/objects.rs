//! `kvtier._core.ObjectFormat`: how single verified L3 objects named by an engine's own page hashes (SGLang's
//! HiCache pages, vLLM's CPU chunks) are keyed, sealed and checked, by the same format as the L3 tier's groups
//! (rust/l3/mod.rs). `ObjectPath` (bindings/python/src/l3.rs) moves them.

use pyo3::prelude::*;

use crate::{bad_argument, namespace_bytes};
use kvtier::index::chain::Key;
use kvtier::l3::{group_key_string, ObjectFormat};

/// Context of the BLAKE3 key derivation that maps an engine's page hash (its text) to a chain key.
const PAGE_KEY_CONTEXT: &str = "kvtier 2026-12 engine page hash to chain key v1";

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyObjectFormat>()?;
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
            return Err(bad_argument(format!("fingerprint must be non-empty and without '/', got {fingerprint:?}")));
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
        self.chain_keys(&page_hashes)
    }

    /// The Store key of each chain key: `kvtier/v<format>/<fingerprint>/g1/<hex>`, an object of one page.
    fn store_keys(&self, keys: Vec<u128>) -> Vec<String> {
        keys.into_iter().map(|k| self.store_key(k)).collect()
    }
}

impl PyObjectFormat {
    pub(super) fn format(&self) -> &ObjectFormat {
        &self.format
    }

    /// The chain key of each page hash, refusing an empty one.
    pub(super) fn chain_keys(&self, page_hashes: &[String]) -> PyResult<Vec<Key>> {
        if let Some(i) = page_hashes.iter().position(String::is_empty) {
            return Err(bad_argument(format!("page_hashes[{i}] is empty")));
        }
        Ok(page_hashes.iter().map(|h| page_key(h)).collect())
    }

    pub(super) fn store_key(&self, key: Key) -> String {
        group_key_string(&self.fingerprint, 1, key)
    }
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
