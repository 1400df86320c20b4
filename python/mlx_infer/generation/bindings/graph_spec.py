"""A model's graph read into what the compiled C++ decode step takes (``mlx_infer._fast.DecodeStep``).

:func:`graph_spec` reads a llama-, gemma2/gemma3-, gemma4- or deepseek_v3-family graph into a :class:`~mlx_infer._fast.DecodeConfig`,
the weights under canonical names (no copy: the same arrays the model holds) and the quantization of each
quantized linear. :class:`DecodePolicy` is the binding's choice of how the step runs;
:class:`DecodeStepUnsupported` says why a graph has no step.

Canonical weight names::

    embed.{weight,scales,biases}            norm.weight        lm_head.* (untied only)
    layers.{i}.{q,k,v,o,gate,up,down}.{weight,bias,scales,biases}
    layers.{i}.attn_norm.weight             llama input_layernorm / gemma (2, 3) input_layernorm
    layers.{i}.mlp_norm.weight              llama post_attention_layernorm / gemma pre_feedforward_layernorm
    layers.{i}.post_attn_norm.weight        gemma post_attention_layernorm
    layers.{i}.post_mlp_norm.weight         gemma post_feedforward_layernorm
    layers.{i}.{q_norm,k_norm}.weight       qwen3 / gemma per-head norms
    layers.{i}.sinks                        gpt_oss per-head attention sink logits
    layers.{i}.router.*, layers.{i}.experts.{gate,up,down}.{weight,bias,scales,biases}   routed experts

Gemma's norms scale by ``1 + w``; the ``1 +`` is applied here, once.

Gemma 4 (:func:`_gemma4_spec`; its norms scale by ``w``) sets the switches of the
one C++ forward that only it uses so far: per-layer KV geometry, KV sharing
(``kv_donors``: shared layers own no buffer), V from K, the V norm, per-layer
inputs, layer scalars and the experts beside the MLP; their canonical names are
listed in ``cpp/decode/graph.h``. The step's buffers then exist for the KV-owning
layers only, in the order of ``model.make_cache()``.

DeepSeek V3 (:mod:`.mla_spec`) sets the multi-head latent attention switches (``kv_lora_rank`` and the
head widths: its buffers hold the latent as K and the RoPE key as V, one head) and ``noaux_tc`` routing
with shared experts; its names (``layers.{i}.{q_a,q_a_norm,q_b,kv_a,kv_a_norm,embed_q,unembed_out}``,
``layers.{i}.router.correction_bias``, ``layers.{i}.shared.{gate,up,down}``) are listed there and in
``cpp/decode/graph.h``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ... import _fast
from ...layers.rope import Llama3RoPE, LongRoPE, NoPE, YarnRoPE
from ...models import graph_family, materialize_graph_constants
from ...layers.switch import QuantizedSwitchLinear, SwitchLinear
from ...models.gemma4 import FULL, SLIDING, ProportionalRoPE
from .fused import fuse_in_place

#: Families with a C++ step (module name of the graph's family file).
SUPPORTED_FAMILIES = ("llama", "gemma2", "gemma3", "gemma4", "smollm3", "granite", "glm4", "phi3", "olmo2",
                      "qwen3_moe", "gpt_oss", "deepseek_v3")
#: Families the llama forward of the C++ step runs, with the switches their spec sets (NoPE layers: a RoPE
#: of no dims; granite's multipliers: embed_scale, attn_scale, residual_scale, logits_divisor; glm4's
#: sandwich norms under its own names, decode_norms, and its fused gate_up_proj; phi3's fused qkv_proj and
#: gate_up_proj, and its LongRoPE (a RopeSpec with long_freqs: each row's table picked by its call's end);
#: olmo2's post-norms and whole-projection q/k norms: pre_norms, qk_norm_whole; qwen3_moe's routed experts,
#: read from its SparseMoeBlock: num_experts, top_k_experts, norm_topk_prob; gpt_oss's attention sinks
#: (``layers.{i}.sinks``), biased experts and their clamped activation, the softmax over the chosen router
#: logits: activation, swiglu_limit, moe_softmax_topk).
LLAMA_FORWARD = ("llama", "smollm3", "granite", "glm4", "phi3", "olmo2", "qwen3_moe", "gpt_oss")
#: A routed-expert block's (router, experts) attributes: qwen3_moe's SparseMoeBlock, gpt_oss's MLPBlock.
MOE_BLOCKS = (("gate", "switch_mlp"), ("router", "experts"))
#: Families read as gemma blocks (``1 + w`` norms, sandwich norms, GELU-tanh, the embedding scale, the final
#: logit soft cap): gemma3, and gemma2 without q/k norms, its attention scores soft-capped (its
#: decode_switches: attn_softcap) and plain residual adds (gemma3's clip float16 sums).
GEMMA_FORWARD = ("gemma3", "gemma2")

#: KV scheme name -> the buffer dtype the C++ step takes.
KV_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}


class DecodeStepUnsupported(ValueError):
    """The graph (or its cache) has no compiled decode step; use the eager graph."""


@dataclass(frozen=True)
class DecodePolicy:
    """Per-generation choices of the compiled step.

    Attributes:
        max_capacity: most tokens a row may hold (0 = unbounded); a step past it
            fails and the generation continues eagerly.
        compile: trace the whole step once per (batch, the caches' buffer
            lengths) with ``mx.compile`` (attention over the whole buffer under
            a mask; a plain cache grows by 256 tokens, a retrace each time);
            off builds the graph in C++ every step and reads exact-length KV
            views (no mask) while all rows have one length.
        compile_min_batch: compile only from this batch size on; ``None``
            picks 2 on a GPU and 1 on the CPU. Measured on an H200 (random bf16
            weights, 512-token prompts): at batch 1 the per-step graph is as fast
            or faster (the masked attention of the compiled step cannot use the
            fused decode-attention kernel: llama-8b 0.76x mlx-lm compiled vs
            0.93-1.0x per-step), from batch 8 on the compiled step is faster
            (1.2-1.9x mlx-lm). The CPU has no fused attention kernel, so
            compiling pays there at every batch size.
        fuse_projections: run q|k|v and gate|up as one matmul each, the model's
            projections made views of the fused weights (``bindings/fused.py``: no
            second copy). ``None`` picks on for a GPU (one launch instead of three,
            the small k/v products no longer alone) and off for the CPU, whose
            kernels run each product on its own. Adapters do not change it: the
            fused product gets each targeted member's update added to its rows
            (``cpp/decode/lora.cpp``), so a model with an adapter bank (``mlx-infer
            serve``) decodes fused on a GPU too.
        tuned_products: run the dense bfloat16/float16 products (not quantized, not on the
            CPU kernels) through ``_fast.tuned_linear``: cuBLASLt with the fastest of its
            candidate algorithms, timed once per (rows, N, K, dtype), where MLX takes cuBLASLt's
            first heuristic (on an H200 that pick is up to 3x slower than torch's cuBLAS at 8-32
            rows: ``benchmarks/products.py``). One-row products stay on MLX's gemv. ``None``
            picks on where ``_fast.tuned_products_available()`` (a build with the CUDA toolkit,
            MLX's CUDA backend and ``-DMLX_INFER_CUBLAS=ON``, off by default: its first call
            crashed on the H200 in session 6, not yet localized) and the default device is the
            GPU; off elsewhere, where it would build ``mx.matmul`` anyway.
    """

    max_capacity: int = 0
    compile: bool = True
    compile_min_batch: int | None = None
    fuse_projections: bool | None = None
    tuned_products: bool | None = None

    def resolved_fuse_projections(self) -> bool:
        """``fuse_projections``, with ``None`` resolved for the default device."""
        if self.fuse_projections is not None:
            return self.fuse_projections
        return mx.default_device().type == mx.DeviceType.gpu

    def resolved_tuned_products(self) -> bool:
        """``tuned_products``, with ``None`` resolved for the default device and this build
        (``MLX_INFER_TUNED_PRODUCTS=0`` in the environment turns the default off: MLX's matmul)."""
        if self.tuned_products is not None:
            return self.tuned_products
        if os.environ.get("MLX_INFER_TUNED_PRODUCTS", "1") == "0":
            return False
        return mx.default_device().type == mx.DeviceType.gpu and _fast.tuned_products_available()

    def resolved_compile_min_batch(self) -> int:
        """``compile_min_batch``, with ``None`` resolved for the default device."""
        if self.compile_min_batch is not None:
            return self.compile_min_batch
        return 1 if mx.default_device().type == mx.DeviceType.cpu else 2


def family_of_graph(model: Any) -> str:
    """The graph's declared family where the C++ step has a forward for it (:data:`SUPPORTED_FAMILIES`);
    raises DecodeStepUnsupported otherwise."""
    family = graph_family(model)
    if family not in SUPPORTED_FAMILIES:
        raise DecodeStepUnsupported(f"no compiled decode step for the {family!r} graph family")
    return family


def _rope_spec(rope: nn.Module) -> Any:
    if isinstance(rope, NoPE):
        return _fast.RopeSpec(dims=0)  # the layer applies no RoPE
    if isinstance(rope, ProportionalRoPE):
        return _fast.RopeSpec(dims=rope.dims, traditional=False, freqs=rope._freqs)
    if isinstance(rope, Llama3RoPE):
        return _fast.RopeSpec(dims=rope.dims, traditional=rope.traditional, freqs=rope._freqs)
    if isinstance(rope, LongRoPE):  # freqs the short table; attention_factor scales the rotated dims first
        return _fast.RopeSpec(dims=rope.dims, traditional=False, freqs=rope._short_freqs,
                              long_freqs=rope._long_freqs, original=int(rope.original), mscale=float(rope.scale))
    if isinstance(rope, YarnRoPE):
        return _fast.RopeSpec(dims=rope.dims, traditional=rope.traditional, freqs=rope._freqs,
                              mscale=float(rope.mscale))
    if isinstance(rope, nn.RoPE):
        return _fast.RopeSpec(dims=rope.dims, traditional=rope.traditional, base=float(rope.base),
                              scale=float(rope.scale))
    raise DecodeStepUnsupported(f"no compiled decode step for rope module {type(rope).__name__}")


def _uses_cpu_kernels(module: nn.Module) -> bool:
    """True for mlx-infer's CPU-kernel layers (``mlx_infer.layers.linear``), whose products the step mirrors."""
    return type(module).__module__.endswith("layers.linear") and type(module).__name__.startswith("Fast")


def _add_linear(name: str, module: nn.Module, weights: dict, quant: dict, fast: list) -> None:
    if _uses_cpu_kernels(module):
        fast.append(name)
    weights[f"{name}.weight"] = module["weight"]
    if "bias" in module:
        weights[f"{name}.bias"] = module["bias"]
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        weights[f"{name}.scales"] = module["scales"]
        if module.get("biases") is not None:
            weights[f"{name}.biases"] = module["biases"]
        quant[name] = (int(module.group_size), int(module.bits), str(getattr(module, "mode", "affine")))
    elif not isinstance(module, (nn.Linear, nn.Embedding)):
        raise DecodeStepUnsupported(f"no compiled decode step for {name} of type {type(module).__name__}")


def graph_spec(model: Any, *, kv_scheme: str | None = None,
               policy: DecodePolicy = DecodePolicy()) -> tuple[Any, dict[str, mx.array], dict[str, tuple]]:
    """The C++ step's config, canonical weights and quantization for ``model``.

    Args:
        model: a graph of one of :data:`SUPPORTED_FAMILIES`.
        kv_scheme: ``"bf16"``, ``"f16"``, ``"f32"`` or ``None`` (the prefill's dtype).
        policy: capacity and compile choices.

    Raises:
        DecodeStepUnsupported: the family, a module type or the rope type has no C++ step.
    """
    family = family_of_graph(model)
    if getattr(model, "pipeline_parallel", None) is not None:
        raise DecodeStepUnsupported("no compiled decode step for a pipeline-parallel graph (its layers span ranks)")
    if kv_scheme is not None and kv_scheme not in KV_DTYPES:
        raise ValueError(f"kv_scheme must be one of {', '.join(KV_DTYPES)} or None, got {kv_scheme!r}.")
    materialize_graph_constants(model)  # the RoPE tables the specs hand over; the step may run on another thread
    if family == "gemma4":
        return _gemma4_spec(model, kv_scheme, policy)
    if family == "deepseek_v3":
        from .mla_spec import deepseek_v3_spec  # it builds on this module's helpers

        return deepseek_v3_spec(model, kv_scheme, policy)
    args = model.args
    inner = model.model
    gemma = family in GEMMA_FORWARD
    attn0 = inner.layers[0].self_attn
    cfg = _fast.DecodeConfig()
    cfg.family = "llama" if family in LLAMA_FORWARD else family
    cfg.num_layers = len(inner.layers)
    cfg.hidden_size = args.hidden_size
    cfg.num_heads = attn0.n_heads
    cfg.num_kv_heads = attn0.n_kv_heads
    cfg.head_dim = attn0.head_dim
    cfg.vocab_size = args.vocab_size
    cfg.rms_norm_eps = float(args.rms_norm_eps)
    cfg.attn_scale = float(attn0.scale)
    cfg.activation = "gelu_tanh" if gemma else "silu"
    cfg.embed_scale = float(inner.embed_scale) if gemma else 0.0
    cfg.clip_f16_residual = family == "gemma3"  # gemma3.residual_add
    cfg.final_logit_softcap = (float(args.final_logit_softcapping)
                               if gemma and args.final_logit_softcapping is not None else None)
    switches = getattr(model, "decode_switches", None)  # what the family's file says its forward adds
    for key, value in (switches() if switches is not None else {}).items():
        if not hasattr(cfg, key):
            raise DecodeStepUnsupported(f"no compiled decode step: {family}'s decode_switches names {key!r}, "
                                        "which the C++ step does not have")
        setattr(cfg, key, value)
    window = args.sliding_window
    cfg.windows = [int(window) if layer.use_sliding else 0 for layer in inner.layers]
    cfg.ropes = [_rope_spec(layer.self_attn.rope) for layer in inner.layers]
    _apply_policy(cfg, kv_scheme, policy)
    _apply_tensor_parallel(cfg, model)
    if cfg.qk_norm_whole and cfg.tp_backend:
        raise DecodeStepUnsupported("no compiled decode step for a tensor-parallel graph whose q/k norms span "
                                    "every head (olmo2): each rank holds some heads only")

    weights: dict[str, mx.array] = {}
    quant: dict[str, tuple] = {}
    fast: list[str] = []
    fuse = policy.resolved_fuse_projections()

    read: list[mx.array] = []  # parameters handed over transformed (not as themselves)

    def norm(name: str, module: nn.Module) -> None:
        weights[f"{name}.weight"] = (1.0 + module.weight) if gemma else module.weight
        read.append(module.weight)

    _add_linear("embed", inner.embed_tokens, weights, quant, fast)
    if not args.tie_word_embeddings:
        _add_linear("lm_head", model.lm_head, weights, quant, fast)
    norm("norm", inner.norm)
    for i, layer in enumerate(inner.layers):
        p = f"layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        _add_projections(p, attn, ("q_proj", "k_proj", "v_proj"), "qkv", ("q", "k", "v"), fuse, weights, quant,
                         fast, read)
        _add_linear(f"{p}.o", attn.o_proj, weights, quant, fast)
        moe = next(((r, e) for r, e in MOE_BLOCKS if r in mlp and e in mlp), None)
        if moe is not None:  # routed experts (qwen3_moe, gpt_oss): the router, then SwitchGLU
            _add_moe(p, mlp, moe, cfg, weights, quant, fast)
        else:
            _add_projections(p, mlp, ("gate_proj", "up_proj"), "gate_up", ("gate", "up"), fuse, weights, quant,
                             fast, read)
            _add_linear(f"{p}.down", mlp.down_proj, weights, quant, fast)
        for step_norm, attr in (getattr(layer, "decode_norms", None) or BLOCK_NORMS[gemma]).items():
            norm(f"{p}.{step_norm}", layer[attr])
        if "q_norm" in attn:  # per head (qwen3, gemma3) or over the whole projection (qk_norm_whole: olmo2)
            norm(f"{p}.q_norm", attn.q_norm)
            norm(f"{p}.k_norm", attn.k_norm)
        if "sinks" in attn:  # gpt_oss: one learned logit per head joins each softmax
            weights[f"{p}.sinks"] = attn.sinks
    _mirror_cpu_kernels(inner.layers, fast)
    cfg.cpu_kernel_linears = fast
    check_every_parameter_used(model, [*weights.values(), *read])
    mx.eval(list(weights.values()))
    return cfg, weights, quant


def has_fused_projections(weights: Any) -> bool:
    """Whether a spec's canonical ``weights`` (names) run some layer's q|k|v or gate|up as one product."""
    return any(k.endswith((".qkv.weight", ".gate_up.weight")) for k in weights)


def check_every_parameter_used(model: nn.Module, used: Sequence[mx.array]) -> None:
    """Refuse a graph with a parameter the step would not read (a translation gap, never silently skipped).

    ``used``: every array the spec hands to the step or derives a handed-over array from. The C++ side checks
    the converse (a handed-over name the step does not read is an error: cpp/decode/weights.cpp).

    Raises:
        DecodeStepUnsupported: naming the parameters the step would ignore.
    """
    ids = {id(a) for a in used}
    missed = [path for path, a in tree_flatten(model.parameters()) if id(a) not in ids]
    if missed:
        shown = ", ".join(missed[:8]) + (f", ... ({len(missed)} in all)" if len(missed) > 8 else "")
        raise DecodeStepUnsupported(f"no compiled decode step: it would not use the model's parameters {shown}")


def _mirror_cpu_kernels(layers: Sequence[nn.Module], fast: list[str]) -> None:
    """Attention and the gated activation on the CPU kernels too, as the swapped modules run them
    (layers.linear swaps every layer's modules alike: the last layer's classes say it)."""
    if layers and getattr(type(layers[-1].self_attn), "_mlx_infer_stock_class", None) is not None:
        fast.append("attention")
    if layers and getattr(type(layers[-1].mlp), "_mlx_infer_stock_class", None) is not None:
        fast.append("gated_activation")


def _apply_policy(cfg: Any, kv_scheme: str | None, policy: DecodePolicy) -> None:
    cfg.kv_dtype = KV_DTYPES[kv_scheme] if kv_scheme else ""
    cfg.max_capacity = policy.max_capacity
    cfg.compile = policy.compile
    cfg.compile_min_batch = policy.resolved_compile_min_batch()
    cfg.fuse_projections = False  # fused in place by graph_spec (bindings/fused.py), never copied in C++
    cfg.tuned_products = policy.resolved_tuned_products()


def _apply_tensor_parallel(cfg: Any, model: Any) -> None:
    """A sharded graph (:mod:`mlx_infer.parallel`): the step runs its collectives over the same group."""
    from ...parallel.layers import tensor_parallel_of

    tp = tensor_parallel_of(model)
    if tp is None:
        return
    cfg.tp_backend = tp.pg.backend
    cfg.vocab_parallel = tp.vocab_parallel
    cfg.vocab_start = tp.vocab_start
    cfg.per_layer_vocab_start = tp.per_layer_vocab_start
    cfg.expert_start = tp.expert_start


#: The step's norms of a block <- the block's attributes: pre-norm (llama) and sandwich (gemma3) blocks.
#: A family with other names declares ``decode_norms`` on its block class (models/glm4.py).
BLOCK_NORMS = {False: {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
               True: {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                      "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}}


def _add_projections(p: str, owner: nn.Module, names: tuple[str, ...], fused_name: str, shorts: tuple[str, ...],
                     fuse: bool, weights: dict, quant: dict, fast: list, read: list) -> None:
    """A block's q/k/v (or gate/up): one product already fused in the checkpoint (``qkv_proj``,
    ``gate_up_proj``: phi3, glm4), fused in place (``fuse``), or one product each."""
    own = f"{fused_name}_proj"
    if own in owner:
        _add_linear(f"{p}.{fused_name}", owner[own], weights, quant, fast)
        return
    fused = fuse_in_place(owner, names, fused_name) if fuse else None
    if fused is not None:
        _add_fused(f"{p}.{fused_name}", [owner[n] for n in names], fused, weights, quant, fast, read)
        return
    for short, n in zip(shorts, names):
        _add_linear(f"{p}.{short}", owner[n], weights, quant, fast)


def _add_fused(name: str, mods: list[nn.Module], fused: dict[str, mx.array], weights: dict, quant: dict,
               fast: list, read: list) -> None:
    """Linears fused in place (``fuse_in_place``) under one ``name``; their own parameters (views of
    ``fused``) count as used."""
    first = mods[0]
    if _uses_cpu_kernels(first):
        fast.append(name)
    for part, a in fused.items():
        weights[f"{name}.{part}"] = a
    if isinstance(first, nn.QuantizedLinear):
        quant[name] = (int(first.group_size), int(first.bits), str(getattr(first, "mode", "affine")))
    read.extend(v for m in mods for _, v in tree_flatten(m.parameters()))


def _add_moe(p: str, mlp: nn.Module, names: tuple[str, str], cfg: Any, weights: dict, quant: dict,
             fast: list) -> None:
    """A top-k routed gated expert block under ``p``; ``names``: its (router, SwitchGLU experts) attributes."""
    if cfg.tp_backend:
        raise DecodeStepUnsupported("no compiled decode step for routed experts in a tensor-parallel graph "
                                    "(the llama forward holds every expert)")
    router, experts = mlp[names[0]], mlp[names[1]]
    e, k = int(router.weight.shape[0]), int(mlp.top_k)
    if cfg.num_experts not in (0, e) or cfg.top_k_experts not in (0, k):
        raise DecodeStepUnsupported("no compiled decode step: its MoE layers route differently")
    cfg.num_experts, cfg.top_k_experts = e, k
    cfg.norm_topk_prob = bool(getattr(mlp, "norm_topk_prob", False))
    _add_linear(f"{p}.router", router, weights, quant, fast)
    for short in ("gate", "up", "down"):
        _add_experts(f"{p}.experts.{short}", experts[f"{short}_proj"], weights, quant)


def _add_experts(name: str, module: nn.Module, weights: dict, quant: dict) -> None:
    """A SwitchLinear ``(experts, out, in)``, or its quantized form, and its per-expert bias, under ``name``."""
    weights[f"{name}.weight"] = module["weight"]
    if "bias" in module:  # (experts, out): gpt_oss
        weights[f"{name}.bias"] = module["bias"]
    if isinstance(module, QuantizedSwitchLinear):
        if module.get("global_scale") is not None:
            raise DecodeStepUnsupported(f"no compiled decode step for {name}: experts with a global "
                                        f"scale ({module.mode}) are not built into the step")
        weights[f"{name}.scales"] = module["scales"]
        if module.get("biases") is not None:
            weights[f"{name}.biases"] = module["biases"]
        quant[name] = (int(module.group_size), int(module.bits), str(module.mode))
    elif not isinstance(module, SwitchLinear):
        raise DecodeStepUnsupported(f"no compiled decode step for {name} of type {type(module).__name__}")


def _gemma4_spec(model: Any, kv_scheme: str | None,
                 policy: DecodePolicy) -> tuple[Any, dict[str, mx.array], dict[str, tuple]]:
    """:func:`graph_spec` for a Gemma 4 text graph (names: ``cpp/decode/graph.h``)."""
    args, inner = model.args, model.model
    layers = inner.layers
    if any(t not in (FULL, SLIDING) for t in args.layer_types):
        raise DecodeStepUnsupported(f"no compiled decode step for gemma4 layer types {sorted(set(args.layer_types))}")
    cfg = _fast.DecodeConfig()
    cfg.family = "gemma4"
    cfg.num_layers = len(layers)
    cfg.hidden_size = args.hidden_size
    cfg.num_heads = layers[0].self_attn.n_heads
    cfg.num_kv_heads = layers[0].self_attn.n_kv_heads
    cfg.head_dim = layers[0].self_attn.head_dim
    cfg.vocab_size = args.vocab_size
    cfg.rms_norm_eps = float(args.rms_norm_eps)
    cfg.attn_scale = 1.0  # q/k norms do the scaling
    cfg.activation = "gelu_tanh"
    cfg.embed_scale = float(inner.embed_scale)
    cfg.clip_f16_residual = False
    cfg.final_logit_softcap = (float(args.final_logit_softcapping)
                               if args.final_logit_softcapping is not None else None)
    cfg.windows = [int(args.sliding_window) if layer.layer_type == SLIDING else 0 for layer in layers]
    cfg.ropes = [_rope_spec(layer.self_attn.rope) for layer in layers]
    cfg.layer_kv_heads = [layer.self_attn.n_kv_heads for layer in layers]
    cfg.layer_head_dims = [layer.self_attn.head_dim for layer in layers]
    cfg.kv_donors = [-1 if d is None else int(d) for d in args.kv_donors]
    cfg.v_from_k = [int(layer.self_attn.owns_kv and layer.self_attn.k_eq_v) for layer in layers]
    cfg.v_norm = True  # V RMS-normed without a weight
    cfg.per_layer_width = int(inner.per_layer_width or 0)
    cfg.layer_scalars = True
    if args.enable_moe_block:
        cfg.num_experts = int(args.num_experts)
        cfg.top_k_experts = int(args.top_k_experts)
        cfg.moe_beside_mlp = True  # the experts beside the dense MLP, with their own norms
    _apply_policy(cfg, kv_scheme, policy)
    _apply_tensor_parallel(cfg, model)
    cfg.fuse_projections = False  # the gemma4 forward runs each projection on its own

    weights: dict[str, mx.array] = {}
    quant: dict[str, tuple] = {}
    fast: list[str] = []

    def linear(name: str, module: nn.Module) -> None:
        _add_linear(name, module, weights, quant, fast)

    def norm(name: str, module: nn.Module) -> None:
        weights[f"{name}.weight"] = module.weight

    linear("embed", inner.embed_tokens)
    if not args.tie_word_embeddings:
        linear("lm_head", model.lm_head)
    norm("norm", inner.norm)
    if cfg.per_layer_width:
        linear("embed_per_layer", inner.embed_tokens_per_layer)
        linear("per_layer_proj", inner.per_layer_model_projection)
        norm("per_layer_proj_norm", inner.per_layer_projection_norm)
    for i, layer in enumerate(layers):
        p = f"layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        mods = [("q", attn.q_proj), ("o", attn.o_proj), ("gate", mlp.gate_proj), ("up", mlp.up_proj),
                ("down", mlp.down_proj)]
        if attn.owns_kv:
            mods.append(("k", attn.k_proj))
            if not attn.k_eq_v:
                mods.append(("v", attn.v_proj))
            norm(f"{p}.k_norm", attn.k_norm)
        for short, mod in mods:
            linear(f"{p}.{short}", mod)
        norm(f"{p}.q_norm", attn.q_norm)
        norm(f"{p}.attn_norm", layer.input_layernorm)
        norm(f"{p}.post_attn_norm", layer.post_attention_layernorm)
        norm(f"{p}.mlp_norm", layer.pre_feedforward_layernorm)
        norm(f"{p}.post_mlp_norm", layer.post_feedforward_layernorm)
        weights[f"{p}.layer_scalar"] = layer.layer_scalar
        if cfg.per_layer_width:
            linear(f"{p}.pli_gate", layer.per_layer_input_gate)
            linear(f"{p}.pli_proj", layer.per_layer_projection)
            norm(f"{p}.pli_norm", layer.post_per_layer_input_norm)
        if layer.enable_moe:
            linear(f"{p}.router", layer.router.proj)
            weights[f"{p}.router_scale"] = layer.router.scale
            weights[f"{p}.per_expert_scale"] = layer.router.per_expert_scale
            glu = layer.experts.switch_glu
            for short, mod in (("gate", glu.gate_proj), ("up", glu.up_proj), ("down", glu.down_proj)):
                _add_experts(f"{p}.experts.{short}", mod, weights, quant)
            norm(f"{p}.mlp_norm_2", layer.pre_feedforward_layernorm_2)
            norm(f"{p}.post_mlp_norm_1", layer.post_feedforward_layernorm_1)
            norm(f"{p}.post_mlp_norm_2", layer.post_feedforward_layernorm_2)
    _mirror_cpu_kernels(layers, fast)
    cfg.cpu_kernel_linears = fast
    check_every_parameter_used(model, list(weights.values()))
    mx.eval(list(weights.values()))
    return cfg, weights, quant
