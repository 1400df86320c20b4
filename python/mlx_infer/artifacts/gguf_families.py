"""GGUF support for the families of issue 20 that llama.cpp exports: gemma2, olmo2, granite, qwen3moe, smollm3, gpt-oss,
phi3, glm4, deepseek2.

Three pieces per architecture, each undoing what llama.cpp's ``convert_hf_to_gguf.py`` does:

- :func:`family_config`: the family's metadata keys into HF ``config.json`` fields
  (soft caps and windows, Granite's multipliers, the expert layout);
- :func:`hf_names`: GGUF tensor names -> ours, as the inverse of the gguf package's own
  HF -> GGUF table (``gguf.get_tensor_name_map``, the one llama.cpp's converter uses),
  taken over the parameters our graph of that config has (merged experts map to
  ``switch_mlp``);
- :func:`untransform`: the value changes (Gemma's norms stored as ``1 + w``; the q/k row
  permutation of llama.cpp's Llama-derived converters, Granite's among them).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import UnsupportedModelError

if TYPE_CHECKING:
    from .gguf_config import Meta

#: GGUF ``general.architecture`` -> (HF model_type, HF architectures entry) of the families here.
FAMILY_ARCHITECTURES = {
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
    "granite": ("granite", "GraniteForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "glm4": ("glm4", "Glm4ForCausalLM"),
    "deepseek2": ("deepseek_v3", "DeepseekV3ForCausalLM"),
}
#: Our parameter-name pieces -> the HF names the gguf table knows them by.
_LOOKUP_RENAMES = (
    (".switch_mlp.", ".experts."),  # merged experts
    (".self_attn.embed_q.", ".self_attn.k_b_proj."),  # DeepSeek's kv_b_proj, split as llama.cpp splits it
    (".self_attn.unembed_out.", ".self_attn.v_b_proj."),
    (".e_score_correction_bias", ".e_score_correction.bias"),
)
#: Tensors that are config, not weights: read by :func:`rope_factors_config` (Phi-3's LongRoPE factors).
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
#: Architectures whose converter (a ``LlamaModel`` subclass) permutes the q/k rows for interleaved RoPE.
PERMUTED_QK = {"granite", "smollm3"}
#: Architectures whose converter stores RMSNorm weights as ``1 + w``.
PLUS_ONE_NORMS = {"gemma2"}


def family_config(m: "Meta", config: dict[str, Any], tensors: dict[str, Any]) -> None:
    """Add the family's fields (read from the GGUF metadata through ``m``) to ``config``."""
    arch, a = m.arch, f"{m.arch}."
    n_layers = config["num_hidden_layers"]
    if arch == "gemma2":
        scale = m.number(a + "attention.scale", lo=0.0, lo_open=True, default=None)
        if scale:
            qpas = float(1.0 / scale**2)
        elif n_layers == 46:  # Gemma 2 27B scales by hidden / heads (llama.cpp does the same)
            qpas = config["hidden_size"] // config["num_attention_heads"]
        else:
            qpas = config["head_dim"]
        config.update({
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": qpas,
            "sliding_window": m.integer(a + "attention.sliding_window", lo=1, hi=1 << 30, default=4096),
            # llama.cpp hard-codes Gemma 2's pattern: even layers slide.
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)],
            "attn_logit_softcapping": m.number(a + "attn_logit_softcapping", lo=0.0, lo_open=True, default=None),
            "final_logit_softcapping": m.number(a + "final_logit_softcapping", lo=0.0, lo_open=True, default=None),
        })
    elif arch == "olmo2":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    elif arch == "granite":
        config.update({
            "attention_bias": "blk.0.attn_q.bias" in tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in tensors,
            "attention_multiplier": m.number(a + "attention.scale", lo=0.0, lo_open=True,
                                             default=config["head_dim"] ** -0.5),
            "embedding_multiplier": m.number(a + "embedding_scale", lo=0.0, lo_open=True, default=1.0),
            "residual_multiplier": m.number(a + "residual_scale", lo=0.0, lo_open=True, default=1.0),
            "logits_scaling": m.number(a + "logit_scale", lo=0.0, lo_open=True, default=1.0),
        })
    elif arch == "smollm3":
        # llama.cpp has no key for it: every 4th layer goes without RoPE (hard-coded, as in SmolLM3-3B).
        config.update({"attention_bias": "blk.0.attn_q.bias" in tensors, "no_rope_layer_interval": 4})
    elif arch == "phi3":
        dims = m.integer(a + "rope.dimension_count", lo=1, hi=config["head_dim"], default=config["head_dim"])
        window = m.integer(a + "attention.sliding_window", lo=0, hi=1 << 30, default=0)
        config.update({"partial_rotary_factor": dims / config["head_dim"], "sliding_window": window or None})
    elif arch == "glm4":  # llama.cpp rotates GLM-4 interleaved ("NORM") as HF does: no permutation
        dims = m.integer(a + "rope.dimension_count", lo=1, hi=config["head_dim"], default=config["head_dim"] // 2)
        config.update({"partial_rotary_factor": dims / config["head_dim"],
                       "attention_bias": "blk.0.attn_q.bias" in tensors})
    elif arch == "deepseek2":
        _deepseek2_config(m, config)
    elif arch == "gpt-oss":
        experts = m.integer(a + "expert_count", lo=1, hi=1 << 16)
        config.update({
            "num_local_experts": experts,
            "num_experts_per_tok": m.integer(a + "expert_used_count", lo=1, hi=experts),
            "intermediate_size": m.integer(a + "expert_feed_forward_length", lo=1, hi=1 << 20,
                                           default=config["intermediate_size"]),
            "sliding_window": m.integer(a + "attention.sliding_window", lo=1, hi=1 << 30, default=128),
            # llama.cpp hard-codes gpt-oss's pattern (even layers slide) and its SwiGLU limit.
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)],
            "swiglu_limit": 7.0,
        })
    elif arch == "qwen3moe":
        experts = m.integer(a + "expert_count", lo=1, hi=1 << 16)
        config.update({
            "num_experts": experts,
            "num_experts_per_tok": m.integer(a + "expert_used_count", lo=1, hi=experts),
            "moe_intermediate_size": m.integer(a + "expert_feed_forward_length", lo=1, hi=1 << 20),
            # llama.cpp renormalizes the top-k weights of qwen3moe unless the file says otherwise.
            "norm_topk_prob": m.flag(a + "expert_weights_norm", default=True),
            "decoder_sparse_step": 1, "mlp_only_layers": [],
        })


def _deepseek2_config(m: "Meta", config: dict[str, Any]) -> None:
    """DeepSeek V3 / R1 as llama.cpp writes them since its MLA layout (``attn_k_b`` / ``attn_v_b``)."""
    a = f"{m.arch}."
    gating = m.integer(a + "expert_gating_func", lo=0, hi=3, default=2)
    if gating != 2:
        raise UnsupportedModelError(f"{m.header.path}: DeepSeek expert gating {gating} is not supported; "
                                    "supported: sigmoid (2, DeepSeek V3 / R1).")
    rope = m.integer(a + "rope.dimension_count", lo=1, hi=1 << 13)
    key = m.integer(a + "attention.key_length_mla", lo=rope + 1, hi=1 << 14, default=None)
    if key is None:
        raise UnsupportedModelError(f"{m.header.path} predates llama.cpp's MLA layout (no attention.key_length_mla); "
                                    "re-export it with a current llama.cpp or load the HF checkpoint.")
    experts = m.integer(a + "expert_count", lo=1, hi=1 << 16)
    config.update({
        "kv_lora_rank": m.integer(a + "attention.kv_lora_rank", lo=1, hi=1 << 14),
        "q_lora_rank": m.integer(a + "attention.q_lora_rank", lo=1, hi=1 << 16, default=None),
        "qk_rope_head_dim": rope, "qk_nope_head_dim": key - rope,
        "v_head_dim": m.integer(a + "attention.value_length_mla", lo=1, hi=1 << 14),
        "num_key_value_heads": config["num_attention_heads"],
        "n_routed_experts": experts,
        "num_experts_per_tok": m.integer(a + "expert_used_count", lo=1, hi=experts),
        "n_shared_experts": m.integer(a + "expert_shared_count", lo=0, hi=1 << 16, default=0) or None,
        "moe_intermediate_size": m.integer(a + "expert_feed_forward_length", lo=1, hi=1 << 20),
        "routed_scaling_factor": m.number(a + "expert_weights_scale", lo=0.0, lo_open=True, default=1.0),
        "norm_topk_prob": m.flag(a + "expert_weights_norm", default=True),
        "n_group": m.integer(a + "expert_group_count", lo=1, hi=1 << 16, default=1),
        "topk_group": m.integer(a + "expert_group_used_count", lo=1, hi=1 << 16, default=1),
        "first_k_dense_replace": m.integer(a + "leading_dense_block_count", lo=0, hi=1 << 12, default=0),
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "rope_interleave": True,
    })
    config.pop("head_dim", None)  # key_length is the latent's width here, not a head's


def rope_factors_config(m: "Meta", config: dict[str, Any], factors: dict[str, np.ndarray]) -> None:
    """Phi-3's LongRoPE: llama.cpp stores the long and short factors as tensors, the rest as keys."""
    if not factors:
        return
    if set(factors) != set(CONFIG_TENSORS):
        raise UnsupportedModelError(f"{m.header.path} has only {sorted(factors)} of the LongRoPE factor tensors "
                                    f"{list(CONFIG_TENSORS)}; re-export the file with llama.cpp.")
    a = f"{m.arch}."
    rope: dict[str, Any] = {
        "rope_type": "longrope", "rope_theta": config["rope_theta"],
        "long_factor": [float(x) for x in factors["rope_factors_long.weight"]],
        "short_factor": [float(x) for x in factors["rope_factors_short.weight"]],
        "original_max_position_embeddings": m.integer(a + "rope.scaling.original_context_length", lo=1,
                                                      hi=1 << 30, default=config["max_position_embeddings"]),
    }
    attn = m.number(a + "rope.scaling.attn_factor", lo=0.0, lo_open=True, default=None)
    if attn is not None:
        rope["attention_factor"] = float(np.float32(attn))
    config["rope_scaling"] = rope
    config["original_max_position_embeddings"] = rope["original_max_position_embeddings"]


def hf_names(arch: str, config: dict[str, Any], gguf_names: list[str], path: Path) -> dict[str, str]:
    """GGUF tensor name -> our parameter name, for every tensor of the file.

    Raises:
        UnsupportedModelError: a tensor our graph does not use (no weight is dropped silently).
    """
    from gguf import MODEL_ARCH, get_tensor_name_map
    from mlx.utils import tree_flatten

    from .loader import build_model

    model = build_model(config, path)  # lazy: no parameter is materialized
    name_map = get_tensor_name_map(MODEL_ARCH[arch.upper().replace("-", "_")], config["num_hidden_layers"])
    reverse: dict[str, str] = {}
    for ours, _ in tree_flatten(model.parameters()):
        lookup = ours
        for old, new in _LOOKUP_RENAMES:
            lookup = lookup.replace(old, new)
        g = name_map.get_name(lookup, try_suffixes=(".weight", ".bias"))
        if g is not None:
            reverse[g] = ours
            if not ours.endswith((".weight", ".bias")):  # gpt-oss's sinks: the converter adds ".weight"
                reverse[g + ".weight"] = ours
    out = {}
    for g in gguf_names:
        if g not in reverse:
            raise UnsupportedModelError(
                f"{path} has a tensor {g!r} that a {arch} model does not use here; refusing to drop weights "
                "silently. The file may be a variant this reader does not support.")
        out[g] = reverse[g]
    return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's half split)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def untransform(arch: str, gguf_name: str, w: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """A tensor's value in HF's convention (see the module docstring)."""
    if arch in PERMUTED_QK and ".attn_q." in gguf_name:
        return _unpermute(w, config["num_attention_heads"])
    if arch in PERMUTED_QK and ".attn_k." in gguf_name:
        return _unpermute(w, config["num_key_value_heads"])
    if arch in PLUS_ONE_NORMS and gguf_name.endswith("norm.weight"):
        return w - np.float32(1.0)
    return w
