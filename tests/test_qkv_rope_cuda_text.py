"""The fused q|k|v RoPE kernel's source text (cpp/attention/qkv_rope_cuda.cpp), run on the CPU
(tests/cuda_emulation.py), against MLX's own split and ``mx.fast.rope`` of the same rows: base and freqs
(Llama 3's scaled frequencies), traditional pairs, partial rotary dims, a RoPE scale, GQA. Float32; the
kernel's arithmetic follows MLX's CUDA rope kernel; against the CPU's rope the difference is float rounding
(measured below :data:`TOL` at positions below 100). The H200 run (tests/test_qkv_rope_cuda.py) checks it under NVRTC against MLX's CUDA RoPE.
The writing kernel (``qkv_rope_write``) must give the same q and leave in the storage exactly what the two
K/V Scatters it replaces wrote: the non-writing kernel's k and v at each row's slot, nothing else touched.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import compiler, run_qkv_rope, run_qkv_rope_write

TOL = 5e-6

CASES = [  # R, H, KVH, D, dims, traditional, base, scale, with_freqs
    (3, 4, 2, 64, 64, False, 10000.0, 1.0, False),
    (2, 8, 2, 64, 64, False, 500000.0, 1.0, True),   # Llama 3 style: freqs instead of base
    (2, 4, 4, 32, 16, True, 10000.0, 0.5, False),    # traditional pairs, partial rotary, scaled positions
    (4, 2, 1, 128, 96, False, 1000000.0, 1.0, False),  # partial, non-traditional: the tail copied
]


def rope_inputs(rng, R, H, KVH, D, dims, base, with_freqs):
    """qkv (R, (H + 2 KVH) D), positions (R,) and, with_freqs, Llama 3 style freqs (dims / 2,)."""
    assert compiler() is not None, "g++ (C++20) is needed to build the CUDA kernel's text for the CPU"
    qkv = rng.standard_normal((R, (H + 2 * KVH) * D)).astype(np.float32)
    # Short positions: MLX's CPU rope derives inv_freq its own way, and a last-bit difference in it grows with
    # the angle; the H200 test compares long positions against MLX's CUDA kernel, whose formula this one follows.
    positions = rng.integers(0, 100, size=R).astype(np.int32)
    freqs = (base ** (np.arange(0, dims, 2) / dims) * rng.uniform(1, 8, dims // 2)).astype(np.float32) \
        if with_freqs else None
    return qkv, positions, freqs


@pytest.mark.parametrize("R,H,KVH,D,dims,traditional,base,scale,with_freqs", CASES)
def test_qkv_rope_kernel_text_matches_mlx_rope(tmp_path, R, H, KVH, D, dims, traditional, base, scale, with_freqs):
    qkv, positions, freqs = rope_inputs(np.random.default_rng(R * 7 + D + dims), R, H, KVH, D, dims, base,
                                        with_freqs)
    q, k, v = run_qkv_rope(tmp_path, qkv, positions, H=H, KVH=KVH, D=D, dims=dims, traditional=traditional,
                           base=None if with_freqs else base, scale=scale, freqs=freqs)
    x = mx.array(qkv)
    off = mx.array(positions)
    fr = None if freqs is None else mx.array(freqs)

    def rot(part: mx.array, heads: int) -> np.ndarray:  # graph.cpp's path: (R, heads, 1, D) at per-row offsets
        y = mx.fast.rope(mx.reshape(part, (R, heads, 1, D)), dims, traditional=traditional,
                         base=None if with_freqs else base, scale=scale, offset=off, freqs=fr)
        return np.array(y).reshape(R, heads, D)

    want_q = rot(x[:, : H * D], H)
    want_k = rot(x[:, H * D:(H + KVH) * D], KVH)
    want_v = qkv[:, (H + KVH) * D:].reshape(R, KVH, D)
    assert np.array_equal(v, want_v)  # v is copied as it is
    if dims < D:  # features past dims are not rotated
        assert np.array_equal(q[..., dims:], qkv[:, : H * D].reshape(R, H, D)[..., dims:])
    for got, want in ((q, want_q), (k, want_k)):
        rel = np.abs(got - want).max() / np.abs(want).max()
        print(f"max rel {rel:.2e}")
        assert rel <= TOL


@pytest.mark.parametrize("R,H,KVH,D,dims,traditional,base,scale,with_freqs", CASES)
def test_qkv_rope_write_kernel_text_writes_the_storage_as_the_scatter(tmp_path, R, H, KVH, D, dims, traditional,
                                                                      base, scale, with_freqs):
    rng = np.random.default_rng(R * 11 + D + dims)
    qkv, positions, freqs = rope_inputs(rng, R, H, KVH, D, dims, base, with_freqs)
    pages, P = 5, 4
    # distinct slots in pages 1.. (page 0 is the null page), rows out of order and across pages
    slots = (P + rng.permutation((pages - 1) * P)[:R]).astype(np.int32)
    k_pool = rng.standard_normal((pages, KVH, P, D)).astype(np.float32)
    v_pool = rng.standard_normal((pages, KVH, P, D)).astype(np.float32)
    kw = dict(H=H, KVH=KVH, D=D, dims=dims, traditional=traditional, base=None if with_freqs else base,
              scale=scale, freqs=freqs)
    q, k, v = run_qkv_rope(tmp_path / "out", qkv, positions, **kw)
    q_w, k_after, v_after = run_qkv_rope_write(tmp_path / "write", qkv, positions, slots, k_pool, v_pool, **kw)
    assert np.array_equal(q_w, q)
    want_k, want_v = k_pool.copy(), v_pool.copy()  # the Scatter's result: row r's heads at slot r
    for r, s_ in enumerate(slots):
        want_k[s_ // P, :, s_ % P, :] = k[r]
        want_v[s_ // P, :, s_ % P, :] = v[r]
    assert np.array_equal(k_after, want_k)
    assert np.array_equal(v_after, want_v)


NORM_CASES = [  # R, H, KVH, D, dims, traditional, base, with_freqs: the per-head q/k norms before RoPE
    (3, 4, 1, 256, 256, False, 10000.0, False),   # gemma3-270m's heads: one block of 4 warps per head
    (2, 4, 2, 128, 128, False, 1000000.0, False),  # qwen3's
    (2, 2, 1, 48, 32, True, 10000.0, False),      # 24 pairs in a 32-thread block, partial traditional rotary
    (2, 2, 2, 64, 64, False, 500000.0, True),
]


@pytest.mark.parametrize("R,H,KVH,D,dims,traditional,base,with_freqs", NORM_CASES)
def test_qkv_rope_kernel_text_norms_heads_as_mlx_rms_norm_then_rope(tmp_path, R, H, KVH, D, dims, traditional,
                                                                    base, with_freqs):
    """With q/k norms: each q and k head is mx.fast.rms_norm'd by its weight, then rotated (forward.cpp's
    unfused path: rms of (R, 1, H, D), then rope); v untouched; the writing kernel the same at the slots."""
    rng = np.random.default_rng(R * 13 + D + dims)
    qkv, positions, freqs = rope_inputs(rng, R, H, KVH, D, dims, base, with_freqs)
    qkv *= rng.uniform(0.1, 30.0, size=(1, qkv.shape[1])).astype(np.float32)  # heads far from unit RMS
    q_w = rng.uniform(0.5, 2.0, D).astype(np.float32)
    k_w = rng.uniform(-1.5, 1.5, D).astype(np.float32)
    eps = 1e-6
    kw = dict(H=H, KVH=KVH, D=D, dims=dims, traditional=traditional, base=None if with_freqs else base,
              scale=1.0, freqs=freqs, norms=(q_w, k_w, eps))
    q, k, v = run_qkv_rope(tmp_path / "out", qkv, positions, **kw)
    x = mx.array(qkv)
    off = mx.array(positions)
    fr = None if freqs is None else mx.array(freqs)

    def norm_rot(part: mx.array, heads: int, w: np.ndarray) -> np.ndarray:
        y = mx.fast.rms_norm(mx.reshape(part, (R, 1, heads, D)), mx.array(w), eps)
        y = mx.fast.rope(mx.transpose(y, (0, 2, 1, 3)), dims, traditional=traditional,
                         base=None if with_freqs else base, scale=1.0, offset=off, freqs=fr)
        return np.array(y).reshape(R, heads, D)

    assert np.array_equal(v, qkv[:, (H + KVH) * D:].reshape(R, KVH, D))
    for got, want in ((q, norm_rot(x[:, : H * D], H, q_w)), (k, norm_rot(x[:, H * D:(H + KVH) * D], KVH, k_w))):
        rel = np.abs(got - want).max() / np.abs(want).max()
        print(f"max rel {rel:.2e}")
        assert rel <= TOL
    # the norm happened: without it the heads' scale (0.1-30) would show
    assert np.abs(q).max() < 10 * np.abs(q_w).max()

    pages, P = 4, 4
    slots = (P + rng.permutation((pages - 1) * P)[:R]).astype(np.int32)
    k_pool = rng.standard_normal((pages, KVH, P, D)).astype(np.float32)
    v_pool = rng.standard_normal((pages, KVH, P, D)).astype(np.float32)
    q_w2, k_after, v_after = run_qkv_rope_write(tmp_path / "write", qkv, positions, slots, k_pool, v_pool, **kw)
    assert np.array_equal(q_w2, q)
    want_k, want_v = k_pool.copy(), v_pool.copy()
    for r, s_ in enumerate(slots):
        want_k[s_ // P, :, s_ % P, :] = k[r]
        want_v[s_ // P, :, s_ % P, :] = v[r]
    assert np.array_equal(k_after, want_k) and np.array_equal(v_after, want_v)
