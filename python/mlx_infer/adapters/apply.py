"""The low-rank update inside the eager graph: hooked linear layers and per-row adapter slots.

A targeted linear layer keeps its class's parameters and gets a subclass whose
``__call__`` adds the update (as the CPU-kernel swap does, so weights, ``isinstance``
checks and the compiled steps' weight reading are unchanged). Which adapter each row
uses is the *selection*, set around a forward with :func:`adapter_rows`:

- ``None`` (no selection set): the bank's default adapter (``load(path, adapter=...)``), or none;
- an ``int`` slot: every row uses that adapter, computed with mlx-lm's own ops
  (``y + (scale * ((x @ a) @ b)).astype(x.dtype)``; DoRA as ``mlx_lm.tuner.dora``), so a
  single-adapter forward is bit-identical to mlx-lm's;
- a ``(B,)`` int array of slots: row ``b`` uses slot ``slots[b]`` (0 = no adapter), over the
  bank's stacked tensors (rank padded with zeros). A small bank (``S * r <= DENSE_MAX_COLS``)
  runs two products over every slot at once, the other slots' columns masked to zero::

      xa = (x (B, L, in) @ A_cat^T (in, S r)) * mask[slots]      (B, L, S r)
      y  = base(x) + (xa @ B_cat^T (S r, out)).astype(x.dtype)   B_cat scaled by each slot's scale

  (A_cat and B_cat are stored as linear weights; when the base layer runs on the CPU kernels the
  whole update and its add are one op, ``_fast.fast_lora_update``: float32 accumulation, one rounding)

  a larger one gathers each row's own A and B::

      xa = gather_mm(x (B, L, in), A (S, in, r), rhs=slots)      (B, L, r)
      z  = gather_mm(xa, B (S, r, out), rhs=slots)               (B, L, out)
      y  = base(x) + (scales[slots] * z).astype(x.dtype)
      DoRA slots: y = g[slots] * (x W^T + ...) + bias, g = m / ||W + scale (A B)^T|| per row of W
                  (g = 1 for the others)

  the same ops as the compiled C++ steps (cpp/decode/lora.cpp), which also run one update for
  each group of linears that share their input (q|k|v, gate|up; adapters/native.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Iterator

import mlx.core as mx
import mlx.nn as nn

from .. import _fast

if TYPE_CHECKING:
    from .bank import AdapterBank
    from .formats import LoraTarget

_SELECTION: ContextVar[Any] = ContextVar("mlx_infer_adapter_rows", default=None)
_HOOK_CLASSES: dict[type, type] = {}


@contextmanager
def adapter_rows(selection: int | mx.array | None) -> Iterator[None]:
    """Run the forwards inside with this selection (see the module doc)."""
    token = _SELECTION.set(selection)
    try:
        yield
    finally:
        _SELECTION.reset(token)


def current_selection() -> Any:
    """The selection set by :func:`adapter_rows` (``None``: the bank's default)."""
    return _SELECTION.get()


def dequantized_weight(module: nn.Module) -> mx.array:
    """The layer's weight, dequantized as mlx-lm's DoRALinear does."""
    w = module["weight"]
    if isinstance(module, nn.QuantizedLinear):
        w = mx.dequantize(w, module["scales"], module.get("biases"), group_size=module.group_size,
                          bits=module.bits, mode=getattr(module, "mode", "affine"))
    return w


def dora_gain(module: nn.Module, t: "LoraTarget") -> mx.array:
    """``m / ||W + scale (a b)^T||`` per output row ``(out,)``, as mlx-lm's DoRALinear computes it."""
    w = dequantized_weight(module)
    adapted = w + (t.scale * t.b.T) @ t.a.T
    return t.m / mx.linalg.norm(adapted, axis=1)


def linear_without_bias(module: nn.Module, x: mx.array) -> mx.array:
    """The layer's product ``x W^T`` without its additive bias (DoRA scales it before the bias)."""
    if isinstance(module, nn.QuantizedLinear):
        mode = getattr(module, "mode", "affine")
        if type(module).__name__.startswith("Fast"):
            return _fast.fast_quantized_matmul(x, module["weight"], module["scales"], module.get("biases"),
                                               transpose=True, group_size=module.group_size, bits=module.bits,
                                               mode=mode)
        return mx.quantized_matmul(x, module["weight"], module["scales"], module.get("biases"), transpose=True,
                                   group_size=module.group_size, bits=module.bits, mode=mode)
    if type(module).__name__.startswith("Fast"):
        return _fast.fast_linear(x, module["weight"], None)
    return x @ module["weight"].T


def _uniform(module: nn.Module, base: Any, x: mx.array, t: "LoraTarget", gain: mx.array | None) -> mx.array:
    """mlx-lm's LoRALinear / DoRALinear forward for one adapter on every row."""
    if t.m is None:
        y = base(module, x)
        z = (x @ t.a) @ t.b
        return y + (t.scale * z).astype(x.dtype)
    w = dequantized_weight(module)
    y = x @ w.T
    z = (x @ t.a) @ t.b
    out = y + (t.scale * z).astype(x.dtype)
    out = gain.astype(x.dtype) * out
    if "bias" in module:
        out = out + module["bias"]
    return out


def _product(module: nn.Module, x: mx.array, w: mx.array) -> mx.array:
    """``x @ w.T`` on the kernels the base layer runs on (the CPU kernels when it was swapped), in
    the promoted dtype as ``x @ w.T`` promotes (a bfloat16 model's float32 adapter: float32)."""
    if type(module).__name__.startswith("Fast"):
        dt = x.dtype if x.dtype == w.dtype else mx.float32  # floating dtypes that differ promote to float32
        return _fast.fast_linear(x.astype(dt), w.astype(dt), None)
    return x @ w.T


def slot_mask(slots: mx.array, slots_total: int, rank: int, dtype: mx.Dtype) -> mx.array:
    """``(B, 1, S * r)``: 1 on the columns of each row's slot, 0 elsewhere."""
    cols = mx.arange(slots_total * rank, dtype=mx.int32) // rank  # (S*r,) the slot of each column
    return (slots.astype(mx.int32)[:, None] == cols[None, :]).astype(dtype)[:, None, :]


def _rows(module: nn.Module, base: Any, x: mx.array, stack: Any, slots: mx.array) -> mx.array:
    """Per-row adapters over the stacked tensors (see the module doc)."""
    lead = x.shape[:-1]
    x3 = x.reshape(lead[0], -1, x.shape[-1])  # (B, L, in)
    if stack.dense and type(module).__name__.startswith("Fast"):  # the CPU kernels: update + add, one op
        S, _, r = stack.a.shape
        bank_args = dict(slot_count=S, rank=r)
        quantized = isinstance(module, nn.QuantizedLinear)
        if stack.g is None and not quantized:  # the product, the update and the add: one op
            y = _fast.fast_lora_linear(x3, module["weight"], module.get("bias"), stack.a_cat, stack.b_cat, slots,
                                       **bank_args)
        elif stack.g is None and getattr(module, "mode", "affine") == "affine" and "bias" not in module:
            y = _fast.fast_lora_quantized_matmul(x3, module["weight"], module["scales"], module.get("biases"),
                                                 stack.a_cat, stack.b_cat, slots, group_size=module.group_size,
                                                 bits=module.bits, **bank_args)
        elif stack.g is None:
            y = _fast.fast_lora_update(base(module, x3), x3, stack.a_cat, stack.b_cat, slots, **bank_args)
        else:
            g = mx.take(stack.g, slots, axis=0)[:, None, :].astype(x.dtype)  # (B, 1, out)
            y = g * _fast.fast_lora_update(linear_without_bias(module, x3), x3, stack.a_cat, stack.b_cat, slots,
                                           **bank_args)
            if "bias" in module:
                y = y + module["bias"]
        return y.reshape(*lead, y.shape[-1])
    if stack.dense:  # every slot's columns at once, the others masked out; scales are in b_cat
        S, _, r = stack.a.shape
        xa = _product(module, x3, stack.a_cat)  # (B, L, S*r)
        xa = xa * slot_mask(slots, S, r, xa.dtype)
        delta = _product(module, xa, stack.b_cat).astype(x.dtype)  # (B, L, out)
    else:
        xa = mx.gather_mm(x3, stack.a, rhs_indices=slots)  # (B, L, r)
        z = mx.gather_mm(xa, stack.b, rhs_indices=slots)  # (B, L, out)
        s = mx.take(stack.scales, slots, axis=0).reshape(-1, 1, 1)  # (B, 1, 1)
        delta = (s * z).astype(x.dtype)
    if stack.g is None:
        y = base(module, x3) + delta
    else:
        g = mx.take(stack.g, slots, axis=0)[:, None, :].astype(x.dtype)  # (B, 1, out)
        y = g * (linear_without_bias(module, x3) + delta)
        if "bias" in module:
            y = y + module["bias"]
    return y.reshape(*lead, y.shape[-1])


def _hook_class(cls: type) -> type:
    sub = _HOOK_CLASSES.get(cls)
    if sub is None:
        base = cls.__call__

        def __call__(self: Any, x: mx.array) -> mx.array:
            bank: AdapterBank = self._lora_bank
            sel = current_selection()
            if sel is None:
                sel = bank.default_slot
            stack = bank.stacks.get(self._lora_key)
            if stack is None:
                return base(self, x)
            if isinstance(sel, int):
                t = stack.targets[sel] if 0 <= sel < len(stack.targets) else None
                if t is None:
                    return base(self, x)
                return _uniform(self, base, x, t, stack.gains[sel])
            return _rows(self, base, x, stack, sel)

        sub = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__, "_mlx_infer_lora_base": cls})
        _HOOK_CLASSES[cls] = sub
    return sub


def hook(module: nn.Module, bank: "AdapterBank", key: str) -> None:
    """Make ``module`` (a linear layer at path ``key``) add the bank's update for ``key``."""
    if "_mlx_infer_lora_base" not in type(module).__dict__:
        module.__class__ = _hook_class(type(module))
    object.__setattr__(module, "_lora_bank", bank)
    object.__setattr__(module, "_lora_key", key)


def unhook(module: nn.Module) -> None:
    """Back to the layer's own class."""
    base = type(module).__dict__.get("_mlx_infer_lora_base")
    if base is not None:
        module.__class__ = base
