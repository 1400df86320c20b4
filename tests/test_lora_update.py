"""The fused per-row LoRA update primitive (``_fast.fast_lora_update``, cpp/cpu_kernels/lora_update.cpp).

Checked against a float64 numpy reference of ``base + sum_j (x . a[j]) b[row0 + n, j]`` over each
row's slot columns (slot 0 and out-of-range slots: base unchanged), for bank layouts with padded
ranks, a group member's columns/rows, every kernel dtype, eagerly and inside ``mx.compile``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer import _fast

TOL = {mx.float32: 2e-5, mx.bfloat16: 2e-2, mx.float16: 2e-3}


def _bank(rng: np.random.Generator, S: int, r: int, K: int, N: int, ranks: list[int], k: int = 1,
          part: int = 0) -> tuple[np.ndarray, np.ndarray, int, int]:
    """a (k S r, K), block-diagonal b (k N, k S r), slot 0 zeros, slot s's rank ranks[s] padded to r."""
    a = np.zeros((k * S * r, K))
    b = np.zeros((k * N, k * S * r))
    for p in range(k):
        for s in range(1, S):
            c0 = p * S * r + s * r
            a[c0:c0 + ranks[s]] = rng.standard_normal((ranks[s], K)) / np.sqrt(K)
            b[p * N:(p + 1) * N, c0:c0 + ranks[s]] = rng.standard_normal((N, ranks[s])) * 0.5
    return a, b, part * S * r, part * N


def _reference(base: np.ndarray, x: np.ndarray, a: np.ndarray, b: np.ndarray, slots: np.ndarray, S: int, r: int,
               col0: int, row0: int) -> np.ndarray:
    out = base.astype(np.float64).copy()
    N = base.shape[-1]
    for i, s in enumerate(slots):
        if s <= 0 or s >= S:
            continue
        cols = slice(col0 + s * r, col0 + (s + 1) * r)
        xa = x[i].astype(np.float64) @ a[cols].T  # (L, r)
        out[i] += xa @ b[row0:row0 + N, cols].T
    return out


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("B,L,K,N,S,r,k,part", [(32, 1, 64, 48, 5, 8, 1, 0), (7, 3, 40, 24, 3, 16, 1, 0),
                                                (16, 1, 64, 32, 5, 8, 3, 2), (4, 2, 24, 640, 2, 8, 2, 1)])
def test_matches_float64_reference(dtype: mx.Dtype, B: int, L: int, K: int, N: int, S: int, r: int, k: int,
                                   part: int) -> None:
    rng = np.random.default_rng(B * 1000 + K + N + part)
    ranks = [0] + [int(rng.integers(1, r + 1)) for _ in range(S - 1)]
    a, b, col0, row0 = _bank(rng, S, r, K, N, ranks, k, part)
    slots = rng.integers(0, S, size=B).astype(np.int32)
    slots[0], slots[-1] = 0, S - 1  # a row without adapter and one with the last slot, always
    x = mx.array(rng.standard_normal((B, L, K)).astype(np.float32)).astype(dtype)
    base = mx.array(rng.standard_normal((B, L, N)).astype(np.float32)).astype(dtype)
    am, bm = mx.array(a.astype(np.float32)).astype(dtype), mx.array(b.astype(np.float32)).astype(dtype)
    sm = mx.array(slots)

    def f(base: mx.array, x: mx.array, am: mx.array, bm: mx.array, sm: mx.array) -> mx.array:
        return _fast.fast_lora_update(base, x, am, bm, sm, slot_count=S, rank=r, col0=col0, row0=row0)

    ref = _reference(_np(base), _np(x), _np(am), _np(bm), slots, S, r, col0, row0)
    for fn in (f, mx.compile(f)):
        out = fn(base, x, am, bm, sm)
        assert out.dtype == dtype and out.shape == (B, L, N)
        got = _np(out)
        scale = np.abs(ref).max()
        assert np.abs(got - ref).max() <= TOL[dtype] * scale, np.abs(got - ref).max()
        # rows without an adapter are base, bit for bit
        for i in np.flatnonzero(slots == 0):
            assert mx.array_equal(out[int(i)], base[int(i)])
    assert not np.allclose(ref, _np(base), atol=1e-3), "the update changed nothing: the test would hide a no-op"


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("form", ["dense", "dense+bias", "quantized"])
def test_product_fused_with_the_update(dtype: mx.Dtype, form: str) -> None:
    """``fast_lora_linear`` / ``fast_lora_quantized_matmul``: the layer's product, the update and the add in
    one op, against float64 ``x W^T (+ bias)`` plus the update (a group member's columns and rows)."""
    rng = np.random.default_rng(11)
    B, L, K, N, S, r, k, part = 9, 2, 64, 40, 4, 8, 2, 1
    a, b, col0, row0 = _bank(rng, S, r, K, N, [0, 8, 3, 6], k, part)
    slots = np.array([0, 1, 2, 3, 0, 3, 2, 1, 1], np.int32)
    x = mx.array(rng.standard_normal((B, L, K)).astype(np.float32)).astype(dtype)
    w = mx.array((rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)).astype(dtype)
    am, bm = mx.array(a.astype(np.float32)).astype(dtype), mx.array(b.astype(np.float32)).astype(dtype)
    bank = dict(slot_count=S, rank=r, col0=col0, row0=row0)
    bias = mx.array(rng.standard_normal(N).astype(np.float32)).astype(dtype) if form == "dense+bias" else None

    def f(x: mx.array, w: mx.array, am: mx.array, bm: mx.array, sm: mx.array) -> mx.array:
        if form == "quantized":
            wq, sc, bi = mx.quantize(w, group_size=32, bits=4)
            return _fast.fast_lora_quantized_matmul(x, wq, sc, bi, am, bm, sm, group_size=32, bits=4, **bank)
        return _fast.fast_lora_linear(x, w, bias, am, bm, sm, **bank)

    wd = _np(w)
    if form == "quantized":
        wd = _np(mx.dequantize(*mx.quantize(w, group_size=32, bits=4), group_size=32, bits=4))
    base = _np(x) @ wd.T + (0 if bias is None else _np(bias))
    ref = _reference(base, _np(x), _np(am), _np(bm), slots, S, r, col0, row0)
    for fn in (f, mx.compile(f)):
        out = fn(x, w, am, bm, mx.array(slots))
        assert out.dtype == dtype and out.shape == (B, L, N)
        assert np.abs(_np(out) - ref).max() <= 2 * TOL[dtype] * np.abs(ref).max()
    assert not np.allclose(ref, base, atol=1e-3)


def test_mixed_dtypes_take_the_mlx_formula() -> None:
    """A float32 adapter on bfloat16 activations and base (another dtype pair) still matches the reference."""
    rng = np.random.default_rng(3)
    S, r, K, N, B = 3, 8, 32, 16, 6
    a, b, _, _ = _bank(rng, S, r, K, N, [0, 8, 5])
    slots = np.array([0, 1, 2, 1, 2, 0], np.int32)
    x = mx.array(rng.standard_normal((B, 1, K)).astype(np.float32)).astype(mx.bfloat16)
    base = mx.array(rng.standard_normal((B, 1, N)).astype(np.float32))  # float32 base: not the kernel's case
    out = _fast.fast_lora_update(base, x, mx.array(a.astype(np.float32)), mx.array(b.astype(np.float32)),
                                 mx.array(slots), slot_count=S, rank=r)
    ref = _reference(_np(base), _np(x), a, b, slots, S, r, 0, 0)
    assert out.dtype == mx.float32
    assert np.abs(_np(out) - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("bad,match", [
    (dict(slot_count=9), "do not fit"),
    (dict(col0=8), "do not fit"),
    (dict(slots=mx.zeros((3,), mx.int32)), "one entry per row"),
    (dict(a=mx.zeros((24, 5))), "rows, K"),
])
def test_bad_shapes_are_refused(bad: dict, match: str) -> None:
    args = dict(base=mx.zeros((4, 1, 16)), x=mx.zeros((4, 1, 32)), a=mx.zeros((24, 32)), b=mx.zeros((16, 24)),
                slots=mx.zeros((4,), mx.int32), slot_count=3, rank=8)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        _fast.fast_lora_update(args.pop("base"), args.pop("x"), args.pop("a"), args.pop("b"), args.pop("slots"),
                               **args)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_per_row_forward_on_cpu_kernels_matches_stock(tmp_path, monkeypatch, family: str) -> None:
    """The eager per-row forward with the fused update (layers on the CPU kernels) gives the stock
    per-row forward's logits: a LoRA and a DoRA adapter of different ranks, rows using each and none."""
    from lora_helpers import make_mlx_adapter
    from tiny import make_tiny_model_dir

    from mlx_infer.adapters import adapter_rows, attach_adapter, bank_of
    from mlx_infer.artifacts.loader import load_model

    d = make_tiny_model_dir(tmp_path / family, family)
    keys = ["self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj"]
    a1 = make_mlx_adapter(d, tmp_path / "lora", seed=5, rank=4, keys=keys, b_std=1.0)
    a2 = make_mlx_adapter(d, tmp_path / "dora", seed=6, rank=12, keys=keys, dora=True, b_std=1.0)
    ids = mx.array([[5, 17, 33, 2, 90, 41]] * 3)  # (3, L)
    calls = []
    real = _fast.fast_lora_update
    monkeypatch.setattr(_fast, "fast_lora_update", lambda *a, **k: calls.append(1) or real(*a, **k))
    outs = {}
    for kernels in (False, True):
        loaded = load_model(d, cpu_kernels=kernels)
        n1, n2 = attach_adapter(loaded.model, a1), attach_adapter(loaded.model, a2)
        bank = bank_of(loaded.model)
        assert all(s.dense for s in bank.stacks.values())
        with adapter_rows(mx.array([bank.acquire(n1), 0, bank.acquire(n2)], mx.int32)):
            outs[kernels] = loaded.model(ids)
        assert bool(calls) == kernels, "the fused op runs exactly when the layers are on the CPU kernels"
        base = loaded.model(ids)
    fused, stock = outs[True], outs[False]
    assert mx.allclose(fused, stock, rtol=1e-4, atol=1e-4), mx.abs(fused - stock).max().item()
    for r in (0, 2):
        assert not mx.allclose(fused[r], base[r], atol=1e-3), f"row {r}: the adapter changed nothing"


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_each_instruction_set_matches_the_reference(isa: str) -> None:
    """The portable loops and the AVX2 ones (picked by the kernels' instruction set) agree with float64."""
    if isa not in ("generic", _fast.cpu_kernel_isa()) and _fast.cpu_kernel_isa() == "generic":
        pytest.skip(f"this CPU lacks {isa}")
    rng = np.random.default_rng(21)
    B, K, N, S, r = 12, 72, 56, 4, 8  # K not a multiple of 8: the loops' tails run too
    a, b, _, _ = _bank(rng, S, r, K, N, [0, 8, 5, 2])
    slots = np.array([0, 1, 2, 3] * 3, np.int32)
    x = mx.array(rng.standard_normal((B, 1, K)).astype(np.float32))
    base = mx.array(rng.standard_normal((B, 1, N)).astype(np.float32))
    ref = _reference(_np(base), _np(x), a, b, slots, S, r, 0, 0)
    try:
        _fast.set_cpu_kernel_isa(isa)
        out = _fast.fast_lora_update(base, x, mx.array(a.astype(np.float32)), mx.array(b.astype(np.float32)),
                                     mx.array(slots), slot_count=S, rank=r)
        got = _np(out)
    finally:
        _fast.set_cpu_kernel_isa("")
    assert np.abs(got - ref).max() <= TOL[mx.float32] * np.abs(ref).max()
