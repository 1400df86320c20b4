"""The paged KV core in C++: page pool, block tables, copy-on-write, sliding
windows, the prefix index, and gather/scatter over paged storage.

No model: allocator tests assert exact page ids, refcounts and eviction order;
a hypothesis state machine checks the invariants over thousands of random
operations against a numpy simulation of the K/V storage.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_infer._fast import AppendResult, PageGroups, PagePool, gather_pages, scatter_slots


def make(num_pages=6, page_size=4):
    return PagePool(num_pages=num_pages, page_size=page_size)


# -- allocation ---------------------------------------------------------------


def test_append_hands_out_pages_in_order_and_never_the_null_page():
    pool = make(num_pages=6, page_size=4)
    assert pool.num_free_pages() == 5 and pool.num_used_pages() == 0
    pool.add_sequence(1)
    r = pool.append(1, 5)
    assert isinstance(r, AppendResult)
    assert r.slots == [4, 5, 6, 7, 8] and r.copies == []
    assert r.writes == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0)]
    assert pool.block_table(1) == [1, 2] and pool.length(1) == 5
    assert [pool.refcount(p) for p in range(6)] == [0, 1, 1, 0, 0, 0]
    # The partial last page is filled before a new one is taken.
    assert pool.append(1, 3).slots == [9, 10, 11]
    assert pool.block_table(1) == [1, 2]
    assert pool.append(1, 0).slots == []
    pool.add_sequence(2)
    assert pool.append(2, 12).slots == list(range(12, 24))
    assert pool.block_table(2) == [3, 4, 5]
    assert pool.num_free_pages() == 0 and pool.num_used_pages() == 5
    assert 0 not in pool.block_table(1) + pool.block_table(2)
    pool.check()


def test_out_of_pages_is_none_and_changes_nothing():
    pool = make(num_pages=4, page_size=4)
    pool.add_sequence(1)
    assert pool.append(1, 6) is not None
    before = (pool.block_table(1), pool.length(1), pool.num_free_pages())
    assert pool.append(1, 7) is None  # needs 2 more pages, 1 left
    assert pool.append(1, 1 << 40) is None  # absurd sizes are also just "no"
    assert (pool.block_table(1), pool.length(1), pool.num_free_pages()) == before
    assert pool.append(1, 6).slots == [10, 11, 12, 13, 14, 15]  # exactly fits
    assert pool.num_free_pages() == 0
    assert pool.append(1, 1) is None
    pool.check()


def test_free_returns_pages_to_the_back_of_the_free_queue():
    pool = make(num_pages=6, page_size=4)
    pool.add_sequence(1)
    pool.append(1, 8)  # pages 1, 2
    pool.free(1)
    assert not pool.has_sequence(1)
    assert pool.refcount(1) == pool.refcount(2) == 0
    pool.add_sequence(2)
    # FIFO: pages 3, 4, 5 were queued before the freed 2, 1.
    pool.append(2, 20)
    assert pool.block_table(2) == [3, 4, 5, 2, 1]
    pool.check()


def test_fork_shares_pages_and_copy_on_write_copies_the_partial_last_page():
    pool = make(num_pages=8, page_size=4)
    pool.add_sequence(1)
    pool.append(1, 6)  # [1, 2], page 2 holds 2 of 4
    pool.fork(1, 2)
    assert pool.block_table(2) == [1, 2] and pool.length(2) == 6
    assert pool.refcount(1) == pool.refcount(2) == 2
    r = pool.append(2, 3)
    assert r.copies == [(2, 3)]  # copy page 2 -> 3 first, then write
    assert r.slots == [3 * 4 + 2, 3 * 4 + 3, 4 * 4 + 0]
    assert pool.block_table(2) == [1, 3, 4]
    assert pool.block_table(1) == [1, 2]
    assert [pool.refcount(p) for p in range(1, 5)] == [2, 1, 1, 1]
    # Seq 1 is now the only owner of page 2 and writes in place.
    r = pool.append(1, 1)
    assert r.copies == [] and r.slots == [2 * 4 + 2]
    pool.check()


def test_fork_at_a_page_boundary_needs_no_copy():
    pool = make(num_pages=8, page_size=4)
    pool.add_sequence(1)
    pool.append(1, 8)
    pool.fork(1, 2)
    r = pool.append(2, 1)
    assert r.copies == [] and r.slots == [12]
    assert pool.block_table(2) == [1, 2, 3]
    pool.check()


def test_copy_on_write_without_a_free_page_is_none():
    pool = make(num_pages=3, page_size=4)
    pool.add_sequence(1)
    pool.append(1, 6)  # uses both pages
    pool.fork(1, 2)
    assert pool.append(2, 1) is None
    assert pool.block_table(2) == [1, 2] and pool.refcount(2) == 2
    pool.free(1)
    assert pool.append(2, 1).copies == []  # sole owner now
    pool.check()


def test_truncate_rolls_back_and_releases_emptied_pages():
    pool = make(num_pages=8, page_size=4)
    pool.add_sequence(1)
    pool.append(1, 10)  # [1, 2, 3]
    pool.truncate(1, 0)
    assert pool.length(1) == 10
    pool.truncate(1, 3)  # length 7: page 3 emptied
    assert pool.block_table(1) == [1, 2] and pool.length(1) == 7
    assert pool.refcount(3) == 0
    assert pool.append(1, 1).slots == [2 * 4 + 3]
    pool.truncate(1, 8)
    assert pool.block_table(1) == [] and pool.length(1) == 0
    assert pool.num_free_pages() == 7
    pool.check()


def test_truncate_of_a_fork_keeps_the_shared_page_for_the_other():
    pool = make(num_pages=8, page_size=4)
    pool.add_sequence(1)
    pool.append(1, 8)
    pool.fork(1, 2)
    pool.truncate(2, 2)  # page 2 now partial for seq 2, full for seq 1
    assert pool.refcount(2) == 2
    r = pool.append(2, 1)
    assert r.copies == [(2, 3)] and r.slots == [3 * 4 + 2]
    assert pool.block_table(1) == [1, 2]
    pool.check()


def test_release_outside_window_nulls_whole_pages_before_the_window():
    # The diagram in page_pool.cpp: page_size 16, length 60, window 20.
    pool = PagePool(num_pages=8, page_size=16)
    pool.add_sequence(1)
    pool.append(1, 60)
    assert pool.block_table(1) == [1, 2, 3, 4]
    assert pool.release_outside_window(1, 20) == 2
    assert pool.block_table(1) == [0, 0, 3, 4]
    assert pool.refcount(1) == pool.refcount(2) == 0 and pool.refcount(0) == 0
    assert pool.release_outside_window(1, 20) == 0  # idempotent
    pool.append(1, 4)  # length 64: tokens 44..63 in window, page 3 still needed
    assert pool.release_outside_window(1, 20) == 0
    pool.append(1, 5)  # length 69: window starts at 49, page 3 (32..47) out
    assert pool.release_outside_window(1, 20) == 1
    assert pool.block_table(1) == [0, 0, 0, 4, 5]
    # A rollback may not end inside a released page.
    with pytest.raises(ValueError, match="released by release_outside_window"):
        pool.truncate(1, 69 - 40)
    pool.truncate(1, 69 - 49)  # length 49: token 48 lives in page 4, fine
    assert pool.block_table(1) == [0, 0, 0, 4]
    pool.free(1)
    assert pool.num_free_pages() == 7
    pool.check()


def test_windowed_sequence_longer_than_the_pool_still_grows():
    # Regression (hypothesis): the "more than the whole pool" guard compared
    # against length + n, but a windowed sequence's length counts tokens on
    # released (null) pages, so it refused appends that fit in free pages.
    pool = PagePool(num_pages=6, page_size=2)  # 10 token slots in all
    pool.add_sequence(1)
    pool.append(1, 8)
    assert pool.release_outside_window(1, 1) == 3  # pages of tokens 0..5
    for _ in range(4):
        assert pool.append(1, 2) is not None
        pool.release_outside_window(1, 1)
    assert pool.length(1) == 16 > 10  # longer than the pool
    assert pool.num_free_pages() == 4
    r = pool.append(1, 7)  # needs 4 pages, 4 free
    assert r is not None and len(r.slots) == 7 and pool.length(1) == 23
    assert pool.append(1, 2) is None  # genuinely out of pages now
    assert pool.append(1, 11) is None  # more than the pool: refused outright
    pool.check()


def test_bad_input_is_a_value_error_with_a_reason():
    with pytest.raises(ValueError, match=r"\[PagePool\] page_size must be a positive power of two"):
        PagePool(num_pages=4, page_size=3)
    with pytest.raises(ValueError, match="power of two"):
        PagePool(num_pages=4, page_size=0)
    with pytest.raises(ValueError, match="power of two"):
        PagePool(num_pages=4, page_size=-8)
    with pytest.raises(ValueError, match="null page"):
        PagePool(num_pages=1, page_size=4)
    with pytest.raises(ValueError, match="int32"):
        PagePool(num_pages=1 << 28, page_size=16)
    pool = make()
    pool.add_sequence(1)
    with pytest.raises(ValueError, match="already exists"):
        pool.add_sequence(1)
    with pytest.raises(ValueError, match="already exists"):
        pool.add_sequence_with_prefix(1, [1, 2, 3])
    for call in (
        lambda: pool.append(9, 1),
        lambda: pool.free(9),
        lambda: pool.truncate(9, 0),
        lambda: pool.fork(9, 10),
        lambda: pool.block_table(9),
        lambda: pool.length(9),
        lambda: pool.release_outside_window(9, 4),
        lambda: pool.register_full_pages(9, []),
    ):
        with pytest.raises(ValueError, match="unknown sequence id 9"):
            call()
    with pytest.raises(ValueError, match="already exists"):
        pool.fork(1, 1)
    with pytest.raises(ValueError, match="n_tokens must be >= 0"):
        pool.append(1, -1)
    pool.append(1, 3)
    with pytest.raises(ValueError, match="cannot drop 4 tokens .* length 3"):
        pool.truncate(1, 4)
    with pytest.raises(ValueError, match="cannot drop"):
        pool.truncate(1, -1)
    with pytest.raises(ValueError, match="window must be positive"):
        pool.release_outside_window(1, 0)
    with pytest.raises(ValueError, match="out of range"):
        pool.refcount(6)
    with pytest.raises(ValueError, match="set_cache_cap"):
        pool.set_cache_cap(-1)
    pool.free(1)
    with pytest.raises(ValueError, match="unknown sequence id 1 .*already freed"):
        pool.free(1)  # no double free
    pool.check()


# -- prefix index -------------------------------------------------------------


def prompt_pool():
    """Seq 1 holds 10 tokens over pages [1, 2, 3]; its 2 full pages are indexed."""
    pool = make(num_pages=8, page_size=4)
    tokens = list(range(100, 110))
    pool.add_sequence(1)
    pool.append(1, 10)
    assert pool.register_full_pages(1, tokens) == 2
    assert pool.register_full_pages(1, tokens) == 0  # idempotent
    return pool, tokens


def test_register_and_match_prefix():
    pool, tokens = prompt_pool()
    assert pool.page_hash(1) is not None and pool.page_hash(2) is not None
    assert pool.page_hash(3) is None  # partial pages are never indexed
    assert pool.match_prefix(tokens) == [1, 2]
    assert pool.match_prefix(tokens[:7]) == [1]
    assert pool.match_prefix(tokens[:8] + [0, 0, 0, 0]) == [1, 2]
    assert pool.match_prefix([100, 101, 102, 0] + tokens[4:]) == []
    assert pool.match_prefix(tokens[:4] + [0] + tokens[5:]) == [1]  # chained
    assert pool.match_prefix(tokens, namespace="other-model") == []
    assert pool.match_prefix([]) == []
    # Pure: nothing counted, nothing referenced.
    assert (pool.hits, pool.misses, pool.refcount(1)) == (0, 0, 1)
    # Hashes are fixed functions of content: equal across pools.
    other, _ = prompt_pool()
    assert other.page_hash(2) == pool.page_hash(2)


def test_namespaces_keep_caches_apart():
    pool = make(num_pages=8, page_size=4)
    tokens = list(range(8))
    pool.add_sequence(1, namespace="a")
    pool.append(1, 8)
    pool.register_full_pages(1, tokens)
    assert pool.match_prefix(tokens + [9], namespace="a") == [1, 2]
    assert pool.match_prefix(tokens + [9]) == []
    assert pool.add_sequence_with_prefix(2, tokens + [9], namespace="b") == 0
    assert pool.add_sequence_with_prefix(3, tokens + [9], namespace="a") == 8


def test_add_sequence_with_prefix_reuses_pages_and_counts():
    pool, tokens = prompt_pool()
    prompt = tokens[:8] + [7, 7, 7]
    assert pool.add_sequence_with_prefix(2, prompt) == 8
    assert pool.block_table(2) == [1, 2] and pool.length(2) == 8
    assert [pool.refcount(p) for p in (1, 2, 3)] == [2, 2, 1]
    assert (pool.hits, pool.misses) == (2, 0)
    # The rest of the prompt goes to a new page; no copy (boundary).
    r = pool.append(2, 3)
    assert r.copies == [] and r.slots == [16, 17, 18]
    # A prompt of exactly two cached pages reuses only one: the last token
    # must still run through the model to produce logits.
    assert pool.add_sequence_with_prefix(3, tokens[:8]) == 4
    assert pool.block_table(3) == [1]
    assert (pool.hits, pool.misses) == (3, 0)  # only 1 page was eligible
    assert pool.add_sequence_with_prefix(4, [1, 2, 3, 4, 5]) == 0
    assert (pool.hits, pool.misses) == (3, 1)
    assert pool.add_sequence_with_prefix(5, []) == 0
    pool.check()


def test_freed_hashed_pages_stay_cached_and_are_reused():
    pool, tokens = prompt_pool()
    pool.free(1)
    # Page 3 (unhashed) went to the free queue; 1 and 2 are cached, tail first.
    assert pool.cached_pages() == [2, 1]
    assert pool.num_cached_pages() == 2 and pool.num_used_pages() == 0
    assert pool.num_free_pages() == 7  # cached pages are still allocatable
    assert pool.add_sequence_with_prefix(2, tokens) == 8
    assert pool.cached_pages() == [] and pool.refcount(1) == 1
    assert pool.evictions == 0
    pool.check()


def test_eviction_is_lru_when_the_free_queue_runs_out():
    pool = make(num_pages=6, page_size=4)
    a, b = list(range(8)), list(range(50, 58))
    for seq, toks in ((1, a), (2, b)):
        pool.add_sequence(seq)
        pool.append(seq, 8)
        pool.register_full_pages(seq, toks)
    assert pool.block_table(1) == [1, 2] and pool.block_table(2) == [3, 4]
    pool.free(1)
    pool.free(2)
    assert pool.cached_pages() == [2, 1, 4, 3]
    # Touching seq 1's chain again makes it most recently used.
    assert pool.add_sequence_with_prefix(3, a + [0]) == 8
    pool.free(3)
    assert pool.cached_pages() == [4, 3, 2, 1]
    pool.add_sequence(4)
    # Free queue [5] first, then the LRU front: 4, 3 (seq 2's tail, then head).
    assert pool.append(4, 12) is not None
    assert pool.block_table(4) == [5, 4, 3]
    assert pool.evictions == 2
    assert pool.page_hash(4) is None and pool.page_hash(3) is None
    assert pool.match_prefix(b) == [] and pool.match_prefix(a) == [1, 2]
    assert pool.append(4, 8) is not None  # evicts 2 then 1
    assert pool.block_table(4) == [5, 4, 3, 2, 1]
    assert pool.evictions == 4 and pool.match_prefix(a) == []
    assert pool.append(4, 1) is None
    pool.check()


def test_cache_cap_evicts_least_recently_used_first():
    pool = make(num_pages=8, page_size=4)
    tokens = list(range(12))
    pool.add_sequence(1)
    pool.append(1, 12)
    pool.register_full_pages(1, tokens)
    pool.set_cache_cap(2)
    pool.free(1)
    assert pool.cached_pages() == [2, 1] and pool.evictions == 1  # page 3 (tail) went
    assert pool.match_prefix(tokens) == [1, 2]
    pool.set_cache_cap(1)
    assert pool.cached_pages() == [1] and pool.cache_cap == 1
    pool.set_cache_cap(0)
    assert pool.cached_pages() == [] and pool.evictions == 3
    assert pool.num_free_pages() == 7
    pool.check()


def test_sole_owner_rewriting_a_hashed_page_drops_its_hash():
    pool, tokens = prompt_pool()
    pool.truncate(1, 4)  # length 6: page 2 hashed but now partial for seq 1
    assert pool.page_hash(2) is not None
    assert pool.match_prefix(tokens) == [1, 2]  # content is still intact
    r = pool.append(1, 1)
    assert r.copies == [] and r.slots == [2 * 4 + 2]
    assert pool.page_hash(2) is None and pool.match_prefix(tokens) == [1]
    pool.check()


def test_shared_hashed_page_is_copied_not_rewritten():
    pool, tokens = prompt_pool()
    pool.truncate(1, 4)
    assert pool.add_sequence_with_prefix(2, tokens) == 8  # reuses pages 1, 2
    r = pool.append(1, 1)
    assert r.copies == [(2, 4)]  # FIFO: 4..7 were queued before the truncated 3
    assert pool.match_prefix(tokens) == [1, 2]
    pool.check()


def test_register_with_tokens_that_disagree_with_an_indexed_page_raises():
    pool = make(num_pages=8, page_size=4)
    pool.add_sequence(1)
    pool.append(1, 8)
    pool.fork(1, 2)  # before indexing: seq 2 recomputes hashes from its tokens
    pool.register_full_pages(1, list(range(8)))
    with pytest.raises(ValueError, match="disagree with the tokens already registered for page 1"):
        pool.register_full_pages(2, [9] * 8)
    assert pool.register_full_pages(2, list(range(8))) == 0  # same content: no-op
    pool.check()


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

NUM_PAGES = 20
PAGE_SIZE = 2
BASES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5])


class PoolMachine(RuleBasedStateMachine):
    """Random pool operations against a model of each sequence's tokens.

    Storage is simulated as one numpy token id per flat slot: every append
    performs the returned copies, then writes the new token ids at the
    returned slots, exactly as the K/V adapter will.
    """

    def __init__(self):
        super().__init__()
        self.pool = PagePool(num_pages=NUM_PAGES, page_size=PAGE_SIZE)
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
        total = NUM_PAGES - 1
        used = pool.num_used_pages()
        cached = pool.num_cached_pages()
        free_uncached = pool.num_free_pages() - cached
        assert free_uncached >= 0 and free_uncached + used + cached == total
        refs = np.zeros(NUM_PAGES, dtype=np.int64)
        for seq in self.tokens:
            table = pool.block_table(seq)
            live = [p for p in table if p != 0]
            assert len(set(live)) == len(live)
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
TestPoolMachine.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- layer groups (PageGroups) ------------------------------------------------------
#
# Group 0 global, group 1 windowed; every sequence lives in both with one length.


def groups(num_pages=(16, 6), window=8, slack=0, page_size=4):
    return PageGroups(num_pages=list(num_pages), page_size=page_size, windows=[0, window], slack=slack)


def test_groups_windowed_pages_go_back_while_global_pages_stay():
    g = groups()
    assert (g.num_groups, g.keep(0), g.keep(1)) == (2, 0, 7)  # window 8: the next query reads 7
    g.add_sequence(1)
    r0, r1 = g.append(1, 6)
    assert r0.slots == r1.slots == [4, 5, 6, 7, 8, 9]  # pages 1, 2 in each group's own pool
    g.append(1, 6)  # length 12: nothing is 7 tokens behind the end of a page yet
    assert g.block_table(1, 0) == g.block_table(1, 1) == [1, 2, 3]
    r0, r1 = g.append(1, 4)  # release first: tokens 0..3 are more than 7 behind 12
    assert g.block_table(1, 0) == [1, 2, 3, 4]
    assert g.block_table(1, 1) == [0, 2, 3, 4]  # page 1 released, page 4 taken from the free queue
    assert r1.slots == [16, 17, 18, 19]
    assert g.pool(1).first_held_token(1) == 4 and g.pool(1).num_free_pages() == 2
    assert (g.held_pages(1, 0), g.held_pages(1, 1)) == (4, 3)
    for _ in range(40):  # one token at a time, 10 windows further
        assert g.append(1, 1) is not None
        assert g.held_pages(1, 1) <= -(-(8 + 0) // 4) + 1  # ceil((W + slack) / P) + 1
        g.check()
    assert g.length(1) == 56 and g.held_pages(1, 0) == 14 and g.pool(0).num_free_pages() == 1
    g.free(1)
    assert g.pool(0).num_used_pages() == g.pool(1).num_used_pages() == 0
    g.check()


def test_groups_append_is_all_groups_or_none():
    g = groups(num_pages=(16, 3))  # the windowed group has 2 usable pages
    g.add_sequence(1)
    assert g.append(1, 8) is not None
    before = [(g.block_table(1, i), g.pool(i).num_free_pages()) for i in (0, 1)]
    assert g.pool(1).pages_needed(1, 4) == 1 and g.pool(1).num_free_pages() == 0
    assert g.append(1, 4) is None  # the windowed group needs a page it does not have
    assert g.length(1) == 8 and [(g.block_table(1, i), g.pool(i).num_free_pages()) for i in (0, 1)] == before
    assert g.pool(1).pages_needed(1, 10**9) == 2**31 - 1  # can never fit
    g.check()


def test_groups_truncate_within_the_slack_and_refused_past_it():
    g = groups(slack=2)  # keep 9 tokens in the windowed group
    g.add_sequence(1)
    g.append(1, 12)
    g.append(1, 4)  # release: tokens before 12 - 9 = 3 -> none whole; length 16
    g.append(1, 1)  # release: tokens before 16 - 9 = 7 -> page 0 (tokens 0..3)
    assert g.block_table(1, 1)[0] == 0 and g.pool(1).first_held_token(1) == 4
    g.truncate(1, 4)  # length 13: the window reads from 13 - 7 = 6 >= 4
    assert g.length(1) == 13
    with pytest.raises(ValueError, match="slack"):
        g.truncate(1, 3)  # length 10 would read from 3, a released token
    assert g.length(1) == 13 and g.block_table(1, 0) == [1, 2, 3, 4]  # nothing changed
    g.truncate(1, 13)  # back to empty: nothing is read, always allowed
    assert g.length(1) == 0 and g.block_table(1, 1) == []
    with pytest.raises(ValueError, match=r"n_tokens must be in \[0, length\]"):
        g.truncate(1, 1)
    g.check()


def test_groups_fork_copies_a_shared_partial_page_in_each_group():
    g = groups(window=5)
    g.add_sequence(1)
    g.append(1, 6)  # pages [1, 2], page 2 half full
    g.fork(1, 2)
    assert [g.pool(i).refcount(2) for i in (0, 1)] == [2, 2]
    r0, r1 = g.append(2, 1)
    assert r0.copies == r1.copies == [(2, 3)]  # copy-on-write in both groups
    assert g.block_table(2, 0) == g.block_table(2, 1) == [1, 3]
    assert g.block_table(1, 0) == g.block_table(1, 1) == [1, 2]
    g.append(2, 5)  # length 12
    g.append(2, 1)  # the windowed group of 2 releases pages 1 and 3 (1 still held by sequence 1)
    assert g.block_table(2, 1)[0] == 0 and g.pool(1).refcount(1) == 1 and g.pool(0).refcount(1) == 2
    with pytest.raises(ValueError, match="already exists"):
        g.fork(1, 2)
    g.free(2)
    assert [g.pool(i).refcount(p) for i in (0, 1) for p in (1, 2)] == [1, 1, 1, 1]
    g.check()


def test_groups_prefix_hit_needs_every_group_and_only_the_window_pages():
    g = groups(window=5)  # keep 4 tokens: a hit needs 1 windowed page before its end
    tokens = list(range(100, 117))  # 17 tokens: 4 full pages reusable
    g.add_sequence(1)
    g.append(1, 16)  # pages 1..4 in both groups
    assert g.register_full_pages(1, tokens) == 8  # 4 per group
    g.append(1, 1)  # windowed group releases logical pages 0..2 (hashed: they stay cached)
    assert g.block_table(1, 1) == [0, 0, 0, 4, 5]
    assert g.pool(1).cached_pages() == [3, 2, 1]  # newest first: the chain head goes last
    assert g.add_sequence_with_prefix(2, tokens) == 16
    assert g.block_table(2, 0) == [1, 2, 3, 4]
    assert g.block_table(2, 1) == [0, 0, 0, 4]  # only the page its window reads
    assert g.pool(1).refcount(4) == 2 and g.pool(1).cached_pages() == [3, 2, 1]
    assert (g.hits, g.misses) == (4, 0)
    # A prompt sharing 2 pages: cached windowed pages serve it too.
    other = tokens[:8] + [7] * 9
    assert g.match_prefix(other) == 8
    assert g.pool(1).prefix_hits(other) == [1, 2, 0, 0]
    g.pool(1).set_cache_cap(0)  # evict the windowed group's cached pages
    assert g.pool(1).prefix_hits(other) == [0, 0, 0, 0]
    assert g.pool(0).prefix_hits(other) == [1, 2, 0, 0]  # the global group still hits...
    assert g.match_prefix(other) == 0  # ...but every group must
    assert g.add_sequence_with_prefix(3, other) == 0 and g.misses == 4
    g.check()


def test_groups_bad_input_is_a_value_error():
    for kw, match in (
        ({"num_pages": [8], "windows": [0, 8]}, "one window and one pool size per group"),
        ({"num_pages": [8, 8], "windows": [0, -1]}, "must be >= 0"),
        ({"num_pages": [8, 1], "windows": [0, 8]}, "at least 2"),
    ):
        with pytest.raises(ValueError, match=match):
            PageGroups(page_size=4, slack=0, **kw)
    with pytest.raises(ValueError, match="slack must be >= 0"):
        PageGroups(num_pages=[8], page_size=4, windows=[0], slack=-1)
    g = groups()
    with pytest.raises(ValueError, match="unknown sequence id 9"):
        g.append(9, 1)
    with pytest.raises(ValueError, match="out of range"):
        g.pool(2)
    g.add_sequence(1)
    with pytest.raises(ValueError, match="n_tokens must be >= 0"):
        g.append(1, -1)
    with pytest.raises(ValueError, match="already exists"):
        g.add_sequence_with_prefix(1, [1, 2, 3])


GROUP_WINDOWS = [0, 5]  # a global group and a windowed one (keep 4 + slack)
GROUP_SLACK = 2


class GroupsMachine(RuleBasedStateMachine):
    """Random PageGroups operations against a model of each sequence's tokens.

    One simulated storage per group (a token id per flat slot). Every
    sequence must read back its tokens from each group: all of them from the
    global group, and in a windowed group every token from its first held
    one, which never lies past what the window and the slack need.
    """

    def __init__(self):
        super().__init__()
        self.pages = PageGroups(num_pages=[NUM_PAGES, NUM_PAGES // 2], page_size=PAGE_SIZE,
                                windows=GROUP_WINDOWS, slack=GROUP_SLACK)
        self.storage = [np.full(NUM_PAGES * PAGE_SIZE, -1, dtype=np.int64) for _ in GROUP_WINDOWS]
        self.tokens: dict[int, list[int]] = {}
        # Longest length an append started at (where the window last released): rolling back to
        # floor - slack or later is always allowed.
        self.floor: dict[int, int] = {}
        self.next_id = 0

    ids = st.integers(min_value=0, max_value=10**6)

    def _pick(self, i):
        keys = sorted(self.tokens)
        return keys[i % len(keys)]

    def _snapshot(self):
        return {s: [self.pages.block_table(s, g) for g in range(len(GROUP_WINDOWS))] for s in self.tokens}

    def _append(self, seq, new):
        self.floor[seq] = max(self.floor[seq], len(self.tokens[seq]))  # released even when refused
        rs = self.pages.append(seq, len(new))
        if rs is None:
            held = [self.pages.pool(g).pages_needed(seq, len(new)) > self.pages.pool(g).num_free_pages()
                    for g in range(len(GROUP_WINDOWS))]
            assert any(held) and self.pages.length(seq) == len(self.tokens[seq])
            return False
        for store, r in zip(self.storage, rs):
            for src, dst in r.copies:
                store[dst * PAGE_SIZE:(dst + 1) * PAGE_SIZE] = store[src * PAGE_SIZE:(src + 1) * PAGE_SIZE]
            for slot, tok in zip(r.slots, new):
                assert slot // PAGE_SIZE != 0, "wrote into the null page"
                store[slot] = tok
        self.tokens[seq].extend(new)
        return True

    @rule(base=st.sampled_from(BASES), extra=st.lists(st.integers(0, 9), max_size=4),
          prefixed=st.booleans(), index=st.booleans())
    def add(self, base, extra, prefixed, index):
        self.next_id += 1
        seq = self.next_id
        prompt = base + extra
        n = self.pages.add_sequence_with_prefix(seq, prompt) if prefixed else 0
        if not prefixed:
            self.pages.add_sequence(seq)
        assert n % PAGE_SIZE == 0 and (n == 0 or n < len(prompt))
        self.tokens[seq] = prompt[:n]
        self.floor[seq] = n
        if self._append(seq, prompt[n:]) and index:
            self.pages.register_full_pages(seq, self.tokens[seq])

    @precondition(lambda self: self.tokens)
    @rule(i=ids, new=st.lists(st.integers(0, 9), min_size=0, max_size=6), index=st.booleans())
    def append(self, i, new, index):
        seq = self._pick(i)
        if self._append(seq, new) and index:
            self.pages.register_full_pages(seq, self.tokens[seq])

    @precondition(lambda self: self.tokens)
    @rule(i=ids)
    def fork(self, i):
        src = self._pick(i)
        self.next_id += 1
        self.pages.fork(src, self.next_id)
        self.tokens[self.next_id] = list(self.tokens[src])
        self.floor[self.next_id] = self.floor[src]

    @precondition(lambda self: self.tokens)
    @rule(i=ids)
    def free(self, i):
        seq = self._pick(i)
        self.pages.free(seq)
        del self.tokens[seq], self.floor[seq]

    @precondition(lambda self: self.tokens)
    @rule(i=ids, n=st.integers(0, 6))
    def truncate(self, i, n):
        seq = self._pick(i)
        length = len(self.tokens[seq])
        n = min(n, length)
        new_len = length - n
        if new_len == 0 or new_len >= self.floor[seq] - GROUP_SLACK:
            self.pages.truncate(seq, n)  # within the slack: always allowed
            del self.tokens[seq][new_len:]
            if new_len == 0:
                self.floor[seq] = 0  # an empty sequence holds nothing and released nothing
        else:
            before = self._snapshot()
            try:
                self.pages.truncate(seq, n)
            except ValueError:
                assert self._snapshot() == before  # refused: nothing changed
            else:
                del self.tokens[seq][new_len:]
                if new_len == 0:
                    self.floor[seq] = 0

    @invariant()
    def groups_agree_and_read_back(self):
        self.pages.check()
        for seq, toks in self.tokens.items():
            assert self.pages.length(seq) == len(toks)
            for g, w in enumerate(GROUP_WINDOWS):
                first = self.pages.pool(g).first_held_token(seq)
                if w == 0:
                    assert first == 0
                elif toks:  # the next query reads the last w - 1 tokens: they are held
                    assert first <= max(0, len(toks) - (w - 1))
                table = self.pages.block_table(seq, g)
                for pos in range(first, len(toks)):
                    page = table[pos // PAGE_SIZE]
                    assert page != 0
                    assert self.storage[g][page * PAGE_SIZE + pos % PAGE_SIZE] == toks[pos], (seq, g, pos)


TestGroupsMachine = GroupsMachine.TestCase
TestGroupsMachine.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
