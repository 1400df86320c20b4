"""Which precision the embedded default model is cached in: float32 vs bf16, 8-bit and 4-bit affine.

For each variant (converted once from the default GGUF into a scratch directory) it measures greedy
agreement with the float32 reference over ``--tokens`` tokens on a fixed prompt set (matching positions
and the length of the common prefix), decode and prompt tok/s (a ~``--long`` token prompt), load time,
disk size and peak memory. Variants run interleaved for ``--rounds`` rounds (the machine may be shared:
speed figures are medians over rounds).

    python benchmarks/default_precision.py --json benchmarks/results/cpu-default-precision.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from mlx_infer.artifacts.convert import convert
from mlx_infer.artifacts.default_model import default_model_gguf
from mlx_infer.artifacts.loader import load_model
from mlx_infer.generation.autoregressive import generate

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Photosynthesis is the process by which plants",
    "Once upon a time, in a small village by the sea, there lived",
]
VARIANTS = {  # name -> convert() arguments
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "q8": {"quantize_bits": 8},
    "q4": {"quantize_bits": 4},
}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _run(loaded: object, prompt: str, n: int) -> tuple[list[int], float, float]:
    gen = generate(loaded, prompt, max_tokens=n)
    with gen:
        ids = [item.token for item in gen]
    return ids, gen.stats.decode_tps, gen.stats.prefill_tps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/mlx-infer-precision", help="scratch directory for the variants")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--long", type=int, default=512, help="prompt tokens of the prompt-speed run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    gguf = default_model_gguf()
    work = Path(args.work)
    dirs = {}
    for name, kw in VARIANTS.items():
        out = work / name
        if not (out / "config.json").is_file():
            convert(gguf, out, overwrite=True, progress=False, **kw)
        dirs[name] = out
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * (args.long // 10))

    tokens: dict[str, list[list[int]]] = {}
    speed: dict[str, dict[str, list[float]]] = {n: {"decode": [], "prefill": [], "load_s": [], "peak": []}
                                                for n in VARIANTS}
    for r in range(args.rounds):
        for name in VARIANTS:
            mx.reset_peak_memory()
            t0 = time.perf_counter()
            loaded = load_model(dirs[name])
            speed[name]["load_s"].append(time.perf_counter() - t0)
            outs = []
            decode = []
            for prompt in PROMPTS:
                ids, d, _ = _run(loaded, prompt, args.tokens)
                outs.append(ids)
                decode.append(d)
            _, _, pre = _run(loaded, long_prompt, 2)
            speed[name]["decode"].append(statistics.median(decode))
            speed[name]["prefill"].append(pre)
            speed[name]["peak"].append(mx.get_peak_memory() / 1e9)
            tokens.setdefault(name, outs)
            print(f"round {r + 1} {name}: decode {statistics.median(decode):.1f} tok/s, prompt {pre:.0f} tok/s",
                  file=sys.stderr)
            del loaded

    ref = tokens["float32"]
    rows = []
    for name in VARIANTS:
        same = sum(a == b for o, rr in zip(tokens[name], ref) for a, b in zip(o, rr))
        total = sum(len(rr) for rr in ref)
        prefix = []
        for o, rr in zip(tokens[name], ref):
            k = 0
            while k < min(len(o), len(rr)) and o[k] == rr[k]:
                k += 1
            prefix.append(k)
        rows.append({
            "variant": name, "disk_mb": round(_dir_bytes(dirs[name]) / 1e6, 1),
            "agreement": round(same / total, 4), "common_prefix": prefix,
            "decode_tps": round(statistics.median(speed[name]["decode"]), 2),
            "prompt_tps": round(statistics.median(speed[name]["prefill"]), 1),
            "load_s": round(statistics.median(speed[name]["load_s"]), 2),
            "peak_gb": round(max(speed[name]["peak"]), 3),
            "decode_rounds": [round(x, 2) for x in speed[name]["decode"]],
        })
    doc = {"model": gguf.name, "prompts": PROMPTS, "tokens": args.tokens, "long_prompt_tokens": args.long,
           "rounds": args.rounds, "device": str(mx.default_device()), "rows": rows}
    print("| variant | disk MB | agreement vs f32 | common prefix (of %d) | decode tok/s | prompt tok/s | load s | peak GB |"
          % args.tokens)
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['disk_mb']} | {r['agreement']:.1%} | {r['common_prefix']} | {r['decode_tps']} "
              f"| {r['prompt_tps']} | {r['load_s']} | {r['peak_gb']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
