"""The CUDA GEMV kernel's source text (cpp/matmul/gemv_cuda.cpp, ``_fast.skinny_linear``), run on the CPU
(tests/cuda_emulation.py), against a float64 ``x @ w.T + bias``: every tiling the H200 sweep tries, rows of x
from 1 to 16, K with and without a whole last iteration, N not a multiple of the rows per warp or of a block's
rows (the warps past N, the repeated last row), with and without a bias. Float32 in, float32 sums: ``max |y -
ref| / max |ref|`` <= :data:`TOL`. The device run (benchmarks/products.py --gemv-sweep) checks the kernel under
NVRTC in bfloat16; the routing (``gemv_takes``, ``skinny_linear_applies``, MLX_INFER_GEMV_ROWS and
MLX_INFER_GEMV_MAX_MIB) is tested on the CPU too.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import compiler, run_gemv
from mlx_infer import _fast

TOL = 1e-5

CASES = [  # M, N, K, bias, (rows_per_warp, warps, unroll)
    (1, 37, 256, False, (1, 4, 8)),   # K = 64 chunks: part of one iteration; N < a block's rows
    (1, 70, 1024, True, (2, 4, 8)),   # K = 256 chunks: a whole iteration per lane; bias
    (2, 45, 520, False, (2, 8, 4)),   # K = 130 chunks: the last iteration partial; N odd with 2 rows per warp
    (4, 33, 640, True, (4, 2, 2)),    # 4 rows per warp, N = 33 (the last warp has one row)
    (8, 19, 96, False, (1, 1, 1)),    # one warp per block, one chunk at a time
    (16, 9, 4096, True, (1, 4, 16)),  # the most rows; 16 chunks per lane at once
    (3, 64, 2048, False, (3, 4, 8)),  # rows per warp that divide nothing
]


MMA_CASES = [  # M, N, K, bias, (n-tiles, warps, unroll): the tensor-core form
    (1, 37, 256, False, (1, 4, 8)),    # 8 steps: one warp's iteration, the others none; N not a multiple of 8
    (5, 64, 1024, True, (2, 4, 4)),    # rows of x past M in the m-tile (zeros), bias, 2 n-tiles
    (16, 24, 640, False, (4, 2, 8)),   # a whole m-tile; 20 steps: the last iteration partial; n-tiles past N
    (20, 19, 2048, True, (1, 8, 2)),   # two m-tiles, the second partial
    (64, 40, 96, False, (3, 1, 1)),    # four m-tiles, one warp, one step at a time, 3 n-tiles
]


@pytest.mark.parametrize("M,N,K,with_bias,tiling", MMA_CASES)
def test_gemv_mma_kernel_text_matches_float64(tmp_path, M, N, K, with_bias, tiling):
    assert compiler() is not None, "g++ (C++20, <barrier>) is needed to build the CUDA kernels' text for the CPU"
    rng = np.random.default_rng(M * 1000 + N + K + 1)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32) if with_bias else None
    got = run_gemv(tmp_path, x, w, b, rows_per_warp=tiling[0], warps=tiling[1], unroll=tiling[2], mma=True)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + (0 if b is None else b.astype(np.float64))
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"mma M={M} N={N} K={K} tiling={tiling}: {rel:.2e}")
    assert rel <= TOL


@pytest.mark.parametrize("M,N,K,with_bias,tiling", CASES)
def test_gemv_kernel_text_matches_float64(tmp_path, M, N, K, with_bias, tiling):
    # The project builds with a C++ compiler (README); without g++ this test cannot check anything: fail, loudly.
    assert compiler() is not None, "g++ (C++20, <barrier>) is needed to build the CUDA kernels' text for the CPU"
    rng = np.random.default_rng(M * 1000 + N + K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32) if with_bias else None
    got = run_gemv(tmp_path, x, w, b, rows_per_warp=tiling[0], warps=tiling[1], unroll=tiling[2])
    ref = x.astype(np.float64) @ w.astype(np.float64).T + (0 if b is None else b.astype(np.float64))
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"M={M} N={N} K={K} tiling={tiling}: {rel:.2e}")
    assert rel <= TOL


MIB = 1 << 20


def test_routing_rule_defaults(monkeypatch):
    """The default rule (gemv_cuda.cpp says why): 2 to 8 rows over weights of at most 64 MiB; one row stays on
    MLX's own GEMV, and the large products (llama-8B's gate|up and down, every LM head) on cuBLAS."""
    monkeypatch.delenv("MLX_INFER_GEMV_ROWS", raising=False)
    monkeypatch.delenv("MLX_INFER_GEMV_MAX_MIB", raising=False)
    monkeypatch.delenv("MLX_INFER_GEMV_MIN_ROWS", raising=False)
    assert _fast.gemv_max_rows() == 8 and _fast.gemv_max_weight_mib() == 64 and _fast.gemv_min_rows() == 2
    assert not _fast.gemv_takes(1, MIB)
    assert _fast.gemv_takes(2, MIB) and _fast.gemv_takes(8, 64 * MIB)
    assert not _fast.gemv_takes(8, 64 * MIB + 1) and not _fast.gemv_takes(9, MIB)
    bf16 = 2
    llama_8b = {"q|k|v": (6144, 4096), "o": (4096, 4096), "gate|up": (28672, 4096), "down": (4096, 14336),
                "head": (128256, 4096)}
    assert [name for name, (n, k) in llama_8b.items() if _fast.gemv_takes(8, n * k * bf16)] == ["q|k|v", "o"]
    llama_1b = {"q|k|v": (3072, 2048), "o": (2048, 2048), "gate|up": (16384, 2048), "down": (2048, 8192),
                "head": (128256, 2048)}
    assert [name for name, (n, k) in llama_1b.items() if not _fast.gemv_takes(4, n * k * bf16)] == ["head"]


def test_routing_and_knobs(monkeypatch):
    """Off CUDA no product is routed to the kernel; the knobs are read at each call and refused when bad."""
    x, w = mx.zeros((2, 64), mx.bfloat16), mx.zeros((32, 64), mx.bfloat16)
    monkeypatch.setenv("MLX_INFER_GEMV_ROWS", "16")
    assert _fast.gemv_max_rows() == 16 and _fast.gemv_takes(16, MIB) and not _fast.gemv_takes(17, MIB)
    monkeypatch.setenv("MLX_INFER_GEMV_ROWS", "0")
    assert _fast.gemv_max_rows() == 0 and not _fast.gemv_takes(2, MIB)
    assert not _fast.skinny_linear_applies(x, w)
    monkeypatch.setenv("MLX_INFER_GEMV_ROWS", "8")
    monkeypatch.setenv("MLX_INFER_GEMV_MAX_MIB", "0")  # no cap
    assert _fast.gemv_takes(8, 1 << 40)
    monkeypatch.setenv("MLX_INFER_GEMV_MAX_MIB", "1")
    assert _fast.gemv_takes(8, MIB) and not _fast.gemv_takes(8, MIB + 1)
    monkeypatch.setenv("MLX_INFER_GEMV_MIN_ROWS", "1")
    assert _fast.gemv_min_rows() == 1 and _fast.gemv_takes(1, MIB)
    for bad in ("0", "3", "one"):
        monkeypatch.setenv("MLX_INFER_GEMV_MIN_ROWS", bad)
        with pytest.raises(ValueError, match=f"MLX_INFER_GEMV_MIN_ROWS='{bad}' is not an integer in"):
            _fast.gemv_min_rows()
    monkeypatch.delenv("MLX_INFER_GEMV_MIN_ROWS")
    for bad in ("65", "-1", "four"):
        monkeypatch.setenv("MLX_INFER_GEMV_ROWS", bad)
        with pytest.raises(ValueError, match=f"MLX_INFER_GEMV_ROWS='{bad}' is not an integer in"):
            _fast.gemv_max_rows()
    monkeypatch.setenv("MLX_INFER_GEMV_ROWS", "8")
    for bad in ("-3", "2.5", "lots"):
        monkeypatch.setenv("MLX_INFER_GEMV_MAX_MIB", bad)
        with pytest.raises(ValueError, match=f"MLX_INFER_GEMV_MAX_MIB='{bad}' is not an integer in"):
            _fast.gemv_takes(2, MIB)
    monkeypatch.delenv("MLX_INFER_GEMV_MAX_MIB")
    monkeypatch.setenv("MLX_INFER_GEMV_ROWS", "8")
    if mx.default_device() == mx.cpu:
        assert not _fast.skinny_linear_applies(x, w, stream=mx.cpu)
        with pytest.raises(ValueError, match="CUDA"):
            _fast.skinny_linear(x, w, stream=mx.cpu)


def test_bad_operands_clear_errors():
    x, w = mx.zeros((2, 64), mx.float32), mx.zeros((32, 64), mx.float32)
    with pytest.raises(ValueError, match=r"x \(\.\.\., K\) with 1 to 64 rows"):
        _fast.skinny_linear(mx.zeros((65, 64)), w)
    with pytest.raises(ValueError, match="CUDA-core form takes at most 16"):
        _fast.skinny_linear(mx.zeros((17, 64)), w, tiling=(1, 4, 8))
    with pytest.raises(ValueError, match="must fit 48 KiB of shared memory"):
        _fast.skinny_linear(mx.zeros((64, 64), mx.bfloat16), mx.zeros((32, 64), mx.bfloat16), tiling=(4, 8, 4),
                            mma=True)
    with pytest.raises(ValueError, match="tensor-core form takes bfloat16/float16"):
        _fast.skinny_linear(x, w, tiling=(1, 4, 8), mma=True)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        _fast.skinny_linear(mx.zeros((2, 6)), mx.zeros((32, 6)))
    with pytest.raises(ValueError, match="one float dtype"):
        _fast.skinny_linear(x.astype(mx.bfloat16), w)
    with pytest.raises(ValueError, match=r"bias must be \(N,\)"):
        _fast.skinny_linear(x, w, mx.zeros((31,)))
    with pytest.raises(ValueError, match="tiling"):
        _fast.skinny_linear(x, w, tiling=(5, 4, 8))


ON_CUDA = mx.default_device().type == mx.DeviceType.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend (the kernel is NVRTC-compiled on the device)")
def test_cuda_skinny_linear_close_to_float32():
    """On the device: both forms in bfloat16 against a float32 product (bf16 inputs exact in float32)."""
    for M in (1, 2, 8, 16, 33):
        check_on_device(M)


def check_on_device(M: int) -> None:
    rng = np.random.default_rng(M)
    x = mx.array(rng.standard_normal((M, 4096)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array(rng.standard_normal((1000, 4096)).astype(np.float32) * 0.02).astype(mx.bfloat16)
    b = mx.array(rng.standard_normal(1000).astype(np.float32)).astype(mx.bfloat16)
    ref = x.astype(mx.float32) @ w.astype(mx.float32).T + b.astype(mx.float32)
    forms = [(None, False), ((1, 4, 8), True), ((4, 2, 4), True)] + ([((2, 4, 8), False)] if M <= 16 else [])
    for tiling, mma in forms:
        y = _fast.skinny_linear(x, w, b, tiling=tiling, mma=mma).astype(mx.float32)
        rel = (mx.abs(y - ref).max() / mx.abs(ref).max()).item()
        assert rel < 1e-2, (tiling, mma, rel)  # one bfloat16 rounding of the output: ~4e-3
