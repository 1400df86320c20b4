"""The paged KV core in C++: gather/scatter over paged storage, and a hypothesis
state machine that checks the page pool's invariants over thousands of random
operations against a numpy simulation of the K/V storage.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_infer._fast import PagePool, gather_pages, scatter_slots

from paged_helpers import BASES, NUM_PAGES, PAGE_SIZE, make, machine_settings


# -- storage index math ---------------------------------------------------------


def test_gather_pages_matches_numpy():
    rng = np.random.default_rng(0)
    storage = rng.standard_normal((6, 2, 4, 3)).astype(np.float32)  # (pages, H, P, D)
    table = np.array([3, 1, 5, 0], dtype=np.int32)
    for length in (0, 1, 4, 10, 12):
        got = gather_pages(mx.array(storage), mx.array(table), length=length)
        flat = np.concatenate([storage[p] for p in table], axis=1)  # (H, 16, D)
        np.testing.assert_array_equal(np.array(got), flat[:, :length])
        assert got.shape == (2, length, 3)


def test_scatter_slots_matches_numpy_and_leaves_the_input_alone():
    rng = np.random.default_rng(1)
    storage = rng.standard_normal((6, 2, 4, 3)).astype(np.float32)
    slots = np.array([5, 22, 4, 13, 0], dtype=np.int32)
    values = rng.standard_normal((2, 5, 3)).astype(np.float32)  # (H, T, D)
    before = mx.array(storage)
    out = scatter_slots(before, mx.array(slots), mx.array(values))
    want = storage.copy()
    for t, slot in enumerate(slots):
        want[slot // 4, :, slot % 4] = values[:, t]
    np.testing.assert_array_equal(np.array(out), want)
    np.testing.assert_array_equal(np.array(before), storage)
    empty = scatter_slots(before, mx.zeros((0,), mx.int32), mx.zeros((2, 0, 3)))
    np.testing.assert_array_equal(np.array(empty), storage)
    bf16 = scatter_slots(before.astype(mx.bfloat16), mx.array(slots), mx.array(values))
    assert bf16.dtype == mx.bfloat16


def test_pool_slots_scatter_then_gather_round_trip():
    pool = make(num_pages=8, page_size=4)
    storage = mx.zeros((8, 2, 4, 3))
    pool.add_sequence(1)
    written = []
    for n in (3, 5, 1, 6):
        r = pool.append(1, n)
        vals = mx.random.normal((2, n, 3))
        storage = scatter_slots(storage, mx.array(r.slots), vals)
        written.append(vals)
    got = gather_pages(storage, mx.array(pool.block_table(1)), length=pool.length(1))
    np.testing.assert_array_equal(np.array(got), np.array(mx.concatenate(written, axis=1)))


def test_storage_ops_reject_bad_shapes():
    storage = mx.zeros((6, 2, 4, 3))
    with pytest.raises(ValueError, match=r"\[gather_pages\] storage must be"):
        gather_pages(mx.zeros((6, 4, 3)), mx.array([1]), length=1)
    with pytest.raises(ValueError, match="needs 3 pages"):
        gather_pages(storage, mx.array([1, 2]), length=9)
    with pytest.raises(ValueError, match="1-D integer"):
        gather_pages(storage, mx.array([1.0]), length=1)
    with pytest.raises(ValueError, match="length must be >= 0"):
        gather_pages(storage, mx.array([1]), length=-1)
    with pytest.raises(ValueError, match=r"values must be \(kv_heads, T, head_dim\)"):
        scatter_slots(storage, mx.array([1, 2]), mx.zeros((2, 3, 3)))
    with pytest.raises(ValueError, match="1-D integer"):
        scatter_slots(storage, mx.array([[1]]), mx.zeros((2, 1, 3)))


# -- property test ---------------------------------------------------------------
# (NUM_PAGES, PAGE_SIZE, BASES: paged_helpers.py, shared with test_paged_groups.py's GroupsMachine)


class PoolMachine(RuleBasedStateMachine):
    """Random pool operations against a model of each sequence's tokens.

    Storage is simulated as one numpy token id per flat slot: every append
    performs the returned copies, then writes the new token ids at the
    returned slots, exactly as the K/V adapter will.
    """

    #: Pages handed out at first (``None``: all); a subclass starts small and grows.
    MATERIALIZED: int | None = None

    def __init__(self):
        super().__init__()
        self.pool = PagePool(num_pages=NUM_PAGES, page_size=PAGE_SIZE, materialized=self.MATERIALIZED)
        self.storage = np.full(NUM_PAGES * PAGE_SIZE, -1, dtype=np.int64)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def _snapshot(self):
        return (
            {s: (self.pool.block_table(s), self.pool.length(s)) for s in self.tokens},
            self.pool.num_free_pages(),
            self.pool.cached_pages(),
        )

    ids = st.integers(min_value=0, max_value=10**6)

    def _pick(self, i):
        keys = sorted(self.tokens)
        return keys[i % len(keys)]

    def _write(self, seq, r, new_tokens):
        for src, dst in r.copies:
            a, b = src * PAGE_SIZE, dst * PAGE_SIZE
            self.storage[b : b + PAGE_SIZE] = self.storage[a : a + PAGE_SIZE]
        assert len(r.slots) == len(new_tokens)
        for slot, tok in zip(r.slots, new_tokens):
            assert slot // PAGE_SIZE != 0, "wrote into the null page"
            self.storage[slot] = tok
        self.tokens[seq].extend(new_tokens)

    @rule(base=st.sampled_from(BASES), extra=st.lists(st.integers(0, 9), max_size=4),
          prefixed=st.booleans(), ns=st.sampled_from(["", "x"]), index=st.booleans())
    def add(self, base, extra, prefixed, ns, index):
        seq = self._new_id()
        prompt = base + extra
        if prefixed:
            n = self.pool.add_sequence_with_prefix(seq, prompt, namespace=ns)
            assert n % PAGE_SIZE == 0 and n < max(len(prompt), 1) or n == 0
            self.tokens[seq] = prompt[:n]
            rest = prompt[n:]
        else:
            self.pool.add_sequence(seq, namespace=ns)
            self.tokens[seq] = []
            rest = prompt
        before = self._snapshot()
        r = self.pool.append(seq, len(rest))
        if r is None:
            assert self._snapshot() == before
        else:
            self._write(seq, r, rest)
            if index:
                self.pool.register_full_pages(seq, self.tokens[seq])

    @precondition(lambda self: self.tokens)
    @rule(i=ids, new=st.lists(st.integers(0, 9), min_size=0, max_size=7))
    def append(self, i, new):
        seq = self._pick(i)
        before = self._snapshot()
        r = self.pool.append(seq, len(new))
        if r is None:
            length = self.pool.length(seq)
            need = -(-(length + len(new)) // PAGE_SIZE) - len(self.pool.block_table(seq))
            table = self.pool.block_table(seq)
            if length % PAGE_SIZE and self.pool.refcount(table[-1]) > 1:
                need += 1
            assert need > self.pool.num_free_pages()
            assert self._snapshot() == before
        else:
            self._write(seq, r, new)

    @precondition(lambda self: self.tokens)
    @rule(i=ids)
    def fork(self, i):
        src = self._pick(i)
        dst = self._new_id()
        self.pool.fork(src, dst)
        self.tokens[dst] = list(self.tokens[src])

    @precondition(lambda self: self.tokens)
    @rule(i=ids, a=st.lists(st.integers(0, 9), min_size=1, max_size=3),
          b=st.lists(st.integers(0, 9), min_size=1, max_size=3))
    def fork_and_diverge(self, i, a, b):
        # The copy-on-write path: both sides write after sharing a page.
        src = self._pick(i)
        self.fork(i)
        dst = self.next_id
        for seq, new in ((dst, a), (src, b)):
            r = self.pool.append(seq, len(new))
            if r is not None:
                self._write(seq, r, new)

    @precondition(lambda self: self.tokens)
    @rule(i=ids, frac=st.floats(0, 1))
    def truncate(self, i, frac):
        seq = self._pick(i)
        n = int(len(self.tokens[seq]) * frac)
        new_len = len(self.tokens[seq]) - n
        table = self.pool.block_table(seq)
        if new_len > 0 and table[(new_len - 1) // PAGE_SIZE] == 0:
            with pytest.raises(ValueError):
                self.pool.truncate(seq, n)
            return
        self.pool.truncate(seq, n)
        del self.tokens[seq][new_len:]

    @precondition(lambda self: self.tokens)
    @rule(i=ids)
    def free(self, i):
        seq = self._pick(i)
        self.pool.free(seq)
        del self.tokens[seq]

    @precondition(lambda self: self.tokens)
    @rule(i=ids, window=st.integers(1, 8))
    def window(self, i, window):
        seq = self._pick(i)
        self.pool.release_outside_window(seq, window)
        length = len(self.tokens[seq])
        table = self.pool.block_table(seq)
        for p, page in enumerate(table):
            if (p + 1) * PAGE_SIZE <= length - window:
                assert page == 0

    @precondition(lambda self: self.tokens)
    @rule(i=ids)
    def register(self, i):
        seq = self._pick(i)
        self.pool.register_full_pages(seq, self.tokens[seq])

    @rule(cap=st.sampled_from([0, 2, 5, NUM_PAGES]))
    def cap(self, cap):
        self.pool.set_cache_cap(cap)

    @invariant()
    def pool_is_consistent(self):
        pool = self.pool
        pool.check()
        total = pool.materialized - 1
        used = pool.num_used_pages()
        cached = pool.num_cached_pages()
        free_uncached = pool.num_free_pages() - cached
        assert free_uncached >= 0 and free_uncached + used + cached == total
        refs = np.zeros(NUM_PAGES, dtype=np.int64)
        for seq in self.tokens:
            table = pool.block_table(seq)
            live = [p for p in table if p != 0]
            assert len(set(live)) == len(live) and all(p < pool.materialized for p in live)
            refs[live] += 1
        assert [pool.refcount(p) for p in range(NUM_PAGES)] == refs.tolist()
        assert all(pool.page_hash(p) is not None for p in pool.cached_pages())
        assert set(pool.cached_pages()).isdisjoint(np.flatnonzero(refs).tolist())

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self):
        for seq, toks in self.tokens.items():
            assert self.pool.length(seq) == len(toks)
            table = self.pool.block_table(seq)
            assert len(table) == -(-len(toks) // PAGE_SIZE)
            for pos, tok in enumerate(toks):
                page = table[pos // PAGE_SIZE]
                if page != 0:  # window-released positions are gone by design
                    assert self.storage[page * PAGE_SIZE + pos % PAGE_SIZE] == tok, (seq, pos)

    @invariant()
    def cached_prefixes_hold_their_tokens(self):
        # Whatever the index serves must be what the storage holds.
        for base in BASES:
            for ns in ("", "x"):
                pages = self.pool.match_prefix(base, namespace=ns)
                for k, page in enumerate(pages):
                    got = self.storage[page * PAGE_SIZE : (page + 1) * PAGE_SIZE].tolist()
                    assert got == base[k * PAGE_SIZE : (k + 1) * PAGE_SIZE]


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = machine_settings(400)


class GrowingPoolMachine(PoolMachine):
    """The same operations on a pool that starts with 2 of its pages materialized and grows
    (state/paged/growth.py): ids below ``materialized`` only, written pages untouched by a growth."""

    MATERIALIZED = 2

    @rule(extra=st.integers(0, 6))
    def grow(self, extra):
        before = self._snapshot()
        old = self.pool.materialized
        to = min(NUM_PAGES, old + extra)
        assert self.pool.grow(to) == to - old
        tables, free, cached = before
        assert self._snapshot() == (tables, free + to - old, cached)  # ids and tables unchanged
        assert self.pool.num_unmaterialized_pages() == NUM_PAGES - to


TestGrowingPoolMachine = GrowingPoolMachine.TestCase
TestGrowingPoolMachine.settings = machine_settings(150)
