"""KV bytes held for many sequences sharing a prompt prefix: paged store vs mlx-lm caches.

    python benchmarks/kv_memory.py --json benchmarks/results/kv-memory.json

16 sequences share a 2,048-token prefix and each adds 128 tokens of its own,
on the default model's geometry (read from its config.json; no weights are
loaded: random K/V of the model's shapes go through each cache's
``update_and_fetch``, so only KV bytes are measured).

- ours: one :class:`~mlx_infer.state.paged.PagedKVStore`; the first sequence
  writes the prefix (in ``--chunk``-token prefill chunks) and registers it,
  the others reuse it through the prefix index and write only their own
  tokens. Global and sliding-window layers have separate page pools (layer
  groups): a windowed group holds only its window (+ slack) of each sequence.
  Each group's pool is sized to fit exactly (its peak pages in a
  bookkeeping-only dry run of the same appends, null page included);
  ``ours_bytes`` is the storage the store allocated, ``ours_used_bytes`` the
  pages sequences reference at the end, ``ours_one_pool_bytes`` what one pool
  shared by every layer (every layer keeping every page) allocates, and
  ``groups`` the pages and layers of each group.
- mlx-lm: 16 sequences x one ``KVCache`` per layer, each prefilled with all
  2,048 + 128 tokens (its ``nbytes``: capacity in 256-token steps).
  ``mlx_lm_prompt_cache_bytes`` is the same with mlx-lm's own
  ``make_cache()`` for the model (rotating window caches on sliding layers).

Prints one JSON object; ``--json PATH`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def model_config(model: str | None) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from _common import resolve_model

    model_dir, _, _, _ = resolve_model(model)
    return json.loads((model_dir / "config.json").read_text())


def fill(caches: list, tokens: int, kv_heads: int, head_dim: int, dtype: mx.Dtype, chunk: int = 2048) -> None:
    """Write ``tokens`` random tokens through every layer's cache, in prefill chunks."""
    done = 0
    while done < tokens:
        n = min(chunk, tokens - done)
        for c in caches:
            k = mx.random.normal((1, kv_heads, n, head_dim)).astype(dtype)  # (1, KVH, n, D)
            c.update_and_fetch(k, k)
        mx.eval([c.state for c in caches])
        done += n


def run_bookkeeping(pages, prompts: list[list[int]], prefix_len: int, chunk: int) -> list[int]:
    """Peak pages of each group over the benchmark's appends, bookkeeping only (no K/V)."""
    peak = [0] * pages.num_groups

    def append(seq: int, tokens: int) -> None:
        for done in range(0, tokens, chunk):
            assert pages.append(seq, min(chunk, tokens - done)) is not None
            for g in range(pages.num_groups):
                peak[g] = max(peak[g], pages.pool(g).num_used_pages())

    for i, prompt in enumerate(prompts):
        cached = pages.add_sequence_with_prefix(i, prompt)
        if cached < prefix_len:
            append(i, prefix_len - cached)
            pages.register_full_pages(i, prompt[:prefix_len])
        append(i, len(prompt) - max(cached, prefix_len))
        pages.register_full_pages(i, prompt)
    return peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded Gemma 3 270M)")
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--own-tokens", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk of our store (tokens)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--json", nargs="?", const="", default=None, metavar="PATH",
                   help="print the JSON object (always printed); with PATH also write it there")
    args = p.parse_args()

    from mlx_lm.models.cache import KVCache
    from mlx_lm.utils import _get_classes

    from mlx_infer.models import get_model_classes
    from mlx_infer.state.paged import PagedKVStore, model_geometry

    config = model_config(args.model)
    model_cls, args_cls = get_model_classes(config["model_type"])
    model = model_cls(args_cls.from_dict(config))  # weights stay lazy: never evaluated
    windows, kv_heads, head_dim = model_geometry(model)
    n_layers, dtype, P = len(windows), DTYPES[args.dtype], args.page_size
    S, prefix_len, own = args.sequences, args.prefix_tokens, args.own_tokens
    mx.random.seed(0)

    # ours: each group's pool sized to its peak in a dry run of the same appends
    prefix = list(range(prefix_len))
    prompts = [prefix + [100_000 + i] * own for i in range(S)]
    probe = PagedKVStore.for_model(model, num_pages=1 + S * -(-(prefix_len + own) // P), page_size=P)
    pages = [1 + n for n in run_bookkeeping(probe.pages, prompts, prefix_len, args.chunk)]
    store = PagedKVStore.for_model(model, num_pages=pages, page_size=P, dtype=dtype)
    cached = []
    for prompt in prompts:
        seq = store.add_sequence(prompt)
        cached.append(seq.cached_tokens)
        caches = store.make_cache(seq)
        if seq.cached_tokens < prefix_len:  # the first: write the prefix, index it, go on
            fill(caches, prefix_len, kv_heads, head_dim, dtype, args.chunk)
            seq.register(prefix)
        fill(caches, len(prompt) - max(seq.cached_tokens, prefix_len), kv_heads, head_dim, dtype, args.chunk)
        seq.register(prompt)
    assert cached == [0] + [prefix_len] * (S - 1), cached
    groups = [{"window": g.window, "layers": len(g.layers), "pages": g.num_pages,
               "used_pages": store.pages.pool(g.index).num_used_pages(),
               "bytes": sum(store.storage[i].nbytes for i in g.layers)} for g in store.groups]
    layer_page = store.page_bytes // n_layers  # every layer has the same shapes here
    one_pool_bytes = n_layers * layer_page * (1 + -(-prefix_len // P) + S * -(-own // P))

    # mlx-lm: one KVCache per layer per sequence, each with every token
    mlx_lm_bytes = 0
    for _ in range(S):
        caches = [KVCache() for _ in range(n_layers)]
        fill(caches, prefix_len + own, kv_heads, head_dim, dtype)
        mlx_lm_bytes += sum(c.nbytes for c in caches)
    lm_model_cls, lm_args_cls = _get_classes(config)
    lm_model = lm_model_cls(lm_args_cls.from_dict(config))
    prompt_cache_bytes = 0
    for _ in range(S):
        caches = lm_model.make_cache()
        fill(caches, prefix_len + own, kv_heads, head_dim, dtype)
        prompt_cache_bytes += sum(c.nbytes for c in caches)

    result = {
        "model_type": config["model_type"], "layers": n_layers, "kv_heads": kv_heads, "head_dim": head_dim,
        "dtype": args.dtype, "sequences": S, "prefix_tokens": prefix_len, "own_tokens": own, "page_size": P,
        "chunk": args.chunk, "window_slack": store.pages.slack, "groups": groups,
        "ours_bytes": store.nbytes, "ours_used_bytes": store.used_bytes, "mlx_lm_bytes": mlx_lm_bytes,
        "ours_one_pool_bytes": one_pool_bytes, "ratio_vs_one_pool": store.nbytes / one_pool_bytes,
        "ratio": store.nbytes / mlx_lm_bytes, "goal_ratio": 1 / 8,
        "mlx_lm_prompt_cache_bytes": prompt_cache_bytes,
        "ratio_vs_prompt_cache": store.nbytes / prompt_cache_bytes,
    }
    text = json.dumps(result)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
