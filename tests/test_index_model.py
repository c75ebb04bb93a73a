"""The Rust index against the plain-Python model of the same rules, under random operation sequences.

After every step, under either eviction policy: both agree on every plan, slot, eviction list, ghost list, adaptive
target, KV event and counter; no slot is owned by two entries; free +
used = capacity; refs never negative; no acquired or not-ready entry is ever evicted; every hit is a run of ready
pages ending at a boundary with a ready state. Requests follow the engine contract: a request's prompt only grows
until it is forgotten (and a reused id is refused).
"""

from __future__ import annotations

import array

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvtier
from kvtier.tools.pyindex import PyIndex

BLOCK = 4
BASES = [np.random.default_rng(seed).integers(0, 1000, size=64, dtype=np.int32) for seed in range(3)]

prompts = st.builds(
    lambda base, n, tail: np.concatenate([BASES[base][:n], np.asarray(tail, dtype=np.int32)]).astype(np.int32),
    st.integers(0, len(BASES) - 1),
    st.integers(0, 48),
    st.lists(st.integers(0, 999), max_size=6),
)
request_ids = st.sampled_from([f"r{i}" for i in range(5)])
# The engine's own block hashes (36 bytes, as vLLM's), from a small alphabet so that prompts share them.
engine_keys = st.lists(st.integers(0, 11).map(lambda i: bytes([i]) * 36), max_size=8, unique=True)


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
        policy=st.sampled_from(kvtier.EVICTION_POLICIES),
        event_buffer=st.sampled_from([0, 2, 1000]),
    )
    def setup(self, page_slots, state_slots, keep, min_hit, lookback, slack, policy, event_buffer):
        kw = dict(
            state_slots=state_slots,
            block_size=BLOCK,
            keep_tokens=keep,
            min_hit_tokens=min_hit,
            state_lookback_blocks=lookback,
            ring_slack=slack,
            eviction_policy=policy,
            event_buffer=event_buffer,
        )
        config = kvtier.IndexConfig(page_slots, **kw)
        self.rust = kvtier.Index(config)
        self.model = PyIndex(
            config,
            chain_fn=lambda rid, ns, toks: self.rust.chain(rid, np.asarray(toks, np.int32)),
        )
        self.n_pages, self.n_states = page_slots, state_slots
        self.pending: list[int] = []
        self.prompts: dict[str, np.ndarray] = {}
        self.before = snapshot(self.rust, page_slots, state_slots)

    def _grown(self, rid: str, prompt: np.ndarray) -> np.ndarray:
        """The request's prompt grown by a few tokens (the engine contract), or a new request's prompt."""
        old = self.prompts.get(rid)
        grown = prompt if old is None else np.concatenate([old, prompt[: len(prompt) % 9]]).astype(np.int32)
        self.prompts[rid] = grown
        return grown

    def _step_evictions(self, discarded: set[tuple[str, int]] = frozenset()) -> None:
        """Every entry that left the pools since the last step was evictable (or discarded by an abort)."""
        after = snapshot(self.rust, self.n_pages, self.n_states)
        for where, (key, refs, ready) in self.before.items():
            if after.get(where, (None,))[0] != key and where not in discarded:
                assert refs == 0 and ready, f"{where} key {key:x} left the pool with refs={refs} ready={ready}"
        self.before = after

    @rule(rid=request_ids, prompt=prompts, extra=st.integers(0, 8))
    def store(self, rid, prompt, extra):
        prompt = self._grown(rid, prompt)
        seq_len = len(prompt) + extra
        p = self.rust.plan_store(rid, prompt, seq_len=seq_len)
        m = self.model.plan_store(rid, prompt.tolist(), seq_len)
        got = (p.ticket, p.page_indices.tolist(), p.page_slots.tolist(), p.state_boundaries, p.state_slots.tolist())
        assert got == m
        self.pending.append(p.ticket)
        self._step_evictions()

    @rule(rid=request_ids, prompt=prompts, load=st.booleans())
    def lookup(self, rid, prompt, load):
        prompt = self._grown(rid, prompt)
        got = self.rust.lookup(rid, prompt.tolist() if load else prompt, verify=load)
        assert (got.hit_tokens, got.ready_pages, got.limit_pages) == self.model.lookup(rid, prompt.tolist())
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
        self.prompts.pop(rid, None)

    @rule(rid=request_ids, prompt=prompts)
    def reuse(self, rid, prompt):
        """A known id with an unrelated prompt: refused unless it extends every token hashed."""
        old = self.prompts.get(rid)
        hashed = 0 if old is None else len(old) // BLOCK * BLOCK
        refused = hashed > 0 and (len(prompt) < hashed or not np.array_equal(prompt[:hashed], old[:hashed]))
        if refused:
            keys = self.rust.keys(rid)
            with pytest.raises(kvtier.PromptMismatchError):
                self.rust.chain(rid, prompt)
            assert self.rust.keys(rid) == keys
        else:
            self.model.chain(rid, prompt.tolist())
            self.prompts[rid] = prompt

    @rule(keys=engine_keys, load=st.booleans())
    def engine_keyed(self, keys, load):
        """A half of the engine that sees only its own block hashes: a lookup, then a load of the hit or a store."""
        got = self.rust.lookup_keys(keys)
        assert got == self.model.lookup_keys(keys)
        assert [self.rust.key_state(k) for k in keys] == [self.model.key_state(k) for k in keys]
        hits = got[0]
        if load and hits:
            ticket, slots = self.rust.load_keys(keys[:hits])
            assert (ticket, slots.tolist()) == self.model.load_keys(keys[:hits])
            for slot in slots:
                assert self.rust.page_entry(slot)[2], "a loaded page is ready"
            self.pending.append(ticket)
        elif not load:
            plan = self.rust.store_keys(keys)
            want = self.model.store_keys(keys)
            assert (plan and (*plan[:2], plan[2].tolist(), plan[3])) == want
            if plan is not None:
                self.pending.append(plan[0])
        self._step_evictions()

    @rule(keys=engine_keys, ok=st.booleans())
    def engine_keys_reported(self, keys, ok):
        """The engine reports copies of its keys done (or failed); the stores owed nothing more are settled."""
        matched, due = self.rust.complete_keys(keys, ok)
        assert (matched, due) == self.model.complete_keys(keys, ok)
        discarded = set()
        for ticket, failed in due:
            self.pending.remove(ticket)
            if failed:
                discarded |= {where for where, (_, refs, ready) in self.before.items() if refs >= 1 and not ready}
                self.rust.abort(ticket)
                self.model.abort(ticket)
            else:
                self.rust.complete(ticket)
                self.model.complete(ticket)
        self._step_evictions(discarded)

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
        for rust, model in ((self.rust.page_policy(), self.model.pages), (self.rust.state_policy(), self.model.states)):
            assert rust.probation == list(model.lists[0])
            assert rust.protected == list(model.lists[1])
            assert rust.probation_ghosts == list(model.ghosts[0])
            assert rust.protected_ghosts == list(model.ghosts[1])
            assert rust.target == model.target
        assert self.rust.page_lru() == self.model.pages.lru_order()
        assert self.rust.state_lru() == self.model.states.lru_order()
        got = [(e.seq, e.removed, e.medium, e.keys) for e in self.rust.take_events()]
        assert got == [(seq, removed, "CPU", keys) for seq, removed, keys in self.model.take_events()]
        assert stats["events_dropped"] == self.model.events_dropped


TestIndexMachine = IndexMachine.TestCase


def test_adaptive_agrees_with_the_model_on_a_long_workload():
    """A seeded workload long enough for keys to come back from both ghost lists: the target moves both ways, and
    the Rust index and the model agree on every list, ghost and event all along."""
    config = kvtier.IndexConfig(12, block_size=BLOCK, min_hit_tokens=0, eviction_policy="adaptive", event_buffer=64)
    rust = kvtier.Index(config)
    model = PyIndex(config, chain_fn=lambda rid, ns, toks: rust.chain(rid, np.asarray(toks, np.int32)))
    rng = np.random.default_rng(7)
    targets = set()
    for i in range(400):
        base, n = int(rng.integers(len(BASES))), int(rng.integers(4, 64))
        prompt = BASES[base][:n] if rng.random() < 0.7 else rng.integers(0, 1000, size=n, dtype=np.int32)
        rid = f"q{i}"
        hit = rust.lookup(rid, prompt).hit_tokens
        assert hit == model.lookup(rid, prompt.tolist())[0]
        if hit:
            rust.complete(rust.begin_load(rid, hit).ticket)
            model.complete(model.begin_load(rid, hit)[0])
        rust.complete(rust.plan_store(rid, prompt).ticket)
        model.complete(model.plan_store(rid, prompt.tolist())[0])
        rust.forget(rid)
        model.forget(rid)
        got = rust.page_policy()
        assert (got.probation, got.protected, got.probation_ghosts, got.protected_ghosts, got.target) == (
            list(model.pages.lists[0]),
            list(model.pages.lists[1]),
            list(model.pages.ghosts[0]),
            list(model.pages.ghosts[1]),
            model.pages.target,
        )
        events = [(e.seq, e.removed, e.keys) for e in rust.take_events()]
        assert events == model.take_events()
        targets.add(got.target)
    assert min(targets) < 12 * 8 < max(targets), "keys came back from both ghost lists"


def test_lookup_counts_a_retried_request_once():
    ix = kvtier.Index(kvtier.IndexConfig(16, block_size=4, min_hit_tokens=0))
    t = np.arange(40, dtype=np.int32)
    ix.complete(ix.plan_store("a", t).ticket)
    for _ in range(3):
        assert ix.lookup("b", t).hit_tokens == 36
        ix.defer("b")
    s = ix.stats()
    assert (s["lookups"], s["deferred"], s["lookup_tokens"]) == (1, 3, 40)


def test_first_pages_are_evicted_last():
    ix = kvtier.Index(kvtier.IndexConfig(8, block_size=4, min_hit_tokens=0))
    t = np.arange(32, dtype=np.int32)
    ix.complete(ix.plan_store("a", t).ticket)
    keys = ix.keys("a")
    assert ix.page_lru() == keys[::-1], "deepest page least recent"
    ix.complete(ix.plan_store("b", np.arange(100, 104, dtype=np.int32)).ticket)
    assert ix.page_slot(keys[-1]) is None and ix.page_slot(keys[0]) is not None


def test_states_snap_the_hit_to_a_boundary():
    ix = kvtier.Index(
        kvtier.IndexConfig(16, state_slots=4, block_size=4, min_hit_tokens=0, state_lookback_blocks=2, ring_slack=4)
    )
    t = np.arange(40, dtype=np.int32)  # 10 blocks; states at boundaries 40 and 36 (ring: b >= 40 - 4)
    p = ix.plan_store("a", t)
    assert p.state_boundaries == [40, 36]
    ix.complete(p.ticket)
    assert ix.lookup("b", np.arange(45, dtype=np.int32)).hit_tokens == 40
    assert ix.lookup("c", t).hit_tokens == 36  # keep_tokens=1 caps at 9 blocks: the state at 36
    assert ix.lookup("d", t[:35]).hit_tokens == 0  # 8 blocks ready, no state at or below 32


@given(st.lists(st.integers(0, 2**31 - 1), min_size=8, max_size=200), st.sampled_from(["blake3", "xxh3"]))
def test_chain_extension_equals_a_fresh_chain(tokens, kind):
    ix = kvtier.Index(kvtier.IndexConfig(4, block_size=4, hash_kind=kind))
    arr = np.asarray(tokens, dtype=np.int32)
    for cut in range(0, len(arr) + 1, 7):
        ix.chain("grow", arr[:cut] if cut % 2 else tokens[:cut])
    fresh = ix.chain("fresh", arr)
    assert ix.chain("grow", arr) == fresh
    other = arr.copy()
    other[1] ^= 1
    with pytest.raises(kvtier.PromptMismatchError, match=r"token 1 \(in its block at tokens 0\.\.4\)"):
        ix.chain("grow", other)
    assert ix.forget("grow")
    changed = ix.chain("grow", other)
    assert all(a != b for a, b in zip(changed, fresh, strict=True))


# The rules, on both the Rust index and the plain-Python model: the minimal traces.


class Rules:
    """The Rust index or the Python model behind one interface: store (and complete), lookup, state keys."""

    def __init__(self, impl: str, page_slots: int, **kw: int) -> None:
        self.rust = kvtier.Index(kvtier.IndexConfig(page_slots, **kw))
        self.model = PyIndex(kvtier.IndexConfig(page_slots, **kw)) if impl == "python" else None
        self.block = kw.get("block_size", 16)

    def store(self, rid: str, tokens: list[int]) -> tuple[list[int], list[int]]:
        if self.model is not None:
            ticket, pages, _, boundaries, _ = self.model.plan_store(rid, tokens)
            self.model.complete(ticket)
            return pages, boundaries
        p = self.rust.plan_store(rid, tokens)
        self.rust.complete(p.ticket)
        self.rust.check()
        return p.page_indices.tolist(), p.state_boundaries

    def lookup(self, rid: str, tokens: list[int]) -> int:
        if self.model is not None:
            return self.model.lookup(rid, tokens)[0]
        return self.rust.lookup(rid, tokens).hit_tokens

    def stat(self, name: str) -> int:
        return self.model.stats[name] if self.model is not None else self.rust.stats()[name]

    def pages_used(self) -> int:
        return len(self.model.pages.entries) if self.model is not None else self.rust.stats()["pages_used"]


both = pytest.mark.parametrize("impl", ["rust", "python"])


@both
def test_no_state_below_min_hit_tokens(impl):
    """Bug 1: a store of 8 tokens with min_hit 8 (bs 4) planned states at [8, 4]."""
    ix = Rules(impl, 8, state_slots=4, block_size=4, min_hit_tokens=8, ring_slack=100)
    assert ix.store("a", list(range(8)))[1] == [8]


@both
@pytest.mark.parametrize(("lookback", "want"), [(0, []), (1, [24]), (2, [24, 20])])
def test_lookback_k_means_k_boundaries(impl, lookback, want):
    """Bug 2: with lookback 1 a 24-token store planned states [24, 20]; with lookback 0 it still stored one."""
    ix = Rules(impl, 8, state_slots=4, block_size=4, min_hit_tokens=0, state_lookback_blocks=lookback, ring_slack=100)
    assert ix.store("a", list(range(24)))[1] == want


@both
def test_a_store_never_evicts_its_own_present_state(impl):
    """Bug 3: bs 16, 2 state slots, lookback 2: store 64 tokens, then the same 64 + 16. Both end with states
    {80, 64}: 3 states stored, not 4 (the second store kept 64 and evicted 48)."""
    ix = Rules(impl, 16, state_slots=2, block_size=16, state_lookback_blocks=2, ring_slack=100)
    assert ix.store("a", list(range(64)))[1] == [64, 48]
    assert ix.store("a", list(range(80)))[1] == [80]
    assert ix.stat("states_stored") == 3
    assert ix.lookup("b", list(range(81))) == 80
    assert ix.lookup("c", list(range(65))) == 64


@both
def test_a_prompt_below_min_hit_stores_nothing(impl):
    """Behaviour 4: a 5-token prompt (bs 4, min_hit 8) stored page 0."""
    ix = Rules(impl, 8, block_size=4, min_hit_tokens=8)
    assert ix.store("a", list(range(5))) == ([], [])
    assert (ix.pages_used(), ix.stat("stores"), ix.stat("store_skipped")) == (0, 0, 0)


@both
def test_a_partial_run_is_stored_only_up_to_a_stored_state(impl):
    """Behaviour 5: a 40-token prompt the pool could not take flushed a 12-token prompt's pages for a run ending at
    no state, turning the short prompt's next turn from a 12-token hit into a miss."""
    kw = dict(block_size=4, min_hit_tokens=4, state_lookback_blocks=2, ring_slack=100)
    ix = Rules(impl, 4, state_slots=2, **kw)
    ix.store("short", list(range(12)))
    assert ix.store("long", list(range(100, 140))) == ([], [])
    assert ix.lookup("short", list(range(16))) == 12
    # A partial run that ends at a stored state is kept up to it; without states the first pages that fit are.
    ix = Rules(impl, 5, state_slots=2, **{**kw, "state_lookback_blocks": 6})
    assert ix.store("a", list(range(24))) == ([0, 1, 2, 3, 4], [20, 16])
    ix = Rules(impl, 5, **kw)
    assert ix.store("a", list(range(24)))[0] == [0, 1, 2, 3, 4]


@both
def test_a_prompts_first_pages_are_evicted_last(impl):
    """Deliberate: pages re-enter the LRU deepest first, and a store holds its present pages."""
    ix = Rules(impl, 6, block_size=4, min_hit_tokens=0)
    ix.store("a", list(range(16)))  # pages 0-3
    ix.store("b", list(range(100, 108)))  # 2 more: full
    ix.store("a", list(range(24)))  # 2 missing: evicts b's pages, never a's own 0-3
    assert ix.lookup("x", list(range(25))) == 24


# Token ids as engines hold them.


def test_every_token_container_gives_the_same_keys():
    ids = np.random.default_rng(1).integers(0, 2**31 - 1, size=100, dtype=np.int64)
    ix = kvtier.Index(kvtier.IndexConfig(4, block_size=16))
    want = ix.chain("ref", ids.astype(np.int32))
    for i, t in enumerate(
        [
            ids.tolist(),
            tuple(ids.tolist()),
            ids,
            ids.astype(np.uint32),
            array.array("i", ids.tolist()),
            array.array("l", ids.tolist()),
            array.array("q", ids.tolist()),
            torch.from_numpy(ids),
            torch.from_numpy(ids.astype(np.int32)),
            [np.int64(x) for x in ids],
        ]
    ):
        assert ix.chain(f"r{i}", t) == want, type(t)
    small = np.arange(64, dtype=np.uint16)
    assert ix.chain("u16", small) == ix.chain("i32", small.astype(np.int32))


@pytest.mark.parametrize(
    ("ids", "error", "match"),
    [
        ([1, 2, -3] + [0] * 16, ValueError, r"token_ids\[2\] = -3"),
        ([0] * 17 + [2**31], ValueError, r"token_ids\[17\] = 2147483648"),
        ([0] * 5 + [2**70], ValueError, r"token_ids\[5\]"),
        (np.array([0, 5, 2**31], dtype=np.int64), ValueError, r"token_ids\[2\] = 2147483648"),
        (np.array([0, -1], dtype=np.int32).repeat(16), ValueError, r"token_ids\[16\] = -1"),
        ([0, 1.5], TypeError, r"token_ids\[1\] must be an int, got float"),
        (np.zeros((2, 16), np.int32), ValueError, "1-D"),
        (np.zeros(16, np.float32), TypeError, "dtype float32"),
        (np.zeros(16, np.bool_), TypeError, "dtype bool"),
        (np.zeros(32, np.int32)[::2], ValueError, "contiguous"),
        ("abcd", TypeError, "str"),
        (None, TypeError, "NoneType"),
    ],
)
def test_bad_token_ids_are_named(ids, error, match):
    ix = kvtier.Index(kvtier.IndexConfig(4, block_size=16))
    with pytest.raises(error, match=match):
        ix.lookup("r", ids)
    assert not ix.forget("r"), "a refused call leaves no request behind"


def test_an_answering_lookup_reads_only_the_ends_and_the_new_tokens():
    """A lookup that only answers does not read the hashed tokens between the first and last hashed blocks: a bad
    id planted among them goes unseen there, one after them is named; a verified lookup, a chain or a store reads
    and compares every token."""
    ix = kvtier.Index(kvtier.IndexConfig(64, block_size=4, min_hit_tokens=0))
    ids = list(range(100))
    ix.complete(ix.plan_store("r", ids).ticket)
    ids[50] = -7  # inside the hashed prompt, not in its first or last block
    assert ix.lookup("r", ids + [1, 2, 3, 4]).limit_pages == 25
    with pytest.raises(ValueError, match=r"token_ids\[105\] = -1"):
        ix.lookup("r", ids + [1, 2, 3, 4, 5, -1, 7, 8])
    for call in (
        lambda: ix.lookup("r", ids + [1, 2, 3, 4], verify=True),
        lambda: ix.verify("r", ids),
        lambda: ix.chain("r", ids),
        lambda: ix.plan_store("r", ids),
    ):
        with pytest.raises(ValueError, match=r"token_ids\[50\] = -7"):
            call()


@pytest.mark.parametrize("as_array", [False, True])
def test_every_token_is_compared_before_a_hit_is_served_or_a_prompt_stored(as_array):
    """A request id reused for a prompt that differs only inside the hashed run: the answer may be stale, but a
    verified lookup (what resume does before it loads), a store and a chain refuse it; nothing changes."""
    ix = kvtier.Index(kvtier.IndexConfig(64, block_size=4, min_hit_tokens=0))
    p1 = np.arange(24, dtype=np.int32)
    ix.complete(ix.plan_store("innocent", p1).ticket)
    ix.lookup("r", p1 if as_array else p1.tolist())
    p2 = p1.copy()
    p2[9] += 1000  # block 2 of 6: neither the first nor the last hashed block
    p2 = p2 if as_array else p2.tolist()
    assert ix.lookup("r", p2).hit_tokens == 20, "an answer only"
    before = (ix.stats()["pages_used"], ix.stats()["in_flight"])
    for call in (
        lambda: ix.lookup("r", p2, verify=True),
        lambda: ix.plan_store("r", p2),
        lambda: ix.chain("r", p2),
        lambda: ix.verify("r", p2),
    ):
        with pytest.raises(kvtier.PromptMismatchError, match=r"token 9 \(in its block at tokens 8\.\.12\)"):
            call()
    assert (ix.stats()["pages_used"], ix.stats()["in_flight"]) == before
    assert ix.stats()["prompt_mismatches"] == 4
    assert ix.lookup("innocent", p1, verify=True).hit_tokens == 20, "the innocent prefix is untouched"


def test_a_reused_request_id_is_refused_until_forgotten():
    ix = kvtier.Index(kvtier.IndexConfig(64, block_size=4))
    ix.lookup("r", list(range(40)))
    for other, why in [
        (list(range(36)), "fewer than the 40"),
        (list(range(1, 41)), r"token 0 \(in its block at tokens 0\.\.4\)"),
        (list(range(36)) + [0, 0, 0, 0], r"token 36 \(in its block at tokens 36\.\.40\)"),
    ]:
        with pytest.raises(kvtier.PromptMismatchError, match=why) as e:
            ix.lookup("r", other)
        assert isinstance(e.value, ValueError) and "'r'" not in str(e.value) and '"r"' in str(e.value)
    with pytest.raises(kvtier.PromptMismatchError, match="namespace"):
        ix.lookup("r", list(range(40)), namespace="tenant")
    assert ix.forget("r")
    assert ix.lookup("r", list(range(1, 41))).limit_pages == 9


def test_huge_pools_allocate_only_what_they_use():
    ix = kvtier.Index(kvtier.IndexConfig(2_000_000_000, state_slots=2_000_000_000, block_size=4, min_hit_tokens=0))
    ix.complete(ix.plan_store("a", list(range(16))).ticket)
    assert ix.stats()["pages_used"] == 4 and ix.stats()["states_used"] == 1
    # Pages stored by engine key keep their keys' bytes a slot used, not a slot of the pool.
    ix.complete(ix.store_keys([b"k1", b"k2"])[0])
    assert ix.stats()["pages_used"] == 6 and ix.key_state(b"k2") == 2
    ix.check()
