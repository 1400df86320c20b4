"""The denoising binding: a graph that declares the denoising method, as the canvas loop drives it.

``bind_denoising(loaded_or_model)`` accepts only a graph whose declaration
names ``method="denoising"`` and that provides every denoising operation
(``prefill``, ``extend_prefill``, ``decoder_logits``, ``soft_embeddings``);
otherwise it raises ``TypeError`` naming what is wrong. The result carries the
descriptor ``GraphDescriptor(method="denoising", graph_abi="mlx-denoising-v1",
state_abi="cache-list-v1")``, which :func:`assert_denoising_graph` checks
before the loop runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from ...contracts import STATE_ABI_CACHE_LIST, GraphDeclaration, GraphDescriptor
from ...errors import MlxInferError
from ...models import graph_family

#: The graph ABI of a denoising graph: prefill/extend state, canvas logits, soft embeddings.
GRAPH_ABI_DENOISING = "mlx-denoising-v1"

#: The operations a denoising graph must provide, in the order they are checked.
DENOISING_OPERATIONS = ("prefill", "extend_prefill", "decoder_logits", "soft_embeddings")

State = list[Any]


@dataclass(frozen=True)
class DenoisingBinding:
    """A denoising graph bound for canvas generation.

    Attributes:
        descriptor: identity and ABI of the bound graph.
        graph: the model (``nn.Module``).
        prefill: ``tokens (1, L) -> state``: a fresh encoder state holding the prompt.
        extend_prefill: ``(tokens (1, L), state) -> state``: append a final block.
        decoder_logits: ``(canvas (1, C), state, feedback (1, C, D) | None) -> logits (1, C, V)``.
        soft_embeddings: ``logits (1, C, V) -> feedback (1, C, D)``.
        canvas_length: tokens per canvas (block).
        embed_scale: the embedding scale the soft embeddings carry.
        vocab_size: canvas tokens are drawn from ``[0, vocab_size)``.
        eos_token_ids: the model's EOS ids (the loop adds its own).
        memory: bytes held by the weights.
    """

    descriptor: GraphDescriptor
    graph: Any
    prefill: Callable[[mx.array], State]
    extend_prefill: Callable[[mx.array, State], State]
    decoder_logits: Callable[[mx.array, State, mx.array | None], mx.array]
    soft_embeddings: Callable[[mx.array], mx.array]
    canvas_length: int
    embed_scale: float
    vocab_size: int
    eos_token_ids: frozenset[int] = frozenset()
    memory: int = 0

    @property
    def declaration(self) -> GraphDeclaration:
        return self.graph.declaration

    @staticmethod
    def close_state(state: State | None) -> None:
        """Release an encoder state's buffers (the state is empty afterwards)."""
        if not state:
            return
        for cache in state:
            cache.state = ()
        state.clear()


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MlxInferError(f"the graph's {name} must be a positive integer, got {value!r}; check config.json.")
    return value


def bind_denoising(loaded_or_model: Any, *, eos_token_ids: frozenset[int] | None = None) -> DenoisingBinding:
    """Bind a loaded model (or a bare graph) for denoising generation.

    Args:
        loaded_or_model: a :class:`~mlx_infer.artifacts.loader.LoadedModel` or a graph.
        eos_token_ids: overrides the loaded model's EOS ids.

    Raises:
        TypeError: the graph does not declare the denoising method, or lacks one of
            :data:`DENOISING_OPERATIONS` (the message names it).
        MlxInferError: the graph's canvas length or vocabulary size is not a positive integer.
    """
    if hasattr(loaded_or_model, "model") and hasattr(loaded_or_model, "tokenizer"):
        model, artifact = loaded_or_model.model, str(loaded_or_model.path)
        eos = frozenset(loaded_or_model.eos_token_ids) if eos_token_ids is None else frozenset(eos_token_ids)
    else:
        model, artifact, eos = loaded_or_model, "", frozenset(eos_token_ids or ())
    declaration = getattr(model, "declaration", None)
    method = getattr(declaration, "method", None)
    if method != "denoising":
        raise TypeError(f"{type(model).__name__} declares the {method!r} method, not 'denoising': "
                        "bind it for autoregressive generation instead.")
    for operation in DENOISING_OPERATIONS:
        if not callable(getattr(model, operation, None)):
            raise TypeError(f"{type(model).__name__} declares the denoising method but provides no {operation}.")
    canvas_length = _positive_int("canvas_length", getattr(model, "canvas_length", None))
    vocab_size = _positive_int("vocab_size", getattr(model, "vocab_size", None))
    family = graph_family(model)
    binding = DenoisingBinding(
        descriptor=GraphDescriptor(id=f"{family}:{getattr(model, 'model_type', family)}", method="denoising",
                                   graph_abi=GRAPH_ABI_DENOISING, state_abi=STATE_ABI_CACHE_LIST,
                                   artifact=artifact),
        graph=model,
        prefill=model.prefill,
        extend_prefill=model.extend_prefill,
        decoder_logits=model.decoder_logits,
        soft_embeddings=model.soft_embeddings,
        canvas_length=canvas_length,
        embed_scale=float(getattr(model, "embed_scale", 1.0)),
        vocab_size=vocab_size,
        eos_token_ids=eos,
        memory=sum(v.nbytes for _, v in tree_flatten(model.parameters())) if hasattr(model, "parameters") else 0,
    )
    assert_denoising_graph(binding.descriptor)
    return binding


def assert_denoising_graph(descriptor: GraphDescriptor) -> None:
    """Refuse a descriptor the denoising loop cannot drive.

    Raises:
        MlxInferError: naming each field that does not match and what was expected.
    """
    d = descriptor
    problems = []
    if d.method != "denoising":
        problems.append(f"method is {d.method!r}, expected 'denoising' (use the autoregressive loop)")
    if d.backend != "mlx":
        problems.append(f"backend is {d.backend!r}, expected 'mlx'")
    if d.graph_abi != GRAPH_ABI_DENOISING:
        problems.append(f"graph_abi is {d.graph_abi!r}, expected {GRAPH_ABI_DENOISING!r}")
    if not d.state_abi:
        problems.append("state_abi is empty")
    if problems:
        raise MlxInferError(f"Graph {d.id!r} cannot be driven by the denoising loop: " + "; ".join(problems) + ".")


__all__ = ["DENOISING_OPERATIONS", "GRAPH_ABI_DENOISING", "DenoisingBinding", "assert_denoising_graph",
           "bind_denoising"]
