"""The paged-attention CUDA kernels' source text, run on the CPU (tests/cuda_emulation.py), against the float64
reference of tests/test_paged_attention.py: unsplit and split-K (the merge kernel), a window, a soft cap
(Gemma 2), attention sinks (gpt-oss), both, and a row of length 0 (zeros). Float32; the kernels keep every
sum in float32, so ``‖out - ref‖ / ‖ref‖`` <= :data:`TOL` (measured <= 2.3e-7). The GPU run of
benchmarks/gpu_paged_attention.py checks the same kernels under NVRTC on the device.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import compiler, run
from mlx_infer import _fast
from test_paged_attention import reference

TOL = 1e-5

CASES = [  # R, H, KVH, D, P, max_len, window, softcap, sinks
    (2, 8, 2, 64, 16, 200, 0, 0.0, False),   # split: pass 1 partials, then the merge
    (2, 4, 1, 128, 8, 200, 37, 2.0, False),  # unsplit (the window bounds the keys), capped
    (2, 8, 2, 64, 16, 200, 0, 1.0, True),    # split, capped, with sinks (joined in the merge)
    (2, 8, 4, 16, 4, 200, 50, 0.5, True),    # unsplit with sinks (joined in pass 1)
    (3, 4, 1, 128, 8, 150, 37, 0.0, False),  # unsplit (a window), plain
]


#: Pass 1's key pipelines (kU sets per warp and iteration, kPrefetch): the default first, the kernel before the
#: knob (one set, prefetched), and the others MLX_INFER_PAGED_ATTN_UNROLL / _PREFETCH select.
PIPELINES = [(2, False), (1, True), (4, False), (2, True), (8, False)]


#: Every case with the default pipeline; the plain ones (no cap, no sinks) with every pipeline.
PARAMS = [c + p for c in CASES for p in PIPELINES if p == PIPELINES[0] or (c[7] == 0.0 and not c[8])]


def inputs(seed: int, R: int, H: int, KVH: int, D: int, P: int, max_len: int, cap: float, with_sinks: bool):
    """Float32 q (R, H, D), K/V storage (pages, KVH, P, D), shuffled tables (R, T), lengths with the longest row
    first and an empty one last, and sinks (H,) or None. Asserts the emulation can be built: the project builds
    with a C++ compiler (README); without g++ these tests cannot check anything, so they fail, loudly."""
    assert compiler() is not None, "g++ (C++20, <barrier>) is needed to build the CUDA kernels' text for the CPU"
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, size=R).astype(np.int32)
    lengths[0], lengths[-1] = max_len, 0  # the longest row, and one that attends to nothing
    T = int(-(-lengths.max() // P)) + 1
    pages = 1 + R * T
    tables = rng.permutation(np.arange(1, pages))[: R * T].reshape(R, T).astype(np.int32)
    q = (rng.standard_normal((R, H, D)) * (3 if cap else 1)).astype(np.float32)
    k = rng.standard_normal((pages, KVH, P, D)).astype(np.float32)
    v = rng.standard_normal((pages, KVH, P, D)).astype(np.float32)
    sinks = rng.normal(np.log(max_len) + 1, 1.0, size=H).astype(np.float32) if with_sinks else None
    return q, k, v, tables, lengths, sinks


@pytest.mark.parametrize("R,H,KVH,D,P,max_len,window,cap,with_sinks,unroll,prefetch", PARAMS)
def test_cuda_kernel_text_matches_float64_reference(tmp_path, R, H, KVH, D, P, max_len, window, cap, with_sinks,
                                                    unroll, prefetch):
    q, k, v, tables, lengths, sinks = inputs(R * 31 + D + window, R, H, KVH, D, P, max_len, cap, with_sinks)
    T = tables.shape[1]
    scale = D ** -0.5
    max_keys = min(window, T * P) if window > 0 else T * P
    splits = _fast.paged_attention_splits(R, KVH, max_keys)  # what cuda_paged_attention launches
    assert (splits > 1) == (window == 0)  # the cases cover both launches
    got = run(tmp_path, q, k, v, tables, lengths, window=window, scale=scale, softcap=cap, sinks=sinks, splits=splits,
              unroll=unroll, prefetch=prefetch)
    ref = reference(mx.array(q), mx.array(k), mx.array(v), mx.array(tables), mx.array(lengths), window, scale,
                    softcap=cap, sinks=None if sinks is None else mx.array(sinks))
    assert np.isfinite(got).all() and (got[-1] == 0).all()
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"splits={splits} cap={cap} sinks={with_sinks} unroll={unroll} prefetch={prefetch}: {rel:.2e}")
    assert rel <= TOL


@pytest.mark.parametrize("R,H,KVH,D,P,max_len,window,cap,with_sinks",
                         [c for c in CASES if c[6] == 0])  # the split launches
def test_one_pass_merge_matches_the_two_kernels(tmp_path, R, H, KVH, D, P, max_len, window, cap, with_sinks):
    """The paged step's split launch, its merge inside pass 1 (the last split of each (row, KV head) merges),
    gives the two-kernel launch's output exactly (the same float32 arithmetic in the same order) and leaves
    every split counter zero for the next launch."""
    q, k, v, tables, lengths, sinks = inputs(7 * R + D, R, H, KVH, D, P, max_len, cap, with_sinks)
    splits = _fast.paged_attention_splits(R, KVH, tables.shape[1] * P)
    assert splits > 1
    kw = dict(window=window, scale=D ** -0.5, softcap=cap, sinks=sinks, splits=splits)
    two = run(tmp_path / "two", q, k, v, tables, lengths, **kw)
    counts: list = []
    one = run(tmp_path / "one", q, k, v, tables, lengths, **kw, one_pass=True, counts_out=counts)
    np.testing.assert_array_equal(one, two)
    assert counts[0].shape == (R * KVH,) and not counts[0].any()


def test_key_pipeline_knobs_read_with_clear_errors(monkeypatch):
    """The CUDA kernel's key pipeline as a trace reads it: the tuned default, each knob, bad values refused."""
    monkeypatch.delenv("MLX_INFER_PAGED_ATTN_UNROLL", raising=False)
    monkeypatch.delenv("MLX_INFER_PAGED_ATTN_PREFETCH", raising=False)
    assert _fast.paged_key_pipeline() == PIPELINES[0]
    monkeypatch.setenv("MLX_INFER_PAGED_ATTN_UNROLL", "1")
    monkeypatch.setenv("MLX_INFER_PAGED_ATTN_PREFETCH", "1")
    assert _fast.paged_key_pipeline() == (1, True)
    for name, bad in (("MLX_INFER_PAGED_ATTN_UNROLL", "9"), ("MLX_INFER_PAGED_ATTN_UNROLL", "two"),
                      ("MLX_INFER_PAGED_ATTN_PREFETCH", "2")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}='{bad}' is not an integer in"):
            _fast.paged_key_pipeline()
        monkeypatch.setenv(name, "1")
