"""Time to first token of a prompt alone vs joining decoding streams (the engine, in process).

    python benchmarks/join_ttft.py --shape llama-1b -p 512 --streams 31      # on a GPU
    python benchmarks/join_ttft.py --shape gemma3-270m --toy -p 512           # CPU smoke run

Random weights of a real shape (``served.py``'s ``--shape``). Per trial:
a lone ``-p``-token prompt's TTFT (submit to first token), then ``--streams``
requests decode (short prompts, long generations) and, once all of them
decode, the same-length prompt joins: its TTFT under load. Medians of
``-n`` trials after a warm-up; the ratio is the issue's "within 2x" figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from served_models import shape_dir  # noqa: E402

from mlx_infer.artifacts.loader import load_model  # noqa: E402
from mlx_infer.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from mlx_infer.engine.scheduler import DECODE  # noqa: E402


def ttft(engine: Engine, prompt: list[int]) -> float:
    first = threading.Event()
    t0 = time.perf_counter()
    engine.submit(EngineRequest(prompt_ids=prompt, max_tokens=2, ignore_eos=True, detokenize=False),
                  on_token=lambda ev: first.set())
    first.wait()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-1b")
    p.add_argument("--toy", action="store_true")
    p.add_argument("--prompt-tokens", "-p", type=int, default=512)
    p.add_argument("--streams", type=int, default=31)
    p.add_argument("--num-trials", "-n", type=int, default=3)
    p.add_argument("--memory-budget", type=float, default=None)
    p.add_argument("--no-mixed", action="store_true", help="prefill in its own forward (EngineConfig.mixed_steps off)")
    args = p.parse_args()
    loaded = load_model(shape_dir(args.shape, args.toy, Path(tempfile.mkdtemp(prefix="join-"))))
    vocab = loaded.model.args.vocab_size
    mixed = {} if not args.no_mixed else {"mixed_steps": False}
    engine = Engine(loaded, EngineConfig(max_batch=args.streams + 1, memory_budget_gb=args.memory_budget,
                                         **mixed)).start()
    prompt = lambda i: [(31 * i + 7 * j + 3) % (vocab - 10) + 5 for j in range(args.prompt_tokens)]  # noqa: E731
    alone, loaded_ttft = [], []
    for trial in range(args.num_trials + 1):
        a = ttft(engine, prompt(1000 + trial))  # distinct prompts: no prefix-cache hit
        handles = [engine.submit(EngineRequest(prompt_ids=prompt(2000 + 100 * trial + i)[:16], max_tokens=10_000,
                                               ignore_eos=True, detokenize=False)) for i in range(args.streams)]
        while not (len(engine.scheduler.running) == args.streams
                   and all(r.state == DECODE for r in engine.scheduler.running)):
            time.sleep(0.005)
        time.sleep(0.05)  # a few decode steps
        j = ttft(engine, prompt(3000 + trial))
        for h in handles:
            h.cancel()
        while engine.has_work():
            time.sleep(0.01)
        if trial:  # the first round is the warm-up (traces)
            alone.append(a)
            loaded_ttft.append(j)
        print(f"trial {trial}: alone {a * 1e3:.1f} ms, joining {args.streams} streams {j * 1e3:.1f} ms", flush=True)
    engine.stop()
    a, j = statistics.median(alone) * 1e3, statistics.median(loaded_ttft) * 1e3
    print(f"{args.shape}{'-toy' if args.toy else ''} p={args.prompt_tokens}: TTFT alone {a:.1f} ms, joining "
          f"{args.streams} decoding streams {j:.1f} ms ({j / a:.2f}x)")


if __name__ == "__main__":
    main()
