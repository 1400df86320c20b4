"""paged_attention's kernel against a float64 reference and the gather path, then timed.

    python benchmarks/gpu_paged_attention.py --json benchmarks/results/h200-paged-attention.json
    python benchmarks/gpu_paged_attention.py --quick     # CPU smoke run (the CPU kernel)

Checks (fresh random inputs each): ``‖out - ref‖ / ‖ref‖`` of ``impl="auto"``
(CUDA on an NVIDIA GPU, the CPU primitive on the CPU) and of the gather
reference against a float64 numpy reference, over head dims 64/128/256, GQA
groups 1/4, pages of 8/16 tokens, windows, lengths 1..300, row counts that do
and do not split (flash decoding), the op inside ``mx.compile``; a row of
length 0 must give zeros. Soft-capped cases (Gemma 2's ``attn_logit_softcapping``:
each score ``s`` becomes ``cap * tanh(s / cap)`` before the softmax) against the
reference capped likewise, where caps that bind must also move the output away from
the uncapped reference (``rel_uncapped``). Cases with attention sinks (gpt-oss: a
per-head logit joins each softmax with no value), split and unsplit, against the
reference with the sink in its denominator, and away from it without (``rel_no_sinks``). Then the time per call of the kernel and of the
gather path at serving shapes (llama-1B/8B attention: 32 heads over 8 KV heads),
with the bytes of K/V each must read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_infer import _fast

TOL = {mx.float32: 1e-4, mx.bfloat16: 2e-2, mx.float16: 5e-3}


def case(rng: np.random.Generator, R: int, H: int, KVH: int, D: int, P: int, max_len: int, dtype, *,
         spare: int = 3, min_len: int = 1):
    """Random q, storage, tables (distinct pages per row, shuffled) and lengths."""
    lengths = rng.integers(min_len, max_len + 1, size=R).astype(np.int32)
    T = int(-(-lengths.max() // P)) + spare
    pages = 1 + R * T
    perm = rng.permutation(np.arange(1, pages))
    tables = perm[: R * T].reshape(R, T).astype(np.int32)
    q = rng.standard_normal((R, H, D)).astype(np.float32)
    k = rng.standard_normal((pages, KVH, P, D)).astype(np.float32)
    v = rng.standard_normal((pages, KVH, P, D)).astype(np.float32)
    arrs = [mx.array(x).astype(dtype) for x in (q, k, v)]
    return arrs + [mx.array(tables), mx.array(lengths)]


def reference(q, k, v, tables, lengths, window: int, scale: float, softcap: float = 0.0, sinks=None) -> np.ndarray:
    """float64 attention of each row over its keys [max(0, len - window), len), read through the table."""
    q, k, v = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v))
    sinks = None if sinks is None else np.array(sinks.astype(mx.float32), dtype=np.float64)
    tables, lengths = np.array(tables), np.array(lengths)
    R, H, D = q.shape
    KVH, P = k.shape[1], k.shape[2]
    G = H // KVH
    out = np.zeros((R, H, D))
    for r in range(R):
        n = int(lengths[r])
        lo = max(0, n - window) if window > 0 else 0
        pos = np.arange(lo, n)
        if len(pos) == 0:
            continue
        pg = tables[r, pos // P]
        keys = k[pg, :, pos % P]  # (S, KVH, D)
        vals = v[pg, :, pos % P]
        for h in range(H):
            s = keys[:, h // G] @ q[r, h] * scale
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            top = s.max() if sinks is None else max(s.max(), sinks[h])
            w = np.exp(s - top)
            den = w.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
            out[r, h] = (w / den) @ vals[:, h // G]
    return out


def rel(out: mx.array, ref: np.ndarray) -> float:
    o = np.array(out.astype(mx.float32), dtype=np.float64)
    if not np.isfinite(o).all():
        return float("inf")
    return float(np.linalg.norm(o - ref) / max(np.linalg.norm(ref), 1e-30))


def check(quick: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    configs = [  # R, H, KVH, D, P, max_len, window, dtype
        (5, 32, 8, 64, 16, 300, 0, mx.bfloat16), (5, 32, 8, 128, 16, 300, 0, mx.bfloat16),
        (3, 4, 1, 256, 16, 300, 37, mx.bfloat16), (64, 32, 8, 128, 16, 300, 0, mx.bfloat16),
        (7, 8, 8, 64, 8, 300, 50, mx.float32), (2, 16, 4, 128, 8, 300, 0, mx.float16),
        (1, 32, 8, 128, 16, 2000, 0, mx.bfloat16), (9, 4, 1, 256, 8, 700, 512, mx.bfloat16),
        (33, 32, 8, 64, 16, 300, 100, mx.float32),
    ]
    configs = [(*c, 0.0) for c in configs] + [  # ..., softcap: Gemma 2's 50 (hardly binds) and caps that bind
        (5, 32, 8, 128, 16, 300, 0, mx.bfloat16, 1.0), (1, 32, 8, 128, 16, 2000, 0, mx.bfloat16, 2.0),
        (9, 4, 1, 256, 8, 700, 512, mx.bfloat16, 50.0), (33, 32, 8, 64, 16, 300, 100, mx.float32, 0.5),
        (2, 16, 4, 128, 8, 300, 0, mx.float16, 1.0), (64, 8, 4, 256, 16, 300, 0, mx.bfloat16, 50.0),
    ]
    if quick:
        configs = [(3, 8, 2, 64, 8, 100, 0, mx.float32, 0.0), (2, 4, 1, 128, 16, 60, 20, mx.bfloat16, 0.0),
                   (3, 8, 2, 64, 8, 100, 0, mx.float32, 1.0)]
    for R, H, KVH, D, P, L, W, dt, cap in configs:
        q, k, v, tab, lens = case(rng, R, H, KVH, D, P, L, dt)
        if cap:
            q = q * 3  # scores of a few units: a cap of 0.5..2 bends them
        scale = D ** -0.5
        ref = reference(q, k, v, tab, lens, W, scale, cap)
        got = _fast.paged_attention(q, k, v, tab, lens, window=W, scale=scale, softcap=cap)
        gat = _fast.paged_attention(q, k, v, tab, lens, window=W, scale=scale, softcap=cap, impl="gather")
        fn = mx.compile(lambda a, b, c, t, n: _fast.paged_attention(a, b, c, t, n, window=W, scale=scale, softcap=cap))
        comp = fn(q, k, v, tab, lens)
        mx.eval(got, gat, comp)
        T = tab.shape[1]
        row = {"R": R, "H": H, "KVH": KVH, "D": D, "P": P, "max_len": L, "window": W, "dtype": str(dt),
               "softcap": cap, "backend": _fast.paged_attention_backend(q, k),
               "splits": _fast.paged_attention_splits(R, KVH, min(W, T * P) if W else T * P),
               "rel_kernel": rel(got, ref), "rel_gather": rel(gat, ref), "rel_compiled": rel(comp, ref)}
        row["ok"] = max(row["rel_kernel"], row["rel_compiled"]) <= TOL[dt]
        if 0 < cap <= 2:  # a binding cap: the kernel's output must be far from the uncapped attention
            row["rel_uncapped"] = rel(got, reference(q, k, v, tab, lens, W, scale))
            row["ok"] = row["ok"] and row["rel_uncapped"] > 5 * TOL[dt]
        rows.append(row)
        print(json.dumps(row), flush=True)
    sink_configs = [  # R, H, KVH, D, P, max_len, window, dtype: gpt-oss-like heads (64 over 8), split and not
        (4, 64, 8, 64, 16, 300, 128, mx.bfloat16), (1, 64, 8, 64, 16, 2000, 0, mx.bfloat16),
        (33, 32, 8, 64, 16, 300, 0, mx.float32), (2, 16, 4, 128, 8, 300, 0, mx.float16),
        (6, 64, 8, 64, 16, 300, 64, mx.bfloat16), (160, 32, 8, 128, 16, 200, 0, mx.bfloat16),  # unsplit
    ]
    if quick:
        sink_configs = [(3, 8, 2, 64, 8, 100, 0, mx.float32)]
    for R, H, KVH, D, P, L, W, dt in sink_configs:
        q, k, v, tab, lens = case(rng, R, H, KVH, D, P, L, dt)
        # about log(keys) + 1: the sink keeps a share of the softmax however many keys a row has
        sinks = mx.array(rng.normal(np.log(min(W or L, L)) + 1, 1.0, size=H).astype(np.float32)).astype(dt)
        scale = D ** -0.5
        ref = reference(q, k, v, tab, lens, W, scale, sinks=sinks)
        got = _fast.paged_attention(q, k, v, tab, lens, window=W, scale=scale, sinks=sinks)
        gat = _fast.paged_attention(q, k, v, tab, lens, window=W, scale=scale, sinks=sinks, impl="gather")
        fn = mx.compile(lambda a, b, c, t, n, z: _fast.paged_attention(a, b, c, t, n, window=W, scale=scale, sinks=z))
        comp = fn(q, k, v, tab, lens, sinks)
        mx.eval(got, gat, comp)
        T = tab.shape[1]
        row = {"R": R, "H": H, "KVH": KVH, "D": D, "P": P, "max_len": L, "window": W, "dtype": str(dt),
               "sinks": True, "backend": _fast.paged_attention_backend(q, k),
               "splits": _fast.paged_attention_splits(R, KVH, min(W, T * P) if W else T * P),
               "rel_kernel": rel(got, ref), "rel_gather": rel(gat, ref), "rel_compiled": rel(comp, ref),
               "rel_no_sinks": rel(got, reference(q, k, v, tab, lens, W, scale))}
        row["ok"] = max(row["rel_kernel"], row["rel_compiled"]) <= TOL[dt] and row["rel_no_sinks"] > 5 * TOL[dt]
        rows.append(row)
        print(json.dumps(row), flush=True)
    # A row of length 0 attends to nothing: zeros from the kernel.
    q, k, v, tab, lens = case(rng, 4, 8, 2, 64, 16, 40, mx.float32)
    lens = mx.array([0, 5, 0, 40], mx.int32)
    got = np.array(_fast.paged_attention(q, k, v, tab, lens, scale=0.125, sinks=mx.ones((8,))))
    ok = bool(np.all(got[[0, 2]] == 0) and np.isfinite(got).all())
    rows.append({"case": "zero-length rows with sinks", "ok": ok})
    print(json.dumps(rows[-1]), flush=True)
    # A row of length 0 attends to nothing: zeros from the kernel.
    q, k, v, tab, lens = case(rng, 4, 8, 2, 64, 16, 40, mx.float32)
    lens = mx.array([0, 5, 0, 40], mx.int32)
    got = np.array(_fast.paged_attention(q, k, v, tab, lens, scale=0.125))
    ok = bool(np.all(got[[0, 2]] == 0) and np.isfinite(got).all())
    rows.append({"case": "zero-length rows", "ok": ok})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def bench(fn, n: int = 50) -> float:
    for _ in range(5):
        mx.eval(fn())
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def timing(quick: bool) -> list[dict]:
    rng = np.random.default_rng(1)
    rows = []
    shapes = [(8, 64), (32, 64), (64, 64), (128, 64), (8, 128), (32, 128), (64, 128), (128, 128)]
    contexts = [512, 2048]
    if quick:
        shapes, contexts = [(4, 64)], [128]
    for ctx in contexts:
        for R, D in shapes:
            q, k, v, tab, lens = case(rng, R, 32, 8, D, 16, ctx, mx.bfloat16, spare=0, min_len=ctx)
            scale = D ** -0.5
            kern = bench(lambda: _fast.paged_attention(q, k, v, tab, lens, scale=scale))
            gath = bench(lambda: _fast.paged_attention(q, k, v, tab, lens, scale=scale, impl="gather"))
            kv_bytes = 2 * R * 8 * ctx * D * 2
            row = {"R": R, "D": D, "context": ctx, "kernel_ms": kern, "gather_ms": gath,
                   "kernel_GBps": kv_bytes / kern / 1e6, "speedup": gath / kern,
                   "splits": _fast.paged_attention_splits(R, 8, tab.shape[1] * 16)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def parse_pipeline(text: str) -> tuple[int, bool]:
    """``"4"`` -> (4, False), ``"1p"`` -> (1, True): kU key sets per warp and iteration, prefetched or not."""
    prefetch = text.endswith("p")
    unroll = int(text[:-1] if prefetch else text)
    return unroll, prefetch


def sweep(pipelines: list[str], reps: int = 15, calls: int = 16, quick: bool = False) -> dict:
    """Pass 1's key pipelines (MLX_INFER_PAGED_ATTN_UNROLL / _PREFETCH) at serving shapes: each timed as
    ``calls`` kernel calls in one evaluation (the launches back to back, as a step's layers run them, over 4
    storages so the K/V reads miss the L2 as a step's do), median of ``reps``; every pipeline also checked
    against the float64 reference. The best is the lowest geometric mean over the shapes."""
    import math
    import os

    rng = np.random.default_rng(7)
    shapes = [(R, D, ctx) for D in (64, 128) for ctx in (640, 2048) for R in (8, 32, 64, 128)]
    if quick:
        shapes, reps, calls = [(4, 64, 64)], 2, 2
    inputs = {}
    for R, D, ctx in shapes:
        T = -(-ctx // 16)
        pages = 1 + R * T
        tabs = mx.array(rng.permutation(np.arange(1, pages))[: R * T].reshape(R, T).astype(np.int32))
        lens = mx.array(np.full(R, ctx, np.int32))
        q = mx.random.normal((R, 32, D)).astype(mx.bfloat16)
        kv = [(mx.random.normal((pages, 8, 16, D)).astype(mx.bfloat16),
               mx.random.normal((pages, 8, 16, D)).astype(mx.bfloat16)) for _ in range(4)]
        mx.eval(q, kv)
        inputs[(R, D, ctx)] = (q, kv, tabs, lens)
    results: dict = {"shapes": [list(x) for x in shapes], "pipelines": {}}
    check_rng = np.random.default_rng(3)
    for name in pipelines:
        unroll, prefetch = parse_pipeline(name)
        os.environ["MLX_INFER_PAGED_ATTN_UNROLL"] = str(unroll)
        os.environ["MLX_INFER_PAGED_ATTN_PREFETCH"] = "1" if prefetch else "0"
        errs = []
        for R, D, L in ((3, 64, 300), (40, 128, 900), (5, 64, 37)):
            q, k, v, tab, lens = case(check_rng, R, 32, 8, D, 16, L, mx.bfloat16)
            out = _fast.paged_attention(q, k, v, tab, lens, scale=D ** -0.5)
            errs.append(rel(out, reference(q, k, v, tab, lens, 0, D ** -0.5)))
        times = []
        for key in shapes:
            q, kv, tabs, lens = inputs[key]
            scale = key[1] ** -0.5

            def many():
                return [_fast.paged_attention(q, *kv[i % 4], tabs, lens, scale=scale) for i in range(calls)]

            times.append(bench(many, reps) / calls)
        geo = math.exp(sum(math.log(t) for t in times) / len(times))
        ok = all(e <= TOL[mx.bfloat16] for e in errs)
        results["pipelines"][name] = {"ms": times, "geomean_ms": geo, "rel": errs, "ok": ok}
        print(json.dumps({"pipeline": name, "geomean_ms": round(geo, 4), "ok": ok,
                          "ms": [round(t, 4) for t in times]}), flush=True)
    for var in ("MLX_INFER_PAGED_ATTN_UNROLL", "MLX_INFER_PAGED_ATTN_PREFETCH"):
        os.environ.pop(var, None)
    good = {n: r for n, r in results["pipelines"].items() if r["ok"]}
    results["best"] = min(good, key=lambda n: good[n]["geomean_ms"]) if good else None
    print("\n| R | D | context | " + " | ".join(f"{n} ms" for n in pipelines) + " |")
    for i, (R, D, ctx) in enumerate(shapes):
        cells = " | ".join(f"{results['pipelines'][n]['ms'][i]:.4f}" for n in pipelines)
        print(f"| {R} | {D} | {ctx} | {cells} |")
    print(f"best: {results['best']}", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--sweep", default=None, metavar="LIST",
                   help="only time pass 1's key pipelines, e.g. 1p,2,2p,4,4p,8 (kU sets; p: prefetched)")
    p.add_argument("--best-file", default=None, help="with --sweep: write the best pipeline's env assignments")
    args = p.parse_args()
    print(f"device {mx.default_device()}", flush=True)
    if args.sweep:
        res = sweep(args.sweep.split(","), quick=args.quick)
        if args.json:
            Path(args.json).write_text(json.dumps({"device": str(mx.default_device()), **res}, indent=2))
        if args.best_file and res["best"]:
            unroll, prefetch = parse_pipeline(res["best"])
            Path(args.best_file).write_text(f"MLX_INFER_PAGED_ATTN_UNROLL={unroll} "
                                            f"MLX_INFER_PAGED_ATTN_PREFETCH={int(prefetch)}\n")
        sys.exit(0 if res["best"] else 1)
    checks = check(args.quick)
    times = timing(args.quick)
    print("\n| R | D | context | kernel ms | gather ms | gather/kernel | kernel GB/s (K+V) | splits |")
    for r in times:
        print(f"| {r['R']} | {r['D']} | {r['context']} | {r['kernel_ms']:.3f} | {r['gather_ms']:.3f} | "
              f"{r['speedup']:.2f} | {r['kernel_GBps']:.0f} | {r['splits']} |")
    bad = [c for c in checks if not c["ok"]]
    print(f"checks: {len(checks) - len(bad)}/{len(checks)} ok")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(mx.default_device()), "checks": checks,
                                               "timing": times}, indent=2))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
