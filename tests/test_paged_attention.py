"""``_fast.paged_attention``: attention of one query per row read through block tables.

Oracle: a float64 numpy attention over each row's keys ``[max(0, len - window), len)``
fetched through its table. Inputs are fresh random draws per case: shuffled
distinct pages per row (so a wrong page or offset shows), GQA groups 1/2/4,
windows shorter and longer than the rows, lengths 1..300, pages of 8 and 16
tokens, float32/bfloat16/float16. Checks ``‖out - ref‖ / ‖ref‖`` of the CPU
kernel (``impl="auto"`` on the CPU) and of the gather reference, the op inside
``mx.compile``, rows of length 0 (zeros), and the errors for bad shapes. With a soft
cap (Gemma 2: each score ``s`` becomes ``cap * tanh(s / cap)`` before the softmax) the
same against the reference capped likewise, and ``softcap=0`` is exactly the uncapped op.
With attention sinks (gpt-oss: a per-head logit joins each softmax, with no value) the same
against the reference with the sink in its denominator, rows of length 0 get zeros, and the
sinks' shape is checked.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer import _fast
from test_qkv_rope import ON_CUDA

#: The kernel the op runs where these tests run (the CUDA machine runs them too; Metal has none: the gather).
BACKEND = "cuda" if ON_CUDA else "cpu" if mx.default_device().type == mx.DeviceType.cpu else "gather"

# float32 accumulation in both; the bound covers the inputs' rounding (bf16 q/k/v: ~3e-3 measured).
TOL = {mx.float32: 1e-5, mx.bfloat16: 1e-2, mx.float16: 2e-3}


def make_case(rng, R, H, KVH, D, P, max_len, dtype, min_len=1):
    lengths = rng.integers(min_len, max_len + 1, size=R).astype(np.int32)
    T = int(-(-lengths.max() // P)) + 2  # two pages of padding past the longest row
    pages = 1 + R * T
    tables = rng.permutation(np.arange(1, pages))[: R * T].reshape(R, T).astype(np.int32)
    for r in range(R):  # entries past a row's end are the null page, as the engine pads them
        tables[r, -(-lengths[r] // P):] = 0
    q = rng.standard_normal((R, H, D)).astype(np.float32)
    k = rng.standard_normal((pages, KVH, P, D)).astype(np.float32)
    v = rng.standard_normal((pages, KVH, P, D)).astype(np.float32)
    return [mx.array(x).astype(dtype) for x in (q, k, v)] + [mx.array(tables), mx.array(lengths)]


def reference(q, k, v, tables, lengths, window, scale, softcap=0.0, sinks=None):
    q, k, v = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v))
    sinks = None if sinks is None else np.array(sinks.astype(mx.float32), dtype=np.float64)
    tables, lengths = np.array(tables), np.array(lengths)
    R, H, D = q.shape
    KVH, P = k.shape[1], k.shape[2]
    out = np.zeros((R, H, D))
    for r in range(R):
        n = int(lengths[r])
        pos = np.arange(max(0, n - window) if window > 0 else 0, n)
        if len(pos) == 0:
            continue
        keys, vals = k[tables[r, pos // P], :, pos % P], v[tables[r, pos // P], :, pos % P]  # (S, KVH, D)
        for h in range(H):
            s = keys[:, h // (H // KVH)] @ q[r, h] * scale
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            top = s.max() if sinks is None else max(s.max(), sinks[h])
            w = np.exp(s - top)
            den = w.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
            out[r, h] = w / den @ vals[:, h // (H // KVH)]
    return out


def rel(out, ref):
    o = np.array(out.astype(mx.float32), dtype=np.float64)
    assert np.isfinite(o).all()
    return np.linalg.norm(o - ref) / np.linalg.norm(ref)


CASES = [  # R, H, KVH, D, P, max_len, window, dtype
    (4, 8, 2, 32, 8, 300, 0, mx.float32),
    (5, 4, 1, 64, 16, 300, 37, mx.float32),
    (3, 4, 4, 16, 8, 120, 200, mx.float32),   # window longer than every row
    (6, 8, 2, 32, 16, 300, 16, mx.bfloat16),  # window of exactly one page
    (2, 8, 4, 64, 8, 257, 0, mx.float16),
    (7, 4, 2, 32, 8, 9, 5, mx.bfloat16),      # short rows, one or two pages
]


@pytest.mark.parametrize("R,H,KVH,D,P,max_len,window,dtype", CASES)
def test_kernel_and_gather_match_float64_reference(R, H, KVH, D, P, max_len, window, dtype):
    rng = np.random.default_rng(R * 1000 + D + window)
    q, k, v, tab, lens = make_case(rng, R, H, KVH, D, P, max_len, dtype)
    scale = D ** -0.5
    ref = reference(q, k, v, tab, lens, window, scale)
    assert _fast.paged_attention_backend(q, k) == BACKEND
    got = _fast.paged_attention(q, k, v, tab, lens, window=window, scale=scale)
    gathered = _fast.paged_attention(q, k, v, tab, lens, window=window, scale=scale, impl="gather")
    assert got.shape == q.shape and got.dtype == q.dtype
    assert rel(got, ref) <= TOL[dtype]
    assert rel(gathered, ref) <= 2 * TOL[dtype]


SOFTCAP_CASES = [  # R, H, KVH, D, P, max_len, window, dtype, cap: caps that bind (|s| up to ~3x the cap) and not
    (4, 8, 2, 32, 8, 300, 0, mx.float32, 1.0),
    (5, 4, 1, 64, 16, 200, 37, mx.float32, 50.0),
    (6, 8, 2, 32, 16, 300, 16, mx.bfloat16, 2.0),
    (3, 8, 4, 64, 8, 257, 0, mx.float16, 0.5),
]


@pytest.mark.parametrize("R,H,KVH,D,P,max_len,window,dtype,cap", SOFTCAP_CASES)
def test_softcap_kernel_and_gather_match_float64_reference(R, H, KVH, D, P, max_len, window, dtype, cap):
    rng = np.random.default_rng(R * 1000 + D + window + 1)
    q, k, v, tab, lens = make_case(rng, R, H, KVH, D, P, max_len, dtype)
    q = q * 3  # scores of a few units: a cap of 0.5..2 bends them, 50 hardly does
    scale = D ** -0.5
    ref = reference(q, k, v, tab, lens, window, scale, softcap=cap)
    uncapped = reference(q, k, v, tab, lens, window, scale)
    got = _fast.paged_attention(q, k, v, tab, lens, window=window, scale=scale, softcap=cap)
    gathered = _fast.paged_attention(q, k, v, tab, lens, window=window, scale=scale, softcap=cap, impl="gather")
    assert rel(got, ref) <= TOL[dtype]
    assert rel(gathered, ref) <= 2 * TOL[dtype]
    if cap < 10:  # the cap binds: the capped reference is far from the uncapped one, so the check has teeth
        assert rel(got, uncapped) > 10 * TOL[dtype]
    fn = mx.compile(lambda *a: _fast.paged_attention(*a, window=window, scale=scale, softcap=cap))
    assert rel(fn(q, k, v, tab, lens), ref) <= TOL[dtype]


def test_softcap_zero_is_the_uncapped_op():
    rng = np.random.default_rng(11)
    q, k, v, tab, lens = make_case(rng, 4, 8, 2, 32, 8, 100, mx.float32)
    for impl in ("auto", "gather"):
        plain = _fast.paged_attention(q, k, v, tab, lens, window=20, scale=0.3, impl=impl)
        zero = _fast.paged_attention(q, k, v, tab, lens, window=20, scale=0.3, softcap=0.0, impl=impl)
        assert mx.array_equal(plain, zero)
    with pytest.raises(ValueError, match="softcap"):
        _fast.paged_attention(q, k, v, tab, lens, scale=0.3, softcap=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        _fast.paged_attention(q, k, v, tab, lens, scale=0.3, softcap=float("nan"))


SINK_CASES = [  # R, H, KVH, D, P, max_len, window, dtype, softcap: sinks of about the scores' size, GQA 1/2/4
    (4, 8, 2, 32, 8, 300, 0, mx.float32, 0.0),
    (5, 4, 4, 64, 16, 120, 37, mx.float32, 0.0),
    (6, 8, 2, 32, 16, 300, 16, mx.bfloat16, 0.0),
    (3, 8, 2, 64, 8, 100, 0, mx.float32, 2.0),  # with a soft cap too: the kernels and the composed gather
]


@pytest.mark.parametrize("R,H,KVH,D,P,max_len,window,dtype,cap", SINK_CASES)
def test_sinks_kernel_and_gather_match_float64_reference(R, H, KVH, D, P, max_len, window, dtype, cap):
    rng = np.random.default_rng(R * 100 + D + window + 7)
    q, k, v, tab, lens = make_case(rng, R, H, KVH, D, P, max_len, dtype)
    sinks = mx.array(rng.normal(2.0, 1.5, size=H).astype(np.float32)).astype(dtype)  # heads weigh the sink apart
    scale = D ** -0.5
    ref = reference(q, k, v, tab, lens, window, scale, softcap=cap, sinks=sinks)
    kw = dict(window=window, scale=scale, softcap=cap, sinks=sinks)
    got = _fast.paged_attention(q, k, v, tab, lens, **kw)
    gathered = _fast.paged_attention(q, k, v, tab, lens, impl="gather", **kw)
    assert rel(got, ref) <= TOL[dtype]
    assert rel(gathered, ref) <= 2 * TOL[dtype]
    # the sinks take a share of every softmax: far from the attention without them
    assert rel(got, reference(q, k, v, tab, lens, window, scale, softcap=cap)) > 10 * TOL[dtype]
    fn = mx.compile(lambda *a: _fast.paged_attention(*a, **kw))
    assert rel(fn(q, k, v, tab, lens), ref) <= TOL[dtype]


def test_sinks_zero_length_rows_and_shapes():
    rng = np.random.default_rng(5)
    q, k, v, tab, _ = make_case(rng, 3, 4, 2, 16, 8, 30, mx.float32)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    out = np.array(_fast.paged_attention(q, k, v, tab, mx.array([0, 12, 0], mx.int32), scale=0.25, sinks=sinks))
    assert (out[[0, 2]] == 0).all() and np.abs(out[1]).sum() > 0
    with pytest.raises(ValueError, match=r"sinks must be \(H,\)"):
        _fast.paged_attention(q, k, v, tab, mx.array([1, 2, 3], mx.int32), scale=0.25, sinks=sinks[:3])


def test_inside_compile_and_mixed_kv_dtype():
    rng = np.random.default_rng(7)
    q, k, v, tab, lens = make_case(rng, 5, 8, 2, 32, 8, 200, mx.float32)
    fn = mx.compile(lambda *a: _fast.paged_attention(*a, window=50, scale=0.2))
    ref = reference(q, k, v, tab, lens, 50, 0.2)
    assert rel(fn(q, k, v, tab, lens), ref) <= TOL[mx.float32]
    # bfloat16 storage under float32 queries: K/V are read as stored.
    kb, vb = k.astype(mx.bfloat16), v.astype(mx.bfloat16)
    ref_b = reference(q, kb, vb, tab, lens, 0, 0.2)
    assert rel(_fast.paged_attention(q, kb, vb, tab, lens, scale=0.2), ref_b) <= TOL[mx.float32]


def test_zero_length_rows_get_zeros():
    rng = np.random.default_rng(3)
    q, k, v, tab, _ = make_case(rng, 3, 4, 2, 16, 8, 30, mx.float32)
    lens = mx.array([0, 12, 0], mx.int32)
    out = np.array(_fast.paged_attention(q, k, v, tab, lens, scale=0.25))
    assert (out[[0, 2]] == 0).all() and np.abs(out[1]).sum() > 0


def test_bad_shapes_raise_clear_errors():
    rng = np.random.default_rng(1)
    q, k, v, tab, lens = make_case(rng, 2, 4, 2, 16, 8, 20, mx.float32)
    with pytest.raises(ValueError, match="q must be"):
        _fast.paged_attention(q[0], k, v, tab, lens, scale=1.0)
    with pytest.raises(ValueError, match="multiple"):
        _fast.paged_attention(q[:, :3], k, v, tab, lens, scale=1.0)
    with pytest.raises(ValueError, match="block_tables"):
        _fast.paged_attention(q, k, v, tab[:1], lens, scale=1.0)
    with pytest.raises(ValueError, match="lengths"):
        _fast.paged_attention(q, k, v, tab, lens.astype(mx.int64), scale=1.0)
    with pytest.raises(ValueError, match="impl"):
        _fast.paged_attention(q, k, v, tab, lens, scale=1.0, impl="flash")


def test_split_count_grows_for_few_long_rows():
    assert _fast.paged_attention_splits(256, 8, 4096) == 1  # rows x heads fill the GPU already
    assert _fast.paged_attention_splits(1, 8, 4096) > 8     # one long row: flash decoding
    assert _fast.paged_attention_splits(1, 8, 40) == 1      # too few keys to split


def test_split_floor_is_read_at_each_call(monkeypatch):
    """MLX_INFER_PAGED_ATTN_MIN_SPLIT_KEYS (an A/B of the split count): 64 keys a split by default, the
    variable's floor where set, bad values refused with the variable named."""
    monkeypatch.delenv("MLX_INFER_PAGED_ATTN_MIN_SPLIT_KEYS", raising=False)
    assert _fast.paged_attention_splits(1, 8, 640) == 10    # 640 keys, at least 64 a split
    monkeypatch.setenv("MLX_INFER_PAGED_ATTN_MIN_SPLIT_KEYS", "32")
    assert _fast.paged_attention_splits(1, 8, 640) == 20
    monkeypatch.setenv("MLX_INFER_PAGED_ATTN_MIN_SPLIT_KEYS", "16")
    assert _fast.paged_attention_splits(1, 8, 640) == 32    # at most 32 splits
    for bad in ("0", "many"):
        monkeypatch.setenv("MLX_INFER_PAGED_ATTN_MIN_SPLIT_KEYS", bad)
        with pytest.raises(ValueError, match=f"MLX_INFER_PAGED_ATTN_MIN_SPLIT_KEYS='{bad}' is not an integer in"):
            _fast.paged_attention_splits(1, 8, 640)
