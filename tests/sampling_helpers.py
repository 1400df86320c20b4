"""Shared by the sampling tests (test_sampling_parity.py, test_sampling_draws.py, test_sampling_params.py):
the logits cases and the exact comparison."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

INF = float("inf")


def np_(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def assert_same(ours: mx.array, theirs: mx.array) -> None:
    """Exact: same shape, same -inf mask, bit-equal finite values."""
    a, b = np_(ours), np_(theirs)
    assert a.shape == b.shape
    assert np.array_equal(np.isneginf(a), np.isneginf(b)), "different tokens removed"
    assert np.array_equal(a, b), f"max |diff| {np.nanmax(np.abs(a - b))}"


def logits_cases() -> dict[str, mx.array]:
    """Logits (B, V) for the parity tests, including the edge cases."""
    rng = np.random.default_rng(0)
    normal = rng.normal(0, 3, (3, 97)).astype(np.float32)
    with_inf = normal.copy()
    with_inf[:, ::5] = -INF
    peaked = rng.normal(0, 1, (2, 64)).astype(np.float32)
    peaked[:, 7] += 12.0
    return {
        "normal": mx.array(normal),
        "neg_inf": mx.array(with_inf),
        "all_equal": mx.zeros((2, 50)),
        "peaked": mx.array(peaked),
        "single_token": mx.array([[1.5], [-2.0]]),
        "two_tokens": mx.array([[0.3, 0.2]]),
        "bf16": mx.array(normal[:2, :64]).astype(mx.bfloat16),  # what models emit
    }


CASES = logits_cases()
