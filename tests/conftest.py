"""Shared fixtures. The real-model ones are session-scoped: loading the GGUF into
transformers takes ~45 s here, so each oracle is built once per test run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The suite compares against mlx-lm bit for bit, which needs MLX's stock kernels (the
# default); the CPU kernels are tested where they are asked for explicitly
# (tests/test_cpu_kernels.py, load_model(..., cpu_kernels=True)). Subprocesses inherit this.
os.environ["MLX_INFER_CPU_KERNELS"] = "0"
# On CUDA, MLX rounds float32 products to TF32 by default (MLX_ENABLE_TF32, read once per process): a 10-bit
# mantissa whose rounding depends on the product's kernel, so a row batched with 7 others (a GEMM) and the same
# row alone (a GEMV) part after a few dozen greedy tokens of the tiny float32 models (the H200, session 14:
# tests/test_paged_decode_step.py's 8-row llama case, eager paged against alone, token 35). The suite's
# greedy-equality contracts are float32's; bf16 serving numerics are the benchmarks'. Subprocesses inherit it.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

if os.environ.get("MLX_INFER_CRASH_BACKTRACE") == "1":  # a native stack on a fatal signal (device runs)
    from mlx_infer import _fast

    _fast.install_crash_backtrace()


@pytest.fixture(scope="session")
def mlx_infer_cache(tmp_path_factory) -> Path:
    """A private mlx-infer cache for this test run (converted models land here)."""
    path = tmp_path_factory.mktemp("mlx-infer-cache")
    os.environ["MLX_INFER_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    """The real Gemma 3 270M GGUF (Q4_K_M) from the default-model package."""
    from mlx_infer.artifacts.default_model import default_model_gguf

    return default_model_gguf()


@pytest.fixture(scope="session")
def real_model(real_gguf, mlx_infer_cache):
    """Our load of the real model: the GGUF dequantized to float32, converted once."""
    from mlx_infer.artifacts.loader import load_model

    return load_model(real_gguf)


@pytest.fixture(scope="session")
def hf_gguf_model(real_gguf):
    """transformers' Gemma3ForCausalLM from the same GGUF, float32 (the reference implementation)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": real_gguf.name}
    model = AutoModelForCausalLM.from_pretrained(str(real_gguf.parent), torch_dtype=torch.float32, **kwargs)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(real_gguf.parent), **kwargs)
    return model, tokenizer
