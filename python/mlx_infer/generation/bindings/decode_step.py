"""The compiled C++ decode step, wrapped for the generation loop.

:func:`graph_spec` reads a llama-, gemma3- or gemma4-family graph into what
``mlx_infer._fast.DecodeStep`` takes: a :class:`~mlx_infer._fast.DecodeConfig`,
the weights under canonical names (no copy: the same arrays the model holds)
and the quantization of each quantized linear.

:class:`CompiledDecodeStep` implements the ``DecodeStep`` contract
(``step(tokens, state) -> logits``, ``close()``). On its first call it takes
over the KV that the eager prefill wrote into the plain caches
(:mod:`mlx_infer.state.kv`); from then on the C++ step owns the KV and the
plain caches are left behind, until :meth:`CompiledDecodeStep.sync` (or a
failure) writes it back. A step that raises is reported once
(``warnings.warn``) and the rest of the generation runs on the eager graph from
the unchanged KV, so the tokens do not change.

Canonical weight names::

    embed.{weight,scales,biases}            norm.weight        lm_head.* (untied only)
    layers.{i}.{q,k,v,o,gate,up,down}.{weight,bias,scales,biases}
    layers.{i}.attn_norm.weight             llama input_layernorm / gemma input_layernorm
    layers.{i}.mlp_norm.weight              llama post_attention_layernorm / gemma pre_feedforward_layernorm
    layers.{i}.post_attn_norm.weight        gemma post_attention_layernorm
    layers.{i}.post_mlp_norm.weight         gemma post_feedforward_layernorm
    layers.{i}.{q_norm,k_norm}.weight       qwen3 / gemma per-head norms

Gemma's norms scale by ``1 + w``; the ``1 +`` is applied here, once.

Gemma 4 (:func:`_gemma4_spec`; its norms scale by ``w``) adds per-layer KV
geometry, KV sharing (``kv_donors``: shared layers own no buffer), per-layer
inputs and the MoE block; its extra canonical names are listed in
``cpp/decode/gemma4.h``. The step's buffers then exist for the KV-owning
layers only, in the order of ``model.make_cache()``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from ... import _fast
from ...adapters.bank import bank_of
from ...adapters.native import AdapterTargetUnsupported, NativeAdapters
from ...layers.rope import Llama3RoPE, YarnRoPE
from ...models import materialize_graph_constants
from ...layers.switch import QuantizedSwitchLinear, SwitchLinear
from ...models.gemma4 import FULL, SLIDING, ProportionalRoPE
from ...state.kv import KVCache, RotatingKVCache

#: Families with a C++ step (module name of the graph's family file).
SUPPORTED_FAMILIES = ("llama", "gemma3", "gemma4")

#: KV scheme name -> the buffer dtype the C++ step takes.
KV_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}


class DecodeStepUnsupported(ValueError):
    """The graph (or its cache) has no compiled decode step; use the eager graph."""


@dataclass(frozen=True)
class DecodePolicy:
    """Per-generation choices of the compiled step.

    Attributes:
        capacity_step: KV buffer growth in tokens (a retrace per growth).
        max_capacity: most tokens a row may hold (0 = unbounded); a step past it
            fails and the generation continues eagerly.
        compile: trace the whole step once per (batch, capacity) with
            ``mx.compile`` (attention over the whole buffer under a mask);
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
        fuse_projections: run q|k|v and gate|up as one matmul each (holds a
            fused copy of those weights: about 2/3 of a dense model's bytes).
    """

    capacity_step: int = 256
    max_capacity: int = 0
    compile: bool = True
    compile_min_batch: int | None = None
    fuse_projections: bool = False

    def resolved_compile_min_batch(self) -> int:
        """``compile_min_batch``, with ``None`` resolved for the default device."""
        if self.compile_min_batch is not None:
            return self.compile_min_batch
        return 1 if mx.default_device().type == mx.DeviceType.cpu else 2


def family_of_graph(model: Any) -> str:
    """``"llama"``, ``"gemma3"`` or ``"gemma4"`` from the graph's module; raises DecodeStepUnsupported otherwise."""
    family = type(model).__module__.rsplit(".", 1)[-1]
    if family not in SUPPORTED_FAMILIES:
        raise DecodeStepUnsupported(f"no compiled decode step for the {family!r} graph family")
    return family


def _rope_spec(rope: nn.Module) -> Any:
    if isinstance(rope, ProportionalRoPE):
        return _fast.RopeSpec(dims=rope.dims, traditional=False, freqs=rope._freqs)
    if isinstance(rope, Llama3RoPE):
        return _fast.RopeSpec(dims=rope.dims, traditional=rope.traditional, freqs=rope._freqs)
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
        model: a llama- or gemma3-family graph.
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
    args = model.args
    inner = model.model
    gemma = family == "gemma3"
    attn0 = inner.layers[0].self_attn
    cfg = _fast.DecodeConfig()
    cfg.family = family
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
    cfg.clip_f16_residual = gemma
    cfg.final_logit_softcap = (float(args.final_logit_softcapping)
                               if gemma and args.final_logit_softcapping is not None else None)
    window = args.sliding_window
    cfg.windows = [int(window) if layer.use_sliding else 0 for layer in inner.layers]
    cfg.ropes = [_rope_spec(layer.self_attn.rope) for layer in inner.layers]
    _apply_policy(cfg, kv_scheme, policy)
    _apply_tensor_parallel(cfg, model)

    weights: dict[str, mx.array] = {}
    quant: dict[str, tuple] = {}
    fast: list[str] = []

    def norm(name: str, module: nn.Module) -> None:
        weights[f"{name}.weight"] = (1.0 + module.weight) if gemma else module.weight

    _add_linear("embed", inner.embed_tokens, weights, quant, fast)
    if not args.tie_word_embeddings:
        _add_linear("lm_head", model.lm_head, weights, quant, fast)
    norm("norm", inner.norm)
    for i, layer in enumerate(inner.layers):
        p = f"layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        for short, mod in (("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("o", attn.o_proj),
                           ("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj)):
            _add_linear(f"{p}.{short}", mod, weights, quant, fast)
        norm(f"{p}.attn_norm", layer.input_layernorm)
        if gemma:
            norm(f"{p}.post_attn_norm", layer.post_attention_layernorm)
            norm(f"{p}.mlp_norm", layer.pre_feedforward_layernorm)
            norm(f"{p}.post_mlp_norm", layer.post_feedforward_layernorm)
        else:
            norm(f"{p}.mlp_norm", layer.post_attention_layernorm)
        if gemma or getattr(attn, "qk_norm", False):
            norm(f"{p}.q_norm", attn.q_norm)
            norm(f"{p}.k_norm", attn.k_norm)
    _mirror_cpu_kernels(inner.layers, fast)
    cfg.cpu_kernel_linears = fast
    mx.eval(list(weights.values()))
    return cfg, weights, quant


def _mirror_cpu_kernels(layers: Sequence[nn.Module], fast: list[str]) -> None:
    """Attention and the gated activation on the CPU kernels too, as the swapped modules run them
    (layers.linear swaps every layer's modules alike: the last layer's classes say it)."""
    if layers and getattr(type(layers[-1].self_attn), "_mlx_infer_stock_class", None) is not None:
        fast.append("attention")
    if layers and getattr(type(layers[-1].mlp), "_mlx_infer_stock_class", None) is not None:
        fast.append("gated_activation")


def _apply_policy(cfg: Any, kv_scheme: str | None, policy: DecodePolicy) -> None:
    cfg.kv_dtype = KV_DTYPES[kv_scheme] if kv_scheme else ""
    cfg.capacity_step = policy.capacity_step
    cfg.max_capacity = policy.max_capacity
    cfg.compile = policy.compile
    cfg.compile_min_batch = policy.resolved_compile_min_batch()
    cfg.fuse_projections = policy.fuse_projections


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


def _add_experts(name: str, module: nn.Module, weights: dict, quant: dict) -> None:
    """A SwitchLinear ``(experts, out, in)``, or its quantized form, under ``name``."""
    weights[f"{name}.weight"] = module["weight"]
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
    """:func:`graph_spec` for a Gemma 4 text graph (names: ``cpp/decode/gemma4.h``)."""
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
    cfg.per_layer_width = int(inner.per_layer_width or 0)
    if args.enable_moe_block:
        cfg.num_experts = int(args.num_experts)
        cfg.top_k_experts = int(args.top_k_experts)
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
    mx.eval(list(weights.values()))
    return cfg, weights, quant


def kv_layers(cfg: Any) -> list[int]:
    """The layers that own a KV buffer (all but gemma4's KV-shared ones), as the plain cache list orders them."""
    donors = list(cfg.kv_donors)
    return [i for i in range(cfg.num_layers) if not donors or donors[i] == -1]


# -- plain caches <-> the step's buffers ----------------------------------------------------------


def _temporal(cache: Any) -> tuple[mx.array, mx.array] | None:
    """A plain cache's kept tokens, oldest first ``(B, KVH, n, D)``, ending at ``offset - 1``."""
    if isinstance(cache, KVCache):
        return cache.state or None
    if isinstance(cache, RotatingKVCache):
        state = cache.state
        if not state:
            return None
        _, offset, idx = map(int, cache.meta_state)
        out = []
        for v in state:
            n = v.shape[2]
            if idx == n:
                out.append(v)
            elif idx < offset:  # wrapped: the oldest token sits at idx
                out.append(mx.concatenate([v[..., idx:, :], v[..., :idx, :]], axis=2))
            else:
                out.append(v[..., :idx, :])
        return out[0], out[1]
    raise DecodeStepUnsupported(f"the compiled step cannot take over a {type(cache).__name__}")


def _row_width(caches: Sequence[Any]) -> int:
    """Rows held by one cache list (1 while it is empty)."""
    for c in caches:
        state = c.state
        if state:
            return state[0].shape[0]
    return 1


def _is_rows(state: Sequence[Any]) -> bool:
    """True when ``state`` is one cache list per row rather than one batched cache list."""
    return len(state) > 0 and isinstance(state[0], (list, tuple))


def prefix_arrays(rows: list[list[Any]], n_kv_heads: int | Sequence[int], head_dim: int | Sequence[int],
                  dtype: mx.Dtype) -> tuple[list[mx.array], list[mx.array], list[int]]:
    """Right-aligned per-layer K/V over the rows' caches, and each row's length.

    ``rows[r]`` is a cache list whose caches all hold the same number of rows
    (usually one); rows of different lengths are left-padded with zeros.
    ``n_kv_heads`` / ``head_dim``: one for every cache, or one per cache.
    """
    n = len(rows[0])
    heads = [n_kv_heads] * n if isinstance(n_kv_heads, int) else list(n_kv_heads)
    dims = [head_dim] * n if isinstance(head_dim, int) else list(head_dim)
    lengths: list[int] = []
    for caches in rows:
        offsets = {c.offset for c in caches}
        if len(offsets) != 1:
            raise DecodeStepUnsupported(f"a row's caches disagree on their offset: {sorted(offsets)}")
        lengths += [offsets.pop()] * _row_width(caches)
    keys, values = [], []
    for layer in range(len(rows[0])):
        parts = [_temporal(caches[layer]) for caches in rows]
        S = max((p[0].shape[2] for p in parts if p is not None), default=0)
        ks, vs = [], []
        for caches, p in zip(rows, parts):
            if p is None:
                empty = mx.zeros((_row_width(caches), heads[layer], S, dims[layer]), dtype)
                ks.append(empty)
                vs.append(empty)
                continue
            k, v = p
            pad = S - k.shape[2]
            if pad:
                k = mx.concatenate([mx.zeros((*k.shape[:2], pad, k.shape[3]), k.dtype), k], axis=2)
                v = mx.concatenate([mx.zeros((*v.shape[:2], pad, v.shape[3]), v.dtype), v], axis=2)
            ks.append(k)
            vs.append(v)
        keys.append(mx.concatenate(ks, axis=0) if len(ks) > 1 else ks[0])
        values.append(mx.concatenate(vs, axis=0) if len(vs) > 1 else vs[0])
    return keys, values, lengths


def write_back(step: Any, rows: list[list[Any]], windows: list[int]) -> None:
    """Writes the step's KV into the plain caches so the eager graph can continue."""
    lengths = step.lengths
    kv = step.kv_state()
    r0 = 0
    for caches in rows:
        width = _row_width(caches)
        n = lengths[r0]
        if any(lengths[r] != n for r in range(r0, r0 + width)):
            raise DecodeStepUnsupported("rows sharing one cache list hold different lengths")
        for layer, cache in enumerate(caches):
            k, v = (a[r0:r0 + width] for a in kv[layer])
            slots = k.shape[2]
            if windows[layer] == 0:
                cache.state = (k[..., :n, :], v[..., :n, :])
            else:
                if n <= slots:  # not wrapped: positions 0..n-1 in slots 0..n-1
                    state, idx = (k[..., :n, :], v[..., :n, :]), n
                else:
                    state, idx = (k, v), n % slots
                cache.meta_state = tuple(map(str, (windows[layer], n, idx)))
                cache.state = state
        r0 += width


# -- the contract's DecodeStep ---------------------------------------------------------------------


class CompiledDecodeStep:
    """``step(tokens, state) -> logits`` over the C++ step, with an eager fallback.

    ``state`` is the graph's cache list (``model.make_cache()``) after the
    eager prefill, every row of the batch at the same offset, or one cache
    list per row (rows of different lengths; each prefilled alone). The first
    call (and any call with another state, or after the caches changed) takes
    the KV over; later calls leave the plain caches untouched.
    """

    def __init__(self, model: Any, *, kv_scheme: str | None = None,
                 policy: DecodePolicy = DecodePolicy()):
        bank = bank_of(model)
        if bank is not None:
            policy = replace(policy, fuse_projections=False)  # a fused q|k|v takes no adapter
        cfg, weights, quant = graph_spec(model, kv_scheme=kv_scheme, policy=policy)
        self._model = model
        self._cfg = cfg
        owners = kv_layers(cfg)  # one buffer (and one plain cache) per KV-owning layer
        self._windows = [cfg.windows[i] for i in owners]
        self._kv_heads = [cfg.layer_kv_heads[i] if cfg.layer_kv_heads else cfg.num_kv_heads for i in owners]
        self._head_dims = [cfg.layer_head_dims[i] if cfg.layer_head_dims else cfg.head_dim for i in owners]
        self._step: Any = _fast.DecodeStep(cfg, weights, quant)
        # The bank's stacks are inputs of the step (adapters/native.py); rows pick slots per step.
        self._adapters = NativeAdapters(model, weights)
        try:
            self._adapters.refresh(self._step)
        except AdapterTargetUnsupported as exc:
            raise DecodeStepUnsupported(str(exc)) from None
        self._bound: Any = None
        self._bound_offsets: list[int] | None = None
        self._rows: list[list[Any]] = []
        self.failures = 0
        self.last_error: BaseException | None = None

    # -- properties ------------------------------------------------------------------

    @property
    def failed(self) -> bool:
        """True once a step failed; every later step runs on the eager graph."""
        return self.last_error is not None

    @property
    def traces(self) -> int:
        """Times the C++ step was traced (one per (batch, capacity) seen)."""
        return self._step.traces if self._step is not None else 0

    @property
    def retraces(self) -> int:
        """Traces after the first."""
        return max(0, self.traces - 1)

    @property
    def lengths(self) -> list[int]:
        """Tokens the step holds per row."""
        return list(self._step.lengths) if self._step is not None else []

    @property
    def native(self) -> Any:
        """The ``mlx_infer._fast.DecodeStep``."""
        return self._step

    # -- the contract -----------------------------------------------------------------

    def step(self, tokens: mx.array, state: Sequence[Any]) -> mx.array:
        """Logits ``(B, vocab)`` for one new token per row.

        Args:
            tokens: ``(B,)`` (or ``(B, 1)``) token ids.
            state: the cache list, or one cache list per row (see the class doc).
        """
        if self.failed or self._step is None:
            return self._eager(tokens, state)
        try:
            if state is not self._bound or self._offsets(state) != self._bound_offsets:
                self._take_over(state)
            self._adapters.refresh(self._step)
            slots = self._adapters.slots(self._step.batch_size)
            return self._step.step(tokens) if slots is None else self._step.step(tokens, slots)
        except Exception as exc:  # noqa: BLE001 - any failure falls back, reported once
            return self._fail(exc, tokens, state)

    __call__ = step

    def sync(self) -> None:
        """Writes the step's KV back into the bound plain caches (their offsets then match)."""
        if self._bound is not None and self._step is not None and self._step.loaded:
            write_back(self._step, self._rows, self._windows)
            self._bound_offsets = self._offsets(self._bound)

    def close(self) -> None:
        """Releases the KV buffers and the compiled graph (the plain caches stay as they are)."""
        if self._step is not None:
            self._step.reset()
        self._step = None
        self._bound = None
        self._rows = []

    def __enter__(self) -> "CompiledDecodeStep":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _offsets(self, state: Sequence[Any]) -> list[int]:
        # One cache per row list: the layers of a list move together, so the
        # first one tells whether anything wrote to the caches behind our back.
        rows = state if _is_rows(state) else [state]
        return [caches[0].offset for caches in rows if len(caches)]

    def _take_over(self, state: Sequence[Any]) -> None:
        rows = [list(r) for r in state] if _is_rows(state) else [list(state)]
        dtype = self._model.model.embed_tokens.weight.dtype
        if isinstance(self._model.model.embed_tokens, nn.QuantizedEmbedding):
            dtype = self._model.model.embed_tokens.scales.dtype
        keys, values, lengths = prefix_arrays(rows, self._kv_heads, self._head_dims, dtype)
        self._step.load_prefix(keys, values, lengths)
        self._rows = rows
        self._bound = state
        self._bound_offsets = self._offsets(state)

    def _fail(self, exc: BaseException, tokens: mx.array, state: Sequence[Any]) -> mx.array:
        self.failures += 1
        self.last_error = exc
        warnings.warn(f"compiled decode step failed ({type(exc).__name__}: {exc}); "
                      "continuing this generation on the eager graph", RuntimeWarning, stacklevel=3)
        if state is self._bound and self._step is not None and self._step.loaded:
            write_back(self._step, self._rows, self._windows)  # the KV as of before the failed step
        if self._step is not None:
            self._step.reset()
        return self._eager(tokens, state)

    def _eager(self, tokens: mx.array, state: Sequence[Any]) -> mx.array:
        tokens = tokens.reshape(-1, 1)  # (B, 1)
        if not _is_rows(state):
            return self._model(tokens, cache=list(state))[:, -1, :]  # (B, vocab)
        out, r = [], 0
        for caches in state:
            width = _row_width(caches)
            out.append(self._model(tokens[r:r + width], cache=list(caches))[:, -1, :])
            r += width
        return mx.concatenate(out, axis=0)
