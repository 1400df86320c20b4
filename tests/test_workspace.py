"""SDPA workspace sizing, prefill chunk choice and KV byte arithmetic in C++.

Exact expected numbers for the arithmetic, and a check against what MLX really
allocates: on CPU there is no fused SDPA kernel, so
``mx.fast.scaled_dot_product_attention`` runs the unfused fallback whose score
workspace the formula bounds.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_infer._fast import (
    DEFAULT_WORKSPACE_BUDGET,
    Geometry,
    kv_bytes_for_context,
    kv_bytes_per_token,
    max_context_for_budget,
    prefill_chunk_size,
    sdpa_fallback_bytes,
)

GIB = 1 << 30
MIB = 1 << 20


def geo(**kw):
    args = dict(n_heads=8, n_kv_heads=2, head_dim=64, n_layers=4, dtype_bytes=2)
    args.update(kw)
    return Geometry(**args)


# Gemma 3 270M: 18 layers, 4 query heads, 1 KV head, head_dim 256, every
# sixth layer global, the rest a 512-token sliding window.
GEMMA3_270M = Geometry(
    n_heads=4, n_kv_heads=1, head_dim=256, n_layers=18,
    layer_windows=[0 if (i + 1) % 6 == 0 else 512 for i in range(18)], dtype_bytes=2,
)


def test_geometry_fields_and_validation():
    g = geo(layer_windows=[128, 0, 128, 0])
    assert (g.n_heads, g.n_kv_heads, g.head_dim, g.n_layers, g.dtype_bytes) == (8, 2, 64, 4, 2)
    assert g.layer_windows == [128, 0, 128, 0]
    assert geo().layer_windows == []
    with pytest.raises(ValueError, match="n_heads .8. must be a multiple of n_kv_heads .3."):
        geo(n_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim must be positive"):
        geo(head_dim=0)
    with pytest.raises(ValueError, match="one entry per layer: got 2 for 4 layers"):
        geo(layer_windows=[1, 2])
    with pytest.raises(ValueError, match=">= 0"):
        geo(layer_windows=[0, 0, -1, 0])
    with pytest.raises(TypeError):
        Geometry(8, 2, 64, 4)  # keyword-only: the ints are too easy to swap


def test_sdpa_fallback_bytes_exact():
    # n_heads * queries * keys * (4 + dtype_bytes)
    assert sdpa_fallback_bytes(geo(), chunk=512, prompt_tokens=4096) == 8 * 512 * 4096 * 6
    assert sdpa_fallback_bytes(geo(dtype_bytes=4), chunk=512, prompt_tokens=4096) == 8 * 512 * 4096 * 8
    # Fewer prompt tokens than the chunk: only that many query rows.
    assert sdpa_fallback_bytes(geo(), chunk=2048, prompt_tokens=100) == 8 * 100 * 100 * 6
    assert sdpa_fallback_bytes(geo(), chunk=8, prompt_tokens=0) == 0
    # All windowed: keys = window + chunk.
    windowed = geo(layer_windows=[128] * 4)
    assert sdpa_fallback_bytes(windowed, chunk=512, prompt_tokens=4096) == 8 * 512 * 640 * 6
    assert sdpa_fallback_bytes(windowed, chunk=512, prompt_tokens=600) == 8 * 512 * 600 * 6
    # Mixed: the global layer is the worst, and layers run one at a time.
    mixed = geo(layer_windows=[128, 0, 128, 0])
    assert sdpa_fallback_bytes(mixed, chunk=512, prompt_tokens=4096) == 8 * 512 * 4096 * 6
    assert sdpa_fallback_bytes(GEMMA3_270M, chunk=2048, prompt_tokens=32768) == 4 * 2048 * 32768 * 6
    # Saturates rather than wrapping around.
    assert sdpa_fallback_bytes(geo(), chunk=1 << 40, prompt_tokens=1 << 40) == (1 << 63) - 1
    with pytest.raises(ValueError, match="chunk must be positive"):
        sdpa_fallback_bytes(geo(), chunk=0, prompt_tokens=10)
    with pytest.raises(ValueError, match="prompt_tokens must be >= 0"):
        sdpa_fallback_bytes(geo(), chunk=8, prompt_tokens=-1)


def test_prefill_chunk_size():
    assert DEFAULT_WORKSPACE_BUDGET == GIB
    # 4 * 2048 * 32768 * 6 = 1.5 GiB > 1 GiB; 1024 gives 0.75 GiB.
    assert prefill_chunk_size(GEMMA3_270M, 32768) == 1024
    assert prefill_chunk_size(GEMMA3_270M, 16384) == 2048  # exactly 0.75 GiB
    assert prefill_chunk_size(GEMMA3_270M, 0) == 2048
    # Exactly at the budget is within it: 8 * 1024 * 4096 * 6 = 192 MiB.
    g = geo()
    assert prefill_chunk_size(g, 4096, budget_bytes=192 * MIB) == 1024
    assert prefill_chunk_size(g, 4096, budget_bytes=192 * MIB - 1) == 512
    # Never below 8, however tight the budget.
    assert prefill_chunk_size(g, 1 << 20, budget_bytes=1) == 8
    # An explicit chunk is exact, even when over budget or not a power of two.
    assert prefill_chunk_size(g, 1 << 20, explicit=300) == 300
    assert prefill_chunk_size(g, 10, budget_bytes=1, explicit=4096) == 4096
    with pytest.raises(ValueError, match="explicit chunk must be positive"):
        prefill_chunk_size(g, 10, explicit=-1)
    with pytest.raises(ValueError, match="budget_bytes must be positive"):
        prefill_chunk_size(g, 10, budget_bytes=0)


def test_kv_bytes_per_token_exact_and_matches_mlx_quantize():
    g = geo()  # 2 kv heads, head_dim 64, 4 layers
    assert kv_bytes_per_token(g) == 2 * 2 * 64 * 2 * 4 == 2048
    assert kv_bytes_per_token(g, kv_bits=32) == 4096
    # 4-bit: 32 packed bytes + (scale + bias) * 2 bytes per 64-group, per head.
    assert kv_bytes_per_token(g, kv_bits=4) == 2 * 2 * (32 + 4) * 4 == 576
    assert kv_bytes_per_token(g, kv_bits=8) == 2 * 2 * (64 + 4) * 4 == 1088
    assert kv_bytes_per_token(g, kv_bits=4, group_size=32) == 2 * 2 * (32 + 8) * 4
    # Against what mx.quantize really produces for one token's K of one layer.
    for bits in (2, 3, 4, 5, 6, 8):
        k = mx.zeros((g.n_kv_heads, 1, g.head_dim), dtype=mx.bfloat16)
        w, scales, biases = mx.quantize(k, group_size=64, bits=bits)
        one_layer = 2 * (w.nbytes + scales.nbytes + biases.nbytes)
        assert kv_bytes_per_token(g, kv_bits=bits) == one_layer * g.n_layers, bits
    with pytest.raises(ValueError, match="kv_bits must be one of"):
        kv_bytes_per_token(g, kv_bits=7)
    with pytest.raises(ValueError, match="multiple of group_size 128"):
        kv_bytes_per_token(g, kv_bits=4, group_size=128)


def test_kv_bytes_for_context_and_max_context():
    g = geo()  # 512 bytes per token per layer at 16 bits
    assert kv_bytes_for_context(g, 1000) == 2048 * 1000
    assert max_context_for_budget(g, MIB) == 512
    assert max_context_for_budget(g, MIB - 1) == 511
    assert max_context_for_budget(g, 0) == 0
    assert max_context_for_budget(g, MIB, kv_bits=4) == MIB // 576
    mixed = geo(layer_windows=[128, 0, 128, 0])
    assert kv_bytes_for_context(mixed, 1000) == 2 * 512 * 1000 + 2 * 512 * 128
    # 1024 T + 131072 <= 1 MiB  ->  T <= 896
    assert max_context_for_budget(mixed, MIB) == 896
    windowed = geo(layer_windows=[128] * 4)
    assert kv_bytes_for_context(windowed, 10**9) == 4 * 512 * 128
    assert max_context_for_budget(windowed, MIB) is None  # every window fits
    assert max_context_for_budget(windowed, 100_000) == 48  # 2048 * 48 <= 100000 < 2048 * 49
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        max_context_for_budget(g, -1)


# -- against MLX's real allocation ------------------------------------------------

# (n_heads, n_kv_heads, head_dim, chunk, keys): tiny head counts, chunks of
# 256/512/1024 over 2k-8k keys, GQA and MHA.
MEASURED = [
    (2, 1, 32, 256, 2048),
    (4, 4, 16, 512, 4096),
    (4, 1, 32, 1024, 8192),
]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", MEASURED, ids=lambda s: "h{}kv{}d{}-c{}k{}".format(*s))
def test_sdpa_fallback_peak_is_within_the_formula(shape, dtype):
    """Tolerance: the measured transient peak (peak minus memory already live,
    which includes the inputs and the mask) lies between one score buffer in
    the input dtype and 1.10x that (MLX reuses the score buffer for the masked
    scores and the softmax; the rest is the small output), and never above
    ``sdpa_fallback_bytes``, which bounds it with float32 scores plus a
    separate softmax output ((4 + d) / d = 2x for f32, 3x for bf16)."""
    n_heads, n_kv_heads, head_dim, chunk, keys = shape
    dtype_bytes = 4 if dtype == mx.float32 else 2
    g = Geometry(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                 n_layers=1, dtype_bytes=dtype_bytes)
    mx.random.seed(0)
    q = mx.random.normal((1, n_heads, chunk, head_dim)).astype(dtype)
    k = mx.random.normal((1, n_kv_heads, keys, head_dim)).astype(dtype)
    v = mx.random.normal((1, n_kv_heads, keys, head_dim)).astype(dtype)
    # Causal over the last `chunk` positions of a `keys`-long prompt.
    rows = mx.arange(keys - chunk, keys)[:, None]
    mask = rows >= mx.arange(keys)[None, :]
    mx.eval(q, k, v, mask)
    mx.synchronize()
    live = mx.get_active_memory()
    mx.reset_peak_memory()
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5, mask=mask)
    mx.eval(out)
    measured = mx.get_peak_memory() - live
    del out

    one_buffer = n_heads * chunk * keys * dtype_bytes
    bound = sdpa_fallback_bytes(g, chunk=chunk, prompt_tokens=keys)
    assert bound == n_heads * chunk * keys * (4 + dtype_bytes)
    assert one_buffer <= measured <= 1.10 * one_buffer, (measured, one_buffer)
    assert measured <= bound
