//! Chained 128-bit block keys over token ids.
//!
//! Page i's key is `C(key_{i-1}, D(tokens[i*bs..(i+1)*bs]))`: `D` digests one block on its own and `C` chains the
//! digests, so the blocks of a prompt are digested independently (many at once, in SIMD lanes) and only the small
//! chain step runs block after block. `key_{-1}` is derived from a per-request namespace (zero when empty), so a
//! tenant salt isolates whole chains. With keyed BLAKE3, `D` is `keyed_hash(k_block, block bytes)` (256 bits) and
//! `C` is `keyed_hash(k_chain, prev || digest)` truncated to 128 bits: a collision of two chains needs a collision
//! of `C` or of `D`, as in a Merkle-Damgard chain over fixed-length digests.
//!
//! A request's chain only grows: its tokens may only be extended until the request is forgotten. The chain keeps
//! the tokens it hashed, so a call for a known request checks that the prompt still extends them and hashes only
//! the new blocks: in full (every token compared) before anything is loaded or stored under its keys, or only at
//! the ends (length, first and last hashed block) for a lookup that just answers.
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::error::{invalid, Result};

/// A block key.
pub type Key = u128;

/// A map keyed by block keys (the pools', the policy's and the L3 seen-set's).
pub type KeyMap<V> = HashMap<Key, V, BuildHasherDefault<KeyHasher>>;

/// Keys are uniform 128-bit hashes already: hash them by their low 64 bits.
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 ^= u64::from_le_bytes(b);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

/// Version of the key derivation (hash construction and derived keys). A change of it changes every key: it is
/// part of the L3 fingerprint, so objects stored under an older scheme are never read.
/// 1: one keyed BLAKE3 (or xxh3) over `domain || prev || block`. 2: block digests chained over their digests.
pub const KEY_SCHEME: u32 = 2;

/// Context string from which the hash keys are derived (BLAKE3 `derive_key`).
const KEY_CONTEXT: &str = "kvtier 2026-12 block hash key scheme 2";

/// Context of the key derivation that maps an engine's own page hash (SGLang's HiCache page hashes, the keys of
/// vLLM's CPU chunks) to a chain key, apart from the token chain's keys.
const ENGINE_PAGE_CONTEXT: &str = "kvtier 2026-12 engine page hash to chain key v1";

/// The chain key of an engine's page hash (its text): BLAKE3 in key-derivation mode, truncated to 128 bits (little
/// endian). Unkeyed: the engine's hash already names the page's tokens and what they follow; the object's digest
/// under the deployment's key is what vouches for its bytes (rust/l3/mod.rs).
pub fn engine_page_key(hash: &str) -> Key {
    let mut h = blake3::Hasher::new_derive_key(ENGINE_PAGE_CONTEXT);
    h.update(hash.as_bytes());
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    Key::from_le_bytes(out)
}

/// The chain key of each engine page hash, refusing an empty one (any other text is a hash: SGLang's are sha256
/// hex chains).
pub fn engine_page_keys<S: AsRef<str>>(page_hashes: &[S]) -> Result<Vec<Key>> {
    if let Some(i) = page_hashes.iter().position(|h| h.as_ref().is_empty()) {
        return Err(invalid(format!("page_hashes[{i}] is empty")));
    }
    Ok(page_hashes.iter().map(|h| engine_page_key(h.as_ref())).collect())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HashKind {
    /// Keyed BLAKE3 truncated to 128 bits: cryptographic, a crafted prompt cannot collide with another's prefix.
    Blake3,
    /// xxh3-128 seeded from the key: faster, but collisions can be crafted; single-tenant use only.
    Xxh3,
}

impl HashKind {
    /// Every name `parse` takes.
    pub const NAMES: [&'static str; 2] = ["blake3", "xxh3"];

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
    /// Sub-keys of `key` for block digests, chain steps and namespaces (BLAKE3 words; xxh3 takes seeds from them).
    block_key: [u32; 8],
    chain_key: [u32; 8],
    namespace_key: [u8; 32],
    /// xxh3's secret for block digests, derived from the key once (a seeded xxh3 would derive one a call).
    xxh3_secret: [u8; 192],
    /// Digest 16 blocks at once in AVX-512 lanes (checked once, at construction).
    wide: bool,
}

impl BlockHasher {
    /// `secret` is any byte string (a deployment's `KVTIER_HASH_KEY`); empty gives the public default key.
    pub fn new(kind: HashKind, secret: &[u8]) -> Self {
        let key = blake3::derive_key(KEY_CONTEXT, secret);
        let sub = |label: &[u8]| *blake3::keyed_hash(&key, label).as_bytes();
        let mut xxh3_secret = [0u8; 192];
        blake3::Hasher::new_keyed(&key).update(b"xxh3 secret").finalize_xof().fill(&mut xxh3_secret);
        Self {
            kind,
            key,
            block_key: lanes::words(&sub(b"block")),
            chain_key: lanes::words(&sub(b"chain")),
            namespace_key: sub(b"namespace"),
            xxh3_secret,
            wide: lanes::wide_available(),
        }
    }

    pub fn kind(&self) -> HashKind {
        self.kind
    }

    /// A short public digest of the key, so fingerprints differ per key without revealing it.
    pub fn key_id(&self) -> String {
        let d = blake3::keyed_hash(&self.key, b"key id");
        d.to_hex()[..16].to_string()
    }

    /// `key_{-1}` for a namespace under a model version: 0 when both are empty. The version (what
    /// `Index::set_model_version` names) is length-prefixed, so no (version, namespace) pair is another's.
    pub fn root(&self, version: &[u8], namespace: &[u8]) -> Key {
        if version.is_empty() && namespace.is_empty() {
            return 0;
        }
        let owned;
        let input = if version.is_empty() {
            namespace // the root of a namespace without a version, as before versions existed
        } else {
            let mut m = Vec::with_capacity(9 + version.len() + namespace.len());
            m.push(b'v');
            m.extend_from_slice(&(version.len() as u64).to_le_bytes());
            m.extend_from_slice(version);
            m.extend_from_slice(namespace);
            owned = m;
            &owned
        };
        match self.kind {
            HashKind::Blake3 => {
                let d = blake3::keyed_hash(&self.namespace_key, input);
                u128::from_le_bytes(d.as_bytes()[..16].try_into().expect("16 bytes"))
            }
            HashKind::Xxh3 => xxhash_rust::xxh3::xxh3_128_with_seed(input, self.seed(2)),
        }
    }

    /// The key of the block after one with key `prev`.
    pub fn next(&self, prev: Key, block: &[i32]) -> Key {
        let mut out = Vec::with_capacity(1);
        self.extend(prev, block, block.len(), &mut out);
        out[0]
    }

    /// Appends to `out` the keys of the full blocks of `tokens` (`block_size` ids each), chained from `prev`.
    pub fn extend(&self, mut prev: Key, tokens: &[i32], block_size: usize, out: &mut Vec<Key>) {
        let blocks = tokens.len() / block_size;
        out.reserve(blocks);
        match self.kind {
            HashKind::Xxh3 => {
                let chain_seed = self.seed(1);
                for block in tokens.chunks_exact(block_size) {
                    let d = xxhash_rust::xxh3::xxh3_128_with_secret(token_bytes(block), &self.xxh3_secret);
                    let mut m = [0u8; 32];
                    m[..16].copy_from_slice(&prev.to_le_bytes());
                    m[16..].copy_from_slice(&d.to_le_bytes());
                    prev = xxhash_rust::xxh3::xxh3_128_with_seed(&m, chain_seed);
                    out.push(prev);
                }
            }
            HashKind::Blake3 => {
                let mut done = 0;
                if self.wide && block_size * 4 <= lanes::MAX_BYTES {
                    // SAFETY: `wide` is set only when the CPU has AVX-512F.
                    done =
                        unsafe { lanes::chain_wide(&self.block_key, &self.chain_key, prev, tokens, block_size, out) };
                    if done > 0 {
                        prev = out[out.len() - 1];
                    }
                }
                let block_key = lanes::bytes(&self.block_key);
                for block in tokens[done * block_size..blocks * block_size].chunks_exact(block_size) {
                    let d = blake3::keyed_hash(&block_key, token_bytes(block));
                    prev = lanes::chain_step(&self.chain_key, prev, &lanes::words(d.as_bytes()));
                    out.push(prev);
                }
            }
        }
    }

    /// xxh3 seeds of the chain step (1) and the namespace root (2).
    fn seed(&self, i: usize) -> u64 {
        match i {
            1 => u64::from(self.chain_key[0]) | u64::from(self.chain_key[1]) << 32,
            _ => u64::from_le_bytes(self.namespace_key[..8].try_into().expect("8 bytes")),
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

/// The largest token id plus one: ids are `0 <= id < 2**31`.
pub const TOKEN_LIMIT: i64 = 1 << 31;

/// Token ids as a caller holds them (an int32 slice, a wider or narrower integer slice, part of a list).
pub trait TokenIds {
    /// Number of ids in the prompt.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies ids `start..start + out.len()` into `out`; an id outside `0 <= id < 2**31` is an error naming it
    /// and its position.
    fn read(&self, start: usize, out: &mut [i32]) -> Result<()>;
    /// The ids as int32, when they are held so (read in place; the caller checks the range of what it uses).
    fn as_i32(&self) -> Option<&[i32]> {
        None
    }
    /// The offset of the first id of `start..start + expected.len()` that differs from `expected`, None when all
    /// are equal. One pass: a memcmp for int32 ids held in place, a read and compare for the others.
    fn diff(&self, start: usize, expected: &[i32]) -> Result<Option<usize>> {
        if let Some(all) = self.as_i32() {
            let got = &all[start..start + expected.len()];
            return Ok((got != expected).then(|| first_difference(got, expected)));
        }
        const STEP: usize = 4096;
        let mut buf = vec![0; STEP.min(expected.len())];
        for (i, want) in expected.chunks(STEP).enumerate() {
            let got = &mut buf[..want.len()];
            self.read(start + i * STEP, got)?;
            if got != want {
                return Ok(Some(i * STEP + first_difference(got, want)));
            }
        }
        Ok(None)
    }
}

fn first_difference(a: &[i32], b: &[i32]) -> usize {
    a.iter().zip(b).position(|(x, y)| x != y).unwrap_or(a.len().min(b.len()))
}

/// The error of a token id out of range.
pub fn bad_token(position: usize, value: impl std::fmt::Display) -> crate::error::Error {
    invalid(format!("token_ids[{position}] = {value} is out of range: ids must be >= 0 and < 2**31"))
}

/// Checks that int32 ids are non-negative; `offset` is the position of `ids[0]` in the prompt.
pub fn check_i32(ids: &[i32], offset: usize) -> Result<()> {
    if ids.iter().fold(0, |acc, &t| acc | t) >= 0 {
        return Ok(());
    }
    let i = ids.iter().position(|&t| t < 0).expect("a negative id");
    Err(bad_token(offset + i, ids[i]))
}

impl TokenIds for [i32] {
    fn len(&self) -> usize {
        <[i32]>::len(self)
    }
    fn read(&self, start: usize, out: &mut [i32]) -> Result<()> {
        let src = &self[start..start + out.len()];
        check_i32(src, start)?;
        out.copy_from_slice(src);
        Ok(())
    }
    fn as_i32(&self) -> Option<&[i32]> {
        Some(self)
    }
}

macro_rules! token_ids_of {
    ($($t:ty),*) => {$(
        impl TokenIds for [$t] {
            fn len(&self) -> usize {
                <[$t]>::len(self)
            }
            #[allow(clippy::cast_possible_truncation, clippy::unnecessary_cast, unused_comparisons)]
            fn read(&self, start: usize, out: &mut [i32]) -> Result<()> {
                let src = &self[start..start + out.len()];
                for (i, (&v, o)) in src.iter().zip(out.iter_mut()).enumerate() {
                    if v < 0 || (v as i128) >= TOKEN_LIMIT as i128 {
                        return Err(bad_token(start + i, v));
                    }
                    *o = v as i32;
                }
                Ok(())
            }
        }
    )*};
}
token_ids_of!(i64, u64, u32, i16, u16, i8, u8);

impl<T> TokenIds for &[T]
where
    [T]: TokenIds,
{
    fn len(&self) -> usize {
        (**self).len()
    }
    fn read(&self, start: usize, out: &mut [i32]) -> Result<()> {
        (**self).read(start, out)
    }
    fn as_i32(&self) -> Option<&[i32]> {
        (**self).as_i32()
    }
    fn diff(&self, start: usize, expected: &[i32]) -> Result<Option<usize>> {
        (**self).diff(start, expected)
    }
}

impl<T> TokenIds for Vec<T>
where
    [T]: TokenIds,
{
    fn len(&self) -> usize {
        self.as_slice().len()
    }
    fn read(&self, start: usize, out: &mut [i32]) -> Result<()> {
        self.as_slice().read(start, out)
    }
    fn as_i32(&self) -> Option<&[i32]> {
        self.as_slice().as_i32()
    }
    fn diff(&self, start: usize, expected: &[i32]) -> Result<Option<usize>> {
        self.as_slice().diff(start, expected)
    }
}

/// How much of a known request's prompt a call compares with the tokens hashed for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// Every hashed token: before anything is loaded into the engine's blocks or stored under the chain's keys.
    Full,
    /// The length and the first and last hashed blocks: a lookup that only answers (a deferred request asking
    /// again), which serves nothing.
    Ends,
}

impl Check {
    /// The ranges of a prompt of `len` tokens that a call with this check reads, for a request with `hashed`
    /// tokens hashed in blocks of `block_size`: every token for `Full`, a request not hashed yet, or a prompt
    /// shorter than what was hashed (the call then refuses it); for `Ends` the first and the last hashed block
    /// (to check that the prompt still extends them) and the tokens after them. Empty ranges are unused.
    pub fn ranges(self, hashed: usize, len: usize, block_size: usize) -> [std::ops::Range<usize>; 3] {
        if self == Check::Full || hashed == 0 || hashed > len || hashed < block_size {
            [0..len, 0..0, 0..0]
        } else {
            [0..block_size, hashed - block_size..hashed, hashed..len]
        }
    }
}

/// Some of a prompt's ids, read one at a time from where the engine holds them (a Python list): `len` ids in all,
/// of which the ranges a call's `Check` reads (`Check::ranges`). Reading any other id is an error.
pub struct Window {
    len: usize,
    pieces: Vec<(usize, Vec<i32>)>,
}

impl Window {
    /// Reads `ranges` of a prompt of `len` ids, id `i` by `id(i)` (which range-checks it).
    pub fn read<E>(
        len: usize,
        ranges: &[std::ops::Range<usize>],
        mut id: impl FnMut(usize) -> std::result::Result<i32, E>,
    ) -> std::result::Result<Self, E> {
        let mut pieces = Vec::with_capacity(ranges.len());
        for r in ranges.iter().filter(|r| r.start < r.end) {
            // A plain loop into a vector of the range's size (collecting into a Result grows it step by step).
            let mut ids = Vec::with_capacity(r.len());
            for i in r.clone() {
                ids.push(id(i)?);
            }
            pieces.push((r.start, ids));
        }
        Ok(Self { len, pieces })
    }
}

impl TokenIds for Window {
    fn len(&self) -> usize {
        self.len
    }
    fn read(&self, start: usize, out: &mut [i32]) -> Result<()> {
        let end = start + out.len();
        let (from, ids) =
            self.pieces.iter().find(|(from, ids)| *from <= start && end <= from + ids.len()).ok_or_else(|| {
                invalid(format!("token_ids {start}..{end} were not read: the request changed meanwhile"))
            })?;
        out.copy_from_slice(&ids[start - from..end - from]);
        Ok(())
    }
}

/// One request's chain: its namespace, the keys of the full blocks hashed so far and those blocks' tokens (to
/// check that a later call still extends the same prompt).
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

    /// Tokens hashed so far (full blocks).
    pub fn hashed_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Why `tokens` under `namespace` do not extend what was hashed, if they do not. `Check::Full` compares every
    /// hashed token, `Check::Ends` the first and last hashed blocks.
    pub fn mismatch<T: TokenIds + ?Sized>(
        &self,
        block_size: usize,
        namespace: &[u8],
        tokens: &T,
        check: Check,
    ) -> Result<Option<String>> {
        if self.keys.is_empty() {
            return Ok(None);
        }
        if namespace != self.namespace.as_slice() {
            return Ok(Some("its namespace differs from the one it was hashed under".to_owned()));
        }
        let hashed = self.tokens.len();
        if tokens.len() < hashed {
            return Ok(Some(format!("the prompt has {} tokens, fewer than the {hashed} already hashed", tokens.len())));
        }
        let last = hashed - block_size;
        let differs = match check {
            Check::Full => tokens.diff(0, &self.tokens)?,
            Check::Ends => match tokens.diff(0, &self.tokens[..block_size])? {
                None => tokens.diff(last, &self.tokens[last..])?.map(|i| last + i),
                first => first,
            },
        };
        Ok(differs.map(|i| {
            let b = i / block_size;
            format!(
                "token {i} (in its block at tokens {}..{}) differs from the one hashed",
                b * block_size,
                (b + 1) * block_size
            )
        }))
    }

    /// Extends the chain over the full blocks of `tokens` past those hashed; the caller has checked `mismatch`.
    /// Reads (and range-checks) only the tokens past those hashed. `root` is `key_{-1}` (`BlockHasher::root` of
    /// the namespace), used when the chain is empty. Returns the number of blocks hashed.
    pub fn extend<T: TokenIds + ?Sized>(
        &mut self,
        hasher: &BlockHasher,
        block_size: usize,
        namespace: &[u8],
        root: Key,
        tokens: &T,
    ) -> Result<usize> {
        let (from, to) = (self.keys.len(), tokens.len() / block_size);
        // The partial block after the full ones is not hashed, but its ids are checked like the others.
        let tail = (to * block_size).max(from * block_size)..tokens.len();
        if !tail.is_empty() {
            tokens.read(tail.start, &mut vec![0; tail.len()])?;
        }
        if to <= from {
            return Ok(0);
        }
        let owned;
        let new: &[i32] = match tokens.as_i32() {
            Some(all) => {
                let new = &all[from * block_size..to * block_size];
                check_i32(new, from * block_size)?;
                new
            }
            None => {
                let mut buf = vec![0; (to - from) * block_size];
                tokens.read(from * block_size, &mut buf)?;
                owned = buf;
                &owned
            }
        };
        if from == 0 {
            self.namespace = namespace.to_vec();
        }
        let prev = self.keys.last().copied().unwrap_or(root);
        hasher.extend(prev, new, block_size, &mut self.keys);
        self.tokens.extend_from_slice(new);
        Ok(to - from)
    }
}

/// Keyed BLAKE3 of short inputs (one chunk, at most 1024 bytes) written out from the specification, so that many
/// independent blocks can be digested at once, one per SIMD lane, and a chain step costs one compression. Every
/// output equals `blake3::keyed_hash` (tested against it).
// Loops run over lanes and words by index on purpose: that is the shape the vectorizer turns into SIMD.
#[allow(clippy::needless_range_loop)]
mod lanes {
    use super::Key;

    /// A chunk: the longest input one lane digests.
    pub const MAX_BYTES: usize = 1024;
    /// Lanes of the wide path (AVX-512: sixteen 32-bit words a register).
    const WIDE: usize = 16;

    const IV: [u32; 8] =
        [0x6A09_E667, 0xBB67_AE85, 0x3C6E_F372, 0xA54F_F53A, 0x510E_527F, 0x9B05_688C, 0x1F83_D9AB, 0x5BE0_CD19];
    /// Message word order of each of the seven rounds.
    const SCHEDULE: [[usize; 16]; 7] = [
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
        [2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8],
        [3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1],
        [10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6],
        [12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4],
        [9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7],
        [11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13],
    ];
    const CHUNK_START: u32 = 1;
    const CHUNK_END: u32 = 2;
    const ROOT: u32 = 8;
    const KEYED_HASH: u32 = 16;
    /// Flags of the one block of a one-block keyed hash.
    const ONE_BLOCK: u32 = KEYED_HASH | CHUNK_START | CHUNK_END | ROOT;

    /// A word in each of `L` lanes.
    type V<const L: usize> = [u32; L];

    pub fn words(b: &[u8; 32]) -> [u32; 8] {
        std::array::from_fn(|i| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().expect("4 bytes")))
    }

    pub fn bytes(w: &[u32; 8]) -> [u8; 32] {
        let mut b = [0u8; 32];
        for (chunk, x) in b.chunks_exact_mut(4).zip(w) {
            chunk.copy_from_slice(&x.to_le_bytes());
        }
        b
    }

    pub fn wide_available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    #[inline(always)]
    fn g<const L: usize>(s: &mut [V<L>; 16], [a, b, c, d]: [usize; 4], x: &V<L>, y: &V<L>) {
        for i in 0..L {
            s[a][i] = s[a][i].wrapping_add(s[b][i]).wrapping_add(x[i]);
            s[d][i] = (s[d][i] ^ s[a][i]).rotate_right(16);
            s[c][i] = s[c][i].wrapping_add(s[d][i]);
            s[b][i] = (s[b][i] ^ s[c][i]).rotate_right(12);
            s[a][i] = s[a][i].wrapping_add(s[b][i]).wrapping_add(y[i]);
            s[d][i] = (s[d][i] ^ s[a][i]).rotate_right(8);
            s[c][i] = s[c][i].wrapping_add(s[d][i]);
            s[b][i] = (s[b][i] ^ s[c][i]).rotate_right(7);
        }
    }

    // Rounds are spelled out (not a loop over SCHEDULE) so that every index is a constant and the state stays in
    // registers.
    #[inline(always)]
    fn round<const L: usize>(s: &mut [V<L>; 16], m: &[V<L>; 16], r: &[usize; 16]) {
        g(s, [0, 4, 8, 12], &m[r[0]], &m[r[1]]);
        g(s, [1, 5, 9, 13], &m[r[2]], &m[r[3]]);
        g(s, [2, 6, 10, 14], &m[r[4]], &m[r[5]]);
        g(s, [3, 7, 11, 15], &m[r[6]], &m[r[7]]);
        g(s, [0, 5, 10, 15], &m[r[8]], &m[r[9]]);
        g(s, [1, 6, 11, 12], &m[r[10]], &m[r[11]]);
        g(s, [2, 7, 8, 13], &m[r[12]], &m[r[13]]);
        g(s, [3, 4, 9, 14], &m[r[14]], &m[r[15]]);
    }

    /// One compression (chunk counter 0) in each lane; `cv` becomes the first half of the output.
    #[inline(always)]
    fn compress<const L: usize>(cv: &mut [V<L>; 8], m: &[V<L>; 16], block_len: V<L>, flags: u32) {
        let mut s = [[0u32; L]; 16];
        s[..8].copy_from_slice(cv);
        for i in 0..4 {
            s[8 + i] = [IV[i]; L];
        }
        s[14] = block_len;
        s[15] = [flags; L];
        round(&mut s, m, &SCHEDULE[0]);
        round(&mut s, m, &SCHEDULE[1]);
        round(&mut s, m, &SCHEDULE[2]);
        round(&mut s, m, &SCHEDULE[3]);
        round(&mut s, m, &SCHEDULE[4]);
        round(&mut s, m, &SCHEDULE[5]);
        round(&mut s, m, &SCHEDULE[6]);
        for i in 0..8 {
            for l in 0..L {
                cv[i][l] = s[i][l] ^ s[i + 8][l];
            }
        }
    }

    /// Lane `l`'s output truncated to a key: its first four words, little-endian.
    #[inline(always)]
    fn lane_key<const L: usize>(cv: &[V<L>; 8], l: usize) -> Key {
        (0..4).fold(0, |k, w| k | Key::from(cv[w][l]) << (32 * w))
    }

    /// `keyed_hash(key, prev || digest)` truncated to a key: one compression.
    #[inline(always)]
    pub fn chain_step(key: &[u32; 8], prev: Key, digest: &[u32; 8]) -> Key {
        let mut m = [[0u32; 1]; 16];
        for (w, slot) in m.iter_mut().take(4).enumerate() {
            slot[0] = (prev >> (32 * w)) as u32;
        }
        for w in 0..8 {
            m[4 + w][0] = digest[w];
        }
        let mut cv: [V<1>; 8] = std::array::from_fn(|i| [key[i]]);
        compress(&mut cv, &m, [48], ONE_BLOCK);
        lane_key(&cv, 0)
    }

    /// `keyed_hash(key, block bytes)` of `L` consecutive blocks of `block_size` ids (at most 1024 bytes each).
    #[inline(always)]
    fn digest_lanes<const L: usize>(key: &[u32; 8], tokens: &[i32], block_size: usize) -> [V<L>; 8] {
        let bytes = block_size * 4;
        let blocks = bytes.div_ceil(64);
        let mut cv: [V<L>; 8] = std::array::from_fn(|i| [key[i]; L]);
        let mut m = [[0u32; L]; 16];
        for b in 0..blocks {
            let words = (block_size - 16 * b).min(16);
            for l in 0..L {
                let src = &tokens[l * block_size + 16 * b..l * block_size + 16 * b + words];
                for (w, &t) in src.iter().enumerate() {
                    m[w][l] = t as u32;
                }
                for mw in m.iter_mut().skip(words) {
                    mw[l] = 0;
                }
            }
            let mut flags = KEYED_HASH;
            if b == 0 {
                flags |= CHUNK_START;
            }
            if b == blocks - 1 {
                flags |= CHUNK_END | ROOT;
            }
            compress(&mut cv, &m, [(words * 4) as u32; L], flags);
        }
        cv
    }

    /// Chains as many whole groups of 16 blocks of `tokens` as there are, digesting each group in AVX-512 lanes;
    /// appends their keys to `out` and returns the number of blocks done.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx512f"))]
    pub unsafe fn chain_wide(
        block_key: &[u32; 8],
        chain_key: &[u32; 8],
        mut prev: Key,
        tokens: &[i32],
        block_size: usize,
        out: &mut Vec<Key>,
    ) -> usize {
        let groups = tokens.len() / block_size / WIDE;
        for group in tokens.chunks_exact(WIDE * block_size).take(groups) {
            let d = digest_lanes::<WIDE>(block_key, group, block_size);
            for l in 0..WIDE {
                prev = chain_step(chain_key, prev, &std::array::from_fn(|w| d[w][l]));
                out.push(prev);
            }
        }
        groups * WIDE
    }

    #[cfg(test)]
    pub fn digest_one(key: &[u32; 8], block: &[i32]) -> [u32; 8] {
        let d = digest_lanes::<1>(key, block, block.len());
        std::array::from_fn(|w| d[w][0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_page_keys_are_derived_apart_and_refuse_an_empty_hash() {
        assert_eq!(engine_page_key("ab"), engine_page_key("ab"));
        assert_ne!(engine_page_key("ab"), engine_page_key("ba"));
        assert_ne!(engine_page_key(""), engine_page_key("a"));
        // The keys of objects already in a Store: the derivation must not change.
        let mut want = [0u8; 16];
        want.copy_from_slice(&blake3::derive_key(ENGINE_PAGE_CONTEXT, b"ab")[..16]);
        assert_eq!(engine_page_key("ab"), Key::from_le_bytes(want));
        assert_eq!(engine_page_keys(&["x", "y"]).unwrap(), vec![engine_page_key("x"), engine_page_key("y")]);
        let err = engine_page_keys(&["x", ""]).unwrap_err();
        assert_eq!(err.to_string(), "page_hashes[1] is empty");
    }

    #[test]
    fn a_check_reads_every_token_or_only_the_ends_and_the_new_tokens() {
        assert_eq!(Check::Full.ranges(8, 12, 4), [0..12, 0..0, 0..0]);
        assert_eq!(Check::Ends.ranges(8, 12, 4), [0..4, 4..8, 8..12]);
        assert_eq!(Check::Ends.ranges(4, 4, 4), [0..4, 0..4, 4..4]);
        // Nothing hashed yet, or a prompt shorter than what was hashed (refused by the call): all of it.
        assert_eq!(Check::Ends.ranges(0, 12, 4), [0..12, 0..0, 0..0]);
        assert_eq!(Check::Ends.ranges(16, 12, 4), [0..12, 0..0, 0..0]);
        // The ranges an Ends check reads are what the chain compares: the prompt still extends its chain.
        let h = BlockHasher::new(HashKind::Blake3, b"");
        let t = toks(40, 3);
        let mut c = Chain::default();
        c.extend(&h, 4, b"", h.root(b"", b""), &t[..16]).unwrap();
        let ranges = Check::Ends.ranges(c.hashed_tokens(), t.len(), 4);
        let w = Window::read(t.len(), &ranges, |i| Ok::<i32, ()>(t[i])).unwrap();
        assert_eq!(c.mismatch(4, b"", &w, Check::Ends).unwrap(), None);
        assert_eq!(c.extend(&h, 4, b"", h.root(b"", b""), &w).unwrap(), 6);
        assert_eq!(c.keys(), chain_of(&h, 4, b"", &t).as_slice());
        // A Full check reads what an Ends window does not have: refused, never read as zeros.
        let mut w2 = Window::read(t.len(), &ranges, |i| Ok::<i32, ()>(t[i])).unwrap();
        assert!(c.mismatch(4, b"", &w2, Check::Full).is_err());
        w2 = Window::read(t.len(), &Check::Full.ranges(16, t.len(), 4), |i| Ok::<i32, ()>(t[i])).unwrap();
        assert_eq!(c.mismatch(4, b"", &w2, Check::Full).unwrap(), None);
    }

    fn toks(n: usize, seed: i32) -> Vec<i32> {
        (0..n as i32).map(|i| (i * 7919 + seed) % 50_000).collect()
    }

    fn chain_of(h: &BlockHasher, bs: usize, ns: &[u8], t: &[i32]) -> Vec<Key> {
        let mut c = Chain::default();
        c.extend(h, bs, ns, h.root(b"", ns), t).unwrap();
        c.keys().to_vec()
    }

    /// Each key is exactly keyed BLAKE3 of the spec: `C(prev, D(block))`, computed here with the blake3 crate.
    #[test]
    fn every_hash_kind_name_parses_to_itself() {
        for name in HashKind::NAMES {
            assert_eq!(HashKind::parse(name).unwrap().name(), name);
        }
        assert!(HashKind::parse("sha256").is_err());
    }

    #[test]
    fn blake3_keys_equal_the_reference_construction() {
        let h = BlockHasher::new(HashKind::Blake3, b"secret");
        let key = blake3::derive_key(KEY_CONTEXT, b"secret");
        let (kb, kc) = (blake3::keyed_hash(&key, b"block"), blake3::keyed_hash(&key, b"chain"));
        for bs in [1, 3, 4, 15, 16, 17, 64, 100, 256, 257, 300] {
            let t = toks(bs * 37 + 5, bs as i32);
            let mut prev: Key = 0;
            let mut want = Vec::new();
            for block in t.chunks_exact(bs) {
                let d = blake3::keyed_hash(kb.as_bytes(), token_bytes(block));
                let mut m = prev.to_le_bytes().to_vec();
                m.extend_from_slice(d.as_bytes());
                prev = u128::from_le_bytes(blake3::keyed_hash(kc.as_bytes(), &m).as_bytes()[..16].try_into().unwrap());
                want.push(prev);
            }
            assert_eq!(chain_of(&h, bs, b"", &t), want, "block size {bs}");
            let narrow = BlockHasher { wide: false, ..h.clone() };
            assert_eq!(chain_of(&narrow, bs, b"", &t), want, "block size {bs}, one block at a time");
            if bs * 4 <= lanes::MAX_BYTES {
                let one = lanes::digest_one(&h.block_key, &t[..bs]);
                assert_eq!(lanes::bytes(&one), *blake3::keyed_hash(kb.as_bytes(), token_bytes(&t[..bs])).as_bytes());
            }
        }
    }

    #[test]
    fn chained_keys_depend_on_the_whole_prefix() {
        for kind in [HashKind::Blake3, HashKind::Xxh3] {
            let h = BlockHasher::new(kind, b"");
            let a = toks(64 * 40, 1);
            let mut b = a.clone();
            b[3] += 1;
            let (ka, kb) = (chain_of(&h, 64, b"", &a), chain_of(&h, 64, b"", &b));
            assert!(ka.iter().zip(&kb).all(|(x, y)| x != y));
            assert_eq!(h.next(ka[0], &a[64..128]), ka[1]);
        }
    }

    #[test]
    fn extend_hashes_only_new_blocks() {
        for kind in [HashKind::Blake3, HashKind::Xxh3] {
            let h = BlockHasher::new(kind, b"k");
            let t = toks(100, 3);
            let mut c = Chain::default();
            assert_eq!(c.extend(&h, 16, b"", h.root(b"", b""), &t[..40]).unwrap(), 2);
            assert_eq!(c.mismatch(16, b"", &t[..], Check::Full).unwrap(), None);
            assert_eq!(c.extend(&h, 16, b"", h.root(b"", b""), &t[..]).unwrap(), 4);
            assert_eq!(c.extend(&h, 16, b"", h.root(b"", b""), &t[..]).unwrap(), 0);
            assert_eq!(c.keys(), chain_of(&h, 16, b"", &t));
        }
    }

    #[test]
    fn a_prompt_that_does_not_extend_the_chain_is_named() {
        let h = BlockHasher::new(HashKind::Blake3, b"");
        let t = toks(64, 3);
        let mut c = Chain::default();
        c.extend(&h, 16, b"", h.root(b"", b""), &t[..]).unwrap();
        let why = |ns: &[u8], p: &[i32], check| c.mismatch(16, ns, p, check).unwrap().unwrap_or_default();
        for check in [Check::Full, Check::Ends] {
            assert!(why(b"", &t[..50], check).contains("50 tokens, fewer than the 64"));
            assert!(why(b"x", &t[..], check).contains("namespace"));
            let mut first = t.clone();
            first[2] += 1;
            assert!(why(b"", &first, check).contains("token 2 (in its block at tokens 0..16)"));
            let mut last = t.clone();
            last[63] += 1;
            assert!(why(b"", &last, check).contains("token 63 (in its block at tokens 48..64)"));
        }
        let mut middle = t.clone();
        middle[20] += 1;
        assert!(why(b"", &middle, Check::Full).contains("token 20 (in its block at tokens 16..32)"));
        assert_eq!(why(b"", &middle, Check::Ends), "", "an answering lookup compares the ends only");
        // Ids held in another width are compared the same way, chunk by chunk.
        let mut wide: Vec<i64> = t.iter().map(|&x| i64::from(x)).collect();
        assert_eq!(c.mismatch(16, b"", &wide, Check::Full).unwrap(), None);
        wide[40] += 1;
        assert!(c.mismatch(16, b"", &wide, Check::Full).unwrap().unwrap().contains("token 40"));
    }

    #[test]
    fn namespaces_and_hash_keys_separate_chains() {
        let t = toks(32, 5);
        let h = BlockHasher::new(HashKind::Blake3, b"");
        assert_ne!(chain_of(&h, 16, b"", &t), chain_of(&h, 16, b"tenant-a", &t));
        assert_ne!(chain_of(&h, 16, b"tenant-a", &t), chain_of(&h, 16, b"tenant-b", &t));
        assert_ne!(chain_of(&h, 16, b"", &t), chain_of(&BlockHasher::new(HashKind::Blake3, b"secret"), 16, b"", &t));
        assert_ne!(chain_of(&h, 16, b"", &t), chain_of(&BlockHasher::new(HashKind::Xxh3, b""), 16, b"", &t));
    }

    #[test]
    fn every_integer_width_gives_the_same_keys_and_bad_ids_are_named() {
        let h = BlockHasher::new(HashKind::Blake3, b"");
        let t = toks(48, 9);
        let want = chain_of(&h, 16, b"", &t);
        let wide: Vec<i64> = t.iter().map(|&x| i64::from(x)).collect();
        let mut c = Chain::default();
        c.extend(&h, 16, b"", h.root(b"", b""), &wide).unwrap();
        assert_eq!(c.keys(), want);
        let err = Chain::default().extend(&h, 16, b"", 0, &[1, 2, -5][..]).unwrap_err();
        assert!(err.to_string().contains("token_ids[2] = -5"), "the partial block is checked too: {err}");
        let mut bad = wide.clone();
        bad[20] = 1 << 31;
        let err = Chain::default().extend(&h, 16, b"", 0, &bad).unwrap_err();
        assert!(err.to_string().contains("token_ids[20] = 2147483648"), "{err}");
        let mut neg = t.clone();
        neg[33] = -1;
        let err = Chain::default().extend(&h, 16, b"", 0, &neg).unwrap_err();
        assert!(err.to_string().contains("token_ids[33] = -1"), "{err}");
    }
}
