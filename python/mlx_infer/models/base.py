"""The scaffolding the decoder-only families share (not a family: no ``model_type`` maps here).

- :class:`GQAttention`: the q/k/v/o projections of grouped-query attention.
- :func:`rope_and_cache`: the RoPE-then-cache step of every RoPE attention.
- :class:`PreNormBlock`: ``h = x + attn(norm(x)); out = h + mlp(norm(h))`` with RMSNorms.
- :class:`DecoderModel`: embedding, blocks and final norm, with one mask per layer kind.
- :class:`CausalLM`: the LM wrapper (tied or untied head, ``sanitize``, ``layers``, ``make_cache``).

A family keeps its distinctive math (attention, MLP, block order, embedding scale, logit
caps) in its own file and subclasses these for the rest. Each family's ``Model`` class stays
defined in the family module and declares its ``family`` there (read by
:func:`mlx_infer.models.graph_family`).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from ..layers.attention import create_attention_mask
from ..state.kv import KVCache, RotatingKVCache


def rope_and_cache(rope: Callable[..., mx.array], queries: mx.array, keys: mx.array, values: mx.array,
                   cache: Any) -> tuple[mx.array, mx.array, mx.array]:
    """Rotate ``queries`` / ``keys`` at the cache's offset and append keys and values to the cache.

    Args:
        rope: the layer's RoPE module, called as ``rope(x, offset=...)``.
        queries: ``(B, H, L, D)``.
        keys, values: ``(B, KVH, L, D)``.
        cache: the layer's cache, or ``None`` (positions from 0, nothing stored).

    Returns:
        ``(queries (B, H, L, D), keys (B, KVH, S, D), values (B, KVH, S, D))``; ``S`` is the
        cached length including these ``L`` tokens (``L`` without a cache).
    """
    if cache is not None:
        queries = rope(queries, offset=cache.offset)
        keys = rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)  # (B, KVH, S, D)
    else:
        queries = rope(queries)
        keys = rope(keys)
    return queries, keys, values


class GQAttention(nn.Module):
    """The projections of grouped-query attention; a family's subclass adds its RoPE and norms
    and writes the forward.

    ``q_proj`` maps ``hidden -> n_heads * head_dim``, ``k_proj`` / ``v_proj`` ``hidden ->
    n_kv_heads * head_dim`` and ``o_proj`` back (mlx-lm's names; the tensor-parallel plan
    and the kernel swaps read ``n_heads`` / ``n_kv_heads`` / ``head_dim``).

    Args:
        args: the family's settings (``hidden_size``, ``num_attention_heads``,
            ``num_key_value_heads``, ``head_dim``).
        qkv_bias, o_bias: biases on the q/k/v and the output projections.
        scale: the attention scale (default ``head_dim ** -0.5``).
    """

    def __init__(self, args: Any, *, qkv_bias: bool = False, o_bias: bool = False, scale: float | None = None):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=o_bias)


class PreNormBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))`` (RMSNorms).

    Args:
        args: the family's settings (``hidden_size``, ``rms_norm_eps``).
        attn: the attention, called as ``attn(x, mask, cache)``.
        mlp: the feed-forward (dense or experts), called as ``mlp(x)``.
        sliding: whether the layer attends over a sliding window (its mask and cache).
    """

    def __init__(self, args: Any, attn: nn.Module, mlp: nn.Module, *, sliding: bool = False):
        super().__init__()
        self.use_sliding = sliding
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """Embedding, blocks and final norm: tokens to final hidden states.

    Layers with ``use_sliding`` get a mask over the last ``args.sliding_window`` tokens,
    the others a causal one; each mask is built once, from the cache of the first layer
    of its kind (``_full_idx`` / ``_swa_idx``, which the pipeline plan moves to a layer
    its rank holds).

    Args:
        args: the family's settings (``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
            ``rms_norm_eps``, optionally ``sliding_window``).
        make_layer: builds block ``i`` (called in layer order, after the embedding).
        norm: the final norm's class (``nn.RMSNorm`` or a family's own).
        mask_as_array: pass masks as arrays (attention that adds the mask to its scores itself).
    """

    def __init__(self, args: Any, make_layer: Callable[[int], nn.Module], *, norm: type = nn.RMSNorm,
                 mask_as_array: bool = False):
        super().__init__()
        self.args = args
        self.mask_as_array = mask_as_array
        self.sliding_window: int | None = getattr(args, "sliding_window", None)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [make_layer(i) for i in range(args.num_hidden_layers)]
        self.norm = norm(args.hidden_size, eps=args.rms_norm_eps)
        kinds = [layer.use_sliding for layer in self.layers]
        self._full_idx = next((i for i, s in enumerate(kinds) if not s), None)
        self._swa_idx = next((i for i, s in enumerate(kinds) if s), None)

    def embed(self, inputs: mx.array | None, input_embeddings: mx.array | None) -> mx.array:
        """Token embeddings ``(B, L, hidden)``, or ``input_embeddings`` when given (a family scales them here)."""
        return input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)

    def __call__(self, inputs: mx.array | None, cache: list[Any] | None = None,
                 input_embeddings: mx.array | None = None) -> mx.array:
        """Return the final-norm hidden states ``(B, L, hidden)``."""
        h = self.embed(inputs, input_embeddings)  # (B, L, E)
        if cache is None:
            cache = [None] * len(self.layers)
        full_mask = swa_mask = None
        if self._full_idx is not None:
            full_mask = create_attention_mask(h, cache[self._full_idx], return_array=self.mask_as_array)
        if self._swa_idx is not None:
            swa_mask = create_attention_mask(h, cache[self._swa_idx], window_size=self.sliding_window,
                                             return_array=self.mask_as_array)
        for layer, c in zip(self.layers, cache):
            h = layer(h, swa_mask if layer.use_sliding else full_mask, c)
        return self.norm(h)


class CausalLM(nn.Module):
    """A causal LM over a :class:`DecoderModel`: ``inputs (B, L) -> logits (B, L, vocab)``.

    Args:
        args: the family's settings (``model_type``, ``hidden_size``, ``vocab_size``,
            ``tie_word_embeddings``, optionally ``sliding_window``).
        model: the family's decoder (built before the untied ``lm_head``).
    """

    def __init__(self, args: Any, model: nn.Module):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = model
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array | None, cache: list[Any] | None = None,
                 input_embeddings: mx.array | None = None) -> mx.array:
        """Logits for every position.

        Args:
            inputs: token ids ``(B, L)``; ignored when ``input_embeddings`` is given.
            cache: one cache per layer (from :meth:`make_cache`), updated in place.
            input_embeddings: ``(B, L, hidden)`` embeddings to use instead of ``inputs``
                (unscaled: a family that scales its embeddings scales these too).

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
        """Drop precomputed ``rotary_emb.inv_freq`` buffers, then :meth:`sanitize_head`."""
        return self.sanitize_head({k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k})

    def sanitize_head(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop ``lm_head.*`` for a tied head; an untied config whose checkpoint lacks
        ``lm_head.weight`` is switched to a tied head (what HF does on load)."""
        if not self.args.tie_word_embeddings and not any(k.startswith("lm_head.") for k in weights):
            self.args.tie_word_embeddings = True
            self.pop("lm_head")
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights

    @property
    def layers(self) -> list[nn.Module]:
        """The decoder's blocks."""
        return self.model.layers

    def make_cache(self) -> list[KVCache | RotatingKVCache]:
        """One cache per layer: rotating (window-sized) for sliding layers, growing otherwise."""
        return [RotatingKVCache(self.args.sliding_window) if layer.use_sliding else KVCache()
                for layer in self.layers]


__all__ = ["CausalLM", "DecoderModel", "GQAttention", "PreNormBlock", "rope_and_cache"]
