"""The decode graphs' GEMV kernel (``_fast.skinny_linear``, cpp/matmul/gemv_cuda.cpp) against MLX's ``x @ W.T``,
timed kernel by kernel on the device (CUPTI through torch.profiler).

For the products the compiled steps run (fused q|k|v and gate|up, o, down, the LM head) of the chosen shapes at
the chosen row counts: MLX's bf16 product (every kernel it launches, split-K reductions included) and every
tiling of the sweep of both forms (the CUDA-core form at up to 16 rows; the tensor-core form at any), each over
weight copies that overflow the L2. The device's own kernel durations are what is compared: timing products from
the host (``--iters`` queued, one ``mx.eval``) measures MLX's per-op host cost instead, ~20 us a product (the
session-15 run: every variant of a 50 MB product at 19.7-21.3 us). Each tiling's output is checked against a
float32 product. Then per (shape, M) the whole step's products (layers x per-layer + head) for MLX and for the
best tiling of each product.

    python benchmarks/gpu_gemv_probe.py --shapes llama-8b --ms 1,32 --json OUT.json   # GPU machine, CUDA torch
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode import SHAPES  # noqa: E402
from products import L2_BYTES, layer_products  # noqa: E402

from mlx_infer import _fast  # noqa: E402

PRODUCTS = ("qkv", "o", "gate_up", "down", "head")  # what the compiled steps run (fused projections)
#: CUDA-core tilings (rows of w per warp, warps, chunks in flight per lane), at up to 16 rows; tensor-core
#: tilings (8-row n-tiles per block, warps splitting K, 32-element steps in flight per lane), at any.
CORE_TILINGS = [(r, w, u) for r, w, u in itertools.product((1, 2, 4), (4, 8), (4, 8, 16)) if r * u <= 32]
MMA_TILINGS = list(itertools.product((1, 2, 4), (2, 4, 8), (4, 8)))
#: ``--quick``: the few tilings worth a look (NVRTC compiles each once per row count, ~1-2 s a kernel on the H200:
#: the whole sweep took ~60 s for its first product in session 15).
QUICK_CORE = [(1, 4, 16), (2, 4, 8), (1, 8, 8)]
QUICK_MMA = [(1, 4, 8), (2, 2, 4), (4, 2, 4), (2, 4, 8)]
#: A kernel of ours in CUPTI's table: mlx::core::cu::custom_kernel_mlxi_gemv[_mma]_<T>_<template ints>_<bias>(...
OURS = re.compile(r"mlxi_gemv(_mma)?_bfloat16_t_([0-9_]+)_[tf]\(")


def label_of(kernel: str) -> str:
    """``mlx`` for MLX's kernels, else ``core R,W,U`` / ``mma NT,W,U`` from our kernel's template constants."""
    m = OURS.search(kernel)
    if m is None:
        return "mlx"
    ints = m.group(2).split("_")  # core: kM kR kNW kU; mma: kMT kNT kNW kU
    return ("mma " if m.group(1) else "core ") + ",".join(ints[1:])


def device_times(runs: list[tuple[str, Any]], x: mx.array, ws: list[mx.array], iters: int) -> dict[str, float]:
    """Microseconds per product of each run, from the device's kernel durations."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _, fn in runs:  # warm-up: NVRTC compiles, cuBLAS's heuristics
        mx.eval([fn(x, w) for w in ws])
    mx.synchronize()
    torch.zeros(1, device="cuda")  # CUPTI needs a context in torch too
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _, fn in runs:
            mx.eval([fn(x, ws[j % len(ws)]) for j in range(iters)])
            mx.synchronize()
    total: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if str(getattr(ev, "device_type", "")).endswith("CUDA"):
            total[label_of(ev.name)] += ev.time_range.elapsed_us()
    return {k: v / iters for k, v in total.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama-8b,llama-1b,gemma3-270m")
    p.add_argument("--ms", default="1,8,32")
    p.add_argument("--products", default=",".join(PRODUCTS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="a handful of tilings instead of the whole sweep")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    core_tilings, mma_tilings = (QUICK_CORE, QUICK_MMA) if args.quick else (CORE_TILINGS, MMA_TILINGS)
    try:
        import torch

        assert torch.cuda.is_available()
    except (ImportError, AssertionError):
        raise SystemExit("gpu_gemv_probe.py times kernels through torch.profiler: it needs a CUDA build of torch")
    ms = [int(m) for m in args.ms.split(",")]
    products = args.products.split(",")
    rows: list[dict[str, Any]] = []
    print(f"device {mx.default_device()} mlx {mx.__version__}", flush=True)
    for shape in args.shapes.split(","):
        cfg = SHAPES[shape]
        prods = layer_products(cfg)
        per: dict[tuple[int, str], dict[str, float]] = {}
        for name in products:
            out, inp = prods[name]
            copies = max(1, -(-L2_BYTES // (out * inp * 2)))
            ws = [mx.random.normal((out, inp)).astype(mx.bfloat16) * 0.02 for _ in range(copies)]
            mx.eval(ws)
            for m in ms:
                x = mx.random.normal((m, inp)).astype(mx.bfloat16)
                ref = x.astype(mx.float32) @ ws[0].astype(mx.float32).T
                runs: list[tuple[str, Any]] = [("mlx", lambda a, b: a @ b.T)]
                runs += [(f"core {r},{w},{u}", lambda a, b, t=(r, w, u): _fast.skinny_linear(a, b, tiling=t))
                         for r, w, u in core_tilings if m <= 16]
                runs += [(f"mma {n},{w},{u}", lambda a, b, t=(n, w, u): _fast.skinny_linear(a, b, tiling=t, mma=True))
                         for n, w, u in mma_tilings]
                errs = {}
                for label, fn in runs[1:]:
                    y = fn(x, ws[0]).astype(mx.float32)
                    errs[label] = (mx.abs(y - ref).max() / mx.abs(ref).max()).item()
                us = device_times(runs, x, ws, args.iters)
                ours = {k: v for k, v in us.items() if k != "mlx"}
                best = min(ours, key=ours.get)
                per[(m, name)] = {"mlx": us["mlx"], "best": ours[best]}
                gb = out * inp * 2 / 1e9
                print(f"{shape:12s} {name:8s} M={m:2d} N={out:6d} K={inp:5d}  mlx {us['mlx']:7.1f} us "
                      f"({gb / us['mlx'] * 1e3:4.2f} TB/s)  best {best:>11s} {ours[best]:7.1f} us "
                      f"({us['mlx'] / ours[best]:4.2f}x, {gb / ours[best] * 1e3:4.2f} TB/s)  worst relerr "
                      f"{max(errs.values()):.1e}", flush=True)
                rows.append({"suite": "gemv", "shape": shape, "product": name, "m": m, "out": out, "in": inp,
                             "device_us": us, "best": best, "relerr": errs})
                del x, ref
            del ws
            mx.clear_cache()
        if all(n in products for n in PRODUCTS):
            layers = cfg["num_hidden_layers"]
            for m in ms:
                step = {e: (sum(per[(m, n)][e] for n in PRODUCTS if n != "head") * layers
                            + per[(m, "head")][e]) / 1e3 for e in ("mlx", "best")}
                print(f"{shape:12s} step products M={m:2d}: mlx {step['mlx']:.3f} ms, best tilings "
                      f"{step['best']:.3f} ms ({step['mlx'] / step['best']:.2f}x)", flush=True)
                rows.append({"suite": "gemv-step", "shape": shape, "m": m, **{f"{k}_ms": v for k, v in step.items()}})
    if args.json:
        doc = {"machine": platform.node(), "mlx": mx.__version__, "device": str(mx.default_device()),
               "command": " ".join(sys.argv), "timing": "device kernel durations (CUPTI via torch.profiler)",
               "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
