"""A DeepSeek V3 graph read into the compiled C++ decode step (:func:`~.graph_spec.graph_spec`'s ``deepseek_v3``).

The step runs DeepSeek's multi-head latent attention in mlx-lm's absorbed form (``cpp/decode/mla.cpp``) and its
``noaux_tc`` routed experts with the shared ones (``cpp/decode/moe.cpp``), switches of the one C++ forward
(``DecodeConfig.kv_lora_rank``, ``moe_noaux_tc``). Each layer's KV is what the eager graph caches: one KV head,
K the normed latent (``kv_lora_rank`` wide) and V the rotated RoPE key (``qk_rope_head_dim`` wide). Canonical
names (``cpp/decode/graph.h``), beside the shared ones (embed, norm, lm_head, ``layers.{i}.{o,attn_norm,mlp_norm}``,
a dense layer's ``gate``/``up``/``down``)::

    layers.{i}.q.*                                 q_proj (no q LoRA: q_lora_rank null)
    layers.{i}.q_a.*, q_a_norm.weight, q_b.*       q_a_proj, q_a_layernorm, q_b_proj
    layers.{i}.kv_a.*, kv_a_norm.weight            kv_a_proj_with_mqa, kv_a_layernorm
    layers.{i}.embed_q.*, unembed_out.*            the per-head MultiLinear halves of kv_b_proj
    layers.{i}.router.weight                       mlp.gate.weight (MoEGate: x @ weight.T, never quantized)
    layers.{i}.router.correction_bias              mlp.gate.e_score_correction_bias
    layers.{i}.experts.{gate,up,down}.*            mlp.switch_mlp (SwitchGLU)
    layers.{i}.shared.{gate,up,down}.*             mlp.shared_experts

Quantized: the affine-quantized linears, experts and ``QuantizedMultiLinear`` embed_q / unembed_out as the model
holds them. Refused (:class:`~.graph_spec.DecodeStepUnsupported`, the engine and ``generate`` then decode on
the eager graph): a tensor-parallel graph (its heads split over ranks and its experts held whole here).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ... import _fast
from ...models.deepseek_v3 import MultiLinear, QuantizedMultiLinear
from .graph_spec import (DecodePolicy, DecodeStepUnsupported, _add_experts, _add_linear, _add_projections,
                         _apply_policy, _mirror_cpu_kernels, _rope_spec, check_every_parameter_used)


def deepseek_v3_spec(model: Any, kv_scheme: str | None,
                     policy: DecodePolicy) -> tuple[Any, dict[str, mx.array], dict[str, tuple]]:
    """:func:`~.graph_spec.graph_spec` for a DeepSeek V3 graph (see the module doc for the names)."""
    from ...parallel.layers import tensor_parallel_of

    if tensor_parallel_of(model) is not None:
        raise DecodeStepUnsupported("no compiled decode step for a tensor-parallel DeepSeek V3 graph (its "
                                    "latent attention's heads and its routed experts are not split in the step)")
    args, inner = model.args, model.model
    layers = inner.layers
    attn0 = layers[0].self_attn
    cfg = _fast.DecodeConfig()
    cfg.family = "deepseek_v3"
    cfg.num_layers = len(layers)
    cfg.hidden_size = args.hidden_size
    cfg.num_heads = attn0.n_heads
    cfg.num_kv_heads = 1  # one cached head: the latent (K) and the RoPE key (V)
    cfg.head_dim = attn0.kv_lora_rank  # K's width
    cfg.vocab_size = args.vocab_size
    cfg.rms_norm_eps = float(args.rms_norm_eps)
    cfg.attn_scale = float(attn0.scale)  # q_head_dim ** -0.5, times YaRN's mscale squared
    cfg.activation = "silu"
    cfg.kv_lora_rank = attn0.kv_lora_rank
    cfg.qk_nope_head_dim = attn0.nope_dim
    cfg.qk_rope_head_dim = attn0.rope_dim
    cfg.v_head_dim = args.v_head_dim
    cfg.windows = [0] * len(layers)
    cfg.ropes = [_rope_spec(layer.self_attn.rope) for layer in layers]
    if args.n_routed_experts is not None:
        cfg.num_experts = int(args.n_routed_experts)
        cfg.top_k_experts = int(args.num_experts_per_tok)
        cfg.moe_noaux_tc = True
        cfg.moe_groups = int(args.n_group)
        cfg.moe_topk_groups = int(args.topk_group)
        cfg.routed_scaling_factor = float(args.routed_scaling_factor)
        cfg.norm_topk_prob = bool(args.norm_topk_prob)
    _apply_policy(cfg, kv_scheme, policy)

    weights: dict[str, mx.array] = {}
    quant: dict[str, tuple] = {}
    fast: list[str] = []
    read: list[mx.array] = []  # parameters handed over transformed (fused in place)
    fuse = policy.resolved_fuse_projections()

    def linear(name: str, module: nn.Module) -> None:
        _add_linear(name, module, weights, quant, fast)

    linear("embed", inner.embed_tokens)
    if not args.tie_word_embeddings:
        linear("lm_head", model.lm_head)
    weights["norm.weight"] = inner.norm.weight
    for i, layer in enumerate(layers):
        p = f"layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_lora_rank is None:
            linear(f"{p}.q", attn.q_proj)
        else:
            linear(f"{p}.q_a", attn.q_a_proj)
            weights[f"{p}.q_a_norm.weight"] = attn.q_a_layernorm.weight
            linear(f"{p}.q_b", attn.q_b_proj)
        linear(f"{p}.kv_a", attn.kv_a_proj_with_mqa)
        weights[f"{p}.kv_a_norm.weight"] = attn.kv_a_layernorm.weight
        _add_multi_linear(f"{p}.embed_q", attn.embed_q, weights, quant)
        _add_multi_linear(f"{p}.unembed_out", attn.unembed_out, weights, quant)
        linear(f"{p}.o", attn.o_proj)
        weights[f"{p}.attn_norm.weight"] = layer.input_layernorm.weight
        weights[f"{p}.mlp_norm.weight"] = layer.post_attention_layernorm.weight
        if "switch_mlp" in mlp:  # the routed experts (and the shared ones) instead of the MLP
            weights[f"{p}.router.weight"] = mlp.gate.weight
            weights[f"{p}.router.correction_bias"] = mlp.gate.e_score_correction_bias
            for short in ("gate", "up", "down"):
                _add_experts(f"{p}.experts.{short}", mlp.switch_mlp[f"{short}_proj"], weights, quant)
            if "shared_experts" in mlp:
                for short in ("gate", "up", "down"):
                    linear(f"{p}.shared.{short}", mlp.shared_experts[f"{short}_proj"])
        else:  # a dense layer (the first first_k_dense_replace ones, those moe_layer_freq skips)
            _add_projections(p, mlp, ("gate_proj", "up_proj"), "gate_up", ("gate", "up"), fuse, weights, quant,
                             fast, read)
            linear(f"{p}.down", mlp.down_proj)
    _mirror_cpu_kernels(layers, fast)
    cfg.cpu_kernel_linears = fast
    check_every_parameter_used(model, [*weights.values(), *read])
    mx.eval(list(weights.values()))
    return cfg, weights, quant


def _add_multi_linear(name: str, module: nn.Module, weights: dict, quant: dict) -> None:
    """A per-head ``(H, out, in)`` MultiLinear, or its affine-quantized form, under ``name``."""
    weights[f"{name}.weight"] = module["weight"]
    if isinstance(module, QuantizedMultiLinear):
        weights[f"{name}.scales"] = module["scales"]
        if module.get("biases") is not None:
            weights[f"{name}.biases"] = module["biases"]
        quant[name] = (int(module.group_size), int(module.bits), str(module.mode))
    elif not isinstance(module, MultiLinear):
        raise DecodeStepUnsupported(f"no compiled decode step for {name} of type {type(module).__name__}")
