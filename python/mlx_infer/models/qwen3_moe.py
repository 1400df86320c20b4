"""Qwen 3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen 3 attention with sparse expert MLPs.

Attention is Qwen 3's (per-head q/k RMSNorm before RoPE; :class:`~mlx_infer.models.llama.Attention`).
A layer's MLP is a mixture of experts (:class:`SparseMoeBlock`) unless it is listed in
``mlp_only_layers`` or falls between ``decoder_sparse_step`` strides, where it is the dense
SwiGLU MLP. The router takes a softmax over all experts, keeps the top ``num_experts_per_tok``
and (``norm_topk_prob``) renormalizes them; the experts run through
:class:`~mlx_infer.layers.switch.SwitchGLU` (``gather_mm`` / ``gather_qmm``).

Checkpoints store one ``mlp.experts.{e}.{gate,up,down}_proj`` per expert (transformers 5
holds them fused as ``mlp.experts.gate_up_proj`` / ``down_proj``); :meth:`Model.sanitize`
stacks either into ``mlp.switch_mlp.*`` (quantized parts too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..contracts import GraphDeclaration
from ..errors import ModelLoadError
from ..layers.switch import SwitchGLU
from . import llama
from .base import CausalLM, DecoderModel, PreNormBlock
from .llama import MLP, Attention, swiglu
from .schema import check_number, config_fields


@dataclass
class ModelArgs(llama.ModelArgs):
    """Qwen 3 MoE settings: the Llama family's plus the expert layout."""

    num_experts: int | None = None
    num_local_experts: int | None = None  # transformers 5's name for num_experts
    num_experts_per_tok: int = 8
    moe_intermediate_size: int | None = None
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    norm_topk_prob: bool = True

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelArgs":
        """Build from a config dict, ignoring keys this family does not use."""
        return cls(**config_fields(cls, params))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_experts is None:
            self.num_experts = self.num_local_experts
        if self.num_experts is None or self.moe_intermediate_size is None:
            raise ModelLoadError("A qwen3_moe config needs \"num_experts\" and \"moe_intermediate_size\"; "
                                 "fix config.json.")
        self.num_experts = check_number("num_experts", self.num_experts, integer=True, lo=1, hi=1 << 16)
        self.num_experts_per_tok = check_number("num_experts_per_tok", self.num_experts_per_tok, integer=True,
                                                lo=1, hi=self.num_experts)
        self.decoder_sparse_step = check_number("decoder_sparse_step", self.decoder_sparse_step, integer=True,
                                                lo=1, hi=1 << 12)
        for i in self.mlp_only_layers:
            check_number("mlp_only_layers[]", i, integer=True, lo=0, hi=self.num_hidden_layers - 1)
        if self.sliding_window is not None:  # transformers: the window, when used, applies to every layer
            self.layer_types = [llama.SLIDING] * self.num_hidden_layers

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` has the expert MLP (else the dense one)."""
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0


class SparseMoeBlock(nn.Module):
    """Top-k routed SwiGLU experts (mlx-lm's ``Qwen3MoeSparseMoeBlock``, op for op)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts, swiglu)

    def __call__(self, x: mx.array) -> mx.array:
        gates = mx.softmax(self.gate(x), axis=-1, precise=True)  # (B, L, E)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])  # (B, L, k)
        scores = mx.take_along_axis(gates, inds, axis=-1)  # (B, L, k)
        if self.norm_topk_prob:
            scores /= mx.sum(scores, axis=-1, keepdims=True)
        y = self.switch_mlp(x, inds)  # (B, L, k, D)
        return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)


class TransformerBlock(PreNormBlock):
    """Pre-norm block with Qwen 3 attention and a sparse (or dense) MLP."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(args, Attention(args, qk_norm=True),
                         SparseMoeBlock(args) if args.is_moe_layer(layer) else MLP(args),
                         sliding=args.layer_types[layer] == llama.SLIDING)


class Model(CausalLM):
    """Qwen 3 MoE causal LM: ``inputs (B, L) -> logits (B, L, vocab)``; the compiled decode step runs it
    through the llama forward with its routed experts (not under tensor parallelism)."""

    #: The family this graph belongs to (its module here; see :func:`mlx_infer.models.graph_family`).
    family = "qwen3_moe"
    declaration = GraphDeclaration(method="autoregressive", compiled_decode=True)

    def __init__(self, args: ModelArgs):
        super().__init__(args, DecoderModel(args, lambda i: TransformerBlock(args, i)))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Stack per-expert (or split transformers 5's fused) expert weights into ``switch_mlp``;
        then the shared ``inv_freq`` and tied-head handling (:meth:`CausalLM.sanitize`)."""
        weights = dict(weights)
        n = self.args.num_experts
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}.mlp"
            if not isinstance(layer.mlp, SparseMoeBlock):
                continue
            fused = weights.pop(f"{prefix}.experts.gate_up_proj", None)  # (E, 2 * I, D): gate, then up
            if fused is not None:
                gate, up = mx.split(fused, 2, axis=1)
                weights[f"{prefix}.switch_mlp.gate_proj.weight"] = gate
                weights[f"{prefix}.switch_mlp.up_proj.weight"] = up
                weights[f"{prefix}.switch_mlp.down_proj.weight"] = weights.pop(f"{prefix}.experts.down_proj")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for part in ("weight", "scales", "biases"):
                    key = f"{prefix}.experts.0.{proj}.{part}"
                    if key in weights:
                        weights[f"{prefix}.switch_mlp.{proj}.{part}"] = mx.stack(
                            [weights.pop(f"{prefix}.experts.{e}.{proj}.{part}") for e in range(n)])
        return super().sanitize(weights)
