"""The decode graphs' GEMV kernel (``_fast.skinny_linear``, cpp/matmul/gemv_cuda.cpp) against MLX's ``x @ W.T``.

For the products the compiled steps run (fused q|k|v and gate|up, o, down, the LM head) of the llama-8B,
llama-1B and gemma3-270m shapes, at M = 1, 2, 4, 8, 16 rows: MLX's bf16 product, the kernel with its default
tiling, and every tiling of the sweep (rows per warp x warps per block x chunks in flight per lane), each timed
over weight copies that overflow the L2 (``--iters`` products queued, one ``mx.eval``: launch overhead counts
as in a step), the kernel's output checked against a float32 product. Then per (shape, M) the whole step's
products (layers x per-layer + head) for MLX, the default tiling and the best tiling of each product.

    python benchmarks/gpu_gemv_probe.py --json OUT.json          # on the GPU machine (MLX's CUDA backend)
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode import SHAPES  # noqa: E402
from products import L2_BYTES, layer_products  # noqa: E402

from mlx_infer import _fast  # noqa: E402

PRODUCTS = ("qkv", "o", "gate_up", "down", "head")  # what the compiled steps run (fused projections)
#: The CUDA-core form's tilings (rows per warp, warps, chunks in flight), swept at M = 1; the tensor-core form's
#: (warps splitting K, steps in flight), swept at every M.
CORE_TILINGS = [(r, w, u) for r, w, u in itertools.product((1, 2, 4), (4, 8), (4, 8, 16)) if r * u <= 32]
MMA_TILINGS = [(nt, w, u) for nt, w, u in itertools.product((1, 2, 4), (2, 4, 8), (4, 8, 16)) if nt * u <= 32]


def timer(ws: list[mx.array], x: mx.array, iters: int) -> Callable[[Callable[[mx.array, mx.array], mx.array]], float]:
    def run(fn: Callable[[mx.array, mx.array], mx.array]) -> float:
        mx.eval([fn(x, w) for w in ws])  # warm-up (and the kernel's NVRTC compile)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            mx.eval([fn(x, ws[j % len(ws)]) for j in range(iters)])
            best = min(best, (time.perf_counter() - t) / iters)
        return best
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama-8b,llama-1b,gemma3-270m")
    p.add_argument("--ms", default="1,2,4,8,16,32")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--no-sweep", action="store_true", help="the default tiling only")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    rows: list[dict[str, Any]] = []
    print(f"device {mx.default_device()} mlx {mx.__version__}", flush=True)
    for shape in args.shapes.split(","):
        cfg = SHAPES[shape]
        prods = layer_products(cfg)
        per: dict[tuple[int, str], dict[str, float]] = {}
        for name in PRODUCTS:
            out, inp = prods[name]
            copies = max(1, -(-L2_BYTES // (out * inp * 2)))
            ws = [mx.random.normal((out, inp)).astype(mx.bfloat16) * 0.02 for _ in range(copies)]
            mx.eval(ws)
            for m in ms:
                x = mx.random.normal((m, inp)).astype(mx.bfloat16)
                ref = x.astype(mx.float32) @ ws[0].astype(mx.float32).T
                run = timer(ws, x, args.iters)
                t_mlx = run(lambda a, b: a @ b.T)
                got = _fast.skinny_linear(x, ws[0]).astype(mx.float32)
                err = (mx.abs(got - ref).max() / mx.abs(ref).max()).item()
                t_def = run(lambda a, b: _fast.skinny_linear(a, b))
                times = {"mlx": t_mlx, "default": t_def}
                errs = {"default": err}
                best = ("default", t_def)
                sweep = [] if args.no_sweep else (
                    [("core " + ",".join(map(str, c)), c, False) for c in CORE_TILINGS if m == 1]
                    + [("mma " + ",".join(map(str, c)), c, True) for c in MMA_TILINGS])
                if not args.no_sweep and m <= 16:
                    sweep.append(("core default", None, False))
                for label, til, mma in sweep:
                    if til is None:  # the CUDA-core form's default tiling at this M
                        core = (2 if out >= 2048 and m <= 4 else 1, 4, 8 if inp >= 2048 else 4)
                        til = core
                    t = run(lambda a, b, til=til, mma=mma: _fast.skinny_linear(a, b, tiling=til, mma=mma))
                    y = _fast.skinny_linear(x, ws[0], tiling=til, mma=mma).astype(mx.float32)
                    errs[label] = (mx.abs(y - ref).max() / mx.abs(ref).max()).item()
                    times[label] = t
                    if t < best[1]:
                        best = (label, t)
                per[(m, name)] = {"mlx": t_mlx, "default": t_def, "best": best[1]}
                gb = out * inp * 2 / 1e9
                print(f"{shape:12s} {name:8s} M={m:2d} N={out:6d} K={inp:5d}  mlx {t_mlx * 1e6:7.1f} us "
                      f"({gb / t_mlx / 1e3:4.2f} TB/s)  default {t_def * 1e6:7.1f} ({t_mlx / t_def:4.2f}x)  "
                      f"best {best[0]:>13s} {best[1] * 1e6:7.1f} ({t_mlx / best[1]:4.2f}x, {gb / best[1] / 1e3:4.2f} "
                      f"TB/s)  relerr {err:.1e} (worst tiling {max(errs.values()):.1e})", flush=True)
                rows.append({"suite": "gemv", "shape": shape, "product": name, "m": m, "out": out, "in": inp,
                             "relerr": errs, "max_relerr": max(errs.values()),
                             "us": {k: v * 1e6 for k, v in times.items()},
                             "best_tiling": best[0]})
                del x, ref
            del ws
            mx.clear_cache()
        layers = cfg["num_hidden_layers"]
        for m in ms:
            step = {e: (sum(per[(m, n)][e] for n in PRODUCTS if n != "head") * layers + per[(m, "head")][e]) * 1e3
                    for e in ("mlx", "default", "best")}
            print(f"{shape:12s} step products M={m:2d}: mlx {step['mlx']:.3f} ms, default {step['default']:.3f} ms "
                  f"({step['mlx'] / step['default']:.2f}x), best tilings {step['best']:.3f} ms "
                  f"({step['mlx'] / step['best']:.2f}x)", flush=True)
            rows.append({"suite": "gemv-step", "shape": shape, "m": m, **{f"{k}_ms": v for k, v in step.items()}})
    if args.json:
        doc = {"machine": platform.node(), "mlx": mx.__version__, "device": str(mx.default_device()),
               "command": " ".join(sys.argv), "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
