"""The paged KV core in C++: the page pool's allocation, block tables, copy-on-write,
sliding windows and the prefix index.

No model: the tests assert exact page ids, refcounts and eviction order. Gather/scatter
over paged storage and the pool's state machine: test_paged_storage.py; layer groups:
test_paged_groups.py.
"""

from __future__ import annotations

import pytest

from mlx_infer._fast import AppendResult, PagePool

from paged_helpers import make


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
