"""Tensor-parallel sharding plan of a graph: which slice of each weight a rank holds.

Megatron-style, as mlx-lm's ``shard`` methods (``mlx.nn.layers.distributed``):

==============================  =========================================  =====================
module                          rank ``r`` of ``N`` holds                   after the product
==============================  =========================================  =====================
``q_proj`` (all-to-sharded)     rows of its ``H / N`` query heads           local heads
``k_proj``/``v_proj``           rows of its ``KVH / N`` KV heads, or, when  local KV heads
                                ``KVH < N``, the one KV head its query
                                heads read (replicated on ``N / KVH`` ranks)
``o_proj`` (sharded-to-all)     columns of its query heads                  ``all_sum``
``gate_proj``/``up_proj``       rows ``r/N .. (r+1)/N`` of the hidden       local hidden
``down_proj`` (sharded-to-all)  columns of the same hidden slice            ``all_sum``
``embed_tokens``                rows ``r/N .. (r+1)/N`` of the vocabulary   lookup: ``all_sum``
``lm_head`` / tied head         the same vocabulary rows                    ``all_gather``
Gemma 4 experts (expert         experts ``r/N .. (r+1)/N`` (gate/up/down)   local experts' share
parallel)                                                                   of the routed sum,
                                                                            ``all_sum``
Gemma 4 per-layer table         its vocabulary rows, as ``embed_tokens``    lookup: ``all_sum``
fused ``qkv_proj`` (Phi 3)      each part's rows of its heads, as above     local heads
fused ``gate_up_proj``          each half's rows ``r/N .. (r+1)/N``         local hidden
qwen3_moe / gpt_oss /           ``switch_mlp`` / ``experts``: experts       the MoE block's
deepseek_v3 experts             ``r/N .. (r+1)/N`` (every parameter);       output, ``all_sum``
                                DeepSeek's shared experts as an MLP
gpt-oss ``sinks``               its query heads' sink logits                (softmax per head)
OLMo 2 ``q_norm``/``k_norm``    its heads' slice of the weight              sum of squares:
(RMSNorm over all heads)                                                    ``all_sum``
DeepSeek V3 MLA                 ``q_proj``/``q_b_proj`` rows, ``embed_q``,  local heads
                                ``unembed_out`` of its query heads;
                                ``o_proj`` columns
norms, q/k norms, RoPE, the     replicated (vectors, and small matrices);
router, per-layer projections,  DeepSeek's latent: every rank caches it
MLA latent projections          whole
(``q_a_proj``,
``kv_a_proj_with_mqa``)
==============================  =========================================  =====================

Experts are split whole (expert parallel), not sliced: every rank routes every
token (the router is replicated), runs its own experts on the tokens routed to
them (a routing weight of zero for the others) and the ``all_sum`` adds the
ranks' shares.

The vocabulary is split, not replicated: in small-hidden, large-vocab models
the table is most of the weights (Gemma 3 270M: 168M of 268M parameters), so
replicating it would leave each rank with more than half the model. Both
collectives are exact: a token's row lives on one rank (the others add
zeros), and the gathered logits are the concatenation of the local ones. A
vocabulary that ``N`` does not divide stays replicated (said in the plan).

A sharded-to-all layer's additive bias is kept on rank 0 only (zeros
elsewhere), so the ``all_sum`` adds it once. Quantized layers split the same
way: ``weight``/``scales``/``biases`` are sliced along the same axis, by the
same fraction (a split must fall on a quantization-group boundary).

A slice is a fraction of one axis (``Slice``); the loader (:mod:`.load`) reads
just those bytes from the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import UnsupportedModelError
from ..models import graph_family
from .group import ParallelGroup

#: Families whose graphs can be split (module name of the family file).
TP_FAMILIES = ("llama", "gemma3", "gemma4", "smollm3", "granite", "glm4", "gemma2", "phi3", "qwen3_moe",
               "gpt_oss", "olmo2", "deepseek_v3")


@dataclass(frozen=True)
class Slice:
    """Indices ``[lo * n / den, hi * n / den)`` of ``axis`` of a tensor whose ``axis`` has ``n`` entries."""

    axis: int
    lo: int
    hi: int
    den: int
    zero_unless_leader: bool = False  # sharded-to-all bias: rank 0 keeps it

    def bounds(self, n: int, name: str) -> tuple[int, int]:
        """``(start, stop)`` on an axis of ``n`` entries; refuses a split that is not whole."""
        if (self.lo * n) % self.den or (self.hi * n) % self.den:
            raise UnsupportedModelError(
                f"cannot split {name} (axis {self.axis}, {n} entries) into {self.den} equal parts; "
                "use a process count that divides the heads, MLP width and quantization groups.")
        return self.lo * n // self.den, self.hi * n // self.den

    def ranges(self, n: int, name: str) -> list[tuple[int, int]]:
        """The ``(start, stop)`` runs of the axis this rank holds (one for a plain slice)."""
        return [self.bounds(n, name)]


@dataclass(frozen=True)
class FusedSlice:
    """A slice of each part of a fused weight (Phi 3's ``qkv_proj``, ``gate_up_proj``), concatenated.

    The axis is ``sum(units)`` equal units long, part ``i`` being ``units[i]`` of them (heads, or
    ``N`` shares of an MLP half); this rank holds units ``[lo_i, hi_i)`` of each part, in order.
    """

    axis: int
    parts: tuple[tuple[int, int, int], ...]  # (units, lo, hi) per part, along the axis
    zero_unless_leader: bool = False

    def ranges(self, n: int, name: str) -> list[tuple[int, int]]:
        """The ``(start, stop)`` runs of the axis this rank holds, one per part."""
        total = sum(u for u, _, _ in self.parts)
        if n % total:
            raise UnsupportedModelError(f"cannot split the fused {name} (axis {self.axis}, {n} entries) into its "
                                        f"{total} heads/shares; use a process count that divides the heads, MLP "
                                        "width and quantization groups.")
        step, out, base = n // total, [], 0
        for units, lo, hi in self.parts:
            out.append((base + lo * step, base + hi * step))
            base += units * step
        return out


@dataclass
class ShardPlan:
    """What one rank holds: a slice per sharded parameter; everything else is replicated.

    Attributes:
        slices: parameter path -> its slice (parameters absent here are whole).
        heads: attention module path -> (local query heads, local KV heads).
        vocab_parallel: the embedding / LM head are split by vocabulary.
        notes: one line per choice worth stating (replicated KV heads, replicated vocabulary).
    """

    pg: ParallelGroup
    slices: dict[str, Slice | FusedSlice] = field(default_factory=dict)
    heads: dict[str, tuple[int, int]] = field(default_factory=dict)
    row_parallel: list[str] = field(default_factory=list)  # modules followed by all_sum
    experts: list[str] = field(default_factory=list)  # expert-parallel Experts modules (gemma4)
    switches: list[str] = field(default_factory=list)  # expert-parallel SwitchGLU modules (qwen3_moe, gpt_oss)
    global_norms: list[str] = field(default_factory=list)  # head-split RMSNorms over all heads (all_sum of squares)
    vocab_tables: dict[str, int] = field(default_factory=dict)  # vocab-split embedding path -> first row here
    vocab_parallel: bool = False
    notes: list[str] = field(default_factory=list)
    held: set[str] | None = None  # pipeline parallel: the parameters this rank reads (None: all)
    pipeline: tuple[int, int] | None = None  # pipeline parallel: the layers [start, stop) held here

    def local_shape(self, path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape rank ``pg.rank`` holds of the parameter ``path`` of full shape ``shape``."""
        s = self.slices.get(path)
        if s is None or s.zero_unless_leader:
            return tuple(shape)
        out = list(shape)
        out[s.axis] = sum(stop - start for start, stop in s.ranges(shape[s.axis], path))
        return tuple(out)


def _linear_slices(plan: ShardPlan, path: str, module: nn.Module, axis: int, lo: int, hi: int, den: int) -> None:
    """Slices of a (possibly quantized) linear's parameters; ``axis`` 0 = output rows, -1 = inputs."""
    for name in ("weight", "scales", "biases"):
        if name in module:
            plan.slices[f"{path}.{name}"] = Slice(axis, lo, hi, den)
    if "bias" in module:
        if axis == 0:
            plan.slices[f"{path}.bias"] = Slice(0, lo, hi, den)
        else:
            plan.slices[f"{path}.bias"] = Slice(0, 0, 1, 1, zero_unless_leader=True)


def _attention(plan: ShardPlan, path: str, attn: nn.Module, family: str) -> None:
    N, r = plan.pg.size, plan.pg.rank
    H, KVH = int(attn.n_heads), int(attn.n_kv_heads)
    if H % N:
        raise UnsupportedModelError(f"{path}: {H} attention heads cannot be split over {N} processes; "
                                    f"use a process count that divides {H}.")
    Hl = H // N
    if "q_proj" in attn:
        _linear_slices(plan, f"{path}.q_proj", attn.q_proj, 0, r * Hl, (r + 1) * Hl, H)
    _linear_slices(plan, f"{path}.o_proj", attn.o_proj, -1, r * Hl, (r + 1) * Hl, H)
    plan.row_parallel.append(f"{path}.o_proj")
    if "sinks" in attn:  # gpt-oss: one sink logit per query head, split with the heads
        plan.slices[f"{path}.sinks"] = Slice(0, r * Hl, (r + 1) * Hl, H)
    if KVH >= N:
        if KVH % N:
            raise UnsupportedModelError(f"{path}: {KVH} KV heads cannot be split over {N} processes; use a "
                                        f"process count that divides {KVH} (or a multiple of it).")
        KVl, lo = KVH // N, r * (KVH // N)
    else:
        if N % KVH:
            raise UnsupportedModelError(f"{path}: {KVH} KV heads cannot be replicated evenly over {N} "
                                        f"processes; use a process count that {KVH} divides.")
        KVl, lo = 1, r // (N // KVH)  # the KV head this rank's query heads read
        note = f"KV heads replicated: {KVH} KV heads over {N} ranks ({N // KVH} ranks per KV head)"
        if note not in plan.notes:
            plan.notes.append(note)
    for proj in ("k_proj", "v_proj"):
        if proj in attn:
            _linear_slices(plan, f"{path}.{proj}", attn[proj], 0, lo, lo + KVl, KVH)
    if "qkv_proj" in attn:  # Phi 3: q | k | v fused along the output, each part split by its heads
        fused = FusedSlice(0, ((H, r * Hl, (r + 1) * Hl), (KVH, lo, lo + KVl), (KVH, lo, lo + KVl)))
        _fused_slices(plan, f"{path}.qkv_proj", attn.qkv_proj, fused)
    if family == "olmo2":  # RMSNorm over all heads' concatenation: sums of squares all_sum-ed
        plan.slices[f"{path}.q_norm.weight"] = Slice(0, r * Hl, (r + 1) * Hl, H)
        plan.slices[f"{path}.k_norm.weight"] = Slice(0, lo, lo + KVl, KVH)
        plan.global_norms += [f"{path}.q_norm", f"{path}.k_norm"]
    plan.heads[path] = (Hl, KVl)


def _mla(plan: ShardPlan, path: str, attn: nn.Module) -> None:
    """DeepSeek V3's multi-head latent attention: the query heads split (``q_proj`` / ``q_b_proj`` rows,
    the per-head ``embed_q`` / ``unembed_out``, ``o_proj`` columns); the latent projections
    (``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms) replicated, so every rank caches the
    whole latent (one shared "KV head")."""
    N, r = plan.pg.size, plan.pg.rank
    H = int(attn.n_heads)
    if H % N:
        raise UnsupportedModelError(f"{path}: {H} attention heads cannot be split over {N} processes; "
                                    f"use a process count that divides {H}.")
    Hl = H // N
    q = "q_proj" if "q_proj" in attn else "q_b_proj"
    for name in (q, "embed_q", "unembed_out"):
        _linear_slices(plan, f"{path}.{name}", attn[name], 0, r * Hl, (r + 1) * Hl, H)
    _linear_slices(plan, f"{path}.o_proj", attn.o_proj, -1, r * Hl, (r + 1) * Hl, H)
    plan.row_parallel.append(f"{path}.o_proj")
    note = "MLA latent projections replicated: every rank computes and caches the whole latent"
    if note not in plan.notes:
        plan.notes.append(note)
    plan.heads[path] = (Hl, 1)


def _fused_slices(plan: ShardPlan, path: str, module: nn.Module, fused: FusedSlice) -> None:
    """A fused column-parallel linear: every parameter (and the bias) takes the same part-wise rows."""
    for name in ("weight", "scales", "biases", "bias"):
        if name in module:
            plan.slices[f"{path}.{name}"] = fused


def _mlp(plan: ShardPlan, path: str, mlp: nn.Module) -> None:
    N, r = plan.pg.size, plan.pg.rank
    switch = next((n for n in ("switch_mlp", "experts") if n in mlp and hasattr(mlp[n], "gate_proj")), None)
    if switch is not None:  # qwen3_moe / gpt_oss: experts split whole; the router replicated
        _switch(plan, f"{path}.{switch}", mlp[switch])
        plan.row_parallel.append(path)  # the block's weighted sum of local experts, all_sum-ed
        if "shared_experts" in mlp:  # DeepSeek V3: split as an MLP, summed by the block's all_sum
            shared = mlp.shared_experts
            for proj, axis in (("gate_proj", 0), ("up_proj", 0), ("down_proj", -1)):
                _linear_slices(plan, f"{path}.shared_experts.{proj}", shared[proj], axis, r, r + 1, N)
        return
    if "gate_up_proj" in mlp:  # Phi 3 / GLM 4: gate | up fused, each half split
        fused = FusedSlice(0, ((N, r, r + 1), (N, r, r + 1)))
        _fused_slices(plan, f"{path}.gate_up_proj", mlp.gate_up_proj, fused)
        _linear_slices(plan, f"{path}.down_proj", mlp.down_proj, -1, r, r + 1, N)
        plan.row_parallel.append(f"{path}.down_proj")
        return
    _linear_slices(plan, f"{path}.gate_proj", mlp.gate_proj, 0, r, r + 1, N)
    _linear_slices(plan, f"{path}.up_proj", mlp.up_proj, 0, r, r + 1, N)
    _linear_slices(plan, f"{path}.down_proj", mlp.down_proj, -1, r, r + 1, N)
    plan.row_parallel.append(f"{path}.down_proj")


def make_plan(model: nn.Module, pg: ParallelGroup) -> ShardPlan:
    """The sharding plan of ``model`` (built, quantized if it is, not yet loaded) for ``pg.rank``.

    Raises:
        UnsupportedModelError: the family has no tensor-parallel plan, or a
            dimension does not split over ``pg.size``.
    """
    family = graph_family(model)
    if family not in TP_FAMILIES:
        raise UnsupportedModelError(
            f"tensor parallel is not supported for the {family!r} family yet (supported: "
            f"{', '.join(TP_FAMILIES)}); run it in one process.")
    plan = ShardPlan(pg)
    inner = model.model
    for i, layer in enumerate(inner.layers):
        if family == "deepseek_v3":
            _mla(plan, f"model.layers.{i}.self_attn", layer.self_attn)
        else:
            _attention(plan, f"model.layers.{i}.self_attn", layer.self_attn, family)
        _mlp(plan, f"model.layers.{i}.mlp", layer.mlp)
        if getattr(layer, "enable_moe", False):
            _experts(plan, f"model.layers.{i}.experts", layer.experts)
    V = int(model.args.vocab_size)
    r, N = pg.rank, pg.size
    if V % N == 0:
        plan.vocab_parallel = True
        _linear_slices(plan, "model.embed_tokens", inner.embed_tokens, 0, r, r + 1, N)
        plan.vocab_tables["model.embed_tokens"] = r * (V // N)
        if "lm_head" in model:
            _linear_slices(plan, "lm_head", model.lm_head, 0, r, r + 1, N)
    else:
        plan.notes.append(f"vocabulary replicated: {V} tokens do not split over {N} ranks")
    if getattr(inner, "per_layer_width", 0):
        Vp = int(inner.embed_tokens_per_layer["weight"].shape[0])
        if Vp % N == 0:
            _linear_slices(plan, "model.embed_tokens_per_layer", inner.embed_tokens_per_layer, 0, r, r + 1, N)
            plan.vocab_tables["model.embed_tokens_per_layer"] = r * (Vp // N)
        elif plan.vocab_parallel:  # the compiled step splits both tables or neither
            raise UnsupportedModelError(f"the per-layer input table ({Vp} rows) does not split over {N} "
                                        "processes while the vocabulary does; use a process count that divides both.")
        else:
            plan.notes.append(f"per-layer input table replicated: {Vp} rows do not split over {N} ranks")
    return plan


def _experts(plan: ShardPlan, path: str, experts: nn.Module) -> None:
    N, r = plan.pg.size, plan.pg.rank
    glu = experts.switch_glu
    E = int(glu.gate_proj["weight"].shape[0])
    if E % N:
        raise UnsupportedModelError(f"{path}: {E} experts cannot be split over {N} processes; use a process "
                                    f"count that divides {E}.")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for name in ("weight", "scales", "biases"):
            if name in glu[proj]:
                plan.slices[f"{path}.switch_glu.{proj}.{name}"] = Slice(0, r, r + 1, N)
    plan.experts.append(path)


def _switch(plan: ShardPlan, path: str, switch: nn.Module) -> None:
    """A ``SwitchGLU``'s experts split whole: every parameter (weights, scales, biases) on its expert axis."""
    N, r = plan.pg.size, plan.pg.rank
    E = int(switch.gate_proj["weight"].shape[0])
    if E % N:
        raise UnsupportedModelError(f"{path}: {E} experts cannot be split over {N} processes; use a process "
                                    f"count that divides {E}.")
    for k, _ in tree_flatten(switch.parameters()):
        plan.slices[f"{path}.{k}"] = Slice(0, r, r + 1, N)
    plan.switches.append(path)


def local_shapes(model: nn.Module, plan: ShardPlan) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape on this rank (the model still holds the full shapes)."""
    return {k: plan.local_shape(k, tuple(v.shape)) for k, v in tree_flatten(model.parameters())}


def replicated_bytes(model: nn.Module, plan: ShardPlan) -> int:
    """Bytes of the parameters every rank holds whole (norms, and anything the plan leaves unsplit)."""
    return sum(v.nbytes for k, v in tree_flatten(model.parameters())
               if k not in plan.slices or plan.slices[k].zero_unless_leader)
