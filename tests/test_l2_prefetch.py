"""``_fast.l2_prefetch``: one CUDA kernel that copies ``x`` through and asks the L2 for every line of a later
product's weight (cpp/matmul/l2_prefetch_cuda.cpp); the decode graphs take it behind MLX_INFER_L2_PREFETCH_O=1.

On the CUDA backend the output equals ``x`` exactly (any dtype of x and of the weight, quantized words too) and
the weight is left as it was. Elsewhere the binding refuses with a clear error. The switch
is off by default, read at each call, and a bad value names itself. Whether the prefetch pays is
benchmarks/gpu_l2_prefetch_probe.py's question.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer import _fast

ON_CUDA = mx.default_device().type == mx.DeviceType.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


@pytest.mark.parametrize("x_shape,x_dtype,w_shape,w_dtype", [
    ((1, 6144), mx.bfloat16, (4096, 4096), mx.bfloat16),
    ((13, 3072), mx.float32, (2048, 2048), mx.bfloat16),
    ((2, 640), mx.float16, (640, 128), mx.uint32),  # a quantized weight's packed words
])
def test_copies_x_exactly_on_cuda_or_refuses_clearly(x_shape, x_dtype, w_shape, w_dtype):
    rng = np.random.default_rng(7)
    x = mx.array(rng.standard_normal(x_shape).astype(np.float32)).astype(x_dtype)
    w = mx.array(rng.integers(0, 1 << 30, size=w_shape).astype(np.uint32)) if w_dtype == mx.uint32 else \
        mx.array(rng.standard_normal(w_shape).astype(np.float32) * 0.02).astype(w_dtype)
    if not ON_CUDA:
        with pytest.raises(ValueError, match="CUDA backend"):
            _fast.l2_prefetch(x, w)
        return
    # a copy (bfloat16 has no numpy dtype: copy through its bits): the kernel must only read the weight
    w_before = mx.array(np.array(w.view(mx.uint16) if w.dtype == mx.bfloat16 else w)).view(w.dtype)
    y = _fast.l2_prefetch(x, w)
    assert y.shape == x.shape and y.dtype == x.dtype and mx.array_equal(y, x).item()
    assert mx.array_equal(w, w_before).item()


def test_switch_defaults_off_is_read_at_each_call_and_refuses_bad_values(monkeypatch):
    monkeypatch.delenv("MLX_INFER_L2_PREFETCH_O", raising=False)
    assert _fast.l2_prefetch_o_enabled() is False
    monkeypatch.setenv("MLX_INFER_L2_PREFETCH_O", "1")
    assert _fast.l2_prefetch_o_enabled() is True
    monkeypatch.setenv("MLX_INFER_L2_PREFETCH_O", "on")
    with pytest.raises(ValueError, match="MLX_INFER_L2_PREFETCH_O"):
        _fast.l2_prefetch_o_enabled()
