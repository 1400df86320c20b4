"""Decode throughput vs batch size, mlx-infer beside mlx-lm in one run.

    python benchmarks/decode.py --batch-sizes 1,8,32 -p 512 -g 128 --json benchmarks/results/cpu-decode.json
"""

from __future__ import annotations

from _common import engines_for, finish, parser, resolve_model

from mlx_infer.bench import BenchConfig, run_bench


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--prompt-tokens", "-p", type=int, default=512)
    p.add_argument("--generation-tokens", "-g", type=int, default=128)
    args = p.parse_args()
    model_dir, gguf, name, vocab = resolve_model(args.model)
    engines = engines_for(args, model_dir, gguf, args.prompt_tokens + args.generation_tokens + 16)
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        live = [e for e in engines if b == 1 or e.name != "llama.cpp"]
        rows += run_bench(live, BenchConfig(prompt_tokens=args.prompt_tokens, generation_tokens=args.generation_tokens,
                                            batch_size=b, num_trials=args.num_trials, suite="decode"),
                          model_name=name, vocab_size=vocab)
    finish(args, rows, x="batch" if len(args.batch_sizes.split(",")) > 1 else "engine")


if __name__ == "__main__":
    main()
