"""``mlx-infer generate | convert`` — thin over the library.

Flags follow ``mlx_lm.generate`` / ``mlx_lm.convert`` where the verbs overlap.
Generated text goes to stdout; stats, progress and errors go to stderr.
Bad input exits with status 2 and a one-line message, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .errors import MlxInferError


def _generate(args: argparse.Namespace) -> int:
    from .artifacts.loader import load_model
    from .generation.autoregressive import generate

    loaded = load_model(args.model, dtype=args.dtype)
    gen = generate(loaded, args.prompt, max_tokens=args.max_tokens, temperature=args.temp,
                   seed=args.seed, chat=args.chat)
    with gen:
        for item in gen:
            if item.text:
                sys.stdout.write(item.text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    s = gen.stats
    if args.verbose:
        print(f"prompt: {s.prompt_tokens} tokens, {s.prefill_tps:.2f} tokens/s\n"
              f"generation: {s.generated_tokens} tokens, {s.decode_tps:.2f} tokens/s\n"
              f"peak memory: {s.peak_memory_gb:.3f} GB\nfinish: {s.finish_reason}", file=sys.stderr)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .artifacts.convert import convert

    if args.quantize not in (None, 4, 8):
        raise MlxInferError(f"--quantize takes 4 or 8 bits, got {args.quantize}.")
    out = convert(Path(args.model), Path(args.mlx_path), quantize_bits=args.quantize,
                  group_size=args.q_group_size, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(prog="mlx-infer", description="Run language models on MLX.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--model", default=None,
                   help="model directory or .gguf file (default: the embedded Gemma 3 270M)")
    g.add_argument("--prompt", "-p", required=True, help="the prompt text ('-' reads stdin)")
    g.add_argument("--max-tokens", "-m", type=int, default=256, help="most tokens to generate")
    g.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (default: fresh)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="cast weights to this dtype")
    g.add_argument("--verbose", type=lambda s: s.lower() in ("1", "true", "yes"), default=True,
                   help="print stats on stderr (default true)")
    g.set_defaults(func=_generate)

    c = sub.add_parser("convert", help="write a GGUF or HF model as an MLX directory")
    c.add_argument("--model", "--hf-path", dest="model", required=True, help="source .gguf file or HF directory")
    c.add_argument("--mlx-path", "-o", required=True, help="output directory")
    c.add_argument("--quantize", "-q", type=int, default=None, help="quantize to 4 or 8 bits")
    c.add_argument("--q-group-size", type=int, default=64, help="quantization group size")
    c.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="dtype of unquantized weights")
    c.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    c.set_defaults(func=_convert)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mlx-infer`` console script."""
    args = build_parser().parse_args(argv)
    if getattr(args, "prompt", None) == "-":
        args.prompt = sys.stdin.read()
    try:
        return args.func(args)
    except MlxInferError as e:
        print(f"mlx-infer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mlx-infer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
