"""Each quantized product of a shape's layer, once per engine and row count, for Nsight Compute to time (issue 17).

products.py times products back to back from the host, where a product of a few microseconds is bounded by
MLX's encoding of it, not by the GPU; this runs each once (after a warm-up outside the profiled range) so that
``ncu`` reports every kernel's own device time and DRAM bytes, and ``--summarize`` prints them per product as
TB/s of the packed weights:

    ncu --csv --profile-from-start off --cache-control all --clock-control none \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum --log-file q.csv \\
        python benchmarks/quantized_kernels.py --shape llama-8b --ms 1,2,8
    python benchmarks/quantized_kernels.py --summarize q.csv

Engines: ``mlx`` (``mx.quantized_matmul``), ``ours`` (``_fast.quantized_gemv``, cpp/matmul/qgemv_cuda.cpp, its default
form for the rows) and, at 1-4 rows, where that default is the CUDA-core form, ``ours-mma`` (the tensor-core form).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode import SHAPES  # noqa: E402
from kernel_times import profiler  # noqa: E402
from products import STEP, layer_products  # noqa: E402

from mlx_infer import _fast  # noqa: E402


def run(shape: str, ms: list[int], bits_list: list[int], group_size: int) -> list[str]:
    """Run every (product, bits, M, engine) once inside the profiled range; the labels in launch order."""
    labels = []
    prods = {n: v for n, v in layer_products(SHAPES[shape]).items() if n in STEP["mlx"] + ("head",)}
    for name, (out, inp) in prods.items():
        w = mx.random.normal((out, inp)).astype(mx.bfloat16) * 0.02
        for bits in bits_list:
            q = mx.quantize(w, group_size=group_size, bits=bits)
            for m in ms:
                x = mx.random.normal((m, inp)).astype(mx.bfloat16)
                fns = {"mlx": lambda: mx.quantized_matmul(x, *q, transpose=True, group_size=group_size, bits=bits),
                       "ours": lambda: _fast.quantized_gemv(x, *q, group_size=group_size, bits=bits)}
                mma = _fast.default_qgemv_tiling(max(m, 5), out, inp, bits, mx.bfloat16)  # the tensor-core form's
                if m <= 4 and mma[3]:  # where the default is the CUDA-core form: the tensor-core form beside it
                    fns["ours-mma"] = lambda: _fast.quantized_gemv(x, *q, group_size=group_size, bits=bits,
                                                                   tiling=mma[:3], mma=True)
                for engine, fn in fns.items():
                    mx.eval(q, x)
                    mx.eval(fn())  # compiles ours (NVRTC) outside the profiled range
                    mx.synchronize()
                    profiler(True)
                    mx.eval(fn())
                    mx.synchronize()
                    profiler(False)
                    labels.append(f"{name} {bits}-bit M={m} {engine} ({out}x{inp}, "
                                  f"{out * inp * (bits / 8 + 4 / group_size) / 1e6:.1f} MB)")
    return labels


def summarize(path: Path, labels_path: Path) -> None:
    """Per launch: label, kernel, microseconds, TB/s of DRAM read."""
    rows: dict[str, dict[str, str]] = {}
    with path.open() as f:
        for r in csv.DictReader(line for line in f if line.startswith('"')):
            rows.setdefault(r["ID"], {"kernel": r["Kernel Name"].split("(")[0][:60]})[r["Metric Name"]] = \
                r["Metric Value"].replace(",", "")
    labels = labels_path.read_text().splitlines()
    launches = sorted(rows.items(), key=lambda kv: int(kv[0]))
    print(f"{len(launches)} kernels profiled for {len(labels)} products")
    if len(launches) != len(labels):  # a product launched more (or fewer) than one kernel: no labels
        labels = [f"kernel {i}" for i in range(len(launches))]
    for label, (_, r) in zip(labels, launches):
        us = float(r["gpu__time_duration.sum"]) / 1e3
        gb = float(r.get("dram__bytes_read.sum", 0)) / 1e9
        print(f"{label:58} {us:9.1f} us {gb / us * 1e6 / 1e3 if us else 0:6.2f} TB/s  {r['kernel']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    p.add_argument("--ms", default="1,2,8")
    p.add_argument("--bits", default="4,8")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--labels", default="quantized_kernels.labels", help="where the launch labels go (or come from)")
    p.add_argument("--summarize", metavar="CSV", help="print an ncu CSV of a run with its labels")
    args = p.parse_args()
    if args.summarize:
        summarize(Path(args.summarize), Path(args.labels))
        return
    labels = run(args.shape, [int(v) for v in args.ms.split(",")], [int(v) for v in args.bits.split(",")],
                 args.group_size)
    Path(args.labels).write_text("\n".join(labels) + "\n")


if __name__ == "__main__":
    main()
