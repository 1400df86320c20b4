"""Read a GGUF file into the in-memory artifact form: HF config, HF-named weights, tokenizer.

A GGUF (llama.cpp's single-file format) carries everything a model directory
does, under llama.cpp's names and conventions. :func:`read_gguf` undoes those:

* metadata keys (``gemma3.embedding_length``) become an HF ``config.json`` dict;
* tensor names (``blk.3.attn_q.weight``) become HF names
  (``model.layers.3.self_attn.q_proj.weight``), dequantized from any type the
  ``gguf`` package can dequantize;
* llama.cpp's value transforms are reverted: the q/k row permutation of
  llama-arch models and the ``+1`` it adds to Gemma norm weights;
* the vocabulary is rebuilt as an HF ``tokenizers`` JSON that encodes and
  decodes as transformers' ``AutoTokenizer.from_pretrained(..., gguf_file=...)``
  does.

The header (metadata and tensor table) is parsed here, with every read bounds-
checked, so a truncated or corrupt file fails with a clear error before any
tensor is touched; the ``gguf`` package only dequantizes the blocks.
transformers is never imported.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import ModelLoadError, UnsupportedModelError
from .gguf_config import SUPPORTED_ARCHITECTURES, Meta, build_config, check_tokenizer_metadata, model_type
from .gguf_tokenizer import build_tokenizer, generation_config
from .gguf_families import CONFIG_TENSORS, FAMILY_ARCHITECTURES, hf_names, rope_factors_config, untransform

__all__ = ["SUPPORTED_ARCHITECTURES", "GGUFArtifact", "GGUFHeader", "GGUFTensorInfo", "read_gguf", "read_gguf_header"]


GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ARRAY_DEPTH = 4  # arrays of arrays: llama.cpp writes none; bounded so a hostile file cannot recurse deep

# GGUF metadata value types: fixed-width scalars as struct formats; 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


# --------------------------------------------------------------------------------------------
# Header


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file.

    Attributes:
        name: the GGUF tensor name (``blk.0.attn_q.weight``).
        shape: the logical shape in row-major (numpy/HF) order.
        ggml_type: the ``gguf.GGMLQuantizationType`` value.
        offset: absolute byte offset of the data in the file.
        nbytes: bytes of data.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


@dataclass
class GGUFHeader:
    """A GGUF file's metadata and tensor table (no tensor data).

    Attributes:
        path: the file.
        version: GGUF format version (2 or 3).
        metadata: key -> value; arrays of strings are lists of ``str``, numeric
            arrays are lists of Python numbers.
        tensors: the tensor table, in file order.
        file_size: size of the file in bytes.
    """

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    file_size: int

    @property
    def architecture(self) -> str:
        """``general.architecture``."""
        return str(self.metadata.get("general.architecture", ""))


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buf: Any, path: Path):
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ModelLoadError(
                f"{self.path} is truncated or corrupt: reading {what} at byte {self.pos} needs {n} more "
                f"bytes, but the file has {self.size}. Re-download or re-export the GGUF file."
            )

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize("<" + fmt)
        self._need(n, what)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        self._need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype], f"the value of {key!r}")
        if vtype == _STRING:
            return self.string(f"the value of {key!r}")
        if vtype == _ARRAY:
            etype = self.scalar("I", f"the array type of {key!r}")
            count = self.scalar("Q", f"the array length of {key!r}")
            if etype in _NUMPY_DTYPES:
                dt = np.dtype(_NUMPY_DTYPES[etype])
                self._need(count * dt.itemsize, f"the array {key!r}")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.tolist()
            if etype == _STRING:
                if count > self.size:  # each string takes at least 8 bytes
                    self._need(count, f"the array {key!r}")
                return [self.string(f"element of {key!r}") for _ in range(count)]
            if etype == _ARRAY:
                if depth >= _MAX_ARRAY_DEPTH:
                    raise ModelLoadError(
                        f"{self.path} is corrupt: metadata key {key!r} nests arrays more than {_MAX_ARRAY_DEPTH} "
                        "deep (GGUF files from llama.cpp nest none). Re-download or re-export the GGUF file.")
                if count > self.size:  # each array takes at least 12 bytes
                    self._need(count, f"the array {key!r}")
                return [self.value(_ARRAY, key, depth + 1) for _ in range(count)]
        raise ModelLoadError(
            f"{self.path} is corrupt: metadata key {key!r} has unknown value type {vtype}. "
            "Re-download or re-export the GGUF file."
        )


def _ggml_sizes() -> dict[int, tuple[int, int]]:
    from gguf.constants import GGML_QUANT_SIZES

    return {int(k): v for k, v in GGML_QUANT_SIZES.items()}


def _ggml_type_name(ggml_type: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def _open_checked(path: str | os.PathLike) -> tuple[Path, int]:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"GGUF file {str(p)!r} does not exist. Check the path, or pass a model directory.")
    if not p.is_file():
        raise ModelLoadError(f"{p} is not a file. Pass the path of a .gguf file.")
    size = p.stat().st_size
    with p.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{p} is not a GGUF file (its first bytes are {magic!r}, not b'GGUF'). "
            "Pass a .gguf file, or a model directory with config.json and *.safetensors."
        )
    return p, size


def _parse_header(p: Path, size: int, buf: Any) -> GGUFHeader:
    cur = _Cursor(buf, p)
    cur.pos = 4
    version = cur.scalar("I", "the version")
    if version not in _GGUF_VERSIONS:
        if struct.unpack("<I", struct.pack(">I", version))[0] in _GGUF_VERSIONS:
            raise UnsupportedModelError(f"{p} is a big-endian GGUF; only little-endian GGUF files are read.")
        raise UnsupportedModelError(
            f"{p} is GGUF version {version}; versions {' and '.join(map(str, _GGUF_VERSIONS))} are supported. "
            "Re-export it with a current llama.cpp."
        )
    n_tensors = cur.scalar("Q", "the tensor count")
    n_kv = cur.scalar("Q", "the metadata count")
    if n_tensors > size or n_kv > size:
        raise ModelLoadError(
            f"{p} is corrupt: it claims {n_tensors} tensors and {n_kv} metadata entries in {size} bytes. "
            "Re-download or re-export the GGUF file."
        )
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("a metadata key")
        vtype = cur.scalar("I", f"the type of {key!r}")
        metadata[key] = cur.value(vtype, key)

    sizes = _ggml_sizes()
    raw_tensors = []
    for _ in range(n_tensors):
        name = cur.string("a tensor name")
        n_dims = cur.scalar("I", f"the rank of {name!r}")
        if n_dims > _MAX_DIMS:
            raise ModelLoadError(
                f"{p} is corrupt: tensor {name!r} claims {n_dims} dimensions (ggml allows {_MAX_DIMS})."
            )
        dims = [cur.scalar("Q", f"the shape of {name!r}") for _ in range(n_dims)]
        if any(d == 0 or d >= 1 << 31 for d in dims):
            raise ModelLoadError(
                f"{p} is corrupt: tensor {name!r} has shape {dims[::-1]}; every dimension must be in "
                "[1, 2**31). Re-download or re-export the GGUF file.")
        ggml_type = cur.scalar("I", f"the type of {name!r}")
        offset = cur.scalar("Q", f"the offset of {name!r}")
        raw_tensors.append((name, dims, ggml_type, offset))

    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{p} is corrupt: general.alignment is {alignment!r}, not a power of two.")
    data_start = (cur.pos + alignment - 1) // alignment * alignment

    tensors: list[GGUFTensorInfo] = []
    end = data_start
    for name, dims, ggml_type, offset in raw_tensors:
        if ggml_type not in sizes:
            raise UnsupportedModelError(
                f"{p}: tensor {name!r} has ggml type {ggml_type}, which the installed gguf package does not "
                "know. Upgrade the `gguf` package or re-quantize the file to a common type (Q4_K_M, Q8_0, F16)."
            )
        block, type_size = sizes[ggml_type]
        n_elements = math.prod(dims) if dims else 1
        if dims and dims[0] % block:
            raise ModelLoadError(
                f"{p} is corrupt: tensor {name!r} of type {_ggml_type_name(ggml_type)} has a row of "
                f"{dims[0]} values, not a multiple of its block size {block}."
            )
        nbytes = n_elements // block * type_size
        start = data_start + offset
        tensors.append(GGUFTensorInfo(name, tuple(int(d) for d in reversed(dims)), ggml_type, start, nbytes))
        end = max(end, start + nbytes)
    if end > size:
        raise ModelLoadError(
            f"{p} is truncated: its tensor data should end at byte {end}, but the file has only {size} bytes "
            f"({end - size} missing). The download or copy was cut short; fetch the file again."
        )
    return GGUFHeader(path=p, version=version, metadata=metadata, tensors=tensors, file_size=size)


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table, checking it is complete.

    Raises:
        ModelLoadError: the path does not exist, is not a GGUF file, or is
            truncated or corrupt.
        UnsupportedModelError: the GGUF version or a tensor type cannot be read.
    """
    p, size = _open_checked(path)
    if size < 24:
        raise ModelLoadError(f"{p} is truncated: {size} bytes is shorter than a GGUF header. Fetch the file again.")
    with p.open("rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return _parse_header(p, size, mm)
        finally:
            try:
                mm.close()
            except BufferError:  # a traceback still holds a view into it; the GC closes it later
                pass


# --------------------------------------------------------------------------------------------
# Tensors


_LEAF_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LEAF_NAMES = {
    **_LEAF_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_DENSE_LEAF_NAMES = {**_LEAF_NAMES, "ffn_norm": "post_attention_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IGNORED_TENSORS = {"rope_freqs.weight"}  # folded into config["rope_scaling"]


def _hf_name(arch: str, name: str, path: Path) -> str:
    base, _, suffix = name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    leaves = _GEMMA3_LEAF_NAMES if arch == "gemma3" else _DENSE_LEAF_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in leaves:
        return f"model.layers.{parts[1]}.{leaves[parts[2]]}.{suffix}"
    raise UnsupportedModelError(
        f"{path} has a tensor {name!r} that a {arch} model does not use here; refusing to drop weights "
        "silently. The file may be a variant (multimodal, MoE) this reader does not support."
    )


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's half split)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(f: Any, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor as float32 numpy, in its logical shape (read from the open file ``f``)."""
    from gguf import GGMLQuantizationType, quants

    f.seek(info.offset)
    data = f.read(info.nbytes)
    if len(data) != info.nbytes:  # the file shrank since its header was checked
        raise ModelLoadError(f"{f.name} is truncated: tensor {info.name!r} is cut short. Fetch the file again.")
    raw = np.frombuffer(data, dtype=np.uint8)
    t = info.ggml_type
    if t == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(info.shape).copy()
    if t == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(info.shape).astype(np.float32)
    if t == GGMLQuantizationType.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(info.shape)
    if t == GGMLQuantizationType.F64:
        return raw.view(np.float64).reshape(info.shape).astype(np.float32)
    block, type_size = _ggml_sizes()[t]
    rows = raw.reshape(*info.shape[:-1], info.shape[-1] // block * type_size)
    try:
        return np.asarray(quants.dequantize(rows, GGMLQuantizationType(t)), dtype=np.float32).reshape(info.shape)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"Tensor {info.name!r} is stored as {_ggml_type_name(t)}, which the gguf package cannot "
            "dequantize. Re-quantize the file to a K-quant, Q8_0 or F16."
        ) from None


# --------------------------------------------------------------------------------------------
# Tokenizer


# --------------------------------------------------------------------------------------------
# Entry point


@dataclass
class GGUFArtifact:
    """A GGUF file in the form a model directory holds it.

    Attributes:
        config: the HF ``config.json`` dict (``model_type``, shapes, RoPE, ...).
        weights: HF tensor name -> array, dequantized, in HF conventions.
        tokenizer_json: an HF ``tokenizers`` JSON (the ``tokenizer.json`` text).
        tokenizer_config: the ``tokenizer_config.json`` dict (special tokens,
            ``add_bos_token``, ``chat_template`` when the file has one).
        generation_config: the ``generation_config.json`` dict (eos ids), or ``{}``.
        metadata: the GGUF metadata with the vocabulary arrays left out.
    """

    config: dict[str, Any]
    weights: dict[str, mx.array]
    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


def _check_tensor_shapes(header: GGUFHeader, config: dict[str, Any], tensors: dict[str, GGUFTensorInfo]) -> None:
    """Every tensor the graph of ``config`` needs is there with the shape it needs, before any is dequantized.

    Raises:
        ModelLoadError: the config is invalid (a field named), a tensor is missing, or has another shape.
    """
    from mlx.utils import tree_flatten

    from .loader import build_model

    model = build_model(config, header.path)  # lazy: no parameter is materialized
    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelLoadError(f"{header.path} lacks tensors a {config['model_type']} model with its metadata needs: "
                             f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}. Re-export the GGUF file.")
    for name, info in tensors.items():
        if name in expected and info.shape != expected[name]:
            raise ModelLoadError(
                f"{header.path}: tensor {info.name!r} has shape {list(info.shape)}, but the metadata "
                f"describes a model whose {name} is {list(expected[name])}. The file is damaged or its "
                "metadata does not match its tensors; re-export it with llama.cpp.")


def _resolve_dtype(dtype: Any) -> mx.Dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"Unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}.")
        return _DTYPES[dtype]
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype must be one of mx.float32, mx.float16, mx.bfloat16, got {dtype!r}.")
    return dtype


def read_gguf(path: str | os.PathLike, *, dtype: mx.Dtype | str = mx.float32, progress: bool = False) -> GGUFArtifact:
    """Read a GGUF file into config, HF-named weights and tokenizer.

    Args:
        path: the ``.gguf`` file.
        dtype: dtype of the returned weights (float32 by default; values are
            dequantized and un-transformed in float32 first, then cast).
        progress: show a progress bar while dequantizing.

    Returns:
        A :class:`GGUFArtifact`.

    Raises:
        ModelLoadError: missing path, not a GGUF file, truncated or corrupt file.
        UnsupportedModelError: an architecture, tokenizer or tensor type that
            cannot be read (the message names what is supported).
    """
    target = _resolve_dtype(dtype)
    header = read_gguf_header(path)
    model_type(header)  # fail on the architecture before the slow parts
    check_tokenizer_metadata(header)
    arch = header.architecture
    infos = {t.name: t for t in header.tensors}
    family = arch in FAMILY_ARCHITECTURES  # named and transformed by .gguf_families
    if not family:
        mapped = {name: _hf_name(arch, name, header.path) for name in infos if name not in _IGNORED_TENSORS}
    from tqdm.auto import tqdm

    with header.path.open("rb") as f:
        rope_freqs = None
        if "rope_freqs.weight" in infos:
            rope_freqs = _dequantize(f, infos["rope_freqs.weight"]).astype(np.float64)
        n_vocab = len(header.metadata.get("tokenizer.ggml.tokens") or []) or None
        config = build_config(header, infos, n_vocab, rope_freqs)
        if family:
            rope_factors_config(Meta(header), config, {
                n: _dequantize(f, infos[n]).astype(np.float64) for n in CONFIG_TENSORS if n in infos})
            weights_in = [n for n in infos if n not in _IGNORED_TENSORS and n not in CONFIG_TENSORS]
            mapped = hf_names(arch, config, weights_in, header.path)
        _check_tensor_shapes(header, config, {hf: infos[g] for g, hf in mapped.items()})
        config["torch_dtype"] = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}[target]
        tokenizer_json, tokenizer_config = build_tokenizer(header)

        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        weights: dict[str, mx.array] = {}
        for gname, hf in tqdm(mapped.items(), desc="Dequantizing GGUF", unit="tensor", disable=not progress):
            w = _dequantize(f, infos[gname])
            if arch == "llama" and ".attn_q." in gname:
                w = _reverse_permute(w, heads)
            elif arch == "llama" and ".attn_k." in gname:
                w = _reverse_permute(w, kv_heads)
            elif arch == "gemma3" and gname.endswith("norm.weight"):
                w = w - np.float32(1.0)  # llama.cpp stores Gemma's (1 + w) norm weights as 1 + w
            elif family:
                w = untransform(arch, gname, w, config)
            a = mx.array(w)
            if a.dtype != target:
                a = a.astype(target)
            mx.eval(a)
            weights[hf] = a
            del w

    small_meta = {k: v for k, v in header.metadata.items()
                  if not (isinstance(v, list) and len(v) > 64) and k != "tokenizer.chat_template"}
    return GGUFArtifact(
        config=config,
        weights=weights,
        tokenizer_json=tokenizer_json,
        tokenizer_config=tokenizer_config,
        generation_config=generation_config(header),
        metadata=small_meta,
    )

