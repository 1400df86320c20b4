"""Descriptors and Protocols shared across rooms (see DESIGN.md, "Contracts").

A model file depends only on :class:`Cache`; a binding depends on :class:`Graph`;
the generation loop depends on bindings. Nothing here imports a model family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import mlx.core as mx

Method = Literal["autoregressive", "denoising"]

#: ABI tags a binding asserts before driving a graph.
GRAPH_ABI_HIDDEN_BSH = "mlx-hidden-bsh-v1"
STATE_ABI_CACHE_LIST = "cache-list-v1"


@dataclass(frozen=True)
class GraphDescriptor:
    """Identity and ABI of a bound graph: what a binding checks before driving it."""

    id: str
    method: Method
    backend: str = "mlx"
    graph_abi: str = GRAPH_ABI_HIDDEN_BSH
    state_abi: str = STATE_ABI_CACHE_LIST
    artifact: str = ""


@dataclass(frozen=True)
class GraphDeclaration:
    """What a model family declares about itself (read once by bindings).

    Attributes:
        method: the inference method the graph serves.
        bounded_prefill_workspace: prefill chunks may be shrunk to bound the
            attention-score workspace (see PrefillPolicy in DESIGN.md).
        compiled_decode: the family has a compiled C++ decode step.
    """

    method: Method = "autoregressive"
    bounded_prefill_workspace: bool = True
    compiled_decode: bool = False


@runtime_checkable
class Cache(Protocol):
    """Per-layer KV state, duck-typed as mlx-lm's caches are.

    ``offset`` is the number of tokens already written. ``update_and_fetch``
    appends ``(B, kv_heads, L, head_dim)`` keys/values and returns the keys and
    values attention must read. ``make_mask(L, window_size=...)`` returns the
    mask for the next ``L`` queries: ``None``, the string ``"causal"`` or a
    boolean array broadcastable to ``(B, heads, L, keys)``.
    """

    offset: int

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]: ...

    def make_mask(self, N: int, *, window_size: int | None = None, return_array: bool = False) -> Any: ...

    @property
    def state(self) -> Any: ...

    def trim(self, n: int) -> int: ...

    @property
    def nbytes(self) -> int: ...


class Graph(Protocol):
    """A model family instance (autoregressive): an ``nn.Module`` with these members.

    These are what the generation loops and the engine call (the binding reads the
    declaration and sizes; the loops run the phases):

    - ``family``: the family's name, declared once on the ``Model`` class
      (read through :func:`mlx_infer.models.graph_family`);
    - ``__call__(inputs (B, L) int32, cache=None) -> logits (B, L, vocab)``: eager decode;
    - ``model(inputs (B, L), cache=None) -> hidden (B, L, hidden)``: prefill, no LM head;
      ``model.embed_tokens`` (its dtype sizes the prefill workspace);
    - ``logits_from_hidden(hidden (B, L, hidden)) -> logits (B, L, vocab)``;
    - ``layers[i].self_attn`` with ``n_heads``, ``n_kv_heads``, ``head_dim`` (the paged
      KV store's and the prefill policy's sizes);
    - ``args.vocab_size`` (constraints, the engine's token checks).
    """

    family: str
    args: Any
    declaration: GraphDeclaration
    model: Any

    def __call__(self, inputs: mx.array, cache: list[Cache] | None = None) -> mx.array: ...

    def logits_from_hidden(self, h: mx.array) -> mx.array: ...

    def make_cache(self) -> list[Cache]: ...

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]: ...

    @property
    def layers(self) -> list[Any]: ...
