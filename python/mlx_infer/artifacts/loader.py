"""Load a checkpoint into a graph + tokenizer.

Accepted inputs, in the order they are recognised:

1. ``None``: the embedded default model (see :mod:`.default_model`), cached once in
   ``DEFAULT_VARIANT`` (``dtype="float32"``: the float32 reference the parity tests use).
2. A GGUF file: converted once into an MLX directory in the cache (opening a
   GGUF and dequantizing it takes seconds; a safetensors directory loads
   in a fraction of that), then loaded from there.
3. A directory with ``config.json`` and ``*.safetensors``: an HF checkpoint
   (bf16/f16/f32) or an MLX-quantized one as mlx-lm writes it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import MlxInferError, ModelLoadError
from ..input.tokenizer import Tokenizer, load_tokenizer
from ..models.schema import check_quantization
from ..parallel.group import current_group, leader_first
from .config import context_length, read_config, read_json_object, read_text
from .default_model import DEFAULT_VARIANT, VARIANTS, cache_dir, default_model_gguf, gguf_cache_key, variant_dir

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
    if path is None:
        p = leader_first(lambda: default_model_dir(float32=dtype == "float32"))
        return load_model_dir(p, source=source, dtype=None if dtype == "float32" else dtype, cpu_kernels=cpu_kernels)
    p = Path(path).expanduser()
    if "\x00" in str(p):
        raise ModelLoadError(f"Model path {str(p)!r} contains a NUL byte; pass a real path.")
    if not p.exists() and p.is_symlink():
        raise ModelLoadError(f"Model path {str(p)!r} is a symbolic link that loops or points nowhere "
                             f"({os.readlink(p)!r}); point it at a model directory or a .gguf file.")
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
        gguf = p
        p = leader_first(lambda: converted_gguf_dir(gguf))  # under mlx.launch: one rank converts
    return load_model_dir(p, source=source, dtype=dtype, cpu_kernels=cpu_kernels)


def _progress() -> bool:
    """Progress bars for one-time conversions: on a terminal only (stderr)."""
    import sys

    return sys.stderr.isatty()


def default_model_dir(*, float32: bool = False) -> Path:
    """The default model's MLX directory, converted once into the cache (``float32``: the reference
    dequantized from the GGUF; else :data:`DEFAULT_VARIANT`)."""
    import sys

    gguf = default_model_gguf()
    if float32 or DEFAULT_VARIANT == "float32":
        return converted_gguf_dir(gguf)
    out = variant_dir(gguf, DEFAULT_VARIANT)
    if (out / "config.json").is_file():
        return out
    from .convert import convert

    if _progress():
        print(f"mlx-infer: first run: converting the default model to {DEFAULT_VARIANT} in {out} "
              "(one time, ~10-30 s)", file=sys.stderr)
    return convert(gguf, out, overwrite=True, progress=_progress(), **VARIANTS[DEFAULT_VARIANT])


def converted_gguf_dir(gguf_path: Path) -> Path:
    """The cached MLX directory for a GGUF file, converting it on first use.

    The cache key (:func:`.default_model.gguf_cache_key`) covers the file's absolute path, size and
    modification time and the conversion format, so an edited or replaced GGUF is converted again.
    """
    from .convert import write_mlx_dir
    from .gguf import read_gguf

    out = cache_dir() / "converted" / f"{gguf_path.stem}-{gguf_cache_key(gguf_path)}"
    if (out / "config.json").is_file():
        return out
    if _progress():
        import sys

        print(f"mlx-infer: converting {gguf_path.name} to an MLX directory in {out} (one time; later runs "
              "load it directly)", file=sys.stderr)
    artifact = read_gguf(gguf_path, progress=_progress())
    write_mlx_dir(
        artifact.config, artifact.weights, out,
        tokenizer_json=artifact.tokenizer_json,
        tokenizer_config=artifact.tokenizer_config,
        generation_config=artifact.generation_config,
        overwrite=True, progress=_progress(),
    )
    return out


INDEX_FILE = "model.safetensors.index.json"


def _shard_path(model_dir: Path, index: Path, name: Any) -> Path:
    """The shard ``name`` of an index, refused unless it names a file inside ``model_dir``.

    The check is on the name (no absolute paths, no ``..``), not on where symlinks
    lead: Hugging Face's cache links every snapshot file into a blob store.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ModelLoadError(f"{index} names a weight shard {name!r}, which is not a file name; "
                             "restore the index from the checkpoint.")
    norm = os.path.normpath(name)
    if os.path.isabs(norm) or norm == ".." or norm.startswith(".." + os.sep) or norm == ".":
        raise ModelLoadError(
            f"{index} names the weight shard {name!r}, which lies outside {model_dir}; shards must be "
            "files inside the model directory. Restore the index from the checkpoint.")
    return model_dir / norm


def safetensors_files(model_dir: Path, *, prefer_model_prefix: bool = False) -> list[Path]:
    """The ``*.safetensors`` shards of a model directory, as its index names them (if it has one).

    Without an index every ``*.safetensors`` file is a shard; with
    ``prefer_model_prefix`` only ``model*.safetensors`` when there are such files
    (some repos also ship the weights under another layout, as Mistral's
    ``consolidated.safetensors``).

    Raises:
        ModelLoadError: a malformed index, a shard named outside the directory, a
            missing shard, or no weights at all.
    """
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(read_text(index))["weight_map"]
        except (json.JSONDecodeError, RecursionError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is malformed ({e}); restore it from the checkpoint.") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: \"weight_map\" must be a non-empty object of tensor name -> "
                                 "shard file; restore it from the checkpoint.")
        files = sorted({_shard_path(model_dir, index, name) for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{model_dir} is missing weight shards listed in {INDEX_FILE}: "
                f"{', '.join(missing)}. Download the complete checkpoint."
            )
        return files
    files = (sorted(model_dir.glob("model*.safetensors")) if prefer_model_prefix else []) \
        or sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{model_dir} has config.json but no *.safetensors weights. PyTorch .bin "
            "checkpoints are not read; convert them to safetensors first (save_pretrained(..., "
            "safe_serialization=True))."
        )
    return files


def check_weights(weights: dict[str, mx.array], model_dir: Path) -> None:
    """Refuse weights that would run but compute garbage: non-float tensors where floats are
    expected, and NaN or infinite values.

    Integer tensors are allowed only as the packed ``.weight`` of a quantized layer (one
    with ``.scales`` beside it) and as the uint8 ``.scales`` of the scale-only (mxfp)
    modes, as MLX's quantized formats store them. The finiteness test is a max and a min
    per float tensor (~0.3 s on the real model's 1.1 GB of float32 weights, 2-core CPU).

    Raises:
        ModelLoadError: naming the first offending tensors and the directory.
    """
    floats: list[tuple[str, mx.array]] = []
    for name, v in weights.items():
        if mx.issubdtype(v.dtype, mx.floating):
            floats.append((name, v))
            continue
        base = name.rsplit(".", 1)[0]
        packed = name.endswith(".weight") and f"{base}.scales" in weights and v.dtype in (mx.uint32, mx.uint8)
        # mxfp4/mxfp8 store scales as uint8 (E8M0) and have no .biases
        fp_scales = name.endswith(".scales") and v.dtype == mx.uint8 and f"{base}.biases" not in weights
        if not (packed or fp_scales):
            raise ModelLoadError(
                f"{model_dir}: tensor {name!r} has dtype {v.dtype}, but the model needs floating-point "
                "weights there (integer tensors are only read as the packed weights of a quantized layer, "
                "beside its .scales). Convert the checkpoint again.")
    # max and min propagate NaN and reach +-inf: two plain reductions, no temporary the size of
    # the tensor (mx.isfinite(v).all() allocates one and is ~4x slower on the real model).
    extremes = mx.stack([mx.stack([mx.max(v), mx.min(v)]).astype(mx.float32) for _, v in floats]) \
        if floats else mx.zeros((0, 2))  # (T, 2)
    finite = mx.all(mx.isfinite(extremes), axis=1).tolist()  # T bools
    bad = [name for (name, _), ok in zip(floats, finite) if not ok]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ModelLoadError(
            f"{model_dir}: weights {', '.join(map(repr, bad[:3]))}{more} hold NaN or infinite values; "
            "the checkpoint is corrupt (or was saved after a diverged training step). Download or convert "
            "it again.")


def load_weights(model_dir: Path) -> dict[str, mx.array]:
    """Read every safetensors file of a model directory (memory-mapped by MLX)."""
    weights: dict[str, mx.array] = {}
    for f in safetensors_files(model_dir):
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError, OSError) as e:
            raise ModelLoadError(
                f"Could not read weights from {f}: {e}. The file is truncated or corrupt; "
                "download or convert it again."
            ) from None
    return weights


def _quantize_if_needed(model: nn.Module, config: dict[str, Any], weights: dict[str, mx.array]) -> None:
    qconfig = check_quantization(config)
    if qconfig is None:
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
    if mx.default_device() != mx.cpu:
        return False
    value = os.environ.get(CPU_KERNELS_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise MlxInferError(f"{CPU_KERNELS_ENV}={value!r}: use 1 (mlx-infer's CPU kernels, the default on a CPU) "
                         "or 0 (MLX's stock kernels).")
    return value != "0"


def _check_sampling_defaults(generation_config: dict[str, Any], path: Path) -> None:
    """The sampling defaults of generation_config.json must be valid SamplingParams: every request
    starts from them, so a bad one is refused at load, not on each request."""
    from ..sampling import SamplingParams

    try:
        SamplingParams.from_generation_config(generation_config)
    except MlxInferError as e:
        raise ModelLoadError(f"{path}: {e}") from None


def build_model(config: dict[str, Any], cfg_path: Path) -> nn.Module:
    """The (unloaded) graph a config describes; every field is checked first (:mod:`mlx_infer.models.schema`).

    Raises:
        UnsupportedModelError: a ``model_type`` or variant without a graph here.
        ModelLoadError: a field of the wrong type or range; the message names the
            field and ``cfg_path``.
    """
    from ..models import get_model_classes

    try:
        model_cls, args_cls = get_model_classes(config["model_type"])
        args = args_cls.from_dict(config)
        check_quantization(config)
        return model_cls(args)
    except MlxInferError as e:
        raise type(e)(f"{cfg_path}: {e}") from None
    except (TypeError, ValueError, KeyError, ArithmeticError) as e:
        raise ModelLoadError(f"{cfg_path} does not describe a valid {config['model_type']} model: {e}") from None


def load_model_dir(model_dir: Path, *, source: str | None = None, dtype: str | None = None,
                   cpu_kernels: bool | None = None) -> LoadedModel:
    """Load an HF or MLX-quantized model directory (``cpu_kernels``: see :func:`load_model`)."""
    from ..models import materialize_graph_constants

    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir} is not a directory.")
    config = read_config(model_dir)
    cfg_path = model_dir / "config.json"
    model = build_model(config, cfg_path)

    def quantize(weights: dict[str, Any]) -> None:
        try:
            _quantize_if_needed(model, config, weights)
        except (TypeError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{cfg_path}: the quantization settings do not fit this model: {e}") from None

    pg, plan = current_group(), None
    if pg.distributed:  # launched by mlx.launch: read and keep only this rank's shard (mlx_infer.parallel)
        from ..parallel.load import sharded_weights

        weights, plan = sharded_weights(model, safetensors_files(model_dir), pg, quantize)
        check_weights(weights, model_dir)
    else:
        weights = model.sanitize(load_weights(model_dir))
        check_weights(weights, model_dir)
        quantize(weights)
    if dtype is not None:
        target = _DTYPES[dtype]
        weights = {
            k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) and not k.endswith((".scales", ".biases")) else v
            for k, v in weights.items()
        }
    try:
        model.load_weights(list(weights.items()), strict=plan is None)  # a shard's shapes: checked when read
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
    if plan is not None:
        from ..parallel.layers import install_tensor_parallel
        from ..parallel.pipeline import install_pipeline

        tp = install_pipeline(model, plan) if plan.pipeline else install_tensor_parallel(model, plan)
        if pg.is_leader:
            import sys

            from ..parallel.serve_rank import startup_line

            print(startup_line(tp), file=sys.stderr, flush=True)
    # Any thread (the engine's, the server's) may run the graph: nothing lazy may stay behind.
    materialize_graph_constants(model)

    tokenizer = load_tokenizer(model_dir)
    generation_config = read_json_object(model_dir / "generation_config.json") or {}
    _check_sampling_defaults(generation_config, model_dir / "generation_config.json")
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
