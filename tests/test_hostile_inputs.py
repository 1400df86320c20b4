"""Hostile inputs to loading (config.json, tokenizer files, safetensors, index.json) and sampling.

Hardening issue, section 4; the harness (what every case asserts) is tests/hostile.py, GGUF
cases are in test_hostile_gguf.py and CLI cases in test_hostile_cli.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
import pytest
from hostile import assert_refused, bounded, copy_model, tiny_model_dirs

from mlx_infer.artifacts.loader import load_model
from mlx_infer.sampling import RequestRNG, SamplingParams, make_sampler, sample


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    return tiny_model_dirs(tmp_path_factory)


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


# Gemma 4 and Diffusion Gemma, through the registry's ModelArgs.from_dict (their tiny checkpoints
# are built in test_gemma4.py / test_denoising.py against transformers; the fields are what matters here).
_S, _F = "sliding_attention", "full_attention"
_GEMMA4 = dict(
    model_type="gemma4_text", vocab_size=256, vocab_size_per_layer_input=256, hidden_size=64, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
    hidden_size_per_layer_input=0, num_hidden_layers=3, layer_types=[_S, _S, _F],
    rope_parameters={_S: {"rope_type": "default", "rope_theta": 10_000.0},
                     _F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}},
)
ARGS_CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("g4_per_layer_key_out_of_range", "gemma4_text", {"per_layer_config": {"7": {"head_dim": 16}}},
     r'"per_layer_config" key \'7\' must be full_attention, sliding_attention or a layer index below 3'),
    ("g4_per_layer_value_str", "gemma4_text", {"per_layer_config": {_F: "wide"}}, r'"per_layer_config"\[.full_attention.\] must be an object'),
    ("g4_per_layer_head_dim_zero", "gemma4_text", {"per_layer_config": {_F: {"head_dim": 0}}},
     r'"head_dim of layer 2" must be >= 1'),
    ("g4_per_layer_kv_not_divisor", "gemma4_text", {"per_layer_config": {_F: {"num_key_value_heads": 3}}},
     r'multiple of "num_key_value_heads of layer 2"'),
    ("g4_rope_unknown_type", "gemma4_text", {"rope_parameters": {_S: {"rope_type": "ntk"}, _F: {"rope_type": "default"}}},
     r'"rope_parameters.sliding_attention" names RoPE type \'ntk\''),
    ("g4_partial_rotary_zero", "gemma4_text",
     {"rope_parameters": {_S: {"rope_type": "default"}, _F: {"rope_type": "proportional", "partial_rotary_factor": 0}}},
     r'"rope_parameters.full_attention.partial_rotary_factor" must be > 0'),
    ("g4_layer_types_unknown", "gemma4_text", {"layer_types": [_S, "local", _F]}, r"\"layer_types\"\[1\] is 'local'"),
    ("g4_experts_zero", "gemma4_text", {"enable_moe_block": True, "num_experts": 0, "top_k_experts": 1,
                                        "moe_intermediate_size": 8}, r'"num_experts" must be >= 1'),
    ("g4_shared_layers_negative", "gemma4_text", {"num_kv_shared_layers": -1}, r'"num_kv_shared_layers" must be >= 0'),
    ("g4_ple_width_str", "gemma4_text", {"hidden_size_per_layer_input": "8"}, r'"hidden_size_per_layer_input" must be an integer'),
    ("dg_text_config_bad", "diffusion_gemma", {"text_config": {**_GEMMA4, "head_dim": -16}}, r'"head_dim" must be >= 1'),
    ("dg_canvas_str", "diffusion_gemma", {"canvas_length": "256", "text_config": _GEMMA4},
     r"\"canvas_length\" must be an integer"),
]


@pytest.mark.parametrize("model_type, overrides, match", [c[1:] for c in ARGS_CASES], ids=[c[0] for c in ARGS_CASES])
def test_model_args_refused(model_type, overrides, match):
    from mlx_infer.artifacts.loader import build_model

    config = {**_GEMMA4, **overrides, "model_type": model_type}
    msg = assert_refused(lambda: build_model(config, Path("/models/x/config.json")), match)
    assert "/models/x/config.json" in msg


def test_model_args_control_builds():
    """The base config of the cases above is valid (each case fails only by its override)."""
    from mlx_infer.artifacts.loader import build_model

    assert build_model(dict(_GEMMA4), Path("config.json")) is not None
    assert build_model({"model_type": "diffusion_gemma", "text_config": dict(_GEMMA4)}, Path("config.json")) is not None


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



def test_prompt_ids_outside_the_vocabulary_are_refused(tmp_path):
    """A tokenizer larger than the embedding (or foreign ids) must not read past its rows."""
    from mlx_infer.errors import MlxInferError
    from mlx_infer.generation.autoregressive import generate_tokens
    from tiny import make_tiny_model_dir

    loaded = load_model(make_tiny_model_dir(tmp_path / "m", "llama"))
    vocab = loaded.model.args.vocab_size
    for bad in ([1, vocab], [-1], [1, 2, 10**12]):
        with pytest.raises(MlxInferError, match="outside the model's vocabulary"):
            list(generate_tokens(loaded.model, bad, max_tokens=2))


def test_model_path_that_is_a_symlink_loop_says_so(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(ValueError, match="loops or points nowhere"):
        load_model(str(loop))
