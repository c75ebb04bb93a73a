//! Chained 128-bit block keys over int32 token ids.
//!
//! Page i's key is `H(key_{i-1} || tokens[i*bs..(i+1)*bs])`, and `key_{-1}` is derived from a per-request
//! namespace (zero when empty), so a tenant salt isolates whole chains. Chains are cached per request and only
//! extended: the tokens already hashed are compared (cheap) and only blocks past the first difference are hashed.
use crate::error::{invalid, Result};

/// A block key.
pub type Key = u128;

/// Version of the chain key scheme (hash and chaining); part of every L3 fingerprint.
pub const KEY_SCHEME: u32 = 2;

/// Context string from which hash keys are derived (BLAKE3 `derive_key`).
const KEY_CONTEXT: &str = "kvtier 2026-12 block hash key v1";
/// Domain bytes so that a namespace can never hash to the same value as a block.
const DOMAIN_BLOCK: u8 = 0;
const DOMAIN_NAMESPACE: u8 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HashKind {
    /// Keyed BLAKE3 truncated to 128 bits: cryptographic, a crafted prompt cannot collide with another's prefix.
    Blake3,
    /// xxh3-128 seeded from the key: faster, but collisions can be crafted; single-tenant use only.
    Xxh3,
}

impl HashKind {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "blake3" => Ok(Self::Blake3),
            "xxh3" => Ok(Self::Xxh3),
            other => Err(invalid(format!("hash_kind must be 'blake3' or 'xxh3', got {other:?}"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Blake3 => "blake3",
            Self::Xxh3 => "xxh3",
        }
    }
}

/// Hashes blocks with one kind and one deployment key.
#[derive(Clone, Debug)]
pub struct BlockHasher {
    kind: HashKind,
    key: [u8; 32],
}

impl BlockHasher {
    /// `secret` is any byte string (a deployment's `KVTIER_HASH_KEY`); empty gives the public default key.
    pub fn new(kind: HashKind, secret: &[u8]) -> Self {
        Self { kind, key: blake3::derive_key(KEY_CONTEXT, secret) }
    }

    pub fn kind(&self) -> HashKind {
        self.kind
    }

    /// A short public digest of the key, so fingerprints differ per key without revealing it.
    pub fn key_id(&self) -> String {
        let d = blake3::keyed_hash(&self.key, b"key id");
        d.to_hex()[..16].to_string()
    }

    /// `key_{-1}` for a namespace: 0 when empty.
    pub fn root(&self, namespace: &[u8]) -> Key {
        if namespace.is_empty() {
            0
        } else {
            self.digest(DOMAIN_NAMESPACE, 0, namespace)
        }
    }

    /// The key of a block whose predecessor has key `prev`.
    pub fn next(&self, prev: Key, tokens: &[i32]) -> Key {
        self.digest(DOMAIN_BLOCK, prev, token_bytes(tokens))
    }

    fn digest(&self, domain: u8, prev: Key, data: &[u8]) -> Key {
        match self.kind {
            HashKind::Blake3 => {
                let mut h = blake3::Hasher::new_keyed(&self.key);
                h.update(&[domain]);
                h.update(&prev.to_le_bytes());
                h.update(data);
                let mut out = [0u8; 16];
                h.finalize_xof().fill(&mut out);
                u128::from_le_bytes(out)
            }
            HashKind::Xxh3 => {
                let seed = u64::from_le_bytes(self.key[..8].try_into().expect("8 bytes"));
                let mut h = xxhash_rust::xxh3::Xxh3::with_seed(seed);
                h.update(&[domain]);
                h.update(&prev.to_le_bytes());
                h.update(data);
                h.digest128()
            }
        }
    }
}

/// Token ids as little-endian bytes, without copying on little-endian targets.
fn token_bytes(tokens: &[i32]) -> &[u8] {
    #[cfg(target_endian = "big")]
    compile_error!("block keys are defined over little-endian token bytes");
    // SAFETY: i32 has no padding and any byte pattern is a valid u8; the length covers exactly the slice.
    unsafe { std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens)) }
}

/// One request's chain: the namespace, the tokens of the full blocks hashed so far, and their keys.
#[derive(Clone, Debug, Default)]
pub struct Chain {
    namespace: Vec<u8>,
    tokens: Vec<i32>,
    keys: Vec<Key>,
}

impl Chain {
    pub fn keys(&self) -> &[Key] {
        &self.keys
    }

    /// Extends the chain to cover every full block of `tokens`, rehashing only from the first block that differs
    /// from what was hashed before (a changed namespace rehashes everything). Returns the number of blocks hashed.
    pub fn extend(&mut self, hasher: &BlockHasher, block_size: usize, namespace: &[u8], tokens: &[i32]) -> usize {
        if namespace != self.namespace.as_slice() {
            self.namespace = namespace.to_vec();
            self.tokens.clear();
            self.keys.clear();
        }
        let full = tokens.len() / block_size;
        let same = self.tokens.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        let keep = (same / block_size).min(full);
        self.keys.truncate(keep);
        self.tokens.truncate(keep * block_size);
        let mut prev = self.keys.last().copied().unwrap_or_else(|| hasher.root(namespace));
        for block in tokens[keep * block_size..full * block_size].chunks_exact(block_size) {
            prev = hasher.next(prev, block);
            self.keys.push(prev);
        }
        self.tokens.extend_from_slice(&tokens[keep * block_size..full * block_size]);
        full - keep
    }
}

/// Validates a prompt's token ids: every id must be non-negative.
pub fn check_tokens(tokens: &[i32]) -> Result<()> {
    match tokens.iter().position(|&t| t < 0) {
        None => Ok(()),
        Some(i) => Err(invalid(format!("token ids must be >= 0, got {} at position {i}", tokens[i]))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: usize, seed: i32) -> Vec<i32> {
        (0..n as i32).map(|i| (i * 7919 + seed) % 50_000).collect()
    }

    #[test]
    fn chained_keys_depend_on_the_whole_prefix() {
        let h = BlockHasher::new(HashKind::Blake3, b"");
        let a = toks(64, 1);
        let mut b = a.clone();
        b[3] += 1;
        let (mut ca, mut cb) = (Chain::default(), Chain::default());
        ca.extend(&h, 16, b"", &a);
        cb.extend(&h, 16, b"", &b);
        assert!(ca.keys().iter().zip(cb.keys()).all(|(x, y)| x != y));
    }

    #[test]
    fn extend_hashes_only_new_or_changed_blocks() {
        for kind in [HashKind::Blake3, HashKind::Xxh3] {
            let h = BlockHasher::new(kind, b"k");
            let t = toks(100, 3);
            let mut c = Chain::default();
            assert_eq!(c.extend(&h, 16, b"", &t[..40]), 2);
            assert_eq!(c.extend(&h, 16, b"", &t), 4);
            let mut fresh = Chain::default();
            fresh.extend(&h, 16, b"", &t);
            assert_eq!(c.keys(), fresh.keys());
            let mut changed = t.clone();
            changed[50] = 9;
            assert_eq!(c.extend(&h, 16, b"", &changed), 3, "blocks 3..6 rehashed");
            assert_eq!(c.keys()[..3], fresh.keys()[..3]);
            assert_ne!(c.keys()[3], fresh.keys()[3]);
        }
    }

    #[test]
    fn namespaces_and_hash_keys_separate_chains() {
        let t = toks(32, 5);
        let key_of = |h: &BlockHasher, ns: &[u8]| {
            let mut c = Chain::default();
            c.extend(h, 16, ns, &t);
            c.keys().to_vec()
        };
        let h = BlockHasher::new(HashKind::Blake3, b"");
        assert_ne!(key_of(&h, b""), key_of(&h, b"tenant-a"));
        assert_ne!(key_of(&h, b"tenant-a"), key_of(&h, b"tenant-b"));
        assert_ne!(key_of(&h, b""), key_of(&BlockHasher::new(HashKind::Blake3, b"secret"), b""));
        assert_ne!(key_of(&h, b""), key_of(&BlockHasher::new(HashKind::Xxh3, b""), b""));
    }

    #[test]
    fn negative_tokens_are_rejected_with_their_position() {
        let err = check_tokens(&[1, 2, -5]).unwrap_err();
        assert!(err.to_string().contains("-5 at position 2"), "{err}");
    }
}
