"""Model families, found by a checkpoint's ``model_type`` through one alias table.

Each family is one module with ``ModelArgs`` (``from_dict`` ignores unknown
keys) and ``Model`` (an ``nn.Module`` satisfying :class:`mlx_infer.contracts.Graph`).
``Model`` declares its family once, as the class attribute ``family`` (the
module's name: ``family = "llama"`` also serves ``mistral``, ``qwen2``, ``qwen3``);
:func:`graph_family` is the one place that reads it.
The scaffolding they share (decoder stack, LM head, ``sanitize``, caches, the
RoPE-then-cache step) is in :mod:`mlx_infer.models.base`; ``schema`` checks configs.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import UnsupportedModelError

#: ``config.json`` ``model_type`` -> family module in this package.
MODEL_TYPE_ALIASES: dict[str, str] = {
    "glm4": "glm4",
    "gpt_oss": "gpt_oss",
    "granite": "granite",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "qwen3_moe": "qwen3_moe",
    "smollm3": "smollm3",
    "gemma2": "gemma2",
    "olmo2": "olmo2",
    "phi3": "phi3",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "gemma4": "gemma4",
    "gemma4_text": "gemma4",
    "deepseek_v3": "deepseek_v3",
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


def graph_family(model: Any) -> str:
    """The family of a graph (instance or class): its ``family`` class attribute.

    Subclasses inherit it, so the wrappers that re-class a graph (tensor and
    pipeline parallel, adapters) keep their family; a family that subclasses
    another's ``Model`` declares its own.

    Raises:
        UnsupportedModelError: the class declares no family (the message names
            the class and the fix).
    """
    cls = model if isinstance(model, type) else type(model)
    family = getattr(cls, "family", None)
    if not isinstance(family, str) or not family:
        raise UnsupportedModelError(
            f"{cls.__module__}.{cls.__qualname__} declares no model family; add a class attribute "
            f"such as `family = \"llama\"` to it (the family module's name, see mlx_infer/models/).")
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


def graph_constants(model: nn.Module) -> list[mx.array]:
    """Every array a graph's modules hold that is not a parameter (RoPE frequency tables, ...).

    Walks every module, its entries (``_freqs`` and other private keys that
    ``parameters()`` leaves out) and its plain attributes, looking inside lists,
    tuples and dicts; each array is listed once.
    """
    params = {id(v) for _, v in tree_flatten(model.parameters())}
    seen: set[int] = set()
    found: list[mx.array] = []

    def collect(value: Any) -> None:
        if isinstance(value, nn.Module):
            return  # walked on its own
        if isinstance(value, mx.array):
            if id(value) not in params and id(value) not in seen:
                seen.add(id(value))
                found.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                collect(v)
        elif isinstance(value, dict):
            for v in value.values():
                collect(v)

    for _, module in model.named_modules():
        for v in module.values():
            collect(v)
        for v in vars(module).values():
            collect(v)
    return found


def materialize_graph_constants(model: nn.Module) -> None:
    """Evaluate the graph's non-parameter arrays now, on the loading thread.

    MLX streams belong to the thread that made them: an array left lazy here
    (a RoPE table built by a module's ``__init__``) cannot be evaluated by
    another thread (the engine's), which fails with ``There is no Stream(cpu, 0)
    in current thread``. Evaluated arrays carry no stream and any thread can
    read them. Every graph the loader builds goes through this.
    """
    constants = graph_constants(model)
    if constants:
        mx.eval(constants)


__all__ = ["MODEL_TYPE_ALIASES", "SUPPORTED_MODEL_TYPES", "family_of", "get_model_classes", "graph_constants",
           "graph_family", "materialize_graph_constants"]
