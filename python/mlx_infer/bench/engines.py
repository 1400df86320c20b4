"""The engines a benchmark can drive, behind one small interface."""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx

from ..errors import MlxInferError


@dataclass
class TrialResult:
    """One timed run of one engine."""

    prompt_tps: float
    ttft_ms: float
    decode_tps: float
    peak_gb: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


class BenchEngine(Protocol):
    """Loads a model once, then runs trials on token-id prompts."""

    name: str

    def run(self, prompts: list[list[int]], generation_tokens: int, prefill_step_size: int) -> TrialResult: ...

    def close(self) -> None: ...


def _timed(prompt_tokens: int, batch: int, n: int, t0: float, t_first: float, t_end: float, peak: float) -> TrialResult:
    ttft = t_first - t0
    decode = t_end - t_first
    return TrialResult(
        prompt_tps=batch * prompt_tokens / ttft if ttft > 0 else 0.0,
        ttft_ms=ttft * 1e3,
        decode_tps=batch * (n - 1) / decode if n > 1 and decode > 0 else 0.0,
        peak_gb=peak,
    )


class MlxInferEngine:
    """mlx-infer's generation loop (batch 1) or static batch path (batch > 1).

    ``cpu_kernels=False`` (engine ``mlx-infer-stock``) keeps MLX's stock matmul
    and attention kernels instead of mlx-infer's CPU ones.
    """

    name = "mlx-infer"

    def __init__(self, model_path: str | None, dtype: str | None = None, cpu_kernels: bool | None = None):
        from ..artifacts.loader import load_model

        self.loaded = load_model(model_path, dtype=dtype, cpu_kernels=cpu_kernels)
        if cpu_kernels is False:
            self.name = "mlx-infer-stock"

    def run(self, prompts: list[list[int]], generation_tokens: int, prefill_step_size: int) -> TrialResult:
        from ..generation.autoregressive import generate_tokens
        from ..generation.static_batch import generate_batch

        mx.reset_peak_memory()
        t0 = time.perf_counter()
        if len(prompts) == 1:
            t_first = t0
            n = 0
            for t in generate_tokens(self.loaded.model, prompts[0], max_tokens=generation_tokens,
                                     prefill_step_size=prefill_step_size):
                n += 1
                if n == 1:
                    t_first = time.perf_counter()
            t_end = time.perf_counter()
            return _timed(len(prompts[0]), 1, n, t0, t_first, t_end, mx.get_peak_memory() / 1e9)
        _, stats = generate_batch(self.loaded.model, prompts, max_tokens=generation_tokens,
                                  prefill_step_size=prefill_step_size)
        t_first = t0 + stats.prefill_ms / 1e3
        return _timed(len(prompts[0]), len(prompts), generation_tokens, t0, t_first,
                      t_first + stats.decode_ms / 1e3, stats.peak_memory_gb)

    def close(self) -> None:
        del self.loaded
        gc.collect()


class MlxLmEngine:
    """mlx-lm's ``stream_generate`` (batch 1) or ``batch_generate`` (batch > 1)."""

    name = "mlx-lm"

    def __init__(self, model_dir: Path):
        try:
            from mlx_lm import load
        except ImportError:
            raise MlxInferError("--compare mlx-lm needs mlx-lm: pip install 'mlx-infer[bench]'.") from None
        self.model, self.tokenizer = load(str(model_dir))
        self.tokenizer._eos_token_ids = set()  # never stop early, as mlx_lm.benchmark does

    def run(self, prompts: list[list[int]], generation_tokens: int, prefill_step_size: int) -> TrialResult:
        from mlx_lm import batch_generate, stream_generate

        mx.reset_peak_memory()
        t0 = time.perf_counter()
        if len(prompts) == 1:
            n, t_first = 0, t0
            for _ in stream_generate(self.model, self.tokenizer, prompts[0], max_tokens=generation_tokens,
                                     prefill_step_size=prefill_step_size):
                n += 1
                if n == 1:
                    t_first = time.perf_counter()
            return _timed(len(prompts[0]), 1, n, t0, t_first, time.perf_counter(), mx.get_peak_memory() / 1e9)
        stats = batch_generate(self.model, self.tokenizer, prompts, max_tokens=generation_tokens,
                               prefill_step_size=prefill_step_size).stats
        # batch_generate reports its own split; use its prompt time for TTFT.
        t_first = t0 + stats.prompt_time
        return _timed(len(prompts[0]), len(prompts), generation_tokens, t0, t_first,
                      t_first + stats.generation_time, mx.get_peak_memory() / 1e9)

    def close(self) -> None:
        del self.model
        gc.collect()


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python, on the same GGUF (batch 1)."""

    name = "llama.cpp"

    def __init__(self, gguf_path: Path | None, n_ctx: int):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise MlxInferError("--compare llama.cpp needs llama-cpp-python: pip install llama-cpp-python.") from None
        if gguf_path is None:
            raise MlxInferError("--compare llama.cpp needs a GGUF model (pass --model FILE.gguf or use the default).")
        # llama-cpp-python defaults to cpu_count // 2 threads (1 on a 2-core machine); give it
        # as many as mlx-infer's CPU kernels use (physical cores), for prompt and decode alike.
        from .. import _fast

        threads = _fast.cpu_threads()
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, verbose=False, logits_all=False,
                         n_threads=threads, n_threads_batch=threads)

    def run(self, prompts: list[list[int]], generation_tokens: int, prefill_step_size: int) -> TrialResult:
        if len(prompts) != 1:
            raise MlxInferError("the llama.cpp engine runs batch 1 only.")
        self.llm.reset()
        t0 = time.perf_counter()
        n, t_first = 0, t0
        for _ in self.llm.generate(prompts[0], top_k=1, top_p=1.0, temp=0.0, reset=True):
            n += 1
            if n == 1:
                t_first = time.perf_counter()
            if n >= generation_tokens:
                break
        return _timed(len(prompts[0]), 1, n, t0, t_first, time.perf_counter(), 0.0)

    def close(self) -> None:
        del self.llm
        gc.collect()


ENGINES = ("mlx-infer", "mlx-infer-stock", "mlx-lm", "llama.cpp")


def make_engine(name: str, *, model: str | None, model_dir: Path, gguf_path: Path | None, n_ctx: int,
                dtype: str | None = None) -> Any:
    """Build an engine by name for the same model."""
    if name == "mlx-infer":
        return MlxInferEngine(model, dtype=dtype)
    if name == "mlx-infer-stock":
        return MlxInferEngine(model, dtype=dtype, cpu_kernels=False)
    if name == "mlx-lm":
        return MlxLmEngine(model_dir)
    if name == "llama.cpp":
        return LlamaCppEngine(gguf_path, n_ctx)
    raise MlxInferError(f"Unknown engine {name!r}; choose from {', '.join(ENGINES)}.")
