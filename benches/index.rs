//! Index operations on one long prompt (131,072 tokens in 2048 pages of 64): chain hashing (both hash kinds, as
//! bytes of token ids a second), the lookup of a request already hashed, store planning, eviction under a full
//! pool (under each eviction policy), and the L3 seen-set.
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvtier::index::chain::{BlockHasher, Chain, Check, HashKind};
use kvtier::index::policy::Policy;
use kvtier::index::KeyState;
use kvtier::l3::SeenSet;
use kvtier::{Config, Index};

const BLOCK: usize = 64;
const PAGES: usize = 2048; // a 131,072-token prompt

fn tokens(n: usize, seed: u32) -> Vec<i32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) % 150_000) as i32).collect()
}

fn config(page_slots: u32, eviction_policy: Policy) -> Config {
    Config { eviction_policy, ..Config::new(page_slots, 0, BLOCK) }
}

fn stored(page_slots: u32, prompt: &[i32], policy: Policy) -> Index {
    let mut ix = Index::new(config(page_slots, policy), page_slots, 0).unwrap();
    let t = ix.plan_store("warm", b"", prompt, prompt.len()).unwrap().ticket;
    ix.complete(t).unwrap();
    ix
}

fn chain_extend(c: &mut Criterion) {
    let t = tokens(PAGES * BLOCK, 1);
    let mut g = c.benchmark_group("chain_extend");
    g.throughput(Throughput::Bytes(t.len() as u64 * 4));
    for kind in [HashKind::Blake3, HashKind::Xxh3] {
        let h = BlockHasher::new(kind, b"");
        g.bench_function(kind.name(), |b| {
            b.iter(|| {
                let mut chain = Chain::default();
                chain.extend(&h, BLOCK, b"", 0, black_box(&t)).unwrap();
                chain
            })
        });
    }
    g.finish();
}

fn lookup_walk(c: &mut Criterion) {
    let t = tokens(PAGES * BLOCK, 2);
    let mut ix = stored(PAGES as u32 * 2, &t, Policy::Lru);
    ix.chain("r", b"", &t, Check::Full).unwrap();
    let mut g = c.benchmark_group("lookup_walk");
    g.throughput(Throughput::Elements(PAGES as u64));
    g.bench_function("2048_pages_hashed", |b| b.iter(|| ix.lookup("r", b"", black_box(&t)).unwrap()));
    // Every hashed token compared, as before a hit is served.
    g.bench_function("2048_pages_verified", |b| b.iter(|| ix.verify("r", b"", black_box(&t)).unwrap()));
    g.finish();
}

fn store_planning(c: &mut Criterion) {
    let t = tokens(PAGES * BLOCK, 3);
    let mut g = c.benchmark_group("plan_store");
    g.throughput(Throughput::Elements(PAGES as u64));
    g.bench_function("all_present", |b| {
        let mut ix = stored(PAGES as u32 * 2, &t, Policy::Lru);
        b.iter(|| {
            let p = ix.plan_store("warm", b"", black_box(&t), t.len()).unwrap();
            ix.complete(p.ticket).unwrap();
        })
    });
    g.bench_function("all_new", |b| {
        b.iter_batched(
            || {
                let mut ix = Index::new(config(PAGES as u32, Policy::Lru), PAGES as u32, 0).unwrap();
                ix.chain("r", b"", &t, Check::Full).unwrap();
                ix
            },
            |mut ix| {
                let p = ix.plan_store("r", b"", &t, t.len()).unwrap();
                ix.complete(p.ticket).unwrap();
                ix
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

fn eviction_full_pool(c: &mut Criterion) {
    // The pool holds one prompt; storing another evicts all of it.
    let a = tokens(PAGES * BLOCK, 4);
    let b2 = tokens(PAGES * BLOCK, 5);
    let mut g = c.benchmark_group("evict_full_pool");
    g.throughput(Throughput::Elements(PAGES as u64));
    for policy in [Policy::Lru, Policy::Adaptive] {
        let name =
            if policy == Policy::Lru { "2048_pages".to_owned() } else { format!("2048_pages_{}", policy.name()) };
        g.bench_function(name, |b| {
            b.iter_batched(
                || {
                    let mut ix = stored(PAGES as u32, &a, policy);
                    ix.chain("b", b"", &b2, Check::Full).unwrap();
                    ix
                },
                |mut ix| {
                    let p = ix.plan_store("b", b"", &b2, b2.len()).unwrap();
                    ix.complete(p.ticket).unwrap();
                    ix
                },
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();
}

/// vLLM's offloading manager on engine keys (36 bytes: a block hash and its group): a store of 2048 new keys into
/// a full pool of 2048 (every stored key evicted), then its keys reported done and the store completed; the keys'
/// hashing one at a time; a lookup of keys none of which is on the host.
fn engine_keys(c: &mut Criterion) {
    // Distinct keys shaped as vLLM's: a 32-byte digest and a 4-byte group index.
    let keys = |seed: u32| -> Vec<Vec<u8>> {
        (0..PAGES as u32)
            .map(|i| {
                let mut k = blake3::hash(&[seed.to_le_bytes(), i.to_le_bytes()].concat()).as_bytes().to_vec();
                k.extend_from_slice(&[0; 4]);
                k
            })
            .collect()
    };
    let (a, b2) = (keys(1), keys(2));
    let mut g = c.benchmark_group("engine_keys");
    g.throughput(Throughput::Elements(PAGES as u64));
    g.bench_function("store_2048_evicting_2048", |b| {
        b.iter_batched(
            || {
                let mut ix = Index::new(config(PAGES as u32, Policy::Lru), PAGES as u32, 0).unwrap();
                let p = ix.store_keys(&a).unwrap().unwrap();
                ix.complete(p.ticket).unwrap();
                ix
            },
            |mut ix| {
                ix.store_keys(black_box(&b2)).unwrap().unwrap();
                for (t, _) in ix.complete_keys(&b2, true).unwrap().due {
                    ix.complete(t).unwrap();
                }
                ix
            },
            BatchSize::LargeInput,
        )
    });
    let sets: Vec<Vec<Vec<u8>>> = (3..8).map(keys).collect();
    let mut ix = Index::new(config(PAGES as u32, Policy::Lru), PAGES as u32, 0).unwrap();
    let mut at = 0;
    g.bench_function("steady_store_2048_evicting_2048", |b| {
        b.iter(|| {
            at = (at + 1) % sets.len();
            let p = ix.store_keys(black_box(&sets[at])).unwrap().unwrap();
            for (t, _) in ix.complete_keys(&sets[at], true).unwrap().due {
                ix.complete(t).unwrap();
            }
            p.evicted.len()
        })
    });
    // A lookup of keys none of which is on the host: one probe of the names a key (only the first is asked).
    let mut ix = Index::new(config(PAGES as u32, Policy::Lru), PAGES as u32, 0).unwrap();
    g.bench_function("lookup_2048_none_stored", |b| b.iter(|| ix.lookup_keys(black_box(&b2)).unwrap()));
    // One key at a time, every key ready: what vLLM's scheduler asks.
    let p = ix.store_keys(&a).unwrap().unwrap();
    ix.complete(p.ticket).unwrap();
    g.bench_function("key_state_2048_all_ready", |b| {
        b.iter(|| a.iter().filter(|k| ix.key_state(k).unwrap() == KeyState::Ready).count())
    });
    g.finish();
}

fn seen_set(c: &mut Criterion) {
    let mut g = c.benchmark_group("seen_set");
    g.throughput(Throughput::Elements(1));
    let mut s = SeenSet::new(1 << 16).unwrap();
    let mut k: u128 = 0;
    g.bench_function("insert_full", |b| {
        b.iter(|| {
            k = k.wrapping_add(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
            s.insert(black_box(k))
        })
    });
    g.bench_function("contains", |b| b.iter(|| s.contains(black_box(k))));
    g.finish();
}

criterion_group!(benches, chain_extend, lookup_walk, store_planning, eviction_full_pool, engine_keys, seen_set);
criterion_main!(benches);
