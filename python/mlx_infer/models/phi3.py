"""Phi-3 / Phi-3.5 / Phi-4-mini: fused projections and LongRoPE.

What sets it apart from Llama:

- One fused ``qkv_proj`` (queries, then keys, then values along the output) and one fused
  ``gate_up_proj`` (gate, then up) per block, as the checkpoints store them.
- RoPE may be partial (``partial_rotary_factor``: Phi-4-mini rotates 3/4 of each head) and
  scaled with LongRoPE (``rope_type`` ``longrope`` / ``su``: short and long per-frequency
  factors, see :class:`~mlx_infer.layers.rope.LongRoPE`) or linearly.
- ``sliding_window`` (Phi-3-mini-4k: 2047), when set, applies to every layer, as in
  transformers (mlx-lm ignores it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..contracts import GraphDeclaration
from ..errors import ModelLoadError
from ..layers.attention import scaled_dot_product_attention
from ..layers.rope import LongRoPE, initialize_rope, rope_type_of
from .base import CausalLM, DecoderModel, PreNormBlock, rope_and_cache
from .llama import swiglu
from .schema import check_heads, check_number, config_fields, rope_settings

ROPE_TYPES = ("default", "linear", "longrope", "su")


@dataclass
class ModelArgs:
    """Phi-3 settings, named as in HF ``config.json``."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    partial_rotary_factor: float | None = None
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int | None = None
    sliding_window: int | None = None
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelArgs":
        """Build from a config dict, ignoring keys this family does not use."""
        return cls(**config_fields(cls, params))

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        check_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.rope_theta, self.rope_scaling = rope_settings(self.rope_theta, self.rope_scaling, self.rope_parameters,
                                                           ROPE_TYPES, default_theta=10000.0)
        rp = self.rope_parameters or {}
        if self.partial_rotary_factor is None:
            self.partial_rotary_factor = rp.get("partial_rotary_factor", 1.0)
        self.partial_rotary_factor = check_number("partial_rotary_factor", self.partial_rotary_factor,
                                                  integer=False, lo=0.0, hi=1.0, lo_open=True)
        if self.original_max_position_embeddings is None:
            self.original_max_position_embeddings = (self.rope_scaling or {}).get(
                "original_max_position_embeddings", rp.get("original_max_position_embeddings", 4096))

    @property
    def rope_dims(self) -> int:
        """Rotated dimensions of each head."""
        return int(self.head_dim * self.partial_rotary_factor)


def make_rope(args: ModelArgs) -> nn.Module:
    """The config's RoPE: LongRoPE, linear, or plain (over the rotated dims)."""
    scaling = args.rope_scaling or {}
    if rope_type_of(scaling) in ("longrope", "su"):
        for key in ("short_factor", "long_factor"):
            if key not in scaling:
                raise ModelLoadError(f"\"rope_scaling\" of type longrope needs {key!r}; fix config.json.")
        return LongRoPE(args.rope_dims, base=args.rope_theta, short_factor=scaling["short_factor"],
                        long_factor=scaling["long_factor"],
                        original_max_position_embeddings=args.original_max_position_embeddings,
                        max_position_embeddings=args.max_position_embeddings,
                        factor=scaling.get("factor"), attention_factor=scaling.get("attention_factor"))
    return initialize_rope(args.rope_dims, args.rope_theta, False, args.rope_scaling or None)


class Attention(nn.Module):
    """Grouped-query attention over one fused q|k|v projection."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim
        self.scale = head_dim**-0.5
        self.qkv_proj = nn.Linear(dim, (self.n_heads + 2 * self.n_kv_heads) * head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)
        self.rope = make_rope(args)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        qkv = self.qkv_proj(x)  # (B, L, (H + 2 KVH) * D)
        q_end = self.n_heads * self.head_dim
        queries, keys, values = mx.split(qkv, [q_end, q_end + self.n_kv_heads * self.head_dim], axis=-1)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, KVH, L, D)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, KVH, L, D)
        queries, keys, values = rope_and_cache(self.rope, queries, keys, values, cache)  # k, v: (B, KVH, S, D)
        out = scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)  # (B, H, L, D)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, H*D)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU over one fused gate|up projection."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)  # (B, L, hidden) each
        return self.down_proj(swiglu(gate, up))


class TransformerBlock(PreNormBlock):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``; sliding when the config has a window."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, Attention(args), MLP(args.hidden_size, args.intermediate_size),
                         sliding=args.sliding_window is not None)


class Model(CausalLM):
    """Phi-3 causal LM: ``inputs (B, L) -> logits (B, L, vocab)``; the compiled decode step runs it through
    the llama forward (its fused qkv_proj and gate_up_proj as they are), except with LongRoPE (refused:
    decoded eagerly)."""

    #: The family this graph belongs to (its module here; see :func:`mlx_infer.models.graph_family`).
    family = "phi3"
    declaration = GraphDeclaration(method="autoregressive", compiled_decode=True)

    def __init__(self, args: ModelArgs):
        super().__init__(args, DecoderModel(args, lambda i: TransformerBlock(args)))
