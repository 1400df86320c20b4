"""KV storage that grows on demand up to the pool's capacity (state/paged/growth.py).

The C++ pools hand out only materialized page ids and ``grow(to)`` adds more (exact ids, no
model); the store grows every layer's storage keeping each written page's id and contents;
an engine that grows many times gives the tokens of one preallocated at full capacity and of
the plain model, preempting only where the capacity (not the materialized storage) runs out.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from tiny import make_tiny_model_dir

from mlx_infer import _fast
from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer.engine.config import initial_pages, pool_growth
from mlx_infer.errors import MlxInferError
from mlx_infer.generation.bindings.autoregressive import Composition
from mlx_infer.state.paged import LayerKV, PagedKVStore, PagedLayerCache
from mlx_infer.state.paged.growth import PoolGrowth

# -- the C++ pools --------------------------------------------------------------------------


def test_a_pool_hands_out_only_materialized_ids_and_grows_in_id_order():
    p = _fast.PagePool(num_pages=10, page_size=4, materialized=3)
    assert (p.num_pages, p.materialized, p.num_free_pages(), p.num_unmaterialized_pages()) == (10, 3, 2, 7)
    p.add_sequence(1)
    assert p.append(1, 12) is None and p.length(1) == 0  # 3 pages needed, 2 materialized: nothing changed
    assert p.grow(6) == 3 and p.materialized == 6 and p.num_free_pages() == 5
    assert p.append(1, 12).slots == list(range(4, 16)) and p.block_table(1) == [1, 2, 3]
    p.add_sequence(2)
    assert p.append(2, 8).writes == [(4, 0), (4, 1), (4, 2), (4, 3), (5, 0), (5, 1), (5, 2), (5, 3)]
    p.free(1)  # pages 3, 2, 1 back (tail first), behind nothing: the free queue is [3, 2, 1]
    assert p.grow(8) == 2  # ids 6, 7 join behind the freed ones
    p.add_sequence(3)
    p.append(3, 20)
    assert p.block_table(3) == [3, 2, 1, 6, 7] and p.num_free_pages() == 0
    p.check()
    assert p.grow(8) == 0  # already there: nothing added
    with pytest.raises(ValueError, match="never shrinks"):
        p.grow(5)
    with pytest.raises(ValueError, match="num_pages = 10"):
        p.grow(11)
    for bad in (1, 11):
        with pytest.raises(ValueError, match="materialized must be in"):
            _fast.PagePool(num_pages=10, page_size=4, materialized=bad)
    assert _fast.PagePool(num_pages=10, page_size=4).materialized == 10  # default: every page


def test_page_groups_need_and_grow_per_group():
    g = _fast.PageGroups(num_pages=[10, 8], page_size=4, windows=[0, 8], slack=0, materialized=[3, 4])
    assert [g.pool(i).materialized for i in (0, 1)] == [3, 4]
    g.add_sequence(1)
    g.add_sequence(2)
    assert g.pages_needed([1, 2], [9, 2]) == [4, 4]
    assert g.append_batch([1, 2], [9, 2]) is None  # group 0 has 2 free pages
    assert g.grow(0, 6) == 3 and g.grow(1, 5) == 1
    plan = g.append_batch([1, 2], [9, 2])
    assert plan is not None and plan.real_rows == 11
    g.check()
    with pytest.raises(ValueError, match="out of range"):
        g.grow(2, 9)
    with pytest.raises(ValueError, match="one materialized size per group"):
        _fast.PageGroups(num_pages=[10, 8], page_size=4, windows=[0, 8], slack=0, materialized=[3])


def test_the_growth_target_adds_headroom_rounded_to_the_granule():
    g = PoolGrowth(headroom=0.25, granule=64)
    assert g.target(192, 28, 4096) == 320  # (192 + 28) x 1.25 = 275 -> 320
    assert g.target(192, 28, 300) == 300  # capped at the capacity
    assert g.target(192, 0, 4096) == 192  # nothing short: no growth
    assert g.initial(4096) == 64 and g.initial(40) == 40 and PoolGrowth(granule=1).initial(4096) == 2
    assert PoolGrowth(headroom=0, granule=1).target(5, 3, 100) == 8


# -- the store --------------------------------------------------------------------------------

D = 32


def write(store: PagedKVStore, seq, n: int, rng: np.random.Generator) -> list[tuple[mx.array, mx.array]]:
    """One step of ``n`` random tokens through every layer's cache; returns what each layer read."""
    caches = store.make_cache(seq)
    out = []
    for c in caches:
        k = mx.array(rng.standard_normal((1, 2, n, D)).astype(np.float32))  # (1, KVH, n, D)
        v = mx.array(rng.standard_normal((1, 2, n, D)).astype(np.float32))
        out.append(c.update_and_fetch(k, v))
    return out


def snapshot(store: PagedKVStore) -> list[list[np.ndarray]]:
    return [[np.array(p) for p in s.parts] for s in store.storage]


def test_growth_keeps_every_written_page_and_id_plain_and_quantized():
    rng = np.random.default_rng(0)
    store = PagedKVStore(num_layers=2, num_pages=12, page_size=4, materialized=3, dtype=mx.float32,
                         kv_scheme=[LayerKV(), LayerKV(bits=8, group_size=32)], head_dim=D,
                         growth=PoolGrowth(headroom=0.0, granule=1))
    a = store.add_sequence()
    write(store, a, 5, rng)  # 2 pages: exactly the materialized free ones
    assert store.growths == 0 and all(s.num_pages == 3 for s in store.storage)
    before, table = snapshot(store), a.block_table
    b = store.add_sequence()
    write(store, b, 9, rng)  # 3 more pages: the storage grows first
    assert store.growths == 1 and store.materialized == [6] and all(s.num_pages == 6 for s in store.storage)
    assert a.block_table == table and max(b.block_table) < 6
    after = snapshot(store)
    for old, new in zip(before, after):
        for p_old, p_new in zip(old, new):  # plain K/V, packed, scales, biases alike
            assert p_new.shape[0] == 6 and np.array_equal(p_new[:3], p_old)
    # A reads back its 5 tokens (and one new) from the grown storage exactly as written.
    keys_before = write(store, a, 1, np.random.default_rng(1))[0][0]  # (1, KVH, 6, D) plain layer
    assert np.array_equal(np.array(keys_before)[0, :, :5], np.concatenate(
        [before[0][0][p] for p in table], axis=1)[:, :5])
    # Up to the capacity and no further: an append the capacity cannot hold fails, no growth.
    c = store.add_sequence()
    write(store, c, 20, rng)  # 5 pages: grows to 11 (the null page and 10 used)
    assert store.materialized == [11]
    d = store.add_sequence()
    assert not d.reserve(8) and store.materialized == [11] and store.free_pages() == [1]
    assert d.reserve(4) and store.materialized == [12]
    store.pages.check()


def test_a_store_without_growth_and_bad_sizes():
    store = PagedKVStore(num_layers=1, num_pages=8, page_size=4, materialized=2)
    s = store.add_sequence()
    assert not s.reserve(8) and store.free_pages() == [7]  # no policy: nothing grows by itself
    assert store.grow(4) and store.materialized == [4] and s.reserve(8)
    with pytest.raises(MlxInferError, match="capacity is 8"):
        store.grow(9)
    for bad in (1, 9, 2.5):
        with pytest.raises(MlxInferError, match=r"materialized pages of the global group .* \[2, num_pages = 8\]"):
            PagedKVStore(num_layers=1, num_pages=8, page_size=4, materialized=bad)
    with pytest.raises(MlxInferError, match="one per group"):
        PagedKVStore(num_layers=2, num_pages=8, page_size=4, layer_windows=[None, 4], materialized=[2, 2, 2])
    for bad in (dict(headroom=-0.1), dict(headroom=float("inf")), dict(granule=0), dict(granule=2.0)):
        with pytest.raises(MlxInferError, match="PoolGrowth"):
            PoolGrowth(**bad)
    with pytest.raises(MlxInferError, match="grow_pool must be True, False, a PoolGrowth or None"):
        EngineConfig(grow_pool="yes")


# -- the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = load_model(make_tiny_model_dir(tmp_path_factory.mktemp(family), family))
        return cache[family]
    return get


def greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):  # the plain model over the whole sequence each time: the reference
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1]).item()))
    return ids[len(prompt):]


PROMPTS = [[(11 * i + 5 * j) % 290 + 5 for j in range(n)] for i, n in enumerate((10, 41, 23, 6, 30))]
TINY_GROWTH = PoolGrowth(headroom=0.0, granule=1)  # grows at nearly every step that needs a page


def serve(loaded, *, mixed: bool, grow, compiled: bool = True, num_pages: int = 96, max_batch: int = 4,
          prefix_cache: bool = True, max_tokens: int = 12, prepare=None,
          kv_scheme=None) -> tuple[list[list[int]], Engine]:
    """The PROMPTS, one submitted at first and the rest while it decodes."""
    engine = Engine(loaded, EngineConfig(page_size=4, prefill_step_size=8, num_pages=num_pages, max_batch=max_batch,
                                         mixed_steps=mixed, grow_pool=grow, prefix_cache=prefix_cache,
                                         kv_scheme=kv_scheme),
                    composition=Composition(compiled_decode=compiled))
    if prepare is not None:
        prepare(engine)
    req = dict(max_tokens=max_tokens, detokenize=False, ignore_eos=True)
    first = engine.submit(EngineRequest(prompt_ids=PROMPTS[0], **req))
    for _ in range(3):
        engine.step()
    later = [engine.submit(EngineRequest(prompt_ids=p, **req)) for p in PROMPTS[1:]]
    engine.run_until_idle()
    return [h.result(1).token_ids for h in [first] + later], engine


@pytest.mark.parametrize("family,mixed,compiled", [("llama", True, True), ("llama", False, True),
                                                   ("llama", False, False), ("gemma3", True, True)])
def test_an_engine_that_grows_many_times_gives_the_preallocated_tokens(models, family, mixed, compiled):
    loaded = models(family)
    grown, engine = serve(loaded, mixed=mixed, grow=TINY_GROWTH, compiled=compiled)
    full, other = serve(loaded, mixed=mixed, grow=False, compiled=compiled)
    assert grown == full
    assert grown[1] == greedy(loaded.model, PROMPTS[1], 12)
    assert engine.store.growths >= 3 and other.store.growths == 0
    assert other.store.materialized == [g.num_pages for g in other.store.groups]
    materialized = engine.store.materialized
    assert all(m < g.num_pages for m, g in zip(materialized, engine.store.groups))  # never needed the cap
    assert [s.num_pages for s in engine.store.storage] == [materialized[g] for g in engine.store.layer_group]
    if compiled:
        assert engine.paged_decode.failures == 0 and engine.paged_decode.retraces == 0
    if mixed:
        assert engine.mixed_steps > 0 and engine.paged_decode.eager_steps == 0
    stats = engine.stats()
    assert stats["kv_pool_growths_total"] == engine.store.growths
    assert stats["kv_pages_materialized"] == sum(m - 1 for m in materialized)
    assert stats["kv_pages_free"] == stats["kv_pages_total"]  # idle: the whole capacity is allocatable
    assert "mlx_infer_kv_pool_growths_total" in engine.prometheus()
    engine.store.pages.check()


def test_quantized_kv_grows_with_the_preallocated_tokens(models):
    """8-bit KV (packed parts, scales and biases grow alike; the eager paged path)."""
    loaded = models("qwen3")  # head_dim 32: a quantization group of 32
    q8 = LayerKV(bits=8, group_size=32)
    grown, engine = serve(loaded, mixed=False, grow=TINY_GROWTH, kv_scheme=q8)
    full, _ = serve(loaded, mixed=False, grow=False, kv_scheme=q8)
    assert grown == full and engine.store.growths >= 3 and engine.paged_decode is None
    assert all(len(s.parts) == 6 and {p.shape[0] for p in s.parts} == {engine.store.materialized[0]}
               for s in engine.store.storage)


def test_preemption_happens_only_where_the_capacity_runs_out(models):
    """A pool too small for the load: the growing engine preempts exactly when and as often as the
    preallocated one (no prefix cache, so both hold the same pages), each time with every page
    materialized, and gives the same tokens."""
    loaded = models("llama")

    def recorder(into: list) -> callable:
        def prepare(engine: Engine) -> None:
            inner = engine.scheduler.preempt

            def preempt(victim):  # when (forwards so far), whom, and what the capacity had left
                into.append((engine.metrics.forwards_total, victim.order, engine.store.free_pages()))
                return inner(victim)
            engine.scheduler.preempt = preempt
        return prepare

    mine, theirs = [], []
    grown, engine = serve(loaded, mixed=False, grow=TINY_GROWTH, num_pages=20, prefix_cache=False, max_tokens=16,
                          prepare=recorder(mine))
    full, other = serve(loaded, mixed=False, grow=False, num_pages=20, prefix_cache=False, max_tokens=16,
                        prepare=recorder(theirs))
    assert grown == full and grown[1] == greedy(loaded.model, PROMPTS[1], 16)
    assert mine == theirs and len(mine) == engine.metrics.preemptions_total > 0
    assert engine.store.growths > 1 and engine.store.materialized == [20]


def test_admission_reasons_about_the_capacity_and_grows_once_for_a_burst(models):
    loaded = models("llama")
    config = EngineConfig(page_size=4, prefill_step_size=8, num_pages=64, max_batch=8, mixed_steps=False,
                          grow_pool=PoolGrowth(headroom=0.25, granule=4))
    engine = Engine(loaded, config, composition=Composition(compiled_decode=False))
    assert engine.store.materialized == initial_pages([64], pool_growth(engine.config)) == [4]
    for p in PROMPTS:  # 110 prompt tokens: 30 pages, far more than the 3 materialized usable ones
        engine.submit(EngineRequest(prompt_ids=p, max_tokens=4, detokenize=False, ignore_eos=True))
    engine._intake()
    admitted, _ = engine.scheduler.admit()
    assert len(admitted) == len(PROMPTS)  # admitted against the capacity, not the materialized pages
    assert engine.store.growths == 1 and engine.store.materialized[0] >= 30 + len(PROMPTS)
    engine.run_until_idle()
    m0, m = 4, engine.store.materialized[0]
    assert engine.store.growths <= math.floor(math.log(m / m0) / math.log(1.25)) + 1
    assert engine.metrics.preemptions_total == 0


def test_the_prefix_cache_works_in_grown_storage(models):
    loaded = models("llama")
    engine = Engine(loaded, EngineConfig(page_size=4, prefill_step_size=8, num_pages=64, mixed_steps=False,
                                         grow_pool=TINY_GROWTH), composition=Composition(compiled_decode=False))
    shared = PROMPTS[1][:24]
    req = dict(max_tokens=6, detokenize=False, ignore_eos=True)
    first = engine.generate([EngineRequest(prompt_ids=shared + [7, 8], **req)], timeout=60)[0]
    growths = engine.store.growths
    second = engine.generate([EngineRequest(prompt_ids=shared + [9], **req)], timeout=60)[0]
    engine.stop()
    assert growths > 0 and second.cached_tokens == 24
    assert second.token_ids == greedy(loaded.model, shared + [9], 6)
    assert first.token_ids == greedy(loaded.model, shared + [7, 8], 6)


def test_a_mixing_engine_allocates_only_the_initial_pages_and_says_so(models):
    loaded = models("llama")
    engine = Engine(loaded, EngineConfig(page_size=4, prefill_step_size=16, num_pages=500, mixed_steps=True,
                                         grow_pool=PoolGrowth(headroom=0.25, granule=8)))
    assert engine.store.materialized == [8]  # one granule
    assert all(s is not None and s.num_pages == 8 for s in engine.store.storage)
    from mlx_infer.server.run import _pool_summary

    line = _pool_summary(engine)
    assert "499 global" in line and "storage for 7 pages now, growing on demand" in line
    full = Engine(loaded, EngineConfig(page_size=4, prefill_step_size=16, num_pages=500, mixed_steps=True,
                                       grow_pool=False))
    assert all(s.num_pages == 500 for s in full.store.storage) and "growing" not in _pool_summary(full)


def test_serve_preallocates_the_kv_only_when_asked(tmp_path):
    from mlx_infer.cli import build_parser
    from mlx_infer.server.run import ServeOptions, build

    assert build_parser().parse_args(["serve", "--preallocate-kv"]).preallocate_kv is True
    assert build_parser().parse_args(["serve"]).preallocate_kv is False
    d = make_tiny_model_dir(tmp_path / "m", "llama")
    for preallocate in (False, True):
        _, engine, _ = build(ServeOptions(model=str(d), memory_budget_gb=0.05, preallocate_kv=preallocate))
        try:  # the pool lives in the engine's process: asked there
            growth_off, all_materialized = engine.call(_pool_state)
            assert growth_off == preallocate and all_materialized == preallocate
        finally:
            engine.stop()


def _pool_state(engine) -> tuple[bool, bool]:
    store = engine.store
    return store.growth is None, store.materialized == [g.num_pages for g in store.groups]
