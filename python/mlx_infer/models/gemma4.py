"""Gemma 4 (text): per-layer inputs, KV-shared layers and an optional MoE block.

What sets it apart from Gemma 3:

- RMSNorm scales by ``weight`` (not ``1 + weight``); values get a scale-free
  RMSNorm (``v_norm``); attention scale is 1 (q/k norms do the scaling).
- Full-attention layers have their own head dim (``global_head_dim``) and,
  with ``attention_k_eq_v``, their own KV heads (``num_global_key_value_heads``)
  and no ``v_proj``: values are the raw key projection. transformers >= 5.2x
  writes both as ``per_layer_config`` instead; either form is read.
- Full layers use *proportional* partial RoPE: the first
  ``partial_rotary_factor`` of the frequencies rotate, the rest stay put.
- Per-layer inputs (e2b/e4b): a packed embedding table
  ``(vocab, layers * P)`` plus a projection of the scaled embeddings give each
  layer a ``P``-wide input, gated into the residual after the MLP.
- KV sharing: the last ``num_kv_shared_layers`` layers own no K/V projections
  and no cache; each reads the keys/values its donor (the last non-shared layer
  of the same attention type) produced in the same forward pass.
- MoE (26B-A4B): a router (top-k with per-expert scale) and experts run
  beside the dense MLP, each with its own post-norm; experts use
  ``mx.gather_mm`` / ``mx.gather_qmm``.
- Each layer's output is multiplied by a learned ``layer_scalar``; final
  logits are soft-capped.

The op order follows mlx-lm's ``gemma4_text`` so logits are bit-identical to it.
The multimodal ``gemma4`` config (``text_config``) is flattened by
:meth:`ModelArgs.from_dict`; :meth:`Model.sanitize` maps the wrapper prefixes,
drops vision/audio towers, splits HF's fused expert tensors and adopts the
quantization of MLX-quantized checkpoints from the weight shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ..contracts import GraphDeclaration
from ..errors import UnsupportedModelError
from ..layers.attention import create_attention_mask, scaled_dot_product_attention
from ..layers.rope import SUPPORTED_ROPE_TYPES, initialize_rope, rope_type_of
from ..layers.switch import FP_MODES, QuantizedEmbeddingKept, QuantizedLinearKept, SwitchGLU, SwitchLinear
from ..state.kv import KVCache, RotatingKVCache
from .base import CausalLM
from .schema import (FULL, SLIDING, check_heads, check_layer_types, check_nested_rope, check_value, config_fields,
                     per_layer_indices)

_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
# Checkpoint prefixes of the multimodal layouts, mapped to ours.
_PREFIX_MAP = (
    ("model.language_model.", "model."),  # transformers
    ("language_model.model.", "model."),  # mlx-lm / mlx-vlm conversions
    ("language_model.lm_head.", "lm_head."),
)
_SHARED_SKIP = ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.", "self_attn.v_norm.")
# (group_size, bits) defaults per quantization mode; the scale-only modes are told apart by them.
_ROPE_TYPES = (*SUPPORTED_ROPE_TYPES, "proportional")


@dataclass
class ModelArgs:
    """Gemma 4 text settings, named and defaulted as HF's ``Gemma4TextConfig``.

    ``layer_head_dims``, ``layer_kv_heads`` and ``kv_donors`` (per layer: the
    index of the layer whose K/V it reads, or ``None`` when it owns them) are
    derived in ``__post_init__``.
    """

    model_type: str
    hidden_size: int = 2304
    num_hidden_layers: int = 30
    intermediate_size: int = 9216
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    per_layer_config: dict[Any, dict[str, Any]] | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    vocab_size: int = 262_144
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    rope_parameters: dict[str, Any] | None = None
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    layer_types: list[str] | None = None
    max_position_embeddings: int = 131_072
    final_logit_softcapping: float | None = None
    attention_k_eq_v: bool = False
    attention_bias: bool = False
    use_bidirectional_attention: str | None = None
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    tie_word_embeddings: bool = True
    layer_head_dims: list[int] = field(init=False, default_factory=list)
    layer_kv_heads: list[int] = field(init=False, default_factory=list)
    kv_donors: list[int | None] = field(init=False, default_factory=list)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelArgs":
        """Build from a ``gemma4_text`` or multimodal ``gemma4`` config, ignoring unknown keys."""
        params = dict(params)
        text = params.pop("text_config", None)
        if isinstance(text, dict):
            top = params
            params = dict(text)
            for key in ("vocab_size", "tie_word_embeddings"):
                if key in top and key not in text:
                    params[key] = top[key]
            params.setdefault("model_type", "gemma4_text")
        return cls(**config_fields(cls, params))

    def __post_init__(self) -> None:
        check_heads(self.num_attention_heads, self.num_key_value_heads)
        check_nested_rope("rope_parameters", self.rope_parameters, _ROPE_TYPES)
        unsupported = [what for what, bad in (
            ("use_bidirectional_attention='all' (a non-causal encoder)", self.use_bidirectional_attention == "all"),
            ("attention_bias=true", self.attention_bias),
            (f"hidden_activation={self.hidden_activation!r}",
             self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_approx"))) if bad]
        if unsupported:
            raise UnsupportedModelError(f"Gemma 4 configs with {', '.join(unsupported)} are not supported.")
        if self.rope_parameters is None:
            self.rope_parameters = _DEFAULT_ROPE
        n = self.num_hidden_layers
        if self.layer_types is None:
            p = self.sliding_window_pattern
            self.layer_types = [FULL if (i + 1) % p == 0 else SLIDING for i in range(n)]
        self.layer_types = check_layer_types(self.layer_types, n)
        self.layer_types[-1] = FULL  # as transformers forces it
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            raise ValueError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size in config.json.")

        # Per-layer head dim / KV heads: explicit per_layer_config, else the global_* keys on full layers.
        overrides: dict[int, dict[str, Any]] = {}
        if self.per_layer_config:
            for key, o in self.per_layer_config.items():
                idxs = per_layer_indices(key, o, self.layer_types)
                for i in idxs:
                    overrides.setdefault(i, {}).update(o)
        else:
            full: dict[str, Any] = {"head_dim": self.global_head_dim}
            if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
                full["num_key_value_heads"] = self.num_global_key_value_heads
            overrides = {i: full for i, t in enumerate(self.layer_types) if t == FULL}
        self.layer_head_dims = [overrides.get(i, {}).get("head_dim", self.head_dim) for i in range(n)]
        self.layer_kv_heads = [overrides.get(i, {}).get("num_key_value_heads", self.num_key_value_heads)
                               for i in range(n)]
        for i, (hd, kv) in enumerate(zip(self.layer_head_dims, self.layer_kv_heads)):
            check_value(f"head_dim of layer {i}", "int", hd, range_of="head_dim")
            check_value(f"num_key_value_heads of layer {i}", "int", kv, range_of="num_key_value_heads")
            check_heads(self.num_attention_heads, kv, f"num_key_value_heads of layer {i}")

        shared = self.num_kv_shared_layers
        if not 0 <= shared < n:
            raise UnsupportedModelError(
                f"num_kv_shared_layers={shared} leaves no layer owning a KV cache among {n} layers "
                "(draft models reading a target's cache are not supported).")
        first = n - shared
        last_of_type = {t: i for i, t in enumerate(self.layer_types[:first])}
        self.kv_donors = [None] * first
        for j in range(first, n):
            t = self.layer_types[j]
            if t not in last_of_type:
                raise ValueError(f"KV-shared layer {j} ({t}) has no earlier {t} layer to read K/V from; "
                                 "fix layer_types or num_kv_shared_layers in config.json.")
            self.kv_donors.append(last_of_type[t])

    def rope_for(self, layer_type: str) -> dict[str, Any]:
        """The rope settings of one attention type."""
        rp = self.rope_parameters
        return rp.get(layer_type, {}) if FULL in rp or SLIDING in rp else rp


@partial(mx.compile, shapeless=True)
def geglu(gate: mx.array, x: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * x


@partial(mx.compile, shapeless=True)
def logit_softcap(cap: float, x: mx.array) -> mx.array:
    return mx.tanh(x / cap) * cap


class ProportionalRoPE(nn.Module):
    """RoPE over the whole head where only the first ``rotated_dims`` frequencies turn.

    The remaining frequency slots get an infinite period (angle 0), so those
    dimension pairs pass through unchanged, as HF's zero inverse frequencies do.
    """

    def __init__(self, dims: int, rotated_dims: int, base: float, factor: float = 1.0):
        super().__init__()
        self.dims = dims
        exponents = mx.arange(0, rotated_dims, 2, dtype=mx.float32) / dims
        self._freqs = mx.concatenate([factor * (base**exponents), mx.full(((dims - rotated_dims) // 2,), mx.inf)])

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)


def make_rope(head_dim: int, params: dict[str, Any], max_position_embeddings: int) -> nn.Module:
    """The rope of one attention type: proportional, or any type :func:`initialize_rope` knows."""
    base = params.get("rope_theta", 10_000.0)
    if rope_type_of(params) == "proportional":
        rotated = 2 * int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        return ProportionalRoPE(head_dim, rotated, base, params.get("factor", 1.0))
    scaling = params if rope_type_of(params) != "default" else None
    return initialize_rope(head_dim, base, False, scaling, max_position_embeddings)


class Router(nn.Module):
    """Scale-free RMSNorm, ``* scale / sqrt(D)``, project, top-k, softmax over the k, ``* per_expert_scale``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.top_k_experts
        self.eps = args.rms_norm_eps
        self.proj = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.scale = mx.ones((args.hidden_size,))
        self.per_expert_scale = mx.ones((args.num_experts,))
        self._root_size = args.hidden_size**-0.5

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Return ``(indices, weights)``, each ``(B, L, k)``."""
        scores = self.proj(mx.fast.rms_norm(x, self.scale * self._root_size, self.eps))  # (B, L, E)
        idx = mx.argpartition(scores, kth=-self.top_k, axis=-1)[..., -self.top_k:]  # (B, L, k)
        weights = mx.softmax(mx.take_along_axis(scores, idx, axis=-1), axis=-1)
        return idx, weights * self.per_expert_scale[idx]


class Experts(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.switch_glu = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts, geglu)

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        y = self.switch_glu(x, indices)  # (B, L, k, D)
        return (mx.expand_dims(weights, -1) * y).sum(-2)


class MLP(nn.Module):
    """GELU-tanh gated feed-forward."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


class Attention(nn.Module):
    """GQA with q/k/v norms and scale 1; a KV-shared layer has only ``q_proj``, ``q_norm`` and ``o_proj``."""

    def __init__(self, args: ModelArgs, idx: int):
        super().__init__()
        dim = args.hidden_size
        self.layer_type = args.layer_types[idx]
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.layer_kv_heads[idx]
        self.head_dim = hd = args.layer_head_dims[idx]
        self.owns_kv = args.kv_donors[idx] is None
        self.k_eq_v = args.attention_k_eq_v and self.layer_type == FULL
        self.eps = args.rms_norm_eps
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        if self.owns_kv:
            self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
            self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.rope = make_rope(hd, args.rope_for(self.layer_type), args.max_position_embeddings)

    def __call__(self, x: mx.array, mask: Any, cache: Any = None, shared_kv: tuple[mx.array, mx.array] | None = None,
                 offset: int = 0) -> tuple[mx.array, tuple[mx.array, mx.array], int]:
        """Return ``(out (B, L, D), (keys, values) attended, rope offset)``; the last two feed KV-shared layers."""
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim))  # (B, L, H, D)
        if shared_kv is None:
            offset = cache.offset if cache is not None else 0
            keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)  # (B, L, KVH, D)
            values = keys if self.k_eq_v else self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            keys = self.rope(self.k_norm(keys).transpose(0, 2, 1, 3), offset=offset)  # (B, KVH, L, D)
            values = mx.fast.rms_norm(values, None, self.eps).transpose(0, 2, 1, 3)  # (B, KVH, L, D)
            if cache is not None:
                keys, values = cache.update_and_fetch(keys, values)  # (B, KVH, S, D)
        else:
            keys, values = shared_kv
        queries = self.rope(queries.transpose(0, 2, 1, 3), offset=offset)  # (B, H, L, D)
        out = scaled_dot_product_attention(queries, keys, values, scale=1.0, mask=mask)  # (B, H, L, D)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1)), (keys, values), offset


class DecoderLayer(nn.Module):
    """Attention, dense MLP (+ experts), per-layer-input gate, times ``layer_scalar``."""

    def __init__(self, args: ModelArgs, idx: int):
        super().__init__()
        d, eps = args.hidden_size, args.rms_norm_eps
        self.layer_type = args.layer_types[idx]
        # Read by the paged KV store and the prefill policy, as on the other families' layers:
        # without it every layer would be paged as global (attending past its window).
        self.use_sliding = self.layer_type == SLIDING
        self.self_attn = Attention(args, idx)
        wide = args.use_double_wide_mlp and args.kv_donors[idx] is not None
        self.mlp = MLP(d, args.intermediate_size * (2 if wide else 1))
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(d, eps=eps)
        self.enable_moe = args.enable_moe_block
        if self.enable_moe:
            self.router = Router(args)
            self.experts = Experts(args)
            self.post_feedforward_layernorm_1 = nn.RMSNorm(d, eps=eps)
            self.post_feedforward_layernorm_2 = nn.RMSNorm(d, eps=eps)
            self.pre_feedforward_layernorm_2 = nn.RMSNorm(d, eps=eps)
        self.has_per_layer_input = bool(args.hidden_size_per_layer_input)
        if self.has_per_layer_input:
            p = args.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(d, p, bias=False)
            self.per_layer_projection = nn.Linear(p, d, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(d, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, mask: Any, cache: Any = None, per_layer_input: mx.array | None = None,
                 shared_kv: tuple[mx.array, mx.array] | None = None,
                 offset: int = 0) -> tuple[mx.array, tuple[mx.array, mx.array], int]:
        r, kv, offset = self.self_attn(self.input_layernorm(x), mask, cache, shared_kv, offset)
        h = x + self.post_attention_layernorm(r)
        if self.enable_moe:
            h1 = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
            idx, weights = self.router(h)
            h2 = self.experts(self.pre_feedforward_layernorm_2(h), idx, weights)
            r = h1 + self.post_feedforward_layernorm_2(h2)
        else:
            r = self.mlp(self.pre_feedforward_layernorm(h))
        h = h + self.post_feedforward_layernorm(r)
        if self.has_per_layer_input and per_layer_input is not None:
            gate = nn.gelu_approx(self.per_layer_input_gate(h)) * per_layer_input  # (B, L, P)
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar, kv, offset


class Gemma4Model(nn.Module):
    """Embeddings (+ per-layer inputs), blocks and final norm: tokens to final hidden states."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.window_size = args.sliding_window
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        # Applied in the activations' dtype (as HF casts it to the weights' dtype and mlx-lm does).
        self.embed_scale = args.hidden_size**0.5
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.per_layer_width = p = args.hidden_size_per_layer_input
        if p:
            n = args.num_hidden_layers
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, n * p)
            self.embed_tokens_per_layer_scale = p**0.5
            self.per_layer_input_scale = 2.0**-0.5
            self.per_layer_projection_scale = args.hidden_size**-0.5
            self.per_layer_model_projection = nn.Linear(args.hidden_size, n * p, bias=False)
            self.per_layer_projection_norm = nn.RMSNorm(p, eps=args.rms_norm_eps)
        self.num_cache_layers = args.kv_donors.count(None)
        self._donor_set = {d for d in args.kv_donors if d is not None}
        # One mask per attention type, built from the first layer of that type (always a cache owner).
        self._mask_idx = {t: args.layer_types.index(t) for t in set(args.layer_types)}

    def per_layer_inputs(self, inputs: mx.array) -> mx.array:
        """Token-identity per-layer inputs ``(B, L, layers, P)`` from token ids ``(B, L)``."""
        out = self.embed_tokens_per_layer(inputs) * self.embed_tokens_per_layer_scale  # (B, L, layers*P)
        return mx.unflatten(out, -1, (self.args.num_hidden_layers, self.per_layer_width))

    def project_per_layer_inputs(self, h: mx.array, per_layer_inputs: mx.array | None) -> mx.array:
        """Combine the projection of the scaled embeddings ``h`` with the token-identity part."""
        proj = self.per_layer_model_projection(h) * self.per_layer_projection_scale  # (B, L, layers*P)
        proj = self.per_layer_projection_norm(mx.unflatten(proj, -1, (self.args.num_hidden_layers,
                                                                      self.per_layer_width)))
        if per_layer_inputs is None:
            return proj
        return (proj + per_layer_inputs) * self.per_layer_input_scale  # (B, L, layers, P)

    def _ids_from_embeddings(self, emb: mx.array) -> mx.array:
        """The token whose embedding row is nearest to each of ``emb (B, L, D)``."""
        e = self.embed_tokens
        table = e.weight if isinstance(e, nn.Embedding) else mx.dequantize(
            e.weight, e.scales, e.get("biases"), e.group_size, e.bits, mode=e.mode)  # (V, D)
        w2 = table.square().sum(-1)  # (V,)
        dist = w2 - 2 * self.embed_tokens.as_linear(emb)  # (B, L, V), |e|^2 omitted: constant per row
        return mx.argmin(dist, axis=-1)

    def __call__(self, inputs: mx.array | None, cache: list[Any] | None = None,
                 input_embeddings: mx.array | None = None, per_layer_inputs: mx.array | None = None) -> mx.array:
        """Return the final-norm hidden states ``(B, L, hidden)``.

        Args:
            inputs: token ids ``(B, L)``, or ``None`` with ``input_embeddings``.
            cache: the caches of :meth:`Model.make_cache` (one per KV-owning layer).
            input_embeddings: unscaled embeddings ``(B, L, hidden)`` to use instead of ``inputs``.
            per_layer_inputs: token-identity per-layer inputs ``(B, L, layers, P)``; when absent
                they are looked up from ``inputs`` (or from the nearest embedding rows).
        """
        if input_embeddings is None:
            input_embeddings = self.embed_tokens(inputs)
        h = input_embeddings * self.embed_scale  # (B, L, D)
        n = len(self.layers)
        pli: list[mx.array | None] = [None] * n
        if self.per_layer_width:
            if per_layer_inputs is None:
                ids = inputs if inputs is not None else self._ids_from_embeddings(input_embeddings)
                per_layer_inputs = self.per_layer_inputs(ids)
            per_layer_inputs = self.project_per_layer_inputs(h, per_layer_inputs)  # (B, L, layers, P)
            pli = [per_layer_inputs[:, :, i, :] for i in range(n)]
        caches = list(cache) if cache is not None else []
        caches += [None] * (n - len(caches))
        masks = {t: create_attention_mask(h, caches[i], window_size=self.window_size if t == SLIDING else None)
                 for t, i in self._mask_idx.items()}
        kvs: dict[int, tuple[tuple[mx.array, mx.array], int]] = {}
        for i, (layer, donor) in enumerate(zip(self.layers, self.args.kv_donors)):
            shared, offset = kvs[donor] if donor is not None else (None, 0)
            h, kv, offset = layer(h, masks[layer.layer_type], caches[i], pli[i], shared, offset)
            if i in self._donor_set:
                kvs[i] = (kv, offset)
        return self.norm(h)


class Model(CausalLM):
    """Gemma 4 causal LM: ``inputs (B, L) -> logits (B, L, vocab)``.

    Compiled decode is declared: the C++ step's one forward (``cpp/decode/forward.cpp``)
    covers every switch (``bindings/graph_spec.py: _gemma4_spec`` sets them); a graph it cannot build (e.g. nvfp4 experts with a global
    scale) is refused by the binding, which then decodes eagerly.
    """

    #: The family this graph belongs to (its module here; see :func:`mlx_infer.models.graph_family`).
    family = "gemma4"
    declaration = GraphDeclaration(method="autoregressive", compiled_decode=True)

    def __init__(self, args: ModelArgs):
        super().__init__(args, Gemma4Model(args))

    def __call__(self, inputs: mx.array | None, cache: list[Any] | None = None,
                 input_embeddings: mx.array | None = None, per_layer_inputs: mx.array | None = None) -> mx.array:
        """Logits ``(B, L, vocab)`` for every position (arguments as :meth:`Gemma4Model.__call__`)."""
        return self.logits_from_hidden(self.model(inputs, cache, input_embeddings, per_layer_inputs))

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        """Project final hidden states ``(B, L, hidden)`` to soft-capped logits ``(B, L, vocab)``."""
        logits = super().logits_from_hidden(h)
        cap = self.args.final_logit_softcapping
        return logit_softcap(cap, logits) if cap is not None else logits

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map checkpoint weights (HF, mlx-lm or mlx-vlm; text-only or multimodal) to this module's names.

        Drops vision/audio towers and embedders, rotary buffers and the K/V
        weights of KV-shared layers; splits HF's fused ``experts.gate_up_proj``
        ``(E, 2I, D)`` into ``switch_glu.gate_proj``/``up_proj`` and renames
        ``experts.down_proj``; drops a tied ``lm_head``. For MLX-quantized
        weights (``*.scales``) it quantizes the matching modules of this model
        with the bits, group size and mode the shapes imply, so per-layer
        precisions (e.g. an 8-bit router) load whatever the config's keys say.
        """
        out: dict[str, mx.array] = {}
        for k, v in weights.items():
            for old, new in _PREFIX_MAP:
                if k.startswith(old):
                    k = new + k[len(old):]
                    break
            parts = k.split(".")
            if parts[0] not in ("model", "lm_head") or "rotary_emb" in k:
                continue
            if parts[1] not in ("embed_tokens", "embed_tokens_per_layer", "layers", "norm",
                                "per_layer_model_projection", "per_layer_projection_norm") and parts[0] == "model":
                continue  # vision/audio towers and embedders, under model.*
            donors = self.args.kv_donors
            if parts[1] == "layers" and int(parts[2]) < len(donors) and donors[int(parts[2])] is not None \
                    and ".".join(parts[3:]).startswith(_SHARED_SKIP):
                continue
            if k.endswith(".experts.gate_up_proj"):
                base = k[: -len("gate_up_proj")] + "switch_glu."
                gate, up = mx.split(v, 2, axis=-2)
                out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = mx.contiguous(gate), mx.contiguous(up)
                continue
            if k.endswith(".experts.down_proj"):
                k = k[: -len("down_proj")] + "switch_glu.down_proj.weight"
            out[k] = v
        out = self.sanitize_head(out)
        self._adopt_quantization(out)
        return out

    def _adopt_quantization(self, weights: dict[str, mx.array]) -> None:
        """Quantize each module that has ``<path>.scales`` in ``weights`` as its shapes say."""
        modules = dict(self.named_modules())
        swaps = []
        for key in weights:
            if not key.endswith(".scales"):
                continue
            path = key[: -len(".scales")]
            m = modules.get(path)
            if not isinstance(m, (nn.Linear, nn.Embedding, SwitchLinear)):
                continue
            in_dims, packed = m.weight.shape[-1], weights[path + ".weight"]
            bits, group_size = packed.shape[-1] * 32 // in_dims, in_dims // weights[key].shape[-1]
            mode = "affine" if path + ".biases" in weights else FP_MODES.get((group_size, bits))
            if packed.shape[:-1] != m.weight.shape[:-1] or packed.shape[-1] * 32 != bits * in_dims or mode is None:
                raise ValueError(f"The quantized weights of {path} {tuple(packed.shape)} do not fit its shape "
                                 f"{tuple(m.weight.shape)} in this config (or use an unknown mode); check config.json.")
            if isinstance(m, nn.Linear):
                q = QuantizedLinearKept.from_linear(m, group_size, bits, mode)
            elif isinstance(m, nn.Embedding):
                q = QuantizedEmbeddingKept.from_embedding(m, group_size, bits, mode)
            else:
                q = m.to_quantized(group_size=group_size, bits=bits, mode=mode)
                if path + ".global_scale" in weights:
                    q.global_scale = mx.zeros(weights[path + ".global_scale"].shape, mx.float32)
            swaps.append((path, q))
        if swaps:
            self.update_modules(tree_unflatten(swaps))

    @property
    def quant_predicate(self):
        """mlx-lm's choice for converting: the router projection at 8 bits, everything else the default."""
        return lambda path, _: {"group_size": 64, "bits": 8} if path.endswith("router.proj") else True

    def make_cache(self) -> list[KVCache | RotatingKVCache]:
        """One cache per KV-owning layer (KV-shared layers read their donor's): rotating for sliding layers."""
        return [RotatingKVCache(self.args.sliding_window) if layer.layer_type == SLIDING else KVCache()
                for layer, donor in zip(self.layers, self.args.kv_donors) if donor is None]
