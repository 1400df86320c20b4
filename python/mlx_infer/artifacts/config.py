"""Reading and checking a model directory's config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError


def read_text(path: Path) -> str:
    """A UTF-8 text file's contents, failing with a message naming the file."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path} is not UTF-8 text ({e}); restore it from the original checkpoint.") from None
    except OSError as e:
        raise ModelLoadError(f"{path} could not be read ({e.strerror}).") from None


def read_json_object(path: Path) -> dict[str, Any] | None:
    """A JSON file holding an object, or ``None`` when the file is absent."""
    if not path.is_file():
        return None
    try:
        data = json.loads(read_text(path))
    except (json.JSONDecodeError, RecursionError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}); restore it from the original checkpoint.") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, found {type(data).__name__}; restore it from "
                             "the original checkpoint.")
    return data


def read_config(model_dir: Path) -> dict[str, Any]:
    """Read ``model_dir/config.json``, failing with an actionable message.

    Raises:
        ModelLoadError: the file is missing, is not JSON, is not an object or
            lacks ``model_type``.
    """
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(
            f"{model_dir} has no config.json. A model directory needs config.json beside its "
            "*.safetensors files (as Hugging Face and mlx-lm write them); pass a .gguf file "
            "directly, or convert a checkpoint with `mlx-infer convert`."
        )
    config = read_json_object(path) or {}
    if "model_type" not in config:
        text = config.get("text_config")
        if isinstance(text, dict) and "model_type" in text:
            config["model_type"] = text["model_type"]
        else:
            raise ModelLoadError(
                f"{path} has no \"model_type\". Add the architecture's model_type (for example "
                "\"llama\" or \"gemma3_text\") as in the original Hugging Face config."
            )
    if not isinstance(config["model_type"], str):
        raise ModelLoadError(f"{path}: \"model_type\" must be a string such as \"llama\", got "
                             f"{config['model_type']!r}.")
    return config


def context_length(config: dict[str, Any]) -> int | None:
    """The model's context window in tokens, if the config states one."""
    for source in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "n_ctx", "seq_length"):
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
