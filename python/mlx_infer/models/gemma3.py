"""Gemma 3 (text): interleaved sliding-window and global attention layers.

What sets it apart from Llama:

- RMSNorm scales by ``1 + weight``; four norms per block (before/after
  attention, before/after the MLP) plus per-head q/k norms.
- Embeddings are multiplied by ``sqrt(hidden_size)`` rounded through bfloat16
  (as HF does for bf16 checkpoints and mlx-lm always does).
- Sliding layers use the local rope base and a window of ``sliding_window``
  tokens; global layers use ``rope_theta`` and any rope scaling.
- Attention scale is ``query_pre_attn_scalar ** -0.5``; the MLP is GELU-tanh
  gated; the head is tied to the embedding.

The multimodal ``gemma3`` config (text settings under ``text_config``) is
flattened by :meth:`ModelArgs.from_dict`, and :meth:`Model.sanitize` maps its
``language_model`` weight names and drops the vision tower.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..contracts import GraphDeclaration
from ..errors import UnsupportedModelError
from ..layers.attention import scaled_dot_product_attention
from ..layers.rope import SUPPORTED_ROPE_TYPES, initialize_rope, rope_type_of
from .base import CausalLM, DecoderModel, GQAttention, rope_and_cache
from .schema import (FULL, SLIDING, check_heads, check_layer_types, check_nested_rope, check_number, check_rope_dict,
                     config_fields)

# Defaults HF's Gemma3TextConfig supplies when a multimodal text_config omits them.
_MULTIMODAL_TEXT_DEFAULTS = {"num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 262208}

# Weight-name prefixes of the multimodal checkpoint layouts, mapped to ours.
_PREFIX_MAP = (
    ("language_model.model.", "model."),  # transformers < 4.52 and mlx-community conversions
    ("model.language_model.", "model."),  # transformers >= 4.52
    ("language_model.lm_head.", "lm_head."),
)
_DROPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector.")


@dataclass
class ModelArgs:
    """Gemma 3 text settings, named as in HF ``config.json`` (defaults: Gemma 3 1B)."""

    model_type: str
    hidden_size: int = 1152
    num_hidden_layers: int = 26
    intermediate_size: int = 6912
    num_attention_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1.0e-6
    vocab_size: int = 262144
    num_key_value_heads: int = 1
    rope_theta: float | None = None
    rope_local_base_freq: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    query_pre_attn_scalar: float = 256
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    layer_types: list[str] | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelArgs":
        """Build from a ``gemma3_text`` or multimodal ``gemma3`` config, ignoring unknown keys."""
        params = dict(params)
        text = params.pop("text_config", None)
        if isinstance(text, dict):
            top = {k: v for k, v in params.items() if k != "vision_config"}
            params = {**_MULTIMODAL_TEXT_DEFAULTS, **text}
            if "vocab_size" in top:
                params["vocab_size"] = top["vocab_size"]
            if "tie_word_embeddings" in top and "tie_word_embeddings" not in text:
                params["tie_word_embeddings"] = top["tie_word_embeddings"]
        if "sliding_window_pattern" not in params and "_sliding_window_pattern" in params:
            params["sliding_window_pattern"] = params["_sliding_window_pattern"]
        return cls(**config_fields(cls, params))

    def __post_init__(self) -> None:
        check_heads(self.num_attention_heads, self.num_key_value_heads)
        check_nested_rope("rope_parameters", self.rope_parameters, SUPPORTED_ROPE_TYPES)
        check_rope_dict("rope_scaling", self.rope_scaling, SUPPORTED_ROPE_TYPES)
        if self.attn_logit_softcapping is not None:
            raise UnsupportedModelError(
                "Gemma 3 configs with attn_logit_softcapping are not supported (the fast attention "
                "kernel has no soft cap); set it to null if the checkpoint was trained without it."
            )
        rp = self.rope_parameters or {}
        nested = FULL in rp or SLIDING in rp
        global_rp = rp.get(FULL, {}) if nested else rp
        local_rp = rp.get(SLIDING, {}) if nested else {}
        if self.rope_theta is None:
            self.rope_theta = global_rp.get("rope_theta", 1_000_000.0)
        if self.rope_local_base_freq is None:
            self.rope_local_base_freq = local_rp.get("rope_theta", 10_000.0)
        if self.rope_scaling is None and rope_type_of(global_rp) != "default":
            self.rope_scaling = global_rp
        if self.layer_types is None:
            p = self.sliding_window_pattern
            self.layer_types = [FULL if (i + 1) % p == 0 else SLIDING for i in range(self.num_hidden_layers)]
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers)
        for name in ("rope_theta", "rope_local_base_freq"):
            setattr(self, name, check_number(name, getattr(self, name), integer=False, lo=0.0, hi=3.4e38, lo_open=True))


class RMSNorm(nn.Module):
    """RMSNorm scaling by ``1 + weight`` (the weight is stored as an offset from 1)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


@partial(mx.compile, shapeless=True)
def residual_add(x: mx.array, y: mx.array) -> mx.array:
    """``x + y``; in float16 summed in float32 and clipped so activations cannot overflow to inf."""
    if x.dtype != mx.float16:
        return x + y
    bound = mx.finfo(mx.float16).max
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -bound, bound).astype(mx.float16)


class Attention(GQAttention):
    """Grouped-query attention with q/k RMSNorm; local or global rope per layer kind."""

    def __init__(self, args: ModelArgs, *, sliding: bool):
        super().__init__(args, scale=args.query_pre_attn_scalar**-0.5)
        head_dim = self.head_dim
        self.q_norm = RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, eps=args.rms_norm_eps)
        if sliding:
            self.rope = initialize_rope(head_dim, args.rope_local_base_freq, False)
        else:
            self.rope = initialize_rope(head_dim, args.rope_theta, False, args.rope_scaling,
                                        args.max_position_embeddings)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, KVH, L, D)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, KVH, L, D)
        queries = self.q_norm(queries)
        keys = self.k_norm(keys)
        queries, keys, values = rope_and_cache(self.rope, queries, keys, values, cache)  # k, v: (B, KVH, S, D)
        out = scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)  # (B, H, L, D)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, H*D)
        return self.o_proj(out)


class MLP(nn.Module):
    """GELU-tanh gated feed-forward."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    """``h = x + post_attn(attn(pre(x)))``; ``out = h + post_ff(mlp(pre_ff(h)))``."""

    def __init__(self, args: ModelArgs, *, sliding: bool):
        super().__init__()
        self.use_sliding = sliding
        self.self_attn = Attention(args, sliding=sliding)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        eps = args.rms_norm_eps
        self.input_layernorm = RMSNorm(args.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps=eps)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = residual_add(x, self.post_attention_layernorm(r))
        r = self.mlp(self.pre_feedforward_layernorm(h))
        return residual_add(h, self.post_feedforward_layernorm(r))


class Gemma3Model(DecoderModel):
    """Embedding (scaled), blocks and final norm: tokens to final hidden states."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, lambda i: TransformerBlock(args, sliding=args.layer_types[i] == SLIDING),
                         norm=RMSNorm)
        # sqrt(hidden) rounded to bfloat16, as the checkpoints were trained and as mlx-lm
        # computes it (transformers in float32 uses the exact root: 25.30 vs 25.25 at 640).
        self.embed_scale: float = mx.array(args.hidden_size**0.5, mx.bfloat16).item()

    def embed(self, inputs: mx.array | None, input_embeddings: mx.array | None) -> mx.array:
        """Token embeddings (or unscaled ``input_embeddings``) ``(B, L, hidden)`` times ``embed_scale``."""
        h = super().embed(inputs, input_embeddings)  # (B, L, E)
        return h * mx.array(self.embed_scale, h.dtype)


class Model(CausalLM):
    """Gemma 3 causal LM: ``inputs (B, L) -> logits (B, L, vocab)``.

    ``input_embeddings`` are taken unscaled (the ``sqrt(hidden)`` normalizer is applied to them).
    """

    #: The family this graph belongs to (its module here; see :func:`mlx_infer.models.graph_family`).
    family = "gemma3"
    declaration = GraphDeclaration(method="autoregressive", compiled_decode=True)

    def __init__(self, args: ModelArgs):
        super().__init__(args, Gemma3Model(args))

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        """Project final hidden states ``(B, L, hidden)`` to logits ``(B, L, vocab)``, soft-capped when configured."""
        logits = super().logits_from_hidden(h)
        cap = self.args.final_logit_softcapping
        if cap is not None:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map checkpoint weights (text-only or multimodal layouts) to this module's names.

        Drops the vision tower and projector and strips the ``language_model`` prefixes;
        then the shared ``inv_freq`` and tied-head handling (:meth:`CausalLM.sanitize`).
        """
        out = {}
        for k, v in weights.items():
            if k.startswith(_DROPPED_PREFIXES):
                continue
            for old, new in _PREFIX_MAP:
                if k.startswith(old):
                    k = new + k[len(old):]
                    break
            out[k] = v
        return super().sanitize(out)
