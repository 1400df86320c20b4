"""Attention dispatch and causal masks.

Mask values follow mlx-lm's conventions (``mlx_lm.models.base``): ``None`` when
every key is visible (one query), the string ``"causal"`` when the fast kernel
can build the lower-triangular mask itself, else a boolean array where ``True``
means "attend".
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .linear import cpu_attention_active, fast_scaled_dot_product_attention

Mask = None | str | mx.array


def create_causal_mask(N: int, offset: int = 0, window_size: int | None = None) -> mx.array:
    """Boolean mask for ``N`` queries at positions ``offset .. offset+N-1``.

    Args:
        N: number of queries.
        offset: number of keys before the first query.
        window_size: if set, a query at position ``q`` sees keys ``k`` with
            ``q - window_size < k <= q`` (the window counts the query itself).

    Returns:
        ``(N, offset + N)`` bool array, ``True`` where attention is allowed.
    """
    rinds = mx.arange(offset + N)
    linds = mx.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]  # (N, 1)
    rinds = rinds[None]  # (1, offset + N)
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    return mask


def create_attention_mask(h: mx.array, cache: Any = None, window_size: int | None = None,
                          return_array: bool = False) -> Mask:
    """The mask for the queries in ``h`` given the layer's cache.

    Args:
        h: hidden states ``(B, L, D)``; only ``L`` is read.
        cache: the layer's cache (its ``make_mask`` decides), or ``None`` for a
            cache-free full-sequence forward.
        window_size: sliding-window size of the layer, ``None`` for global.
        return_array: always return an array instead of ``"causal"``.

    Returns:
        ``None``, ``"causal"`` or a boolean array broadcastable to
        ``(B, heads, L, keys)``.
    """
    N = h.shape[1]
    if cache is not None and hasattr(cache, "make_mask"):
        return cache.make_mask(N, window_size=window_size, return_array=return_array)
    if N == 1:
        return None
    if return_array or (window_size and N > window_size):
        return create_causal_mask(N, window_size=window_size)
    return "causal"


def scaled_dot_product_attention(queries: mx.array, keys: Any, values: Any, *,
                                 scale: float, mask: Mask, sinks: mx.array | None = None) -> mx.array:
    """Softmax attention over ``(B, H, L, D)`` queries and ``(B, KVH, S, D)`` keys/values.

    Grouped-query attention (``H`` a multiple of ``KVH``) is handled by the kernel.
    Keys and values given as ``(packed, scales, biases)`` tuples (a quantized
    KV cache) go through :func:`quantized_scaled_dot_product_attention`.

    Args:
        queries: ``(B, H, L, D)``.
        keys: ``(B, KVH, S, D)``, or a quantized tuple.
        values: ``(B, KVH, S, Dv)``, or a quantized tuple.
        scale: multiplier on ``q . k`` (usually ``D ** -0.5``).
        mask: ``None``, ``"causal"`` or a boolean/additive array
            broadcastable to ``(B, H, L, S)``.
        sinks: ``(H,)`` attention-sink logits, or ``None``.

    Returns:
        ``(B, H, L, Dv)``.
    """
    if sinks is not None:  # one learned logit per head joins every softmax (gpt-oss); MLX's kernel only
        D = queries.shape[-1]
        return mx.fast.scaled_dot_product_attention(queries, dequantized(keys, D), dequantized(values, D),
                                                    scale=scale, mask=mask, sinks=sinks)
    if isinstance(keys, tuple):
        return quantized_scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    if cpu_attention_active():  # a model on mlx-infer's CPU kernels (layers.linear)
        return fast_scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def quantized_scaled_dot_product_attention(queries: mx.array, q_keys: tuple[mx.array, ...],
                                           q_values: tuple[mx.array, ...], *, scale: float,
                                           mask: Mask) -> mx.array:
    """Attention over affine-quantized K/V (the same ops, in the same order, as mlx-lm's).

    Bits and group size are read off the shapes: ``packed`` is
    ``(B, KVH, S, D * bits / 32)`` uint32 and ``scales``/``biases`` are
    ``(B, KVH, S, D / group_size)``.

    Args:
        queries: ``(B, H, L, D)``.
        q_keys: ``(packed, scales, biases)`` of the keys.
        q_values: ``(packed, scales, biases)`` of the values (value dim ``D``).
        scale: multiplier on ``q . k``.
        mask: as for :func:`scaled_dot_product_attention`.

    Returns:
        ``(B, H, L, D)``.
    """
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = q_keys[0].shape[-3]
    n_repeats = n_q_heads // n_kv_heads
    bits = q_keys[0].shape[-1] * 32 // D
    group_size = D // q_keys[1].shape[-1]
    queries = queries * scale
    if n_repeats > 1:
        queries = mx.reshape(queries, (B, n_kv_heads, n_repeats, L, D))  # (B, KVH, rep, L, D)
        q_keys = tuple(mx.expand_dims(x, axis=-3) for x in q_keys)  # (B, KVH, 1, S, w)
        q_values = tuple(mx.expand_dims(x, axis=-3) for x in q_values)
    scores = mx.quantized_matmul(queries, *q_keys, transpose=True, group_size=group_size, bits=bits)
    if mask is not None:
        if isinstance(mask, str):
            qL, kL = scores.shape[-2:]
            mask = mx.arange(kL - qL, kL)[:, None] >= mx.arange(kL)[None]  # (L, S) bottom-right causal
        if n_repeats > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores += mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *q_values, transpose=False, group_size=group_size, bits=bits)
    if n_repeats > 1:
        out = mx.reshape(out, (B, n_q_heads, L, D))
    return out


def dequantized(x: Any, dim: int) -> mx.array:
    """A quantized ``(packed, scales, biases)`` K/V tuple as a dense array (bits read off the shapes)."""
    if not isinstance(x, tuple):
        return x
    packed, scales, biases = x
    bits = packed.shape[-1] * 32 // dim
    return mx.dequantize(packed, scales, biases, group_size=dim // scales.shape[-1], bits=bits)


def softcapped_attention(queries: mx.array, keys: Any, values: Any, *, scale: float, mask: Mask,
                         softcap: float | None) -> mx.array:
    """Attention whose scores are soft-capped, ``cap * tanh(scores / cap)`` before the mask (Gemma 2).

    The ops, in order, are mlx-lm's ``gemma2`` attention: the fast kernel has no soft cap,
    so the scores are materialized. Grouped-query heads are handled by a reshape.

    Args:
        queries: ``(B, H, L, D)``.
        keys: ``(B, KVH, S, D)`` (or a quantized KV tuple, dequantized here).
        values: ``(B, KVH, S, Dv)`` (likewise).
        scale: multiplier on the queries.
        mask: ``None``, ``"causal"`` or a boolean/additive array broadcastable to ``(B, H, L, S)``.
        softcap: the cap, or ``None`` for plain softmax attention.

    Returns:
        ``(B, H, L, Dv)``.
    """
    B, H, L, D = queries.shape
    keys, values = dequantized(keys, D), dequantized(values, D)
    kvh = keys.shape[1]
    repeats = H // kvh
    queries = queries * scale
    if repeats > 1:
        queries = queries.reshape(B, kvh, repeats, L, D)  # (B, KVH, rep, L, D)
        keys = mx.expand_dims(keys, 2)  # (B, KVH, 1, S, D)
        values = mx.expand_dims(values, 2)
    scores = queries @ keys.swapaxes(-1, -2)  # (B, KVH, rep, L, S) or (B, H, L, S)
    if softcap is not None:
        scores = mx.tanh(scores / softcap)
        scores *= softcap
    if mask is not None:
        if isinstance(mask, str):
            qL, kL = scores.shape[-2:]
            mask = mx.arange(kL - qL, kL)[:, None] >= mx.arange(kL)[None]  # (L, S) bottom-right causal
        if repeats > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)  # (B, 1, 1, L, S)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    scores = mx.softmax(scores, precise=True, axis=-1)
    out = scores @ values
    if repeats > 1:
        out = out.reshape(B, H, L, -1)
    return out
