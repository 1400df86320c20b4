"""The engine's greedy tokens and teacher-forced logits on the GPU: paged kernel vs gather vs eager vs plain.

    python benchmarks/gpu_paged_step_check.py

Tiny random float32 models (tests/tiny.py), 8 prompts of different lengths,
64 greedy tokens each: the plain single-sequence loop, the engine's eager
paged graph, and the compiled paged step with attention "kernel" and
"gather". Prints, per pair, whether the tokens agree and where the first
difference is; then the max |logit diff| of 32 teacher-forced steps of the
kernel step against the gather step and the eager graph.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_paged_decode_step import STEPS, alone, prompts, run_engine  # noqa: E402
from test_paged_step_kernel import prefilled  # noqa: E402

from mlx_infer.artifacts.loader import load_model  # noqa: E402
from mlx_infer.engine.batch import DecodeBatch  # noqa: E402
from mlx_infer.generation.bindings.paged_decode_step import CompiledPagedDecodeStep, PagedDecodePolicy  # noqa: E402
from tiny import make_tiny_model_dir  # noqa: E402


def first_diff(a: list[list[int]], b: list[list[int]]) -> str:
    for r, (x, y) in enumerate(zip(a, b)):
        for i, (u, w) in enumerate(zip(x, y)):
            if u != w:
                return f"row {r} token {i}"
    return "none"


def main() -> None:
    print(f"device {mx.default_device()}")
    for family in ("llama", "gemma3"):
        loaded = load_model(make_tiny_model_dir(Path(tempfile.mkdtemp()) / family, family))
        ps = prompts(8)
        toks = {"plain": [alone(loaded, p, STEPS) for p in ps]}
        toks["eager"] = run_engine(loaded, ps, compiled=False)[0]
        for mode in ("kernel", "gather"):
            toks[mode] = run_engine(loaded, ps, compiled=True, policy=PagedDecodePolicy(attention=mode))[0]
        for a, b in (("kernel", "gather"), ("kernel", "eager"), ("gather", "eager"), ("eager", "plain"),
                     ("kernel", "plain")):
            print(f"{family}: tokens {a} == {b}: {toks[a] == toks[b]} (first diff: {first_diff(toks[a], toks[b])})")
        runs = {}
        for mode in ("kernel", "gather", "eager"):
            store, seqs = prefilled(loaded, ps)
            batch = DecodeBatch(store, seqs)
            runs[mode] = (batch, None if mode == "eager" else CompiledPagedDecodeStep(
                loaded.model, store, batch.group_windows(), policy=PagedDecodePolicy(attention=mode)))
        rng = np.random.default_rng(0)
        tokens = mx.array([p[-1] for p in ps], mx.uint32)
        worst = {"gather": 0.0, "eager": 0.0}
        argmax_same = {"gather": 0, "eager": 0}
        for _ in range(32):
            out = {}
            for mode, (batch, step) in runs.items():
                assert batch.reserve()
                out[mode] = (loaded.model(tokens[:, None], cache=batch.caches)[:, -1, :] if step is None
                             else step.step(tokens, batch))
                batch.commit()
            mx.eval(list(out.values()))
            for ref in worst:
                worst[ref] = max(worst[ref], mx.abs(out["kernel"] - out[ref]).max().item())
                argmax_same[ref] += int(mx.array_equal(mx.argmax(out["kernel"], -1), mx.argmax(out[ref], -1)).item())
            tokens = mx.array(rng.integers(5, 300, size=len(ps)), mx.uint32)
        print(f"{family}: teacher-forced max |kernel - gather| {worst['gather']:.3g}, |kernel - eager| "
              f"{worst['eager']:.3g}; argmax equal in {argmax_same} of 32 steps")


if __name__ == "__main__":
    main()
