"""GPU check of ``_fast.tuned_linear`` (cuBLASLt, fastest algorithm per shape) against MLX's ``x @ W.T``.

For every product of a model shape's layer (q, k, v, o, gate, up, down, the fused q|k|v and gate|up)
and its LM head, at M = 2, 8, 32, 64, 128, 256 rows (bfloat16): the error of the tuned product
relative to MLX's (``max |tuned - mlx| / max |mlx|``, fails above ``--tol``), and the time of each
with the weights streamed from memory (the products cycle through enough weight copies to overflow
the L2, as ``benchmarks/products.py`` times them): the median over ``--rounds`` rounds of
``--iters`` queued products each. One line per product, then a summary and ``PASS`` or ``FAIL``.

    MLX_INFER_TUNED_PRODUCTS_LOG=1 python benchmarks/gpu_tuned_products.py \\
        --json benchmarks/results/h200-tuned-products.json                 # on the GPU machine
    python benchmarks/gpu_tuned_products.py --tiny --ms 2,8                # CPU smoke run (no primitive)

Fails when the build has no tuned products (``_fast.tuned_products_available()`` false: no CUDA
toolkit at build time, or no CUDA backend) unless ``--tiny``, or when any error exceeds ``--tol``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode import SHAPES, TINY  # noqa: E402
from products import L2_BYTES, layer_products  # noqa: E402

from mlx_infer import _fast  # noqa: E402

#: Products of a layer and the head; ``qkv+bias``: the fused q|k|v with a bias (qwen2's), in cuBLASLt's epilogue.
PRODUCTS = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "qkv+bias", "gate_up", "head")
Product = Callable[[mx.array, mx.array, "mx.array | None"], mx.array]


def mlx_product(x: mx.array, w: mx.array, b: mx.array | None) -> mx.array:
    return x @ w.T if b is None else mx.addmm(b, x, w.T)


def tuned_product(x: mx.array, w: mx.array, b: mx.array | None) -> mx.array:
    return _fast.tuned_linear(x, w, b)


def relative_error(out: int, inp: int, m: int, bias: bool) -> float:
    """``max |tuned - mlx| / max |mlx|`` for one random bf16 product."""
    w = (mx.random.normal((out, inp), key=mx.random.key(out + inp)) * 0.02).astype(mx.bfloat16)
    x = mx.random.normal((m, inp), key=mx.random.key(m)).astype(mx.bfloat16)
    b = mx.random.normal((out,), key=mx.random.key(3)).astype(mx.bfloat16) if bias else None
    ref = mlx_product(x, w, b).astype(mx.float32)  # (m, out)
    got = tuned_product(x, w, b).astype(mx.float32)  # (m, out)
    return (mx.abs(got - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-30)).item()


def time_product(fn: Product, out: int, inp: int, m: int, bias: bool, iters: int, rounds: int) -> float:
    """Median seconds per product over ``rounds``, weights cycling through copies that overflow the L2."""
    copies = max(1, -(-L2_BYTES // (out * inp * 2)))
    ws = [(mx.random.normal((out, inp)) * 0.02).astype(mx.bfloat16) for _ in range(copies)]
    x = mx.random.normal((m, inp)).astype(mx.bfloat16)
    b = mx.random.normal((out,)).astype(mx.bfloat16) if bias else None
    mx.eval(ws, x, *([b] if bias else []))
    for _ in range(3):  # the first use of a shape tunes it (tuned_linear)
        mx.eval([fn(x, w, b) for w in ws])
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        mx.eval([fn(x, ws[j % len(ws)], b) for j in range(iters)])
        times.append((time.perf_counter() - t) / iters)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama-1b,llama-8b,gemma3-270m")
    p.add_argument("--ms", default="2,8,32,64,128,256")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tol", type=float, default=1e-2, help="largest relative error accepted (bf16)")
    p.add_argument("--tiny", action="store_true", help="toy sizes of the shapes (a CPU smoke run)")
    p.add_argument("--json")
    p.add_argument("--backtrace", action="store_true",
                   help="on a crash print the native and the Python stack (no gdb on the device machine); with "
                        "MLX_INFER_TUNED_PRODUCTS_LOG=2 every stage of the first calls is logged too")
    args = p.parse_args()
    if args.backtrace:
        import faulthandler

        faulthandler.enable()
        _fast.install_crash_backtrace()
    available = _fast.tuned_products_available()
    print(f"device {mx.default_device()}, mlx {mx.__version__}, tuned products available: {available}")
    ms = [int(v) for v in args.ms.split(",")]
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        prods = layer_products(dict(SHAPES[shape], **(TINY[shape] if args.tiny else {})))
        for m in ms:
            for name in PRODUCTS:
                bias = name.endswith("+bias")
                out, inp = prods[name.removesuffix("+bias")]
                err = relative_error(out, inp, m, bias)
                t_mlx = time_product(mlx_product, out, inp, m, bias, args.iters, args.rounds)
                t_tuned = time_product(tuned_product, out, inp, m, bias, args.iters, args.rounds)
                row = {"shape": shape, "m": m, "product": name, "out": out, "in": inp, "rel_err": err,
                       "mlx_us": t_mlx * 1e6, "tuned_us": t_tuned * 1e6, "speedup": t_mlx / t_tuned,
                       "ok": err <= args.tol}
                rows.append(row)
                print(f"{shape:>12} M={m:>3} {name:>8} ({out}x{inp}): mlx {row['mlx_us']:8.1f} us  tuned "
                      f"{row['tuned_us']:8.1f} us  {row['speedup']:5.2f}x  rel err {err:.2e}"
                      f"{'' if row['ok'] else '  ERROR ABOVE TOL'}{'  (slower)' if row['speedup'] < 0.95 else ''}")
    bad = [r for r in rows if not r["ok"]]
    geo = math.exp(sum(math.log(r["speedup"]) for r in rows) / len(rows)) if rows else float("nan")
    worst = min(rows, key=lambda r: r["speedup"]) if rows else None
    print(f"{len(rows)} products: geometric-mean speedup {geo:.2f}x"
          + (f", slowest {worst['speedup']:.2f}x ({worst['shape']} M={worst['m']} {worst['product']})" if worst else "")
          + f", {len(bad)} above the error tolerance {args.tol:g}")
    reasons = []
    if not available and not args.tiny:
        reasons.append("tuned products unavailable (a build without the CUDA toolkit, or no CUDA backend)")
    if bad:
        reasons.append(f"{len(bad)} products above the error tolerance")
    if args.json:
        doc = {"machine": platform.processor() or platform.machine(), "device": str(mx.default_device()),
               "mlx": mx.__version__, "command": " ".join(sys.argv), "available": available,
               "geomean_speedup": geo, "pass": not reasons, "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print("PASS" if not reasons else "FAIL: " + "; ".join(reasons))
    return 0 if not reasons else 1


if __name__ == "__main__":
    sys.exit(main())
