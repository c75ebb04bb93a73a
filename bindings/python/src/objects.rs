//! `kvtier._core.ObjectFormat`: how single verified L3 objects named by an engine's own page hashes (SGLang's
//! HiCache pages, vLLM's CPU chunks) are keyed, sealed and checked, by the same format as the L3 tier's groups
//! (rust/l3/mod.rs). `ObjectPath` (bindings/python/src/l3.rs) moves them.

use pyo3::prelude::*;

use crate::{bad_argument, namespace_bytes, to_py};
use kvtier::index::chain::{engine_page_keys, Key};
use kvtier::l3::{group_key_string, ObjectFormat};

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyObjectFormat>()?;
    Ok(())
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
        engine_page_keys(page_hashes).map_err(to_py)
    }

    pub(super) fn store_key(&self, key: Key) -> String {
        group_key_string(&self.fingerprint, 1, key)
    }
}
