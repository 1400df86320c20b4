"""Prefill throughput, TTFT and peak memory vs prompt length, mlx-infer beside mlx-lm.

    python benchmarks/prefill.py --prompt-lengths 128,512,2048,8192,32768 --json benchmarks/results/cpu-prefill.json
"""

from __future__ import annotations

from _common import engines_for, finish, parser, resolve_model

from mlx_infer.bench import BenchConfig, run_bench


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--prompt-lengths", default="128,512,2048,8192,32768")
    p.add_argument("--generation-tokens", "-g", type=int, default=8)
    args = p.parse_args()
    model_dir, gguf, name, vocab = resolve_model(args.model)
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    engines = engines_for(args, model_dir, gguf, max(lengths) + args.generation_tokens + 16)
    rows = []
    for n in lengths:
        rows += run_bench(engines, BenchConfig(prompt_tokens=n, generation_tokens=args.generation_tokens,
                                               num_trials=args.num_trials, suite="prefill"),
                          model_name=name, vocab_size=vocab)
    finish(args, rows, x="prompt_tokens")


if __name__ == "__main__":
    main()
