"""The paged KV adapter (mlx_infer.state.paged) driving the real model graphs.

Oracles and tolerances:

- plain caches (``model.make_cache()``), same model, float32: greedy tokens
  equal for 64 steps. Logits: llama (global attention) reads the same values
  in the same order, so they are bit-identical (``atol 0``); a sliding-window
  layer reads its window in temporal order where the rotating cache reads it
  in ring order, so sums reorder: ``PLAIN_ATOL`` (measured max 2.2e-6).
- batched decode (rows of different lengths, right-padded and masked) vs each
  sequence alone: greedy tokens equal for 16 steps.
- mlx-lm's ``QuantizedKVCache`` on mlx-lm's own load of the same tiny model:
  the same quantize / quantized_matmul ops, so greedy tokens equal for 32
  steps and logits within ``QUANT_ATOL`` (measured: identical).
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.generation.autoregressive import generate_tokens
from mlx_infer.state.paged import (
    LayerKV,
    PagedKVExhausted,
    PagedKVStore,
    PagedLayerCache,
    PagedModel,
    load_kv_config,
)
from tiny import make_tiny_model_dir

PLAIN_ATOL = 1e-4
QUANT_ATOL = 1e-5
PROMPT = [(7 * i + 3) % 300 + 5 for i in range(21)]  # 21 tokens: longer than the window (8)
FAMILIES = {
    "llama": ("llama", {}),
    "gemma3": ("gemma3", {}),  # sliding window 8 on 2 of 3 layers, one global layer
    "mistral": ("llama", {"model_type": "mistral", "sliding_window": 8}),  # every layer windowed
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            family, overrides = FAMILIES.get(name, (name, {}))
            if name == "llama_hd32":
                family, overrides = "llama", {"head_dim": 32}
            path = make_tiny_model_dir(tmp_path_factory.mktemp(name), family, **overrides)
            cache[name] = (load_model(path).model, path)
        return cache[name][0]
    get.path = lambda name: (get(name), cache[name][1])[1]
    return get


def greedy(model, cache, prompt, steps):
    """Prefill ``prompt`` in one chunk, then ``steps`` greedy tokens; returns (tokens, logits)."""
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1]  # (1, vocab)
    tokens, seen = [], []
    for _ in range(steps):
        y = mx.argmax(logits, axis=-1)
        tokens.append(y.item())
        seen.append(logits)
        logits = model(y[None], cache=cache)[:, -1]
    return tokens, mx.concatenate(seen)  # (steps, vocab)


def forced(model, cache, tokens):
    """Feed ``tokens`` one at a time; returns the logits after each (len, vocab)."""
    return mx.concatenate([model(mx.array([[t]]), cache=cache)[:, -1] for t in tokens])


def store_for(model, **kw):
    kw.setdefault("num_pages", 128)
    kw.setdefault("page_size", 4)
    return PagedKVStore.for_model(model, **kw)


# -- single sequence ------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_over_pages_equals_plain_kv(models, name):
    model = models(name)
    want, want_logits = greedy(model, model.make_cache(), PROMPT, 64)
    store = store_for(model)
    seq = store.add_sequence()
    got, got_logits = greedy(model, store.make_cache(seq), PROMPT, 64)
    assert got == want
    atol = 0 if name == "llama" else PLAIN_ATOL
    np.testing.assert_allclose(np.array(got_logits), np.array(want_logits), rtol=0, atol=atol)
    assert seq.length == len(PROMPT) + 64
    windowed = [g for g in store.groups if g.window is not None]
    bound = -(-(8 + store.pages.slack) // 4) + 1  # ceil((W + slack) / P) + 1
    for g in windowed:  # pages behind the window (plus slack) went back to the group's pool
        assert g.window == 8 and g.keep == 7 + store.pages.slack
        assert store.pages.held_pages(seq.seq_id, g.index) <= bound
        assert store.pages.pool(g.index).num_used_pages() <= bound
    for g in store.groups:
        if g.window is None:  # the global layers keep every page
            assert store.pages.pool(g.index).num_used_pages() == -(-seq.length // 4)
    assert [g.window for g in store.groups] == {"llama": [None], "gemma3": [None, 8], "mistral": [8]}[name]
    store.pages.check()


@pytest.mark.parametrize("slack", [0, 5])
def test_mixed_model_windowed_pages_stay_bounded_past_many_windows(models, slack):
    """Gemma 3 tiny (window 8 on 2 of 3 layers): 8 windows long, chunked prefill then decode."""
    model = models("gemma3")
    P, W, prompt = 4, 8, PROMPT * 2  # 42 prompt tokens
    plain = model.make_cache()
    store = store_for(model, window_slack=slack)
    assert [(g.window, g.layers) for g in store.groups] == [(None, (2,)), (8, (0, 1))]
    seq = store.add_sequence()
    paged = store.make_cache(seq)
    bound = -(-(W + slack) // P) + 1
    win, glob = store.groups[1].index, store.groups[0].index
    peak = 0
    for start in range(0, len(prompt), 6):  # prefill chunks of 6 (< W): the bound holds after each
        chunk = mx.array(prompt[start:start + 6])[None]
        want = model(chunk, cache=plain)[:, -1]
        got = model(chunk, cache=paged)[:, -1]
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=PLAIN_ATOL)
        peak = max(peak, store.pages.held_pages(seq.seq_id, win))
    assert peak <= -(-(W + slack + 6) // P) + 1  # window + slack + one chunk
    y = mx.argmax(want, axis=-1)
    for step in range(24):  # 66 tokens in all: past the window 8 times
        want = model(y[None], cache=plain)[:, -1]
        got = model(y[None], cache=paged)[:, -1]
        assert mx.argmax(got, axis=-1).item() == mx.argmax(want, axis=-1).item()
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=PLAIN_ATOL)
        y = mx.argmax(want, axis=-1)
        held = store.pages.held_pages(seq.seq_id, win)
        assert held <= bound, (step, held, bound)
        assert store.pages.held_pages(seq.seq_id, glob) == -(-seq.length // P)  # grows with length
        store.pages.check()
    assert seq.length == 66
    table = seq.block_tables[win]
    assert table[:(66 - W - slack) // P - 1] == [0] * ((66 - W - slack) // P - 1)  # released
    assert 0 not in seq.block_tables[glob]
    # used pages: the windowed group's pool holds only the window's pages
    assert store.pages.pool(win).num_used_pages() == store.pages.held_pages(seq.seq_id, win) <= bound


def test_rollback_within_the_slack_and_refused_beyond(models):
    model = models("gemma3")
    store = store_for(model, window_slack=4)  # keeps W - 1 + 4 = 11 tokens
    seq = store.add_sequence()
    caches = store.make_cache(seq)
    plain = model.make_cache()
    model(mx.array(PROMPT * 2)[None], cache=plain)
    model(mx.array(PROMPT * 2)[None], cache=caches)  # 42 tokens
    for t in (3, 4, 5, 6):  # one token per step: the window releases as it goes
        model(mx.array([[t]]), cache=caches)
    assert seq.length == 46
    before = (seq.block_tables, list(seq.offsets))
    with pytest.raises(ValueError, match="slack"):
        seq.truncate(9)  # the window at 37 would start at 30 < first held token
    assert (seq.block_tables, list(seq.offsets)) == before  # refused: nothing changed
    assert seq.truncate(4) == 4  # back to 42 tokens: within the slack
    want = forced(model, plain, [9, 8, 7])
    got = forced(model, caches, [9, 8, 7])
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=PLAIN_ATOL)
    store.pages.check()


def test_prefix_reuse_with_mixed_groups_needs_every_group_to_hit(models):
    model = models("gemma3")
    P = 4
    prompt = PROMPT * 2  # 42 tokens: 10 full pages reusable (one token left to compute)
    store = store_for(model, window_slack=0)  # windowed group keeps 7 tokens: 2 pages before a hit
    first = store.add_sequence(prompt)
    caches = store.make_cache(first)
    for start in range(0, 40, 8):  # prefill 40 tokens in chunks: the windowed group releases
        model(mx.array(prompt[start:start + 8])[None], cache=caches)
    assert first.register(prompt) > 0  # indexes what each group still holds
    win = store.groups[1].index
    assert first.block_tables[win][:6] == [0] * 6  # pages behind the window are gone
    assert 0 not in first.block_tables[0]
    second = store.add_sequence(prompt)
    assert second.cached_tokens == 40  # the global group has all 10 pages, the windowed the last 2
    assert second.block_tables[0] == first.block_tables[0]
    assert second.block_tables[win] == [0] * 8 + first.block_tables[win][8:10]
    got = model(mx.array(prompt[40:])[None], cache=store.make_cache(second))[:, -1]
    plain = model.make_cache()
    for start in range(0, 40, 8):
        model(mx.array(prompt[start:start + 8])[None], cache=plain)
    want = model(mx.array(prompt[40:])[None], cache=plain)[:, -1]
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=PLAIN_ATOL)
    # A prompt diverging at token 30: the global group would reuse 7 pages, but the windowed
    # group released pages 0-5 before they were indexed, so a hit of 7 pages (which needs
    # windowed pages 5 and 6) is impossible, and so is any shorter one.
    third_prompt = prompt[:30] + [1] * 12
    hits = [store.pages.pool(g.index).prefix_hits(third_prompt) for g in store.groups]
    assert all(hits[0][:7]) and not hits[0][7]
    assert not any(hits[1][:6]) and hits[1][6]
    assert store.add_sequence(third_prompt).cached_tokens == 0
    # Once the windowed group's cached pages are evicted, the full prompt misses too.
    first.free()
    second.free()
    store.pages.pool(win).set_cache_cap(0)
    assert store.pages.match_prefix(prompt) == 0
    store.pages.pool(0).check()
    assert store.add_sequence(prompt).cached_tokens == 0
    store.pages.check()


def test_fork_copy_on_write_with_mixed_groups(models):
    model = models("gemma3")
    store = store_for(model, window_slack=0)
    parent = store.add_sequence()
    pc = store.make_cache(parent)
    prompt = PROMPT * 2
    model(mx.array(prompt[:40])[None], cache=pc)
    model(mx.array(prompt[40:])[None], cache=pc)  # 42 tokens, the windowed group released its head
    reference = model.make_cache()
    model(mx.array(prompt)[None], cache=reference)
    child_plain = model.make_cache()
    model(mx.array(prompt)[None], cache=child_plain)
    child = parent.fork()
    for g in store.groups:  # every group shares the held pages, the last (partial) one included
        p = store.pages.pool(g.index)
        assert child.block_tables[g.index] == parent.block_tables[g.index]
        assert p.refcount(parent.block_tables[g.index][-1]) == 2
    got_child = forced(model, store.make_cache(child), [40, 41, 42, 43, 44, 45, 46, 47, 48])
    for g in store.groups:  # copy-on-write in each group
        assert child.block_tables[g.index][10] != parent.block_tables[g.index][10]
    got_parent = forced(model, pc, [11, 12, 13, 14, 15, 16])
    np.testing.assert_allclose(np.array(got_parent), np.array(forced(model, reference, [11, 12, 13, 14, 15, 16])),
                               rtol=0, atol=PLAIN_ATOL)
    np.testing.assert_allclose(np.array(got_child),
                               np.array(forced(model, child_plain, [40, 41, 42, 43, 44, 45, 46, 47, 48])),
                               rtol=0, atol=PLAIN_ATOL)
    store.pages.check()
    child.free()
    for g in store.groups:
        assert all(store.pages.pool(g.index).refcount(p) == 1 for p in parent.block_tables[g.index] if p)
    parent.free()
    assert all(store.pages.pool(g.index).num_used_pages() == 0 for g in store.groups)
    store.pages.check()


def test_windowed_group_out_of_pages_is_a_return_value(models):
    model = models("gemma3")
    store = store_for(model, num_pages=[64, 4], window_slack=0)  # windowed group: 3 usable pages
    seq = store.add_sequence()
    caches = store.make_cache(seq)
    model(mx.array(PROMPT[:8])[None], cache=caches)  # 2 windowed pages
    assert not seq.reserve(8)  # 8 more: the windowed group needs 2 more pages, has 1
    assert seq.length == 8 and store.pages.held_pages(seq.seq_id, 0) == 2
    with pytest.raises(PagedKVExhausted, match="per layer group"):
        model(mx.array(PROMPT[8:16])[None], cache=caches)
    assert seq.length == 8 and seq.offsets == [8, 8, 8]
    for t in PROMPT[8:]:  # one token at a time fits: the window releases as it grows
        model(mx.array([[t]]), cache=caches)
    assert seq.length == 21
    store.pages.check()


def test_generate_tokens_runs_over_paged_state(models):
    model = models("gemma3")
    want = [t.token for t in generate_tokens(model, PROMPT * 2, max_tokens=24, prefill_step_size=5)]
    store = store_for(model)
    gen = generate_tokens(PagedModel(model, store), PROMPT * 2, max_tokens=24, prefill_step_size=5)
    assert [t.token for t in gen] == want
    assert store.pool.num_used_pages() > 0
    del gen
    gc.collect()
    assert store.pool.num_used_pages() == 0  # the sequence went with its caches


def test_chunked_prefill_and_trim_match_plain(models):
    model = models("gemma3")
    plain, store = model.make_cache(), store_for(model)
    seq = store.add_sequence()
    paged = store.make_cache(seq)
    for chunk in (PROMPT[:5], PROMPT[5:17], PROMPT[17:]):
        model(mx.array(chunk)[None], cache=plain)
        model(mx.array(chunk)[None], cache=paged)
    # Roll back 3 tokens on every layer, as speculative decoding does.
    assert [c.trim(3) for c in paged] == [3] * 3
    assert seq.length == len(PROMPT) - 3 and [c.offset for c in paged] == [18] * 3
    redo = [model.make_cache()]
    model(mx.array(PROMPT[:18])[None], cache=redo[0])
    want = forced(model, redo[0], [9, 8, 7, 6])
    got = forced(model, paged, [9, 8, 7, 6])
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=PLAIN_ATOL)
    assert seq.truncate(100) == 22 and seq.length == 0 and store.pool.num_used_pages() == 0


def test_nbytes_counts_referenced_pages(models):
    model = models("llama")
    store = store_for(model)
    seq = store.add_sequence()
    caches = store.make_cache(seq)
    assert sum(c.nbytes for c in caches) == 0
    model(mx.array(PROMPT)[None], cache=caches)
    # llama tiny: 2 layers, K and V, 2 kv heads, 4 tokens/page, head_dim 16, float32.
    page = 2 * 2 * 4 * 16 * 4
    assert store.page_bytes == 2 * page
    assert caches[0].nbytes == 6 * page and seq.nbytes == 12 * page  # 21 tokens -> 6 pages
    child = seq.fork()
    assert store.used_bytes == 12 * page  # shared pages counted once
    assert child.nbytes == seq.nbytes
    assert store.nbytes == 128 * 2 * page  # the whole pool, allocated


# -- batched decode -------------------------------------------------------------


def test_rope_takes_a_per_row_offset_array():
    x = mx.random.normal((3, 4, 2, 16), key=mx.random.key(0))  # (B, H, L, D)
    offsets = [0, 5, 11]
    got = mx.fast.rope(x, 16, traditional=False, base=10000.0, scale=1.0, offset=mx.array(offsets))
    for b, off in enumerate(offsets):
        want = mx.fast.rope(x[b:b + 1], 16, traditional=False, base=10000.0, scale=1.0, offset=off)
        assert mx.array_equal(got[b:b + 1], want)


@pytest.mark.parametrize("name", ["llama", "gemma3", "mistral"])
def test_batched_decode_equals_each_sequence_alone(models, name):
    model = models(name)
    prompts = [PROMPT[:n] for n in (5, 13, 9, 21)]
    store = store_for(model)
    alone = [greedy(model, store.make_cache(store.add_sequence()), p, 16)[0] for p in prompts]
    seqs = [store.add_sequence() for _ in prompts]
    first = [mx.argmax(model(mx.array(p)[None], cache=store.make_cache(s))[:, -1], axis=-1)
             for s, p in zip(seqs, prompts)]
    batch = store.batch(seqs)
    assert batch.caches[0].offset.tolist() == [5, 13, 9, 21]
    mask = batch.caches[0].make_mask(1)
    assert mask.shape[:3] == (4, 1, 1) and mask.dtype == mx.bool_
    y = mx.concatenate(first)  # (B,)
    rows = [[] for _ in prompts]
    for _ in range(16):
        for row, t in zip(rows, y.tolist()):
            row.append(t)
        assert batch.reserve(1)
        y = mx.argmax(model(y[:, None], cache=batch.caches)[:, -1], axis=-1)  # (B,)
    assert rows == alone
    assert [s.length for s in seqs] == [len(p) + 16 for p in prompts]


def test_batch_reserve_is_all_or_nothing():
    store = PagedKVStore(num_layers=1, num_pages=4, page_size=2)
    a, b = store.add_sequence(), store.add_sequence()
    assert a.reserve(4) and b.reserve(1)  # 2 pages + 1 page: 0 free
    for s in (a, b):
        s.offsets[0] = s.length  # as if the layer had written the step
    assert not store.batch([a, b]).reserve(1)  # a needs a page, b has room: neither grows
    assert (a.length, b.length) == (4, 1)
    store.pool.check()


def test_batched_forward_out_of_pages_changes_nothing(models):
    model = models("llama")
    store = store_for(model, num_pages=4)  # 3 usable pages of 4 tokens
    a, b = store.add_sequence(), store.add_sequence()
    model(mx.array(PROMPT[:8])[None], cache=store.make_cache(a))  # 2 pages, full
    model(mx.array(PROMPT[:3])[None], cache=store.make_cache(b))  # 1 page, room for 1
    with pytest.raises(PagedKVExhausted, match="each of 2 sequences"):
        model(mx.array([[5], [6]]), cache=store.batch([a, b]).caches)
    assert (a.length, b.length) == (8, 3) and a.offsets == [8, 8] and b.offsets == [3, 3]
    store.pool.check()


# -- quantized KV -----------------------------------------------------------------


def mlx_lm_model(path):
    from mlx_lm.utils import load_model as mlx_lm_load

    return mlx_lm_load(Path(path))[0]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_paged_kv_matches_mlx_lm_quantized_cache(models, bits):
    from mlx_lm.models.cache import QuantizedKVCache

    model, path = models("llama_hd32"), models.path("llama_hd32")
    reference = mlx_lm_model(path)
    caches = [QuantizedKVCache(group_size=32, bits=bits) for _ in reference.layers]
    want, want_logits = greedy(reference, caches, PROMPT, 32)
    store = store_for(model, kv_scheme=LayerKV(bits, 32))
    got, got_logits = greedy(model, store.make_cache(store.add_sequence()), PROMPT, 32)
    assert got == want
    np.testing.assert_allclose(np.array(got_logits), np.array(want_logits), rtol=0, atol=QUANT_ATOL)
    # 8-bit: head_dim 32 -> 8 packed words + a scale and a bias per token and head.
    k_part = store.storage[0].keys
    assert k_part[0].dtype == mx.uint32 and k_part[0].shape[-1] == 32 * bits // 32
    assert k_part[1].shape[-1] == 1


def test_mixed_kv_config_per_layer(models, tmp_path):
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    model, path = models("llama_hd32"), models.path("llama_hd32")
    config = tmp_path / "kv_config.json"
    config.write_text(json.dumps([{"layer_idx": 1, "bits": 4, "group_size": 32}]))
    store = store_for(model, kv_scheme=str(config))
    assert [s.bits for s in store.scheme] == [None, 4]
    got, _ = greedy(model, store.make_cache(store.add_sequence()), PROMPT, 32)
    reference = mlx_lm_model(path)
    want, _ = greedy(reference, [KVCache(), QuantizedKVCache(group_size=32, bits=4)], PROMPT, 32)
    assert got == want
    assert store.storage[0].keys[0].dtype == mx.float32 and len(store.storage[1].keys) == 3


def test_quantized_batch_and_windows(models):
    model = models("mistral")  # every layer windowed, head_dim 16
    with pytest.raises(ValueError, match="group_size 32 does not divide the model's head_dim 16"):
        store_for(model, kv_scheme=LayerKV(8, 32))
    model = models("llama_hd32")
    store = store_for(model, kv_scheme=LayerKV(8, 32))
    prompts = [PROMPT[:n] for n in (6, 11)]
    alone = [greedy(model, store.make_cache(store.add_sequence()), p, 8)[0] for p in prompts]
    seqs = [store.add_sequence() for _ in prompts]
    y = mx.concatenate([mx.argmax(model(mx.array(p)[None], cache=store.make_cache(s))[:, -1], axis=-1)
                        for s, p in zip(seqs, prompts)])
    batch, rows = store.batch(seqs), [[], []]
    for _ in range(8):
        for row, t in zip(rows, y.tolist()):
            row.append(t)
        y = mx.argmax(model(y[:, None], cache=batch.caches)[:, -1], axis=-1)
    assert rows == alone


def test_kv_config_validation():
    assert load_kv_config([], 2) == [LayerKV(), LayerKV()]
    for bad, match in (
        ([{"bits": 8}], "needs a layer_idx"),
        ([{"layer_idx": 2, "bits": 8}], r"not in \[0, 2\)"),
        ([{"layer_idx": 0, "bits": 8}, {"layer_idx": 0, "bits": 4}], "listed twice"),
        ([{"layer_idx": 0, "bits": 3}], "bits must be one of"),
        ([{"layer_idx": 0, "bits": 8, "group_size": 48}], "group_size must be one of"),
        ({"layer_idx": 0}, "JSON list"),
    ):
        with pytest.raises(ValueError, match=match):
            load_kv_config(bad, 2)


# -- fork and prefix reuse ------------------------------------------------------------


def test_fork_and_divergent_continuation_leave_the_parent_unchanged(models):
    model = models("gemma3")
    reference = model.make_cache()
    model(mx.array(PROMPT)[None], cache=reference)
    want_parent = forced(model, reference, [11, 12, 13, 14, 15, 16])
    child_plain = model.make_cache()
    model(mx.array(PROMPT)[None], cache=child_plain)
    want_child = forced(model, child_plain, [40, 41, 42, 43, 44])

    store = store_for(model)
    parent = store.add_sequence()
    pc = store.make_cache(parent)
    model(mx.array(PROMPT)[None], cache=pc)  # 21 tokens: the last page (4 per page) is partial
    child = parent.fork()
    assert child.block_table == parent.block_table
    assert store.pool.refcount(parent.block_table[-1]) == 2
    got_child = forced(model, store.make_cache(child), [40, 41, 42, 43, 44])  # copy-on-write
    assert child.block_table[:-2] == parent.block_table[:-1]  # full pages still shared
    assert child.block_table[-2] != parent.block_table[-1]
    got_parent = forced(model, pc, [11, 12, 13, 14, 15, 16])
    np.testing.assert_allclose(np.array(got_parent), np.array(want_parent), rtol=0, atol=PLAIN_ATOL)
    np.testing.assert_allclose(np.array(got_child), np.array(want_child), rtol=0, atol=PLAIN_ATOL)
    child.free()
    assert all(store.pool.refcount(p) == 1 for p in parent.block_table)
    store.pool.check()


def test_prefix_reuse_reports_cached_tokens_and_gives_identical_logits(models):
    model = models("llama")
    store = store_for(model)
    first = store.add_sequence(PROMPT)
    assert first.cached_tokens == 0
    model(mx.array(PROMPT)[None], cache=store.make_cache(first))
    assert first.register(PROMPT) == 5  # 21 tokens: 5 full pages of 4
    second_prompt = PROMPT[:18] + [1, 2, 3, 4]
    second = store.add_sequence(second_prompt)
    assert second.cached_tokens == 16 and second.block_table == first.block_table[:4]
    assert store.pool.hits == 4
    caches = store.make_cache(second)
    assert [c.offset for c in caches] == [16, 16]
    got = model(mx.array(second_prompt[16:])[None], cache=caches)[:, -1]
    plain = model.make_cache()
    model(mx.array(second_prompt[:16])[None], cache=plain)  # the same chunking as the reuse
    want = model(mx.array(second_prompt[16:])[None], cache=plain)[:, -1]
    assert mx.array_equal(got, want)
    # Another namespace (another model or adapter) sees nothing; freed pages stay cached.
    assert store.add_sequence(PROMPT, namespace="other").cached_tokens == 0
    first.free()
    second.free()
    assert store.add_sequence(PROMPT).cached_tokens == 20


# -- bad input --------------------------------------------------------------------


def test_bad_input_is_a_clear_value_error(models):
    model = models("llama")
    store = store_for(model)
    seq = store.add_sequence()
    caches = store.make_cache(seq)
    model(mx.array(PROMPT[:3])[None], cache=caches)
    seq.free()
    seq.free()  # idempotent
    with pytest.raises(ValueError, match="sequence 0 was freed"):
        model(mx.array([[5]]), cache=caches)
    with pytest.raises(ValueError, match="was freed"):
        store.make_cache(seq)
    with pytest.raises(ValueError, match="Unknown paged sequence id 99"):
        store.make_cache(99)
    with pytest.raises(ValueError, match="page_size must be a positive power of two"):
        store_for(model, page_size=12)
    with pytest.raises(ValueError, match="group_size 64 does not divide the model's head_dim 16"):
        store_for(model, kv_scheme=LayerKV(8, 64))
    with pytest.raises(ValueError, match="batch of 2"):
        model(mx.array([[5], [6]]), cache=store.make_cache(store.add_sequence()))
    small = store_for(model, num_pages=3)  # 2 usable pages: 8 tokens
    s = small.add_sequence()
    assert not s.reserve(9) and s.length == 0
    with pytest.raises(PagedKVExhausted, match=r"free pages \(per layer group\), too few to append 9 tokens"):
        model(mx.array(PROMPT[:9])[None], cache=small.make_cache(s))
    assert isinstance(PagedKVExhausted("x"), ValueError)


def test_protocol_members(models):
    from mlx_infer.contracts import Cache

    model = models("gemma3")
    cache = store_for(model).make_cache(store_for(model).add_sequence())
    assert all(isinstance(c, Cache) for c in cache) and isinstance(cache[0], PagedLayerCache)
    assert cache[0].window == 8 and cache[2].window is None
    assert cache[0].make_mask(1, window_size=8) is None and cache[0].make_mask(4) == "causal"
    assert cache[0].state == ()


# -- real model -------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_paged_equals_plain(real_model):
    model = real_model.model
    prompt = real_model.tokenizer.encode("The capital of France is")
    want, _ = greedy(model, model.make_cache(), prompt, 64)
    store = PagedKVStore.for_model(model, num_pages=16, page_size=16)
    got, _ = greedy(model, store.make_cache(store.add_sequence()), prompt, 64)
    assert got == want


@pytest.mark.slow
def test_real_model_past_the_window_equals_plain(real_model):
    """Gemma 3 270M (window 512 on 15 of 18 layers) over a 1,100-token prompt: two windows."""
    model = real_model.model
    ids = real_model.tokenizer.encode("The capital of France is Paris. " * 160)[:1100]
    store = PagedKVStore.for_model(model, num_pages=128, page_size=16)
    seq = store.add_sequence()
    runs = []
    for cache in (model.make_cache(), store.make_cache(seq)):
        for start in range(0, len(ids), 256):  # the same prefill chunks on both
            logits = model(mx.array(ids[start:start + 256])[None], cache=cache)[:, -1]
        runs.append(greedy_from(model, cache, logits, 8))
    assert runs[0] == runs[1]
    win = store.groups[1]
    assert (win.window, len(win.layers)) == (512, 15)
    assert store.pages.held_pages(seq.seq_id, win.index) <= -(-(512 + store.pages.slack) // 16) + 1
    assert store.pages.held_pages(seq.seq_id, 0) == -(-seq.length // 16)


def greedy_from(model, cache, logits, steps):
    """``steps`` greedy tokens continuing from ``logits`` (1, vocab)."""
    tokens = []
    for _ in range(steps):
        y = mx.argmax(logits, axis=-1)
        tokens.append(y.item())
        logits = model(y[None], cache=cache)[:, -1]
    return tokens
