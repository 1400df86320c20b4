"""Which chunk-only mixed steps fail on CUDA (tiny llama shapes), and which part of the step does it.

    python benchmarks/gpu_chunk_probe.py            # every case: one line each, ok / the error
    python benchmarks/gpu_chunk_probe.py --engine   # (internal) the engine cases, in this process
    MLX_USE_CUDA_GRAPHS=0 compute-sanitizer --show-backtrace host \
        python benchmarks/gpu_chunk_probe.py --engine --only=1   # which kernel launch is refused

Session 5 found ``cudaGraphAddKernelNode ... invalid argument`` at the first chunk-only step of 64
prompts of 16 tokens (1,024 chunk rows, 64 logit rows) on the tiny llama (hidden 64, 4 heads over 2,
head dim 16, float32). This probe separates the suspects:

1. ``paged_attention`` alone (the CUDA kernel, eager and inside ``mx.compile``) at 64..4096 rows of that
   geometry, float32 and bfloat16;
2. the engine at the failing step and its neighbours: rows (prompts x tokens) and logit rows varied
   apart, attention kernel vs gather, compiled vs op-by-op step, bfloat16 weights, a wider head;
3. the same engine cases with ``MLX_USE_CUDA_GRAPHS=0`` (a subprocess), so a bad launch fails at its
   own kernel instead of at graph assembly.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_infer import _fast  # noqa: E402


def attention_cases() -> None:
    rng = np.random.default_rng(0)
    H, KVH, D, P = 4, 2, 16, 16
    for dtype in (mx.float32, mx.bfloat16):
        for R in (64, 256, 1024, 2048, 4096):
            T = 4
            pages = 1 + R * T
            q = mx.array(rng.standard_normal((R, H, D)).astype(np.float32)).astype(dtype)
            k = mx.array(rng.standard_normal((pages, KVH, P, D)).astype(np.float32)).astype(dtype)
            v = mx.array(rng.standard_normal((pages, KVH, P, D)).astype(np.float32)).astype(dtype)
            tables = mx.array(np.arange(1, pages).reshape(R, T).astype(np.int32))
            lengths = mx.array(rng.integers(1, T * P + 1, size=R).astype(np.int32))
            for mode in ("eager", "compiled"):
                fn = (lambda *a: _fast.paged_attention(*a, scale=0.25))
                if mode == "compiled":
                    fn = mx.compile(fn)
                try:
                    out = fn(q, k, v, tables, lengths)
                    ref = _fast.paged_attention(q, k, v, tables, lengths, scale=0.25, impl="gather")
                    err = float(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max())
                    print(f"attention {dtype} R={R} {mode}: ok, max |kernel - gather| {err:.2e}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"attention {dtype} R={R} {mode}: FAIL {type(e).__name__} {str(e)[:200]}", flush=True)


def engine_cases() -> None:
    from tiny import make_tiny_model_dir

    from mlx_infer.artifacts.loader import load_model
    from mlx_infer.engine import Engine, EngineConfig, EngineRequest
    from mlx_infer.generation.bindings.paged_decode_step import PagedDecodePolicy

    tmp = Path(tempfile.mkdtemp())
    models = {
        "f32-d16": load_model(make_tiny_model_dir(tmp / "a", "llama")),
        "bf16-d16": load_model(make_tiny_model_dir(tmp / "b", "llama", dtype=mx.bfloat16)),
        "f32-d64": load_model(make_tiny_model_dir(tmp / "c", "llama", hidden_size=256)),
    }
    cases = [  # (model, prompts, prompt tokens, budget, policy kwargs)
        ("f32-d16", 64, 16, 2048, {}),               # session 5's failing step
        ("f32-d16", 16, 16, 2048, {}),               # 256 rows, 16 logit rows
        ("f32-d16", 32, 16, 2048, {}),               # 512 rows
        ("f32-d16", 48, 16, 2048, {}),               # 768 rows
        ("f32-d16", 8, 128, 2048, {}),               # 1024 rows, 8 logit rows
        ("f32-d16", 128, 8, 2048, {}),               # 1024 rows, 128 logit rows
        ("f32-d16", 64, 16, 512, {}),                # 512-token budget
        ("f32-d16", 64, 16, 2048, {"attention": "gather"}),
        ("f32-d16", 64, 16, 2048, {"compile": False}),
        ("f32-d16", 64, 16, 2048, {"pad_rows": False}),
        ("bf16-d16", 64, 16, 2048, {}),
        ("f32-d64", 64, 16, 2048, {}),
    ]
    only = [int(a.split("=")[1]) for a in sys.argv if a.startswith("--only=")]
    tokens: dict[tuple, list] = {}  # (model, prompts, length) -> the first case's tokens
    for name, n, plen, budget, kw in [cases[i] for i in only] if only else cases:
        t = time.perf_counter()
        eng = Engine(models[name], EngineConfig(max_batch=n, num_pages=n * 16 + 1, mixed_steps=True,
                                                prefill_step_size=budget),
                     decode_policy=PagedDecodePolicy(**kw))
        label = f"engine {name} {n}x{plen} budget {budget} {kw or ''}"
        try:
            hs = [eng.submit(EngineRequest(prompt_ids=[(7 * i + j) % 300 + 5 for j in range(plen)], max_tokens=3,
                                           ignore_eos=True, detokenize=False)) for i in range(n)]
            eng.run_until_idle()
            res = {h.result(5).finish_reason for h in hs}
            ids = [h.result(5).token_ids for h in hs]
            same = tokens.setdefault((name, n, plen), ids) == ids
            print(f"{label}: ok mixed {eng.mixed_steps} separate {eng.separate_prefills} {res} "
                  f"tokens {'=' if same else '!='} the first case of these prompts' "
                  f"{time.perf_counter() - t:.1f}s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{label}: FAIL {type(e).__name__} {str(e)[:200]}", flush=True)
        try:
            mx.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"  synchronize after it: {type(e).__name__} {str(e)[:120]}", flush=True)


def main() -> None:
    if "--engine" in sys.argv:
        engine_cases()
        return
    print("device", mx.default_device(), mx.__version__, flush=True)
    attention_cases()
    for graphs in ("1", "0"):
        print(f"== engine cases, MLX_USE_CUDA_GRAPHS={graphs}", flush=True)
        env = dict(os.environ, MLX_USE_CUDA_GRAPHS=graphs)
        subprocess.run([sys.executable, __file__, "--engine"], env=env, timeout=200)


if __name__ == "__main__":
    main()
