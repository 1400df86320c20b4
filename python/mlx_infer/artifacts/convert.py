"""Write MLX model directories: from in-memory weights, a GGUF file or an HF directory.

The directory is what mlx-lm writes and what our loader reads::

    out_dir/
      config.json                      HF config (+ "quantization" when quantized)
      model.safetensors                or model-0000N-of-0000M.safetensors shards
      model.safetensors.index.json     weight name -> shard file (always written, as mlx-lm does)
      tokenizer.json, tokenizer_config.json, generation_config.json

Writing is atomic: everything goes to a temporary directory beside ``out_dir``
that is swapped into place only once complete, so a failure never leaves a
half-written model behind; an existing ``out_dir`` is replaced only when it is
an earlier output of ours (see :mod:`.output_dir`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx

from ..errors import MlxInferError, ModelLoadError
from .output_dir import check_output, discard, make_temp, source_exists, swap_into_place

#: Shards are cut before they would exceed this many bytes (one tensor larger than it gets its own).
DEFAULT_MAX_SHARD_BYTES = 2 << 30
#: Affine quantization widths and group sizes ``mx.quantize`` accepts.
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
# Files of an HF directory that travel with the weights.
_COPIED_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


def _resolve_dtype(dtype: Any) -> mx.Dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise MlxInferError(f"Unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}.")
        return _DTYPES[dtype]
    if dtype not in _DTYPE_NAMES:
        raise MlxInferError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}.")
    return dtype


def should_quantize(name: str, weight: mx.array, group_size: int) -> bool:
    """Whether mlx-lm's ``convert`` would quantize this tensor.

    It quantizes the weight of every ``nn.Linear`` and ``nn.Embedding`` whose
    input dimension divides into groups; in the checkpoints we write those are
    exactly the 2-D floating ``*.weight`` tensors (norms are 1-D, biases are
    not ``weight``).
    """
    return (
        name.endswith(".weight")
        and weight.ndim == 2
        and mx.issubdtype(weight.dtype, mx.floating)
        and weight.shape[-1] % group_size == 0
    )


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=4, ensure_ascii=False) + "\n", encoding="utf-8")


def _shard(weights: dict[str, mx.array], max_bytes: int) -> list[dict[str, mx.array]]:
    shards: list[dict[str, mx.array]] = []
    size = 0
    for k, v in weights.items():
        if not shards or size + v.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    return shards


def write_mlx_dir(
    config: Mapping[str, Any],
    weights: Mapping[str, mx.array],
    out_dir: str | os.PathLike,
    *,
    tokenizer_json: str | None = None,
    tokenizer_config: Mapping[str, Any] | None = None,
    generation_config: Mapping[str, Any] | None = None,
    quantize_bits: int | None = None,
    group_size: int = 64,
    dtype: mx.Dtype | str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    extra_files: Mapping[str, str | os.PathLike] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    source: Path | None = None,
) -> Path:
    """Write an MLX model directory atomically.

    Args:
        config: the HF config dict; written sorted, with ``quantization`` and
            ``quantization_config`` added when quantizing (as mlx-lm writes them).
        weights: HF tensor name -> array.
        out_dir: the directory to create.
        tokenizer_json: ``tokenizer.json`` text, if any.
        tokenizer_config: ``tokenizer_config.json`` dict, if any.
        generation_config: ``generation_config.json`` dict, if any.
        quantize_bits: affine-quantize Linear/Embedding weights to this many
            bits (4 or 8 usually; any of :data:`SUPPORTED_BITS`); ``None`` keeps them dense.
        group_size: quantization group size (32, 64 or 128).
        dtype: cast floating weights to this dtype first (``None`` keeps them);
            quantization scales and biases take this dtype.
        overwrite: replace an existing non-empty ``out_dir`` -- only one this
            function wrote (it carries :data:`~.output_dir.MARKER`) and that holds
            nothing else; anyone else's directory is refused, never deleted.
        progress: show a progress bar.
        extra_files: file name in ``out_dir`` -> source path, copied verbatim
            (written after the named tokenizer/generation files, so they win).
        max_shard_bytes: split ``model.safetensors`` into shards of at most this size.
        source: the model this output is converted from; an ``out_dir`` that is or
            contains it is refused.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        MlxInferError: ``out_dir`` exists and is not empty (without ``overwrite``),
            is not ours to replace, is or contains ``source``, or an argument is invalid.
    """
    out = Path(out_dir).expanduser()
    target = _resolve_dtype(dtype)
    if quantize_bits is not None and quantize_bits not in SUPPORTED_BITS:
        raise MlxInferError(f"quantize_bits must be one of {SUPPORTED_BITS} (or None), got {quantize_bits!r}.")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise MlxInferError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size!r}.")
    if quantize_bits is not None and (
        "quantization" in config or any(k.endswith(".scales") for k in weights)
    ):
        raise MlxInferError("These weights are already quantized; convert from the unquantized checkpoint instead.")
    check_output(out, overwrite=overwrite, source=None if source is None else Path(source).expanduser())

    from tqdm.auto import tqdm

    tmp = make_temp(out)
    try:
        processed: dict[str, mx.array] = {}
        desc = f"Quantizing to {quantize_bits} bits" if quantize_bits else "Preparing weights"
        for name, w in tqdm(weights.items(), desc=desc, unit="tensor", disable=not progress):
            if target is not None and mx.issubdtype(w.dtype, mx.floating) and w.dtype != target:
                w = w.astype(target)
            if quantize_bits is not None and should_quantize(name, w, group_size):
                base = name[: -len(".weight")]
                wq, scales, biases = mx.quantize(w, group_size=group_size, bits=quantize_bits)
                mx.eval(wq, scales, biases)
                processed[f"{base}.weight"] = wq
                processed[f"{base}.scales"] = scales
                processed[f"{base}.biases"] = biases
            else:
                mx.eval(w)
                processed[name] = w

        shards = _shard(processed, max_shard_bytes)
        fmt = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(tqdm(shards, desc="Writing safetensors", unit="file", disable=not progress)):
            fname = fmt.format(i + 1, len(shards))
            mx.save_safetensors(str(tmp / fname), shard, metadata={"format": "mlx"})
            weight_map.update(dict.fromkeys(shard, fname))
        _write_json(tmp / "model.safetensors.index.json", {
            "metadata": {"total_size": sum(v.nbytes for v in processed.values())},
            "weight_map": dict(sorted(weight_map.items())),
        })

        cfg = dict(config)
        cfg.pop("_name_or_path", None)
        if target is not None:
            cfg["torch_dtype"] = _DTYPE_NAMES[target]
        if quantize_bits is not None:
            quant = {"group_size": group_size, "bits": quantize_bits, "mode": "affine"}
            cfg["quantization"] = quant
            cfg["quantization_config"] = dict(quant)
        _write_json(tmp / "config.json", dict(sorted(cfg.items())))
        if tokenizer_json is not None:
            (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        if tokenizer_config is not None:
            _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        if generation_config:
            _write_json(tmp / "generation_config.json", generation_config)
        for fname, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / fname)
        del processed, shards

        swap_into_place(tmp, out, overwrite=overwrite)
    except BaseException:
        discard(tmp)
        raise
    return out


def _read_hf_dir(src: Path) -> tuple[dict[str, Any], dict[str, mx.array], dict[str, Path]]:
    from .config import read_config
    from .loader import safetensors_files

    config = read_config(src)
    files = safetensors_files(src, prefer_model_prefix=True)
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises RuntimeError/ValueError with terse messages
            raise ModelLoadError(f"Could not read {f} ({e}); the file is damaged or incomplete.") from None
    # Older checkpoints store RoPE's inverse frequencies; they are recomputed, never loaded.
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    copied = {name: src / name for name in _COPIED_FILES if (src / name).is_file()}
    return config, weights, copied


def convert(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    quantize_bits: int | None = None,
    group_size: int = 64,
    dtype: mx.Dtype | str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert a ``.gguf`` file or an HF safetensors directory into an MLX directory.

    Args:
        source: a GGUF file (read with :func:`mlx_infer.artifacts.gguf.read_gguf`)
            or a directory with ``config.json`` and ``*.safetensors``.
        out_dir: the MLX directory to write (see :func:`write_mlx_dir`).
        quantize_bits: affine-quantize to 4 or 8 bits (``None``: keep dense).
        group_size: quantization group size.
        dtype: cast floating weights first; ``None`` keeps the source dtype
            (float32 for a GGUF, whatever the safetensors hold otherwise).
        overwrite: replace an existing non-empty ``out_dir`` that an earlier
            conversion wrote (see :func:`write_mlx_dir`).
        progress: show progress bars.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ModelLoadError: the source is missing or unreadable.
        UnsupportedModelError: a GGUF of an architecture we cannot run.
        MlxInferError: ``out_dir`` exists (without ``overwrite``) or a bad argument.
    """
    src = Path(source).expanduser()
    out = Path(out_dir).expanduser()
    if not source_exists(src):
        raise ModelLoadError(f"{str(src)!r} does not exist. Pass a .gguf file or a Hugging Face model directory.")
    check_output(out, overwrite=overwrite, source=src)  # fail before the slow read
    if src.is_file():
        from .gguf import read_gguf

        art = read_gguf(src, progress=progress)
        return write_mlx_dir(
            art.config, art.weights, out,
            tokenizer_json=art.tokenizer_json, tokenizer_config=art.tokenizer_config,
            generation_config=art.generation_config, quantize_bits=quantize_bits, group_size=group_size,
            dtype=dtype, overwrite=overwrite, progress=progress, source=src,
        )
    config, weights, copied = _read_hf_dir(src)
    from .loader import build_model, check_weights

    build_model(config, src / "config.json")  # a config we could not load is refused before writing
    check_weights(weights, src)
    return write_mlx_dir(
        config, weights, out, quantize_bits=quantize_bits, group_size=group_size, dtype=dtype,
        overwrite=overwrite, progress=progress, extra_files={name: str(p) for name, p in copied.items()},
        source=src,
    )
