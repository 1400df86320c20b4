"""q|k|v and gate|up as one product each, with no second copy of the weights.

The compiled decode steps run a layer's q, k and v projections as one product over their
concatenated weights (and gate and up likewise): one launch and one pass over the activations
instead of three, and the small k/v products stop paying a ramp-up each. The concatenation is
made once, and the model's own ``q_proj``/``k_proj``/``v_proj`` parameters are then replaced by
row slices of it — views of the same buffer (MLX slices along the first axis share their
input's memory) — so the eager graph, LoRA wrapping and saving see the same values in the same
shapes while the device holds each weight once::

    fused  (out_q + out_k + out_v, in)      one buffer
    q_proj.weight = fused[:out_q]            views into it
    k_proj.weight = fused[out_q:out_q + out_k]
    v_proj.weight = fused[out_q + out_k:]

Quantized projections fuse their packed weights, scales and biases the same way (all are
indexed by output row); a bias fuses along with them. Projections of different kinds (one
quantized, one not; different group sizes or bits; a bias on some only) are left alone.

Adapters (an :class:`~mlx_infer.adapters.AdapterBank`) keep targeting the members; the eager
graph's hooked projections run on the views as before, and the compiled steps add, to the one
fused product, each member's update for the rows whose slot targets it and zeros on the rows
of members no adapter targets::

    y = x fused^T + delta      delta (B, L, out_q + out_k + out_v) = [delta_q, 0_k, delta_v], one add

The members' dense updates go as one low-rank target on the fused linear, B zero on an
untargeted member's rows (``adapters/native.py``); DoRA members and a large bank's gathered
stacks go by the members' names and the step concatenates their updates
(``cpp/decode/lora.cpp``). Each member's rows get its own values, as unfused (a DoRA member's
gain scales its rows only), so a model with a bank fuses like any other.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

_PARTS = ("weight", "scales", "biases", "bias")


def _kind(m: nn.Module) -> tuple | None:
    """What must agree for two linears to share one product (``None``: not a plain or quantized linear)."""
    if isinstance(m, nn.QuantizedLinear):
        return ("q", int(m.group_size), int(m.bits), str(getattr(m, "mode", "affine")),
                m.get("biases") is not None, "bias" in m)
    if isinstance(m, nn.Linear):
        return ("plain", "bias" in m)
    return None


def fuse_in_place(owner: nn.Module, names: Sequence[str], key: str) -> dict[str, mx.array] | None:
    """The parts (``weight``, ``scales``, ``biases``, ``bias`` where present) of ``owner``'s linears
    ``names`` concatenated by output row, with those linears' parameters made views of them.

    Idempotent: a second call returns the same arrays while the linears still hold the views it
    made (after a module was replaced, e.g. by quantization or a LoRA wrapper, it fuses anew or
    returns ``None``). ``None`` where the linears cannot share a product.

    Args:
        owner: the module holding the linears (an attention or MLP block).
        names: the linears' attribute names, in output order (``("q_proj", "k_proj", "v_proj")``).
        key: a name for this fusion on ``owner`` (``"qkv"``, ``"gate_up"``).
    """
    mods = [owner.get(n) for n in names]
    kinds = {_kind(m) if m is not None else None for m in mods}
    if len(kinds) != 1 or None in kinds:
        return None
    parts = [p for p in _PARTS if p in mods[0] and mods[0][p] is not None]
    attr = f"_mlx_infer_fused_{key}"
    record = owner.__dict__.get(attr)
    if record is not None:
        fused, views = record
        if all(m[p] is v for m, mv in zip(mods, views) for p, v in zip(parts, mv)):
            return fused
    fused = {p: mx.concatenate([m[p] for m in mods], axis=0) for p in parts}  # (sum out, ...)
    mx.eval(list(fused.values()))
    views: list[tuple[mx.array, ...]] = []
    start = 0
    for m in mods:
        rows = m["weight"].shape[0]
        mv = tuple(fused[p][start:start + rows] for p in parts)  # views: the fused buffer's rows
        for p, v in zip(parts, mv):
            setattr(m, p, v)
        views.append(mv)
        start += rows
    mx.eval([v for mv in views for v in mv])
    object.__setattr__(owner, attr, (fused, views))  # not a parameter: the views are
    return fused
