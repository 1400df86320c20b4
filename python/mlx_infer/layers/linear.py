"""Linear layers over mlx-infer's CPU matmul kernels (``mlx_infer._fast``).

MLX's Linux CPU wheel runs ``x @ W.T`` through the reference BLAS and its
bfloat16/quantized matmuls as scalar loops; these layers call our kernels
instead (AVX-512 / AVX2 / portable, multi-threaded; see ``cpp/cpu_kernels/``). On a
GPU stream the same calls build MLX's own ops, so a swapped model still runs
anywhere.

The layers subclass MLX's, with the same parameters (weights load, save and
``isinstance`` checks behave as before); only the product differs:

==========================  ==================================================
stock                        fast
==========================  ==================================================
``nn.Linear``                :class:`FastLinear`
``nn.QuantizedLinear``       :class:`FastQuantizedLinear`
``nn.Embedding``             :class:`FastEmbedding` (its ``as_linear``: tied LM head)
``nn.QuantizedEmbedding``    :class:`FastQuantizedEmbedding` (``as_linear``)
==========================  ==================================================

Numerics: the kernels compute in float32 (bfloat16/float16 inputs widened
exactly, quantized weights dequantized as ``scale * q + bias`` in float32) and
round once to the output dtype; only the summation order differs from an
exact float32 product. Tolerances the tests hold them to (``tests/test_cpu_kernels.py``),
against numpy float64 on the same (dequantized) values:

- matmuls: ``|fast - ref| <= eps_out * |ref| + 1e-6 * sqrt(K) * (|x| @ |w|.T)``,
  eps_out = 0 (float32), 2**-8 (bfloat16), 2**-10 (float16);
- attention: ``eps_out * |ref| + 2e-6 * max|v|``; gated activation:
  ``eps_out * |ref| + 1e-6 * (1 + |ref|)``;
- MLX's stock float32 ops meet the same bounds; its bfloat16 kernels round
  intermediates to bfloat16 and are further from float64 than ours.

Opt-in (``_fast.set_cpu_kernel_isa("avx512vnni")``, CPUs with AVX-512 VNNI):
quantized GEMV (M <= 4) rounds x to int8 per 32 values for VNNI dot products,
adding at most ``sum_k |w_k| * amax(x block) / 254`` (~0.5% relative for
Gaussian x); on the 4-bit Gemma 3 270M its decode logits stay as close to the
float32 model's as MLX's stock 4-bit kernels are, for ~6% more decode speed.

The loader swaps these in by default when MLX runs on the CPU (``cpu_kernels=False``
or ``MLX_INFER_CPU_KERNELS=0`` opts out);
:func:`swap_in_cpu_kernels` does it for any model, :func:`swap_out_cpu_kernels`
restores MLX's stock layers (bit-exact with mlx-lm).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from .. import _fast


def _rebrand(module: nn.Module, cls: type) -> nn.Module:
    """A ``cls`` instance holding ``module``'s parameters and attributes (no copies)."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.__dict__.update(module.__dict__)
    dict.update(new, module)
    return new


class FastLinear(nn.Linear):
    """``nn.Linear`` whose product runs on mlx-infer's CPU kernels."""

    def __call__(self, x: mx.array) -> mx.array:
        return _fast.fast_linear(x, self["weight"], self.get("bias"))


class FastQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose product runs on mlx-infer's CPU kernels.

    Affine 4- and 8-bit weights with group size 32/64/128 use our kernels; other
    modes and bit widths fall through to ``mx.quantized_matmul`` inside the op.
    """

    def __call__(self, x: mx.array) -> mx.array:
        y = _fast.fast_quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"),
            transpose=True, group_size=self.group_size, bits=self.bits,
            mode=getattr(self, "mode", "affine"),
        )
        if "bias" in self:
            y = y + self["bias"]
        return y


class FastEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (a tied LM head) runs on our kernels."""

    def as_linear(self, x: mx.array) -> mx.array:
        return _fast.fast_linear(x, self.weight)


class FastQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` (a tied LM head) runs on our kernels."""

    def as_linear(self, x: mx.array) -> mx.array:
        return _fast.fast_quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"),
            transpose=True, group_size=self.group_size, bits=self.bits,
            mode=getattr(self, "mode", "affine"),
        )


# ---------------------------------------------------------------- attention
#
# Attention is a function the model files call (layers.attention), not a layer,
# so the switch is per attention module: swapped modules run their forward with
# this flag set, and scaled_dot_product_attention dispatches on it. A model
# loaded with stock kernels never sets it (bit-exact with mlx-lm).
_CPU_ATTENTION: ContextVar[bool] = ContextVar("mlx_infer_cpu_attention", default=False)
_FAST_ATTENTION_CLASSES: dict[type, type] = {}


def cpu_attention_active() -> bool:
    """True inside the forward of an attention module swapped onto the CPU kernels."""
    return _CPU_ATTENTION.get()


def fast_scaled_dot_product_attention(queries: mx.array, keys: mx.array, values: mx.array, *,
                                      scale: float, mask: Any) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` on mlx-infer's CPU kernel.

    ``mask`` as mlx-lm passes it: ``None``, ``"causal"`` or an array (bool: True
    = attend; float: added to the scores). Scores, softmax and the weighted sum
    run in float32 (MLX's CPU fallback keeps them in the input dtype).
    """
    if mask is None:
        return _fast.fast_sdpa(queries, keys, values, scale=scale)
    if isinstance(mask, str):
        return _fast.fast_sdpa(queries, keys, values, scale=scale, mask_mode=mask)
    return _fast.fast_sdpa(queries, keys, values, scale=scale, mask_mode="array", mask=mask)


def _fast_attention_class(cls: type) -> type:
    sub = _FAST_ATTENTION_CLASSES.get(cls)
    if sub is None:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            token = _CPU_ATTENTION.set(True)
            try:
                return cls.__call__(self, *args, **kwargs)
            finally:
                _CPU_ATTENTION.reset(token)

        sub = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__,
                                          "_mlx_infer_stock_class": cls})
        _FAST_ATTENTION_CLASSES[cls] = sub
    return sub


def _is_attention(m: nn.Module) -> bool:
    # The families' attention modules (mlx-lm naming): they own q_proj and o_proj.
    return "q_proj" in m and "o_proj" in m


# ---------------------------------------------------------------- gated MLPs
#
# MLX's CPU backend runs gelu_approx / silu through scalar libm calls (~45% of a
# CPU prefill of Gemma 3 270M). For the families' gated MLPs, whose activation
# is known, the swapped class computes down(act(gate(x)) * up(x)) with the fused
# op. Keyed by (module, class name); exact classes only.
_GATED_MLPS: dict[tuple[str, str], str] = {
    ("mlx_infer.models.gemma3", "MLP"): "gelu_approx",
    ("mlx_infer.models.gemma4", "MLP"): "gelu_approx",
    ("mlx_infer.models.llama", "MLP"): "silu",
}
_FAST_MLP_CLASSES: dict[type, type] = {}


def _fast_mlp_class(cls: type, activation: str) -> type:
    sub = _FAST_MLP_CLASSES.get(cls)
    if sub is None:
        def __call__(self: Any, x: mx.array) -> mx.array:
            h = _fast.fast_gated_activation(self.gate_proj(x), self.up_proj(x), activation=activation)
            return self.down_proj(h)

        sub = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__,
                                          "_mlx_infer_stock_class": cls})
        _FAST_MLP_CLASSES[cls] = sub
    return sub


def _gated_activation_of(m: nn.Module) -> str | None:
    act = _GATED_MLPS.get((type(m).__module__, type(m).__name__))
    if act is None or not all(k in m for k in ("gate_proj", "up_proj", "down_proj")):
        return None
    return act


# Exact types only: a subclass (an adapter layer, say) may compute something else.
_TO_FAST: dict[type, type] = {
    nn.Linear: FastLinear,
    nn.QuantizedLinear: FastQuantizedLinear,
    nn.Embedding: FastEmbedding,
    nn.QuantizedEmbedding: FastQuantizedEmbedding,
}
_TO_STOCK: dict[type, type] = {fast: stock for stock, fast in _TO_FAST.items()}


def _swap(model: nn.Module, table: dict[type, type]) -> int:
    count = 0

    def replace(_path: str, m: Any) -> Any:
        nonlocal count
        cls = table.get(type(m))
        if cls is None:
            return m
        count += 1
        return _rebrand(m, cls)

    leaves = tree_map_with_path(replace, model.leaf_modules(), is_leaf=nn.Module.is_module)
    if count:
        model.update_modules(leaves)
    return count


def swap_in_cpu_kernels(model: nn.Module) -> int:
    """Put the model's linear layers, tied head and attention on the CPU kernels.

    In place; parameters are shared, not copied. Linear layers and embeddings
    (whose ``as_linear`` is a tied LM head) are replaced by the fast classes;
    attention modules (those with ``q_proj`` and ``o_proj``) switch to a
    subclass whose forward routes ``scaled_dot_product_attention`` to
    :func:`fast_scaled_dot_product_attention`; the families' gated MLPs switch
    to a subclass computing ``act(gate) * up`` with ``_fast.fast_gated_activation``.
    Returns the number of modules changed.
    """
    count = _swap(model, _TO_FAST)
    for _, m in model.named_modules():
        if "_mlx_infer_stock_class" in type(m).__dict__:
            continue
        if _is_attention(m):
            m.__class__ = _fast_attention_class(type(m))
            count += 1
        elif (act := _gated_activation_of(m)) is not None:
            m.__class__ = _fast_mlp_class(type(m), act)
            count += 1
    return count


def swap_out_cpu_kernels(model: nn.Module) -> int:
    """Undo :func:`swap_in_cpu_kernels`: back to MLX's stock layers. Returns the count."""
    count = _swap(model, _TO_STOCK)
    for _, m in model.named_modules():
        stock = type(m).__dict__.get("_mlx_infer_stock_class")
        if stock is not None:
            m.__class__ = stock
            count += 1
    return count


def uses_cpu_kernels(model: nn.Module) -> bool:
    """True when any of the model's modules runs on the CPU kernels."""
    return any(type(m) in _TO_STOCK or "_mlx_infer_stock_class" in type(m).__dict__
               for _, m in model.named_modules())


def cpu_kernel_info() -> dict[str, Any]:
    """The instruction set and thread count the kernels run with."""
    return {"isa": _fast.cpu_kernel_isa(), "threads": _fast.cpu_threads()}
