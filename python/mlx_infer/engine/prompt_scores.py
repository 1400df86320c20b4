"""Prompt logprobs in the engine (vLLM's ``prompt_logprobs``): scored while the prompt prefills.

A request with ``EngineRequest.prompt_logprobs = k`` gets, for every prompt token after the
first, the log-probability the model gave it after the tokens before it (teacher-forced), and
the ``k`` most likely tokens there. The values come from the engine's own prefill forwards,
over the request's pages, so the prompt's KV is admitted, scheduled and preempted against the
pool like any other (a prompt the pool cannot hold is refused at submit). Per prefill chunk of
``n`` positions the LM head runs on the chunk's hidden states in slices of at most
:data:`MAX_SCORE_ENTRIES` / vocab positions, so its ``(positions, vocab)`` float32 log-softmax
stays bounded.

Such a request takes no prefix-cache hit (every position must be computed) and its chunks never
ride a mixed step (the compiled step returns no hidden states). The first prompt token has no
context: its entries are ``None`` (as OpenAI and vLLM answer). Values are the raw log-softmax
(no temperature, penalty or bias), as vLLM's prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .scheduler import LiveRequest

#: Most float32 ``(positions, vocab)`` log-softmax entries one slice of the LM head holds (64 MiB).
MAX_SCORE_ENTRIES = 2**24


@dataclass(frozen=True)
class PromptLogprobs:
    """Per prompt token: its logprob (``None`` for the first), the top ``k`` ``[(id, logprob)]``
    most likely first (``None`` for the first, or when ``k`` is 0), and its rank (1 + how many
    tokens the model found more likely; ``None`` for the first; ``ranks`` ``None`` when not computed)."""

    token_ids: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]
    ranks: list[int | None] | None = None


def wants_scores(r: LiveRequest) -> bool:
    """Whether ``r`` asked for prompt logprobs."""
    return getattr(r.request, "prompt_logprobs", None) is not None


def score_chunk(model: Any, rows: list[LiveRequest], h: mx.array, vocab_size: int | None) -> None:
    """Score the positions of this prefill chunk for the rows that asked (before ``prefilled`` moves).

    Args:
        model: the graph (``logits_from_hidden``).
        rows: the chunk's rows; row ``i`` fed ``all_ids[prefilled:prefilled + n]``.
        h: ``(B, n, hidden)`` the chunk's hidden states.
        vocab_size: the logits width (sizes the LM head's slices; ``None``: one slice).
    """
    for i, r in enumerate(rows):
        if not wants_scores(r):
            continue
        k = r.request.prompt_logprobs
        start = r.prefilled
        m = min(h.shape[1], r.prompt_len - 1 - start)  # positions that predict a prompt token
        if m <= 0:
            continue
        if r.prompt_scores is None or start == 0:  # first chunk (again, after a preemption)
            r.prompt_scores = ([None] * r.prompt_len, [None] * r.prompt_len, [None] * r.prompt_len)
        lps, tops, ranks = r.prompt_scores
        targets = mx.array(r.all_ids[start + 1:start + 1 + m], mx.int32)  # (m,)
        step = max(1, MAX_SCORE_ENTRIES // vocab_size) if vocab_size else m
        for j in range(0, m, step):
            logits = model.logits_from_hidden(h[i:i + 1, j:min(m, j + step)])[0].astype(mx.float32)  # (s, V)
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (s, V)
            chosen = mx.take_along_axis(logp, targets[j:j + logp.shape[0], None], axis=-1)[:, 0]  # (s,)
            rank = (logp > chosen[:, None]).sum(axis=-1) + 1  # (s,)
            outs = [chosen, rank]
            if k:
                kk = min(k, logp.shape[-1])
                idx = mx.argpartition(-logp, kk - 1, axis=-1)[:, :kk]  # (s, k), unordered
                vals = mx.take_along_axis(logp, idx, axis=-1)  # (s, k)
                order = mx.argsort(-vals, axis=-1)  # (s, k): most likely first
                idx, vals = mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
                outs += [idx, vals]
            mx.eval(outs)
            at = start + j + 1  # the prompt index the slice's first position predicts
            lps[at:at + logp.shape[0]] = chosen.tolist()
            ranks[at:at + logp.shape[0]] = rank.tolist()
            if k:
                tops[at:at + logp.shape[0]] = [list(zip(a, b)) for a, b in zip(idx.tolist(), vals.tolist())]
        if start + m == r.prompt_len - 1:  # the whole prompt is scored: hand it over before the first token
            r.handle.prompt_logprobs = PromptLogprobs(token_ids=list(r.all_ids[:r.prompt_len]), logprobs=lps,
                                                      top=tops if k else [None] * r.prompt_len, ranks=ranks)
