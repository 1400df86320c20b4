"""The step plan: PageGroups.append_batch (exact ids, all or nothing) and the eager paged
forward over it (decode rows and prefill-chunk rows in one forward)."""

import mlx.core as mx
import numpy as np
import pytest
from tiny import make_tiny_model_dir

from mlx_infer._fast import PageGroups
from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine.batch import DecodeBatch
from mlx_infer.state.paged import PagedKVStore


def groups(num_pages=(16, 6), window=8, page_size=4):
    return PageGroups(num_pages=list(num_pages), page_size=page_size, windows=[0, window], slack=0)


def ints(a):
    return np.array(a).tolist()


def test_append_batch_returns_the_plan_of_every_row():
    g = groups()
    for sid in (4, 9):
        g.add_sequence(sid)
    assert g.append(4, 5) is not None  # seq 4: pages 1, 2 (global) / 1, 2 (window)
    plan = g.append_batch([4, 9], [1, 2], table_bucket=4)
    assert plan.rows == 3 and (plan.min_length, plan.max_length) == (1, 6)
    assert ints(plan.positions) == [5, 0, 1] and ints(plan.lengths) == [6, 1, 2]
    assert ints(plan.call_ends) == [6, 2, 2]  # start + count: seq 9's chunk rows share its end
    # seq 9's first page is page 3 of each pool; rows of one sequence share its table.
    assert ints(plan.block_tables[0]) == [[1, 2, 0, 0], [3, 0, 0, 0], [3, 0, 0, 0]]
    assert ints(plan.write_slots[0]) == [2 * 4 + 1, 3 * 4, 3 * 4 + 1]
    assert ints(plan.block_tables[1]) == ints(plan.block_tables[0])
    assert plan.num_copies == [0, 0] and plan.copy_src[0].shape == (0,)
    assert g.length(4) == 6 and g.length(9) == 2
    g.check()


def test_append_batch_is_all_or_nothing_and_rejects_bad_input():
    g = groups(num_pages=(4, 6))  # 3 usable global pages
    for sid in (1, 2):
        g.add_sequence(sid)
    assert g.append_batch([1, 2], [4, 4]) is not None  # one page each
    free = g.pool(0).num_free_pages()
    assert g.append_batch([1, 2], [1, 1]) is None  # each needs a new page, one is free
    assert (g.length(1), g.length(2), g.pool(0).num_free_pages()) == (4, 4, free)
    with pytest.raises(ValueError, match="listed twice"):
        g.append_batch([1, 1], [1, 1])
    with pytest.raises(ValueError, match="counts must be >= 1"):
        g.append_batch([1], [0])
    with pytest.raises(ValueError, match="one count per sequence"):
        g.append_batch([1, 2], [1])
    with pytest.raises(ValueError, match="unknown sequence id 7"):
        g.append_batch([7], [1])
    g.check()


def test_append_batch_copies_a_shared_last_page():
    g = groups()
    g.add_sequence(1)
    g.append(1, 3)
    g.fork(1, 2)
    plan = g.append_batch([1, 2], [1, 1])
    # The first row to write the shared last page copies it; the second is then its sole owner.
    assert plan.num_copies == [1, 1]  # one copy per group
    src, dst = ints(plan.copy_src[0]), ints(plan.copy_dst[0])
    assert src == [1] and dst != [1]
    assert ints(plan.block_tables[0])[0][0] != ints(plan.block_tables[0])[1][0]
    g.check()


def test_gather_index_reads_the_window_and_pads_to_the_null_page():
    g = groups(window=4)
    for sid in (1, 2):
        g.add_sequence(sid)
    g.append(1, 5)
    plan = g.append_batch([1, 2], [1, 2])  # lengths 6; 1, 2
    pages, offs, valid = plan.gather_index(0, 0, 4)  # global: S = 6 -> 8
    t1, t2 = ints(plan.block_tables[0])[0], ints(plan.block_tables[0])[1]
    assert ints(valid) == [[1] * 6 + [0, 0], [1] + [0] * 7, [1, 1] + [0] * 6]
    assert ints(pages)[0][:6] == [t1[0]] * 4 + [t1[1]] * 2 and ints(offs)[0][:6] == [0, 1, 2, 3, 0, 1]
    assert ints(pages)[2][:2] == [t2[0]] * 2 and ints(pages)[0][6:] == [0, 0]
    pages, offs, valid = plan.gather_index(1, 4, 1)  # window 4: row 0 reads positions 2..5
    w1 = ints(plan.block_tables[1])[0]
    assert ints(offs)[0] == [2, 3, 0, 1] and ints(pages)[0] == [w1[0], w1[0], w1[1], w1[1]]
    assert ints(valid)[1] == [1, 0, 0, 0]
    with pytest.raises(ValueError, match="out of range"):
        plan.gather_index(2, 0, 1)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("plan") / request.param, request.param))


def test_one_forward_of_decode_rows_and_a_prefill_chunk_matches_the_plain_model(tiny):
    """Sequence A decodes one token while sequence B prefills 12 tokens as 12 rows of the same
    forward: each row's logits equal the plain model's at that position."""
    model = tiny.model
    a = [5, 9, 17, 33, 60, 71, 80, 90, 101, 7]  # 10 tokens: 9 cached, 1 decoded
    b = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    store = PagedKVStore.for_model(model, num_pages=64, page_size=4)
    sa, sb = store.add_sequence(), store.add_sequence()
    model.model(mx.array([a[:-1]]), cache=store.make_cache(sa))  # A's first 9 tokens in pages
    batch = DecodeBatch(store, [sa, sb], [1, len(b)])
    assert batch.reserve() and batch.rows == 1 + len(b)
    tokens = mx.array([a[-1]] + b)[:, None]  # (R, 1)
    logits = model(tokens, cache=batch.caches)[:, -1, :]  # (R, vocab)
    batch.commit()
    assert sa.offsets == [10] * store.num_layers and sb.offsets == [12] * store.num_layers
    ref_a = model(mx.array([a]))[0, -1]
    ref_b = model(mx.array([b]))[0]  # (12, vocab)
    tol = 1e-4  # float32 both ways; the gather order of keys differs from the plain cache
    assert mx.allclose(logits[0], ref_a, atol=tol, rtol=tol).item()
    assert mx.allclose(logits[1:], ref_b, atol=tol, rtol=tol).item()


def test_row_bucket_pads_with_null_page_rows_after_the_real_ones():
    g = groups()
    g.add_sequence(1)
    plan = g.append_batch([1], [3], row_bucket=8)
    assert (plan.rows, plan.real_rows) == (8, 3)
    assert ints(plan.positions) == [0, 1, 2] + [0] * 5 and ints(plan.lengths) == [1, 2, 3] + [1] * 5
    assert ints(plan.call_ends) == [3, 3, 3] + [1] * 5
    assert ints(plan.write_slots[0])[3:] == [0] * 5 and ints(plan.block_tables[0])[3:] == [[0]] * 5
    assert g.length(1) == 3  # padding grows no sequence
    g.check()


ON_CUDA = mx.default_device().type == mx.DeviceType.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


def test_prefetch_to_gpu_is_a_hint_that_keeps_the_values(monkeypatch):
    """The step plan's buffer is prefetched to the GPU when made (cpp/kv/prefetch.cpp): on CUDA a
    prefetch is issued and the values a kernel then reads are the host's; elsewhere nothing happens.
    ``MLX_INFER_PREFETCH_PLAN=0`` turns it off; an unevaluated array is refused by name."""
    from mlx_infer import _fast

    a = mx.array(np.arange(300, dtype=np.int32))  # made from host data: evaluated
    issued = _fast.prefetch_to_gpu(a)
    assert issued == ON_CUDA, _fast.prefetch_error()
    assert _fast.prefetch_error() == ""
    assert mx.sum(a * 2).item() == 2 * sum(range(300))  # a kernel reads the prefetched pages
    monkeypatch.setenv("MLX_INFER_PREFETCH_PLAN", "0")
    assert _fast.prefetch_to_gpu(mx.array(np.arange(300, dtype=np.int32))) is False
    monkeypatch.delenv("MLX_INFER_PREFETCH_PLAN")
    assert _fast.prefetch_to_gpu(mx.array([1, 2])) is False  # 8 bytes: MLX's small pool, read in place
    with pytest.raises(ValueError, match="must be evaluated"):
        _fast.prefetch_to_gpu(mx.arange(4) + 1)
    # The plan made with prefetching on reads back the same (a step over it is the engine tests' part).
    g = groups()
    g.add_sequence(1)
    plan = g.append_batch([1], [3], table_bucket=2)
    assert ints(plan.positions) == [0, 1, 2] and ints(plan.write_slots[0]) == [4, 5, 6]
    assert _fast.prefetch_error() == ""


def test_host_array_is_mx_array_of_the_values():
    """engine/host_arrays.py: the engine's host-made step inputs, prefetched on CUDA, equal mx.array's."""
    from mlx_infer.engine.host_arrays import host_array

    for values, dtype in (([[1, 2, 3], [4, 5, 6]], mx.uint32), ([7], mx.int32), (list(range(100)), mx.int32)):
        a = host_array(values, dtype)
        assert a.dtype == dtype and a.tolist() == values
