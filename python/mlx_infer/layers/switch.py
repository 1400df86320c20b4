"""Mixture-of-experts leaves: one linear map per expert, applied with ``gather_mm`` / ``gather_qmm``.

As mlx-lm's ``switch_layers``: ``SwitchLinear`` holds ``(experts, out, in)`` weights, ``QuantizedSwitchLinear``
their quantized form (``weight``/``scales``/``biases`` as mlx-lm stores them), ``SwitchGLU`` a gated expert MLP
``down(act(gate(x), up(x)))`` for each of a token's top-k experts. Also here: the quantization-aware leaves a
family's ``sanitize`` uses when it quantizes from the checkpoint's shapes (``nn.quantize`` keeps them as they are).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

#: (group size, bits) each quantization mode defaults to; FP_MODES maps a (group size, bits) pair back to its
#: floating-point mode (affine is the one with biases).
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
FP_MODES = {gb: m for m, gb in MODE_DEFAULTS.items() if m != "affine"}


def _kept(cls: type) -> type:
    """``cls`` whose ``to_quantized`` returns itself: quantized by a family's ``sanitize``, kept by ``nn.quantize``."""
    return type(f"Kept{cls.__name__}", (cls,), {"to_quantized": lambda self, **_: self})


QuantizedLinearKept, QuantizedEmbeddingKept = _kept(nn.QuantizedLinear), _kept(nn.QuantizedEmbedding)


class SwitchLinear(nn.Module):
    """One linear map per expert: weight ``(experts, out, in)``, applied with ``gather_mm``."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False):
        super().__init__()
        scale = input_dims**-0.5
        self.weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        w = self["weight"].swapaxes(-1, -2)  # (experts, in, out)
        if x.dtype != mx.float32 and mx.default_device() == mx.cpu:
            # MLX's CPU gather_mm computes in float32 only: widen, multiply, round back once.
            dtype = x.dtype
            x = mx.gather_mm(x.astype(mx.float32), w.astype(mx.float32), rhs_indices=indices,
                             sorted_indices=sorted_indices).astype(dtype)
        else:
            x = mx.gather_mm(x, w, rhs_indices=indices, sorted_indices=sorted_indices)
        if "bias" in self:
            x = x + mx.expand_dims(self["bias"][indices], -2)  # per-expert bias
        return x

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine",
                     **_: Any) -> "QuantizedSwitchLinear":
        return QuantizedSwitchLinear(self.weight, group_size, bits, mode, bias="bias" in self)


class QuantizedSwitchLinear(nn.Module):
    """Per-expert quantized weights (``weight``/``scales``/``biases`` as mlx-lm stores them), via ``gather_qmm``."""

    def to_quantized(self, **_: Any) -> "QuantizedSwitchLinear":
        return self  # already quantized (see _kept)

    def __init__(self, weight: mx.array, group_size: int | None, bits: int | None, mode: str = "affine",
                 bias: bool = False):
        super().__init__()
        self.group_size, self.bits = group_size or MODE_DEFAULTS[mode][0], bits or MODE_DEFAULTS[mode][1]
        self.mode = mode
        self.weight, self.scales, *biases = mx.quantize(weight, self.group_size, self.bits, mode=mode)
        self.biases = biases[0] if biases else None
        if bias:
            self.bias = mx.zeros(weight.shape[:2])  # (experts, out)
        self.freeze()

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        x = mx.gather_qmm(x, self["weight"], self["scales"], self.get("biases"), rhs_indices=indices,
                          transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode,
                          global_scale=self.get("global_scale"), sorted_indices=sorted_indices)
        if "bias" in self:
            x = x + mx.expand_dims(self["bias"][indices], -2)  # per-expert bias
        return x


class SwitchGLU(nn.Module):
    """Expert gated MLP: ``down(activation(gate(x), up(x)))`` for each of a token's top-k experts."""

    def __init__(self, dims: int, hidden: int, num_experts: int,
                 activation: Callable[[mx.array, mx.array], mx.array], bias: bool = False):
        super().__init__()
        self.gate_proj = SwitchLinear(dims, hidden, num_experts, bias)
        self.up_proj = SwitchLinear(dims, hidden, num_experts, bias)
        self.down_proj = SwitchLinear(hidden, dims, num_experts, bias)
        self._activation = activation

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """``x (..., D)``, ``indices (..., k)`` -> ``(..., k, D)``."""
        x = mx.expand_dims(x, (-2, -3))  # (..., 1, 1, D)
        # Many rows: sort them by expert so each expert's weights are read once.
        do_sort = indices.size >= 64
        idx, inv_order = indices, None
        if do_sort:
            k = indices.shape[-1]
            flat = indices.flatten()
            order = mx.argsort(flat)
            inv_order = mx.argsort(order)
            x, idx = x.flatten(0, -3)[order // k], flat[order]  # (T*k, 1, D), (T*k,)
        up = self.up_proj(x, idx, sorted_indices=do_sort)
        gate = self.gate_proj(x, idx, sorted_indices=do_sort)
        x = self.down_proj(self._activation(gate, up), idx, sorted_indices=do_sort)
        if do_sort:
            x = mx.unflatten(x[inv_order], 0, indices.shape)  # (..., k, 1, D)
        return x.squeeze(-2)
