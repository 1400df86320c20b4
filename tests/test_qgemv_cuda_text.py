"""The fused dequantizing CUDA GEMV kernel's source text (cpp/matmul/qgemv_cuda.cpp, ``_fast.quantized_gemv``), run
on the CPU (tests/cuda_emulation.py), against float64 ``x @ mx.dequantize(wq, scales, biases).T``: 4 and 8 bits,
every group size MLX allows, rows of x from 1 to 8, K with and without a whole last iteration, N not a multiple of
the rows per warp or of a block's rows, tilings the default picks and others. Float32 in, float32 sums: ``max |y -
ref| / max |ref|`` <= :data:`TOL`. The device run (benchmarks/products.py's ours-q4 / ours-q8 rows, and
tests/test_qgemv_cuda.py on CUDA) checks it under NVRTC in bfloat16; the routing (``quantized_gemv_applies``,
MLX_INFER_QGEMV_ROWS) and the operand errors are tested here on the CPU.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import compiler, run_qgemv
from mlx_infer import _fast

TOL = 1e-5

CASES = [  # M, N, K, bits, group_size, (rows_per_warp, warps, unroll)
    (1, 37, 1024, 4, 64, (1, 4, 4)),    # 32 chunks: one per lane, one partial iteration; N < a block's rows
    (2, 70, 4096, 4, 64, (2, 4, 4)),    # 128 chunks: a whole iteration per lane; 35 warps of 2 rows
    (3, 45, 1152, 4, 32, (2, 2, 2)),    # group 32 (one chunk a group); 36 chunks: the second iteration partial
    (8, 19, 2048, 4, 128, (1, 1, 8)),   # the most rows; one warp per block; group 128 (four chunks a group)
    (1, 33, 1024, 8, 64, (4, 2, 4)),    # 8 bits: 16 values a chunk; 4 rows per warp, N = 33
    (5, 24, 640, 8, 32, (3, 4, 1)),     # 8 bits, group 32 (two chunks a group); rows per warp that divide nothing
    (4, 16, 8192, 8, 128, (1, 4, 8)),   # 8 bits, long rows: 512 chunks, two whole iterations per lane
]


MMA_CASES = [  # M, N, K, bits, group_size, (n-tiles, warps, unroll): the tensor-core form
    (1, 37, 1024, 4, 64, (1, 4, 2)),     # 8 super-steps: one iteration of the 4 warps; N not a multiple of 8
    (5, 64, 2048, 4, 32, (2, 4, 2)),     # rows of x past M in the m-tile (zeros); group 32; 2 n-tiles
    (16, 24, 640, 8, 64, (4, 2, 1)),     # 8 bits, a whole m-tile; 10 super-steps; n-tiles past N
    (20, 19, 1152, 4, 128, (1, 8, 2)),   # two m-tiles, the second partial; group 128; 9 super-steps over 8 warps
    (64, 40, 256, 8, 64, (3, 1, 1)),     # four m-tiles, one warp, one super-step at a time, 3 n-tiles
    (33, 16, 4096, 4, 64, (2, 4, 4)),    # three m-tiles; long rows: 32 super-steps, two iterations a warp
]


def _quantized(rng: np.random.Generator, n: int, k: int, bits: int, group_size: int):
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    dense = mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits)
    return np.array(wq), np.array(scales), np.array(biases), np.array(dense).astype(np.float64)


@pytest.mark.parametrize("M,N,K,bits,group_size,tiling", CASES)
def test_qgemv_kernel_text_matches_float64(tmp_path, M, N, K, bits, group_size, tiling):
    # The project builds with a C++ compiler (README); without g++ this test cannot check anything: fail, loudly.
    assert compiler() is not None, "g++ (C++20, <barrier>) is needed to build the CUDA kernels' text for the CPU"
    rng = np.random.default_rng(M * 1000 + N + K + bits)
    wq, scales, biases, dense = _quantized(rng, N, K, bits, group_size)
    x = rng.standard_normal((M, K)).astype(np.float32)
    got = run_qgemv(tmp_path, x, wq, scales, biases, bits=bits, group_size=group_size, rows_per_warp=tiling[0],
                    warps=tiling[1], unroll=tiling[2])
    ref = x.astype(np.float64) @ dense.T
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"M={M} N={N} K={K} bits={bits} group={group_size} tiling={tiling}: {rel:.2e}")
    assert rel <= TOL


@pytest.mark.parametrize("M,N,K,bits,group_size,tiling", MMA_CASES)
def test_qgemv_mma_kernel_text_matches_float64(tmp_path, M, N, K, bits, group_size, tiling):
    """The tensor-core form: its lanes' chunks, the (j, j + 4) k-pairs of x and w, the m-tiles past M and the n-tiles
    past N, the warps' partial sums in shared memory (the emulation does not round the fragments to 16 bits)."""
    assert compiler() is not None, "g++ (C++20, <barrier>) is needed to build the CUDA kernels' text for the CPU"
    rng = np.random.default_rng(M * 1000 + N + K + bits + 7)
    wq, scales, biases, dense = _quantized(rng, N, K, bits, group_size)
    x = rng.standard_normal((M, K)).astype(np.float32)
    got = run_qgemv(tmp_path, x, wq, scales, biases, bits=bits, group_size=group_size, rows_per_warp=tiling[0],
                    warps=tiling[1], unroll=tiling[2], mma=True)
    ref = x.astype(np.float64) @ dense.T
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"mma M={M} N={N} K={K} bits={bits} group={group_size} tiling={tiling}: {rel:.2e}")
    assert rel <= TOL


@pytest.mark.parametrize("rows,n,k,bits", [(1, 4096, 4096, 4), (8, 1024, 4096, 4), (2, 14336, 4096, 8),
                                           (1, 4096, 14336, 4), (32, 14336, 4096, 4), (64, 128256, 4096, 8),
                                           (5, 1024, 640, 4)])
def test_default_tiling_is_one_the_kernel_takes(tmp_path, rows, n, k, bits):
    """The default tiling for real shapes stays inside quantized_gemv's bounds (checked before any launch): the
    CUDA-core form up to 4 rows, the tensor-core form above (16-bit x), its partial sums within 48 KiB."""
    rpw, warps, unroll, mma = _fast.default_qgemv_tiling(rows, n, k, bits, mx.bfloat16)
    assert 1 <= rpw <= 4 and 1 <= warps <= 16 and 1 <= unroll <= 8 and mma == (rows > 4)
    assert not mma or warps * rpw * -(-rows // 16) * 4 * 32 * 4 <= 48 * 1024
    assert _fast.default_qgemv_tiling(rows, n, k, bits, mx.float32)[3] is False


def test_routing_on_the_cpu_keeps_mlx_product(monkeypatch):
    """On the CPU quantized_linear is MLX's (or our CPU kernel's) product, bit for bit, whatever the switch says;
    the switch is read at each call and a bad value names the variable."""
    rng = np.random.default_rng(0)
    wq, scales, biases = mx.quantize(mx.array(rng.standard_normal((64, 128)).astype(np.float32)), group_size=64,
                                     bits=4)
    x = mx.array(rng.standard_normal((2, 128)).astype(np.float32))
    monkeypatch.setenv("MLX_INFER_QGEMV_ROWS", "8")
    assert _fast.qgemv_max_rows() == 8
    assert not _fast.quantized_gemv_applies(x, wq, scales, biases)
    ref = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4)
    assert mx.array_equal(_fast.quantized_linear(x, wq, scales, biases), ref)
    monkeypatch.setenv("MLX_INFER_QGEMV_ROWS", "65")
    with pytest.raises(ValueError, match="MLX_INFER_QGEMV_ROWS"):
        _fast.qgemv_max_rows()
    monkeypatch.delenv("MLX_INFER_QGEMV_ROWS")
    assert _fast.qgemv_max_rows() == 4


def test_operand_errors_name_what_is_wrong():
    rng = np.random.default_rng(1)
    w = mx.array(rng.standard_normal((64, 128)).astype(np.float32))
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = mx.array(rng.standard_normal((2, 128)).astype(np.float32))
    with pytest.raises(ValueError, match="bits must be 4 or 8; got 3"):
        _fast.quantized_gemv(x, wq, scales, biases, group_size=64, bits=3)
    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128"):
        _fast.quantized_gemv(x, wq, scales, biases, group_size=16, bits=4)
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 128\)"):
        _fast.quantized_gemv(x[:, :64], wq, scales, biases)
    with pytest.raises(ValueError, match="scales and biases must be"):
        _fast.quantized_gemv(x, wq, scales[:, :1], biases[:, :1])
    with pytest.raises(ValueError, match="1 to 64 rows"):
        _fast.quantized_gemv(mx.zeros((65, 128)), wq, scales, biases)
    with pytest.raises(ValueError, match="CUDA-core form takes at most 8 rows"):
        _fast.quantized_gemv(mx.zeros((9, 128)), wq, scales, biases)
    with pytest.raises(ValueError, match="tensor-core form takes bfloat16/float16"):
        _fast.quantized_gemv(x, wq, scales, biases, tiling=(1, 4, 2), mma=True)
    with pytest.raises(ValueError, match="GPU stream of MLX's CUDA backend"):
        _fast.quantized_gemv(x, wq, scales, biases)
    with pytest.raises(ValueError, match="tiling must have"):
        _fast.quantized_gemv(x, wq, scales, biases, tiling=(5, 4, 4))
