"""ReusedKernel (cpp/include/mlx_infer/backend.h): our custom CUDA kernels' launches make MLX's
``CustomKernel`` primitive once per launch signature and reuse it (MLX's ``cuda_kernel`` function rebuilds
the kernel's source at every call). CUDA kernels cannot run here, so ``_fast.reused_kernel_probe`` wraps a
function every backend runs (MLX's add, its template argument the result's dtype) in the same class: one
primitive per signature, later calls with new inputs and new shapes computed right through it, and
``MLX_INFER_REUSE_KERNELS=0`` calling the function every time."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_infer import _fast


def test_one_primitive_per_signature_new_inputs_and_shapes_through_it(monkeypatch):
    monkeypatch.delenv("MLX_INFER_REUSE_KERNELS", raising=False)
    assert _fast.reuse_kernels_enabled()
    a, b = mx.array([1.0, 2.0, 3.0]), mx.array([10.0, 20.0, 30.0])
    c, d = mx.ones((2, 4)), mx.arange(8.0).reshape(2, 4)
    pairs = [(a, b), (c, d), (b, a)]  # one signature: float32 inputs with dimensions, a float32 result
    outs, made = _fast.reused_kernel_probe(pairs)
    assert made == 1
    for (x, y), out in zip(pairs, outs):
        np.testing.assert_array_equal(np.array(out), np.array(x) + np.array(y))
    # Each of these differs in the signature: a new primitive each.
    outs, made = _fast.reused_kernel_probe([(a, b), (a.astype(mx.bfloat16), b.astype(mx.bfloat16)),
                                            (c, mx.array(2.0)), (a, b.astype(mx.float16))])
    assert made == 4
    assert outs[1].dtype == mx.bfloat16 and outs[3].dtype == mx.float32
    np.testing.assert_array_equal(np.array(outs[2]), np.full((2, 4), 3.0))


def test_switched_off_calls_the_function_every_time(monkeypatch):
    monkeypatch.setenv("MLX_INFER_REUSE_KERNELS", "0")
    assert not _fast.reuse_kernels_enabled()
    a = mx.array([1.0, 2.0])
    outs, made = _fast.reused_kernel_probe([(a, a), (a, a)])
    assert made == 0 and np.array(outs[1]).tolist() == [2.0, 4.0]
    monkeypatch.setenv("MLX_INFER_REUSE_KERNELS", "1")
    assert _fast.reuse_kernels_enabled()
