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

Quantized weights (``--bits 4,8``, the default): ``mlx-q4`` / ``mlx-q8`` time ``mx.quantized_matmul`` with the
weights affine-quantized (group ``--group-size``, bf16 scales and biases, as ``mlx_lm.convert -q`` and our
``convert`` write them), what every decode graph ran for a quantized checkpoint; ``ours-q4`` / ``ours-q8`` the
decode graphs' product with our fused dequantizing GEMV on (``_fast.quantized_linear`` under
``MLX_INFER_QGEMV_ROWS=64``: cpp/matmul/qgemv_cuda.cpp for 1-64 rows on CUDA, MLX's product elsewhere). Their TB/s
and the weights-alone figure count the packed bytes (``bits / 8`` a weight plus 4 bytes of scale and bias a
group). cuBLAS has no such product: the ratios that matter are against the packed weights at the bandwidth and
against the bf16 cuBLAS row (the speed-up quantizing buys).
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
from _common import environment  # noqa: E402
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


def weight_bytes(bits: int | None, group_size: int) -> float:
    """Bytes one weight takes in memory: bf16 (``bits`` None), or packed affine ``bits`` plus its group's bf16
    scale and bias."""
    return 2.0 if bits is None else bits / 8 + 4 / group_size


def _copies(out: int, inp: int, per_weight: float = 2.0) -> int:
    """Weight copies a timing cycles through: enough to overflow the L2 (one on a --tiny smoke run)."""
    return max(1, int(-(-L2_BYTES // (out * inp * per_weight))))


def time_mlx(out: int, inp: int, m: int, iters: int, fn: Callable[[mx.array, mx.array], mx.array] | None = None) -> float:
    """Seconds per ``x @ W.T`` (bf16; ``fn(x, W)`` when given), weights cycling through copies that overflow the L2."""
    fn = fn or (lambda x, w: x @ w.T)
    ws = [mx.random.normal((out, inp)).astype(mx.bfloat16) * 0.02 for _ in range(_copies(out, inp))]
    return _time(ws, m, inp, iters, fn)


def time_quantized(out: int, inp: int, m: int, iters: int, bits: int, group_size: int, ours: bool = False) -> float:
    """Seconds per ``mx.quantized_matmul(x, Wq, scales, biases, transpose=True)``, ``W`` affine-quantized to
    ``bits`` in groups of ``group_size`` (bf16 scales and biases), copies cycling as in ``time_mlx``; ``ours``: the
    decode graphs' product with our dequantizing GEMV on (``_fast.quantized_linear`` under
    ``MLX_INFER_QGEMV_ROWS=64``: the kernels for 1-64 rows on CUDA, MLX's product elsewhere)."""
    ws = []
    for _ in range(_copies(out, inp, weight_bytes(bits, group_size))):
        w = mx.random.normal((out, inp)).astype(mx.bfloat16) * 0.02
        ws.append(mx.quantize(w, group_size=group_size, bits=bits))  # (wq, scales, biases)
        mx.eval(ws[-1])

    def fn(x: mx.array, q: tuple[mx.array, ...]) -> mx.array:
        if ours:
            return _fast.quantized_linear(x, *q, group_size=group_size, bits=bits)
        return mx.quantized_matmul(x, *q, transpose=True, group_size=group_size, bits=bits)

    with environment({"MLX_INFER_QGEMV_ROWS": "64"} if ours else {}):  # read at each call: on for ours only
        return _time(ws, m, inp, iters, fn)


def _time(ws: list[Any], m: int, inp: int, iters: int, fn: Callable[[mx.array, Any], mx.array]) -> float:
    """Seconds per ``fn(x, ws[j])`` (x: (m, inp) bf16), ``iters`` of them queued and evaluated at once after
    three warm-up rounds."""
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


def quantized_engine(bits: int, ours: bool = False) -> str:
    """The engine name of ``bits``-bit affine products: MLX's (``mlx-q4``) or with our GEMV (``ours-q4``)."""
    return f"{'ours' if ours else 'mlx'}-q{bits}"


def measure(shape: str, cfg: dict[str, Any], ms: list[int], iters: int, bandwidth: float,
            bits: list[int] = (), group_size: int = 64) -> list[dict[str, Any]]:
    """Rows of ``suite`` "products" (one product, one engine, one M) and "products-step" (a whole step's)."""
    rows = []
    prods = layer_products(cfg)
    timers: dict[str, Callable[..., float | None]] = {"mlx": time_mlx, "cublas": time_cublas,
                                                      "ours": lambda o, i, m, n: time_mlx(o, i, m, n, ours)}
    if _fast.tuned_products_available():  # the compiled steps' products on CUDA (_fast.tuned_linear)
        timers["tuned"] = lambda o, i, m, n: time_mlx(o, i, m, n, _fast.tuned_linear)
    per_weight = {e: 2.0 for e in timers}
    steps = dict(STEP)
    for b in bits:
        for o in (False, True):
            e = quantized_engine(b, o)
            timers[e] = lambda o_, i, m, n, b=b, ours=o: time_quantized(o_, i, m, n, b, group_size, ours)
            per_weight[e] = weight_bytes(b, group_size)
            # mlx-lm's quantized layers run the products unfused; a fused q|k|v and gate|up beside
            steps[e], steps[e + "-fused"] = STEP["mlx"], STEP["mlx-fused"]
    for m in ms:
        per: dict[str, dict[str, float]] = {e: {} for e in timers}
        for name, (out, inp) in prods.items():
            for engine, timer in timers.items():
                s = timer(out, inp, m, iters)
                if s is None:
                    continue
                per[engine][name] = s
                moved = out * inp * per_weight[engine] + m * (inp + out) * 2
                rows.append({"suite": "products", "shape": shape, "m": m, "product": name, "engine": engine,
                             "out": out, "in": inp, "ms": s * 1e3, "tb_s": moved / s / 1e12,
                             "tflop_s": 2 * m * out * inp / s / 1e12})
        layers = cfg["num_hidden_layers"]
        elements = sum(o * i for n, (o, i) in prods.items() if n in STEP["mlx"]) * layers \
            + prods["head"][0] * prods["head"][1]
        for engine, names in steps.items():
            source = engine.removesuffix("-fused")
            src = per.get(source, {})
            if not src or any(n not in src for n in names):
                continue
            weights = elements * per_weight[source]
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
    p.add_argument("--bits", default="4,8", help="affine-quantized engines to time (mlx-q4, mlx-q8); '' for none")
    p.add_argument("--group-size", type=int, default=64, help="the quantized engines' group size")
    p.add_argument("--tiny", action="store_true", help="toy sizes of the shapes (a CPU smoke run)")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    if args.tiny:  # toy weights: no L2 to overflow, one copy each
        global L2_BYTES
        L2_BYTES = 0
    ms = [int(v) for v in args.ms.split(",")]
    bits = [int(v) for v in args.bits.split(",") if v]
    if any(b not in (2, 3, 4, 5, 6, 8) for b in bits):
        raise SystemExit(f"--bits {args.bits!r}: MLX's affine quantization takes 2, 3, 4, 5, 6 or 8 bits")
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        cfg = dict(SHAPES[shape], **(TINY[shape] if args.tiny else {}))
        rows += measure(shape, cfg, ms, args.iters, args.bandwidth, bits, args.group_size)
    for r in rows:
        if r["suite"] == "products-step":
            print(f"{r['shape']:>12} M={r['m']:>3} {r['engine']:>9}: step products {r['step_ms']:.3f} ms "
                  f"(weights alone at the bandwidth {r['weights_at_bandwidth_ms']:.3f} ms, "
                  f"{r['fraction_of_bandwidth']:.0%})")
    for engine in ("mlx", "ours", *(quantized_engine(b, o) for b in bits for o in (False, True))):
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
    """TB/s per product against M, one panel per shape, MLX solid, cuBLAS dashed, ours dotted, quantized dash-dot
    (their TB/s count the packed bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if r["suite"] == "products"]
    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for product in sorted({r["product"] for r in rows if r["shape"] == shape}):
            for engine, style in (("mlx", "-"), ("cublas", "--"), ("ours", ":"), ("mlx-q4", "-."), ("ours-q4", ":")):
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
