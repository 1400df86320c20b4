"""Where a decode step's device time goes, kernel by kernel (CUDA, under Nsight Compute).

    ncu --csv --profile-from-start off --metrics gpu__time_duration.sum --log-file engine.csv \
        python benchmarks/kernel_times.py --shape llama-8b --engine engine --streams 1
    ncu ... --log-file mlx-lm.csv python benchmarks/kernel_times.py --shape llama-8b --engine mlx-lm
    python benchmarks/kernel_times.py --summarize engine.csv mlx-lm.csv --steps 4

The run mode builds random bf16 weights of a real shape (served.py's), decodes B greedy streams of a
512-token prompt through the engine (the compiled paged step, ids only) or one stream through mlx-lm's
``generate_step``, and after a warm-up opens the profiler (``cuProfilerStart``) for ``--steps`` decode
steps only. Nsight Compute then times each kernel alone (serialized: the sum is the device's busy time,
without the gaps between kernels or the host). The summarize mode folds each CSV into kernel kinds per
step (count, microseconds) and prints the files side by side: the per-kernel split of issue 16's
1-stream goal against ``generate_step``.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import gzip
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

#: Kernel kinds by a pattern of the (demangled) kernel name, first match wins.
KINDS = (
    ("gemv (ours)", r"skinny|gemv_tc|mlx_infer_gemv"),
    ("gemv (MLX)", r"gemv"),
    ("gemm (cuBLAS)", r"gemm|sm90_xmma|cutlass|cublas"),
    ("attention", r"paged|sdpa|attention|flash|lean_reduction"),
    ("rms norm", r"rms"),
    ("rope", r"rope"),
    ("scatter / kv write", r"scatter|kv_write|slot"),
    ("gather", r"gather"),
    ("copy", r"copy"),
    ("reduce / argmax / logsumexp", r"reduce|arg_|logsumexp"),
    ("fused silu * up (compiled)", r"sigmoid"),
    ("index math (slots)", r"floordivide|remainder|arange"),
    ("elementwise", r"binary|unary|ternary"),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other: " + name.split("(")[0].split("<")[0][-40:]


def summarize(path: Path, steps: int, by_name: bool = False) -> dict[str, tuple[float, float]]:
    """{kind (or kernel name): (kernels per step, microseconds per step)} from an ncu --csv log."""
    count: dict[str, int] = defaultdict(int)
    micros: dict[str, float] = defaultdict(float)
    with (gzip.open(path, "rt", newline="") if path.suffix == ".gz" else open(path, newline="")) as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own ==PROF== lines are not CSV
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "nsecond")
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}.get(unit, 1e-3)
        kind = row["Kernel Name"][:110] if by_name else kind_of(row["Kernel Name"])
        count[kind] += 1
        micros[kind] += value * scale
    return {k: (count[k] / steps, micros[k] / steps) for k in count}


def print_summaries(paths: list[Path], steps: int) -> None:
    tables = [summarize(p, steps) for p in paths]
    kinds = sorted({k for t in tables for k in t}, key=lambda k: -max(t.get(k, (0, 0))[1] for t in tables))
    head = "".join(f" | {p.name.split('.')[0]:>24}" for p in paths)
    print(f"{'kind (per step: kernels, us)':<34}{head}")
    for k in kinds:
        cells = "".join(f" | {t.get(k, (0, 0))[0]:>7.1f} {t.get(k, (0, 0))[1]:>9.1f} us" for t in tables)
        print(f"{k:<34}{cells}")
    totals = "".join(f" | {sum(n for n, _ in t.values()):>7.1f} {sum(u for _, u in t.values()):>9.1f} us"
                     for t in tables)
    print(f"{'total':<34}{totals}")
    for path in paths:
        names = summarize(path, steps, by_name=True)
        print(f"\n{path.name.split('.')[0]}: the 15 dearest kernels (per step: count, us)")
        for name, (n, us) in sorted(names.items(), key=lambda kv: -kv[1][1])[:15]:
            print(f"  {n:>6.1f} {us:>9.1f}  {name}")


def profiler(on: bool) -> None:
    cuda = ctypes.CDLL("libcuda.so.1")
    rc = cuda.cuProfilerStart() if on else cuda.cuProfilerStop()
    if rc != 0:
        raise RuntimeError(f"cuProfiler{'Start' if on else 'Stop'} returned {rc}")


def run(shape: str, engine: str, streams: int, steps: int, prompt_len: int) -> None:
    import mlx.core as mx

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from served_models import prompts_for, shape_dir

    path = shape_dir(shape, False, Path(tempfile.mkdtemp()))
    if engine == "mlx-lm":
        from mlx_lm.generate import generate_step
        from mlx_lm.utils import load_model as load_mlx_lm

        model = load_mlx_lm(path)[0]
        prompt = prompts_for(1, prompt_len, model.args.vocab_size)[0]
        for n, _ in enumerate(generate_step(mx.array(prompt, mx.uint32), model, max_tokens=40 + steps)):
            if n == 30:
                mx.synchronize()
                profiler(True)
            if n == 30 + steps:
                mx.synchronize()
                profiler(False)
        return
    from mlx_infer.artifacts.loader import load_model
    from mlx_infer.engine import Engine, EngineRequest
    from mlx_infer.engine.scheduler import DECODE

    loaded = load_model(path)
    e = Engine(loaded)
    for p in prompts_for(streams, prompt_len, loaded.model.args.vocab_size):
        e.submit(EngineRequest(prompt_ids=p, max_tokens=60 + steps, ignore_eos=True, detokenize=False))
    while not (len(e.scheduler.running) == streams and all(r.state == DECODE for r in e.scheduler.running)):
        e.step()
    for _ in range(20):
        e.step()
    mx.synchronize()
    profiler(True)
    for _ in range(steps):
        e.step()
    mx.synchronize()
    profiler(False)
    e.run_until_idle()
    e.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-8b")
    p.add_argument("--engine", choices=["engine", "mlx-lm"], default="engine")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="decode steps inside the profiled window")
    p.add_argument("--prompt-tokens", "-p", type=int, default=512)
    p.add_argument("--summarize", nargs="+", default=None, metavar="CSV", help="fold ncu CSV logs instead")
    args = p.parse_args()
    if args.summarize:
        print_summaries([Path(s) for s in args.summarize], args.steps)
    else:
        run(args.shape, args.engine, args.streams, args.steps, args.prompt_tokens)


if __name__ == "__main__":
    main()
