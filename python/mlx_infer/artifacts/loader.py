"""Load a checkpoint into a graph + tokenizer.

Accepted inputs, in the order they are recognised:

1. ``None``: the embedded default model (see :mod:`.default_model`).
2. A GGUF file: converted once into an MLX directory in the cache (opening a
   GGUF and dequantizing it takes seconds; a safetensors directory loads
   in a fraction of that), then loaded from there.
3. A directory with ``config.json`` and ``*.safetensors``: an HF checkpoint
   (bf16/f16/f32) or an MLX-quantized one as mlx-lm writes it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import MlxInferError, ModelLoadError
from ..input.tokenizer import Tokenizer, load_tokenizer
from .config import context_length, read_config
from .default_model import cache_dir, default_model_gguf

GGUF_MAGIC = b"GGUF"
_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass
class LoadedModel:
    """A graph bound to its weights, with the tokenizer and facts generation needs.

    Attributes:
        model: the graph (an ``nn.Module`` following :class:`mlx_infer.contracts.Graph`).
        tokenizer: the model's tokenizer and chat template.
        config: the config.json dict the graph was built from.
        path: the MLX directory the weights were read from.
        source: what the caller asked for (a path, or ``"default"``).
        eos_token_ids: tokens that end a generation.
        context_length: the model's context window, when known.
        generation_config: ``generation_config.json`` (sampling defaults), or ``{}``.
    """

    model: nn.Module
    tokenizer: Tokenizer
    config: dict[str, Any]
    path: Path
    source: str
    eos_token_ids: frozenset[int]
    context_length: int | None
    generation_config: dict[str, Any] = field(default_factory=dict)

    @property
    def weight_bytes(self) -> int:
        """Bytes held by the model's parameters."""
        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))


def is_gguf(path: Path) -> bool:
    """True when ``path`` is a file starting with the GGUF magic."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def load_model(path: str | Path | None = None, *, dtype: str | None = None,
               cpu_kernels: bool | None = None) -> LoadedModel:
    """Load a model; see the module docstring for what ``path`` may be.

    ``cpu_kernels``: run linear layers and the LM head on mlx-infer's CPU matmul
    kernels (:mod:`mlx_infer.layers.linear`); ``None`` = :func:`default_cpu_kernels`
    (on when MLX runs on the CPU, unless ``MLX_INFER_CPU_KERNELS=0``). ``False``
    keeps MLX's stock kernels (bit-exact with mlx-lm).

    Raises:
        ModelLoadError: with a message saying what is wrong and how to fix it.
    """
    if dtype is not None and dtype not in _DTYPES:
        raise ModelLoadError(f"Unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}.")
    source = "default" if path is None else str(path)
    p = default_model_gguf() if path is None else Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(
            f"Model path {str(p)!r} does not exist. Pass a model directory (config.json + "
            "*.safetensors) or a .gguf file; Hub ids cannot be downloaded here."
        )
    if p.is_file():
        if not is_gguf(p):
            raise ModelLoadError(
                f"{p} is neither a GGUF file (its first bytes are not 'GGUF') nor a model "
                "directory. Pass the directory holding config.json, or a .gguf file."
            )
        p = converted_gguf_dir(p)
    return load_model_dir(p, source=source, dtype=dtype, cpu_kernels=cpu_kernels)


def converted_gguf_dir(gguf_path: Path) -> Path:
    """The cached MLX directory for a GGUF file, converting it on first use.

    The cache key covers the file's absolute path, size and modification time,
    so an edited or replaced GGUF is converted again.
    """
    from .convert import write_mlx_dir
    from .gguf import read_gguf

    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    out = cache_dir() / "converted" / f"{gguf_path.stem}-{digest}"
    if (out / "config.json").is_file():
        return out
    artifact = read_gguf(gguf_path)
    write_mlx_dir(
        artifact.config, artifact.weights, out,
        tokenizer_json=artifact.tokenizer_json,
        tokenizer_config=artifact.tokenizer_config,
        generation_config=artifact.generation_config,
        overwrite=True,
    )
    return out


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is malformed ({e}); restore it from the checkpoint.") from None
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{model_dir} is missing weight shards listed in model.safetensors.index.json: "
                f"{', '.join(missing)}. Download the complete checkpoint."
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{model_dir} has config.json but no *.safetensors weights. PyTorch .bin "
            "checkpoints are not read; convert them to safetensors first."
        )
    return files


def load_weights(model_dir: Path) -> dict[str, mx.array]:
    """Read every safetensors file of a model directory (memory-mapped by MLX)."""
    weights: dict[str, mx.array] = {}
    for f in _weight_files(model_dir):
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError, OSError) as e:
            raise ModelLoadError(
                f"Could not read weights from {f}: {e}. The file is truncated or corrupt; "
                "download or convert it again."
            ) from None
    return weights


def _quantize_if_needed(model: nn.Module, config: dict[str, Any], weights: dict[str, mx.array]) -> None:
    qconfig = config.get("quantization") or config.get("quantization_config")
    if not qconfig or "bits" not in qconfig:
        return

    def predicate(path: str, module: nn.Module) -> Any:
        if path in qconfig:  # per-layer overrides as mlx-lm writes them
            return qconfig[path]
        return hasattr(module, "to_quantized") and f"{path}.scales" in weights

    nn.quantize(
        model,
        group_size=qconfig.get("group_size", 64),
        bits=qconfig["bits"],
        mode=qconfig.get("mode", "affine"),
        class_predicate=predicate,
    )


#: Environment override of the CPU-kernel default ("0" off, "1" on); read here only.
CPU_KERNELS_ENV = "MLX_INFER_CPU_KERNELS"


def default_cpu_kernels() -> bool:
    """Whether models load onto mlx-infer's CPU kernels when the caller does not say.

    On whenever MLX's default device is the CPU: the kernels accumulate in float32
    (MLX's stock bfloat16 and quantized CPU kernels accumulate in bfloat16), so they
    are both faster and closer to a float32 reference (``tests/test_cpu_kernels.py``).
    ``MLX_INFER_CPU_KERNELS=0`` keeps MLX's stock kernels (bit-exact with mlx-lm), as
    does ``load_model(..., cpu_kernels=False)`` or the CLI's ``--stock-kernels``.
    On a GPU the stock kernels always run.
    """
    import os

    if mx.default_device() != mx.cpu:
        return False
    value = os.environ.get(CPU_KERNELS_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise MlxInferError(f"{CPU_KERNELS_ENV}={value!r}: use 1 (mlx-infer's CPU kernels, the default on a CPU) "
                         "or 0 (MLX's stock kernels).")
    return value != "0"


def load_model_dir(model_dir: Path, *, source: str | None = None, dtype: str | None = None,
                   cpu_kernels: bool | None = None) -> LoadedModel:
    """Load an HF or MLX-quantized model directory (``cpu_kernels``: see :func:`load_model`)."""
    from ..models import get_model_classes, materialize_graph_constants

    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir} is not a directory.")
    config = read_config(model_dir)
    model_cls, args_cls = get_model_classes(config["model_type"])
    try:
        args = args_cls.from_dict(config)
    except (TypeError, ValueError, KeyError) as e:
        raise ModelLoadError(
            f"{model_dir / 'config.json'} does not describe a valid {config['model_type']} model: {e}"
        ) from None
    model = model_cls(args)
    weights = model.sanitize(load_weights(model_dir))
    _quantize_if_needed(model, config, weights)
    if dtype is not None:
        target = _DTYPES[dtype]
        weights = {
            k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) and not k.endswith((".scales", ".biases")) else v
            for k, v in weights.items()
        }
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(
            f"The weights in {model_dir} do not match a {config['model_type']} model with this "
            f"config.json: {e}"
        ) from None
    model.eval()
    mx.eval(model.parameters())
    if cpu_kernels is None:
        cpu_kernels = default_cpu_kernels()
    if cpu_kernels:
        from ..layers.linear import swap_in_cpu_kernels

        swap_in_cpu_kernels(model)
    # Any thread (the engine's, the server's) may run the graph: nothing lazy may stay behind.
    materialize_graph_constants(model)

    tokenizer = load_tokenizer(model_dir)
    generation_config = _read_json(model_dir / "generation_config.json")
    eos = set(tokenizer.eos_token_ids)
    for source_cfg in (config, generation_config):
        ids = source_cfg.get("eos_token_id")
        if isinstance(ids, int):
            eos.add(ids)
        elif isinstance(ids, list):
            eos.update(i for i in ids if isinstance(i, int))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        path=model_dir,
        source=source or str(model_dir),
        eos_token_ids=frozenset(eos),
        context_length=context_length(config),
        generation_config=generation_config,
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}).") from None
    return data if isinstance(data, dict) else {}
