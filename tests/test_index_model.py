"""The Rust index against the plain-Python model of the same rules, under random operation sequences.

After every step: both agree on every plan, slot, LRU order and counter; no slot is owned by two entries; free +
used = capacity; refs never negative; no pinned or not-ready entry is ever evicted; every hit is a run of ready
pages ending at a boundary with a ready state.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvtier
from kvtier.pyindex import PyIndex

BLOCK = 4
BASES = [np.random.default_rng(seed).integers(0, 1000, size=64, dtype=np.int32) for seed in range(3)]

prompts = st.builds(
    lambda base, n, tail: np.concatenate([BASES[base][:n], np.asarray(tail, dtype=np.int32)]).astype(np.int32),
    st.integers(0, len(BASES) - 1),
    st.integers(0, 48),
    st.lists(st.integers(0, 999), max_size=6),
)
request_ids = st.sampled_from([f"r{i}" for i in range(5)])


def snapshot(ix: kvtier.Index, n_pages: int, n_states: int) -> dict[tuple[str, int], tuple[int, int, bool]]:
    out = {}
    for s in range(n_pages):
        e = ix.page_entry(s)
        if e is not None:
            out[("page", s)] = e
    for s in range(n_states):
        e = ix.state_entry(s)
        if e is not None:
            out[("state", s)] = e
    return out


class IndexMachine(RuleBasedStateMachine):
    @initialize(
        page_slots=st.integers(1, 14),
        state_slots=st.integers(0, 4),
        keep=st.integers(1, 6),
        min_hit=st.sampled_from([0, BLOCK, 2 * BLOCK]),
        lookback=st.integers(0, 4),
        slack=st.sampled_from([0, BLOCK, 3 * BLOCK, 100]),
    )
    def setup(self, page_slots, state_slots, keep, min_hit, lookback, slack):
        kw = dict(
            state_slots=state_slots,
            block_size=BLOCK,
            keep_tokens=keep,
            min_hit_tokens=min_hit,
            state_lookback_blocks=lookback,
            ring_slack=slack,
        )
        self.rust = kvtier.Index(page_slots, **kw)
        self.model = PyIndex(
            page_slots, chain_fn=lambda rid, ns, toks: self.rust.chain(rid, np.asarray(toks, np.int32)), **kw
        )
        self.n_pages, self.n_states = page_slots, state_slots
        self.pending: list[int] = []
        self.known: set[str] = set()
        self.before = snapshot(self.rust, page_slots, state_slots)

    def _step_evictions(self, discarded: set[tuple[str, int]] = frozenset()) -> None:
        """Every entry that left the pools since the last step was evictable (or discarded by an abort)."""
        after = snapshot(self.rust, self.n_pages, self.n_states)
        for where, (key, refs, ready) in self.before.items():
            if after.get(where, (None,))[0] != key and where not in discarded:
                assert refs == 0 and ready, f"{where} key {key:x} left the pool with refs={refs} ready={ready}"
        self.before = after

    @rule(rid=request_ids, prompt=prompts, extra=st.integers(0, 8))
    def store(self, rid, prompt, extra):
        seq_len = len(prompt) + extra
        p = self.rust.plan_store(rid, prompt, seq_len=seq_len)
        m = self.model.plan_store(rid, prompt.tolist(), seq_len)
        assert (p.ticket, p.page_indices.tolist(), p.page_slots.tolist(), p.state_boundaries, p.state_slots.tolist()) == m
        self.pending.append(p.ticket)
        self.known.add(rid)
        self._step_evictions()

    @rule(rid=request_ids, prompt=prompts, load=st.booleans())
    def lookup(self, rid, prompt, load):
        got = self.rust.lookup(rid, prompt)
        assert (got.hit_tokens, got.ready_pages, got.limit_pages) == self.model.lookup(rid, prompt.tolist())
        self.known.add(rid)
        if got.hit_tokens == 0:
            return
        if not load:
            self.rust.defer(rid)
            self.model.defer(rid)
            return
        plan = self.rust.begin_load(rid, got.hit_tokens)
        ticket, slots, state = self.model.begin_load(rid, got.hit_tokens)
        assert (plan.ticket, plan.page_slots.tolist(), plan.state_slot) == (ticket, slots, state)
        keys = self.rust.keys(rid)
        n = got.hit_tokens // BLOCK
        for i, slot in enumerate(plan.page_slots.tolist()):
            assert self.rust.page_entry(slot)[0] == keys[i] and self.rust.page_entry(slot)[2], "hit page not ready"
        if self.n_states:
            key, _, ready = self.rust.state_entry(plan.state_slot)
            assert key == keys[n - 1] and ready, "hit does not end at a ready state"
        self.pending.append(plan.ticket)
        self._step_evictions()

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 100), ok=st.booleans())
    def finish(self, i, ok):
        ticket = self.pending.pop(i % len(self.pending))
        discarded = set()
        if ok:
            self.rust.complete(ticket)
            self.model.complete(ticket)
        else:
            discarded = {
                where for where, (_, refs, ready) in self.before.items() if refs >= 1 and not ready
            }  # a store's own new entries may be discarded
            self.rust.abort(ticket)
            self.model.abort(ticket)
        self._step_evictions(discarded)

    @rule(rid=request_ids)
    def forget(self, rid):
        assert self.rust.forget(rid) == self.model.forget(rid)
        self.known.discard(rid)

    @invariant()
    def agrees_with_the_model(self):
        self.rust.check()
        stats = self.rust.stats()
        for k, v in self.model.stats.items():
            assert stats[k] == v, (k, stats[k], v)
        assert stats["pages_evicted"] == self.model.pages.evicted
        for pool, model, n, entry in (
            ("page", self.model.pages, self.n_pages, self.rust.page_entry),
            ("state", self.model.states, self.n_states, self.rust.state_entry),
        ):
            owners = {}
            for key, e in model.entries.items():
                assert e.refs >= 0
                assert e.slot not in owners, f"{pool} slot {e.slot} owned twice"
                owners[e.slot] = key
                assert entry(e.slot) == (key, e.refs, e.ready), (pool, e.slot)
            assert len(model.entries) + len(model.free) == n
            assert sum(entry(s) is not None for s in range(n)) == len(model.entries)
        assert self.rust.page_lru() == list(self.model.pages.lru)
        assert self.rust.state_lru() == list(self.model.states.lru)


TestIndexMachine = IndexMachine.TestCase


def test_lookup_counts_a_retried_request_once():
    ix = kvtier.Index(16, block_size=4, min_hit_tokens=0)
    t = np.arange(40, dtype=np.int32)
    ix.complete(ix.plan_store("a", t).ticket)
    for _ in range(3):
        assert ix.lookup("b", t).hit_tokens == 36
        ix.defer("b")
    s = ix.stats()
    assert (s["lookups"], s["deferred"], s["lookup_tokens"]) == (1, 3, 40)


def test_first_pages_are_evicted_last():
    ix = kvtier.Index(8, block_size=4, min_hit_tokens=0)
    t = np.arange(32, dtype=np.int32)
    ix.complete(ix.plan_store("a", t).ticket)
    keys = ix.keys("a")
    assert ix.page_lru() == keys[::-1], "deepest page least recent"
    ix.complete(ix.plan_store("b", np.arange(100, 104, dtype=np.int32)).ticket)
    assert ix.page_slot(keys[-1]) is None and ix.page_slot(keys[0]) is not None


def test_states_snap_the_hit_to_a_boundary():
    ix = kvtier.Index(16, state_slots=4, block_size=4, min_hit_tokens=0, state_lookback_blocks=2, ring_slack=4)
    t = np.arange(40, dtype=np.int32)  # 10 blocks; states at boundaries 40 and 36 (ring: b >= 40 - 4)
    p = ix.plan_store("a", t)
    assert p.state_boundaries == [40, 36]
    ix.complete(p.ticket)
    assert ix.lookup("b", np.arange(45, dtype=np.int32)).hit_tokens == 40
    assert ix.lookup("c", t).hit_tokens == 36  # keep_tokens=1 caps at 9 blocks: the state at 36
    assert ix.lookup("d", t[:35]).hit_tokens == 0  # 8 blocks ready, no state at or below 32


@given(st.lists(st.integers(0, 2**31 - 1), min_size=8, max_size=200), st.sampled_from(["blake3", "xxh3"]))
def test_chain_extension_equals_a_fresh_chain(tokens, kind):
    ix = kvtier.Index(4, block_size=4, hash_kind=kind)
    arr = np.asarray(tokens, dtype=np.int32)
    for cut in range(0, len(arr) + 1, 7):
        ix.chain("grow", arr[:cut])
    fresh = ix.chain("fresh", arr)
    assert ix.chain("grow", arr) == fresh
    other = arr.copy()
    other[5] ^= 1
    changed = ix.chain("grow", other)
    assert changed[0] == fresh[0]
    assert all(a != b for a, b in zip(changed[1:], fresh[1:]))
