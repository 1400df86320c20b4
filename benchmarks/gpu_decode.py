"""Decode tokens/s on real model shapes with random weights: mlx-lm vs mlx-infer eager vs the compiled step.

    python benchmarks/gpu_decode.py --models gemma3-270m,llama-1b,llama-8b --batches 1,8,32 \
        --json benchmarks/results/h200-gpu-decode.json
    python benchmarks/gpu_decode.py --tiny            # CPU smoke run, tiny shapes

For each model shape: build our graph with random bf16 weights, save it as an
HF-style directory (config.json + safetensors) so mlx-lm loads the same
weights, then for each batch size warm every engine up and run ``--trials``
rounds alternating the engine order (A B C, C B A, ...); rows report medians.

Engines (``--engines``):

- ``mlx-lm``: ``generate_step`` at batch 1, ``batch_generate`` above;
- ``eager``: mlx-infer's loop (``generate_tokens`` / ``generate_batch``);
- ``step``: mlx-infer's eager prefill, then the C++ decode step
  (``CompiledDecodeStep``, default policy: on a GPU built per step at batch 1
  and ``mx.compile``-d from batch 2; on the CPU compiled always), pipelined as
  the loop is;
- ``compiled``: the C++ step, whole step ``mx.compile``-d at every batch size
  (masked attention over the fixed-size buffers);
- ``graph``: the C++ step built every step without the whole-step compile
  (exact-length KV views, no mask: the fused decode-attention kernel applies);
- ``step-fused`` / ``compiled-fused`` / ``graph-fused``: the same with q|k|v and
  gate|up fused into one matmul each;
- ``step-untuned``: ``step`` with MLX's own matmul for the dense products instead of
  ``_fast.tuned_linear`` (cuBLASLt's fastest algorithm per shape, on by default on CUDA).

After the trials it prints, per model and batch, the C++ step's per-step time
split (32 unpipelined steps, median): host graph build (``step()`` + argmax,
no evaluation), eval (``mx.eval``: kernel time plus the wait), and the sync of
reading the token back; and the same for the eager graph.

Prints the results schema JSON (``mlx_infer.bench.report.results_document``);
``--json PATH`` also writes it.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_infer.bench.report import results_document, write_json
from mlx_infer.generation.autoregressive import generate_tokens
from mlx_infer.generation.static_batch import generate_batch
from mlx_infer.generation.bindings.decode_step import CompiledDecodeStep
from mlx_infer.generation.bindings.graph_spec import DecodePolicy
from mlx_infer.models import get_model_classes

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict[str, Any]] = {
    "gemma3-270m": {
        "model_type": "gemma3_text", "hidden_size": 640, "num_hidden_layers": 18, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 2048, "vocab_size": 262144,
        "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "tie_word_embeddings": True,
    },
    "llama-1b": {
        "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256,
        "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "tie_word_embeddings": True,
    },
    "llama-8b": {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256,
        "rope_theta": 500000.0, "rope_scaling": {**LLAMA3_ROPE, "factor": 8.0}, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
    },
    # Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768, top 8) over 24 of its 48 layers: the whole model
    # saved for mlx-lm (61 GB of bf16) would not fit the GPU machine's 64 GiB disk; per-layer speed is the point.
    "qwen3-moe-a3b-24l": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "vocab_size": 151936,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
    # gpt-oss-20b's layer (hidden 2880, 64 query / 8 KV heads of 64, 32 experts of 2880, top 4, sinks, sliding
    # 128 / full alternating, YaRN) over 12 of its 24 layers: bf16 experts (the checkpoint's MXFP4 dequantized)
    # are 1.6 GB a layer, and the GPU holds both engines' copies.
    "gpt-oss-20b-12l": {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 12, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880, "num_local_experts": 32,
        "num_experts_per_tok": 4, "vocab_size": 201088, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 6, "swiglu_limit": 7.0,
        "rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 4096},
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    },
}

# --tiny: the same families at toy sizes, for a CPU smoke run.
TINY = {
    "gemma3-270m": dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=32, intermediate_size=128, vocab_size=1024, sliding_window=16,
                        sliding_window_pattern=3, query_pre_attn_scalar=32),
    "llama-1b": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, intermediate_size=128, vocab_size=1024),
    "llama-8b": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=16, intermediate_size=256, vocab_size=1024),
    "qwen3-moe-a3b-24l": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                              num_experts_per_tok=2, vocab_size=1024),
    "gpt-oss-20b-12l": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                            vocab_size=1024, sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
}

ENGINE_POLICIES = {
    "step": DecodePolicy(),  # the default: on a GPU per-step graph at batch 1, compiled from batch 2
    "step-fused": DecodePolicy(fuse_projections=True),
    "step-unfused": DecodePolicy(fuse_projections=False),  # A/B of the GPU default (fused in place)
    "compiled": DecodePolicy(compile=True, compile_min_batch=1),
    "graph": DecodePolicy(compile=False),
    "compiled-fused": DecodePolicy(compile=True, compile_min_batch=1, fuse_projections=True),
    "graph-fused": DecodePolicy(compile=False, fuse_projections=True),
    "step-untuned": DecodePolicy(tuned_products=False),  # A/B of the tuned products (the CUDA default)
}


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


# -- the model ---------------------------------------------------------------------------------------


def build_model(config: dict[str, Any], seed: int = 0, dtype: mx.Dtype = mx.bfloat16) -> Any:
    """Our graph with random weights (bfloat16 unless told), evaluated layer by layer."""
    model_cls, args_cls = get_model_classes(config["model_type"])
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(dtype)
    for part in [model.model.embed_tokens, *model.model.layers, model.model.norm,
                 *([model.lm_head] if hasattr(model, "lm_head") else [])]:
        mx.eval(part.parameters())
    return model


def save_hf_dir(model: Any, config: dict[str, Any], path: Path, shard_bytes: int = 4 << 30) -> None:
    """config.json + model-0000N.safetensors shards, the layout mlx-lm loads."""
    path.mkdir(parents=True, exist_ok=True)
    dtype = next(w.dtype for _, w in tree_flatten(model.parameters()) if mx.issubdtype(w.dtype, mx.floating))
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": str(dtype).split(".")[-1]}, indent=2))
    shard: dict[str, mx.array] = {}
    size, n = 0, 0
    for name, w in tree_flatten(model.parameters()):
        shard[name] = w
        size += w.nbytes
        if size >= shard_bytes:
            n += 1
            mx.save_safetensors(str(path / f"model-{n:05d}.safetensors"), shard, metadata={"format": "mlx"})
            shard, size = {}, 0
    if shard:
        n += 1
        mx.save_safetensors(str(path / f"model-{n:05d}.safetensors"), shard, metadata={"format": "mlx"})


# -- engines -------------------------------------------------------------------------------------------


class _NoTokenizer:
    """What mlx-lm's batch_generate reads of a tokenizer when nothing stops early."""

    eos_token_ids: list[int] = []

    @staticmethod
    def decode(ids: list[int]) -> str:
        return ""


def trial_row(prompt_tokens: int, batch: int, n: int, t0: float, t_first: float, t_end: float) -> dict[str, float]:
    ttft = t_first - t0
    dec = t_end - t_first
    return {"prompt_tps": batch * prompt_tokens / ttft if ttft > 0 else 0.0, "ttft_ms": ttft * 1e3,
            "decode_tps": batch * (n - 1) / dec if n > 1 and dec > 0 else 0.0,
            "peak_gb": mx.get_peak_memory() / 1e9}


class MlxLm:
    name = "mlx-lm"

    def __init__(self, path: Path):
        from mlx_lm.utils import load_model

        self.model, _ = load_model(path)

    def run(self, prompts: list[list[int]], gen: int) -> dict[str, float]:
        from mlx_lm.generate import batch_generate, generate_step

        mx.reset_peak_memory()
        if len(prompts) == 1:
            t0 = time.perf_counter()
            t_first, n = t0, 0
            for _ in generate_step(mx.array(prompts[0]), self.model, max_tokens=gen):
                n += 1
                if n == 1:
                    t_first = time.perf_counter()
            return trial_row(len(prompts[0]), 1, n, t0, t_first, time.perf_counter())
        stats = batch_generate(self.model, _NoTokenizer(), prompts, max_tokens=gen).stats
        return {"prompt_tps": stats.prompt_tps, "ttft_ms": stats.prompt_time * 1e3,
                "decode_tps": stats.generation_tps, "peak_gb": mx.get_peak_memory() / 1e9}


class Eager:
    name = "eager"

    def __init__(self, model: Any):
        self.model = model

    def run(self, prompts: list[list[int]], gen: int) -> dict[str, float]:
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        if len(prompts) == 1:
            t_first, n = t0, 0
            for _ in generate_tokens(self.model, prompts[0], max_tokens=gen):
                n += 1
                if n == 1:
                    t_first = time.perf_counter()
            return trial_row(len(prompts[0]), 1, n, t0, t_first, time.perf_counter())
        _, stats = generate_batch(self.model, prompts, max_tokens=gen)
        t_first = t0 + stats.prefill_ms / 1e3
        return trial_row(len(prompts[0]), len(prompts), gen, t0, t_first, t_first + stats.decode_ms / 1e3)


def eager_prefill(model: Any, tokens: mx.array, chunk: int = 2048) -> list[Any]:
    """The eager prefill of all but the last prompt token (what the loop does)."""
    cache = model.make_cache()
    L = tokens.shape[1]
    for start in range(0, L - 1, chunk):
        model.model(tokens[:, start:min(start + chunk, L - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


class Compiled:
    """Eager prefill, then the C++ step, pipelined: step n+1 is queued before token n is read."""

    def __init__(self, model: Any, name: str, policy: DecodePolicy):
        self.name = name
        self.model = model
        self.step = CompiledDecodeStep(model, policy=policy)  # reused: traces persist across trials

    def run(self, prompts: list[list[int]], gen: int) -> dict[str, float]:
        mx.reset_peak_memory()
        tokens = mx.array(prompts, dtype=mx.uint32)  # (B, L)
        t0 = time.perf_counter()
        cache = eager_prefill(self.model, tokens)
        y = mx.argmax(self.step.step(tokens[:, -1], cache), axis=-1)  # (B,)
        mx.async_eval(y)
        n, t_first = 0, t0
        while True:
            nxt = mx.argmax(self.step.step(y, cache), axis=-1) if n + 1 < gen else None
            if nxt is not None:
                mx.async_eval(nxt)
            y.tolist()  # what the loop hands to the caller
            n += 1
            if n == 1:
                t_first = time.perf_counter()
            if nxt is None:
                break
            y = nxt
        assert self.step.failures == 0, self.step.last_error
        return trial_row(len(prompts[0]), len(prompts), n, t0, t_first, time.perf_counter())


def breakdown(model: Any, prompts: list[list[int]], make_step: Callable[[list[Any]], Callable[[mx.array], mx.array]],
              n: int = 32) -> dict[str, float]:
    """Median per-step ms of graph build (no eval), eval, and reading the tokens back, unpipelined."""
    tokens = mx.array(prompts, dtype=mx.uint32)
    cache = eager_prefill(model, tokens)
    fn = make_step(cache)
    y = tokens[:, -1]
    builds, evals, syncs = [], [], []
    for i in range(n + 4):
        t0 = time.perf_counter()
        nxt = mx.argmax(fn(y), axis=-1)
        t1 = time.perf_counter()
        mx.eval(nxt)
        t2 = time.perf_counter()
        nxt.tolist()
        t3 = time.perf_counter()
        if i >= 4:
            builds.append(t1 - t0)
            evals.append(t2 - t1)
            syncs.append(t3 - t2)
        y = nxt
    med = lambda v: statistics.median(v) * 1e3  # noqa: E731
    return {"build_ms": med(builds), "eval_ms": med(evals), "sync_ms": med(syncs)}


# -- the run -------------------------------------------------------------------------------------------


def run_model(name: str, config: dict[str, Any], args: argparse.Namespace, rows: list[dict[str, Any]],
              splits: list[dict[str, Any]]) -> None:
    # float32 for a CPU smoke run: MLX's CPU gather_mm (mlx-lm's experts) takes float32 only.
    dtype = mx.float32 if args.tiny and mx.default_device() == mx.cpu else mx.bfloat16
    log(f"== {name}: building random {str(dtype).split('.')[-1]} weights")
    model = build_model(config, dtype=dtype)
    tmp = Path(tempfile.mkdtemp(prefix=f"gpu-decode-{name}-"))
    try:
        engines: list[Any] = []
        names = [e.strip() for e in args.engines.split(",") if e.strip()]
        if "mlx-lm" in names:
            save_hf_dir(model, config, tmp)
            engines.append(MlxLm(tmp))
        for e in names:
            if e == "eager":
                engines.append(Eager(model))
            elif e in ENGINE_POLICIES:
                engines.append(Compiled(model, e, ENGINE_POLICIES[e]))
            elif e != "mlx-lm":
                raise SystemExit(f"unknown engine {e!r}; choose from mlx-lm, eager, {', '.join(ENGINE_POLICIES)}")
        for batch in args.batch_sizes:
            key = mx.random.key(args.seed)
            prompts = mx.random.randint(0, config["vocab_size"], (batch, args.prompt_tokens), key=key).tolist()
            for e in engines:  # warm-up: kernels, compiled traces, allocator
                e.run(prompts, min(8, args.generation_tokens))
            trials: dict[str, list[dict[str, float]]] = {e.name: [] for e in engines}
            for t in range(args.trials):
                for e in (engines if t % 2 == 0 else engines[::-1]):
                    r = e.run(prompts, args.generation_tokens)
                    trials[e.name].append(r)
                    log(f"  {name} b={batch} {e.name:15s} trial {t}: decode {r['decode_tps']:8.1f} tok/s  "
                        f"ttft {r['ttft_ms']:8.1f} ms")
                    gc.collect()
            ref = trials.get("mlx-lm")
            for e in engines:
                ts = trials[e.name]
                row: dict[str, Any] = {"suite": "gpu-decode", "model": name + ("-tiny" if args.tiny else ""),
                                       "engine": e.name, "batch": batch, "prompt_tokens": args.prompt_tokens,
                                       "generation_tokens": args.generation_tokens, "trials": ts}
                for m in ("prompt_tps", "ttft_ms", "decode_tps", "peak_gb"):
                    vals = [t[m] for t in ts]
                    row[m], row[f"{m}_min"], row[f"{m}_max"] = statistics.median(vals), min(vals), max(vals)
                if ref is not None and e.name != "mlx-lm":
                    ratios = [a["decode_tps"] / b["decode_tps"] for a, b in zip(ts, ref) if b["decode_tps"] > 0]
                    row["ratio_vs_mlx-lm"] = {"decode_tps": ratios,
                                              "decode_tps_median": statistics.median(ratios) if ratios else 0.0}
                rows.append(row)
            for e in engines:
                if isinstance(e, Compiled):
                    s = breakdown(model, prompts, lambda cache, e=e: (lambda y: e.step.step(y, cache)))
                    splits.append({"model": name, "batch": batch, "engine": e.name, **s,
                                   "traces": e.step.traces})
                elif isinstance(e, Eager):
                    s = breakdown(model, prompts,
                                  lambda cache: (lambda y: model(y.reshape(-1, 1), cache=cache)[:, -1, :]))
                    splits.append({"model": name, "batch": batch, "engine": "eager", **s})
        for e in engines:
            if isinstance(e, Compiled):
                e.step.close()
        del engines
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        del model
        gc.collect()
        mx.clear_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gemma3-270m,llama-1b,llama-8b")
    p.add_argument("--batches", default="1,8,32", help="batch sizes, comma list")
    p.add_argument("--engines", default="mlx-lm,eager,step",
                   help=f"comma list of mlx-lm, eager, {', '.join(ENGINE_POLICIES)}")
    p.add_argument("--prompt-tokens", "-p", type=int, default=512)
    p.add_argument("--generation-tokens", "-g", type=int, default=128)
    p.add_argument("--trials", "-n", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="toy shapes (CPU smoke run); -p 64 -g 32 unless given")
    p.add_argument("--json", default=None, help="also write the results JSON here")
    args = p.parse_args()
    if args.tiny and "--prompt-tokens" not in sys.argv and "-p" not in sys.argv:
        args.prompt_tokens = 64
    if args.tiny and "--generation-tokens" not in sys.argv and "-g" not in sys.argv:
        args.generation_tokens = 32
    args.batch_sizes = [int(b) for b in args.batches.split(",")]
    log(f"device: {mx.default_device()}")
    rows: list[dict[str, Any]] = []
    splits: list[dict[str, Any]] = []
    for name in (m.strip() for m in args.models.split(",") if m.strip()):
        if name not in SHAPES:
            raise SystemExit(f"unknown model {name!r}; choose from {', '.join(SHAPES)}")
        config = dict(SHAPES[name], **(TINY[name] if args.tiny else {}))
        run_model(name, config, args, rows, splits)
    doc = results_document(rows)
    doc["step_breakdown_ms"] = splits
    print(json.dumps(doc, indent=2))
    log("\nmodel          batch engine           decode tok/s   x mlx-lm")
    for r in rows:
        ratio = r.get("ratio_vs_mlx-lm", {}).get("decode_tps_median")
        log(f"{r['model']:14s} {r['batch']:5d} {r['engine']:15s} {r['decode_tps']:12.1f}   "
            + (f"{ratio:.2f}" if ratio else "-"))
    log("\nper-step split (ms, unpipelined): model batch engine build eval sync")
    for s in splits:
        log(f"{s['model']:14s} {s['batch']:5d} {s['engine']:15s} {s['build_ms']:7.2f} {s['eval_ms']:8.2f} "
            f"{s['sync_ms']:6.3f}")
    if args.json:
        write_json(doc, Path(args.json))


if __name__ == "__main__":
    main()
