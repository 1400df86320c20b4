"""Where a decode step of the serving engine spends its GPU time, kernel by kernel (Nsight Systems).

    nsys profile --trace=cuda,nvtx --cuda-graph-trace=node --capture-range=cudaProfilerApi \\
        --capture-range-end=stop -o /tmp/eng -f true \\
        python benchmarks/gpu_engine_profile.py --shape llama-1b --streams 32
    nsys stats --report cuda_gpu_kern_sum --format csv -o /tmp/eng /tmp/eng.nsys-rep
    python benchmarks/gpu_engine_profile.py --summarize /tmp/eng_cuda_gpu_kern_sum.csv --steps 64
    python benchmarks/gpu_engine_profile.py --shape llama-1b --torch-profiler /tmp/k.csv   # without nsys

The engine (default settings, random bf16 weights of a real shape) takes ``--streams`` requests of
``-p`` prompt tokens; once every row decodes, ``cudaProfilerStart`` opens the capture for
``--steps`` engine iterations, then ``cudaProfilerStop``. ``--summarize`` folds nsys's kernel table
into groups (products, attention, RoPE, norms, KV writes, sampling, copies, other) per step.
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import gc
import glob
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

GROUPS = [  # (group, substrings of a kernel name), first match wins
    ("products (ours: mlxi_gemv)", ("mlxi_gemv",)),
    ("products (cuBLAS/gemv)", ("gemm", "gemv", "cutlass", "sm90_xmma", "xmma", "splitk", "Kernel2", "nvjet")),
    ("paged attention (ours)", ("mlxi_paged_attn",)),
    ("sdpa", ("sdpa", "attention", "flash")),
    ("rope", ("rope",)),
    ("rms norm", ("rms", "layer_norm")),
    ("kv write (scatter)", ("scatter",)),
    ("gather / take", ("gather",)),
    ("sampling (arg-reduce, sort)", ("arg_reduce", "argmax", "sort", "partition", "radix")),
    ("reductions", ("reduce",)),
    ("copies", ("copy",)),
    ("elementwise", ("binary", "unary", "ternary", "compiled", "fused")),
]


def group_of(name: str) -> str:
    low = name.lower()
    for g, keys in GROUPS:
        if any(k.lower() in low for k in keys):
            return g
    return "other"


def summarize(path: str, steps: int) -> None:
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    names: dict[str, list[tuple[float, str]]] = defaultdict(list)
    with open(path) as f:
        for row in csv.DictReader(f):
            ns = float(row["Total Time (ns)"])
            g = group_of(row["Name"])
            totals[g] += ns
            counts[g] += int(row["Instances"])
            names[g].append((ns, row["Name"][:90]))
    whole = sum(totals.values())
    print(f"GPU kernel time per step: {whole / steps / 1e6:.3f} ms over {steps} steps")
    for g, ns in sorted(totals.items(), key=lambda kv: -kv[1]):
        top = max(names[g])[1]
        print(f"  {g:30s} {ns / steps / 1e6:7.3f} ms  {100 * ns / whole:5.1f} %  "
              f"{counts[g] / steps:6.1f} launches/step  (largest: {top})")


def write_kernel_csv(prof, path: str) -> None:
    """torch.profiler's CUDA kernel records (CUPTI: every kernel of the process, MLX's inside its CUDA
    graphs included) as nsys's cuda_gpu_kern_sum CSV columns that :func:`summarize` reads."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if getattr(ev, "device_type", None) is not None and str(ev.device_type).endswith("CUDA"):
            total[ev.name] += ev.time_range.elapsed_us() * 1e3
            count[ev.name] += 1
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Total Time (ns)", "Instances", "Name"])
        for name, ns in sorted(total.items(), key=lambda kv: -kv[1]):
            w.writerow([f"{ns:.0f}", count[name], name])


def profile(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import mlx.core as mx

    from served_models import shape_dir

    from mlx_infer.artifacts.loader import load_model
    from mlx_infer.engine import Engine, EngineConfig

    cudart = None
    for pattern in ("libcudart.so*", "/usr/local/cuda/lib64/libcudart.so*"):
        for lib in sorted(glob.glob(pattern)) or [pattern.split("*")[0]]:
            try:
                cudart = ctypes.CDLL(lib)
                break
            except OSError:
                continue
        if cudart is not None:
            break
    path = shape_dir(args.shape, args.toy, Path(tempfile.mkdtemp(prefix="prof-")))
    loaded = load_model(path)
    vocab = loaded.model.args.vocab_size
    from mlx_infer.engine.config import weight_bytes

    weights = weight_bytes(loaded.model)
    settings = args.gemv_rows.split(",") if args.gemv_rows else [None]
    for setting in settings:  # one engine per MLX_INFER_GEMV_ROWS value (read when its step traces)
        if setting is not None:
            os.environ["MLX_INFER_GEMV_ROWS"] = setting
            print(f"== MLX_INFER_GEMV_ROWS={setting}", flush=True)
        engine = Engine(loaded, EngineConfig(max_batch=args.streams))
        profile_engine(args, engine, vocab, weights, cudart,
                       args.torch_profiler and (args.torch_profiler if setting is None
                                                else args.torch_profiler.replace(".csv", f"-rows{setting}.csv")))
        engine.stop()
        del engine
        gc.collect()
        mx.clear_cache()


def profile_engine(args: argparse.Namespace, engine: Any, vocab: int, weights: int, cudart: Any,
                   kernel_csv: str | None) -> None:
    """Two rounds of ``args.streams`` requests on ``engine``; the second's ``args.steps`` steps profiled."""
    import mlx.core as mx

    from served_models import prompts_for

    from mlx_infer.engine import EngineRequest
    for warm in range(2):  # the first round traces; the second is what is profiled
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        active0 = mx.get_active_memory()
        hs = [engine.submit(EngineRequest(prompt_ids=p, max_tokens=args.steps + 32, ignore_eos=True,
                                          detokenize=False))
              for p in prompts_for(args.streams, args.prompt_tokens, vocab, start=warm * args.streams)]
        from mlx_infer.engine.scheduler import DECODE

        sched = engine.scheduler
        while sched.waiting or len(sched.running) < args.streams or any(
                r.state != DECODE for r in sched.running):  # until every row decodes
            engine.step()
        mx.synchronize()
        prefill_peak = mx.get_peak_memory()
        mx.reset_peak_memory()
        for _ in range(8):
            engine.step()
        mx.synchronize()
        torch_prof = None
        if warm == 1 and kernel_csv:
            import torch
            from torch.profiler import ProfilerActivity

            torch.zeros(1, device="cuda")  # CUPTI needs a context in torch too
            torch_prof = torch.profiler.profile(activities=[ProfilerActivity.CUDA])
            torch_prof.__enter__()
        elif warm == 1 and cudart is not None:
            cudart.cudaProfilerStart()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        mx.synchronize()
        wall = time.perf_counter() - t
        if torch_prof is not None:
            torch_prof.__exit__(None, None, None)
            write_kernel_csv(torch_prof, kernel_csv)
            summarize(kernel_csv, args.steps)
        elif warm == 1 and cudart is not None:
            cudart.cudaProfilerStop()
        decode_peak = mx.get_peak_memory()
        print(f"round {warm} memory (GB): weights {weights / 1e9:.2f}, KV storage {engine.store.nbytes / 1e9:.2f}, "
              f"active before {active0 / 1e9:.2f}; peak while prompts prefilled {prefill_peak / 1e9:.2f}, "
              f"while every row decoded {decode_peak / 1e9:.2f}", flush=True)
        engine.run_until_idle()
        print(f"round {warm}: {args.steps} steps of {args.streams} rows in {wall * 1e3:.1f} ms "
              f"({wall / args.steps * 1e3:.3f} ms/step, {args.streams * args.steps / wall:.0f} tok/s)", flush=True)
        del hs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-1b")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--prompt-tokens", "-p", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--summarize", default=None, metavar="CSV", help="fold nsys's cuda_gpu_kern_sum CSV")
    p.add_argument("--toy", action="store_true", help="the shape's toy sizes (a CPU smoke run)")
    p.add_argument("--gemv-rows", default=None, metavar="LIST",
                   help="one engine (and profile) per MLX_INFER_GEMV_ROWS value, e.g. 0,32 (the GEMV A/B)")
    p.add_argument("--torch-profiler", default=None, metavar="CSV",
                   help="profile with torch.profiler (CUPTI) instead of nsys; write the kernel table here")
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize, args.steps)
    else:
        profile(args)


if __name__ == "__main__":
    main()
