"""Hostile GGUF files: metadata of the wrong type or range (through the gguf package's writer) and
malformed headers (raw bytes). Harness: tests/hostile.py.
"""

from __future__ import annotations

import struct
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hostile import assert_refused

from mlx_infer.artifacts.loader import load_model

gguf = pytest.importorskip("gguf")
from gguf import GGUFValueType as VT  # noqa: E402
from gguf.gguf_writer import GGUFValue  # noqa: E402
from test_gguf import bpe_vocab, gemma_vocab, spm_vocab, write_tiny_gguf  # noqa: E402

from mlx_infer.artifacts.gguf import read_gguf  # noqa: E402


@lru_cache(maxsize=None)
def _vocab(kind: str) -> dict:
    return {"spm": spm_vocab, "bpe": bpe_vocab, "gemma": gemma_vocab}[kind]()


def write_gguf(path: Path, monkeypatch, arch: str = "llama", vocab: str = "spm", *,
               kv: dict[str, tuple[Any, Any, Any]] | None = None, drop: tuple[str, ...] = (),
               extra_tensors: dict[str, np.ndarray] | None = None, **kw: Any) -> Path:
    """A tiny GGUF as llama.cpp writes it, with metadata keys replaced (``kv``: key -> (value, type,
    sub_type)) or dropped, through the gguf package's own writer."""
    class Writer(gguf.GGUFWriter):
        def write_header_to_file(self, *a: Any, **k: Any) -> None:
            for key in drop:
                self.kv_data[0].pop(key, None)
            for key, (value, vtype, sub) in (kv or {}).items():
                self.kv_data[0][key] = GGUFValue(value=value, type=vtype, sub_type=sub)
            super().write_header_to_file(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(gguf, "GGUFWriter", Writer)
        write_tiny_gguf(path, arch, _vocab(vocab), extra_tensors=extra_tensors, **kw)
    return path


def _u32(v: Any) -> tuple[Any, Any, Any]:
    return (v, VT.UINT32, None)


def _f32(v: float) -> tuple[Any, Any, Any]:
    return (v, VT.FLOAT32, None)


def _str(v: str) -> tuple[Any, Any, Any]:
    return (v, VT.STRING, None)


def _arr(v: list, sub: Any) -> tuple[Any, Any, Any]:
    return (v, VT.ARRAY, sub)


GGUF_META_CASES: list[tuple[str, str, str, dict[str, Any], str]] = [
    # (id, arch, vocab, writer kwargs, message regex)
    ("embedding_length_zero", "llama", "spm", {"kv": {"llama.embedding_length": _u32(0)}},
     r"'llama.embedding_length' must be in \[1, "),
    ("head_count_zero", "llama", "spm", {"kv": {"llama.attention.head_count": _u32(0)}},
     r"'llama.attention.head_count' must be in \[1, "),
    ("head_count_string", "llama", "spm", {"kv": {"llama.attention.head_count": _str("four")}},
     r"'llama.attention.head_count' must be an integer"),
    ("head_count_kv_not_divisor", "llama", "spm", {"kv": {"llama.attention.head_count_kv": _u32(3)}},
     r"'llama.attention.head_count_kv' must be a divisor of llama.attention.head_count \(4\)"),
    ("head_count_kv_per_layer_unequal", "llama", "spm",
     {"kv": {"llama.attention.head_count_kv": _arr([2, 4], VT.UINT32)}}, r"different llama.attention.head_count_kv per layer"),
    ("head_count_mismatches_tensors", "llama", "spm", {"kv": {"llama.attention.head_count": _u32(8),
                                                             "llama.attention.head_count_kv": _u32(4)}},
     r"tensor 'blk.0.attn_q.weight' has shape \[64, 64\], but the metadata describes"),
    ("block_count_huge", "llama", "spm", {"kv": {"llama.block_count": (2**40, VT.UINT64, None)}},
     r"'llama.block_count' must be in \[1, 4096\]"),
    ("block_count_more_than_tensors", "llama", "spm", {"kv": {"llama.block_count": _u32(3)}},
     r"lacks tensors a llama model with its metadata needs: model.layers.2"),
    ("rms_eps_negative", "llama", "spm", {"kv": {"llama.attention.layer_norm_rms_epsilon": _f32(-1.0)}},
     r"'llama.attention.layer_norm_rms_epsilon' must be > 0"),
    ("rms_eps_nan", "llama", "spm", {"kv": {"llama.attention.layer_norm_rms_epsilon": _f32(float("nan"))}},
     r"'llama.attention.layer_norm_rms_epsilon' must be a finite number"),
    ("freq_base_inf", "llama", "spm", {"kv": {"llama.rope.freq_base": _f32(float("inf"))}},
     r"'llama.rope.freq_base' must be a finite number"),
    ("context_length_zero", "llama", "spm", {"kv": {"llama.context_length": _u32(0)}},
     r"'llama.context_length' must be in \[1, "),
    ("feed_forward_missing", "llama", "spm", {"drop": ("llama.feed_forward_length",)},
     r"lacks the metadata key 'llama.feed_forward_length'"),
    ("architecture_int", "llama", "spm", {"kv": {"general.architecture": _u32(5)}}, r"architecture 5"),
    ("name_int", "llama", "spm", {"kv": {"general.name": _u32(5)}}, r"'general.name' must be a string"),
    ("rope_scaling_unknown", "llama", "spm", {"kv": {"llama.rope.scaling.type": _str("ntk-weird"),
                                                    "llama.rope.scaling.factor": _f32(2.0)}},
     r"RoPE scaling 'ntk-weird'"),
    ("rope_scaling_factor_negative", "llama", "spm", {"kv": {"llama.rope.scaling.type": _str("linear"),
                                                            "llama.rope.scaling.factor": _f32(-2.0)}},
     r"'llama.rope.scaling.factor' must be > 0"),
    ("tokens_ints", "llama", "spm", {"kv": {"tokenizer.ggml.tokens": _arr([1, 2, 3], VT.UINT32)}},
     r"'tokenizer.ggml.tokens' must be an array of str"),
    ("token_type_short", "llama", "spm", {"kv": {"tokenizer.ggml.token_type": _arr([1, 1], VT.INT32)}},
     r"'tokenizer.ggml.token_type' must be an array of \d+ entries"),
    ("scores_nan", "llama", "spm", {"kv": {"tokenizer.ggml.scores": None}}, r"'tokenizer.ggml.scores' must be numbers"),
    ("eos_outside_vocab", "llama", "spm", {"kv": {"tokenizer.ggml.eos_token_id": _u32(10**6)}},
     r"'tokenizer.ggml.eos_token_id' must be in \[0, "),
    ("tokenizer_model_unknown", "llama", "spm", {"kv": {"tokenizer.ggml.model": _str("wordpiece")}},
     r"tokenizer model 'wordpiece'"),
    ("tokenizer_model_int", "llama", "spm", {"kv": {"tokenizer.ggml.model": _u32(1)}},
     r"'tokenizer.ggml.model' must be a string"),
    ("add_bos_int", "llama", "spm", {"kv": {"tokenizer.ggml.add_bos_token": _u32(1)}},
     r"'tokenizer.ggml.add_bos_token' must be a bool"),
    ("chat_template_int", "llama", "spm", {"kv": {"tokenizer.chat_template": _u32(1)}},
     r"'tokenizer.chat_template' must be a string"),
    ("merge_without_space", "qwen2", "bpe", {"kv": {"tokenizer.ggml.merges": _arr(["ab", "c d"], VT.STRING)}},
     r"merges of two tokens separated by one space"),
    ("vocab_larger_than_embedding", "llama", "spm", {"vocab_pad": 5}, r"the vocabulary has \d+ tokens but the embedding only"),
    ("g3_pattern_list_short", "gemma3", "gemma", {"kv": {"gemma3.attention.sliding_window_pattern": _arr([True], VT.BOOL)}},
     r"'gemma3.attention.sliding_window_pattern' must be an array of 2 entries"),
    ("g3_sliding_window_zero", "gemma3", "gemma", {"kv": {"gemma3.attention.sliding_window": _u32(0)}},
     r"'gemma3.attention.sliding_window' must be in \[1, "),
    ("g3_scale_zero", "gemma3", "gemma", {"kv": {"gemma3.attention.scale": _f32(0.0)}},
     r"'gemma3.attention.scale' must be > 0"),
    ("zero_dim_tensor", "llama", "spm", {"extra_tensors": {"blk.0.attn_norm.weight": np.zeros((0,), np.float32)}},
     r"tensor 'blk.0.attn_norm.weight' has shape \[0\]"),
    ("rope_freqs_zero", "llama", "spm", {"rope_freqs": np.zeros(8)}, r"rope_freqs tensor holds non-positive"),
]


@pytest.mark.parametrize("arch, vocab, kwargs, match", [c[1:] for c in GGUF_META_CASES], ids=[c[0] for c in GGUF_META_CASES])
def test_gguf_metadata_refused(tmp_path, monkeypatch, arch, vocab, kwargs, match):
    kwargs = dict(kwargs)
    kv = dict(kwargs.pop("kv", {}))
    if "tokenizer.ggml.scores" in kv:  # a score list with a NaN in it, one per token
        n = len(_vocab(vocab)["tokens"])
        kv["tokenizer.ggml.scores"] = _arr([0.0] * (n - 1) + [float("nan")], VT.FLOAT32)
    if kwargs.pop("vocab_pad", 0):  # more tokens than the embedding has rows
        toks = _vocab(vocab)["tokens"]
        kv["tokenizer.ggml.tokens"] = _arr(toks + [f"<extra{i}>" for i in range(5)], VT.STRING)
        kv["tokenizer.ggml.token_type"] = _arr(_vocab(vocab)["types"] + [1] * 5, VT.INT32)
        kv["tokenizer.ggml.scores"] = _arr(_vocab(vocab)["scores"] + [0.0] * 5, VT.FLOAT32)
    if arch == "gemma3" and "gemma3.attention.sliding_window_pattern" in kv:
        kwargs["n_layers"] = 2
    p = write_gguf(tmp_path / "model.gguf", monkeypatch, arch, vocab, kv=kv, **kwargs)
    msg = assert_refused(lambda: read_gguf(p), match, tmp_path)
    assert str(p) in msg  # the file is named


# ---------------------------------------------------------------------------------------------
# Raw bytes: malformed headers the gguf writer would never produce.

def _s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _header(n_tensors: int, kvs: list[bytes], version: int = 3, *, n_kv: int | None = None) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kvs) if n_kv is None else n_kv) + b"".join(kvs)


_ARCH = _kv("general.architecture", 8, _s("llama"))


def _tensor(name: str, dims: list[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", ggml_type, offset)


def _deep_array(depth: int) -> bytes:
    return _kv("deep", 9, struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0))


RAW_CASES: list[tuple[str, bytes, str]] = [
    ("magic_only", b"GGUF", r"truncated"),
    ("version_1", _header(0, [_ARCH], version=1) + b"\0" * 32, r"GGUF version 1; versions 2 and 3"),
    ("version_big_endian", b"GGUF" + struct.pack(">IQQ", 3, 0, 1) + b"\0" * 32, r"big-endian GGUF"),
    ("tensor_count_huge", _header(2**60, [_ARCH]) + b"\0" * 32, r"claims \d+ tensors"),
    ("kv_count_huge", _header(0, [_ARCH], n_kv=2**40) + b"\0" * 32, r"metadata entries"),
    ("unknown_value_type", _header(0, [_ARCH, _kv("x", 13, b"\0" * 8)]) + b"\0" * 32, r"unknown value type 13"),
    ("string_length_huge", _header(0, [_kv("general.architecture", 8, struct.pack("<Q", 2**62))]) + b"\0" * 32,
     r"truncated or corrupt"),
    ("array_count_huge", _header(0, [_ARCH, _kv("x", 9, struct.pack("<IQ", 6, 2**61))]) + b"\0" * 32,
     r"truncated or corrupt"),
    ("string_array_count_huge", _header(0, [_ARCH, _kv("x", 9, struct.pack("<IQ", 8, 2**61))]) + b"\0" * 32,
     r"truncated or corrupt"),
    ("array_nested_20000_deep", _header(0, [_ARCH, _deep_array(20_000)]) + b"\0" * 32, r"nests arrays more than 4 deep"),
    ("nested_array_count_huge", _header(0, [_ARCH, _kv("x", 9, struct.pack("<IQ", 9, 2**61))]) + b"\0" * 32,
     r"truncated or corrupt"),
    ("alignment_zero", _header(0, [_ARCH, _kv("general.alignment", 4, struct.pack("<I", 0))]) + b"\0" * 32,
     r"general.alignment is 0, not a power of two"),
    ("alignment_three", _header(0, [_ARCH, _kv("general.alignment", 4, struct.pack("<I", 3))]) + b"\0" * 32,
     r"general.alignment is 3"),
    ("tensor_five_dims", _header(1, [_ARCH]) + _tensor("token_embd.weight", [1, 1, 1, 1, 1]) + b"\0" * 64,
     r"claims 5 dimensions"),
    ("tensor_dim_zero", _header(1, [_ARCH]) + _tensor("token_embd.weight", [8, 0]) + b"\0" * 64,
     r"has shape \[0, 8\]; every dimension must be in \[1, 2\*\*31\)"),
    ("tensor_dim_2e40", _header(1, [_ARCH]) + _tensor("token_embd.weight", [2**40]) + b"\0" * 64,
     r"every dimension must be in"),
    ("tensor_type_unknown", _header(1, [_ARCH]) + _tensor("token_embd.weight", [8], ggml_type=99) + b"\0" * 64,
     r"ggml type 99"),
    ("tensor_offset_past_end", _header(1, [_ARCH]) + _tensor("token_embd.weight", [8], offset=2**40) + b"\0" * 64,
     r"truncated: its tensor data should end at byte"),
    ("tensor_row_not_block_multiple", _header(1, [_ARCH]) + _tensor("token_embd.weight", [33], ggml_type=8) + b"\0" * 64,
     r"not a multiple of its block size 32"),
    ("no_architecture", _header(0, []) + b"\0" * 32, r"architecture None"),
]


@pytest.mark.parametrize("data, match", [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES])
def test_gguf_raw_header_refused(tmp_path, data, match):
    p = tmp_path / "model.gguf"
    p.write_bytes(data)
    assert_refused(lambda: read_gguf(p), match, tmp_path)


def test_gguf_nan_tensor_refused_at_load(tmp_path, monkeypatch, mlx_infer_cache):
    """A GGUF whose weights hold NaN converts (the values are only data there) but never loads."""
    bad = np.full((64,), np.nan, np.float32)
    p = write_gguf(tmp_path / "model.gguf", monkeypatch, extra_tensors={"output_norm.weight": bad})
    assert_refused(lambda: load_model(p), r"'model.norm.weight'.*NaN or infinite", tmp_path)

