"""DeepSeek V3 / R1 (and V2-style configs without a q LoRA): multi-head latent attention and a routed MoE.

Multi-head latent attention (MLA), in its absorbed form (mlx-lm's): the KV cache holds,
per token, the compressed latent ``kv_a_layernorm(c_kv)`` (``kv_lora_rank`` wide) as its
"keys" and the shared RoPE key ``k_pe`` (``qk_rope_head_dim`` wide) as its "values", one
"head" each: ``(B, 1, S, kv_lora_rank)`` and ``(B, 1, S, qk_rope_head_dim)``, instead of
``2 * heads * head_dim`` numbers per token. The per-head key/value up-projections
(``kv_b_proj``, split into :class:`MultiLinear` ``embed_q`` / ``unembed_out`` at load)
are applied to the queries and outputs at decode (one query) and to the latent for a
prefill chunk. The paged KV store sizes pages from the attention's ``n_kv_heads`` (1) and
``head_dim`` (here the mean of the two cached widths, so ``2 * head_dim`` is a token's
width) and allocates each layer's K and V storage with their own widths
(:class:`~mlx_infer.state.paged.storage.LayerStorage`).

The MoE (``noaux_tc``): sigmoid scores plus a selection-only correction bias, group-limited
top-k (``n_group`` / ``topk_group``), weights from the uncorrected scores (normalized with
``norm_topk_prob``) times ``routed_scaling_factor``, plus ``n_shared_experts`` always-on
experts; the first ``first_k_dense_replace`` layers are dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..contracts import GraphDeclaration
from ..errors import UnsupportedModelError
from ..layers.attention import dequantized, scaled_dot_product_attention
from ..layers.rope import SUPPORTED_ROPE_TYPES, initialize_rope
from ..layers.switch import SwitchGLU
from .base import CausalLM, DecoderModel, PreNormBlock
from .llama import swiglu
from .schema import check_heads, check_number, config_fields, rope_settings


@dataclass
class ModelArgs:
    """DeepSeek V3 settings, named as in HF ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    moe_intermediate_size: int | None = None
    num_key_value_heads: int | None = None
    n_shared_experts: int | None = None
    n_routed_experts: int | None = None
    routed_scaling_factor: float = 1.0
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 1
    moe_layer_freq: int = 1
    first_k_dense_replace: int = 0
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelArgs":
        """Build from a config dict, ignoring keys this family does not use."""
        return cls(**config_fields(cls, params))

    def __post_init__(self) -> None:
        check_heads(self.num_attention_heads, self.num_key_value_heads or self.num_attention_heads)
        self.rope_theta, self.rope_scaling = rope_settings(self.rope_theta, self.rope_scaling, self.rope_parameters,
                                                           SUPPORTED_ROPE_TYPES, default_theta=10000.0)
        if self.n_routed_experts is not None:
            if self.topk_method != "noaux_tc" or self.scoring_func != "sigmoid":
                raise UnsupportedModelError(
                    f"DeepSeek routing {self.topk_method!r} / {self.scoring_func!r} is not supported; "
                    "supported: topk_method \"noaux_tc\" with scoring_func \"sigmoid\" (DeepSeek V3 / R1).")
            for name in ("n_group", "topk_group", "num_experts_per_tok", "moe_layer_freq"):
                check_number(name, getattr(self, name), integer=True, lo=1, hi=1 << 16)
            if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
                raise UnsupportedModelError(
                    f"n_routed_experts ({self.n_routed_experts}) must split into n_group ({self.n_group}) groups "
                    f"and topk_group ({self.topk_group}) may not exceed it; fix config.json.")

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` has the routed experts (else the dense MLP)."""
        return (self.n_routed_experts is not None and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)


class MultiLinear(nn.Module):
    """One ``(out, in)`` matrix per head: ``x (..., H, L, in) -> (..., H, L, out)`` (mlx-lm's)."""

    def __init__(self, input_dims: int, output_dims: int, num_heads: int):
        super().__init__()
        scale = math.sqrt(1.0 / input_dims)
        self.weight = mx.random.uniform(low=-scale, high=scale, shape=(num_heads, output_dims, input_dims))

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        return x @ self.weight.swapaxes(-1, -2) if transpose else x @ self.weight

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine",
                     **_: Any) -> "QuantizedMultiLinear":
        """The quantized form (mlx-lm's ``convert`` quantizes ``embed_q`` / ``unembed_out``)."""
        return QuantizedMultiLinear(self.weight, group_size, bits, mode)


class QuantizedMultiLinear(nn.Module):
    """:class:`MultiLinear` with quantized per-head matrices, via ``quantized_matmul`` (mlx-lm's)."""

    def __init__(self, weight: mx.array, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        self.biases = biases[0] if biases else None
        self.freeze()

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        return mx.quantized_matmul(x, self["weight"], scales=self["scales"], biases=self.get("biases"),
                                   transpose=transpose, group_size=self.group_size, bits=self.bits, mode=self.mode)


class Attention(nn.Module):
    """Multi-head latent attention over a cache of latents and RoPE keys."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.q_lora_rank = args.q_lora_rank
        self.rope_dim = args.qk_rope_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.nope_dim = args.qk_nope_head_dim
        self.q_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        # What the KV store reads: one cached "head", K = latent, V = RoPE key (mean width).
        self.n_kv_heads = 1
        self.head_dim = (args.kv_lora_rank + args.qk_rope_head_dim) // 2
        self.scale = self.q_head_dim**-0.5
        dim, bias = args.hidden_size, args.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(dim, self.n_heads * self.q_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = nn.RMSNorm(self.q_lora_rank, eps=1e-6)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.n_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = nn.RMSNorm(self.kv_lora_rank, eps=1e-6)
        self.embed_q = MultiLinear(self.nope_dim, self.kv_lora_rank, self.n_heads)
        self.unembed_out = MultiLinear(self.kv_lora_rank, args.v_head_dim, self.n_heads)
        self.o_proj = nn.Linear(self.n_heads * args.v_head_dim, dim, bias=bias)
        scaling = args.rope_scaling or {}
        if scaling.get("mscale_all_dim") and scaling.get("factor", 1) > 1:
            s = 0.1 * scaling["mscale_all_dim"] * math.log(scaling["factor"]) + 1.0
            self.scale = self.scale * s * s
        self.rope = initialize_rope(self.rope_dim, args.rope_theta, args.rope_interleave, args.rope_scaling,
                                    args.max_position_embeddings)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, L, self.n_heads, self.q_head_dim).transpose(0, 2, 1, 3)  # (B, H, L, nope + rope)
        q_nope, q_pe = mx.split(q, [self.nope_dim], axis=-1)
        compressed, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
        k_pe = k_pe.reshape(B, L, 1, self.rope_dim).transpose(0, 2, 1, 3)  # (B, 1, L, rope)
        kv_latent = self.kv_a_layernorm(compressed)  # (B, L, R)
        offset = cache.offset if cache is not None else 0
        q_pe = self.rope(q_pe, offset)
        k_pe = self.rope(k_pe, offset)
        kv_latent = mx.expand_dims(kv_latent, axis=1)  # (B, 1, L, R)
        if cache is not None:
            kv_latent, k_pe = cache.update_and_fetch(kv_latent, k_pe)  # (B, 1, S, R), (B, 1, S, rope)
            # A quantized KV store hands back (packed, scales, biases): the latent is used as a
            # matrix operand below, so it is dequantized here.
            kv_latent, k_pe = dequantized(kv_latent, self.kv_lora_rank), dequantized(k_pe, self.rope_dim)
        pe_scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)  # (B, H, L, S)
        if mask is not None:
            pe_scores = mx.where(mask, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
        if L == 1:  # absorbed: attend in the latent space
            q_nope = self.embed_q(q_nope)  # (B, H, 1, R)
            k = v = kv_latent
        else:
            k = self.embed_q(kv_latent, transpose=False)  # (B, H, S, nope)
            v = self.unembed_out(kv_latent)  # (B, H, S, v_head)
        out = scaled_dot_product_attention(q_nope, k, v, scale=self.scale, mask=pe_scores)
        if L == 1:
            out = self.unembed_out(out)  # (B, H, 1, v_head)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, H*v_head)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU feed-forward (dense layers and the shared experts)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


@mx.compile
def group_expert_select(gates: mx.array, bias: mx.array, top_k: int, n_group: int, topk_group: int,
                        routed_scaling_factor: float, norm_topk_prob: bool) -> tuple[mx.array, mx.array]:
    """``noaux_tc`` routing (mlx-lm's op order): ``(indices, weights)``, each ``(..., top_k)``."""
    scores = mx.sigmoid(gates.astype(mx.float32))
    orig_scores = scores
    scores = scores + bias
    if n_group > 1:
        scores = mx.unflatten(scores, axis=-1, shape=(n_group, -1))  # (..., G, E/G)
        group_scores = mx.topk(scores, 2, axis=-1).sum(axis=-1, keepdims=True)  # (..., G, 1)
        k = n_group - topk_group
        group_idx = mx.argpartition(group_scores, kth=k - 1, axis=-2)[..., :k, :]
        scores = mx.put_along_axis(scores, mx.stop_gradient(group_idx), mx.array(0.0), axis=-2)
        scores = mx.flatten(scores, -2, -1)
    inds = mx.stop_gradient(mx.argpartition(-scores, kth=top_k - 1, axis=-1)[..., :top_k])
    scores = mx.take_along_axis(orig_scores, inds, axis=-1)
    if top_k > 1 and norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores * routed_scaling_factor


class MoEGate(nn.Module):
    """The router: ``weight (E, hidden)`` and the selection-only ``e_score_correction_bias (E,)``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        self.e_score_correction_bias = mx.zeros((args.n_routed_experts,))

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        a = self.args
        return group_expert_select(x @ self.weight.T, self.e_score_correction_bias, a.num_experts_per_tok,
                                   a.n_group, a.topk_group, a.routed_scaling_factor, a.norm_topk_prob)


class MoE(nn.Module):
    """Routed SwiGLU experts plus the shared ones."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.n_routed_experts, swiglu)
        self.gate = MoEGate(args)
        if args.n_shared_experts is not None:
            self.shared_experts = MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = self.gate(x)  # (B, L, k) each
        y = self.switch_mlp(x, inds)  # (B, L, k, D)
        y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
        if self.args.n_shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class TransformerBlock(PreNormBlock):
    """Pre-norm block: ``h = x + mla(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(args, Attention(args),
                         MoE(args) if args.is_moe_layer(layer) else MLP(args.hidden_size, args.intermediate_size))


def _dense(weights: dict[str, mx.array], base: str, in_dims: int) -> mx.array:
    """``base.weight``, dequantized (and its ``scales`` / ``biases`` removed) when a converter quantized it."""
    w = weights.pop(f"{base}.weight")
    if f"{base}.scales" not in weights:
        return w
    scales, biases = weights.pop(f"{base}.scales"), weights.pop(f"{base}.biases")
    return mx.dequantize(w, scales, biases, group_size=in_dims // scales.shape[-1], bits=w.shape[-1] * 32 // in_dims)


class Model(CausalLM):
    """DeepSeek V3 causal LM: ``inputs (B, L) -> logits (B, L, vocab)``; its compiled decode step is the C++
    forward's MLA and noaux_tc switches (``generation/bindings/mla_spec.py``, ``cpp/decode/mla.cpp``)."""

    #: The family this graph belongs to (its module here; see :func:`mlx_infer.models.graph_family`).
    family = "deepseek_v3"
    declaration = GraphDeclaration(method="autoregressive", compiled_decode=True)
    #: Checkpoint modules this graph does not keep (adapters on them are refused, adapters/formats.py).
    adapter_absorbed = {"kv_b_proj": "DeepSeek's multi-head latent attention splits kv_b_proj into embed_q / "
                                     "unembed_out at load and multiplies by their weights directly (the "
                                     "absorbed attention), so no kv_b_proj layer runs"}

    def __init__(self, args: ModelArgs):
        # The MLA attention folds the mask into its RoPE scores: an array.
        super().__init__(args, DecoderModel(args, lambda i: TransformerBlock(args, i), mask_as_array=True))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Stack the experts, split ``kv_b_proj`` into ``embed_q`` / ``unembed_out`` (dense: a
        quantized one is dequantized first, as is a quantized router), drop the multi-token-prediction
        layers past ``num_hidden_layers`` and ``rotary_emb.inv_freq``."""
        a = self.args
        n = a.num_hidden_layers
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k
                   and not (k.startswith("model.layers.") and int(k.split(".")[2]) >= n)}
        for i in range(n):
            prefix = f"model.layers.{i}"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for part in ("weight", "scales", "biases"):
                    if f"{prefix}.mlp.experts.0.{proj}.{part}" in weights:
                        weights[f"{prefix}.mlp.switch_mlp.{proj}.{part}"] = mx.stack(
                            [weights.pop(f"{prefix}.mlp.experts.{e}.{proj}.{part}") for e in range(a.n_routed_experts)])
            if f"{prefix}.mlp.gate.weight" in weights:
                weights[f"{prefix}.mlp.gate.weight"] = _dense(weights, f"{prefix}.mlp.gate", a.hidden_size)
            attn = f"{prefix}.self_attn"
            if f"{attn}.kv_b_proj.weight" in weights:
                v = _dense(weights, f"{attn}.kv_b_proj", a.kv_lora_rank)  # (H * (nope + v), R)
                v = v.reshape(a.num_attention_heads, a.qk_nope_head_dim + a.v_head_dim, -1)
                weights[f"{attn}.embed_q.weight"] = mx.contiguous(v[:, : a.qk_nope_head_dim, :].swapaxes(-1, -2))
                weights[f"{attn}.unembed_out.weight"] = mx.contiguous(v[:, a.qk_nope_head_dim:, :])
        return self.sanitize_head(weights)
