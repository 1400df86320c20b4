"""SmolLM 3: the Llama graph with some layers attending without RoPE ("NoPE").

``no_rope_layers`` lists one flag per layer, ``1`` where the layer applies RoPE and ``0``
where it does not (default: every ``no_rope_layer_interval``-th layer goes without). The
layers without RoPE use :class:`~mlx_infer.layers.rope.NoPE`. Everything else (GQA, RoPE
scaling, biases, sliding windows from ``layer_types``, tied or untied head) is the Llama
family's, read by :class:`~mlx_infer.models.llama.ModelArgs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


from ..contracts import GraphDeclaration
from ..errors import ModelLoadError
from ..layers.rope import NoPE
from . import llama
from .schema import check_number, config_fields


@dataclass
class ModelArgs(llama.ModelArgs):
    """SmolLM 3 settings: the Llama family's plus which layers use RoPE."""

    no_rope_layer_interval: int = 4
    no_rope_layers: list[int] | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelArgs":
        """Build from a config dict, ignoring keys this family does not use."""
        return cls(**config_fields(cls, params))

    def __post_init__(self) -> None:
        super().__post_init__()
        self.no_rope_layer_interval = check_number("no_rope_layer_interval", self.no_rope_layer_interval,
                                                   integer=True, lo=1, hi=1 << 12)
        if self.no_rope_layers is None:
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0)
                                   for i in range(self.num_hidden_layers)]
        if len(self.no_rope_layers) != self.num_hidden_layers or any(v not in (0, 1) for v in self.no_rope_layers):
            raise ModelLoadError(
                f"\"no_rope_layers\" must hold one 0 or 1 per layer ({self.num_hidden_layers}), got "
                f"{self.no_rope_layers!r:.80}; fix config.json.")


class Model(llama.Model):
    """SmolLM 3 causal LM: ``inputs (B, L) -> logits (B, L, vocab)``; the compiled decode step runs it
    through the llama forward (its NoPE layers: a RoPE of no dims)."""

    #: The family this graph belongs to (its module here; see :func:`mlx_infer.models.graph_family`).
    family = "smollm3"
    declaration = GraphDeclaration(method="autoregressive", compiled_decode=True)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for layer, use_rope in zip(self.model.layers, args.no_rope_layers):
            if not use_rope:
                layer.self_attn.rope = NoPE()
