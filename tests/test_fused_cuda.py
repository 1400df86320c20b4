"""``_fast.add_rms_norm`` and ``_fast.gated_activation``: the decode graphs' fused CUDA kernels (cpp/fused/).

On the CUDA backend: the sum equals ``mx.add`` exactly and the norm ``mx.fast.rms_norm`` of it but for the
last bit of a few elements (the sum of squares adds in another order); the gated activation equals the
decode graphs' compiled SwiGLU / GeGLU over MLX's split (decode/graph.cpp) but for the math library's
rounding of exp / tanh in a few elements; float32, bfloat16 and float16; rows of llama-1B, llama-8B and
gemma3-270m. The decode graphs take them unless ``MLX_INFER_FUSED_ADD_NORM=0`` / ``MLX_INFER_FUSED_GATED=0`` (the
switches are checked here on any backend). Elsewhere the bindings refuse with a clear error
(the graphs then keep MLX's ops); the kernels' text is checked on the CPU by tests/test_fused_cuda_text.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer import _fast

ON_CUDA = mx.default_device().type == mx.DeviceType.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()
DTYPES = [mx.float32, mx.bfloat16, mx.float16]


def last_bit_tolerance(dtype: mx.Dtype) -> float:
    """One unit in the last place of the dtype at 1.0 (relative)."""
    return {mx.float32: 2.0 ** -23, mx.bfloat16: 2.0 ** -7, mx.float16: 2.0 ** -10}[dtype]


def compare(got: mx.array, want: mx.array, dtype: mx.Dtype, name: str, frac_limit: float) -> None:
    """Within a few units in the last place; in 16 bits most elements equal (the rounding to the dtype absorbs
    a float32 difference in the reduction order or the math library); in float32 any element may differ."""
    diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32))
    scale = mx.maximum(mx.abs(want.astype(mx.float32)), mx.array(1e-3))
    rel, frac = (diff / scale).max().item(), (diff > 0).astype(mx.float32).mean().item()
    print(f"{name} {dtype}: max relative diff {rel:.3g}, {frac:.2%} of elements differ")
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == mx.float32:
        assert rel <= 1e-5
    else:
        assert rel <= 4 * last_bit_tolerance(dtype) and frac <= frac_limit


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,E", [(1, 2048), (13, 4096), (5, 640), (3, 12288)])
def test_add_rms_norm_equals_mlx_on_cuda_or_refuses_clearly(dtype, R, E):
    rng = np.random.default_rng(R + E)
    h, r = (mx.array(rng.standard_normal((R, E)).astype(np.float32) * 2).astype(dtype) for _ in range(2))
    w = mx.array(rng.uniform(0.5, 1.5, E).astype(np.float32)).astype(dtype)
    if not ON_CUDA:
        with pytest.raises(ValueError, match="CUDA backend"):
            _fast.add_rms_norm(h, r, w, eps=1e-5)
        return
    got_sum, got_norm = _fast.add_rms_norm(h, r, w, eps=1e-5)
    want_sum = mx.add(h, r)
    assert mx.array_equal(got_sum, want_sum).item()
    compare(got_norm, mx.fast.rms_norm(want_sum, w, 1e-5), dtype, "norm", 0.05)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,E,clip", [(1, 640, False), (13, 1152, False), (5, 640, True)])
def test_sandwich_add_rms_norm_equals_mlx_on_cuda_or_refuses_clearly(dtype, R, E, clip):
    """gemma's sandwich norm: h + rms_norm(r, pre_w) (in float16 with clip_f16: summed in float32, clipped, as
    forward.cpp's residual), then its norm."""
    rng = np.random.default_rng(R + E + 1)
    h = mx.array(rng.standard_normal((R, E)).astype(np.float32) * 2).astype(dtype)
    r = mx.array(rng.standard_normal((R, E)).astype(np.float32) * 40).astype(dtype)
    w = mx.array(rng.uniform(0.5, 1.5, E).astype(np.float32)).astype(dtype)
    pre_w = mx.array(rng.uniform(-2.0, 2.0, E).astype(np.float32)).astype(dtype)
    if not ON_CUDA:
        with pytest.raises(ValueError, match="CUDA backend"):
            _fast.add_rms_norm(h, r, w, eps=1e-6, pre_w=pre_w, clip_f16=clip)
        return
    got_sum, got_norm = _fast.add_rms_norm(h, r, w, eps=1e-6, pre_w=pre_w, clip_f16=clip)
    normed = mx.fast.rms_norm(r, pre_w, 1e-6)
    if clip and dtype == mx.float16:
        s = mx.add(h.astype(mx.float32), normed.astype(mx.float32))
        want_sum = mx.clip(s, -65504.0, 65504.0).astype(mx.float16)
    else:
        want_sum = mx.add(h, normed)
    # the pre-norm's last bit (its sum of squares in another order) may carry into a few sums: bounded by a
    # few units of the addends' size (a sum that cancels keeps their absolute error)
    diff = mx.abs(got_sum.astype(mx.float32) - want_sum.astype(mx.float32))
    size = mx.abs(h.astype(mx.float32)) + mx.abs(normed.astype(mx.float32))
    ulp = 1e-6 if dtype == mx.float32 else 4 * last_bit_tolerance(dtype)
    assert got_sum.dtype == dtype and mx.all(diff <= ulp * size).item()
    if dtype != mx.float32:  # in 16 bits the rounding absorbs most float32 differences
        assert (diff > 0).astype(mx.float32).mean().item() <= 0.05
    want_norm = mx.fast.rms_norm(want_sum, w, 1e-6)
    if dtype == mx.float32:  # the sums' last bits carry into the norm: bounded against the row's scale
        worst = mx.abs(got_norm - want_norm).max().item()
        assert worst <= 1e-5 * mx.abs(want_norm).max().item()
    else:
        compare(got_norm, want_norm, dtype, "norm", 0.05)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("R,F", [(1, 8192), (9, 14336), (4, 2048)])
def test_gated_activation_equals_mlx_on_cuda_or_refuses_clearly(dtype, activation, R, F):
    rng = np.random.default_rng(R + F)
    gate_up = mx.array((rng.standard_normal((R, 2 * F)) * 3).astype(np.float32)).astype(dtype)
    if not ON_CUDA:
        with pytest.raises(ValueError, match="CUDA backend"):
            _fast.gated_activation(gate_up, activation=activation)
        return
    got = _fast.gated_activation(gate_up, activation=activation)
    g, u = mx.split(gate_up, 2, axis=-1)
    dt = dtype
    if activation == "silu":
        want = mx.compile(lambda g, u: mx.multiply(mx.multiply(g, mx.sigmoid(g)), u), shapeless=True)(g, u)
    else:
        def geglu(g, u):
            inner = mx.add(g, mx.multiply(mx.array(0.044715, dt), mx.power(g, mx.array(3, dt))))
            t = mx.tanh(mx.multiply(mx.array(0.7978845608028654, dt), inner))
            return mx.multiply(mx.multiply(mx.multiply(mx.array(0.5, dt), g), mx.add(mx.array(1, dt), t)), u)
        want = mx.compile(geglu, shapeless=True)(g, u)
    if dtype == mx.float32:
        # act(g) u = g u s(g): s is sigmoid(g) or (1 + tanh(..)) / 2, each within a few ulps of 1 from the math
        # library (expf / tanhf here, MLX's unary ops there); where s is tiny (g << 0) that error is large
        # against the result (the H100 run: 5.8e-05 relative in 0.5 % of GeGLU's elements), never against g u.
        g32, u32, w32 = (a.astype(mx.float32) for a in (g, u, want))
        bound = (mx.abs(g32 * u32) + mx.abs(w32)) * 2.0 ** -19  # 16 units in the last place
        diff = mx.abs(got.astype(mx.float32) - w32)
        print(f"{activation} float32: max |diff| / bound {(diff / bound).max().item():.3g}")
        assert got.shape == want.shape and got.dtype == dtype and mx.all(diff <= bound).item()
        return
    compare(got, want, dtype, activation, 0.05)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="'silu' or 'gelu_tanh'"):
        _fast.gated_activation(mx.zeros((2, 32)), activation="relu")
    with pytest.raises(ValueError, match=r"\(R, E\)"):
        _fast.add_rms_norm(mx.zeros((2, 8)), mx.zeros((2, 4)), mx.ones((8,)), eps=1e-5)


@pytest.mark.parametrize("var,read", [("MLX_INFER_FUSED_ADD_NORM", _fast.fused_add_norm_enabled),
                                      ("MLX_INFER_FUSED_GATED", _fast.fused_gated_enabled)])
def test_switches_default_on_read_at_each_call_and_refuse_bad_values(monkeypatch, var, read):
    monkeypatch.delenv(var, raising=False)
    assert read() is True
    monkeypatch.setenv(var, "0")
    assert read() is False
    monkeypatch.setenv(var, "1")
    assert read() is True
    monkeypatch.setenv(var, "yes")
    with pytest.raises(ValueError, match=var):
        read()


def test_norm_row_bound_defaults_to_256_read_at_each_call_and_refuses_bad_values(monkeypatch):
    """MLX_INFER_FUSED_NORM_MAX_ROWS: the most rows of a step taking the norm-carrying kernels (fused_cuda.h)."""
    var = "MLX_INFER_FUSED_NORM_MAX_ROWS"
    monkeypatch.delenv(var, raising=False)
    assert _fast.fused_norm_max_rows() == 256
    monkeypatch.setenv(var, "0")
    assert _fast.fused_norm_max_rows() == 0
    monkeypatch.setenv(var, "2048")
    assert _fast.fused_norm_max_rows() == 2048
    for bad in ("-1", "many"):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=var):
            _fast.fused_norm_max_rows()
