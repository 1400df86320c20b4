"""Filters: pure functions over log-probabilities ``(B, V)`` that set removed tokens to -inf.

The math is mlx-lm's (``sample_utils.apply_top_p`` etc.), run eagerly: mlx-lm
wraps each in ``mx.compile`` with the parameter as a Python constant, which on
CPU JIT-compiles a new kernel (~1 s) for every distinct value a request sends.
Filters never renormalise; each later stage sees the survivors' log-probs.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import mlx.core as mx

from .params import SamplingParams

LogitsFilter = Callable[[mx.array, "mx.array | None"], mx.array]
"""``(logprobs (B, V), key or None) -> logprobs (B, V)``; only XTC uses the key."""

_NEG_INF = -float("inf")


def log_softmax(logits: mx.array) -> mx.array:
    """``logits - logsumexp(logits)`` along the vocabulary, as mlx-lm's generate step."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (B, V)


def apply_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """Nucleus: keep the smallest set of most likely tokens whose mass reaches ``top_p``."""
    sorted_lp = mx.sort(logprobs, axis=-1)  # (B, V) ascending
    sorted_p = mx.exp(sorted_lp.astype(mx.float32))
    mass_above = mx.cumsum(sorted_p, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + sorted_p[..., :1]  # (B, 1)
    n_dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)  # (B, 1)
    # A top_p that rounds to 0 in float32 drops every token; keep the most likely one (top_p -> 0).
    n_dropped = mx.minimum(n_dropped, logprobs.shape[-1] - 1)  # (B, 1)
    threshold = mx.take_along_axis(sorted_lp, n_dropped, axis=-1)  # (B, 1)
    return mx.where(logprobs < threshold, _NEG_INF, logprobs)


def apply_min_p(logprobs: mx.array, min_p: float, min_tokens_to_keep: int = 1) -> mx.array:
    """Drop tokens with ``p < min_p * p_max``, but keep the ``min_tokens_to_keep`` most likely."""
    top = mx.max(logprobs, axis=-1, keepdims=True)  # (B, 1)
    remove = logprobs < top + math.log(min_p)
    if min_tokens_to_keep > 1:
        k = min(min_tokens_to_keep, logprobs.shape[-1])
        keep = mx.argpartition(logprobs, kth=-k, axis=-1)[..., -k:]  # (B, k)
        remove = mx.put_along_axis(remove, keep, mx.array(False), axis=-1)
    return mx.where(remove, _NEG_INF, logprobs)


def apply_xtc(logprobs: mx.array, probability: float, threshold: float,
              removable: mx.array | None, *, key: mx.array | None = None) -> mx.array:
    """Exclude Top Choices: with chance ``probability``, drop every token whose
    probability exceeds ``threshold`` except the least likely of them.

    Args:
        removable: (V,) bool, False for tokens XTC must never drop (EOS, newline);
            ``None`` when there are none.
        key: the draw deciding whether XTC applies at this step.
    """
    probs = mx.softmax(logprobs, -1)  # (B, V)
    above = mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)  # (B, 1)
    mask = probs > above
    if removable is not None:
        mask = mask & removable
    apply = mx.random.uniform(0, 1, key=key) <= probability if probability < 1.0 else mx.array(True)
    return mx.where(apply & mask, _NEG_INF, logprobs)


def apply_top_k(logprobs: mx.array, top_k: int) -> mx.array:
    """Keep the ``top_k`` most likely tokens; ``top_k >= V`` keeps all."""
    if top_k >= logprobs.shape[-1]:
        return logprobs
    drop = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]  # (B, V-k)
    return mx.put_along_axis(logprobs, drop, mx.array(_NEG_INF, logprobs.dtype), axis=-1)


def _xtc_filter(probability: float, threshold: float, protected: Sequence[int]) -> LogitsFilter:
    protected = sorted({int(t) for t in protected if int(t) >= 0})
    cache: dict[int, mx.array | None] = {}  # vocab size -> removable mask

    def removable_for(vocab: int) -> mx.array | None:
        if vocab not in cache:
            ids = [t for t in protected if t < vocab]
            removable = None
            if ids:
                removable = mx.ones((vocab,), dtype=mx.bool_)
                removable[mx.array(ids)] = False
            cache[vocab] = removable
        return cache[vocab]

    def xtc(logprobs: mx.array, key: mx.array | None) -> mx.array:
        return apply_xtc(logprobs, probability, threshold, removable_for(logprobs.shape[-1]), key=key)

    return xtc


def make_filters(params: SamplingParams, *, protected_token_ids: Sequence[int] = ()) -> list[LogitsFilter]:
    """The active filters of ``params``, in order: top_p, min_p, XTC, top_k.

    Args:
        protected_token_ids: tokens XTC never removes (EOS and newline ids).
    """
    out: list[LogitsFilter] = []
    if params.top_p < 1.0:
        top_p = params.top_p
        out.append(lambda lp, key: apply_top_p(lp, top_p))
    if params.min_p > 0.0:
        min_p, keep = params.min_p, params.min_tokens_to_keep
        out.append(lambda lp, key: apply_min_p(lp, min_p, keep))
    if params.xtc_probability > 0.0:
        out.append(_xtc_filter(params.xtc_probability, params.xtc_threshold, protected_token_ids))
    if params.top_k > 0:
        top_k = params.top_k
        out.append(lambda lp, key: apply_top_k(lp, top_k))
    return out
