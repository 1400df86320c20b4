"""``mlx-infer fuse``: merge an adapter into a model directory, as ``mlx_lm.fuse`` does.

Per target, with mlx-lm's ops (``LoRALinear.fuse`` / ``DoRALinear.fuse``), so the output's
tensors equal ``mlx_lm.fuse``'s::

    LoRA   W' = W + ((scale * b^T) @ a^T).astype(W.dtype)
    DoRA   W' = W + (scale * b^T @ a^T).astype(W.dtype);  W' = (m / ||W'|| per row)[:, None] * W'

``W`` is dequantized first for a quantized layer and the result quantized again with the
layer's own group size, bits and mode (``dequantize=True``: the whole model is written
dense and the config loses its quantization keys). Everything else is copied as it is.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .apply import dequantized_weight
from .formats import LoraTarget, load_adapter

#: Files of the source directory copied beside the fused weights (tokenizer and generation settings).
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
          "tokenizer.model", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt")


def fused_weight(module: nn.Module, t: LoraTarget) -> mx.array:
    """The dense fused weight ``(out, in)`` of ``module`` with ``t`` merged in."""
    w = dequantized_weight(module)
    if t.m is None:
        return w + ((t.scale * t.b.T) @ t.a.T).astype(w.dtype)
    w = w + ((t.scale * t.b.T) @ t.a.T).astype(w.dtype)
    norm_scale = t.m / mx.linalg.norm(w, axis=1)
    return norm_scale[:, None] * w


def fuse_adapter(model_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path, *,
                 dequantize: bool = False, overwrite: bool = False) -> Path:
    """Write ``model_dir`` with ``adapter_dir`` merged into ``out_dir``; returns ``out_dir``.

    Raises:
        ModelLoadError / AdapterError: the model or adapter cannot be loaded or do not fit.
        MlxInferError: ``out_dir`` is not ours to replace (see ``write_mlx_dir``).
    """
    from ..artifacts.convert import write_mlx_dir
    from ..artifacts.loader import load_model

    src = Path(model_dir).expanduser()
    loaded = load_model(src, cpu_kernels=False)
    model = loaded.model
    adapter = load_adapter(adapter_dir, model)
    modules = dict(model.named_modules())
    weights = dict(tree_flatten(model.parameters()))
    for key, t in adapter.targets.items():
        module = modules[key]
        w = fused_weight(module, t)
        quantized = isinstance(module, nn.QuantizedLinear)
        for leaf in ("weight", "scales", "biases"):
            weights.pop(f"{key}.{leaf}", None)
        if quantized and not dequantize:
            mode = getattr(module, "mode", "affine")
            parts = mx.quantize(w, group_size=module.group_size, bits=module.bits, mode=mode)
            weights[f"{key}.weight"], weights[f"{key}.scales"] = parts[0], parts[1]
            if len(parts) > 2 and parts[2] is not None:
                weights[f"{key}.biases"] = parts[2]
        else:
            weights[f"{key}.weight"] = w
    config: dict[str, Any] = dict(loaded.config)
    if dequantize:
        weights = _dequantized(model, weights)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    extra = {name: src / name for name in COPIED if (src / name).is_file()}
    return write_mlx_dir(config, weights, out_dir, overwrite=overwrite, progress=False, extra_files=extra,
                         source=src)


def _dequantized(model: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Every quantized layer's weight dense (as mlx-lm's ``dequantize_model``)."""
    out = dict(weights)
    for name, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and f"{name}.scales" in out:
            w = mx.dequantize(out[f"{name}.weight"], out[f"{name}.scales"], out.get(f"{name}.biases"),
                              group_size=m.group_size, bits=m.bits, mode=getattr(m, "mode", "affine"))
            out.pop(f"{name}.scales")
            out.pop(f"{name}.biases", None)
            out[f"{name}.weight"] = w
    return out
