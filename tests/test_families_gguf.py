"""GGUF files of the families llama.cpp exports (gemma2, olmo2, granite, qwen3moe, smollm3, gpt-oss, phi3,
glm4, deepseek2), read back.

Each tiny checkpoint transformers saved (tests/families.py) is written as a GGUF the way
llama.cpp's ``convert_hf_to_gguf.py`` writes it: tensor names from the gguf package's own
HF -> GGUF table, its value changes (Gemma norms stored as ``1 + w``; q/k rows permuted by
the Llama-derived converters, Granite's), merged expert tensors (``ffn_*_exps``), and the
family's metadata keys. Oracles: the weights read back equal the checkpoint's exactly (F32
file) and, through ``load_model(file.gguf)``, the greedy tokens equal the safetensors load's;
a Q8_0 file loads and runs eager == engine.
"""

from __future__ import annotations

import json
import math

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from families import SPECS, hf_setup
from mlx_infer.artifacts.gguf import read_gguf
from mlx_infer.artifacts.loader import load_model
from test_families_paths import PROMPTS, eager_tokens, engine_tokens
from test_gguf import llama_permute

GGUF_SPECS = [n for n, s in SPECS.items()
              if s.gguf_arch in ("gemma2", "olmo2", "granite", "qwen3moe", "smollm3", "gpt-oss", "phi3", "glm4",
                                         "deepseek2")]


def _vocab(src) -> dict:
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    special = {a["content"] for a in tok.get("added_tokens", [])}
    return dict(tokens=tokens, merges=merges, types=[3 if t in special else 1 for t in tokens])


def write_family_gguf(name: str, path, qtype=Q.F32) -> dict[str, np.ndarray]:
    """Write the spec's checkpoint as llama.cpp would; return the HF weights it holds (numpy)."""
    arch = SPECS[name].gguf_arch
    src, cfg, _, _ = hf_setup(name)
    hf = {k: np.array(v) for k, v in mx.load(str(src / "model.safetensors")).items()}
    original = dict(hf)
    n_layers, heads, kv_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if arch == "qwen3moe":  # the converter merges each layer's experts
        n_exp = cfg.get("num_experts") or cfg["num_local_experts"]
        for i in range(n_layers):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                hf[f"model.layers.{i}.mlp.experts.{proj}.weight"] = np.stack(
                    [hf.pop(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight") for e in range(n_exp)])
    if arch == "gpt-oss":  # the converter de-interleaves gate/up and stores (E, out, in)
        for i in range(n_layers):
            p = f"model.layers.{i}.mlp.experts."
            gu, gub = hf.pop(p + "gate_up_proj"), hf.pop(p + "gate_up_proj_bias")
            hf[p + "gate_proj.weight"] = gu[..., ::2].swapaxes(-1, -2)
            hf[p + "up_proj.weight"] = gu[..., 1::2].swapaxes(-1, -2)
            hf[p + "gate_proj.bias"], hf[p + "up_proj.bias"] = gub[..., ::2], gub[..., 1::2]
            hf[p + "down_proj.weight"] = hf.pop(p + "down_proj").swapaxes(-1, -2)
            hf[p + "down_proj.bias"] = hf.pop(p + "down_proj_bias")
    if arch == "deepseek2":  # merged experts; kv_b_proj split into k_b (transposed) and v_b; the router bias renamed
        nope, v_dim = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        for i in range(n_layers):
            p = f"model.layers.{i}."
            if p + "mlp.experts.0.gate_proj.weight" in hf:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    hf[p + f"mlp.experts.{proj}.weight"] = np.stack(
                        [hf.pop(p + f"mlp.experts.{e}.{proj}.weight") for e in range(cfg["n_routed_experts"])])
                hf[p + "mlp.gate.e_score_correction.bias"] = hf.pop(p + "mlp.gate.e_score_correction_bias")
            kv_b = hf.pop(p + "self_attn.kv_b_proj.weight").reshape(heads, nope + v_dim, -1)
            hf[p + "self_attn.k_b_proj.weight"] = kv_b[:, :nope].swapaxes(1, 2)
            hf[p + "self_attn.v_b_proj.weight"] = kv_b[:, nope:]
    if cfg.get("tie_word_embeddings"):
        hf.pop("lm_head.weight", None)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], n_layers)
    tensors = {}
    for k, v in hf.items():
        g = name_map.get_name(k, try_suffixes=(".weight", ".bias"))
        assert g is not None, k
        if k.endswith(".sinks"):
            g += ".weight"  # as llama.cpp's gpt-oss converter names it
        if arch in ("granite", "smollm3") and ".attn_q." in g:  # LlamaModel's converters permute q/k
            v = llama_permute(v, heads, heads)
        elif arch in ("granite", "smollm3") and ".attn_k." in g:
            v = llama_permute(v, heads, kv_heads)
        elif arch == "gemma2" and g.endswith("norm.weight"):
            v = v + np.float32(1.0)
        tensors[g] = v.astype(np.float32)

    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rp = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {name}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    if arch == "deepseek2":  # MLA as llama.cpp writes it: one KV head of the latent (+ the rope key)
        rank, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        w.add_head_count_kv(1)
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope)
        w.add_value_length_mla(cfg["v_head_dim"])
        w.add_kv_lora_rank(rank)
        if cfg.get("q_lora_rank"):
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_rope_dimension_count(rope)
        w.add_expert_count(cfg["n_routed_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    else:
        w.add_head_count_kv(kv_heads)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "granite":
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if arch == "gpt-oss":
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "glm4":
        w.add_rope_dimension_count(int(head_dim * rp.get("partial_rotary_factor", 0.5)))
    if arch == "phi3":
        rope_dims = int(head_dim * rp.get("partial_rotary_factor", 1.0))
        w.add_rope_dimension_count(rope_dims)
        if cfg.get("sliding_window"):
            w.add_sliding_window(cfg["sliding_window"])
        if rp.get("rope_type") == "longrope":  # llama.cpp: factors as tensors, the rest as keys
            orig = rp["original_max_position_embeddings"]
            scale = cfg["max_position_embeddings"] / orig
            w.add_rope_scaling_orig_ctx_len(orig)
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
            tensors["rope_factors_long.weight"] = np.array(rp["long_factor"], np.float32)
            tensors["rope_factors_short.weight"] = np.array(rp["short_factor"], np.float32)
    if arch in ("qwen3moe", "gpt-oss"):
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    vocab = _vocab(src)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for g, data in tensors.items():
        if data.ndim == 2 and qtype != Q.F32 and data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            w.add_tensor(g, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(g, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return original


@pytest.mark.parametrize("name", GGUF_SPECS)
def test_family_gguf_reads_back_the_checkpoint(name, tmp_path):
    path = tmp_path / f"{name}.gguf"
    hf = write_family_gguf(name, path)
    art = read_gguf(path)
    src, cfg, _, _ = hf_setup(name)
    assert art.config["model_type"] == cfg["model_type"]
    ours = load_model(src, cpu_kernels=False).model
    want = ours.sanitize({k: mx.array(v) for k, v in hf.items()})
    got = ours.sanitize(dict(art.weights))
    assert sorted(got) == sorted(want)
    # Gemma's norms round-trip through 1 + w in float32: within one ulp of 1, not bit for bit.
    atol = 2e-7 if SPECS[name].gguf_arch == "gemma2" else 0.0
    for k in want:
        np.testing.assert_allclose(np.array(got[k]), np.array(want[k]), rtol=0, atol=atol, err_msg=k)
    from_gguf = load_model(path, cpu_kernels=False)
    ref = load_model(src, cpu_kernels=False)
    ids = mx.array(hf_setup(name)[2])
    a, b = np.array(from_gguf.model(ids)), np.array(ref.model(ids))
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 if atol else 0.0)  # the same graph, config and weights
    assert [eager_tokens(from_gguf, p) for p in PROMPTS] == [eager_tokens(ref, p) for p in PROMPTS]


@pytest.mark.parametrize("name", GGUF_SPECS)
def test_family_q8_gguf_runs_eager_and_engine(name, tmp_path):
    path = tmp_path / f"{name}-q8.gguf"
    write_family_gguf(name, path, qtype=Q.Q8_0)
    loaded = load_model(path, cpu_kernels=False)
    want = [eager_tokens(loaded, p) for p in PROMPTS]
    assert len(set().union(*want)) >= 3, want
    assert engine_tokens(load_model(path, cpu_kernels=False), name) == want
