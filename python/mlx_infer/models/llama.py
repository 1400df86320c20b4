"""The Llama family: Llama 2/3, Mistral, Qwen 2 and Qwen 3.

One graph covers them; the differences are config switches:

- Qwen 2: bias on the q/k/v projections (``model_type == "qwen2"`` or
  ``attention_bias``).
- Qwen 3: per-head RMSNorm on queries and keys before RoPE (``q_norm`` /
  ``k_norm``), an explicit ``head_dim``.
- Mistral / Qwen with ``use_sliding_window``: sliding-window layers
  (``layer_types``), served by :class:`~mlx_infer.state.kv.RotatingKVCache`.
- RoPE scaling (linear, llama3, yarn) from ``rope_scaling`` or
  transformers 5's ``rope_parameters``.
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
from .base import CausalLM, DecoderModel, GQAttention, PreNormBlock, rope_and_cache
from .schema import FULL, SLIDING, check_heads, check_layer_types, check_number, check_rope_dict, config_fields


@dataclass
class ModelArgs:
    """Llama-family settings, named as in HF ``config.json``."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    head_dim: int | None = None
    num_key_value_heads: int | None = None
    max_position_embeddings: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_theta: float | None = None
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    tie_word_embeddings: bool = True
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    use_sliding_window: bool | None = None
    max_window_layers: int | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelArgs":
        """Build from a config dict, ignoring keys this family does not use."""
        return cls(**config_fields(cls, params))

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        check_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.head_dim is None:
            if self.hidden_size < self.num_attention_heads:
                raise ModelLoadError(
                    f"\"hidden_size\" ({self.hidden_size}) is smaller than \"num_attention_heads\" "
                    f"({self.num_attention_heads}), so the head dim would be 0; set head_dim in config.json.")
            self.head_dim = self.hidden_size // self.num_attention_heads
        # transformers >= 5 nests theta and scaling under rope_parameters.
        if self.rope_parameters:
            if self.rope_theta is None:
                self.rope_theta = self.rope_parameters.get("rope_theta")
            if self.rope_scaling is None:
                self.rope_scaling = self.rope_parameters
        if self.rope_theta is None:
            self.rope_theta = 10000.0
        self.rope_theta = check_number("rope_theta", self.rope_theta, integer=False, lo=0.0, hi=3.4e38, lo_open=True)
        check_rope_dict("rope_scaling", self.rope_scaling, SUPPORTED_ROPE_TYPES)
        if self.use_sliding_window is False:  # Qwen configs carry a window they do not use
            self.sliding_window = None
        if self.layer_types is None:
            self.layer_types = [self._default_layer_type(i) for i in range(self.num_hidden_layers)]
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers)
        if self.sliding_window is None:
            self.layer_types = [FULL] * self.num_hidden_layers

    @property
    def qkv_bias(self) -> bool:
        """Bias on q/k/v: Qwen 2 always has it; others follow ``attention_bias``."""
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def o_proj_bias(self) -> bool:
        """Bias on o_proj: never in Qwen 2 (HF's Qwen2Attention ignores attention_bias there)."""
        return self.attention_bias and self.model_type != "qwen2"

    def _default_layer_type(self, i: int) -> str:
        if self.sliding_window is None:
            return FULL
        if self.use_sliding_window:  # Qwen: the layers from max_window_layers on slide
            return SLIDING if i >= (self.max_window_layers or 0) else FULL
        return SLIDING  # Mistral: every layer slides


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``, fused (the same compiled function as mlx-lm's)."""
    return nn.silu(gate) * x


class Attention(GQAttention):
    """Grouped-query self-attention with RoPE and optional per-head q/k norms."""

    def __init__(self, args: ModelArgs, *, qk_norm: bool):
        super().__init__(args, qkv_bias=args.qkv_bias, o_bias=args.o_proj_bias)
        head_dim = self.head_dim
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.rope = initialize_rope(head_dim, args.rope_theta, args.rope_traditional,
                                    args.rope_scaling, args.max_position_embeddings)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1)  # (B, L, H, D)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)  # (B, L, KVH, D)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)  # (B, L, KVH, D)
        if self.qk_norm:
            queries = self.q_norm(queries)
            keys = self.k_norm(keys)
        queries = queries.transpose(0, 2, 1, 3)  # (B, H, L, D)
        keys = keys.transpose(0, 2, 1, 3)  # (B, KVH, L, D)
        values = values.transpose(0, 2, 1, 3)  # (B, KVH, L, D)
        queries, keys, values = rope_and_cache(self.rope, queries, keys, values, cache)  # k, v: (B, KVH, S, D)
        out = scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)  # (B, H, L, D)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, H*D)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class TransformerBlock(PreNormBlock):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, args: ModelArgs, *, sliding: bool):
        super().__init__(args, Attention(args, qk_norm=args.model_type == "qwen3"), MLP(args), sliding=sliding)


class Model(CausalLM):
    """A Llama-family causal LM: ``inputs (B, L) -> logits (B, L, vocab)``.

    ``sanitize`` drops precomputed ``rotary_emb.inv_freq`` buffers and, for a tied head,
    ``lm_head.weight`` (:class:`~mlx_infer.models.base.CausalLM`).
    """

    #: The family this graph belongs to (its module here; see :func:`mlx_infer.models.graph_family`).
    family = "llama"
    declaration = GraphDeclaration(method="autoregressive", compiled_decode=True)

    def __init__(self, args: ModelArgs):
        model = DecoderModel(args, lambda i: TransformerBlock(args, sliding=args.layer_types[i] == SLIDING))
        super().__init__(args, model)
