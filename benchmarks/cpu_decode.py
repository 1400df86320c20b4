"""CPU decode and prompt throughput: mlx-infer's CPU kernels vs MLX's stock kernels, mlx-lm and llama.cpp.

    python benchmarks/cpu_decode.py --json benchmarks/results/cpu-decode.json

One process, one run: every engine is loaded once and warmed up, then the
engines alternate trial by trial (A B C ..., then ... C B A) and each row
reports the median of ``-n`` trials (batch 1, a random ``-p``-token prompt,
``-g`` generated tokens, greedy). Engines:

    llama.cpp                   llama-cpp-python on the GGUF itself (the default: Q4_K_M),
                                as many threads as mlx-infer's kernels (physical cores)
    mlx-infer [V]               mlx-infer with its CPU kernels (load_model(cpu_kernels=True))
    mlx-infer [V, avx512vnni]   the same with the opt-in int8-activation quantized GEMV
    mlx-infer-stock [V]         mlx-infer with MLX's stock kernels (cpu_kernels=False)
    mlx-lm [V]                  mlx-lm's stream_generate

on MLX variants V of the same model: ``f32`` (the GGUF dequantized, as
mlx-infer loads it), ``bf16``, ``4bit`` (affine 4-bit, group 64, bfloat16
scales and activations) and ``4bit-f32`` (the same 4-bit weights with float32
scales and activations), written once into the mlx-infer cache by
``artifacts.convert``. MLX's stock CPU kernels run ``4bit`` at ~0.5 tok/s
(bfloat16 accumulation in scalar code), so the stock and mlx-lm rows use
``4bit-f32``, where they reach MLX's usual ~4 tok/s.
The document's ``summary`` gives each engine's decode and prompt tokens/s as a
fraction of llama.cpp's (median of per-trial ratios).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_infer.artifacts.convert import convert
from mlx_infer.artifacts.default_model import cache_dir, default_model_gguf
from mlx_infer.artifacts.loader import converted_gguf_dir
from mlx_infer import _fast
from mlx_infer.bench import BenchConfig, make_engine, results_document, run_bench, write_markdown
from mlx_infer.bench.engines import MlxInferEngine
from mlx_infer.bench.report import write_json, write_plot
from mlx_infer.bench.runner import model_facts
from mlx_infer.layers.linear import cpu_kernel_info

VARIANTS = ("f32", "bf16", "4bit", "4bit-f32")


def variant_dir(gguf: Path, variant: str) -> Path:
    """The MLX directory of one variant of the GGUF's model (converted once, cached)."""
    base = converted_gguf_dir(gguf)
    if variant == "f32":
        return base
    out = cache_dir() / "bench" / f"{base.name}-{variant}"
    if not (out / "config.json").is_file():
        kwargs: dict[str, Any] = {"dtype": "float32" if variant.endswith("-f32") else "bfloat16"}
        if variant.startswith("4bit"):
            kwargs["quantize_bits"] = 4
        convert(base, out, overwrite=True, progress=False, **kwargs)
    return out


class IsaEngine:
    """An mlx-infer engine whose trials run with the CPU kernels forced to one instruction set."""

    def __init__(self, inner: MlxInferEngine, isa: str):
        self.inner, self.isa = inner, isa
        self.name = inner.name

    def run(self, *args: Any) -> Any:
        _fast.set_cpu_kernel_isa(self.isa)
        try:
            return self.inner.run(*args)
        finally:
            _fast.set_cpu_kernel_isa("")

    def close(self) -> None:
        self.inner.close()


def _vnni_available() -> bool:
    try:
        _fast.set_cpu_kernel_isa("avx512vnni")
    except ValueError:
        return False
    _fast.set_cpu_kernel_isa("")
    return True


def _list(text: str) -> list[str]:
    items = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in items if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    return items


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded Gemma 3 270M)")
    p.add_argument("--fast", default="bf16,4bit,4bit-f32", help="variants for mlx-infer with its CPU kernels")
    p.add_argument("--vnni", default="4bit", help="variants for mlx-infer with the opt-in avx512vnni kernels "
                                                  "(skipped where the CPU lacks AVX-512 VNNI)")
    p.add_argument("--stock", default="4bit-f32", help="variants for mlx-infer with MLX's stock kernels")
    p.add_argument("--mlx-lm", default="bf16,4bit-f32", help="variants for mlx-lm ('' for none)")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    p.add_argument("--prompt-tokens", "-p", type=int, default=512)
    p.add_argument("--generation-tokens", "-g", type=int, default=128)
    p.add_argument("--num-trials", "-n", type=int, default=3)
    p.add_argument("--json", default=None, help="write the results document here")
    p.add_argument("--markdown", default=None, help="write a markdown table here")
    p.add_argument("--plot", default=None, help="write a PNG here")
    args = p.parse_args()

    gguf = Path(args.model).expanduser() if args.model else default_model_gguf()
    n_ctx = args.prompt_tokens + args.generation_tokens + 16
    engines: list[Any] = []

    def add(kind: str, variant: str | None, isa: str | None = None) -> None:
        model_dir = variant_dir(gguf, variant) if variant else converted_gguf_dir(gguf)
        if kind == "mlx-infer":  # explicit: the CPU kernels whatever MLX_INFER_CPU_KERNELS says
            e: Any = MlxInferEngine(str(model_dir), cpu_kernels=True)
        else:
            e = make_engine(kind, model=str(model_dir), model_dir=model_dir, gguf_path=gguf, n_ctx=n_ctx)
        if variant:
            e.name = f"{e.name} [{variant}{', ' + isa if isa else ''}]"
        if isa:
            e = IsaEngine(e, isa)
        engines.append(e)
        print(f"loaded {e.name}", file=sys.stderr, flush=True)

    if not args.no_llama_cpp:
        add("llama.cpp", None)
    for v in _list(args.fast):
        add("mlx-infer", v)
    if _vnni_available():
        for v in _list(args.vnni):
            add("mlx-infer", v, "avx512vnni")
    for v in _list(args.stock):
        add("mlx-infer-stock", v)
    for v in _list(args.mlx_lm):
        add("mlx-lm", v)

    _, vocab = model_facts(converted_gguf_dir(gguf))
    config = BenchConfig(prompt_tokens=args.prompt_tokens, generation_tokens=args.generation_tokens,
                         num_trials=args.num_trials, suite="cpu-decode")
    rows = run_bench(engines, config, model_name=gguf.stem, vocab_size=vocab)

    doc = results_document(rows)
    doc["cpu_kernels"] = cpu_kernel_info()
    ref = next((r for r in rows if r["engine"] == "llama.cpp"), None)
    if ref is not None:
        summary = {}
        for r in rows:
            if r is ref:
                continue
            pairs = list(zip(ref["trials"], r["trials"]))
            summary[r["engine"]] = {
                "decode_vs_llama_cpp": statistics.median(b["decode_tps"] / a["decode_tps"] for a, b in pairs),
                "prompt_vs_llama_cpp": statistics.median(b["prompt_tps"] / a["prompt_tps"] for a, b in pairs),
            }
        doc["summary"] = summary
    # Ours against mlx-lm on the same MLX variant (the compiled-decode issue's ratio).
    by_name = {r["engine"]: r for r in rows}
    for r in rows:
        if not r["engine"].startswith("mlx-infer") or "[" not in r["engine"]:
            continue
        variant = r["engine"].split("[", 1)[1].split(",")[0].rstrip("]")
        lm = by_name.get(f"mlx-lm [{variant}]")
        if lm is None:
            continue
        pairs = list(zip(lm["trials"], r["trials"]))
        s = doc.setdefault("summary", {}).setdefault(r["engine"], {})
        s["decode_vs_mlx_lm"] = statistics.median(b["decode_tps"] / a["decode_tps"] for a, b in pairs)
        s["prompt_vs_mlx_lm"] = statistics.median(b["prompt_tps"] / a["prompt_tps"] for a, b in pairs)
    print(write_markdown(doc, Path(args.markdown) if args.markdown else None))
    for name, s in doc.get("summary", {}).items():
        parts = [f"{k.replace('_vs_', ' ').replace('_', '.')} {v:.2f}x" for k, v in s.items()]
        print(f"{name:32s} " + "   ".join(parts))
    if args.json:
        write_json(doc, Path(args.json))
    if args.plot:
        write_plot(doc, Path(args.plot))
    for e in engines:
        e.close()
    mx.clear_cache()


if __name__ == "__main__":
    main()
