"""Sampling policy: turn a step's logits into the next token.

:func:`make_sampler` builds, once per request, the list of active steps of its
:class:`SamplingParams`; inactive ones cost nothing. A step runs, in order:

0. **Constraint** (when the request has one, see :mod:`mlx_infer.constraints`) — tokens the
   grammar does not allow get -inf (``Sampler.step(..., bitmask=...)``).
1. **Logit bias** — add ``logit_bias[id]`` to each listed token's logit.
2. **Repetition penalty** — tokens in the last ``repetition_context_size``
   history tokens: negative logits times the penalty, others divided by it.
3. **Presence penalty** — subtract it once from tokens in the last
   ``presence_context_size`` history tokens.
4. **Frequency penalty** — subtract it once per occurrence in the last
   ``frequency_context_size`` history tokens.
   (History is prompt + generated tokens; a context size of 0 means all of it.)
5. **Log-softmax** of the processed logits. With ``logprobs=True`` this is the
   distribution reported (and its ``top_logprobs`` most likely ids).
6. **Temperature 0 stops here** (as does any temperature below
   :data:`MIN_TEMPERATURE`, stored as 0): the token is the argmax of the
   processed logits; steps 7–10 are skipped.
7. **top_p** — keep the smallest most-likely set with mass >= top_p (at least
   the most likely token, even when top_p rounds to 0 in float32).
8. **min_p** — drop tokens with p < min_p · p_max, keeping at least
   ``min_tokens_to_keep``.
9. **XTC** — with chance ``xtc_probability``, drop every token with
   p > ``xtc_threshold`` except the least likely of them; EOS and newline
   tokens are never dropped.
10. **top_k** — keep the k most likely tokens.
11. **Temperature and draw** — a categorical draw from ``logprobs / temperature``
    with the request's own :class:`RequestRNG` key for this step (XTC's coin,
    when 0 < xtc_probability < 1, uses a split of that key).

Every value is checked in the float32 terms these steps compute in (see
:class:`SamplingParams`). The order and arithmetic are mlx-lm 0.32.2's (``make_logits_processors`` then
``make_sampler``), so each stage matches it on the same input.
"""

from .filters import apply_min_p, apply_top_k, apply_top_p, apply_xtc, log_softmax, make_filters
from .params import DEFAULT_CONTEXT_SIZE, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, MIN_TEMPERATURE, SamplingParams
from .processors import (
    apply_frequency_penalty,
    apply_logit_bias,
    apply_presence_penalty,
    apply_repetition_penalty,
    make_logits_processors,
)
from .sampler import RequestRNG, RNGState, SampleOutput, Sampler, make_sampler, sample

__all__ = [
    "DEFAULT_CONTEXT_SIZE",
    "MAX_LOGIT_BIAS",
    "MAX_TOP_LOGPROBS",
    "MIN_TEMPERATURE",
    "RNGState",
    "RequestRNG",
    "SampleOutput",
    "Sampler",
    "SamplingParams",
    "apply_frequency_penalty",
    "apply_logit_bias",
    "apply_min_p",
    "apply_presence_penalty",
    "apply_repetition_penalty",
    "apply_top_k",
    "apply_top_p",
    "apply_xtc",
    "log_softmax",
    "make_filters",
    "make_logits_processors",
    "make_sampler",
    "sample",
]
