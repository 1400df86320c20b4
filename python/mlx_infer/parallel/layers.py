"""The collectives a sharded graph runs, attached to its existing modules.

A sharded module keeps its class's parameters and product (stock, quantized or
mlx-infer's CPU kernels) and gains the collective after it, through a subclass
made once per class (the same name and module, so ``isinstance`` checks and the
compiled step's reading of the layer types see what they saw before):

- row-parallel linear (``o_proj``, ``down_proj``): ``all_sum`` of the partial products;
- vocabulary-parallel embedding: the local rows' lookup (zeros for tokens
  another rank holds), ``all_sum``; its ``as_linear`` (the tied head): the
  local logits, ``all_gather``-ed into the full vocabulary;
- vocabulary-parallel LM head: the same gather;
- expert-parallel ``SwitchGLU`` (qwen3_moe, gpt_oss): its local experts' outputs, zeros for
  experts another rank holds; the MoE block around it is row-parallel (``all_sum``);
- head-split RMSNorm over all heads (OLMo 2's q/k norms): the sum of squares ``all_sum``-ed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .group import ParallelGroup
from .shard import ShardPlan

_CLASSES: dict[tuple[type, str], type] = {}


@dataclass(frozen=True)
class TensorParallel:
    """What a sharded graph carries (``model.tensor_parallel``): its group and how it was split."""

    pg: ParallelGroup
    vocab_parallel: bool
    vocab_start: int
    per_layer_vocab_start: int = 0  # gemma4's per-layer input table, when split
    expert_start: int = 0  # the first expert this rank holds (expert parallel)
    notes: tuple[str, ...] = field(default_factory=tuple)
    rank_bytes: tuple[int, ...] = ()  # every rank's parameter bytes, rank order
    replicated_bytes: int = 0  # of those, what every rank holds whole


def gather_last(y: mx.array, group: Any, size: int) -> mx.array:
    """Concatenate every rank's ``(..., n)`` along the last axis: ``(..., size * n)``, rank order."""
    lead, n = y.shape[:-1], y.shape[-1]
    flat = y.reshape(-1, n)  # (M, n)
    g = mx.distributed.all_gather(flat, group=group)  # (size * M, n)
    g = g.reshape(size, flat.shape[0], n).transpose(1, 0, 2)  # (M, size, n)
    return g.reshape(*lead, size * n)


def _row_call(base: type):
    def __call__(self: Any, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(base.__call__(self, x), group=self._tp.pg.group)
    return {"__call__": __call__}


def _head_call(base: type):
    def __call__(self: Any, x: mx.array) -> mx.array:
        return gather_last(base.__call__(self, x), self._tp.pg.group, self._tp.pg.size)
    return {"__call__": __call__}


def _experts(base: type):
    def __call__(self: Any, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        n = self.switch_glu.gate_proj["weight"].shape[0]
        local = indices - self._tp_expert_start  # (B, L, k)
        mine = (local >= 0) & (local < n)  # routed to an expert this rank holds
        part = base.__call__(self, x, mx.where(mine, local, 0), weights * mine.astype(weights.dtype))
        return mx.distributed.all_sum(part, group=self._tp.pg.group)  # (B, L, D)
    return {"__call__": __call__}


def _switch(base: type):
    def __call__(self: Any, x: mx.array, indices: mx.array) -> mx.array:
        n = self.gate_proj["weight"].shape[0]
        local = indices - self._tp_expert_start  # (B, L, k)
        mine = (local >= 0) & (local < n)  # routed to an expert this rank holds
        y = base.__call__(self, x, mx.where(mine, local, 0))  # (B, L, k, D)
        return y * mine[..., None].astype(y.dtype)  # another rank's experts add zeros here
    return {"__call__": __call__}


def _global_rms(base: type):
    def __call__(self: Any, x: mx.array) -> mx.array:
        # An RMSNorm over every head's concatenation (OLMo 2's q/k norms), this rank holding some heads:
        # the sum of squares is all_sum-ed. A KV head replicated on R ranks counts R times in the sum and
        # in the width alike, so mean = all_sum(local sum) / (local width * N) in every case.
        xf = x.astype(mx.float32)  # (..., w)
        ss = mx.distributed.all_sum(mx.sum(xf * xf, axis=-1, keepdims=True), group=self._tp.pg.group)  # (..., 1)
        y = xf * mx.rsqrt(ss / (x.shape[-1] * self._tp.pg.size) + self.eps)
        return self["weight"] * y.astype(x.dtype)
    return {"__call__": __call__}


def _vocab_embedding(base: type):
    def __call__(self: Any, ids: mx.array) -> mx.array:
        n = self["weight"].shape[0]
        local = ids - self._tp_vocab_start
        mine = (local >= 0) & (local < n)  # tokens whose row this rank holds
        h = base.__call__(self, mx.where(mine, local, 0))  # (..., E)
        h = h * mine[..., None].astype(h.dtype)
        return mx.distributed.all_sum(h, group=self._tp.pg.group)

    def as_linear(self: Any, x: mx.array) -> mx.array:
        return gather_last(base.as_linear(self, x), self._tp.pg.group, self._tp.pg.size)

    return {"__call__": __call__, "as_linear": as_linear}


_ROLES = {"row": _row_call, "head": _head_call, "vocab_embedding": _vocab_embedding, "experts": _experts,
          "switch": _switch, "global_rms": _global_rms}


def _parallel_class(base: type, role: str) -> type:
    key = (base, role)
    cls = _CLASSES.get(key)
    if cls is None:
        attrs = _ROLES[role](base)
        attrs.update({"__module__": base.__module__, "__qualname__": base.__qualname__,
                      "_tp_role": role, "_tp_base": base})
        cls = type(base.__name__, (base,), attrs)
        _CLASSES[key] = cls
    return cls


def tp_role(module: nn.Module) -> str | None:
    """``"row"``, ``"head"``, ``"vocab_embedding"``, ``"experts"``, ``"switch"``, ``"global_rms"`` for a
    sharded module, else ``None``."""
    return type(module).__dict__.get("_tp_role")


def _attach(module: nn.Module, role: str, tp: TensorParallel) -> None:
    if tp_role(module) is not None:
        return
    module.__class__ = _parallel_class(type(module), role)
    object.__setattr__(module, "_tp", tp)


def install_tensor_parallel(model: nn.Module, plan: ShardPlan) -> TensorParallel:
    """Give the loaded, sharded ``model`` its local head counts and its collectives (in place)."""
    pg = plan.pg
    vocab_start = 0
    if plan.vocab_parallel:
        vocab_start = pg.rank * (int(model.args.vocab_size) // pg.size)
    from mlx.utils import tree_flatten

    from .shard import replicated_bytes

    local = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    rank_bytes = mx.distributed.all_gather(mx.array([local], mx.int64), group=pg.group).tolist()
    expert_start = 0
    if plan.experts:
        expert_start = pg.rank * dict(model.named_modules())[plan.experts[0]].switch_glu.gate_proj["weight"].shape[0]
    tp = TensorParallel(pg, plan.vocab_parallel, vocab_start, plan.vocab_tables.get("model.embed_tokens_per_layer", 0),
                        expert_start, tuple(plan.notes), tuple(rank_bytes), replicated_bytes(model, plan))
    modules = dict(model.named_modules())
    for path, (heads, kv_heads) in plan.heads.items():
        modules[path].n_heads = heads
        modules[path].n_kv_heads = kv_heads
    for path in plan.row_parallel:
        _attach(modules[path], "row", tp)
    for path, start in plan.vocab_tables.items():
        _attach(modules[path], "vocab_embedding", tp)
        object.__setattr__(modules[path], "_tp_vocab_start", start)
    if plan.vocab_parallel and "lm_head" in modules:
        _attach(modules["lm_head"], "head", tp)
    for path in plan.experts:
        _attach(modules[path], "experts", tp)
        n = modules[path].switch_glu.gate_proj["weight"].shape[0]
        object.__setattr__(modules[path], "_tp_expert_start", pg.rank * n)
    for path in plan.switches:
        _attach(modules[path], "switch", tp)
        n = modules[path].gate_proj["weight"].shape[0]
        object.__setattr__(modules[path], "_tp_expert_start", pg.rank * n)
    for path in plan.global_norms:
        _attach(modules[path], "global_rms", tp)
    object.__setattr__(model, "tensor_parallel", tp)
    return tp


def parallel_group_of(model: Any) -> ParallelGroup | None:
    """The group a split graph (tensor or pipeline parallel) runs over, or ``None``."""
    split = getattr(model, "tensor_parallel", None) or getattr(model, "pipeline_parallel", None)
    return split.pg if split is not None and split.pg.distributed else None


def tensor_parallel_of(model: Any) -> TensorParallel | None:
    """The model's :class:`TensorParallel`, or ``None`` for a whole (one-process) graph."""
    return getattr(model, "tensor_parallel", None)
