"""The fused q|k|v RoPE kernel's source text (cpp/attention/qkv_rope_cuda.cpp), run on the CPU
(tests/cuda_emulation.py), against MLX's own split and ``mx.fast.rope`` of the same rows: base and freqs
(Llama 3's scaled frequencies), traditional pairs, partial rotary dims, a RoPE scale, GQA. Float32; the
kernel's arithmetic follows MLX's CUDA rope kernel; against the CPU's rope the difference is float rounding
(measured below :data:`TOL` at positions below 100). The H200 run (tests/test_qkv_rope_cuda.py) checks it under NVRTC against MLX's CUDA RoPE.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import compiler, run_qkv_rope

TOL = 5e-6

CASES = [  # R, H, KVH, D, dims, traditional, base, scale, with_freqs
    (3, 4, 2, 64, 64, False, 10000.0, 1.0, False),
    (2, 8, 2, 64, 64, False, 500000.0, 1.0, True),   # Llama 3 style: freqs instead of base
    (2, 4, 4, 32, 16, True, 10000.0, 0.5, False),    # traditional pairs, partial rotary, scaled positions
    (4, 2, 1, 128, 96, False, 1000000.0, 1.0, False),  # partial, non-traditional: the tail copied
]


@pytest.mark.parametrize("R,H,KVH,D,dims,traditional,base,scale,with_freqs", CASES)
def test_qkv_rope_kernel_text_matches_mlx_rope(tmp_path, R, H, KVH, D, dims, traditional, base, scale, with_freqs):
    assert compiler() is not None, "g++ (C++20) is needed to build the CUDA kernel's text for the CPU"
    rng = np.random.default_rng(R * 7 + D + dims)
    qkv = rng.standard_normal((R, (H + 2 * KVH) * D)).astype(np.float32)
    # Short positions: MLX's CPU rope derives inv_freq its own way, and a last-bit difference in it grows with
    # the angle; the H200 test compares long positions against MLX's CUDA kernel, whose formula this one follows.
    positions = rng.integers(0, 100, size=R).astype(np.int32)
    freqs = (base ** (np.arange(0, dims, 2) / dims) * rng.uniform(1, 8, dims // 2)).astype(np.float32) \
        if with_freqs else None
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
