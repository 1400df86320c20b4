"""Decode speed of the default model's variants, loaded once and interleaved (after default_precision.py wrote them).

    python benchmarks/default_precision_decode.py [WORK_DIR]
"""
import statistics, sys
from mlx_infer.artifacts.loader import load_model
from mlx_infer.generation.autoregressive import generate
WORK = sys.argv[1] if len(sys.argv) > 1 else "/tmp/mlx-infer-precision"  # default_precision.py --work
ms = {v: load_model(f"{WORK}/{v}") for v in ("float32", "bfloat16", "q8", "q4")}
res = {v: [] for v in ms}
for r in range(5):
    for v, m in ms.items():
        g = generate(m, "Once upon a time, in a small village by the sea, there lived", max_tokens=96)
        with g:
            for _ in g: pass
        res[v].append(g.stats.decode_tps)
        print(r, v, round(g.stats.decode_tps, 2), file=sys.stderr, flush=True)
for v in ms:
    print(v, "median", round(statistics.median(res[v]), 2), [round(x, 2) for x in res[v]])
