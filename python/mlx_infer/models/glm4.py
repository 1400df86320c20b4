"""GLM-4 (GLM-4-0414 dense): sandwich norms, partial interleaved RoPE, fused gate|up.

What sets it apart from Llama:

- Four norms per block: ``h = x + post_self_attn_norm(attn(input_norm(x)))``,
  ``out = h + post_mlp_norm(mlp(post_attention_norm(h)))``.
- RoPE rotates the first ``partial_rotary_factor`` of each head (default 1/2) in the
  interleaved ("traditional") layout.
- Bias on q/k/v (``attention_bias``), none on o_proj (otherwise Llama's attention,
  :class:`~mlx_infer.models.llama.Attention`); one fused ``gate_up_proj``
  (:class:`~mlx_infer.models.phi3.MLP`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..contracts import GraphDeclaration
from ..layers.rope import initialize_rope
from . import llama
from .base import CausalLM, DecoderModel
from .phi3 import MLP
from .schema import check_number, config_fields


@dataclass
class ModelArgs(llama.ModelArgs):
    """GLM-4 settings: the Llama family's plus the rotated fraction of each head."""

    partial_rotary_factor: float | None = None
    rope_traditional: bool = True
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelArgs":
        """Build from a config dict, ignoring keys this family does not use."""
        return cls(**config_fields(cls, params))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.partial_rotary_factor is None:
            self.partial_rotary_factor = (self.rope_parameters or {}).get("partial_rotary_factor", 0.5)
        self.partial_rotary_factor = check_number("partial_rotary_factor", self.partial_rotary_factor,
                                                  integer=False, lo=0.0, hi=1.0, lo_open=True)

    @property
    def o_proj_bias(self) -> bool:
        """GLM-4 has no bias on o_proj, whatever ``attention_bias`` says (it biases q/k/v only)."""
        return False


class Attention(llama.Attention):
    """Llama's attention (q/k/v bias from ``attention_bias``, none on o_proj) with partial interleaved RoPE."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, qk_norm=False)
        self.rope = initialize_rope(int(self.head_dim * args.partial_rotary_factor), args.rope_theta,
                                    args.rope_traditional, args.rope_scaling, args.max_position_embeddings)


class TransformerBlock(nn.Module):
    """Sandwich-norm block (a norm before and after each sublayer)."""

    #: The compiled decode step's norms (the llama forward's sandwich) <- this block's attributes.
    decode_norms = {"attn_norm": "input_layernorm", "post_attn_norm": "post_self_attn_layernorm",
                    "mlp_norm": "post_attention_layernorm", "post_mlp_norm": "post_mlp_layernorm"}

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.use_sliding = False
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        eps = args.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.post_self_attn_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.post_mlp_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h = x + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), mask, cache))
        return self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(h))) + h


class Model(CausalLM):
    """GLM-4 causal LM: ``inputs (B, L) -> logits (B, L, vocab)``; the compiled decode step runs it through
    the llama forward (sandwich norms by :attr:`TransformerBlock.decode_norms`, the fused gate|up)."""

    #: The family this graph belongs to (its module here; see :func:`mlx_infer.models.graph_family`).
    family = "glm4"
    declaration = GraphDeclaration(method="autoregressive", compiled_decode=True)

    def __init__(self, args: ModelArgs):
        super().__init__(args, DecoderModel(args, lambda i: TransformerBlock(args)))
