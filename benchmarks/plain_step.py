"""Decode tokens/s of the plain compiled step (``CompiledDecodeStep``) on small random models, CPU.

    python benchmarks/plain_step.py --families llama,gemma3 --batch-sizes 1,8 -p 1536 -g 64

A long prompt makes the KV large beside the weights, so a step that copied the
whole KV (a hand-off that keeps MLX from updating the caches in place) shows as
a clear drop in tokens/s. Each row: the median (and the best: the machine
may be shared) over ``-n`` trials of one
greedy generation of ``-g`` tokens after an eager prefill of ``-p`` tokens,
pipelined as the generation loop runs it (the next step queued before the
current token is read).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tiny import make_tiny_model_dir  # noqa: E402

from mlx_infer.artifacts.loader import load_model  # noqa: E402
from mlx_infer.generation.bindings.decode_step import CompiledDecodeStep  # noqa: E402

#: Bigger than tests/tiny.py's defaults so the KV (not the Python overhead) dominates a step.
SIZES = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "vocab_size": 320}
#: Per family, what its config needs beside SIZES (gemma4: its KV-shared, per-layer-input variant, 6 layers).
EXTRA = {"gemma3": {"head_dim": 32},
         "gemma4": {"head_dim": 32, "global_head_dim": 64, "num_hidden_layers": 6, "num_kv_shared_layers": 2,
                    "hidden_size_per_layer_input": 8,
                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}}


def trial(model, step: CompiledDecodeStep, batch: int, prompt: int, gen: int) -> float:
    """Tokens/s (all rows) of one greedy generation."""
    cache = model.make_cache()
    tokens = mx.random.randint(5, 300, (batch, prompt), key=mx.random.key(batch)).astype(mx.uint32)  # (B, P)
    model.model(tokens[:, :-1], cache=cache)
    mx.eval([c.state for c in cache])
    y = mx.argmax(step.step(tokens[:, -1], cache), axis=-1)  # (B,)
    mx.eval(y)
    tic = time.perf_counter()
    for _ in range(gen):
        nxt = mx.argmax(step.step(y, cache), axis=-1)  # (B,), queued before y is read
        mx.async_eval(nxt)
        y.tolist()
        y = nxt
    y.tolist()
    return batch * gen / (time.perf_counter() - tic)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="llama,gemma3")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-tokens", "-p", type=int, default=1536)
    p.add_argument("--generation-tokens", "-g", type=int, default=64)
    p.add_argument("--num-trials", "-n", type=int, default=3)
    args = p.parse_args()
    for family in args.families.split(","):
        path = make_tiny_model_dir(Path(tempfile.mkdtemp()) / family, family, **{**SIZES, **EXTRA.get(family, {})})
        model = load_model(path).model
        step = CompiledDecodeStep(model)
        for b in (int(x) for x in args.batch_sizes.split(",")):
            trial(model, step, b, args.prompt_tokens, 4)  # warm-up: traces
            rates = [trial(model, step, b, args.prompt_tokens, args.generation_tokens)
                     for _ in range(args.num_trials)]
            print(f"{family:8s} batch {b:2d}  prompt {args.prompt_tokens}  median {statistics.median(rates):8.1f}"
                  f"  best {max(rates):8.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
