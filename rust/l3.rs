//! L3 bookkeeping: page groups, the bounded seen-set, and fingerprinted key strings.
use std::collections::VecDeque;

use crate::chain::Key;
use crate::error::{invalid, Result};
use crate::pool::KeyMap;

/// Key-string format version; bump when the bytes behind a key change meaning.
pub const FORMAT_VERSION: u32 = 1;

/// The layout fingerprint: a hash of every `name=value` field that changes the bytes behind a key (model config
/// hash, page and state bytes, block size, layout, dtype, hash kind and key id, format version). Field order
/// does not matter; duplicate names are an error.
pub fn fingerprint(fields: &[(String, String)]) -> Result<String> {
    let mut sorted: Vec<&(String, String)> = fields.iter().collect();
    sorted.sort();
    if let Some(w) = sorted.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(invalid(format!("fingerprint field {:?} given twice", w[0].0)));
    }
    let mut h = blake3::Hasher::new();
    h.update(format!("format={FORMAT_VERSION}\n").as_bytes());
    for (k, v) in sorted {
        if k.contains(['=', '\n']) || v.contains('\n') {
            return Err(invalid(format!("fingerprint field {k:?}={v:?} contains '=' or a newline")));
        }
        h.update(format!("{k}={v}\n").as_bytes());
    }
    Ok(h.finalize().to_hex()[..32].to_string())
}

/// `kvtier/v<version>/<fp>/g<G>/<hex>`: the object holding pages `[g*G, (g+1)*G)`, named by the chain key of its
/// last page (which covers the whole prefix).
pub fn group_key_string(fingerprint: &str, group_pages: u32, last_page_key: Key) -> String {
    format!("kvtier/v{FORMAT_VERSION}/{fingerprint}/g{group_pages}/{last_page_key:032x}")
}

/// `kvtier/v<version>/<fp>/state/<hex>`: the state at the boundary after the page with this key.
pub fn state_key_string(fingerprint: &str, page_key: Key) -> String {
    format!("kvtier/v{FORMAT_VERSION}/{fingerprint}/state/{page_key:032x}")
}

/// The chain keys that name each whole group of `group_pages` pages in `keys`.
pub fn group_keys(keys: &[Key], group_pages: usize) -> Vec<Key> {
    keys.chunks_exact(group_pages).map(|g| *g.last().expect("non-empty chunk")).collect()
}

/// A bounded set of keys already put to or seen in the Store; the oldest insert leaves first.
#[derive(Debug)]
pub struct SeenSet {
    capacity: usize,
    order: VecDeque<Key>,
    members: KeyMap<()>,
}

impl SeenSet {
    pub fn new(capacity: usize) -> Result<Self> {
        if capacity == 0 {
            return Err(invalid("seen-set capacity must be > 0, got 0"));
        }
        Ok(Self { capacity, order: VecDeque::with_capacity(capacity.min(1 << 20)), members: KeyMap::default() })
    }

    pub fn contains(&self, key: Key) -> bool {
        self.members.contains_key(&key)
    }

    /// Inserts `key`; returns false if it was already there.
    pub fn insert(&mut self, key: Key) -> bool {
        if self.members.insert(key, ()).is_some() {
            return false;
        }
        self.order.push_back(key);
        if self.order.len() > self.capacity {
            let old = self.order.pop_front().expect("over capacity");
            self.members.remove(&old);
        }
        true
    }

    /// Removes a key (an object found missing in the Store); O(len), used only on failures.
    pub fn remove(&mut self, key: Key) -> bool {
        let removed = self.members.remove(&key).is_some();
        if removed {
            self.order.retain(|&k| k != key);
        }
        removed
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_ignores_order_and_sees_every_field() {
        let f = |v: &[(&str, &str)]| fingerprint(&v.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect::<Vec<_>>());
        let a = f(&[("block_size", "16"), ("dtype", "bf16")]).unwrap();
        assert_eq!(a, f(&[("dtype", "bf16"), ("block_size", "16")]).unwrap());
        assert_ne!(a, f(&[("block_size", "32"), ("dtype", "bf16")]).unwrap());
        assert!(f(&[("a", "1"), ("a", "2")]).is_err());
        assert!(f(&[("a=b", "1")]).is_err());
    }

    #[test]
    fn key_strings_and_groups() {
        assert_eq!(group_key_string("fp", 4, 0xab), format!("kvtier/v1/fp/g4/{:032x}", 0xab));
        assert_eq!(state_key_string("fp", 1), format!("kvtier/v1/fp/state/{:032x}", 1));
        assert_eq!(group_keys(&[1, 2, 3, 4, 5, 6, 7], 3), vec![3, 6]);
    }

    #[test]
    fn seen_set_is_bounded_fifo() {
        let mut s = SeenSet::new(2).unwrap();
        assert!(s.insert(1));
        assert!(!s.insert(1));
        assert!(s.insert(2));
        assert!(s.insert(3));
        assert!(!s.contains(1) && s.contains(2) && s.contains(3));
        assert!(s.remove(2));
        assert_eq!(s.len(), 1);
        assert!(SeenSet::new(0).is_err());
    }
}
