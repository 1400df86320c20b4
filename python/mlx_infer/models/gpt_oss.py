"""gpt-oss (20B / 120B): attention sinks, alternating sliding/full layers, a biased MoE.

What sets it apart from Llama:

- Each attention head has a learned sink logit (``self_attn.sinks``) that joins its
  softmax (``mx.fast.scaled_dot_product_attention(..., sinks=)``); q/k/v/o all have biases.
- ``layer_types`` alternate sliding-window (``sliding_window`` tokens) and full layers.
- Every MLP is a mixture of experts: a biased router picks the top ``num_experts_per_tok``
  logits and softmaxes them; the experts are biased SwiGLU with gpt-oss's clamped
  activation, ``(clip(up, ±limit) + 1) * g * sigmoid(1.702 g)`` with ``g = min(gate, limit)``.
- Checkpoints store the experts fused and interleaved: transformers' bf16 layout
  ``mlp.experts.gate_up_proj`` ``(E, hidden, 2I)`` (gate and up alternate along the last
  axis) with ``down_proj`` ``(E, I, hidden)`` and ``*_bias``; OpenAI's release quantizes them
  to MXFP4 (``*_blocks`` uint8 ``(E, out, in/32, 16)``, ``*_scales`` ``(E, out, in/32)``), which
  loads as MLX's ``mxfp4`` mode as is. :meth:`Model.sanitize` maps both to
  ``mlp.experts.{gate,up,down}_proj`` (mlx-lm's names); mlx-community conversions already use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..contracts import GraphDeclaration
from ..errors import ModelLoadError
from ..layers.attention import scaled_dot_product_attention
from ..layers.rope import SUPPORTED_ROPE_TYPES, initialize_rope
from ..layers.switch import QuantizedSwitchLinear, SwitchGLU
from .base import CausalLM, DecoderModel, GQAttention, PreNormBlock, rope_and_cache
from .schema import FULL, SLIDING, check_heads, check_layer_types, check_number, config_fields, rope_settings


@dataclass
class ModelArgs:
    """gpt-oss settings, named as in HF ``config.json`` (defaults: gpt-oss-20b)."""

    model_type: str = "gpt_oss"
    num_hidden_layers: int = 24
    num_local_experts: int = 32
    num_experts_per_tok: int = 4
    vocab_size: int = 201088
    rms_norm_eps: float = 1e-5
    hidden_size: int = 2880
    intermediate_size: int = 2880
    head_dim: int = 64
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    sliding_window: int = 128
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    layer_types: list[str] | None = None
    swiglu_limit: float = 7.0
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelArgs":
        """Build from a config dict, ignoring keys this family does not use."""
        return cls(**config_fields(cls, params))

    def __post_init__(self) -> None:
        check_heads(self.num_attention_heads, self.num_key_value_heads)
        self.rope_theta, self.rope_scaling = rope_settings(self.rope_theta, self.rope_scaling, self.rope_parameters,
                                                           SUPPORTED_ROPE_TYPES, default_theta=150000.0)
        self.num_experts_per_tok = check_number("num_experts_per_tok", self.num_experts_per_tok, integer=True,
                                                lo=1, hi=self.num_local_experts)
        if self.layer_types is None:
            self.layer_types = [SLIDING if i % 2 == 0 else FULL for i in range(self.num_hidden_layers)]
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers)


@partial(mx.compile, shapeless=True)
def swiglu_oai(gate: mx.array, x: mx.array, alpha: float = 1.702, limit: float = 7.0) -> mx.array:
    """gpt-oss's gated activation: the gate clipped from above, the linear part clipped and shifted by 1."""
    gate = mx.minimum(gate, limit)
    x = mx.clip(x, -limit, limit)
    return (x + 1.0) * (gate * mx.sigmoid(alpha * gate))


class Attention(GQAttention):
    """Grouped-query attention with biases and per-head attention sinks."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, qkv_bias=True, o_bias=True)
        self.sinks = mx.zeros((self.n_heads,))
        self.rope = initialize_rope(self.head_dim, args.rope_theta, False, args.rope_scaling,
                                    args.max_position_embeddings)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, -1, self.head_dim).swapaxes(1, 2)  # (B, H, L, D)
        k = self.k_proj(x).reshape(B, L, -1, self.head_dim).swapaxes(1, 2)  # (B, KVH, L, D)
        v = self.v_proj(x).reshape(B, L, -1, self.head_dim).swapaxes(1, 2)  # (B, KVH, L, D)
        q, k, v = rope_and_cache(self.rope, q, k, v, cache)  # k, v: (B, KVH, S, D)
        out = scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask, sinks=self.sinks)  # (B, H, L, D)
        return self.o_proj(out.swapaxes(1, 2).reshape(B, L, -1))


class MLPBlock(nn.Module):
    """Top-k routed experts; the softmax runs over the k chosen router logits (mlx-lm's op order)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        limit = args.swiglu_limit
        self.experts = SwitchGLU(args.hidden_size, args.intermediate_size, args.num_local_experts,
                                 lambda gate, up: swiglu_oai(gate, up, limit=limit), bias=True)
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        g = self.router(x)  # (B, L, E)
        inds = mx.stop_gradient(mx.argpartition(g, kth=-self.top_k, axis=-1)[..., -self.top_k:])  # (B, L, k)
        weights = mx.softmax(mx.take_along_axis(g, inds, axis=-1), axis=-1, precise=True)  # (B, L, k)
        y = self.experts(x, inds)  # (B, L, k, D)
        return (y * mx.expand_dims(weights, axis=-1)).sum(axis=-2)


class TransformerBlock(PreNormBlock):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + moe(norm(h))``."""

    def __init__(self, args: ModelArgs, *, sliding: bool):
        super().__init__(args, Attention(args), MLPBlock(args), sliding=sliding)


def _mxfp4_shell(weight_blocks: mx.array, bias: bool) -> QuantizedSwitchLinear:
    """An empty MXFP4 expert linear shaped for ``*_blocks`` ``(E, out, in/32, 16)`` (weights loaded later)."""
    E, out, groups, _ = weight_blocks.shape
    return QuantizedSwitchLinear(mx.zeros((E, out, groups * 32)), 32, 4, "mxfp4", bias=bias)


class Model(CausalLM):
    """gpt-oss causal LM: ``inputs (B, L) -> logits (B, L, vocab)``.

    Decodes through the compiled C++ step (the llama forward of ``cpp/decode/graph.cpp`` with the attention
    sinks, the biased routed experts and :meth:`decode_switches`); under tensor parallelism (the step holds
    every expert) it decodes eagerly.
    """

    #: The family this graph belongs to (its module here; see :func:`mlx_infer.models.graph_family`).
    family = "gpt_oss"
    declaration = GraphDeclaration(method="autoregressive", compiled_decode=True)

    def __init__(self, args: ModelArgs):
        model = DecoderModel(args, lambda i: TransformerBlock(args, sliding=args.layer_types[i] == SLIDING))
        super().__init__(args, model)

    def decode_switches(self) -> dict[str, Any]:
        """What the compiled decode step's llama forward does for gpt-oss's experts: :func:`swiglu_oai` at the
        config's limit, and the routing softmax over the chosen logits only (:class:`MLPBlock`)."""
        return {"activation": "swiglu_oai", "swiglu_limit": float(self.args.swiglu_limit), "moe_softmax_topk": True}

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map transformers' fused bf16 experts and OpenAI's MXFP4 ones to ``mlp.experts.*``.

        MXFP4 experts switch the layer's expert linears to MLX's ``mxfp4`` mode here (the
        checkpoint's config carries no MLX ``quantization`` entry). Then the shared ``inv_freq``
        and tied-head handling (:meth:`CausalLM.sanitize`).
        """
        out: dict[str, mx.array] = {}
        for k, v in weights.items():
            if k.endswith(("gate_up_proj", "gate_up_proj_blocks", "gate_up_proj_scales")):
                base = k.rsplit(".", 1)[0]  # model.layers.{i}.mlp.experts
                if k.endswith("gate_up_proj"):  # (E, hidden, 2I), gate/up interleaved on the last axis
                    parts = {"weight": (v[..., ::2].swapaxes(-1, -2), v[..., 1::2].swapaxes(-1, -2))}
                else:  # (E, 2I, ...), gate/up interleaved on the rows
                    part = "weight" if k.endswith("_blocks") else "scales"
                    if part == "weight":
                        self._use_mxfp4(base, "gate_proj", v[:, ::2])
                        self._use_mxfp4(base, "up_proj", v[:, 1::2])
                        v = v.view(mx.uint32).flatten(-2)
                    parts = {part: (v[:, ::2], v[:, 1::2])}
                for part, (gate, up) in parts.items():
                    out[f"{base}.gate_proj.{part}"] = mx.contiguous(gate)
                    out[f"{base}.up_proj.{part}"] = mx.contiguous(up)
            elif k.endswith("gate_up_proj_bias"):  # (E, 2I)
                base = k.rsplit(".", 1)[0]
                out[f"{base}.gate_proj.bias"] = mx.contiguous(v[..., ::2])
                out[f"{base}.up_proj.bias"] = mx.contiguous(v[..., 1::2])
            elif k.endswith("down_proj"):  # (E, I, hidden)
                out[f"{k}.weight"] = mx.contiguous(v.swapaxes(-1, -2))
            elif k.endswith("down_proj_blocks"):
                base = k[: -len("_blocks")]
                self._use_mxfp4(base.rsplit(".", 1)[0], "down_proj", v)
                out[f"{base}.weight"] = v.view(mx.uint32).flatten(-2)
            elif k.endswith("down_proj_scales"):
                out[f"{k[: -len('_scales')]}.scales"] = v
            elif k.endswith("down_proj_bias"):
                out[f"{k[: -len('_bias')]}.bias"] = v
            else:
                out[k] = v
        return super().sanitize(out)

    def _use_mxfp4(self, experts_path: str, proj: str, blocks: mx.array) -> None:
        parts = experts_path.split(".")  # model.layers.{i}.mlp.experts
        if len(parts) != 5 or not parts[2].isdigit() or int(parts[2]) >= len(self.layers):
            raise ModelLoadError(f"Unexpected MXFP4 expert tensor under {experts_path!r}.")
        experts = self.layers[int(parts[2])].mlp.experts
        if not isinstance(experts[proj], QuantizedSwitchLinear):
            setattr(experts, proj, _mxfp4_shell(blocks, bias=True))
