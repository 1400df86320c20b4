"""Does a weight prefetched into the L2 during a latency-bound kernel make the next one-row product faster?

A 1-stream decode step of a large model is device-bound on its products, and a one-row product of a mid-size
weight (llama-8B's o: 32 MiB, q|k|v: 48 MiB) reaches only ~2.1-2.4 TB/s of an H200's 4.8 (benchmarks/RESULTS.md,
sessions 15 and 25): a ~7-10 us kernel cannot hide its ramp and its tail. But the kernel before it, the paged
attention at one row, runs ~10-17 us on a few blocks and leaves HBM nearly idle. If that kernel asked the L2 for
the o weight while it works, the o product would read it from the L2. This probe tests the idea without the
engine: a stand-in kernel of ``--blocks`` x 128 threads spins for ``--spin-us`` (the attention's duration) and,
with prefetch on, issues ``prefetch.global.L2`` (optionally ``::evict_last``) for every 128-byte line of the next
product's weight; then the product (MLX's ``x @ W.T``, its one-row GEMV) runs on that weight. A fourth arm
prefetches with ``_fast.l2_prefetch`` (a kernel of its own before the stand-in, as the decode graphs place it
under MLX_INFER_L2_PREFETCH_O=1) and the stand-in only spins. Weights cycle
through copies that overflow the L2, so without the prefetch each product reads from HBM. Device kernel
durations come from CUPTI (torch.profiler), as ``gpu_gemv_probe.py`` times them.

    python benchmarks/gpu_l2_prefetch_probe.py --json OUT.json   # GPU machine with a CUDA torch

Per (weight, spin, prefetch policy): the product's median µs with and without the prefetch, and the stand-in's
(it should not grow much: the prefetches are fire-and-forget).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_infer import _fast

#: (name, out, in): llama-8B's o and fused q|k|v, llama-1B's o, one-row products the step runs.
WEIGHTS = [("8b-o", 4096, 4096), ("8b-qkv", 6144, 4096), ("1b-o", 2048, 2048)]
L2_BYTES = 64 * 2**20  # more than an H200's (or H100's 50 MB) L2
#: The arms: no prefetch; prefetch inside the stand-in (plain, ::evict_last); the graphs' own kernel before it.
MODES = {0: "off", 1: "inside", 2: "inside-evict-last", 3: "own-kernel"}

# Template constants: kCycles (spin length in clock cycles), kPrefetch (0 off, 1 prefetch.global.L2, 2 with
# ::evict_last), kLines (128-byte lines of w). x (K,) is copied to out so the product depends on this kernel.
SOURCE = r"""
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int threads = gridDim.x * blockDim.x;
  const char* base = reinterpret_cast<const char*>(w);
  if (kPrefetch == 1) {
    for (long long i = tid; i < kLines; i += threads)
      asm volatile("prefetch.global.L2 [%0];" :: "l"(base + i * 128));
  } else if (kPrefetch == 2) {
    for (long long i = tid; i < kLines; i += threads)
      asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(base + i * 128));
  }
  const long long start = clock64();
  while (clock64() - start < kCycles) { }
  for (int i = tid; i < x_shape[0]; i += threads) out[i] = x[i];
"""


def stand_in() -> Any:
    return mx.fast.cuda_kernel(name="mlxi_probe_wait", input_names=["x", "w"], output_names=["out"], source=SOURCE)


def label(kernel_name: str) -> str:
    """``wait`` for the stand-in, ``prefetch`` for the graphs' prefetch kernel, ``product`` for anything else (MLX's
    GEMV and whatever it launches)."""
    if "mlxi_probe_wait" in kernel_name:
        return "wait"
    return "prefetch" if "mlxi_l2_prefetch" in kernel_name else "product"


def per_iteration(events: list[tuple[str, float]]) -> dict[str, list[float]]:
    """Device durations (µs) in launch order -> per iteration: the stand-in's and the product's (the sum of the
    kernels after one stand-in and before the next)."""
    out: dict[str, list[float]] = {"wait": [], "product": [], "prefetch": []}
    for name, us in events:
        kind = label(name)
        if kind == "wait":
            out["wait"].append(us)
            out["product"].append(0.0)
        elif kind == "prefetch":
            out["prefetch"].append(us)
        elif out["product"]:
            out["product"][-1] += us
    return out


def run(kind: Any, out_f: int, in_f: int, spin_us: float, prefetch: int, blocks: int, iters: int,
        clock_ghz: float) -> dict[str, float]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    copies = max(2, -(-L2_BYTES // (out_f * in_f * 2)))
    ws = [mx.random.normal((out_f, in_f)).astype(mx.bfloat16) * 0.02 for _ in range(copies)]
    x = mx.random.normal((1, in_f)).astype(mx.bfloat16)
    mx.eval(ws, x)
    lines = out_f * in_f * 2 // 128
    targs = [("kCycles", int(spin_us * clock_ghz * 1e3)), ("kPrefetch", prefetch if prefetch < 3 else 0),
             ("kLines", lines)]

    def step(j: int) -> mx.array:
        w = ws[j % copies]
        xin = x.reshape(-1)
        if prefetch == 3:  # the graphs' own prefetch kernel, then a stand-in that only spins
            xin = _fast.l2_prefetch(xin, w)
        xx = kind(inputs=[xin, w], template=targs, grid=(blocks * 128, 1, 1), threadgroup=(128, 1, 1),
                  output_shapes=[(in_f,)], output_dtypes=[mx.bfloat16])[0]
        return xx.reshape(1, in_f) @ w.T  # (1, out)

    for j in range(2 * copies):  # NVRTC compiles, warm
        mx.eval(step(j))
    mx.synchronize()
    torch.zeros(1, device="cuda")  # CUPTI needs a context in torch too
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for j in range(iters):
            mx.eval(step(j))
        mx.synchronize()
    events = sorted(((ev.name, ev.time_range.start, ev.time_range.elapsed_us()) for ev in prof.events()
                     if str(getattr(ev, "device_type", "")).endswith("CUDA")), key=lambda e: e[1])
    times = per_iteration([(n, us) for n, _, us in events])
    return {k: statistics.median(v) for k, v in times.items() if v}  # µs: wait, product, prefetch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", default=",".join(n for n, _, _ in WEIGHTS))
    p.add_argument("--spin-us", default="4,10,16", help="the stand-in's lengths (the attention kernel's time)")
    p.add_argument("--blocks", type=int, default=32, help="the stand-in's blocks of 128 threads (the attention "
                                                          "kernel's grid at one row: KV heads x splits)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--clock-ghz", type=float, default=1.755, help="SM clock for the spin (H200/H100 ~1.75-1.98)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    try:
        import torch

        assert torch.cuda.is_available() and mx.default_device() == mx.gpu and mx.cuda.is_available()
    except (ImportError, AssertionError, AttributeError):
        raise SystemExit("gpu_l2_prefetch_probe.py runs on MLX's CUDA backend and times kernels through "
                         "torch.profiler: it needs both on a GPU machine")
    kind = stand_in()
    rows: list[dict[str, Any]] = []
    print(f"device {mx.default_device()} mlx {mx.__version__}", flush=True)
    for name, out_f, in_f in WEIGHTS:
        if name not in args.weights.split(","):
            continue
        gb = out_f * in_f * 2 / 1e9
        for spin in (float(s) for s in args.spin_us.split(",")):
            got = {pf: run(kind, out_f, in_f, spin, pf, args.blocks, args.iters, args.clock_ghz)
                   for pf in (0, 1, 2, 3)}
            base = got[0]["product"]
            arms = " | ".join(f"{MODES[pf]} {got[pf]['product']:6.1f} us ({base / got[pf]['product']:4.2f}x)"
                              for pf in (1, 2, 3))
            print(f"{name:7s} {gb * 1e3:5.1f} MB spin {spin:4.1f} us: product {base:6.1f} us ({gb / base * 1e3:4.2f}"
                  f" TB/s) | {arms} | stand-in " + " / ".join(f"{got[pf]['wait']:5.1f}" for pf in range(4))
                  + f" us | prefetch kernel {got[3].get('prefetch', 0.0):5.1f} us", flush=True)
            rows.append({"weight": name, "out": out_f, "in": in_f, "spin_us": spin, "blocks": args.blocks,
                         "product_us": {MODES[k]: v["product"] for k, v in got.items()},
                         "stand_in_us": {MODES[k]: v["wait"] for k, v in got.items()},
                         "prefetch_kernel_us": got[3].get("prefetch")})
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": platform.node(), "mlx": mx.__version__,
                                               "command": " ".join(sys.argv), "modes": MODES,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
