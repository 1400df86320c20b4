"""Prefill time with and without the prompt cache: a second call sharing a long prefix.

    python benchmarks/prompt_cache.py --prefix-tokens 1024 --suffix-tokens 32 --json results/cpu-prompt-cache.json

Prints one JSON object: median prefill ms of the cold call (empty cache) and of the warm
call (the same prefix cached), their ratio, and the cached token count.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import mlx.core as mx

from mlx_infer.artifacts.loader import load_model
from mlx_infer.bench.report import results_document, write_json
from mlx_infer.generation.autoregressive import generate_tokens
from mlx_infer.generation.prompt_cache import PromptCache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--num-trials", "-n", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    loaded = load_model(args.model)
    vocab = loaded.config.get("vocab_size") or loaded.config["text_config"]["vocab_size"]
    cold, warm, cached = [], [], 0
    for trial in range(args.num_trials + 1):  # trial 0 warms up
        key = mx.random.key(trial)
        prefix = mx.random.randint(0, vocab, (args.prefix_tokens,), key=key).tolist()
        a = mx.random.randint(0, vocab, (args.suffix_tokens,), key=mx.random.key(1000 + trial)).tolist()
        b = mx.random.randint(0, vocab, (args.suffix_tokens,), key=mx.random.key(2000 + trial)).tolist()
        pc = PromptCache()
        g1 = generate_tokens(loaded.model, prefix + a, max_tokens=1, prompt_cache=pc)
        list(g1)
        g2 = generate_tokens(loaded.model, prefix + b, max_tokens=1, prompt_cache=pc)
        list(g2)
        if trial:
            cold.append(g1.stats.prefill_ms)
            warm.append(g2.stats.prefill_ms)
            cached = g2.stats.cached_tokens
    result = {"prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens,
              "cold_prefill_ms": statistics.median(cold), "warm_prefill_ms": statistics.median(warm),
              "speedup": statistics.median(cold) / statistics.median(warm), "cached_tokens": cached}
    print(json.dumps(result))
    if args.json:
        doc = results_document([])
        doc["prompt_cache"] = result
        write_json(doc, Path(args.json))


if __name__ == "__main__":
    main()
