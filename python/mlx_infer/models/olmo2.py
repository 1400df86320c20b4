"""OLMo 2: post-norm blocks and q/k RMSNorm over the whole projection.

What sets it apart from Llama:

- No norm before attention or the MLP; instead each sublayer's output is normalized
  before the residual add: ``h = x + post_attn_norm(attn(x))``,
  ``out = h + post_ff_norm(mlp(h))``.
- ``q_norm`` / ``k_norm`` are RMSNorms over all heads at once (width ``heads * head_dim``),
  applied to the projections before they are split into heads (Qwen 3 normalizes each head).

The rest (RoPE and its scaling, biases, SwiGLU, tied or untied head) is the Llama family's
settings, read by :class:`~mlx_infer.models.llama.ModelArgs`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..contracts import GraphDeclaration
from ..layers.attention import scaled_dot_product_attention
from ..layers.rope import initialize_rope
from .base import CausalLM, DecoderModel, GQAttention, rope_and_cache
from .llama import MLP, ModelArgs

__all__ = ["Model", "ModelArgs"]


class Attention(GQAttention):
    """Grouped-query attention with RMSNorm over the whole q and k projections."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, qkv_bias=args.attention_bias, o_bias=args.attention_bias)
        head_dim = self.head_dim
        self.q_norm = nn.RMSNorm(self.n_heads * head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.n_kv_heads * head_dim, eps=args.rms_norm_eps)
        self.rope = initialize_rope(head_dim, args.rope_theta, args.rope_traditional, args.rope_scaling,
                                    args.max_position_embeddings)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x))  # (B, L, H*D)
        keys = self.k_norm(self.k_proj(x))  # (B, L, KVH*D)
        values = self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, KVH, L, D)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, KVH, L, D)
        queries, keys, values = rope_and_cache(self.rope, queries, keys, values, cache)  # k, v: (B, KVH, S, D)
        out = scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)  # (B, H, L, D)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, H*D)
        return self.o_proj(out)


class TransformerBlock(nn.Module):
    """Post-norm block: ``h = x + norm(attn(x)); out = h + norm(mlp(h))``."""

    #: The compiled decode step's norms <- this block's attributes (post-norms only: Model.decode_switches).
    decode_norms = {"post_attn_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.use_sliding = False
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_feedforward_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(x, mask, cache))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Model(CausalLM):
    """OLMo 2 causal LM: ``inputs (B, L) -> logits (B, L, vocab)``; the compiled decode step runs it through
    the llama forward with :meth:`decode_switches` (not under tensor parallelism: its q/k norms span the heads)."""

    #: The family this graph belongs to (its module here; see :func:`mlx_infer.models.graph_family`).
    family = "olmo2"
    declaration = GraphDeclaration(method="autoregressive", compiled_decode=True)

    def __init__(self, args: ModelArgs):
        super().__init__(args, DecoderModel(args, lambda i: TransformerBlock(args)))

    def decode_switches(self) -> dict[str, bool]:
        """What the compiled decode step's llama forward does differently for OLMo 2: no pre-norms, and
        q/k norms over the whole projection."""
        return {"pre_norms": False, "qk_norm_whole": True}
