"""Logits processors: pure functions ``(logits (B, V), history) -> logits (B, V)``.

Each penalty looks at its own window of the token history (prompt plus
generated tokens): the last ``context_size`` tokens, or all of them when
``context_size`` is 0. The arithmetic is mlx-lm's (``sample_utils``), so the
processed logits are bit-identical to it; unlike mlx-lm none of them writes
into the caller's array.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import mlx.core as mx

from .params import SamplingParams

History = Sequence[int]
LogitsProcessor = Callable[[mx.array, History], mx.array]


def _window(history: History, context_size: int) -> list[int]:
    if isinstance(history, mx.array):
        history = history.tolist()
    return list(history[-context_size:]) if context_size > 0 else list(history)


def apply_logit_bias(logits: mx.array, ids: mx.array, values: mx.array) -> mx.array:
    """Add ``values`` (N,) to ``logits[:, ids]`` (``ids`` unique)."""
    return logits.at[:, ids].add(values)  # (B, V)


def apply_repetition_penalty(logits: mx.array, tokens: Sequence[int], penalty: float) -> mx.array:
    """Sign-aware multiplicative penalty (CTRL): x<0 -> x*penalty, else x/penalty, once per token."""
    if not tokens:
        return logits
    idx = mx.array(sorted(set(tokens)))  # (N,)
    sel = logits[:, idx]  # (B, N)
    sel = mx.where(sel < 0, sel * penalty, sel / penalty)
    idx = mx.broadcast_to(idx[None], sel.shape)
    return mx.put_along_axis(logits, idx, sel, axis=-1)


def apply_presence_penalty(logits: mx.array, tokens: Sequence[int], penalty: float) -> mx.array:
    """Subtract ``penalty`` once from every token that occurs in ``tokens``."""
    if not tokens:
        return logits
    return logits.at[:, mx.array(sorted(set(tokens)))].subtract(penalty)


def apply_frequency_penalty(logits: mx.array, tokens: Sequence[int], penalty: float) -> mx.array:
    """Subtract ``penalty`` once per occurrence of each token in ``tokens``."""
    if not tokens:
        return logits
    return logits.at[:, mx.array(list(tokens))].subtract(penalty)


def _logit_bias_processor(bias: Mapping[int, float]) -> LogitsProcessor:
    ids = mx.array(list(bias.keys()))
    values = mx.array(list(bias.values()))

    def logit_bias(logits: mx.array, history: History) -> mx.array:
        return apply_logit_bias(logits, ids, values)

    return logit_bias


def _window_processor(fn: Callable[[mx.array, Sequence[int], float], mx.array], penalty: float,
                      context_size: int) -> LogitsProcessor:
    def processor(logits: mx.array, history: History) -> mx.array:
        return fn(logits, _window(history, context_size), penalty)

    processor.__name__ = fn.__name__.removeprefix("apply_")
    return processor


def make_logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """The active processors of ``params``, in order: logit bias, repetition,
    presence, frequency. Inactive ones are left out."""
    out: list[LogitsProcessor] = []
    if params.logit_bias:
        out.append(_logit_bias_processor(params.logit_bias))
    if params.repetition_penalty != 1.0:
        out.append(_window_processor(apply_repetition_penalty, params.repetition_penalty,
                                     params.repetition_context_size))
    if params.presence_penalty != 0.0:
        out.append(_window_processor(apply_presence_penalty, params.presence_penalty,
                                     params.presence_context_size))
    if params.frequency_penalty != 0.0:
        out.append(_window_processor(apply_frequency_penalty, params.frequency_penalty,
                                     params.frequency_context_size))
    return out
