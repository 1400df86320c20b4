"""Gemma 2: alternating sliding-window and global layers with soft-capped attention and logits.

What sets it apart from Llama (and from Gemma 3):

- RMSNorm scales by ``1 + weight``; four norms per block (before/after attention,
  before/after the MLP); no per-head q/k norms (Gemma 3 added them).
- Embeddings are multiplied by ``sqrt(hidden_size)`` (in the activation dtype, as
  mlx-lm and transformers do).
- Attention scores are soft-capped, ``cap * tanh(scores / cap)`` with
  ``attn_logit_softcapping``, before the mask; the final logits likewise with
  ``final_logit_softcapping``. The fast attention kernel has no soft cap, so the
  scores are materialized (:func:`~mlx_infer.layers.attention.softcapped_attention`; the
  compiled decode step composes the same ops, its paged kernels cap each score).
- ``layer_types`` (default: even layers slide, odd layers are global) with a window of
  ``sliding_window`` tokens; one RoPE base for every layer; scale ``query_pre_attn_scalar ** -0.5``;
  GELU-tanh gated MLP; the head is tied to the embedding.

mlx-lm's ``gemma2`` treats every layer as global; here sliding layers keep a window, as
transformers does (and as the checkpoints were trained).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..contracts import GraphDeclaration
from ..layers.attention import softcapped_attention
from ..layers.rope import initialize_rope
from .base import CausalLM, DecoderModel, GQAttention, rope_and_cache
from .gemma3 import MLP, RMSNorm
from .schema import FULL, SLIDING, check_heads, check_layer_types, check_number, check_rope_dict, config_fields


@dataclass
class ModelArgs:
    """Gemma 2 settings, named as in HF ``config.json`` (defaults: Gemma 2 2B)."""

    model_type: str
    hidden_size: int = 2304
    num_hidden_layers: int = 26
    intermediate_size: int = 9216
    num_attention_heads: int = 8
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    vocab_size: int = 256000
    num_key_value_heads: int = 4
    rope_theta: float | None = None
    rope_parameters: dict[str, Any] | None = None
    rope_traditional: bool = False
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    layer_types: list[str] | None = None
    max_position_embeddings: int = 8192
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelArgs":
        """Build from a config dict, ignoring keys this family does not use."""
        return cls(**config_fields(cls, params))

    def __post_init__(self) -> None:
        check_heads(self.num_attention_heads, self.num_key_value_heads)
        # Gemma 2 has no RoPE scaling; transformers >= 5 nests the theta under rope_parameters.
        check_rope_dict("rope_parameters", self.rope_parameters, ("default",))
        if self.rope_theta is None:
            self.rope_theta = (self.rope_parameters or {}).get("rope_theta", 10000.0)
        self.rope_theta = check_number("rope_theta", self.rope_theta, integer=False, lo=0.0, hi=3.4e38, lo_open=True)
        if self.layer_types is None:
            self.layer_types = [SLIDING if i % 2 == 0 else FULL for i in range(self.num_hidden_layers)]
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers)
        if self.sliding_window is None:
            self.layer_types = [FULL] * self.num_hidden_layers


class Attention(GQAttention):
    """Grouped-query attention with soft-capped scores."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, scale=1.0 / (args.query_pre_attn_scalar**0.5))
        self.softcap = args.attn_logit_softcapping
        self.rope = initialize_rope(self.head_dim, args.rope_theta, args.rope_traditional)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, KVH, L, D)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, KVH, L, D)
        queries, keys, values = rope_and_cache(self.rope, queries, keys, values, cache)  # k, v: (B, KVH, S, D)
        out = softcapped_attention(queries, keys, values, scale=self.scale, mask=mask,
                                   softcap=self.softcap)  # (B, H, L, D)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, H*D)
        return self.o_proj(out)


class TransformerBlock(nn.Module):
    """``h = x + post_attn(attn(pre(x)))``; ``out = h + post_ff(mlp(pre_ff(h)))``."""

    def __init__(self, args: ModelArgs, *, sliding: bool):
        super().__init__()
        self.use_sliding = sliding
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        eps = args.rms_norm_eps
        self.input_layernorm = RMSNorm(args.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps=eps)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = x + self.post_attention_layernorm(r)
        r = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(r)


class Gemma2Model(DecoderModel):
    """Embedding (scaled), blocks and final norm: tokens to final hidden states."""

    def __init__(self, args: ModelArgs):
        # softcapped_attention adds the mask to its materialized scores: an array.
        super().__init__(args, lambda i: TransformerBlock(args, sliding=args.layer_types[i] == SLIDING),
                         norm=RMSNorm, mask_as_array=True)
        #: ``sqrt(hidden_size)``, exact (cast to the activation dtype when applied); the compiled step reads it.
        self.embed_scale: float = args.hidden_size**0.5

    def embed(self, inputs: mx.array | None, input_embeddings: mx.array | None) -> mx.array:
        """Token embeddings (or unscaled ``input_embeddings``) ``(B, L, hidden)`` times ``sqrt(hidden_size)``."""
        return super().embed(inputs, input_embeddings) * self.embed_scale


class Model(CausalLM):
    """Gemma 2 causal LM: ``inputs (B, L) -> logits (B, L, vocab)``.

    Decodes through the compiled C++ step (the gemma3 forward of ``cpp/decode/graph.cpp`` without
    q/k norms, with :meth:`decode_switches`). ``input_embeddings`` are taken unscaled.
    """

    #: The family this graph belongs to (its module here; see :func:`mlx_infer.models.graph_family`).
    family = "gemma2"
    declaration = GraphDeclaration(method="autoregressive", compiled_decode=True)

    def __init__(self, args: ModelArgs):
        super().__init__(args, Gemma2Model(args))

    def decode_switches(self) -> dict[str, float]:
        """What the compiled decode step adds for Gemma 2: the attention scores' soft cap (0 = none)."""
        cap = self.args.attn_logit_softcapping
        return {"attn_softcap": float(cap) if cap is not None else 0.0}

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        """Project final hidden states ``(B, L, hidden)`` to soft-capped logits ``(B, L, vocab)``."""
        out = super().logits_from_hidden(h)
        cap = self.args.final_logit_softcapping
        if cap is not None:
            out = mx.tanh(out / cap)
            out = out * cap
        return out
