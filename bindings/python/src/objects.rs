//! `kvtier._core.ObjectFormat`: how single verified L3 objects named by an engine's own page hashes (SGLang's
//! HiCache pages, vLLM's CPU chunks) are keyed, sealed and checked, by the same format as the L3 tier's groups
//! (rust/l3/mod.rs). `ObjectPath` (bindings/python/src/l3.rs) moves them.

use pyo3::prelude::*;

use crate::{namespace_bytes, to_py};
use kvtier::index::chain::engine_page_keys;
use kvtier::l3::path::EngineFormat;

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyObjectFormat>()?;
    Ok(())
}

/// How one engine's objects are written and checked: the layout fingerprint and the deployment's hash key.
#[pyclass(name = "ObjectFormat", module = "kvtier._core", frozen)]
pub struct PyObjectFormat {
    inner: EngineFormat,
}

#[pymethods]
impl PyObjectFormat {
    #[new]
    #[pyo3(signature = (fingerprint, *, hash_key=None))]
    fn new(fingerprint: &str, hash_key: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        Ok(Self { inner: EngineFormat::new(fingerprint, &namespace_bytes(hash_key)?).map_err(to_py)? })
    }

    #[getter]
    fn fingerprint(&self) -> &str {
        self.inner.fingerprint()
    }

    /// The chain key of each page hash (any non-empty text; SGLang's are sha256 hex chains).
    fn keys(&self, page_hashes: Vec<String>) -> PyResult<Vec<u128>> {
        engine_page_keys(&page_hashes).map_err(to_py)
    }

    /// The Store key of each chain key: `kvtier/v<format>/<fingerprint>/g1/<hex>`, an object of one page.
    fn object_names(&self, keys: Vec<u128>) -> Vec<String> {
        keys.into_iter().map(|k| self.inner.store_key(k)).collect()
    }
}

impl PyObjectFormat {
    pub(super) fn engine(&self) -> &EngineFormat {
        &self.inner
    }
}
