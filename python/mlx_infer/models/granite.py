"""IBM Granite (3.x dense): the Llama graph with four multipliers.

- ``embedding_multiplier`` scales the token embeddings (also given ``input_embeddings``);
- ``attention_multiplier`` is the attention scale (instead of ``head_dim ** -0.5``);
- ``residual_multiplier`` scales each sublayer's output before its residual add;
- ``logits_scaling`` divides the logits.

Everything else (RoPE and its scaling, biases, GQA, tied or untied head) is the Llama
family's, read by :class:`~mlx_infer.models.llama.ModelArgs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..contracts import GraphDeclaration
from . import llama
from .base import CausalLM, DecoderModel, PreNormBlock
from .llama import MLP, Attention
from .schema import check_number, config_fields

_F32_MAX = 3.4e38


@dataclass
class ModelArgs(llama.ModelArgs):
    """Granite settings: the Llama family's plus the multipliers."""

    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelArgs":
        """Build from a config dict, ignoring keys this family does not use."""
        return cls(**config_fields(cls, params))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention_multiplier is None:
            self.attention_multiplier = self.head_dim**-0.5
        for name in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"):
            setattr(self, name, check_number(name, getattr(self, name), integer=False, lo=0.0, hi=_F32_MAX,
                                             lo_open=True))


class TransformerBlock(PreNormBlock):
    """Pre-norm block with scaled residual branches."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, Attention(args, qk_norm=False), MLP(args))
        self.self_attn.scale = args.attention_multiplier
        self.residual_multiplier = args.residual_multiplier

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache) * self.residual_multiplier
        return h + self.mlp(self.post_attention_layernorm(h)) * self.residual_multiplier


class GraniteModel(DecoderModel):
    """Embedding (scaled), blocks and final norm: tokens to final hidden states."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, lambda i: TransformerBlock(args))

    def embed(self, inputs: mx.array | None, input_embeddings: mx.array | None) -> mx.array:
        """Token embeddings (or ``input_embeddings``) ``(B, L, hidden)`` times ``embedding_multiplier``."""
        return super().embed(inputs, input_embeddings) * self.args.embedding_multiplier


class Model(CausalLM):
    """Granite causal LM: ``inputs (B, L) -> logits (B, L, vocab)``; the compiled decode step runs it
    through the llama forward with :meth:`decode_switches`."""

    #: The family this graph belongs to (its module here; see :func:`mlx_infer.models.graph_family`).
    family = "granite"
    declaration = GraphDeclaration(method="autoregressive", compiled_decode=True)

    def __init__(self, args: ModelArgs):
        super().__init__(args, GraniteModel(args))

    def decode_switches(self) -> dict[str, float]:
        """What the compiled decode step (the llama forward of ``cpp/decode/graph.cpp``) adds for Granite:
        the embedding, residual and logits multipliers (the attention one is the attention's ``scale``)."""
        a = self.args
        return {"embed_scale": float(a.embedding_multiplier) if a.embedding_multiplier != 1.0 else 0.0,
                "residual_scale": float(a.residual_multiplier), "logits_divisor": float(a.logits_scaling)}

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        """Project final hidden states ``(B, L, hidden)`` to logits ``(B, L, vocab)`` over ``logits_scaling``."""
        return super().logits_from_hidden(h) / self.args.logits_scaling
