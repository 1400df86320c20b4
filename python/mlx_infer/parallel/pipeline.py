"""Pipeline parallel: the layers split across ranks, for links too slow for tensor parallel.

Selected with ``MLX_INFER_PARALLEL=pipeline`` under ``mlx.launch`` (tensor parallel is
the default). Rank ``r`` of ``N`` holds layers ``[r L / N, (r+1) L / N)``; rank 0
holds the embedding, the last rank the final norm's output head (and the embedding
too when the head is tied to it); the final norm (a vector) is on every rank.

One forward, rank by rank (each rank runs the whole graph, the layers it does not
hold pass their input through untouched)::

    rank 0:  embed -> its layers -> send(h, 1)
    rank r:  recv(h, r-1) -> its layers -> send(h, r+1)
    last:    recv(h, N-2) -> its layers -> norm -> head -> logits
    all:     logits = all_sum(last rank's logits, zeros elsewhere)

Only one hidden state ``(B, L, hidden)`` crosses each link per forward (tensor
parallel moves two per layer), and each rank's KV holds its own layers (plain caches
of the other layers stay empty; the engine's paged store gets a one-KV-head
placeholder for them, see :class:`_Elsewhere`). The ranks run one after another: at
batch 1 pipeline parallel saves memory, not time. The compiled C++ decode step does
not run a pipelined graph (``generate``, the engine and so the server decode eagerly
under it; the engine's ranks run in lockstep as under tensor parallel).
Llama-family and Gemma 3 graphs; Gemma 4 (its KV-shared layers read another
layer's K/V) is refused.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError
from ..models import graph_family
from .group import ParallelGroup
from .shard import ShardPlan

PP_FAMILIES = ("llama", "gemma3")


@dataclass(frozen=True)
class PipelineParallel:
    """What a pipelined graph carries (``model.pipeline_parallel``)."""

    pg: ParallelGroup
    start: int  # first layer held here
    stop: int  # one past the last
    rank_bytes: tuple[int, ...] = ()


class _Elsewhere(nn.Module):
    """A layer another rank holds: passes its input through.

    A plain cache is left unwritten. A paged cache (the engine) books every layer's step, so
    the layer writes a placeholder there: zeros of one KV head (its pages then hold ``1 / KVH``
    of a real layer's bytes), read back only to tie the write into the step's graph.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.use_sliding = getattr(layer, "use_sliding", False)
        attn = layer.self_attn  # geometry only (the paged store reads it), no weights
        self.self_attn = types.SimpleNamespace(n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads,
                                               head_dim=attn.head_dim)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        from ..state.kv import KVCache, RotatingKVCache

        if cache is None or isinstance(cache, (KVCache, RotatingKVCache)):
            return x
        B, L = x.shape[:2]
        z = mx.zeros((B, 1, L, self.self_attn.head_dim), x.dtype)  # (B, 1, L, D)
        k, v = cache.update_and_fetch(z, z)
        parts = [a for kv in (k, v) for a in (kv if isinstance(kv, tuple) else (kv,))]
        return mx.depends(x, parts)


class _ZeroEmbedding(nn.Module):
    """The embedding on a rank that does not hold it: zeros of the right shape (replaced by the received state)."""

    def __init__(self, dims: int):
        super().__init__()
        self.dims = dims
        self.dtype = mx.float32

    @property
    def weight(self) -> mx.array:
        """An empty table of the activations' dtype (what dtype probes of the embedding read)."""
        return mx.zeros((0, self.dims), self.dtype)

    def __call__(self, ids: mx.array) -> mx.array:
        return mx.zeros((*ids.shape, self.dims), self.dtype)  # (B, L, hidden)


_STAGE_CLASSES: dict[tuple[type, bool, bool], type] = {}


def _stage_class(base: type, recv: bool, send: bool) -> type:
    key = (base, recv, send)
    cls = _STAGE_CLASSES.get(key)
    if cls is None:
        def __call__(self: Any, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
            pg = self._pp.pg
            if recv:
                x = mx.distributed.recv_like(x, pg.rank - 1, group=pg.group)  # (B, L, hidden) from the rank before
            y = base.__call__(self, x, *args, **kwargs)
            if send:
                y = mx.distributed.send(y, pg.rank + 1, group=pg.group)
                # Sent now: callers evaluate what they need (a prefill only its caches, which do not
                # depend on the send), and the next rank's recv waits for these bytes.
                mx.eval(y)
            return y

        cls = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__,
                                            "__qualname__": base.__qualname__, "_pp_stage": (recv, send)})
        _STAGE_CLASSES[key] = cls
    return cls


def layer_range(n_layers: int, pg: ParallelGroup) -> tuple[int, int]:
    """The contiguous layers ``[start, stop)`` rank ``pg.rank`` holds."""
    if n_layers < pg.size:
        raise UnsupportedModelError(f"pipeline parallel needs at least one layer per process: {n_layers} layers "
                                    f"over {pg.size} processes; use fewer processes or tensor parallel.")
    return pg.rank * n_layers // pg.size, (pg.rank + 1) * n_layers // pg.size


def make_pipeline_plan(model: nn.Module, pg: ParallelGroup) -> ShardPlan:
    """Replace what this rank does not hold by placeholders (in place); the plan names what it reads.

    Raises:
        UnsupportedModelError: a family without a pipeline, or fewer layers than ranks.
    """
    family = graph_family(model)
    if family not in PP_FAMILIES:
        raise UnsupportedModelError(f"pipeline parallel is not supported for the {family!r} family (supported: "
                                    f"{', '.join(PP_FAMILIES)}); use tensor parallel (the default).")
    inner = model.model
    start, stop = layer_range(len(inner.layers), pg)
    last = pg.rank == pg.size - 1
    for i in range(len(inner.layers)):
        if not start <= i < stop:
            inner.layers[i] = _Elsewhere(inner.layers[i])
    tied = bool(model.args.tie_word_embeddings)
    if pg.rank != 0 and not (last and tied):
        inner.embed_tokens = _ZeroEmbedding(int(model.args.hidden_size))
    if not last and "lm_head" in model:
        model.pop("lm_head")
    # Masks come from the first cache of each layer kind: make it one this rank writes.
    kinds = [getattr(inner.layers[i], "use_sliding", False) for i in range(start, stop)]
    inner._full_idx = next((start + j for j, s in enumerate(kinds) if not s), None)
    inner._swa_idx = next((start + j for j, s in enumerate(kinds) if s), None)
    from mlx.utils import tree_flatten

    plan = ShardPlan(pg)
    plan.held = {k for k, _ in tree_flatten(model.parameters())}
    plan.pipeline = (start, stop)
    return plan


def install_pipeline(model: nn.Module, plan: ShardPlan) -> PipelineParallel:
    """After loading: the stage boundaries' send/recv, the shared logits; ``model.pipeline_parallel``."""
    from mlx.utils import tree_flatten

    pg = plan.pg
    start, stop = plan.pipeline
    local = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    rank_bytes = mx.distributed.all_gather(mx.array([local], mx.int64), group=pg.group).tolist()
    pp = PipelineParallel(pg, start, stop, tuple(rank_bytes))
    inner = model.model
    dtype = next(v.dtype for _, v in tree_flatten(inner.layers[start].parameters())
                 if mx.issubdtype(v.dtype, mx.floating))
    if isinstance(inner.embed_tokens, _ZeroEmbedding):
        inner.embed_tokens.dtype = dtype  # what the previous rank sends
    first, last = inner.layers[start], inner.layers[stop - 1]
    recv_send = {id(first): [pg.rank > 0, False]}
    recv_send.setdefault(id(last), [False, False])[1] = pg.rank < pg.size - 1
    for layer in {id(first): first, id(last): last}.values():
        recv, send = recv_send[id(layer)]
        if recv or send:
            layer.__class__ = _stage_class(type(layer), recv, send)
            object.__setattr__(layer, "_pp", pp)
    head = model.logits_from_hidden
    vocab = int(model.args.vocab_size)
    is_last = pg.rank == pg.size - 1

    def logits_from_hidden(h: mx.array) -> mx.array:
        if is_last:
            out = head(h)  # (B, L, vocab)
        else:  # zeros that wait for this rank's send
            out = mx.depends(mx.zeros((*h.shape[:-1], vocab), h.dtype), h)
        return mx.distributed.all_sum(out, group=pg.group)

    object.__setattr__(model, "logits_from_hidden", logits_from_hidden)
    object.__setattr__(model, "pipeline_parallel", pp)
    return pp


def pipeline_of(model: Any) -> PipelineParallel | None:
    """The model's :class:`PipelineParallel`, or ``None``."""
    return getattr(model, "pipeline_parallel", None)
