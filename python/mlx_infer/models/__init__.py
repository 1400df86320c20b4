"""Model families, found by a checkpoint's ``model_type`` through one alias table.

Each family is one module with ``ModelArgs`` (``from_dict`` ignores unknown
keys) and ``Model`` (an ``nn.Module`` satisfying :class:`mlx_infer.contracts.Graph`).
"""

from __future__ import annotations

import importlib

from ..errors import UnsupportedModelError

#: ``config.json`` ``model_type`` -> family module in this package.
MODEL_TYPE_ALIASES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "gemma4": "gemma4",
    "gemma4_text": "gemma4",
    "diffusion_gemma": "diffusion_gemma",
    "diffusion_gemma_text": "diffusion_gemma",
}

#: Every ``model_type`` that has a graph here, sorted.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(MODEL_TYPE_ALIASES))


def family_of(model_type: str) -> str:
    """The family module name serving ``model_type``.

    Raises:
        UnsupportedModelError: ``model_type`` has no graph here.
    """
    family = MODEL_TYPE_ALIASES.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"Model type {model_type!r} is not supported. Supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    return family


def get_model_classes(model_type: str) -> tuple[type, type]:
    """The ``(Model, ModelArgs)`` classes for a checkpoint's ``model_type``.

    Args:
        model_type: the ``model_type`` of ``config.json`` (e.g. ``"qwen3"``).

    Returns:
        ``(ModelClass, ModelArgsClass)`` of the family module.

    Raises:
        UnsupportedModelError: ``model_type`` has no graph here; the message
            names the supported ones.
    """
    module = importlib.import_module(f".{family_of(model_type)}", __name__)
    return module.Model, module.ModelArgs


__all__ = ["MODEL_TYPE_ALIASES", "SUPPORTED_MODEL_TYPES", "family_of", "get_model_classes"]
