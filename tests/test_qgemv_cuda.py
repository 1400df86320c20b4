"""``_fast.quantized_gemv``, the fused dequantizing CUDA GEMV (cpp/matmul/qgemv_cuda.cpp), against MLX's
``mx.quantized_matmul`` on the CUDA backend: 4 and 8 bits, group sizes 32/64/128, bfloat16, float16 and float32 x,
1 to 8 rows (the CUDA-core form) and 1 to 64 (the tensor-core form, 16-bit x), llama-8B's and gemma3-270m's
product shapes; and the decode graphs' routing (``quantized_linear``
takes the kernel for 1 to ``MLX_INFER_QGEMV_ROWS`` rows). Both sum in float32 and round once, in another order:
``max |ours - mlx| / max |mlx|`` within a few units in the last place of the dtype. Elsewhere the kernel refuses
with a clear error and the routing keeps MLX's product (checked here too); the kernel's arithmetic is checked on
the CPU by tests/test_qgemv_cuda_text.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer import _fast

ON_CUDA = mx.default_device().type == mx.DeviceType.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()
ULP = {mx.float32: 2.0 ** -23, mx.bfloat16: 2.0 ** -7, mx.float16: 2.0 ** -10}

CASES = [  # rows, N, K, bits, group_size
    (1, 4096, 4096, 4, 64), (2, 1024, 4096, 4, 64), (8, 4096, 4096, 4, 64), (5, 14336, 4096, 4, 64),
    (1, 4096, 14336, 4, 64), (3, 4096, 14336, 8, 64), (8, 1024, 4096, 8, 64), (1, 640, 2048, 4, 32),
    (4, 1152, 640, 8, 128), (7, 262144 // 16, 640, 4, 64),
]


def operands(rows: int, n: int, k: int, bits: int, group_size: int, dtype: mx.Dtype):
    rng = np.random.default_rng(rows + n + k + bits)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.02).astype(dtype)
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(dtype)
    return (x, *mx.quantize(w, group_size=group_size, bits=bits))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("rows,n,k,bits,group_size", CASES)
def test_quantized_gemv_equals_mlx_on_cuda_or_refuses_clearly(dtype, rows, n, k, bits, group_size):
    x, wq, scales, biases = operands(rows, n, k, bits, group_size, dtype)
    if not ON_CUDA:
        with pytest.raises(ValueError, match="CUDA backend"):
            _fast.quantized_gemv(x, wq, scales, biases, group_size=group_size, bits=bits)
        return
    got = _fast.quantized_gemv(x, wq, scales, biases, group_size=group_size, bits=bits)
    want = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group_size, bits=bits)
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    scale = mx.abs(want.astype(mx.float32)).max().item()
    print(f"rows={rows} ({n}, {k}) {bits}-bit g{group_size} {dtype}: max diff / max |mlx| {diff / scale:.3g}")
    assert diff / scale <= (1e-5 if dtype == mx.float32 else 4 * ULP[dtype])


MMA_CASES = [  # rows, N, K, bits, group_size, tiling (None: the default, the tensor-core form above 4 rows)
    (5, 4096, 4096, 4, 64, None), (16, 14336, 4096, 4, 64, None), (33, 4096, 14336, 4, 64, None),
    (64, 1024, 4096, 8, 64, None), (8, 16384, 640, 4, 32, None), (1, 4096, 4096, 4, 64, (2, 4, 2)),
    (24, 1152, 640, 8, 128, (3, 2, 1)),
]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("rows,n,k,bits,group_size,tiling", MMA_CASES)
def test_tensor_core_form_equals_mlx_on_cuda(dtype, rows, n, k, bits, group_size, tiling):
    """The tensor-core form (dequantized values rounded to the dtype for mma.sync, as MLX's qmm does)."""
    x, wq, scales, biases = operands(rows, n, k, bits, group_size, dtype)
    kw = {} if tiling is None else {"tiling": tiling, "mma": True}
    if not ON_CUDA:
        with pytest.raises(ValueError, match="CUDA backend"):
            _fast.quantized_gemv(x, wq, scales, biases, group_size=group_size, bits=bits, **kw)
        return
    got = _fast.quantized_gemv(x, wq, scales, biases, group_size=group_size, bits=bits, **kw)
    want = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group_size, bits=bits)
    diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    scale = mx.abs(want.astype(mx.float32)).max().item()
    print(f"mma rows={rows} ({n}, {k}) {bits}-bit g{group_size} {dtype}: max diff / max |mlx| {diff / scale:.3g}")
    assert got.shape == want.shape and diff / scale <= 4 * ULP[dtype]


@pytest.mark.parametrize("rows", [1, 8, 9])
def test_the_decode_graphs_route_by_the_switch(monkeypatch, rows):
    """quantized_linear (what the decode graphs call) takes the kernel for 1..MLX_INFER_QGEMV_ROWS rows on CUDA
    only; above the switch, or at 0, or off CUDA, it is MLX's quantized_matmul bit for bit."""
    x, wq, scales, biases = operands(rows, 1024, 2048, 4, 64, mx.bfloat16)
    want = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4)
    monkeypatch.setenv("MLX_INFER_QGEMV_ROWS", "0")
    assert not _fast.quantized_gemv_applies(x, wq, scales, biases)
    assert mx.array_equal(_fast.quantized_linear(x, wq, scales, biases), want).item()
    monkeypatch.setenv("MLX_INFER_QGEMV_ROWS", "8")
    takes = _fast.quantized_gemv_applies(x, wq, scales, biases)
    assert takes == (ON_CUDA and rows <= 8)
    got = _fast.quantized_linear(x, wq, scales, biases)
    if takes:
        assert mx.array_equal(got, _fast.quantized_gemv(x, wq, scales, biases)).item()
    else:
        assert mx.array_equal(got, want).item()
