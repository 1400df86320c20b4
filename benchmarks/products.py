"""The products of a decode step, one by one: MLX's bf16 ``x @ W.T`` against cuBLAS (through torch).

For every product of a model shape's layer (q, k, v, o, gate, up, down; the fused q|k|v and
gate|up the compiled steps run, ``generation/bindings/fused.py``) and its LM head, at M = 1, 8,
32, 64, 128, 256 rows, the time of one product with its weights streamed from memory (the
product cycles through enough copies of the weights to overflow the GPU's L2), the achieved
bandwidth (weights + activations read, output written) and TFLOP/s; then the whole step's
products (every layer's, plus the head) for each engine, and the time the weights alone take at
the device's bandwidth (``--bandwidth``, default the H200's 4.8 TB/s).

    python benchmarks/products.py --json benchmarks/results/h200-products.json \\
        --plot benchmarks/results/h200-products.png                      # on the GPU machine
    python benchmarks/products.py --tiny --ms 1,8 --shapes llama-1b     # CPU smoke run

Engines: ``mlx`` (``x @ W.T``, bf16), ``mlx-fused`` (the same, with q|k|v and gate|up as one
product: what the compiled steps run on a GPU), ``cublas`` (``torch.nn.functional.linear`` on
CUDA; absent without a CUDA torch), ``tuned`` (``_fast.tuned_linear``, cuBLASLt's fastest algorithm per
shape, fused q|k|v and gate|up as the compiled steps run them; where ``_fast.tuned_products_available()``), ``ours`` (what the decode graphs run on this
device: the GEMV kernel, ``_fast.skinny_linear``, where ``_fast.skinny_linear_applies`` (2-8 rows, weights up to
64 MiB, CUDA), else MLX's product; fused q|k|v and gate|up). The timing queues ``--iters`` products and waits once (MLX:
one ``mx.eval``; torch: one ``cuda.synchronize``), so launch overhead counts as it does in a step.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode import SHAPES, TINY  # noqa: E402

from mlx_infer import _fast  # noqa: E402

L2_BYTES = 64 * 2**20  # more than an H200's 50 MB L2: each timed product reads its weights from HBM


def layer_products(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``name -> (out, in)`` of one layer's products and the head, for a shape's config."""
    h, d = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv, i = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (i, h), "up": (i, h), "down": (h, i),
            "qkv": (q + 2 * kv, h), "gate_up": (2 * i, h), "head": (cfg["vocab_size"], h)}


#: Which products make a step for each engine (per layer; the head once).
STEP = {"mlx": ("q", "k", "v", "o", "gate", "up", "down"), "mlx-fused": ("qkv", "o", "gate_up", "down"),
        "cublas": ("q", "k", "v", "o", "gate", "up", "down"), "tuned": ("qkv", "o", "gate_up", "down"),
        "ours": ("qkv", "o", "gate_up", "down")}


def ours(x: mx.array, w: mx.array) -> mx.array:
    """The decode graphs' dense product (cpp/matmul/gemv_cuda.cpp, dense_linear): the GEMV kernel where its rule
    takes the operands, else MLX's ``x @ W.T``."""
    return _fast.skinny_linear(x, w) if _fast.skinny_linear_applies(x, w) else x @ w.T


def _copies(out: int, inp: int) -> int:
    """Weight copies a timing cycles through: enough to overflow the L2 (one on a --tiny smoke run)."""
    return max(1, -(-L2_BYTES // (out * inp * 2)))


def time_mlx(out: int, inp: int, m: int, iters: int, fn: Callable[[mx.array, mx.array], mx.array] | None = None) -> float:
    """Seconds per ``x @ W.T`` (bf16; ``fn(x, W)`` when given), weights cycling through copies that overflow the L2."""
    fn = fn or (lambda x, w: x @ w.T)
    ws = [mx.random.normal((out, inp)).astype(mx.bfloat16) * 0.02 for _ in range(_copies(out, inp))]
    x = mx.random.normal((m, inp)).astype(mx.bfloat16)
    mx.eval(ws, x)
    for _ in range(3):
        mx.eval([fn(x, w) for w in ws])
    t = time.perf_counter()
    ys = [fn(x, ws[j % len(ws)]) for j in range(iters)]
    mx.eval(ys)
    return (time.perf_counter() - t) / iters


def time_cublas(out: int, inp: int, m: int, iters: int) -> float | None:
    """Seconds per ``F.linear`` on CUDA (cuBLAS), or ``None`` without a CUDA torch."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    ws = [torch.randn(out, inp, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(_copies(out, inp))]
    x = torch.randn(m, inp, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        for w in ws:
            torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for j in range(iters):
        torch.nn.functional.linear(x, ws[j % len(ws)])
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def measure(shape: str, cfg: dict[str, Any], ms: list[int], iters: int, bandwidth: float) -> list[dict[str, Any]]:
    rows = []
    prods = layer_products(cfg)
    timers: dict[str, Callable[..., float | None]] = {"mlx": time_mlx, "cublas": time_cublas,
                                                      "ours": lambda o, i, m, n: time_mlx(o, i, m, n, ours)}
    if _fast.tuned_products_available():  # the compiled steps' products on CUDA (_fast.tuned_linear)
        timers["tuned"] = lambda o, i, m, n: time_mlx(o, i, m, n, _fast.tuned_linear)
    for m in ms:
        per: dict[str, dict[str, float]] = {e: {} for e in timers}
        for name, (out, inp) in prods.items():
            for engine, timer in timers.items():
                s = timer(out, inp, m, iters)
                if s is None:
                    continue
                per[engine][name] = s
                moved = out * inp * 2 + m * (inp + out) * 2
                rows.append({"suite": "products", "shape": shape, "m": m, "product": name, "engine": engine,
                             "out": out, "in": inp, "ms": s * 1e3, "tb_s": moved / s / 1e12,
                             "tflop_s": 2 * m * out * inp / s / 1e12})
        layers = cfg["num_hidden_layers"]
        weights = sum(o * i * 2 for n, (o, i) in prods.items() if n in STEP["mlx"]) * layers \
            + prods["head"][0] * prods["head"][1] * 2
        for engine, names in STEP.items():
            src = per.get("mlx" if engine == "mlx-fused" else engine, {})
            if not src or any(n not in src for n in names):
                continue
            step = (sum(src[n] for n in names) * layers + src["head"]) * 1e3
            rows.append({"suite": "products-step", "shape": shape, "m": m, "engine": engine, "step_ms": step,
                         "weights_at_bandwidth_ms": weights / bandwidth * 1e3,
                         "fraction_of_bandwidth": weights / bandwidth * 1e3 / step})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama-1b,llama-8b,gemma3-270m")
    p.add_argument("--ms", default="1,8,32,64,128,256")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s the weights-alone figure assumes")
    p.add_argument("--tiny", action="store_true", help="toy sizes of the shapes (a CPU smoke run)")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    if args.tiny:  # toy weights: no L2 to overflow, one copy each
        global L2_BYTES
        L2_BYTES = 0
    ms = [int(v) for v in args.ms.split(",")]
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        cfg = dict(SHAPES[shape], **(TINY[shape] if args.tiny else {}))
        rows += measure(shape, cfg, ms, args.iters, args.bandwidth)
    for r in rows:
        if r["suite"] == "products-step":
            print(f"{r['shape']:>12} M={r['m']:>3} {r['engine']:>9}: step products {r['step_ms']:.3f} ms "
                  f"(weights alone at the bandwidth {r['weights_at_bandwidth_ms']:.3f} ms, "
                  f"{r['fraction_of_bandwidth']:.0%})")
    for engine in ("mlx", "ours"):
        worst = worst_ratio(rows, engine)
        if worst:
            s, m, n, ratio = worst
            print(f"worst {engine} / cuBLAS time: {ratio:.2f}x ({s}, M={m}, {n})")
    doc = {"machine": platform.processor() or platform.machine(), "device": str(mx.default_device()),
           "mlx": mx.__version__, "command": " ".join(sys.argv), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.plot:
        plot(doc, Path(args.plot))


def worst_ratio(rows: list[dict[str, Any]], engine: str) -> tuple[str, int, str, float] | None:
    """``(shape, M, product, engine's time / cuBLAS's)`` of the product where ``engine`` is furthest behind
    cuBLAS (issue 17's "report the worst ratio"); None without cuBLAS rows."""
    base = {(r["shape"], r["m"], r["product"]): r["ms"] for r in rows
            if r["suite"] == "products" and r["engine"] == "cublas"}
    ratios = [(r["shape"], r["m"], r["product"], r["ms"] / base[key]) for r in rows
              if r["suite"] == "products" and r["engine"] == engine
              and (key := (r["shape"], r["m"], r["product"])) in base]
    return max(ratios, key=lambda w: w[3]) if ratios else None


def plot(doc: dict[str, Any], path: Path) -> None:
    """TB/s per product against M, one panel per shape, MLX solid, cuBLAS dashed, ours dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if r["suite"] == "products"]
    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for product in sorted({r["product"] for r in rows if r["shape"] == shape}):
            for engine, style in (("mlx", "-"), ("cublas", "--"), ("ours", ":")):
                pts = sorted((r["m"], r["tb_s"]) for r in rows
                             if (r["shape"], r["product"], r["engine"]) == (shape, product, engine))
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", label=f"{product} {engine}")
        ax.set_xscale("log", base=2)
        ax.set_title(shape)
        ax.set_xlabel("rows M")
        ax.set_ylabel("TB/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"products: {doc['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
