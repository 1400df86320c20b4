"""Static batches: B prompts of equal length decoded together in one forward per step.

This is the simple batched path (benchmarks, offline jobs); ragged prompts and
requests joining mid-flight belong to the continuous-batching engine.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from ..errors import MlxInferError
from ..sampling import RequestRNG, sample
from .autoregressive import DEFAULT_PREFILL_STEP_SIZE, GenerateStats


def generate_batch(
    model: Any,
    prompts: list[list[int]],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    seeds: list[int | None] | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
) -> tuple[list[list[int]], GenerateStats]:
    """Generate ``max_tokens`` tokens for each of B equal-length prompts (no EOS stop).

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
    rngs = [RequestRNG(s) for s in (seeds or [None] * B)]
    mx.reset_peak_memory()
    cache = model.make_cache()
    tokens = mx.array(prompts, dtype=mx.uint32)  # (B, L)

    def step(y: mx.array) -> mx.array:
        logits = model(y, cache=cache)[:, -1, :]  # (B, vocab)
        if temperature == 0:
            return sample(logits, temperature=0)[:, None]
        rows = [sample(logits[i:i + 1], temperature=temperature, rng=r) for i, r in enumerate(rngs)]
        return mx.concatenate(rows)[:, None]

    tic = time.perf_counter()
    for start in range(0, L - 1, prefill_step_size):
        model.model(tokens[:, start:min(start + prefill_step_size, L - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    y = step(tokens[:, -1:])
    mx.eval(y)
    first = time.perf_counter()
    out = [y]
    for _ in range(max_tokens - 1):
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
