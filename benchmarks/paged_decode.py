"""The engine's batched decode: eager paged graph vs the compiled C++ paged step.

    python benchmarks/paged_decode.py --model tiny --batch 1 8
    python benchmarks/paged_decode.py --model real --batch 1 8 -g 48

One process. Per (model, batch size) the engines (eager; compiled with S
buckets; compiled op by op) are built once, warmed up by one full run (every
trace the timed runs need happens there), then alternate run by run; each row
is the median of ``-n`` runs. A run submits ``B`` greedy requests (random
``-p``-token prompts of one length, ``-g`` tokens each, EOS ignored), steps
the engine on this thread until every prompt is prefilled, then times the
rest: decode tokens per second over the whole batch.

``tiny``: the tests' random llama, gemma3 and gemma4 (KV-shared) configs (tests/tiny.py).
``real``: Gemma 3 270M (the default-model GGUF, dequantized to float32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer.engine.scheduler import DECODE
from mlx_infer.generation.bindings.autoregressive import Composition
from mlx_infer.generation.bindings.paged_decode_step import PagedDecodePolicy

MODES = {
    "eager": (False, PagedDecodePolicy()),
    "compiled": (True, PagedDecodePolicy()),
    "op-by-op": (True, PagedDecodePolicy(compile=False)),
}


def models(which: str) -> list[tuple[str, Any]]:
    if which == "real":
        from mlx_infer.artifacts.default_model import default_model_gguf
        return [("gemma3-270m", load_model(default_model_gguf()))]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import GEMMA4_SWITCHES, make_tiny_model_dir
    root = Path(tempfile.mkdtemp())
    out = [(f"tiny-{f}", load_model(make_tiny_model_dir(root / f, f))) for f in ("llama", "gemma3")]
    # gemma4's KV-shared variant: shared and unshared KV-owning layers, per-layer inputs
    return out + [("tiny-gemma4-kv_shared", load_model(make_tiny_model_dir(root / "g4", "gemma4",
                                                                           **GEMMA4_SWITCHES["kv_shared"])))]


def one_run(engine: Engine, prompts: list[list[int]], gen: int) -> tuple[float, int]:
    """Decode tokens/s of one batch (prefill excluded) and the tokens counted."""
    handles = [engine.submit(EngineRequest(prompt_ids=p, max_tokens=gen, ignore_eos=True, detokenize=False))
               for p in prompts]
    while not all(r.state == DECODE for r in engine.scheduler.running) or len(engine.scheduler.running) < len(prompts):
        engine.step()
    engine._sync()  # the in-flight step's tokens are counted before the clock starts
    mx.synchronize()
    done_before = sum(len(h._events) for h in handles)
    t0 = time.perf_counter()
    engine.run_until_idle()
    mx.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(h.result(timeout=0).token_ids) for h in handles) - done_before
    return tokens / dt, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "real"), default="tiny")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("-p", "--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("-g", "--gen", type=int, default=64, help="generated tokens per request")
    ap.add_argument("-n", "--runs", type=int, default=3)
    ap.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args()
    rows = []
    rng = np.random.default_rng(0)
    for name, loaded in models(args.model):
        vocab = loaded.model.args.vocab_size
        for B in args.batch:
            prompts = [rng.integers(5, min(vocab, 30000), size=args.prompt).tolist() for _ in range(B)]
            engines = {}
            for mode in args.modes:
                compiled, policy = MODES[mode]
                e = Engine(loaded, EngineConfig(max_batch=max(B, 1), prefix_cache=False),
                           composition=Composition(compiled_decode=compiled), decode_policy=policy)
                if compiled and e.paged_decode is None:
                    raise SystemExit(f"{mode}: no compiled paged step ({e.paged_decode_reason})")
                one_run(e, prompts, args.gen)  # warm-up: traces every signature the runs meet
                engines[mode] = e
            tps: dict[str, list[float]] = {m: [] for m in engines}
            order = list(engines)
            for i in range(args.runs):
                for mode in (order if i % 2 == 0 else order[::-1]):
                    tps[mode].append(one_run(engines[mode], prompts, args.gen)[0])
            base = statistics.median(tps["eager"]) if "eager" in tps else None
            for mode, xs in tps.items():
                med = statistics.median(xs)
                e = engines[mode]
                row = {"model": name, "batch": B, "mode": mode, "decode_tps": round(med, 2),
                       "runs": [round(x, 2) for x in xs],
                       "vs_eager": round(med / base, 3) if base else None,
                       "traces": e.paged_decode.traces if e.paged_decode else None,
                       "retraces": e.paged_decode.retraces if e.paged_decode else None}
                rows.append(row)
                print(f"{name:14s} B={B:<3d} {mode:9s} {med:9.1f} tok/s  x{row['vs_eager']}  "
                      f"traces={row['traces']} retraces={row['retraces']}", flush=True)
            for e in engines.values():
                e.stop()
    if args.json:
        args.json.write_text(json.dumps({"prompt": args.prompt, "gen": args.gen, "runs": args.runs,
                                         "mlx": mx.__version__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
