"""The fused residual add + RMS norm CUDA kernel's source text (cpp/norm/add_rms_norm_cuda.cpp), run on the CPU
(tests/cuda_emulation.py), against MLX's own add and ``mx.fast.rms_norm`` of the same rows: float32, row lengths
that are and are not a multiple of the block, one warp and many, eps large enough to matter. The sum is exact
(same float32 add); the norm differs only in the order of its sum of squares, so it stays within :data:`TOL`
relative. The device run (``h200_engine.sh s21a``) checks the kernel under NVRTC, bfloat16 included, through the
step tests with ``MLX_INFER_ADD_NORM=1``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import compiler, run_add_rms_norm

TOL = 2e-6


@pytest.mark.parametrize("R,E,threads,eps", [
    (3, 64, 32, 1e-5),      # one warp, two values a thread
    (2, 2048, 512, 1e-6),   # llama-1B's width, the launch's thread count (one per 4 values)
    (2, 640, 256, 1e-6),    # gemma3-270m's: E not a multiple of the block
    (1, 96, 64, 10.0),      # eps dominates the mean
])
def test_cuda_kernel_text_matches_mlx_add_and_rms_norm(tmp_path, R, E, threads, eps):
    assert compiler() is not None, "g++ (C++20, <barrier>) is needed to build the CUDA kernels' text for the CPU"
    rng = np.random.default_rng(R * 7 + E)
    h = rng.standard_normal((R, E)).astype(np.float32) * 3
    r = rng.standard_normal((R, E)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(E)).astype(np.float32)
    s, n = run_add_rms_norm(tmp_path, h, r, w, eps=eps, threads=threads)
    want_s = mx.add(mx.array(h), mx.array(r))
    want_n = mx.fast.rms_norm(want_s, mx.array(w), eps)
    assert np.array_equal(s, np.array(want_s))
    err = np.abs(n - np.array(want_n)).max() / np.abs(np.array(want_n)).max()
    assert err <= TOL, err
    # The kernel must not pass by writing nothing: the untouched value of the emulation's buffers is -12345.
    assert not np.any(n == -12345.0)


ON_CUDA = mx.default_device().type == mx.DeviceType.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


def test_refused_off_cuda_with_a_clear_error():
    """Off MLX's CUDA backend the kernel never applies (the graphs keep MLX's add and rms_norm) and a direct call
    says where it runs."""
    from mlx_infer import _fast

    h = mx.zeros((2, 64))
    if ON_CUDA:
        assert not _fast.add_rms_norm_supported(h, h, mx.ones((63,)), 1e-5)  # w's width must be E
        return
    assert not _fast.add_rms_norm_supported(h, h, mx.ones((64,)), 1e-5)
    with pytest.raises(ValueError, match="CUDA backend"):
        _fast.add_rms_norm(h, h, mx.ones((64,)), 1e-5)


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend (the kernel is NVRTC-compiled on the device)")
def test_cuda_kernel_matches_mlx_add_and_rms_norm():
    """On the device: the sum bit-equal to MLX's add, the norm within one rounding of mx.fast.rms_norm's."""
    from mlx_infer import _fast

    rng = np.random.default_rng(3)
    for dtype, R, E in ((d, R, E) for d in (mx.float32, mx.bfloat16, mx.float16)
                        for R, E in ((1, 2048), (8, 640), (33, 4096))):
        h = mx.array(rng.standard_normal((R, E)).astype(np.float32) * 3).astype(dtype)
        r = mx.array(rng.standard_normal((R, E)).astype(np.float32)).astype(dtype)
        w = mx.array((1 + 0.1 * rng.standard_normal(E)).astype(np.float32)).astype(dtype)
        s, n = _fast.add_rms_norm(h, r, w, 1e-6)
        want_s = h + r
        want_n = mx.fast.rms_norm(want_s, w, 1e-6)
        assert mx.array_equal(s, want_s).item(), (R, E)
        rel = (mx.abs(n.astype(mx.float32) - want_n.astype(mx.float32)).max()
               / mx.abs(want_n.astype(mx.float32)).max()).item()
        assert rel <= (1e-6 if dtype == mx.float32 else 1e-2), (R, E, rel)
