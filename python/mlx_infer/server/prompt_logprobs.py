"""Prompt logprobs: ``echo`` with ``logprobs`` on ``/v1/completions``, and vLLM's ``prompt_logprobs``.

What lm-eval-harness's log-likelihood requests ask (``echo: true, logprobs: k,
max_tokens: 0 or 1``): the log-probability the model gives each prompt token
after the tokens before it, teacher-forced, with the ``k`` most likely tokens
at each position. The first token has no context: its logprob and top entry
are ``null``, as OpenAI and vLLM answer.

The server asks the engine for them (``EngineRequest.prompt_logprobs``, scored by the
prefill over the request's own KV pages, so the prompt is admitted against the pool:
engine/prompt_scores.py). Here: :func:`echo_logprobs` lays them out as the legacy
``logprobs`` object, :func:`vllm_prompt_logprobs` as vLLM's ``prompt_logprobs`` (completions'
choices, chat's response), :func:`check_scorable` checks an echo-only prompt, and
:func:`prompt_logprobs` computes the same values with a plain cache outside any engine (a
library helper and the tests' second opinion), in chunks of at most :func:`chunk_size`
positions so the ``(positions, vocab)`` log-softmax stays bounded.
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx

from ..engine.prompt_scores import PromptLogprobs

#: Most float32 ``(positions, vocab)`` log-softmax entries one chunk holds (256 MiB).
MAX_CHUNK_ENTRIES = 2**26

__all__ = ["PromptLogprobs", "chunk_size", "prompt_logprobs", "echo_logprobs", "vllm_prompt_logprobs",
           "check_scorable"]


def chunk_size(vocab_size: int, limit: int = 512) -> int:
    """Positions per chunk: at most ``limit``, and at most :data:`MAX_CHUNK_ENTRIES` / vocab."""
    return max(1, min(limit, MAX_CHUNK_ENTRIES // max(vocab_size, 1)))


def prompt_logprobs(model: Any, ids: list[int], top: int, *, chunk: int = 512,
                    cancelled: threading.Event | None = None) -> PromptLogprobs | None:
    """Teacher-forced logprobs of ``ids`` under ``model`` (see the module docstring).

    Args:
        model: a causal LM: ``model(tokens (1, L), cache=...) -> logits (1, L, V)``, ``make_cache()``.
        ids: the prompt's token ids (at least one).
        top: how many most-likely tokens to list per position (0: none).
        chunk: positions per forward (the cache carries the prefix).
        cancelled: checked between chunks; when set, stop and return ``None``.
    """
    tokens = mx.array(ids, dtype=mx.uint32)  # (L,)
    cache = model.make_cache()
    lps: list[float | None] = [None]
    ranks: list[int | None] = [None]
    tops: list[list[tuple[int, float]] | None] = [None]
    n = len(ids) - 1  # positions that predict a prompt token
    for start in range(0, n, chunk):
        if cancelled is not None and cancelled.is_set():
            return None
        end = min(start + chunk, n)
        logits = model(tokens[start:end][None], cache=cache)[0].astype(mx.float32)  # (c, V)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (c, V)
        targets = tokens[start + 1:end + 1].astype(mx.int32)  # (c,)
        chosen = mx.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]  # (c,)
        rank = (logp > chosen[:, None]).sum(axis=-1) + 1  # (c,)
        outs = [chosen, rank, [c.state for c in cache]]
        if top:
            k = min(top, logp.shape[-1])
            idx = mx.argpartition(-logp, k - 1, axis=-1)[:, :k]  # (c, k), unordered
            vals = mx.take_along_axis(logp, idx, axis=-1)  # (c, k)
            order = mx.argsort(-vals, axis=-1)  # (c, k): most likely first
            idx, vals = mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
            outs += [idx, vals]
        mx.eval(outs)
        lps += chosen.tolist()
        ranks += rank.tolist()
        if top:
            tops += [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        else:
            tops += [None] * (end - start)
    return PromptLogprobs(token_ids=list(ids), logprobs=lps, top=tops, ranks=ranks)


def echo_logprobs(text: Any, prompt: PromptLogprobs, tokens: list[int], lps: list[float],
                  tops: list[list[tuple[int, float]]] | None, top: int) -> dict[str, Any]:
    """Legacy ``logprobs`` of the echoed prompt followed by the generated ``tokens``: one list over both,
    offsets counted over the token strings from 0 (as vLLM). A prompt position's top dict holds its top
    ``top`` tokens and the prompt token itself (vLLM's prompt logprobs); ``None`` at the first position.

    Args:
        text: ``text(token_id) -> str`` (the server's token strings).
    """
    strs = [text(t) for t in prompt.token_ids + tokens]
    offsets, pos = [], 0
    for s in strs:
        offsets.append(pos)
        pos += len(s)
    top_dicts = None
    if top:
        top_dicts = [None]
        for tok, lp, best in zip(prompt.token_ids[1:], prompt.logprobs[1:], prompt.top[1:]):
            entry = {text(i): v for i, v in (best or ())[:top]}  # the engine may have scored more
            entry.setdefault(text(tok), lp)
            top_dicts.append(entry)
        top_dicts += [{text(i): v for i, v in best} for best in tops or [[] for _ in tokens]]
    return {"tokens": strs, "token_logprobs": prompt.logprobs + list(lps), "top_logprobs": top_dicts,
            "text_offset": offsets}


def vllm_prompt_logprobs(text: Any, prompt: PromptLogprobs, k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token ``None`` (the first: no context) or
    ``{"<id>": {"logprob", "rank", "decoded_token"}}`` holding the prompt token itself (its rank
    in the whole distribution, 1 = most likely) and the ``k`` most likely tokens (ranks 1..k).

    Args:
        text: ``text(token_id) -> str`` (the server's token strings).
        prompt: the scores (with ``ranks``), at least ``k`` top entries per position.
    """
    ids, ranks = prompt.token_ids, prompt.ranks or [None] * len(prompt.token_ids)
    out: list[dict[str, dict[str, Any]] | None] = [None] if ids else []
    for p in range(1, len(ids)):
        tok = ids[p]
        entry = {str(tok): {"logprob": prompt.logprobs[p], "rank": ranks[p], "decoded_token": text(tok)}}
        for rank, (i, v) in enumerate((prompt.top[p] or [])[:k], 1):
            entry.setdefault(str(i), {"logprob": v, "rank": rank, "decoded_token": text(i)})
        out.append(entry)
    return out


def check_scorable(ids: list[int], vocab_size: int | None, context: int | None) -> None:
    """An echo-only prompt (``max_tokens: 0``, never submitted to the engine) must hold token ids of the
    vocabulary and fit the context.

    Raises:
        ValueError: naming what is wrong.
    """
    bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside this model's vocabulary [0, {vocab_size}).")
    if context is not None and len(ids) > context:
        raise ValueError(f"The prompt has {len(ids)} tokens but the model's context window is {context}; "
                         f"shorten it by at least {len(ids) - context} tokens.")
