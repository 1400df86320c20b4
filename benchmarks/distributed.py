"""Tensor-parallel decode and serving throughput, one process vs N over mx.distributed.

Run the same command alone (the one-process baseline) and under ``mlx.launch``::

    # the multi-GPU run (one host, N GPUs, NCCL):
    python benchmarks/distributed.py --shape llama-8b --batches 1,8,32 -p 512 -g 128 \
        --json benchmarks/results/h200-distributed-n1.json
    mlx.launch --backend nccl -n 8 -- python benchmarks/distributed.py --shape llama-8b \
        --batches 1,8,32 -p 512 -g 128 --json benchmarks/results/h200x8-distributed-n8.json
    # CPU smoke run (ring over loopback), toy shapes:
    mlx.launch --backend ring -n 2 -- python benchmarks/distributed.py --shape llama-1b --toy -g 16

Every rank runs this script. Rank 0 writes the model once (random bf16 weights of a
real shape, :mod:`gpu_decode`'s ``SHAPES``) into ``--work-dir`` (a path every rank
sees: one host, or a shared file system), the ranks meet at a barrier, and each
loads only its shard. Then, per batch size: batch 1 runs ``generate_tokens`` over the
compiled C++ step (its ``all_sum`` inside the step); larger batches run the
continuous-batching engine (rank 0 schedules, every rank steps; ``ignore_eos``
requests, random prompts). ``--trials`` rounds each, medians reported, after a
warm-up. Rows follow the results schema (:mod:`mlx_infer.bench.report`) with the
group facts added: ``ranks``, ``backend``, ``weight_bytes_per_rank``,
``peak_gb_per_rank``. ``MLX_INFER_PARALLEL=pipeline`` measures pipeline parallel
(eager decode: the compiled step does not run a pipelined graph).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def barrier(pg: Any) -> None:
    if pg.distributed:
        mx.eval(mx.distributed.all_sum(mx.array([1]), group=pg.group))


def gather(pg: Any, value: float) -> list[float]:
    if not pg.distributed:
        return [value]
    return mx.distributed.all_gather(mx.array([value], mx.float32), group=pg.group).tolist()


def model_dir(args: argparse.Namespace, pg: Any) -> Path:
    """The benchmark model: ``--model``, or ``--shape`` written once by rank 0 into ``--work-dir``."""
    if args.model:
        return Path(args.model).expanduser()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from served_models import shape_dir

    path = Path(args.work_dir) / (args.shape + ("-toy" if args.toy else ""))
    if pg.is_leader and not (path / "config.json").is_file():
        log(f"writing {args.shape} with random weights into {path}")
        shape_dir(args.shape, args.toy, Path(args.work_dir))
    barrier(pg)
    return path


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def run_generate(loaded: Any, prompt: list[int], gen: int) -> dict[str, float]:
    """Batch 1: the generation loop over the compiled step."""
    from mlx_infer.generation.autoregressive import generate_tokens
    from mlx_infer.generation.bindings.autoregressive import bind_autoregressive
    from mlx_infer.sampling import SamplingParams

    mx.reset_peak_memory()
    decode = bind_autoregressive(loaded).create_decode()
    t0 = time.perf_counter()
    t_first, n = t0, 0
    for tok in generate_tokens(loaded.model, prompt, sampling=SamplingParams(temperature=0.0), max_tokens=gen,
                               eos_token_ids=frozenset(), decode=decode):
        n += 1
        if n == 1:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    if decode is not None:
        decode.close()
    return row_metrics(len(prompt), 1, n, t0, t_first, t_end)


def row_metrics(prompt_tokens: int, batch: int, n: int, t0: float, t_first: float, t_end: float) -> dict[str, float]:
    ttft, dec = t_first - t0, t_end - t_first
    return {"prompt_tps": batch * prompt_tokens / ttft if ttft > 0 else 0.0, "ttft_ms": ttft * 1e3,
            "decode_tps": batch * (n - 1) / dec if n > 1 and dec > 0 else 0.0, "peak_gb": mx.get_peak_memory() / 1e9}


def run_engine(loaded: Any, pg: Any, batch_prompts: list[list[int]], gen: int) -> dict[str, float] | None:
    """Several streams through the engine; followers step along and return ``None``."""
    from mlx_infer.engine import Engine, EngineConfig
    from mlx_infer.engine.request import EngineRequest
    from mlx_infer.parallel.engine_rank import follow

    mx.reset_peak_memory()
    engine = Engine(loaded, EngineConfig(max_batch=len(batch_prompts)))
    if not pg.is_leader:
        follow(engine)
        return None
    reqs = [EngineRequest(prompt_ids=p, max_tokens=gen, ignore_eos=True, request_id=f"b{i}")
            for i, p in enumerate(batch_prompts)]
    with engine:
        t0 = time.perf_counter()
        results = engine.generate(reqs, timeout=3600)
        t_end = time.perf_counter()
    t_first = t0 + max(r.ttft_ms for r in results) / 1e3
    n = min(len(r.token_ids) for r in results)
    return row_metrics(len(batch_prompts[0]), len(batch_prompts), n, t0, t_first, t_end)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-1b", help="a gpu_decode.py shape (gemma3-270m, llama-1b, llama-8b)")
    p.add_argument("--toy", action="store_true", help="the shape's toy size (CPU smoke runs)")
    p.add_argument("--model", default=None, help="benchmark this model directory instead of --shape")
    p.add_argument("--work-dir", default="/tmp/mlx-infer-distributed-bench", help="where rank 0 writes --shape")
    p.add_argument("--batches", default="1,8", help="comma list; 1 = generate over the compiled step")
    p.add_argument("-p", "--prompt-tokens", type=int, default=128)
    p.add_argument("-g", "--generation-tokens", type=int, default=64)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    args = p.parse_args()

    from mlx_infer.artifacts.loader import load_model
    from mlx_infer.bench.report import results_document, write_json
    from mlx_infer.parallel import current_group

    pg = current_group()
    path = model_dir(args, pg)
    loaded = load_model(path)
    vocab = int(loaded.model.args.vocab_size)
    weight_bytes = gather(pg, float(loaded.weight_bytes))
    pipelined = getattr(loaded.model, "pipeline_parallel", None) is not None
    rows = []
    for batch in [int(b) for b in args.batches.split(",") if b.strip()]:
        trials = []
        for t in range(args.trials + 1):  # the first is the warm-up
            ps = prompts(batch, args.prompt_tokens, vocab, seed=t)
            m = run_generate(loaded, ps[0], args.generation_tokens) if batch == 1 else \
                run_engine(loaded, pg, ps, args.generation_tokens)
            peaks = gather(pg, mx.get_peak_memory() / 1e9)
            if m is not None and t > 0:
                trials.append({**m, "peak_gb_per_rank": peaks})
        if not pg.is_leader:
            continue
        row = {"suite": "distributed", "model": f"{args.shape}{'-toy' if args.toy else ''}" if not args.model
               else Path(args.model).name, "engine": f"mlx-infer {'pp' if pipelined else 'tp'}{pg.size}",
               "batch": batch, "prompt_tokens": args.prompt_tokens, "generation_tokens": args.generation_tokens,
               "ranks": pg.size, "backend": pg.backend, "weight_bytes_per_rank": [int(b) for b in weight_bytes],
               "peak_gb_per_rank": [max(tr["peak_gb_per_rank"][r] for tr in trials) for r in range(pg.size)],
               "trials": trials}
        for k in ("prompt_tps", "ttft_ms", "decode_tps", "peak_gb"):
            vals = [tr[k] for tr in trials]
            row[k], row[f"{k}_min"], row[f"{k}_max"] = statistics.median(vals), min(vals), max(vals)
        rows.append(row)
        log(f"{row['engine']} batch {batch}: decode {row['decode_tps']:.1f} tok/s, TTFT {row['ttft_ms']:.0f} ms, "
            f"weights/rank {[round(b / 2**20, 1) for b in weight_bytes]} MiB")
    if pg.is_leader:
        doc = results_document(rows)
        print(json.dumps(doc, indent=2))
        if args.json:
            write_json(doc, Path(args.json))


if __name__ == "__main__":
    main()
