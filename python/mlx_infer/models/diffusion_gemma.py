"""Diffusion Gemma (text): a causal encoder that fills KV state and a canvas decoder over it.

Block diffusion, as transformers' ``DiffusionGemmaForBlockDiffusion`` runs it:

- The **encoder** is a Gemma 4 text trunk (no per-layer inputs, no KV
  sharing). It prefills the prompt into per-layer KV state and, once a block
  is final, extends that state with the block's tokens (causal, sliding
  windows as Gemma 4).
- The **decoder** reads a canvas of ``canvas_length`` tokens. It shares every
  weight with the encoder (HF ties them) and never writes the state: each
  layer attends bidirectionally (no mask) over the cached keys it may see and
  the canvas' own keys. A full layer sees the whole encoded sequence; a
  sliding layer sees the newest ``sliding_window - 1`` encoded tokens (what
  HF's dynamic sliding cache keeps) plus the canvas. Canvas positions follow
  the encoded sequence.
- **Self-conditioning**: the decoder input is
  ``rms(embed(canvas) * s + down(gelu(gate(n)) * up(n)))`` with
  ``n = pre_norm(feedback)``; the feedback of step t+1 is the soft embedding
  of step t's (temperature-scaled) logits, ``softmax(logits) @ E * s``
  (``s = sqrt(hidden)``); the first step has none.
- Full-attention layers never have ``v_proj`` (values are the raw keys); MoE
  is on when the config names ``num_experts`` (HF's only variant), dense
  otherwise. Logits are soft-capped at 30 in float32.

The layers, attention, RoPE, MoE and quantization handling are Gemma 4's
(:mod:`.gemma4`), imported, not copied.

Weights: HF checkpoints store the decoder (``model.decoder.*``) and the
encoder's untied buffers (``layer_scalar``); the encoder copies of tied weights,
the vision tower and ``lm_head`` (tied) are dropped by :meth:`Model.sanitize`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..contracts import GraphDeclaration
from ..errors import UnsupportedModelError
from ..state.kv import KVCache, RotatingKVCache
from . import gemma4
from .schema import config_fields
from .gemma4 import MLP, SLIDING, Gemma4Model, logit_softcap

#: Prompt tokens per encoder chunk when the caller does not choose.
DEFAULT_PREFILL_CHUNK = 2048
_SOFTCAP = 30.0  # HF's DiffusionGemmaTextConfig fixes it (a class attribute, never serialized)
_ENCODER_SCALAR = re.compile(r"model\.encoder\.language_model\.layers\.(\d+)\.layer_scalar$")


@dataclass
class ModelArgs:
    """Diffusion Gemma settings: the block length and the Gemma 4 text trunk.

    Attributes:
        model_type: ``"diffusion_gemma"`` (or ``"diffusion_gemma_text"``).
        canvas_length: tokens per canvas (block).
        text_config: the ``text_config`` dict (or the flat text config).
        tie_word_embeddings: the LM head is the embedding table.
        trunk: the derived :class:`gemma4.ModelArgs` of the shared layers.
    """

    model_type: str = "diffusion_gemma"
    canvas_length: int = 256
    text_config: dict[str, Any] = field(default_factory=dict)
    tie_word_embeddings: bool = True
    trunk: gemma4.ModelArgs = field(init=False)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelArgs":
        """Build from a ``diffusion_gemma`` config (``text_config`` inside) or a flat text one."""
        params = dict(params)
        if not isinstance(params.get("text_config"), dict):
            params["text_config"] = {k: v for k, v in params.items() if k != "text_config"}
        return cls(**config_fields(cls, params))

    def __post_init__(self) -> None:
        c = self.canvas_length
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"canvas_length must be a positive integer (tokens per denoised block), got {c!r}; "
                             "fix it in config.json.")
        text = dict(self.text_config)
        text.setdefault("final_logit_softcapping", _SOFTCAP)
        text.setdefault("tie_word_embeddings", self.tie_word_embeddings)
        text.update(
            model_type="diffusion_gemma_text",
            hidden_size_per_layer_input=0,  # no per-layer inputs
            num_kv_shared_layers=0,  # no KV sharing
            attention_k_eq_v=True,  # full layers have no v_proj in this family
            enable_moe_block=bool(text.get("num_experts")),
        )
        self.trunk = gemma4.ModelArgs.from_dict(text)
        self.tie_word_embeddings = self.trunk.tie_word_embeddings


class SelfConditioning(MLP):
    """Gemma 4's gated MLP over the pre-normed feedback, added to the canvas embeddings, then a scale-free RMSNorm."""

    def __init__(self, dim: int, hidden: int, eps: float):
        super().__init__(dim, hidden)
        self.pre_norm = nn.RMSNorm(dim, eps=eps)
        self.eps = eps

    def __call__(self, embeddings: mx.array, feedback: mx.array | None) -> mx.array:
        if feedback is not None:  # with no feedback the MLP adds exactly 0 (MLP(rms(0)) == 0)
            embeddings = embeddings + super().__call__(self.pre_norm(feedback))
        return mx.fast.rms_norm(embeddings, None, self.eps)


def _newest(cache: Any, n: int | None) -> tuple[mx.array, mx.array]:
    """The newest ``n`` (all when ``None``) cached keys/values ``(B, KVH, <=n, D)``."""
    keys, values = cache.state
    if isinstance(cache, RotatingKVCache):
        # After a one-token write the buffer is a ring whose oldest slot is the next write
        # slot (see RotatingKVCache); put it back in temporal order before cutting.
        idx = int(cache.meta_state[2])
        if idx < keys.shape[2]:
            keys = mx.concatenate([keys[..., idx:, :], keys[..., :idx, :]], axis=2)
            values = mx.concatenate([values[..., idx:, :], values[..., :idx, :]], axis=2)
    if n is not None and keys.shape[2] > n:
        keys, values = keys[..., -n:, :], values[..., -n:, :]
    return keys, values


class _CanvasView:
    """One layer's encoder state as the decoder reads it: cached keys + the canvas', nothing written."""

    def __init__(self, cache: Any, keep: int | None):
        self.offset = cache.offset  # canvas positions continue the encoded sequence
        self._keys, self._values = _newest(cache, keep)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return (mx.concatenate([self._keys, keys], axis=2),  # (B, KVH, S + C, D)
                mx.concatenate([self._values, values], axis=2))


class Model(nn.Module):
    """Diffusion Gemma: ``prefill``/``extend_prefill`` fill KV state; ``decoder_logits`` reads a canvas.

    The operations a :class:`~mlx_infer.generation.bindings.denoising.DenoisingBinding` binds:

    - ``prefill(tokens (B, L)) -> state`` and ``extend_prefill(tokens (B, L), state) -> state``;
    - ``decoder_logits(canvas (B, C), state, feedback (B, C, D) | None) -> logits (B, C, V)`` float32;
    - ``soft_embeddings(logits (B, C, V)) -> feedback (B, C, D)``.
    """

    #: The family this graph belongs to (its module here; see :func:`mlx_infer.models.graph_family`).
    family = "diffusion_gemma"
    declaration = GraphDeclaration(method="denoising", bounded_prefill_workspace=True, compiled_decode=False)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        t = args.trunk
        self.model = Gemma4Model(t)
        self.self_conditioning = SelfConditioning(t.hidden_size, t.intermediate_size, t.rms_norm_eps)
        if not t.tie_word_embeddings:
            self.lm_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)

    # -- facts ----------------------------------------------------------

    @property
    def canvas_length(self) -> int:
        return self.args.canvas_length

    @property
    def embed_scale(self) -> float:
        return self.model.embed_scale

    @property
    def vocab_size(self) -> int:
        return self.args.trunk.vocab_size

    @property
    def layers(self) -> list[gemma4.DecoderLayer]:
        return self.model.layers

    def make_cache(self) -> list[KVCache | RotatingKVCache]:
        """One cache per layer: rotating (the window) for sliding layers, growing for full ones."""
        w = self.args.trunk.sliding_window
        return [RotatingKVCache(w) if layer.layer_type == SLIDING else KVCache() for layer in self.layers]

    # -- encoder --------------------------------------------------------

    def encode(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        """Run ``tokens (B, L)`` through the causal encoder, appending to ``cache``; final hidden ``(B, L, D)``."""
        return self.model(tokens, cache)

    def extend_prefill(self, tokens: mx.array, cache: list[Any], *,
                       chunk: int = DEFAULT_PREFILL_CHUNK) -> list[Any]:
        """Append ``tokens (B, L)`` to the encoder state in chunks of ``chunk``; return the (evaluated) state."""
        for start in range(0, tokens.shape[1], chunk):
            self.encode(tokens[:, start:start + chunk], cache)
            mx.eval([c.state for c in cache])
        return cache

    def prefill(self, tokens: mx.array, *, chunk: int = DEFAULT_PREFILL_CHUNK) -> list[Any]:
        """Fresh encoder state holding ``tokens (B, L)``."""
        return self.extend_prefill(tokens, self.make_cache(), chunk=chunk)

    # -- decoder --------------------------------------------------------

    def soft_embeddings(self, logits: mx.array) -> mx.array:
        """``softmax(logits) @ E * sqrt(hidden)``: ``(B, C, V) -> (B, C, D)`` in the embedding dtype.

        The logits are first rounded to the embedding dtype and the softmax
        taken in float32, as transformers feeds them back.
        """
        e = self.model.embed_tokens
        if isinstance(e, nn.QuantizedEmbedding):
            dtype = e.scales.dtype
            probs = mx.softmax(logits.astype(dtype).astype(mx.float32), axis=-1).astype(dtype)  # (B, C, V)
            soft = mx.quantized_matmul(probs, e.weight, e.scales, e.get("biases"), transpose=False,
                                       group_size=e.group_size, bits=e.bits, mode=e.mode)  # (B, C, D)
        else:
            dtype = e.weight.dtype
            probs = mx.softmax(logits.astype(dtype).astype(mx.float32), axis=-1).astype(dtype)
            soft = probs @ e.weight  # (B, C, D)
        return soft * self.embed_scale

    def decoder_hidden(self, canvas: mx.array, cache: list[Any], feedback: mx.array | None = None) -> mx.array:
        """Final hidden states ``(B, C, D)`` of ``canvas (B, C)`` over the encoder state (read only)."""
        m = self.model
        h = self.self_conditioning(m.embed_tokens(canvas) * m.embed_scale, feedback)  # (B, C, D)
        keep = self.args.trunk.sliding_window - 1
        for layer, c in zip(m.layers, cache):
            h, _, _ = layer(h, None, _CanvasView(c, keep if layer.layer_type == SLIDING else None))
        return m.norm(h)

    def decoder_logits(self, canvas: mx.array, cache: list[Any], feedback: mx.array | None = None) -> mx.array:
        """Soft-capped float32 logits ``(B, C, V)`` for every canvas position."""
        return self.logits_from_hidden(self.decoder_hidden(canvas, cache, feedback))

    def __call__(self, canvas: mx.array, cache: list[Any], feedback: mx.array | None = None) -> mx.array:
        """Same as :meth:`decoder_logits` (a denoising graph has no autoregressive call)."""
        return self.decoder_logits(canvas, cache, feedback)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        """``(B, L, D) -> (B, L, V)`` float32, soft-capped."""
        logits = self.model.embed_tokens.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)
        return logit_softcap(self.args.trunk.final_logit_softcapping or _SOFTCAP, logits.astype(mx.float32))

    # -- weights ----------------------------------------------------------

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map HF (``model.decoder.*``) or our own saved names to this module's.

        Drops the encoder's tied copies, the vision tower and embedder, rotary
        buffers and a tied ``lm_head``; splits fused ``experts.gate_up_proj``;
        adopts MLX quantization from ``*.scales`` as Gemma 4 does.

        Raises:
            UnsupportedModelError: the encoder's ``layer_scalar`` differs from the decoder's
                (both run the same layers here).
        """
        out: dict[str, mx.array] = {}
        encoder_scalars: dict[int, mx.array] = {}
        for k, v in weights.items():
            if "rotary_emb" in k:
                continue
            if k.startswith("model.encoder."):
                m = _ENCODER_SCALAR.match(k)
                if m:
                    encoder_scalars[int(m.group(1))] = v
                continue  # tied copies of the decoder's weights, or the vision tower
            if k.startswith("model.decoder.self_conditioning."):
                k = k[len("model.decoder."):]
            elif k.startswith("model.decoder."):
                k = "model." + k[len("model.decoder."):]
            if k.endswith(".experts.gate_up_proj"):
                base = k[: -len("gate_up_proj")] + "switch_glu."
                gate, up = mx.split(v, 2, axis=-2)  # (E, I, D) each
                out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = mx.contiguous(gate), mx.contiguous(up)
                continue
            if k.endswith(".experts.down_proj"):
                k = k[: -len("down_proj")] + "switch_glu.down_proj.weight"
            out[k] = v
        for i, s in encoder_scalars.items():
            d = out.get(f"model.layers.{i}.layer_scalar")
            if d is not None and not mx.array_equal(s.astype(mx.float32), d.astype(mx.float32)).item():
                raise UnsupportedModelError(
                    f"layer {i}: the encoder's layer_scalar differs from the decoder's; this graph runs one set "
                    "of layers for both, so such a checkpoint is not supported.")
        if self.args.tie_word_embeddings:
            out = {k: v for k, v in out.items() if not k.startswith("lm_head.")}
        gemma4.Model._adopt_quantization(self, out)  # same leaves, same rules as Gemma 4
        return out

    @property
    def quant_predicate(self):
        """As Gemma 4: the router projection at 8 bits, everything else the default."""
        return lambda path, _: {"group_size": 64, "bits": 8} if path.endswith("router.proj") else True


__all__ = ["DEFAULT_PREFILL_CHUNK", "Model", "ModelArgs", "SelfConditioning"]
