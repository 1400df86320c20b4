"""Random adapters for the LoRA tests, written the way mlx-lm and PEFT write them.

``make_mlx_adapter`` uses mlx-lm's own ``linear_to_lora_layers`` on mlx-lm's model of the
directory, gives ``lora_b`` (zero at init) and DoRA's ``m`` random values, and saves the
trainable parameters and config exactly as ``mlx_lm.lora`` does (``adapters.safetensors``,
``adapter_config.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

DEFAULT_KEYS = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]


def mlx_lm_model(model_dir: Path):
    """mlx-lm's model of a tiny directory (the oracle)."""
    from mlx_lm.utils import load_model

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    extra = {}
    if cfg["model_type"] == "gemma4_text":  # mlx-lm's defaults differ from the HF config's absent keys
        extra = {"num_kv_shared_layers": cfg.get("num_kv_shared_layers", 0)}
    model, _ = load_model(Path(model_dir), model_config=extra)
    return model


def make_mlx_adapter(model_dir: Path | None, out: Path, *, seed: int, rank: int = 4, scale: float = 2.0,
                     keys: list[str] | None = None, num_layers: int = -1, dora: bool = False,
                     b_std: float = 0.3, model=None) -> Path:
    """Write a random mlx-lm adapter for ``model_dir`` into ``out``.

    ``model``: a fresh mlx-lm model to build it on instead of loading ``model_dir`` (the
    families of tests/families.py build theirs with ``build_mlx_lm``); it is modified.
    """
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = mlx_lm_model(model_dir) if model is None else model
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": keys or DEFAULT_KEYS}
    n = len(model.layers) if num_layers < 0 else num_layers
    mx.random.seed(seed)
    linear_to_lora_layers(model, n, params, use_dora=dora)
    weights = {}
    for k, v in tree_flatten(model.trainable_parameters()):
        if k.endswith("lora_b"):
            v = mx.random.normal(v.shape) * b_std
        elif k.endswith(".m"):
            v = v * (1.0 + 0.1 * mx.random.normal(v.shape))
        weights[k] = v
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "dora" if dora else "lora", "num_layers": n, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def mlx_lm_with_adapter(model_dir: Path | None, adapter_dir: Path, *, model=None):
    """mlx-lm's model of ``model_dir`` (or the fresh mlx-lm ``model``) with ``adapter_dir`` loaded by
    ``mlx_lm.tuner.utils.load_adapters``."""
    from mlx_lm.tuner.utils import load_adapters

    model = mlx_lm_model(model_dir) if model is None else model
    load_adapters(model, str(adapter_dir))
    model.eval()
    mx.eval(model.parameters())
    return model
