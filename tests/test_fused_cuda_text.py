"""The fused kernels' source text (cpp/fused/: residual add + RMSNorm, gated activation over gate|up), run on the
CPU (tests/cuda_emulation.py) against MLX's own ops on the same float32 rows: ``mx.add`` then
``mx.fast.rms_norm``, and the decode graphs' SwiGLU / GeGLU (decode/graph.cpp's swiglu_ops, geglu_ops) after a
split. Rows of one chunk a thread and of several (kPer > 1), a row length that leaves threads idle; the GPU run
(tests/test_fused_cuda.py) checks the kernels under NVRTC in bf16 against MLX's CUDA ops.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import compiler, run_add_rms_norm, run_gated

TOL = 2e-6  # float32: the sum of squares in another order, exp / tanh of the C library


@pytest.mark.parametrize("R,E,block,per", [(3, 64, 32, 1), (2, 320, 32, 3), (2, 200, 64, 1)])
def test_add_rms_norm_kernel_text_matches_mlx(tmp_path, R, E, block, per):
    assert compiler() is not None, "g++ (C++20) is needed to build the CUDA kernel's text for the CPU"
    assert block * per * 4 >= E
    rng = np.random.default_rng(R + E)
    h, r = (rng.standard_normal((R, E)).astype(np.float32) * 3 for _ in range(2))
    w = rng.uniform(0.5, 1.5, E).astype(np.float32)
    got_sum, got_norm = run_add_rms_norm(tmp_path, h, r, w, 1e-5, block=block, per=per)
    want_sum = mx.add(mx.array(h), mx.array(r))
    want_norm = mx.fast.rms_norm(want_sum, mx.array(w), 1e-5)
    assert np.array_equal(got_sum, np.array(want_sum))
    np.testing.assert_allclose(got_norm, np.array(want_norm), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("R,E,block,per", [(3, 64, 32, 1), (2, 320, 32, 3), (2, 200, 64, 1)])
def test_sandwich_add_rms_norm_kernel_text_matches_mlx(tmp_path, R, E, block, per):
    """gemma's sandwich norm: h + rms_norm(r, pre_w), then its norm (forward.cpp's add_residual, then rms)."""
    assert compiler() is not None, "g++ (C++20) is needed to build the CUDA kernel's text for the CPU"
    rng = np.random.default_rng(R * 3 + E)
    h = rng.standard_normal((R, E)).astype(np.float32) * 3
    r = rng.standard_normal((R, E)).astype(np.float32) * 40  # far from unit RMS: the pre-norm must show
    w = rng.uniform(0.5, 1.5, E).astype(np.float32)
    pre_w = rng.uniform(-2.0, 2.0, E).astype(np.float32)
    got_sum, got_norm = run_add_rms_norm(tmp_path, h, r, w, 1e-6, block=block, per=per, pre_w=pre_w)
    want_sum = mx.add(mx.array(h), mx.fast.rms_norm(mx.array(r), mx.array(pre_w), 1e-6))
    want_norm = mx.fast.rms_norm(want_sum, mx.array(w), 1e-6)
    np.testing.assert_allclose(got_sum, np.array(want_sum), rtol=TOL, atol=TOL * 4)
    np.testing.assert_allclose(got_norm, np.array(want_norm), rtol=TOL, atol=TOL)


def mlx_gated(gate_up: np.ndarray, activation: str) -> np.ndarray:
    g, u = mx.split(mx.array(gate_up), 2, axis=-1)
    if activation == "silu":
        return np.array(mx.multiply(mx.multiply(g, mx.sigmoid(g)), u))
    inner = g + 0.044715 * mx.power(g, 3.0)
    return np.array(0.5 * g * (1.0 + mx.tanh(0.7978845608028654 * inner)) * u)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("R,F,block", [(2, 128, 32), (3, 72, 32)])
def test_gated_kernel_text_matches_mlx(tmp_path, activation, R, F, block):
    assert compiler() is not None, "g++ (C++20) is needed to build the CUDA kernel's text for the CPU"
    rng = np.random.default_rng(R + F)
    gate_up = (rng.standard_normal((R, 2 * F)) * 4).astype(np.float32)  # large |x|: both sigmoid branches
    got = run_gated(tmp_path, gate_up, activation, block=block)
    np.testing.assert_allclose(got, mlx_gated(gate_up, activation), rtol=TOL, atol=TOL)
