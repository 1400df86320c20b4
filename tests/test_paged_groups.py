"""The paged KV core in C++: layer groups (PageGroups), one page pool per group of
layers with a window each, examples and a hypothesis state machine against a numpy
simulation of each group's K/V storage.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_infer._fast import PageGroups

from paged_helpers import BASES, NUM_PAGES, PAGE_SIZE, machine_settings


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
TestGroupsMachine.settings = machine_settings(300)
