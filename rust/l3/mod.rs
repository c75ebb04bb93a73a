//! L3 objects: fingerprinted key strings, the bounded seen-set, and the verified object format.
//!
//! Every object is a header of `HEADER_BYTES` followed by its payload (a group's pages or one state):
//!
//! | bytes  | field                                                                |
//! | ------ | -------------------------------------------------------------------- |
//! | 0..8   | magic `KVTIERL3`                                                     |
//! | 8..12  | format version (u32 LE)                                              |
//! | 12..16 | digest kind: 1 xxh3-128, 2 keyed BLAKE3 (u32 LE)                     |
//! | 16..32 | the layout fingerprint's digest                                      |
//! | 32..48 | the chain key the object is stored under (u128 LE)                   |
//! | 48..52 | object kind: 0 page group, 1 state (u32 LE)                          |
//! | 52..56 | zero                                                                 |
//! | 56..64 | payload length in bytes (u64 LE)                                     |
//! | 64..80 | digest of bytes 0..64 and the payload                                |
//!
//! The digest covers the header's fields too, so a value moved under another key, written by another
//! fingerprint or format, truncated, extended or with one bit flipped fails `check`. Without a hash key anyone
//! who can write to the Store can also compute the digest; with one (`KVTIER_HASH_KEY`) the digest is keyed
//! BLAKE3 and forging an object needs the key. See docs/RELIABILITY.md.
pub mod path;
pub mod plan;

use std::collections::VecDeque;

use crate::error::{invalid, Result};
use crate::index::chain::KeyMap;
use crate::index::chain::{Key, KEY_SCHEME};

/// Object format version (key strings and header); bump when the bytes behind a key change meaning.
pub const FORMAT_VERSION: u32 = 2;
/// Bytes of an object's header.
pub const HEADER_BYTES: usize = 80;
const MAGIC: &[u8; 8] = b"KVTIERL3";
const SIGNED: usize = 64;
/// Context from which the keyed digest's key is derived (BLAKE3 `derive_key`), apart from the chain's.
const DIGEST_CONTEXT: &str = "kvtier 2026-12 L3 object digest v1";

/// What an object holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectKind {
    Group = 0,
    State = 1,
}

/// Why a fetched object was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reject {
    /// The Store holds a value of another length than the header and payload.
    Length(i64),
    Magic,
    Version(u32),
    DigestKind(u32),
    Fingerprint,
    ChainKey,
    Kind,
    PayloadLength(u64),
    Digest,
}

impl std::fmt::Display for Reject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Length(n) => write!(f, "value of the wrong length (Store code or bytes {n})"),
            Self::Magic => write!(f, "no kvtier header"),
            Self::Version(v) => write!(f, "format version {v}, this build reads {FORMAT_VERSION}"),
            Self::DigestKind(k) => write!(f, "digest kind {k}, this cache uses another"),
            Self::Fingerprint => write!(f, "another layout fingerprint"),
            Self::ChainKey => write!(f, "stored under another chain key"),
            Self::Kind => write!(f, "another object kind"),
            Self::PayloadLength(n) => write!(f, "payload length {n} in the header"),
            Self::Digest => write!(f, "digest mismatch"),
        }
    }
}

/// How one cache writes and checks its objects: the fingerprint's digest and the digest kind (keyed when the
/// deployment has a hash key).
#[derive(Clone, Debug)]
pub struct ObjectFormat {
    fingerprint: [u8; 16],
    key: Option<[u8; 32]>,
}

impl ObjectFormat {
    /// `secret`: the deployment's hash key (`KVTIER_HASH_KEY`); empty selects the unkeyed xxh3-128 digest.
    pub fn new(fingerprint: &str, secret: &[u8]) -> Self {
        let mut fp = [0u8; 16];
        fp.copy_from_slice(&blake3::hash(fingerprint.as_bytes()).as_bytes()[..16]);
        let key = (!secret.is_empty()).then(|| blake3::derive_key(DIGEST_CONTEXT, secret));
        Self { fingerprint: fp, key }
    }

    fn digest_kind(&self) -> u32 {
        if self.key.is_some() {
            2
        } else {
            1
        }
    }

    fn digest(&self, head: &[u8], payload: &[&[u8]]) -> [u8; 16] {
        match &self.key {
            Some(key) => {
                let mut h = blake3::Hasher::new_keyed(key);
                h.update(head);
                for part in payload {
                    h.update(part);
                }
                let mut out = [0u8; 16];
                out.copy_from_slice(&h.finalize().as_bytes()[..16]);
                out
            }
            None => {
                let mut h = xxhash_rust::xxh3::Xxh3::new();
                h.update(head);
                for part in payload {
                    h.update(part);
                }
                h.digest128().to_le_bytes()
            }
        }
    }

    /// Writes the header of an object stored under `chain_key` with this payload.
    pub fn seal(&self, header: &mut [u8; HEADER_BYTES], chain_key: Key, kind: ObjectKind, payload: &[&[u8]]) {
        let len: usize = payload.iter().map(|p| p.len()).sum();
        header[..8].copy_from_slice(MAGIC);
        header[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        header[12..16].copy_from_slice(&self.digest_kind().to_le_bytes());
        header[16..32].copy_from_slice(&self.fingerprint);
        header[32..48].copy_from_slice(&chain_key.to_le_bytes());
        header[48..52].copy_from_slice(&(kind as u32).to_le_bytes());
        header[52..56].fill(0);
        header[56..64].copy_from_slice(&(len as u64).to_le_bytes());
        let d = self.digest(&header[..SIGNED], payload);
        header[SIGNED..].copy_from_slice(&d);
    }

    /// Checks a fetched object: Ok only when every header field is what this cache would write for `chain_key`
    /// and the digest matches the payload.
    pub fn check(
        &self,
        header: &[u8; HEADER_BYTES],
        chain_key: Key,
        kind: ObjectKind,
        payload: &[&[u8]],
    ) -> std::result::Result<(), Reject> {
        let u32_at = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().expect("4 bytes"));
        if &header[..8] != MAGIC {
            return Err(Reject::Magic);
        }
        if u32_at(8) != FORMAT_VERSION {
            return Err(Reject::Version(u32_at(8)));
        }
        if u32_at(12) != self.digest_kind() {
            return Err(Reject::DigestKind(u32_at(12)));
        }
        if header[16..32] != self.fingerprint {
            return Err(Reject::Fingerprint);
        }
        if header[32..48] != chain_key.to_le_bytes() {
            return Err(Reject::ChainKey);
        }
        if u32_at(48) != kind as u32 || u32_at(52) != 0 {
            return Err(Reject::Kind);
        }
        let len = u64::from_le_bytes(header[56..64].try_into().expect("8 bytes"));
        if len != payload.iter().map(|p| p.len() as u64).sum::<u64>() {
            return Err(Reject::PayloadLength(len));
        }
        if self.digest(&header[..SIGNED], payload) != header[SIGNED..] {
            return Err(Reject::Digest);
        }
        Ok(())
    }
}

/// The layout fingerprint: a hash of every `name=value` field that changes the bytes behind a key (model
/// identity, shard, page and state bytes, block size, layout, hash kind and key id), plus the object format
/// version and the chain's key scheme. Field order
/// does not matter; duplicate names are an error.
pub fn fingerprint(fields: &[(String, String)]) -> Result<String> {
    let mut sorted: Vec<&(String, String)> = fields.iter().collect();
    sorted.sort();
    if let Some(w) = sorted.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(invalid(format!("fingerprint field {:?} given twice", w[0].0)));
    }
    let mut h = blake3::Hasher::new();
    h.update(format!("format={FORMAT_VERSION}\nkey_scheme={KEY_SCHEME}\n").as_bytes());
    for (k, v) in sorted {
        if k.contains(['=', '\n']) || v.contains('\n') {
            return Err(invalid(format!("fingerprint field {k:?}={v:?} contains '=' or a newline")));
        }
        h.update(format!("{k}={v}\n").as_bytes());
    }
    Ok(h.finalize().to_hex()[..32].to_string())
}

/// Bytes of one part of `part_digests`.
pub const DIGEST_PART_BYTES: usize = 16 << 20;

/// The BLAKE3 digest of each `DIGEST_PART_BYTES` part of `data` (the last part may be shorter), digested on
/// several threads: what a model's weights identity is built from, so that every weight byte counts and a
/// checkpoint of many GiB is digested at memory speed. The parts depend only on the bytes, so data read in chunks
/// of whole parts gives the same digests.
pub fn part_digests(data: &[u8]) -> Vec<[u8; 32]> {
    let parts: Vec<&[u8]> = data.chunks(DIGEST_PART_BYTES).collect();
    let threads = crate::par::threads_for(data.len() as u64, 1, parts.len(), usize::MAX);
    crate::par::map(parts.len(), threads, |i| *blake3::hash(parts[i]).as_bytes())
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
        let f = |v: &[(&str, &str)]| {
            fingerprint(&v.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect::<Vec<_>>())
        };
        let a = f(&[("block_size", "16"), ("dtype", "bf16")]).unwrap();
        assert_eq!(a, f(&[("dtype", "bf16"), ("block_size", "16")]).unwrap());
        assert_ne!(a, f(&[("block_size", "32"), ("dtype", "bf16")]).unwrap());
        assert!(f(&[("a", "1"), ("a", "2")]).is_err());
        assert!(f(&[("a=b", "1")]).is_err());
    }

    #[test]
    fn key_strings_and_groups() {
        assert_eq!(group_key_string("fp", 4, 0xab), format!("kvtier/v2/fp/g4/{:032x}", 0xab));
        assert_eq!(state_key_string("fp", 1), format!("kvtier/v2/fp/state/{:032x}", 1));
    }

    #[test]
    fn check_accepts_only_what_seal_wrote_for_that_key_and_fingerprint() {
        let pages = [vec![7u8; 64], vec![9u8; 64]];
        let parts: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
        for secret in [&b""[..], b"deployment key"] {
            let f = ObjectFormat::new("fp-a", secret);
            let mut h = [0u8; HEADER_BYTES];
            f.seal(&mut h, 42, ObjectKind::Group, &parts);
            assert_eq!(f.check(&h, 42, ObjectKind::Group, &parts), Ok(()));
            assert_eq!(f.check(&h, 43, ObjectKind::Group, &parts), Err(Reject::ChainKey));
            assert_eq!(f.check(&h, 42, ObjectKind::State, &parts), Err(Reject::Kind));
            assert_eq!(
                ObjectFormat::new("fp-b", secret).check(&h, 42, ObjectKind::Group, &parts),
                Err(Reject::Fingerprint)
            );
            let mut flipped = pages[1].clone();
            flipped[5] ^= 0x10;
            assert_eq!(f.check(&h, 42, ObjectKind::Group, &[&pages[0], &flipped]), Err(Reject::Digest));
            assert!(matches!(f.check(&h, 42, ObjectKind::Group, &[&pages[0]]), Err(Reject::PayloadLength(128))));
            let mut old = h;
            old[8] = 1;
            assert_eq!(f.check(&old, 42, ObjectKind::Group, &parts), Err(Reject::Version(1)));
            let mut forged = h;
            forged[32] ^= 1; // a writer who moves the value and fixes the key field still fails the digest
            assert_eq!(f.check(&forged, 42 ^ 1, ObjectKind::Group, &parts), Err(Reject::Digest));
        }
        let keyed = ObjectFormat::new("fp-a", b"k1");
        let mut h = [0u8; HEADER_BYTES];
        ObjectFormat::new("fp-a", b"k2").seal(&mut h, 1, ObjectKind::State, &parts);
        assert_eq!(keyed.check(&h, 1, ObjectKind::State, &parts), Err(Reject::Digest), "another key");
    }

    #[test]
    fn part_digests_cover_every_byte_in_parts() {
        let mut data = vec![0u8; 2 * DIGEST_PART_BYTES + 5];
        let d = part_digests(&data);
        assert_eq!(d.len(), 3);
        assert_eq!(d[2], *blake3::hash(&[0u8; 5]).as_bytes());
        data[DIGEST_PART_BYTES + 7] = 1;
        let e = part_digests(&data);
        assert_eq!((d[0] == e[0], d[1] == e[1], d[2] == e[2]), (true, false, true));
        assert_eq!(part_digests(&data[..DIGEST_PART_BYTES]), e[..1].to_vec(), "chunks of whole parts agree");
        assert!(part_digests(&[]).is_empty());
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
