"""The autoregressive binding: a graph plus the per-run composition, as the loop drives it.

``bind_autoregressive(loaded_or_model, composition)`` reads the graph's
declaration and returns an :class:`AutoregressiveBinding`: its descriptor,
EOS ids, weight bytes, active adapters, KV scheme, ``make_cache()``, the
prefill policy and ``create_decode(policy)``.

The binding decides *how* a run goes (which decode step, what chunk size); the
loops (``generation/autoregressive.py``, ``generation/static_batch.py``,
``generation/constrained.py``, ``engine/``) then drive ``binding.graph``
directly through the members :class:`~mlx_infer.contracts.Graph` lists:

- ``graph(tokens (B, L), cache) -> logits (B, L, vocab)``: a decode step, eager;
- ``graph.model(tokens (B, L), cache) -> hidden (B, L, hidden)``: a prefill
  chunk (fills the cache; no LM head);
- ``graph.logits_from_hidden(hidden (B, L, hidden)) -> logits (B, L, vocab)``:
  the head, for the rows that need logits (prompt scores, a mixed step's ends);
- ``graph.make_cache()``; ``graph.args.vocab_size``; and, to size the paged KV
  store and the prefill workspace, ``graph.layers[i].self_attn``'s ``n_heads``,
  ``n_kv_heads``, ``head_dim`` and ``graph.model.embed_tokens``' dtype.

Paged KV is the engine's (``state/paged``): it wraps the graph's caches, and
``engine/engine.py`` checks the paged step's extra conditions itself.

``create_decode`` returns the compiled C++ step
(:class:`~mlx_infer.generation.bindings.decode_step.CompiledDecodeStep`) only
when both hold, else ``None`` (the loop then decodes eagerly):

1. the graph declares ``compiled_decode=True``;
2. the composition keeps ``compiled_decode`` on.

Adapters do not turn it off: the compiled steps take the adapter bank's stacked
   tensors and each row's slot as inputs (mlx_infer/adapters/native.py), so nothing is
   baked into the traced graph.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from mlx.utils import tree_flatten

from ... import _fast
from ...contracts import (GRAPH_ABI_HIDDEN_BSH, STATE_ABI_CACHE_LIST, GraphDeclaration,
                          GraphDescriptor)
from ...adapters.bank import bank_of
from ...errors import MlxInferError
from ...models import graph_family
from .decode_step import CompiledDecodeStep
from .graph_spec import KV_DTYPES, DecodePolicy, DecodeStepUnsupported

#: KV schemes a composition may name (None: the dtype the graph computes in).
KV_SCHEMES = tuple(KV_DTYPES)

#: ABIs this binding drives.
REQUIRED_GRAPH_ABI = GRAPH_ABI_HIDDEN_BSH
REQUIRED_STATE_ABI = STATE_ABI_CACHE_LIST


@dataclass(frozen=True)
class Composition:
    """Per-run choices (see DESIGN.md, "Contracts").

    Attributes:
        kv_scheme: ``"bf16"``, ``"f16"``, ``"f32"``, or ``None`` for the dtype
            the graph computes in (what the eager caches hold).
        compiled_decode: use the compiled C++ decode step where the graph has one.
        prefill_chunk: explicit prefill chunk (tokens), or ``None`` for the policy's choice.
        prefill_tail_split: run the prompt's last token as the first decode step.
        grammar_jump: tokens a constraint forces are fed as one forward, not one step each
            (the engine's switch; ``generate(grammar_jump=...)`` is the single-request one).
    """

    kv_scheme: str | None = None
    compiled_decode: bool = True
    prefill_chunk: int | None = None
    prefill_tail_split: bool = True
    grammar_jump: bool = True

    def __post_init__(self) -> None:
        if self.kv_scheme is not None and self.kv_scheme not in KV_SCHEMES:
            raise MlxInferError(f"kv_scheme must be one of {', '.join(KV_SCHEMES)} (or None), "
                                f"got {self.kv_scheme!r}.")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise MlxInferError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}.")


@dataclass(frozen=True)
class PrefillPolicy:
    """Prefill chunk sizing: an explicit chunk is exact; otherwise 2048, halved
    (never below 8) while a bounded-workspace graph's SDPA fallback workspace
    for (chunk, prompt) exceeds ``budget_bytes``. It changes work size, never admission."""

    geometry: Any  # mlx_infer._fast.Geometry
    explicit: int | None = None
    bounded_workspace: bool = True
    budget_bytes: int = _fast.DEFAULT_WORKSPACE_BUDGET

    def chunk_size(self, prompt_tokens: int) -> int:
        if self.explicit is not None:
            return self.explicit
        if not self.bounded_workspace:
            return 2048
        return _fast.prefill_chunk_size(self.geometry, prompt_tokens, budget_bytes=self.budget_bytes)


@dataclass
class AutoregressiveBinding:
    """A graph bound for autoregressive generation.

    The loops run the graph's phases themselves, through ``graph`` (see the
    module docstring for the members they call).

    Attributes:
        descriptor: identity and ABI of the bound graph.
        graph: the model (an ``nn.Module`` satisfying :class:`~mlx_infer.contracts.Graph`).
        eos_token_ids: tokens that end a generation.
        memory: bytes held by the weights (and the adapter bank, if any).
        composition: the per-run choices.
        prefill_policy: chunk sizing for prefill.
        adapters: names of the adapters registered on the graph (its bank).
    """

    descriptor: GraphDescriptor
    graph: Any
    eos_token_ids: frozenset[int]
    memory: int
    composition: Composition
    prefill_policy: PrefillPolicy
    adapters: tuple[str, ...] = ()
    _decode_unsupported: str | None = field(default=None, repr=False)

    @property
    def declaration(self) -> GraphDeclaration:
        return self.graph.declaration

    @property
    def kv_scheme(self) -> str | None:
        return self.composition.kv_scheme

    def make_cache(self) -> list[Any]:
        """Fresh per-layer caches for one generation."""
        return self.graph.make_cache()

    def decode_unavailable_reason(self) -> str | None:
        """Why :meth:`create_decode` returns ``None`` (``None`` when it would not)."""
        if not self.declaration.compiled_decode:
            return "the graph declares no compiled decode step"
        if not self.composition.compiled_decode:
            return "the composition turned compiled decode off"
        return self._decode_unsupported

    def create_decode(self, policy: DecodePolicy | None = None) -> CompiledDecodeStep | None:
        """The compiled decode step for one generation, or ``None`` to decode eagerly.

        Args:
            policy: capacity and compile choices (defaults: :class:`DecodePolicy`).
        """
        if self.decode_unavailable_reason() is not None:
            return None
        try:
            return CompiledDecodeStep(self.graph, kv_scheme=self.composition.kv_scheme,
                                      policy=policy or DecodePolicy())
        except DecodeStepUnsupported as exc:  # e.g. an unsupported rope or module type
            self._decode_unsupported = str(exc)
        except (ValueError, RuntimeError) as exc:  # the C++ step refused the graph
            self._decode_unsupported = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"compiled decode step unavailable ({self._decode_unsupported}); "
                          "decoding eagerly", RuntimeWarning, stacklevel=2)
        return None


def _descriptor(model: Any, artifact: str) -> GraphDescriptor:
    declaration: GraphDeclaration = getattr(model, "declaration", GraphDeclaration())
    family = graph_family(model)
    return GraphDescriptor(id=f"{family}:{getattr(model, 'model_type', family)}",
                           method=declaration.method, artifact=artifact)


def _geometry(model: Any) -> Any:
    layers = model.layers
    attn = layers[0].self_attn
    window = getattr(model.args, "sliding_window", None) or 0
    dtype = model.model.embed_tokens.weight.dtype
    if hasattr(model.model.embed_tokens, "scales"):
        dtype = model.model.embed_tokens.scales.dtype
    return _fast.Geometry(n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads, head_dim=attn.head_dim,
                          n_layers=len(layers),
                          layer_windows=[window if getattr(l, "use_sliding", False) else 0 for l in layers],
                          dtype_bytes=dtype.size)


def bind_autoregressive(loaded_or_model: Any, composition: Composition | None = None, *,
                        eos_token_ids: frozenset[int] | None = None) -> AutoregressiveBinding:
    """Bind a loaded model (or a bare graph) for autoregressive generation.

    Args:
        loaded_or_model: a :class:`~mlx_infer.artifacts.loader.LoadedModel` or a graph.
        composition: per-run choices (defaults: :class:`Composition`).
        eos_token_ids: overrides the loaded model's EOS ids (required for a bare graph
            that should stop on EOS).

    Raises:
        MlxInferError: the graph's descriptor is not one this binding drives.
    """
    composition = composition or Composition()
    if hasattr(loaded_or_model, "model") and hasattr(loaded_or_model, "tokenizer"):
        model = loaded_or_model.model
        artifact = str(loaded_or_model.path)
        eos = frozenset(loaded_or_model.eos_token_ids) if eos_token_ids is None else frozenset(eos_token_ids)
    else:
        model = loaded_or_model
        artifact = ""
        eos = frozenset(eos_token_ids or ())
    declaration: GraphDeclaration = getattr(model, "declaration", GraphDeclaration())
    bank = bank_of(model)
    binding = AutoregressiveBinding(
        descriptor=_descriptor(model, artifact),
        graph=model,
        eos_token_ids=eos,
        memory=sum(v.nbytes for _, v in tree_flatten(model.parameters())) + (bank.nbytes if bank else 0),
        adapters=tuple(bank.names) if bank else (),
        composition=composition,
        prefill_policy=PrefillPolicy(geometry=_geometry(model), explicit=composition.prefill_chunk,
                                     bounded_workspace=declaration.bounded_prefill_workspace),
    )
    assert_binding(binding)
    return binding


def assert_binding(binding: AutoregressiveBinding) -> None:
    """Refuse a binding whose graph this module cannot drive.

    Raises:
        MlxInferError: naming the field that does not match and what was expected.
    """
    d = binding.descriptor
    problems = []
    if d.method != "autoregressive":
        problems.append(f"method is {d.method!r}, expected 'autoregressive' (use the denoising loop)")
    if d.backend != "mlx":
        problems.append(f"backend is {d.backend!r}, expected 'mlx'")
    if d.graph_abi != REQUIRED_GRAPH_ABI:
        problems.append(f"graph_abi is {d.graph_abi!r}, expected {REQUIRED_GRAPH_ABI!r}")
    if d.state_abi != REQUIRED_STATE_ABI:
        problems.append(f"state_abi is {d.state_abi!r}, expected {REQUIRED_STATE_ABI!r}")
    if problems:
        raise MlxInferError(f"Graph {d.id!r} cannot be bound for autoregressive generation: "
                            + "; ".join(problems) + ".")
