"""The compiled C++ decode step for Gemma 4 (text) against the eager graph (tiny random configs, CPU).

Oracle: the same model driven eagerly with its plain caches (``model(y, cache)``),
itself checked against transformers and bit-identical to mlx-lm (tests/test_gemma4.py).
The configs are test_gemma4's (window 8; every one has full layers with their own
head dim and proportional partial RoPE, q/k/v norms, scale-1 attention, GeGLU,
scaled embeddings, layer scalars and soft-capped logits), with random weights and
norms / scalars / router scales moved off 1 so every one of them matters:

- ``dense``      untied head, k_eq_v off
- ``k_eq_v``     full layers: V = K's projection, 1 global KV head
- ``ple``        per-layer inputs
- ``kv_shared``  6 layers, the last 2 read their donors' buffers; double-wide MLP; per-layer inputs
- ``moe``        router top-2 of 4 experts beside the dense MLP (gather_mm); k_eq_v on

each in float32, ``-q4`` (4-bit affine, group 32: every linear, the embeddings and
the experts through gather_qmm) and, where MLX's CPU has the kernels, ``-bf16``
(MLX's CPU gather_mm is float32-only, so the unquantized MoE in bf16 is left out:
the eager graph cannot run it either). Prompt 12 tokens, then 32 steps: the sliding
window of 8 is exceeded before the first step.

Checks: greedy tokens equal for 32 steps and teacher-forced logits (a fixed random
token stream) within the tolerance below, the whole step compiled and built per
step; no retrace in steady state; KV buffers for KV-owning layers only; rows of
different lengths batched; the plain caches holding the KV and the eager graph continuing; the binding.
Measured max |compiled - eager| on logits (CPU, mlx 0.32.4, greedy and forced,
compiled and per-step graph alike; logits up to ~7 in magnitude): float32 dense
3.5e-6, k_eq_v 4.3e-6, moe 3.7e-5, ple 1.1e-4, kv_shared 1.8e-4; 4-bit dense 3.8e-6,
k_eq_v 6.0e-6, ple 5.6e-5, kv_shared 1.0e-4, moe 9.5e-5; bfloat16: 0.0 (bit-identical)
for all four. The per-layer-input configs differ most in float32 (rounding of
the fused CPU kernels; the same ops in bfloat16 agree bit for bit).

Refused (listed in ``REFUSED`` with the reason asserted): experts quantized with a
global scale (nvfp4 as mlx-lm writes it): the step does not pass ``global_scale``
to ``gather_qmm``, so the binding decodes such a graph eagerly.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map_with_path

from mlx_infer.generation.bindings.autoregressive import Composition, bind_autoregressive
from mlx_infer.generation.bindings.decode_step import CompiledDecodeStep
from mlx_infer.generation.bindings.graph_spec import DecodePolicy, DecodeStepUnsupported, graph_spec
from mlx_infer.models import get_model_classes
from mlx_infer.state.kv import KVCache, RotatingKVCache

from test_gemma4 import _BASE, CONFIGS as HF_CONFIGS, VOCAB, WINDOW

LOGITS_ATOL = 5e-4  # float32 and 4-bit weights (activations float32); measured <= 1.84e-4
BF16_LOGITS_ATOL = 0.1  # bfloat16 activations; measured 0.0
STEPS = 32
PROMPT = [5, 17, 33, 2, 100, 7, 9, 11, 40, 41, 42, 43]  # 12 tokens > the window of 8
assert len(PROMPT) > WINDOW

VARIANTS = {  # name -> (test_gemma4 config, dtype, quantization bits)
    **{name: (name, mx.float32, None) for name in HF_CONFIGS},
    **{f"{name}-q4": (name, mx.float32, 4) for name in HF_CONFIGS},
    **{f"{name}-bf16": (name, mx.bfloat16, None) for name in ("dense", "k_eq_v", "ple", "kv_shared")},
}

_MODELS: dict[str, object] = {}


def config_of(name: str) -> dict:
    """test_gemma4's config ``name`` as a gemma4_text config.json."""
    return {**_BASE, **HF_CONFIGS[name], "model_type": "gemma4_text"}


def tiny_gemma4(variant: str):
    """A random tiny Gemma 4 (cached per variant); norms, scalars and router scales moved off 1 by N(0, 1)."""
    if variant not in _MODELS:
        name, dtype, bits = VARIANTS[variant]
        model_cls, args_cls = get_model_classes("gemma4_text")
        mx.random.seed(2)  # with unit noise on the vectors, no config's greedy stream collapses
        model = model_cls(args_cls.from_dict(config_of(name)))
        model.update(tree_map_with_path(lambda _, w: w + mx.random.normal(w.shape) if w.ndim <= 1 else w,
                                        model.parameters()))
        if bits is not None:
            nn.quantize(model, group_size=32, bits=bits,
                        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0)
        if dtype != mx.float32:
            model.set_dtype(dtype)
        mx.eval(model.parameters())
        _MODELS[variant] = model
    return _MODELS[variant]


def atol_of(variant: str) -> float:
    return BF16_LOGITS_ATOL if VARIANTS[variant][1] == mx.bfloat16 else LOGITS_ATOL


def prefill(model, prompt: list[int]):
    cache = model.make_cache()
    tokens = mx.array([prompt], dtype=mx.uint32)
    model.model(tokens[:, :-1], cache=cache)
    return cache, tokens[0, -1:]


def eager_run(model, prompt=PROMPT, steps=STEPS, forced=None):
    cache, y = prefill(model, prompt)
    toks, logits = [], []
    for i in range(steps):
        out = model(y.reshape(1, 1), cache=cache)[:, -1, :]
        logits.append(out)
        nxt = mx.argmax(out, axis=-1)
        toks.append(nxt.item())
        y = forced[i:i + 1] if forced is not None else nxt
    return toks, logits


def compiled_run(model, prompt=PROMPT, steps=STEPS, forced=None, policy=DecodePolicy(), step=None):
    cache, y = prefill(model, prompt)
    step = step or CompiledDecodeStep(model, policy=policy)
    toks, logits = [], []
    for i in range(steps):
        out = step.step(y, cache)
        logits.append(out)
        nxt = mx.argmax(out, axis=-1)
        toks.append(nxt.item())
        y = forced[i:i + 1] if forced is not None else nxt
    return toks, logits, step


def max_diff(a: list[mx.array], b: list[mx.array]) -> float:
    return max(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max().item() for x, y in zip(a, b))


ON_CPU = mx.default_device().type == mx.DeviceType.cpu


def agreeing_steps(got: list[int], want: list[int], want_logits: list[mx.array], atol: float) -> int:
    """How many greedy steps to compare: all of them on the CPU, where the step must pick eager's tokens
    exactly (bfloat16 measured bit-identical there); on a GPU, where ``mx.compile`` fuses the elementwise
    chains into kernels of their own rounding, the streams may part only at a near tie: the step's pick
    scores within ``atol`` of eager's pick in eager's own logits. Returns the steps up to and including
    the first divergence (past it the two runs feed different tokens)."""
    if ON_CPU:
        assert got == want
        return len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            row = want_logits[i].reshape(-1).astype(mx.float32)
            gap = (row[w] - row[g]).item()
            assert gap <= atol, f"step {i}: picked {g} over eager's {w}, {gap} below it in eager's logits"
            return i + 1
    assert len(got) == len(want)
    return len(want)


def forced_stream() -> mx.array:
    """The fixed random token stream the teacher-forced runs feed, (STEPS,) uint32."""
    return mx.random.randint(3, VOCAB, (STEPS,), key=mx.random.key(7)).astype(mx.uint32)


def mlx_compile_drift(model) -> float:
    """Max |mx.compile(model)(t) - model(t)| over the logits of the prompt and the forced stream as one
    sequence: how far MLX's own compile of this model parts from its eager graph (0 on the CPU; on CUDA its
    fused elementwise kernels round bfloat16 chains their own way)."""
    seq = mx.concatenate([mx.array(PROMPT, mx.uint32), forced_stream()])[None]  # (1, 12 + STEPS)
    eager = model(seq)
    compiled = mx.compile(lambda t: model(t))(seq)
    return mx.abs(eager.astype(mx.float32) - compiled.astype(mx.float32)).max().item()


def compiled_atol(variant: str, model, compile_: bool) -> float:
    """The bound for the step against eager: ``atol_of`` everywhere, widened for ``mx.compile``'d bfloat16 on a
    GPU to twice MLX's own compile drift on the same model (benchmarks/compile_drift.py prints that drift beside
    the step's, per variant)."""
    atol = atol_of(variant)
    if compile_ and not ON_CPU and VARIANTS[variant][1] == mx.bfloat16:
        atol = max(atol, 2 * mlx_compile_drift(model))
    return atol


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("compile_", [True, False], ids=["compiled", "graph"])
def test_greedy_and_forced_logits_match_eager(variant, compile_):
    model = tiny_gemma4(variant)
    policy = DecodePolicy(compile=compile_, compile_min_batch=1)
    atol = compiled_atol(variant, model, compile_)
    want, want_logits = eager_run(model)
    got, got_logits, step = compiled_run(model, policy=policy)
    assert step.failures == 0, step.last_error
    n = agreeing_steps(got, want, want_logits, atol)
    assert len(set(want)) > 3, "the greedy stream should not collapse onto one token"
    diff = max_diff(got_logits[:n], want_logits[:n])
    assert diff <= atol, diff
    assert step.traces == (1 if compile_ else 0)

    forced = forced_stream()
    want_f, want_fl = eager_run(model, forced=forced)
    got_f, got_fl, step = compiled_run(model, forced=forced, policy=policy)
    assert step.failures == 0, step.last_error
    for i, (g, w) in enumerate(zip(got_f, want_f)):  # same inputs at every step: each pick on its own
        assert agreeing_steps([g], [w], want_fl[i:i + 1], atol) == 1, i
    diff = max_diff(got_fl, want_fl)
    assert diff <= atol, diff


@pytest.mark.parametrize("variant", ["kv_shared", "moe-q4"])
def test_no_retrace_in_steady_state(variant):
    model = tiny_gemma4(variant)
    cache, y = prefill(model, PROMPT)
    step = CompiledDecodeStep(model, policy=DecodePolicy(compile_min_batch=1))
    for _ in range(4):  # warm-up
        y = mx.argmax(step.step(y, cache), axis=-1)
    assert step.traces == 1
    for _ in range(32):
        y = mx.argmax(step.step(y, cache), axis=-1)
    mx.eval(y)
    assert step.traces == 1 and step.retraces == 0


def test_buffers_only_for_kv_owning_layers():
    """6 layers, the last 2 KV-shared: 4 buffer pairs, each with its layer's own geometry."""
    model = tiny_gemma4("kv_shared")
    cfg, _, _ = graph_spec(model)
    assert list(cfg.kv_donors) == [-1, -1, -1, -1, 3, 2]
    assert list(cfg.layer_head_dims) == [16, 16, 32, 16, 16, 32]
    cache, y = prefill(model, PROMPT)
    step = CompiledDecodeStep(model)
    for _ in range(3):
        y = mx.argmax(step.step(y, cache), axis=-1)
    assert step.failures == 0, step.last_error
    assert len(cache) == 4  # the step reads and writes one cache per KV-owning layer
    # sliding layers: a ring of WINDOW slots, 2 KV heads of 16; the full layer: 256 slots (one growth step) of 32
    assert [c.keys.shape for c in cache] == [(1, 2, WINDOW, 16), (1, 2, WINDOW, 16), (1, 2, 256, 32),
                                             (1, 2, WINDOW, 16)]
    assert all(c.offset == len(PROMPT) - 1 + 3 for c in cache)

    k_eq_v = tiny_gemma4("k_eq_v")
    cfg, weights, _ = graph_spec(k_eq_v)
    assert list(cfg.layer_kv_heads) == [2, 2, 1]
    assert "layers.2.k.weight" in weights and "layers.2.v.weight" not in weights


def test_batched_rows_of_different_lengths_match_each_alone():
    model = tiny_gemma4("kv_shared")
    prompts = [[(7 * i + 13 * r) % 250 + 5 for i in range(n)] for r, n in enumerate([3, 9, 12, 20])]
    rows, ys = [], []
    for p in prompts:
        cache, y = prefill(model, p)
        rows.append(cache)
        ys.append(y)
    y = mx.concatenate(ys)  # (4,)
    step = CompiledDecodeStep(model)
    got = [[] for _ in prompts]
    for _ in range(24):
        y = mx.argmax(step.step(y, rows), axis=-1)  # (4,)
        for r, t in enumerate(y.tolist()):
            got[r].append(t)
    assert step.failures == 0, step.last_error
    for r, p in enumerate(prompts):
        want, _ = eager_run(model, prompt=p, steps=24)
        assert got[r] == want, f"row {r} (prompt of {len(p)} tokens)"


@pytest.mark.parametrize("variant", ["kv_shared", "moe"])
def test_caches_hold_the_kv_and_eager_continues(variant):
    """No write-back: after compiled steps the plain caches hold every token and the eager graph continues."""
    model = tiny_gemma4(variant)
    want, _ = eager_run(model, steps=30)
    cache, y = prefill(model, PROMPT)
    step = CompiledDecodeStep(model)
    got = []
    for _ in range(20):
        y = mx.argmax(step.step(y, cache), axis=-1)
        got.append(y.item())
    assert all(c.offset == len(PROMPT) - 1 + 20 for c in cache)
    for _ in range(10):
        y = mx.argmax(model(y.reshape(1, 1), cache=cache)[:, -1, :], axis=-1)
        got.append(y.item())
    assert got == want


def test_binding_and_generation_loop_use_the_compiled_step():
    from mlx_infer.generation.autoregressive import generate_tokens

    model = tiny_gemma4("kv_shared")
    binding = bind_autoregressive(model)
    assert binding.declaration.compiled_decode
    assert binding.decode_unavailable_reason() is None
    decode = binding.create_decode()
    assert isinstance(decode, CompiledDecodeStep)
    native = decode.native  # the loop closes the step at the end; keep a handle to read its counters
    got = [t.token for t in generate_tokens(model, PROMPT, max_tokens=STEPS, decode=decode)]
    compiled_at_one_row = DecodePolicy().resolved_compile_min_batch() <= 1  # the CPU's default; a GPU's is 2
    assert decode.failures == 0 and native.traces == (1 if compiled_at_one_row else 0)
    want = [t.token for t in generate_tokens(model, PROMPT, max_tokens=STEPS)]
    assert got == want

    bf16 = bind_autoregressive(model, Composition(kv_scheme="bf16"))
    step = bf16.create_decode()
    cache, y = prefill(model, PROMPT)
    mx.eval(step.step(y, cache))
    assert all(c.keys.dtype == mx.bfloat16 for c in cache)  # the caches hold the scheme's dtype
    assert isinstance(cache[0], RotatingKVCache) and isinstance(cache[2], KVCache)


# -- refused configs -------------------------------------------------------------------------------


def _moe_experts_with_global_scale():
    """A 4-bit MoE graph whose experts carry a global scale, as mlx-lm writes nvfp4 experts."""
    model_cls, args_cls = get_model_classes("gemma4_text")
    model = model_cls(args_cls.from_dict(config_of("moe")))
    nn.quantize(model, group_size=32, bits=4,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0)
    for layer in model.layers:
        glu = layer.experts.switch_glu
        for m in (glu.gate_proj, glu.up_proj, glu.down_proj):
            m.global_scale = mx.ones((1,), mx.float32)
    return model


REFUSED = {  # name -> (build the graph, what the refusal says)
    "moe-experts-with-global-scale": (_moe_experts_with_global_scale, "global scale"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_configs_decode_eagerly_with_the_reason(name):
    make, reason = REFUSED[name]
    model = make()
    with pytest.raises(DecodeStepUnsupported, match=reason):
        graph_spec(model)
    binding = bind_autoregressive(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refusal is a stated reason, not a failure warning
        assert binding.create_decode() is None
    assert reason in binding.decode_unavailable_reason()


@pytest.mark.parametrize("variant", ["ple-bf16", "kv_shared-bf16"])
def test_mlx_compile_drift_is_the_gpu_bound(variant):
    """The drift that widens the compiled bfloat16 bound on a GPU: exactly 0 on the CPU (MLX's compile and
    eager graph agree bit for bit there, so the CPU keeps BF16_LOGITS_ATOL); on a GPU below half the largest
    |logit| (H100, MLX 0.32.4: ple-bf16 0.66 of |logits| up to 5.9, kv_shared-bf16 2.11 of 5.7 — these tiny
    random models amplify a fused kernel's rounding through every layer; the step's own graph op by op stays
    exactly on eager's, benchmarks/compile_drift.py)."""
    model = tiny_gemma4(variant)
    drift = mlx_compile_drift(model)
    seq = mx.concatenate([mx.array(PROMPT, mx.uint32), forced_stream()])[None]
    largest = mx.abs(model(seq).astype(mx.float32)).max().item()
    assert drift == 0.0 if ON_CPU else 0.0 <= drift < largest / 2, (drift, largest)
    assert compiled_atol(variant, model, False) == BF16_LOGITS_ATOL
    assert compiled_atol(variant, model, True) == (BF16_LOGITS_ATOL if ON_CPU else max(BF16_LOGITS_ATOL, 2 * drift))
