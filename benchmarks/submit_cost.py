"""What MLX's host pays to build and submit one graph node, by kind (issue 16: a few-row step is host-bound).

A "step" here is a chain of ``--nodes`` nodes of one kind on a (rows, E) bfloat16 hidden state, the
shape of a decode step's residual stream. Per step it times the graph build (Python + MLX's op
constructors), ``mx.async_eval`` (MLX encoding the kernels: on CUDA its graph nodes and commits) and the
wait for the device, and prints medians per node. Kinds:

- ``add``: MLX's binary add (one kernel);
- ``rms_norm``: ``mx.fast.rms_norm`` (one kernel);
- ``add+rms_norm``: the two, as a decode layer's residual add and the norm after it (two kernels);
- ``custom``: a trivial ``mx.fast.cuda_kernel`` copy (one ``CustomKernel``, CUDA only);
- ``reshape``: a view (no kernel);
- ``matmul``: ``x @ W`` with W (E, E) (cuBLASLt: MLX's gemv takes only a transposed W);
- ``matmul_wt``: ``x @ W.T``, a Linear layer's product (MLX's gemv at one row, cuBLASLt above);
- ``skinny``: ``mlx_infer._fast.skinny_linear(x, W)``, the decode graphs' GEMV kernel (CUDA only);
- ``tuned``: ``mlx_infer._fast.tuned_linear(x, W)``, our cuBLASLt primitive with its plan (descriptors and
  algorithm) cached per shape (cpp/matmul/cublas_product.cpp; only in a build with ``MLX_INFER_CUBLAS=ON``,
  ``_fast.tuned_products_available()``): what a product costs MLX's host without MLX's per-call descriptors
  and heuristic. Its first call of a shape tunes (the warm-up steps absorb it).

    python benchmarks/submit_cost.py --rows 1,32 --nodes 64 --json /tmp/submit.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx

from mlx_infer import _fast

ON_CUDA = mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()
_COPY = None


def _copy_kernel():
    global _COPY
    if _COPY is None:
        _COPY = mx.fast.cuda_kernel(name="probe_copy", input_names=["a"], output_names=["out"],
                                    source="size_t i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                                           "if (i < N) { out[i] = a[i]; }")
    return _COPY


def node(kind: str, w: mx.array, m: mx.array) -> Callable[[mx.array, mx.array], tuple[mx.array, mx.array]]:
    """One step of the chain: (h, r) -> (h', r'); ``add+rms_norm`` carries the sum as r."""
    if kind == "add":
        return lambda h, r: (h + r, r)
    if kind == "rms_norm":
        return lambda h, r: (mx.fast.rms_norm(h, w, 1e-5), r)
    if kind == "add+rms_norm":
        def pair(h, r):
            s = h + r
            return mx.fast.rms_norm(s, w, 1e-5), s
        return pair
    if kind == "custom":
        def custom(h, r):
            out = _copy_kernel()(inputs=[h], output_shapes=[h.shape], output_dtypes=[h.dtype],
                                 grid=(h.size, 1, 1), threadgroup=(256, 1, 1),
                                 template=[("N", h.size)])[0]
            return out, r
        return custom
    if kind == "reshape":
        return lambda h, r: (h.reshape(-1).reshape(h.shape), r)
    if kind == "matmul":
        return lambda h, r: (h @ m, r)
    if kind == "matmul_wt":  # a Linear's x @ W.T: MLX's gemv at one row, cuBLASLt above
        return lambda h, r: (h @ m.T, r)
    if kind == "skinny":  # the decode graphs' CUDA GEMV kernel (a CustomKernel), 1-64 rows
        return lambda h, r: (_fast.skinny_linear(h, m), r)
    if kind == "tuned":  # our cuBLASLt primitive, its plan cached per shape (mx.matmul where it is not built)
        return lambda h, r: (_fast.tuned_linear(h, m), r)
    raise SystemExit(f"unknown kind {kind!r}")


def measure(kind: str, rows: int, nodes: int, steps: int, E: int) -> dict[str, float]:
    key = mx.random.key(0)
    h0 = mx.random.normal((rows, E), key=key).astype(mx.bfloat16)  # (rows, E)
    r0 = mx.random.normal((rows, E), key=mx.random.key(1)).astype(mx.bfloat16)  # (rows, E)
    w = mx.ones((E,), mx.bfloat16)  # (E,)
    m = (mx.random.normal((E, E), key=mx.random.key(2)) / E**0.5).astype(mx.bfloat16)  # (E, E)
    mx.eval(h0, r0, w, m)
    f = node(kind, w, m)
    builds, submits, waits = [], [], []
    for i in range(steps + 5):
        t0 = time.perf_counter()
        h, r = h0, r0
        for _ in range(nodes):
            h, r = f(h, r)
        t1 = time.perf_counter()
        mx.async_eval(h, r)
        t2 = time.perf_counter()
        mx.eval(h, r)
        t3 = time.perf_counter()
        if i >= 5:  # warm-up: kernels compiled, buffers cached
            builds.append(t1 - t0)
            submits.append(t2 - t1)
            waits.append(t3 - t2)
    per = lambda v: statistics.median(v) / nodes * 1e6  # noqa: E731
    return {"kind": kind, "rows": rows, "nodes": nodes, "build_us_per_node": per(builds),
            "submit_us_per_node": per(submits), "wait_us_per_node": per(waits)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,32")
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--kinds", default="reshape,add,rms_norm,add+rms_norm,custom,matmul,matmul_wt,skinny,tuned")
    p.add_argument("--rounds", type=int, default=3, help="passes over the kinds, alternating (medians printed)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    kinds = [k for k in args.kinds.split(",") if ON_CUDA or k not in ("custom", "skinny")]
    if "tuned" in kinds and not _fast.tuned_products_available():
        print("tuned: this build has no tuned cuBLASLt products (MLX_INFER_CUBLAS=ON builds them); left out")
        kinds.remove("tuned")
    print(f"device {mx.default_device()}, mlx {mx.__version__}, hidden {args.hidden}, {args.nodes} nodes a step")
    results = []
    for rows in (int(s) for s in args.rows.split(",")):
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
        for _ in range(args.rounds):
            for k in kinds:
                runs[k].append(measure(k, rows, args.nodes, args.steps, args.hidden))
        for k in kinds:
            med = {f: statistics.median(r[f] for r in runs[k])
                   for f in ("build_us_per_node", "submit_us_per_node", "wait_us_per_node")}
            results.append({"kind": k, "rows": rows, **med})
            print(f"rows {rows:>3} {k:>13}: build {med['build_us_per_node']:6.2f} us/node, submit "
                  f"{med['submit_us_per_node']:6.2f}, wait {med['wait_us_per_node']:6.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"mlx": mx.__version__, "device": str(mx.default_device()),
                                               "nodes": args.nodes, "hidden": args.hidden,
                                               "results": results}, indent=1))


if __name__ == "__main__":
    main()
