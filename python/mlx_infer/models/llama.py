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
from ..layers.attention import create_attention_mask, scaled_dot_product_attention
from ..errors import ModelLoadError
from ..layers.rope import SUPPORTED_ROPE_TYPES, initialize_rope
from ..state.kv import KVCache, RotatingKVCache
from .schema import check_heads, check_layer_types, check_number, check_rope_dict, config_fields

FULL, SLIDING = "full_attention", "sliding_attention"


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


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE and optional per-head q/k norms."""

    def __init__(self, args: ModelArgs, *, qk_norm: bool):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim
        self.scale = head_dim**-0.5
        qkv_bias = args.qkv_bias
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=args.o_proj_bias)
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

        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)  # (B, KVH, S, D)
        else:
            queries = self.rope(queries)
            keys = self.rope(keys)

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


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, args: ModelArgs, *, sliding: bool):
        super().__init__()
        self.use_sliding = sliding
        self.self_attn = Attention(args, qk_norm=args.model_type == "qwen3")
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, blocks and final norm: tokens to final hidden states."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.sliding_window = args.sliding_window
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, sliding=t == SLIDING) for t in args.layer_types]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # One mask per layer kind, built from the first layer of that kind.
        self._full_idx = next((i for i, t in enumerate(args.layer_types) if t == FULL), None)
        self._swa_idx = next((i for i, t in enumerate(args.layer_types) if t == SLIDING), None)

    def __call__(self, inputs: mx.array | None, cache: list[Any] | None = None,
                 input_embeddings: mx.array | None = None) -> mx.array:
        """Return the final-norm hidden states ``(B, L, hidden)``."""
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)  # (B, L, E)
        if cache is None:
            cache = [None] * len(self.layers)
        full_mask = swa_mask = None
        if self._full_idx is not None:
            full_mask = create_attention_mask(h, cache[self._full_idx])
        if self._swa_idx is not None:
            swa_mask = create_attention_mask(h, cache[self._swa_idx], window_size=self.sliding_window)
        for layer, c in zip(self.layers, cache):
            h = layer(h, swa_mask if layer.use_sliding else full_mask, c)
        return self.norm(h)


class Model(nn.Module):
    """A Llama-family causal LM: ``inputs (B, L) -> logits (B, L, vocab)``."""

    #: The family this graph belongs to (its module here; see :func:`mlx_infer.models.graph_family`).
    family = "llama"
    declaration = GraphDeclaration(method="autoregressive", compiled_decode=True)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array | None, cache: list[Any] | None = None,
                 input_embeddings: mx.array | None = None) -> mx.array:
        """Logits for every position.

        Args:
            inputs: token ids ``(B, L)``; ignored when ``input_embeddings`` is given.
            cache: one cache per layer (from :meth:`make_cache`), updated in place.
            input_embeddings: ``(B, L, hidden)`` embeddings to use instead of ``inputs``.

        Returns:
            ``(B, L, vocab)`` logits.
        """
        return self.logits_from_hidden(self.model(inputs, cache, input_embeddings))

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        """Project final hidden states ``(B, L, hidden)`` to logits ``(B, L, vocab)``."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map checkpoint weights to this module's names.

        Drops precomputed ``rotary_emb.inv_freq`` buffers and, for a tied head,
        ``lm_head.weight``. An untied config whose checkpoint lacks
        ``lm_head.weight`` is switched to a tied head (what HF does on load).
        """
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if not self.args.tie_word_embeddings and not any(k.startswith("lm_head.") for k in weights):
            self.args.tie_word_embeddings = True
            self.pop("lm_head")
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights

    @property
    def layers(self) -> list[TransformerBlock]:
        return self.model.layers

    def make_cache(self) -> list[KVCache | RotatingKVCache]:
        """One cache per layer: rotating for sliding-window layers, growing otherwise."""
        return [RotatingKVCache(self.args.sliding_window) if layer.use_sliding else KVCache()
                for layer in self.layers]
