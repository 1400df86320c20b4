"""What a CUDA kernel pays to read arrays made on the host, timed by the device (CUPTI via torch.profiler).

MLX's CUDA allocator (mlx/backend/cuda/allocator.cpp) puts every buffer of <= 8 bytes in a small pool of
managed memory advised as accessed by the GPU (so it stays where the CPU wrote it and the GPU reads it
across the bus), and every host-made array (``mx.array(numpy)``: no stream) in managed memory that the
GPU's first touch migrates (a page fault). A decode step has both: its per-step plan (positions, lengths,
block tables, slots) is made on the host, and a one-row step's plan arrays are 4 bytes each. This probe
launches ``--layers`` copies of one kernel per "step" (as a step's layers do), 1536 blocks of 64 threads
(the qkv_rope launch at 32 rows of llama-8B), every thread reading ``p[0]`` and ``idx[block % n]``:

- ``const``: p a template constant, idx made by a GPU op (the baseline);
- ``p-small``: p an 8-byte host array (how qkv_rope and paged attention passed their scale before session 16);
- ``idx-small``: idx a 4-byte host array made anew each step (a one-row step's positions);
- ``idx-host``: idx a 128-byte host array made anew each step (a 32-row step's positions);
- ``idx-dev``: the same 128 bytes copied once by a GPU op at the step's start (the copy's own kernel counted);
- ``idx-prefetch``: the 128-byte host array sent to the GPU by ``mlx_infer._fast.prefetch_to_gpu`` (as the
  engine's step plan is), then ``--build-ms`` of host time (a step's graph build) before the launches.

    python benchmarks/gpu_host_arrays.py --json benchmarks/results/h200-host-arrays.json
"""

from __future__ import annotations

import argparse
import json
import platform
import struct
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

SOURCE = """
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= x_shape[0]) return;
  const float s = kConst ? __int_as_float(kBits) : p[0];
  out[i] = x[i] * s + static_cast<float>(idx[blockIdx.x % idx_shape[0]]);
"""


def kernel(name: str) -> Any:
    return mx.fast.cuda_kernel(name=name, input_names=["x", "p", "idx"], output_names=["out"], source=SOURCE)


def bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", v))[0]


def launch(k: Any, x: mx.array, p: mx.array, idx: mx.array, const: bool) -> mx.array:
    return k(inputs=[x, p, idx], template=[("kConst", const), ("kBits", bits(0.5))], grid=(x.shape[0], 1, 1),
             threadgroup=(64, 1, 1), output_shapes=[x.shape], output_dtypes=[mx.float32])[0]


def step(case: str, k: Any, x: mx.array, layers: int, rows: int, rng: np.random.Generator,
         resident: mx.array, build_ms: float = 0.0) -> mx.array:
    """One "step": the case's inputs made as a decode step makes them, then ``layers`` launches.
    ``resident``: a GPU-made int32 array of 32 (device memory, made once)."""
    host = rng.integers(0, 100, size=rows).astype(np.int32)  # this step's plan values
    p = resident  # read only by p-small
    if case == "const":
        idx = resident
    elif case == "p-small":
        idx, p = resident, mx.array([0.5, 0.0])  # 8 bytes, host-made: the small pool
    else:
        idx = mx.array(host)  # host-made: 4 B (small pool) or 128 B (managed)
        if case == "idx-dev":
            idx = mx.concatenate([idx, mx.zeros(4, mx.int32)])[:rows]  # one GPU copy: device memory
        elif case == "idx-prefetch":
            from mlx_infer import _fast

            if not _fast.prefetch_to_gpu(idx):
                raise SystemExit(f"prefetch_to_gpu issued no prefetch: {_fast.prefetch_error() or 'not CUDA'}")
            time.sleep(build_ms / 1e3)  # the host's graph build, while the pages move
    h = x
    for _ in range(layers):
        h = launch(k, h, p, idx, case != "p-small")
    return h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--blocks", type=int, default=1536)
    ap.add_argument("--build-ms", type=float, default=0.5,
                    help="idx-prefetch: host time between the prefetch and the launches (a step's graph build)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    cases = {"const": 32, "p-small": 32, "idx-small": 1, "idx-host": 32, "idx-dev": 32, "idx-prefetch": 32}
    kernels = {c: kernel("probe_" + c.replace("-", "_")) for c in cases}
    x = mx.random.normal((args.blocks * 64,))
    mx.eval(x)
    rng = np.random.default_rng(0)
    resident = mx.arange(32, dtype=mx.int32) * 3  # device memory (a GPU op's output of 128 bytes)
    mx.eval(resident)
    for c, rows in cases.items():  # warm-up: NVRTC
        mx.eval(step(c, kernels[c], x, args.layers, rows, rng, resident, args.build_ms))
    mx.synchronize()
    torch.zeros(1, device="cuda")
    rows_out: list[dict[str, Any]] = []
    for c, rows in cases.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                mx.eval(step(c, kernels[c], x, args.layers, rows, rng, resident, args.build_ms))
                mx.synchronize()
            wall = (time.perf_counter() - t0) / args.steps
        per: dict[str, list[float]] = defaultdict(list)
        for ev in prof.events():
            if str(getattr(ev, "device_type", "")).endswith("CUDA"):
                per["probe" if "probe_" in ev.name else "other"].append(ev.time_range.elapsed_us())
        probe = per["probe"]
        row = {"case": c, "rows": rows, "layers": args.layers, "wall_ms_per_step": wall * 1e3,
               "probe_us_mean": float(np.mean(probe)), "probe_us_median": float(np.median(probe)),
               "probe_us_first_of_step": float(np.mean(probe[:: args.layers])),
               "probe_us_per_step": float(np.sum(probe)) / args.steps,
               "other_us_per_step": float(np.sum(per["other"])) / args.steps}
        rows_out.append(row)
        print(f"{c:>10} ({rows:>2} rows): kernel {row['probe_us_median']:6.2f} us median, {row['probe_us_mean']:6.2f} "
              f"mean, first of a step {row['probe_us_first_of_step']:7.2f}; per step {row['probe_us_per_step']:7.1f} us "
              f"kernels + {row['other_us_per_step']:5.1f} other; wall {row['wall_ms_per_step']:.3f} ms", flush=True)
    if args.json:
        doc = {"machine": platform.platform(), "mlx": mx.__version__, "command": " ".join(sys.argv), "rows": rows_out}
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
