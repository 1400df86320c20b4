"""Static batches: B prompts of equal length decoded together in one forward per step.

This is the simple batched path (benchmarks, offline jobs); ragged prompts and
requests joining mid-flight belong to the continuous-batching engine.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from ..errors import MlxInferError
from ..sampling import RequestRNG, SamplingParams, make_sampler
from .autoregressive import DEFAULT_PREFILL_STEP_SIZE, GREEDY, GenerateStats


def generate_batch(
    model: Any,
    prompts: list[list[int]],
    *,
    max_tokens: int,
    sampling: SamplingParams | list[SamplingParams] = GREEDY,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
) -> tuple[list[list[int]], GenerateStats]:
    """Generate ``max_tokens`` tokens for each of B equal-length prompts (no EOS stop).

    Each row samples with its own :class:`SamplingParams` (one for all, or one
    per row) and its own key sequence, so a seeded row draws the same tokens
    as it would alone.

    Returns:
        The generated ids per prompt and the batch's stats (token counts are
        totals over the batch, so ``decode_tps`` is the aggregate throughput).
    """
    if not prompts or any(len(p) != len(prompts[0]) for p in prompts) or not prompts[0]:
        raise MlxInferError("generate_batch needs non-empty prompts of equal length; "
                            "use the batching engine for ragged prompts.")
    if max_tokens < 1:
        raise MlxInferError(f"max_tokens must be >= 1, got {max_tokens}.")
    B, L = len(prompts), len(prompts[0])
    params = sampling if isinstance(sampling, list) else [sampling] * B
    if len(params) != B:
        raise MlxInferError(f"got {len(params)} SamplingParams for {B} prompts.")
    samplers = [make_sampler(p) for p in params]
    rngs = [RequestRNG(p.seed) for p in params]
    all_greedy = all(p.greedy and not smp.processors for p, smp in zip(params, samplers))
    history = [list(p) for p in prompts]
    mx.reset_peak_memory()
    cache = model.make_cache()
    tokens = mx.array(prompts, dtype=mx.uint32)  # (B, L)

    def step(y: mx.array) -> mx.array:
        logits = model(y, cache=cache)[:, -1, :]  # (B, vocab)
        if all_greedy:
            return mx.argmax(logits, axis=-1)[:, None]  # (B, 1)
        rows = [smp(logits[i:i + 1], history[i], r) for i, (smp, r) in enumerate(zip(samplers, rngs))]
        return mx.concatenate(rows)[:, None]  # (B, 1)

    needs_history = any(smp.processors for smp in samplers)

    tic = time.perf_counter()
    for start in range(0, L - 1, prefill_step_size):
        model.model(tokens[:, start:min(start + prefill_step_size, L - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    y = step(tokens[:, -1:])
    mx.eval(y)
    first = time.perf_counter()
    out = [y]
    for _ in range(max_tokens - 1):
        if needs_history:  # penalties read the tokens so far: sync first
            for h, t in zip(history, y[:, 0].tolist()):
                h.append(t)
        y = step(y)
        mx.async_eval(y)
        out.append(y)
    generated = mx.concatenate(out, axis=1)  # (B, max_tokens)
    mx.eval(generated)
    end = time.perf_counter()
    stats = GenerateStats(
        prompt_tokens=B * L, generated_tokens=B * max_tokens, prefill_ms=(first - tic) * 1e3,
        decode_ms=(end - first) * 1e3, cache_tokens=L + max_tokens - 1,
        peak_memory_gb=mx.get_peak_memory() / 1e9, finish_reason="length",
    )
    return generated.tolist(), stats
