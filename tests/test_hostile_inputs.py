"""Hostile inputs to loading, GGUF, sampling and the generate/convert/bench CLI (hardening issue, section 4).

Every case is one distinct bad (or degenerate) input. Each asserts:

- API: the call raises only an ``MlxInferError`` / ``ValueError`` subclass, whose message names
  what was wrong (a regex per case); anything else (TypeError, OverflowError, RecursionError,
  ZeroDivisionError, a crash) fails the case. Degenerate sampling values that are accepted with a
  documented meaning (near-greedy) are checked for that meaning instead.
- CLI: ``python -m mlx_infer ...`` exits 2 with exactly one line on stderr and no traceback.
- No hang: API cases run in a worker thread joined with a timeout, CLI cases under a subprocess
  timeout (:data:`TIMEOUT_S`).
- Nothing outside what the case created is touched: the case's directory (its inputs, and the
  CLI's working directory) is snapshotted before and after, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
import subprocess
import sys
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
import pytest
from tiny import make_tiny_model_dir

from mlx_infer.artifacts.loader import load_model
from mlx_infer.errors import MlxInferError
from mlx_infer.sampling import RequestRNG, SamplingParams, make_sampler, sample

TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------------------------
# Harness


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: relative path -> (kind, size, mtime_ns, sha256)."""
    out: dict[str, tuple] = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(root))] = ("f", st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        else:
            out[str(p.relative_to(root))] = ("d" if p.is_dir() else "l", st.st_mtime_ns)
    return out


def bounded(fn: Callable[[], Any], timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """Run ``fn`` in a worker thread; fail if it is still running after ``timeout`` seconds."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (reported to the test below)
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout:.0f} s: the input makes it hang"
    return result


def assert_refused(fn: Callable[[], Any], match: str, root: Path | None = None) -> str:
    """``fn`` raises a ValueError subclass matching ``match``, in bounded time, touching nothing under ``root``."""
    before = snapshot(root) if root is not None else None
    result = bounded(fn)
    err = result.get("error")
    assert err is not None, f"accepted silently: returned {result.get('value')!r}"
    assert isinstance(err, ValueError), f"{type(err).__name__} escaped instead of a ValueError: {err}"
    assert re.search(match, str(err)), f"message does not say what was wrong ({match!r}): {err}"
    if root is not None:
        assert snapshot(root) == before, "the input directory changed"
    return str(err)


def cli(args: list[str], cwd: Path, *, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlx_infer", *args], cwd=cwd, input=stdin,
                          capture_output=True, timeout=TIMEOUT_S)


def assert_cli_refuses(args: list[str], cwd: Path, match: str, *, stdin: bytes | None = None) -> str:
    before = snapshot(cwd)
    r = cli(args, cwd, stdin=stdin)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, f"exit {r.returncode}, stderr: {err[-2000:]}"
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"{len(lines)} lines on stderr: {err[-2000:]}"
    assert re.search(match, lines[0]), f"{match!r} not in {lines[0]!r}"
    assert snapshot(cwd) == before, "the CLI touched files it was not asked to write"
    return lines[0]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile-src")
    return {fam: make_tiny_model_dir(root / fam, fam) for fam in ("llama", "gemma3")}


def copy_model(tiny_models: dict[str, Path], family: str, dst: Path) -> Path:
    shutil.copytree(tiny_models[family], dst)
    return dst


# ---------------------------------------------------------------------------------------------
# config.json

_DEL = object()

CONFIG_CASES: list[tuple[str, str, dict[str, Any], str]] = [
    # (id, family, config overrides, message regex)
    ("hidden_size_str", "llama", {"hidden_size": "abc"}, r'"hidden_size" must be an integer'),
    ("vocab_10e12", "llama", {"vocab_size": 10**12}, r'"vocab_size" must be >= 1'),
    ("heads_zero", "llama", {"num_attention_heads": 0}, r'"num_attention_heads" must be >= 1'),
    ("sliding_window_zero", "llama", {"sliding_window": 0}, r'"sliding_window" must be >= 1'),
    ("head_dim_zero", "llama", {"head_dim": 0}, r'"head_dim" must be >= 1'),
    ("rope_theta_str", "llama", {"rope_theta": "x"}, r'"rope_theta" must be a number'),
    ("rope_scaling_str", "llama", {"rope_scaling": "yes"}, r'"rope_scaling" must be an object'),
    ("layers_negative", "llama", {"num_hidden_layers": -1}, r'"num_hidden_layers" must be >= 1'),
    ("layers_null", "llama", {"num_hidden_layers": None}, r'"num_hidden_layers" must be an integer \(not null\)'),
    ("hidden_fraction", "llama", {"hidden_size": 64.5}, r'"hidden_size" must be an integer'),
    ("hidden_bool", "llama", {"hidden_size": True}, r'"hidden_size" must be an integer'),
    ("hidden_nan", "llama", {"hidden_size": float("nan")}, r'"hidden_size" must be an integer'),
    ("intermediate_2e40", "llama", {"intermediate_size": 2**40}, r'"intermediate_size" must be >= 1'),
    ("kv_heads_not_divisor", "llama", {"num_key_value_heads": 3}, r'multiple of "num_key_value_heads"'),
    ("kv_heads_above_heads", "llama", {"num_key_value_heads": 8}, r'multiple of "num_key_value_heads"'),
    ("hidden_below_heads", "llama", {"hidden_size": 2}, r"head dim would be 0"),
    ("eps_zero", "llama", {"rms_norm_eps": 0}, r'"rms_norm_eps" must be > 0'),
    ("eps_str", "llama", {"rms_norm_eps": "1e-6"}, r'"rms_norm_eps" must be a number'),
    ("rope_theta_1e39", "llama", {"rope_theta": 1e39}, r'"rope_theta" must be a finite number \(in float32'),
    ("rope_theta_negative", "llama", {"rope_theta": -1.0}, r'"rope_theta" must be > 0'),
    ("rope_linear_no_factor", "llama", {"rope_scaling": {"rope_type": "linear"}}, r'needs a "factor"'),
    ("rope_unknown_type", "llama", {"rope_scaling": {"rope_type": "dynamic-ntk", "factor": 2.0}},
     r"RoPE type 'dynamic-ntk'; supported types: default, linear, llama3, yarn"),
    ("rope_factor_zero", "llama", {"rope_scaling": {"rope_type": "linear", "factor": 0}},
     r'"rope_scaling.factor" must be > 0'),
    ("rope_yarn_original_str", "llama",
     {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": "big"}},
     r'"rope_scaling.original_max_position_embeddings" must be an integer'),
    ("rope_llama3_equal_factors", "llama",
     {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0}},
     r"low_freq_factor != high_freq_factor"),
    ("rope_type_int", "llama", {"rope_scaling": {"rope_type": 5, "factor": 2.0}}, r"RoPE type 5"),
    ("layer_types_unknown", "llama", {"layer_types": ["full_attention", "chunked_attention"], "sliding_window": 8},
     r"\"layer_types\"\[1\] is 'chunked_attention'; each entry must be one of full_attention, sliding_attention"),
    ("layer_types_unknown_no_window", "llama", {"layer_types": ["full_attention", "bogus"]},
     r"\"layer_types\"\[1\] is 'bogus'"),
    ("layer_types_short", "llama", {"layer_types": ["full_attention"]}, r"layer_types has 1 entries"),
    ("layer_types_str", "llama", {"layer_types": "full_attention"}, r'"layer_types" must be a list'),
    ("model_type_list", "llama", {"model_type": ["llama"]}, r'"model_type" must be a string'),
    ("model_type_unknown", "llama", {"model_type": "gpt_neox"}, r"'gpt_neox' is not supported"),
    ("context_zero", "llama", {"max_position_embeddings": 0}, r'"max_position_embeddings" must be >= 1'),
    ("tie_str", "llama", {"tie_word_embeddings": "yes"}, r'"tie_word_embeddings" must be true or false'),
    ("attention_bias_int", "llama", {"attention_bias": 1}, r'"attention_bias" must be true or false'),
    ("quant_bits_7", "llama", {"quantization": {"bits": 7, "group_size": 64}}, r'"quantization.bits" must be one of'),
    ("quant_group_5", "llama", {"quantization": {"bits": 4, "group_size": 5}},
     r'"quantization.group_size" must be one of'),
    ("quant_str", "llama", {"quantization": "4bit"}, r'"quantization" must be an object'),
    ("g3_query_scalar_zero", "gemma3", {"query_pre_attn_scalar": 0}, r'"query_pre_attn_scalar" must be > 0'),
    ("g3_pattern_zero", "gemma3", {"sliding_window_pattern": 0}, r'"sliding_window_pattern" must be >= 1'),
    ("g3_sliding_window_zero", "gemma3", {"sliding_window": 0}, r'"sliding_window" must be >= 1'),
    ("g3_rope_parameters_part_str", "gemma3", {"rope_parameters": {"full_attention": "x"}},
     r'"rope_parameters.full_attention" must be an object'),
    ("g3_rope_parameters_bad_kind", "gemma3",
     {"rope_parameters": {"full_attention": {"rope_type": "default"}, "chunked": {"rope_type": "default"}}},
     r"per-kind RoPE keys"),
    ("g3_softcap_negative", "gemma3", {"final_logit_softcapping": -1.0}, r'"final_logit_softcapping" must be > 0'),
    ("g3_head_dim_str", "gemma3", {"head_dim": "16"}, r'"head_dim" must be an integer'),
    ("g3_local_base_zero", "gemma3", {"rope_local_base_freq": 0.0}, r'"rope_local_base_freq" must be > 0'),
    ("g3_multimodal_text_bad", "gemma3",
     {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "hidden_size": "abc"}},
     r'"hidden_size" must be an integer'),
]


@pytest.mark.parametrize("family, overrides, match", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_config_field_refused(tiny_models, tmp_path, family, overrides, match):
    d = copy_model(tiny_models, family, tmp_path / "model")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(overrides)
    (d / "config.json").write_text(json.dumps(cfg))
    msg = assert_refused(lambda: load_model(d), match, tmp_path)
    assert "config.json" in msg  # the file is named


# Whole-file damage: config.json and the tokenizer files.
FILE_CASES: list[tuple[str, str, bytes, str]] = [
    ("config_list", "config.json", b"[1, 2]", r"must hold a JSON object, found list"),
    ("config_not_utf8", "config.json", b'{"model_type": "llama\xff"}', r"config.json is not UTF-8"),
    ("config_empty", "config.json", b"", r"config.json is not valid JSON"),
    ("config_deep_nesting", "config.json", b"[" * 100_000 + b"]" * 100_000, r"config.json is not valid JSON"),
    ("config_no_model_type", "config.json", b'{"hidden_size": 64}', r'has no "model_type"'),
    ("tokenizer_config_list", "tokenizer_config.json", b'["<bos>"]', r"tokenizer_config.json must hold a JSON object"),
    ("tokenizer_config_not_utf8", "tokenizer_config.json", b'{"bos_token": "\xc3\x28"}',
     r"tokenizer_config.json is not UTF-8"),
    ("tokenizer_config_bad_json", "tokenizer_config.json", b"{bos_token: 1", r"tokenizer_config.json is not valid JSON"),
    ("tokenizer_config_template_int", "tokenizer_config.json", b'{"chat_template": 5}', r"chat_template must be a string"),
    ("tokenizer_config_bos_int", "tokenizer_config.json", b'{"bos_token": 7}', r'"bos_token" must be a token string'),
    ("tokenizer_config_add_bos_str", "tokenizer_config.json", b'{"add_bos_token": "yes"}',
     r'"add_bos_token" must be true or false'),
    ("tokenizer_json_garbage", "tokenizer.json", b'{"model": 12}', r"tokenizer.json could not be parsed"),
    ("tokenizer_json_not_utf8", "tokenizer.json", b"\xff\xfe\x00garbage", r"tokenizer.json could not be parsed"),
    ("chat_template_jinja_not_utf8", "chat_template.jinja", b"{{ bos_token }}\xff", r"chat_template.jinja is not UTF-8"),
    ("chat_template_json_list", "chat_template.json", b"[1]", r"chat_template.json must hold a JSON object"),
    ("generation_config_bad_json", "generation_config.json", b"{eos", r"generation_config.json is not valid JSON"),
    ("generation_config_list", "generation_config.json", b"[1]", r"generation_config.json must hold a JSON object"),
    ("generation_config_temperature_str", "generation_config.json", b'{"temperature": "hot"}',
     r"generation_config.json: SamplingParams.temperature must be a number"),
    ("generation_config_top_p_2", "generation_config.json", b'{"top_p": 2.0}',
     r"generation_config.json: SamplingParams.top_p must be in \(0, 1\]"),
    ("generation_config_rep_penalty_zero", "generation_config.json", b'{"repetition_penalty": 0}',
     r"generation_config.json: SamplingParams.repetition_penalty must be > 0"),
    ("index_not_json", "model.safetensors.index.json", b"{", r"index.json is malformed"),
    ("index_map_list", "model.safetensors.index.json", b'{"weight_map": ["model.safetensors"]}',
     r'"weight_map" must be a non-empty object'),
    ("index_shard_int", "model.safetensors.index.json", b'{"weight_map": {"a": 5}}', r"names a weight shard 5"),
    ("index_shard_missing", "model.safetensors.index.json", b'{"weight_map": {"a": "model-2.safetensors"}}',
     r"missing weight shards listed in model.safetensors.index.json: model-2.safetensors"),
    ("index_shard_absolute", "model.safetensors.index.json", b'{"weight_map": {"a": "/etc/passwd"}}',
     r"lies outside"),
    ("safetensors_garbage", "model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage", r"Could not read weights"),
    ("safetensors_empty", "model.safetensors", b"", r"Could not read weights"),
]


@pytest.mark.parametrize("name, content, match", [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_damaged_file_refused(tiny_models, tmp_path, name, content, match):
    d = copy_model(tiny_models, "llama", tmp_path / "model")
    if name == "chat_template.jinja":  # only read when tokenizer_config.json has no template
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        del cfg["chat_template"]
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / name).write_bytes(content)
    assert_refused(lambda: load_model(d), match, tmp_path)


def test_index_shard_outside_the_model_dir_is_refused(tiny_models, tmp_path):
    """The shard exists (a real safetensors file beside the model dir), so only the check stops it."""
    d = copy_model(tiny_models, "llama", tmp_path / "model")
    shutil.copy(d / "model.safetensors", tmp_path / "outside.safetensors")
    (d / "model.safetensors").unlink()
    names = list(mx.load(str(tmp_path / "outside.safetensors")))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, "../outside.safetensors")}))
    assert_refused(lambda: load_model(d), r"'\.\./outside\.safetensors', which lies outside", tmp_path)


def test_model_path_with_nul_refused():
    assert_refused(lambda: load_model("model\x00dir"), r"contains a NUL byte")


def _edit_weights(d: Path, edit: Callable[[dict[str, mx.array]], None]) -> None:
    weights = dict(mx.load(str(d / "model.safetensors")))
    edit(weights)
    mx.save_safetensors(str(d / "model.safetensors"), weights)


def _poke(name: str, value: float) -> Callable[[dict[str, mx.array]], None]:
    def edit(w: dict[str, mx.array]) -> None:
        a = np.array(w[name])
        a.flat[a.size // 2] = value
        w[name] = mx.array(a)
    return edit


def _retype(name: str, dtype: mx.Dtype) -> Callable[[dict[str, mx.array]], None]:
    def edit(w: dict[str, mx.array]) -> None:
        w[name] = w[name].astype(dtype)
    return edit


WEIGHT_CASES = [
    ("nan", _poke("model.layers.0.mlp.up_proj.weight", float("nan")), r"'model.layers.0.mlp.up_proj.weight'.*NaN or infinite"),
    ("inf", _poke("model.embed_tokens.weight", float("inf")), r"'model.embed_tokens.weight'.*NaN or infinite"),
    ("neg_inf", _poke("model.norm.weight", -float("inf")), r"'model.norm.weight'.*NaN or infinite"),
    ("int32", _retype("model.layers.1.self_attn.q_proj.weight", mx.int32), r"dtype mlx.core.int32.*floating-point"),
    ("bool", _retype("model.norm.weight", mx.bool_), r"dtype mlx.core.bool.*floating-point"),
    ("uint32_without_scales", _retype("lm_head.weight", mx.uint32), r"'lm_head.weight' has dtype mlx.core.uint32"),
    ("wrong_shape", lambda w: w.update({"model.norm.weight": mx.ones((32,))}), r"do not match a llama model"),
    ("missing_tensor", lambda w: w.pop("model.layers.1.mlp.down_proj.weight"), r"do not match a llama model"),
]


@pytest.mark.parametrize("edit, match", [c[1:] for c in WEIGHT_CASES], ids=[c[0] for c in WEIGHT_CASES])
def test_bad_weights_refused(tiny_models, tmp_path, edit, match):
    d = copy_model(tiny_models, "llama", tmp_path / "model")
    _edit_weights(d, edit)
    assert_refused(lambda: load_model(d), match, tmp_path)


# ---------------------------------------------------------------------------------------------
# GGUF

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


# ---------------------------------------------------------------------------------------------
# Sampling parameters

SAMPLING_REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("temp_negative", {"temperature": -1.0}, r"temperature must be >= 0"),
    ("temp_nan", {"temperature": float("nan")}, r"temperature must be a finite number"),
    ("temp_inf", {"temperature": float("inf")}, r"temperature must be a finite number"),
    ("temp_1e39", {"temperature": 1e39}, r"temperature must be a finite number in float32 range"),
    ("temp_str", {"temperature": "0.5"}, r"temperature must be a number"),
    ("temp_bool", {"temperature": True}, r"temperature must be a number"),
    ("top_p_zero", {"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ("top_p_negative", {"top_p": -0.1}, r"top_p must be in \(0, 1\]"),
    ("top_p_above_one", {"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ("top_p_nan", {"top_p": float("nan")}, r"top_p must be a finite number"),
    ("top_k_negative", {"top_k": -1}, r"top_k must be >= 0"),
    ("top_k_float", {"top_k": 1.5}, r"top_k must be an integer"),
    ("min_p_above_one", {"min_p": 2.0}, r"min_p must be in \[0, 1\]"),
    ("min_p_negative", {"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
    ("min_tokens_zero", {"min_tokens_to_keep": 0}, r"min_tokens_to_keep must be >= 1"),
    ("rep_zero", {"repetition_penalty": 0.0}, r"repetition_penalty must be > 0"),
    ("rep_negative", {"repetition_penalty": -1.0}, r"repetition_penalty must be > 0"),
    ("rep_1e-40", {"repetition_penalty": 1e-40}, r"repetition_penalty must be in \[0.0001, 10000\]"),
    ("rep_1e39", {"repetition_penalty": 1e39}, r"repetition_penalty must be a finite number in float32"),
    ("rep_1e5", {"repetition_penalty": 1e5}, r"repetition_penalty must be in \[0.0001, 10000\]"),
    ("presence_1e39", {"presence_penalty": 1e39}, r"presence_penalty must be a finite number in float32"),
    ("presence_101", {"presence_penalty": 101.0}, r"presence_penalty must be in \[-100, 100\]"),
    ("frequency_minus_1e3", {"frequency_penalty": -1e3}, r"frequency_penalty must be in \[-100, 100\]"),
    ("context_negative", {"repetition_context_size": -1}, r"repetition_context_size must be >= 0"),
    ("bias_1e39", {"logit_bias": {0: 1e39}}, r"logit_bias\[0\] must be a finite number in float32"),
    ("bias_101", {"logit_bias": {0: 101.0}}, r"logit_bias\[0\] must be in \[-100, 100\]"),
    ("bias_inf", {"logit_bias": {0: float("-inf")}}, r"logit_bias\[0\] must be a finite number"),
    ("bias_id_negative", {"logit_bias": {-1: 1.0}}, r"token id must be >= 0"),
    ("bias_id_2e40", {"logit_bias": {2**40: 1.0}}, r"token id must be < 2\*\*31"),
    ("bias_id_superscript", {"logit_bias": {"\u00b2": 1.0}}, r"keys must be token ids"),
    ("bias_id_word", {"logit_bias": {"a": 1.0}}, r"keys must be token ids"),
    ("bias_list", {"logit_bias": [1, 2]}, r"logit_bias must be a mapping"),
    ("seed_2e64", {"seed": 2**64}, r"seed must be a non-negative integer below 2\*\*64"),
    ("seed_negative", {"seed": -1}, r"seed must be a non-negative integer"),
    ("seed_float", {"seed": 1.5}, r"seed must be an integer"),
    ("top_logprobs_21", {"logprobs": True, "top_logprobs": 21}, r"top_logprobs must be in 0..20"),
    ("top_logprobs_without_logprobs", {"top_logprobs": 3}, r"top_logprobs must be 0 unless logprobs"),
    ("xtc_probability_1.5", {"xtc_probability": 1.5}, r"xtc_probability must be in \[0, 1\]"),
    ("xtc_threshold_0.6", {"xtc_threshold": 0.6}, r"xtc_threshold must be in \[0, 0.5\]"),
    ("logprobs_str", {"logprobs": "yes"}, r"logprobs must be True or False"),
]


@pytest.mark.parametrize("kwargs, match", [c[1:] for c in SAMPLING_REFUSED], ids=[c[0] for c in SAMPLING_REFUSED])
def test_sampling_value_refused(kwargs, match):
    assert_refused(lambda: SamplingParams(**kwargs), match)


def test_rng_seed_2e64_refused():
    assert_refused(lambda: RequestRNG(2**64), r"seed must be a non-negative integer below 2\*\*64")


def test_logit_bias_id_outside_vocab_refused():
    assert_refused(lambda: make_sampler(SamplingParams(logit_bias={320: 1.0}), vocab_size=320),
                   r"token ids must be in \[0, 320\)")


# Accepted with the documented meaning: these used to give uniform random tokens.
_LOGITS = mx.array([[0.0, 0.5, 1.0, 0.2, -0.3, 0.9, 0.1, 0.4]])  # (1, 8): argmax 2, close runners-up


def _draws(params: SamplingParams, n: int = 24) -> set[int]:
    s = make_sampler(params)
    return {int(s(_LOGITS, [], RequestRNG(seed)).item()) for seed in range(n)}


NEAR_GREEDY = [
    ("temp_3e-39", {"temperature": 3e-39}),
    ("temp_1e-39_subnormal", {"temperature": 1e-39}),
    ("temp_1e-30", {"temperature": 1e-30}),
    ("temp_5e-7", {"temperature": 5e-7}),
    ("top_p_1e-46_rounds_to_0", {"temperature": 1.0, "top_p": 1e-46}),
    ("top_p_1e-300", {"temperature": 1.0, "top_p": 1e-300}),
    ("top_p_5e-324", {"temperature": 1.0, "top_p": 5e-324}),
    ("top_p_1e-40_subnormal", {"temperature": 1.0, "top_p": 1e-40}),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in NEAR_GREEDY], ids=[c[0] for c in NEAR_GREEDY])
def test_degenerate_sampling_is_near_greedy(kwargs):
    result = bounded(lambda: _draws(SamplingParams(**kwargs)))
    assert "error" not in result, result.get("error")
    assert result["value"] == {2}, f"not the argmax every time: {result['value']}"


def test_sampling_control_is_not_greedy():
    """The check above can fail: ordinary temperature 1 draws several different tokens."""
    assert len(_draws(SamplingParams(temperature=1.0))) > 2


def test_logit_bias_100_forces_a_token():
    assert _draws(SamplingParams(temperature=1.0, logit_bias={6: 100.0})) == {6}


def test_sample_function_tiny_temperature_is_argmax():
    assert {int(sample(_LOGITS, temperature=1e-39, rng=RequestRNG(s)).item()) for s in range(16)} == {2}
    assert_refused(lambda: sample(_LOGITS, temperature=float("nan")), r"temperature must be >= 0")


# ---------------------------------------------------------------------------------------------
# CLI: generate, convert, bench

def _generate(*flags: str) -> list[str]:
    return ["generate", "--model", "{model}", "--prompt", "hi", *flags]


CLI_CASES: list[tuple[str, list[str], str]] = [
    ("temp_word", _generate("--temp", "abc"), r"argument --temp: invalid float value: 'abc'"),
    ("temp_nan", _generate("--temp", "nan"), r"temperature must be a finite number"),
    ("temp_negative", _generate("--temp", "-1"), r"temperature must be >= 0"),
    ("temp_1e39", _generate("--temp", "1e39"), r"temperature must be a finite number in float32"),
    ("top_p_zero", _generate("--top-p", "0"), r"top_p must be in \(0, 1\]"),
    ("top_p_two", _generate("--top-p", "2"), r"top_p must be in \(0, 1\]"),
    ("top_k_negative", _generate("--top-k", "-3"), r"top_k must be >= 0"),
    ("top_k_float", _generate("--top-k", "1.5"), r"argument --top-k: invalid int value"),
    ("min_p_five", _generate("--min-p", "5"), r"min_p must be in \[0, 1\]"),
    ("rep_penalty_zero", _generate("--repetition-penalty", "0"), r"repetition_penalty must be > 0"),
    ("rep_penalty_negative", _generate("--repetition-penalty", "-1"), r"repetition_penalty must be > 0"),
    ("seed_2e64", _generate("--seed", str(2**64)), r"seed must be a non-negative integer below 2\*\*64"),
    ("seed_negative", _generate("--seed", "-1"), r"seed must be a non-negative integer"),
    ("seed_word", _generate("--seed", "abc"), r"argument --seed: invalid int value"),
    ("max_tokens_negative", _generate("--max-tokens", "-1"), r"--max-tokens must be >= 0"),
    ("max_tokens_word", _generate("--max-tokens", "many"), r"argument --max-tokens/-m: invalid int value"),
    ("checkpoint_dot", _generate("--checkpoint", "."), r"--checkpoint '\.' is the current directory or one above it"),
    ("checkpoint_dotdot", _generate("--checkpoint", ".."), r"--checkpoint '\.\.' is the current directory or one above"),
    ("checkpoint_empty", _generate("--checkpoint", " "), r"--checkpoint needs a directory path"),
    ("checkpoint_file", _generate("--checkpoint", "{file}"), r"is an existing file, not a checkpoint directory"),
    ("checkpoint_model_dir", _generate("--checkpoint", "{model}"), r"is \(or holds\) the model"),
    ("resume_dot", _generate("--resume", "."), r"--resume '\.' is the current directory"),
    ("checkpoint_and_resume", _generate("--checkpoint", "a", "--resume", "b"), r"not both"),
    ("checkpoint_every_zero", _generate("--checkpoint", "run", "--checkpoint-every", "0"), r"--checkpoint-every must be >= 1"),
    ("dtype_int8", _generate("--dtype", "int8"), r"argument --dtype: invalid choice: 'int8'"),
    ("unknown_flag", _generate("--bogus"), r"unrecognized arguments: --bogus"),
    ("no_prompt", ["generate", "--model", "{model}"], r"the following arguments are required: --prompt"),
    ("no_command", [], r"the following arguments are required: command"),
    ("stop_empty", _generate("--stop", ""), r"--stop needs a non-empty string"),
    ("prompt_not_utf8", ["generate", "--model", "{model}", "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")],
     r"--prompt is not valid UTF-8"),
    ("model_missing", ["generate", "--model", "{missing}", "--prompt", "hi"], r"does not exist"),
    ("model_not_gguf_file", ["generate", "--model", "{file}", "--prompt", "hi"], r"neither a GGUF file"),
    ("model_bad_config", ["generate", "--model", "{badmodel}", "--prompt", "hi"], r'"hidden_size" must be an integer'),
    ("model_corrupt_gguf", ["generate", "--model", "{badgguf}", "--prompt", "hi"], r"truncated"),
    ("convert_quantize_3", ["convert", "--model", "{model}", "--mlx-path", "out", "-q", "3"], r"--quantize takes 4 or 8"),
    ("convert_group_7", ["convert", "--model", "{model}", "--mlx-path", "out", "-q", "4", "--q-group-size", "7"],
     r"group_size must be one of"),
    ("convert_into_source", ["convert", "--model", "{model}", "--mlx-path", "{model}", "--overwrite"],
     r"is \(or holds\) the source"),
    ("convert_over_parent", ["convert", "--model", "{model}", "--mlx-path", "{case}", "--overwrite"],
     r"is \(or holds\) the source|current directory"),
    ("convert_over_cwd", ["convert", "--model", "{src}", "--mlx-path", ".", "--overwrite"],
     r"is the current directory or one above it; refusing to write a model there"),
    ("convert_missing_source", ["convert", "--model", "{missing}", "--mlx-path", "out"], r"does not exist"),
    ("convert_onto_file", ["convert", "--model", "{model}", "--mlx-path", "{file}"], r"exists and is not a directory"),
    ("convert_bad_config", ["convert", "--model", "{badmodel}", "--mlx-path", "out"], r'"hidden_size" must be an integer'),
    ("convert_corrupt_gguf", ["convert", "--model", "{badgguf}", "--mlx-path", "out"], r"truncated"),
    ("convert_dtype_bad", ["convert", "--model", "{model}", "--mlx-path", "out", "--dtype", "fp8"], r"invalid choice"),
    ("bench_prompt_tokens_zero", ["bench", "--model", "{model}", "-p", "0"], r"--prompt-tokens must be >= 1"),
    ("bench_trials_zero", ["bench", "--model", "{model}", "-n", "0"], r"--num-trials must be >= 1"),
    ("bench_batch_negative", ["bench", "--model", "{model}", "-b", "-1"], r"--batch-size must be >= 1"),
    ("bench_generation_word", ["bench", "--model", "{model}", "-g", "lots"], r"invalid int value"),
    ("bench_compare_unknown", ["bench", "--model", "{model}", "--compare", "vllm"], r"unknown engine 'vllm'"),
    ("bench_compare_twice", ["bench", "--model", "{model}", "--compare", "mlx-lm,mlx-lm"], r"names an engine twice"),
    ("bench_json_is_dir", ["bench", "--model", "{model}", "--json", "{case}"], r"--json .* is a directory"),
    ("bench_plot_under_file", ["bench", "--model", "{model}", "--plot", "{file}/x.png"], r"is a file, so the output"),
    ("bench_model_missing", ["bench", "--model", "{missing}"], r"does not exist"),
]


@pytest.fixture
def cli_case(tiny_models, tmp_path, mlx_infer_cache) -> dict[str, str]:
    """A working directory holding a model, a plain file, a bad-config model and a corrupt GGUF."""
    model = copy_model(tiny_models, "llama", tmp_path / "model")
    bad = copy_model(tiny_models, "llama", tmp_path / "badmodel")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = "abc"
    (bad / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 1))
    return {"model": str(model), "file": str(tmp_path / "notes.txt"), "missing": str(tmp_path / "nope"),
            "badmodel": str(bad), "badgguf": str(tmp_path / "bad.gguf"), "case": str(tmp_path),
            "src": str(tiny_models["llama"])}  # a model outside the working directory


@pytest.mark.parametrize("args, match", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_refuses_in_one_line(cli_case, tmp_path, args, match):
    argv = [a.format(**cli_case) if "{" in a else a for a in args]
    assert_cli_refuses(argv, tmp_path, match)


def test_cli_stdin_not_utf8(cli_case, tmp_path):
    assert_cli_refuses(["generate", "--model", cli_case["model"], "--prompt", "-"], tmp_path,
                       r"the prompt on stdin is not UTF-8 text \(byte 3", stdin=b"abc\xff\xfe rest")


def test_cli_stdin_utf8_still_works(cli_case, tmp_path):
    """The control: a UTF-8 prompt on stdin generates."""
    r = cli(["generate", "--model", cli_case["model"], "--prompt", "-", "--max-tokens", "3"], tmp_path,
            stdin="Hello café".encode())
    assert r.returncode == 0, r.stderr.decode()
