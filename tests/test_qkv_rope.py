"""``_fast.qkv_rope``: the fused q|k|v split + RoPE kernel of the paged step on CUDA (cpp/attention/qkv_rope_cuda.cpp).

On the CUDA backend: its q, k, v equal MLX's own path (split views, ``mx.fast.rope`` at per-row offsets) on
float32 and bfloat16, base and freqs RoPE, partial and traditional, long positions; v exactly. Elsewhere the
binding refuses with a clear error (the graphs then keep ``mx.fast.rope``); the kernel's text is checked on
the CPU by tests/test_qkv_rope_cuda_text.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer import _fast

ON_CUDA = mx.default_device().type == mx.DeviceType.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()

CASES = [  # H, KVH, D, dims, traditional, base, with_freqs
    (32, 8, 64, 64, False, 500000.0, True),   # llama-1B's heads with Llama 3 freqs
    (8, 1, 256, 256, False, 10000.0, False),  # gemma3-270m's geometry (no q/k norms here: the op alone)
    (4, 2, 128, 64, True, 10000.0, False),    # traditional, partial
]


def mlx_path(qkv, positions, H, KVH, D, dims, traditional, base, freqs):
    R = qkv.shape[0]

    def rot(part, heads):
        x = mx.transpose(mx.reshape(part, (R, 1, heads, D)), (0, 2, 1, 3))  # graph.cpp's strided view
        return mx.reshape(mx.fast.rope(x, dims, traditional=traditional, base=base, scale=1.0, offset=positions,
                                       freqs=freqs), (R, heads, D))

    return (rot(qkv[:, : H * D], H), rot(qkv[:, H * D:(H + KVH) * D], KVH),
            mx.reshape(qkv[:, (H + KVH) * D:], (R, KVH, D)))


def check(got, want, dtype, *, f32_worst: float, bf16_worst: float, bf16_frac: float) -> None:
    """q, k within the bounds (float32: the largest difference; bfloat16: it and the share of elements that
    differ at all); v exactly."""
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape and g.dtype == dtype
        diff = mx.abs(g.astype(mx.float32) - w.astype(mx.float32))
        worst, frac = diff.max().item(), (diff > 0).astype(mx.float32).mean().item()
        print(f"{name} {dtype}: max |diff| {worst:.3g}, {frac:.2%} of elements differ")
        if name == "v":
            assert worst == 0.0
        elif dtype == mx.float32:
            assert worst <= f32_worst
        else:
            assert worst <= bf16_worst and frac <= bf16_frac


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("H,KVH,D,dims,traditional,base,with_freqs", CASES)
def test_equals_mlx_rope_on_cuda_or_refuses_clearly(dtype, H, KVH, D, dims, traditional, base, with_freqs):
    R = 13
    rng = np.random.default_rng(H + D + dims)
    qkv = mx.array(rng.standard_normal((R, (H + 2 * KVH) * D)).astype(np.float32)).astype(dtype)
    positions = mx.array(rng.integers(0, 30000, size=R).astype(np.int32))
    freqs = mx.array((base ** (np.arange(0, dims, 2) / dims) * rng.uniform(1, 8, dims // 2)).astype(np.float32)) \
        if with_freqs else None
    kw = dict(heads=H, kv_heads=KVH, head_dim=D, dims=dims, traditional=traditional,
              base=None if with_freqs else base, freqs=freqs)
    if not ON_CUDA:
        with pytest.raises(ValueError, match="CUDA backend"):
            _fast.qkv_rope(qkv, positions, **kw)
        return
    got = _fast.qkv_rope(qkv, positions, **kw)
    want = mlx_path(qkv, positions, H, KVH, D, dims, traditional, None if with_freqs else base, freqs)
    # the same formula as MLX's kernel: equal but for FMA contractions' last bits (NVRTC contracts this kernel's
    # products its own way: 9-17 % of float32 elements 1-2 ulps off on an H100; bfloat16's rounding absorbs them)
    check(got, want, dtype, f32_worst=2e-6, bf16_worst=2 ** -5, bf16_frac=0.01)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("H,KVH,D,dims", [(4, 1, 256, 256), (16, 8, 128, 128), (2, 1, 48, 32)])
def test_qk_norms_equal_mlx_rms_norm_then_rope_on_cuda_or_refuse(dtype, H, KVH, D, dims):
    """gemma3's and qwen3's per-head q/k norms inside the kernel: as forward.cpp's unfused path (rms_norm of
    (R, 1, heads, D), then rope); the sum of squares adds in another order, so a last bit may differ."""
    R, eps = 9, 1e-6
    rng = np.random.default_rng(D + H)
    scale = rng.uniform(0.1, 30.0, size=(1, (H + 2 * KVH) * D)).astype(np.float32)
    qkv = mx.array(rng.standard_normal((R, (H + 2 * KVH) * D)).astype(np.float32) * scale).astype(dtype)
    positions = mx.array(rng.integers(0, 30000, size=R).astype(np.int32))
    q_w = mx.array(rng.uniform(0.5, 2.0, D).astype(np.float32)).astype(dtype)
    k_w = mx.array(rng.uniform(-1.5, 1.5, D).astype(np.float32)).astype(dtype)
    kw = dict(heads=H, kv_heads=KVH, head_dim=D, dims=dims, base=10000.0, q_norm=q_w, k_norm=k_w, eps=eps)
    if not ON_CUDA:
        with pytest.raises(ValueError, match="CUDA backend"):
            _fast.qkv_rope(qkv, positions, **kw)
        return
    got = _fast.qkv_rope(qkv, positions, **kw)

    def norm_rot(part, heads, w):
        y = mx.fast.rms_norm(mx.reshape(part, (R, 1, heads, D)), w, eps)
        y = mx.fast.rope(mx.transpose(y, (0, 2, 1, 3)), dims, traditional=False, base=10000.0, scale=1.0,
                         offset=positions)
        return mx.reshape(y, (R, heads, D))

    want = (norm_rot(qkv[:, : H * D], H, q_w), norm_rot(qkv[:, H * D:(H + KVH) * D], KVH, k_w),
            mx.reshape(qkv[:, (H + KVH) * D:], (R, KVH, D)))
    # |values| <= ~2 (the weights): a last bit of the norm (its reduction order) carried through the rotation
    check(got, want, dtype, f32_worst=1e-5, bf16_worst=2 ** -4, bf16_frac=0.05)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        _fast.qkv_rope(mx.zeros((2, 4 * 8)), mx.zeros((2,), mx.int32), heads=2, kv_heads=1, head_dim=8, dims=8,
                       base=10000.0, q_norm=mx.ones((8,)))
    qkv = mx.zeros((2, 4 * 8))
    with pytest.raises(ValueError, match="exactly one of base and freqs"):
        _fast.qkv_rope(qkv, mx.zeros((2,), mx.int32), heads=2, kv_heads=1, head_dim=8, dims=8)
    with pytest.raises(ValueError, match=r"positions \(R,\)"):
        _fast.qkv_rope(qkv, mx.zeros((3,), mx.int32), heads=2, kv_heads=1, head_dim=8, dims=8, base=10000.0)


def test_norm_switch_defaults_on_is_read_at_each_call_and_refuses_bad_values(monkeypatch):
    monkeypatch.delenv("MLX_INFER_QKV_ROPE_NORM", raising=False)
    assert _fast.qkv_rope_norm_enabled() is True
    monkeypatch.setenv("MLX_INFER_QKV_ROPE_NORM", "0")
    assert _fast.qkv_rope_norm_enabled() is False
    monkeypatch.setenv("MLX_INFER_QKV_ROPE_NORM", "off")
    with pytest.raises(ValueError, match="MLX_INFER_QKV_ROPE_NORM"):
        _fast.qkv_rope_norm_enabled()
