"""How far compiled bfloat16 graphs part from eager on this device: tiny Gemma 4 configs of
tests/test_gemma4_decode_step.py, teacher-forced, max |logits difference| for

- MLX's own ``mx.compile`` of the model over the whole sequence (the reference drift),
- our compiled C++ step (``mx.compile`` of the step graph) and
- our step's graph op by op (no compile),

each against the eager model with its caches. Grounds the GPU bound of
``test_greedy_and_forced_logits_match_eager`` (twice MLX's own drift). Run from the repository root:
``python benchmarks/compile_drift.py``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_gemma4_decode_step import (  # noqa: E402
    compiled_run, eager_run, forced_stream, max_diff, mlx_compile_drift, tiny_gemma4)

from mlx_infer.generation.bindings.graph_spec import DecodePolicy  # noqa: E402

VARIANTS = ["dense-bf16", "k_eq_v-bf16", "ple-bf16", "kv_shared-bf16", "ple", "kv_shared"]


def main() -> None:
    rows = []
    print(f"device {mx.default_device()}, mlx {mx.__version__}")
    for v in VARIANTS:
        model = tiny_gemma4(v)
        t = time.perf_counter()
        forced = forced_stream()
        _, want = eager_run(model, forced=forced)
        _, compiled, _ = compiled_run(model, forced=forced, policy=DecodePolicy(compile=True, compile_min_batch=1))
        _, graph, _ = compiled_run(model, forced=forced, policy=DecodePolicy(compile=False, compile_min_batch=1))
        row = {"variant": v, "mlx_compile": mlx_compile_drift(model), "step_compiled": max_diff(compiled, want),
               "step_graph": max_diff(graph, want)}
        rows.append(row)
        print(f"{v:16s} mx.compile {row['mlx_compile']:.4g}  step compiled {row['step_compiled']:.4g}  "
              f"step op by op {row['step_graph']:.4g}  ({time.perf_counter() - t:.1f} s)", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
