"""The compiled C++ decode step against the eager graph (tiny random configs, CPU).

Oracle: the same model driven eagerly with its plain caches (``model(y, cache)``).
Checks, per configuration:

- greedy tokens equal for 64 steps after a 12-token prompt (past the sliding
  window of 8 on gemma3);
- teacher-forced logits (a fixed random token stream, 64 steps) within
  ``LOGITS_ATOL`` of the eager graph's, and the same argmax at every step.

The step runs each linear on the kernels the model's layer uses (MLX's, or
mlx-infer's CPU kernels where the loader swapped them in). Measured max
|compiled - eager| on logits (CPU, mlx 0.32.4, greedy and forced, compiled and
graph modes), logits up to ~10 in magnitude: llama, qwen2 (bias), qwen3 (q/k
norm), llama3 rope, 4-bit and 8-bit llama: 0.0 (bit-identical); gemma3 and
4-bit gemma3: <= 6e-6; mistral with a sliding window of 8 (its ring is read
in another order): <= 1.05e-5; bfloat16 llama: 0.0. On an H200 (CUDA)
the same tests pass with the same tolerances.
The real Gemma 3 270M (float32, slow test): see ``REAL_LOGITS_ATOL``.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map_with_path

from mlx_infer.artifacts.loader import load_model
from mlx_infer.contracts import GraphDescriptor
from mlx_infer.errors import MlxInferError
from mlx_infer.generation.bindings.autoregressive import (AutoregressiveBinding, Composition,
                                                          assert_binding, bind_autoregressive)
from mlx_infer.generation.bindings.decode_step import CompiledDecodeStep
from mlx_infer.generation.bindings.graph_spec import DecodePolicy, graph_spec
from mlx_infer.state.kv import KVCache, RotatingKVCache

from tiny import make_tiny_model_dir

try:  # mlx-infer's CPU matmul kernels: the loader swaps them in on the CPU; the step mirrors them
    from mlx_infer.layers.linear import swap_in_cpu_kernels
except ImportError:
    swap_in_cpu_kernels = None

LOGITS_ATOL = 1e-4  # float32 and quantized tiny models; measured <= 1.05e-5
BF16_LOGITS_ATOL = 0.1  # bfloat16; measured 0.0 on CPU
REAL_LOGITS_ATOL = 1e-3  # real Gemma 3 270M float32 (262k vocab, 18 layers); measured 0.0 on CPU
STEPS = 64
PROMPT = [5, 17, 33, 2, 100, 7, 9, 11, 40, 41, 42, 43]  # 12 tokens > gemma3's window of 8

CONFIGS = {
    "llama": ("llama", {}, None),
    "qwen2-bias": ("llama", {"model_type": "qwen2"}, None),
    "qwen3-qknorm": ("llama", {"model_type": "qwen3", "head_dim": 32}, None),
    "mistral-window": ("llama", {"model_type": "mistral", "sliding_window": 8}, None),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64}}, None),
    "gemma3": ("gemma3", {}, None),
    "llama-q4": ("llama", {}, 4),
    "llama-q8": ("llama", {}, 8),
    "gemma3-q4": ("gemma3", {}, 4),
}

_MODELS: dict[str, object] = {}


def _mlx_compiles() -> bool:
    """Whether ``mx.compile`` really compiles in this process (probed, not guessed).

    MLX decides when ``compile`` is called (``skip_compile()`` in mlx/compile.cpp): if
    compilation is disabled (``MLX_DISABLE_COMPILE``) or the device can't JIT, it returns the
    function itself. On the CPU backend "can JIT" is ``JitCompiler::available()``: MLX runs
    ``g++ --version`` through the shell once per process and compiles only if that succeeds
    (mlx/backend/cpu/jit_compiler.cpp). Without it, nothing is ever traced: every call runs
    the function on real arrays (same results, no fusion) and the C++ step's trace counter
    stays 0 -- which is what a wheel user without a compiler gets. A Python function shows
    which case holds: compiled, its body runs only while traced; uncompiled, on every call.
    Two warm-up calls first: the first function compiled in a fresh process can trace twice
    (measured, mlx 0.32.4: the cache entry's default stream is only settled by then).
    """
    calls: list[None] = []

    def probe(x: mx.array) -> mx.array:
        calls.append(None)
        return x + 1

    fn = mx.compile(probe)
    x = mx.array(1.0)
    for _ in range(2):  # warm-up: traces where MLX compiles
        mx.eval(fn(x))
    calls.clear()
    for _ in range(3):  # same shape and dtype: no trace if compiled, a run per call if not
        mx.eval(fn(x))
    assert len(calls) in (0, 3), calls
    return not calls


MLX_COMPILES = _mlx_compiles()
TRACED = 1 if MLX_COMPILES else 0  # traces of a compiled step for one (batch, capacity)


def tiny_model(name: str):
    """A tiny random model (cached per name): gemma3 gets random norms so its tokens vary."""
    if name not in _MODELS:
        family, overrides, bits = CONFIGS[name]
        path = make_tiny_model_dir(Path(tempfile.mkdtemp()) / name, family, **overrides)
        model = load_model(path).model
        if family == "gemma3":
            mx.random.seed(1)
            model.update(tree_map_with_path(
                lambda p, w: mx.random.normal(w.shape) * 0.5 if "norm" in p else w, model.parameters()))
        if bits is not None:
            nn.quantize(model, group_size=32, bits=bits)
        mx.eval(model.parameters())
        _MODELS[name] = model
    return _MODELS[name]


def prefill(model, prompt: list[int]):
    cache = model.make_cache()
    tokens = mx.array([prompt], dtype=mx.uint32)
    if len(prompt) > 1:
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


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("compile_", [True, False], ids=["compiled", "graph"])
def test_greedy_and_forced_logits_match_eager(name, compile_):
    model = tiny_model(name)
    policy = DecodePolicy(compile=compile_, compile_min_batch=1)
    want, want_logits = eager_run(model)
    got, got_logits, step = compiled_run(model, policy=policy)
    assert got == want
    assert max_diff(got_logits, want_logits) <= LOGITS_ATOL
    assert step.failures == 0

    forced = mx.random.randint(3, 300, (STEPS,), key=mx.random.key(7)).astype(mx.uint32)
    want_f, want_fl = eager_run(model, forced=forced)
    got_f, got_fl, _ = compiled_run(model, forced=forced, policy=policy)
    assert got_f == want_f
    assert max_diff(got_fl, want_fl) <= LOGITS_ATOL


@pytest.mark.parametrize("name", ["qwen2-bias", "gemma3", "llama-q4"])
@pytest.mark.parametrize("compile_", [True, False], ids=["compiled", "graph"])
def test_fused_projections_match_eager(name, compile_):
    model = tiny_model(name)
    want, want_logits = eager_run(model, steps=32)
    got, got_logits, _ = compiled_run(model, steps=32, policy=DecodePolicy(
        compile=compile_, compile_min_batch=1, fuse_projections=True))
    assert got == want
    assert max_diff(got_logits, want_logits) <= LOGITS_ATOL


def test_bfloat16_matches_eager():
    path = make_tiny_model_dir(Path(tempfile.mkdtemp()) / "bf16", "llama", dtype=mx.bfloat16)
    model = load_model(path).model
    want, want_logits = eager_run(model)
    got, got_logits, _ = compiled_run(model)
    assert got == want
    assert max_diff(got_logits, want_logits) <= BF16_LOGITS_ATOL


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_no_retrace_in_steady_state(name):
    model = tiny_model(name)
    cache, y = prefill(model, PROMPT)
    step = CompiledDecodeStep(model, policy=DecodePolicy(compile_min_batch=1))
    for _ in range(4):  # warm-up
        y = mx.argmax(step.step(y, cache), axis=-1)
    before = step.traces
    assert before == TRACED
    for _ in range(32):
        y = mx.argmax(step.step(y, cache), axis=-1)
    mx.eval(y)
    assert step.traces - before == 0
    assert step.retraces == 0


def test_mlx_compiles_exactly_where_its_jit_compiler_runs():
    """The probe agrees with MLX's rule, and the C++ step's trace counter follows the probe."""
    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("MLX's g++ rule is its CPU backend's; this run's default device is a GPU")
    gxx = subprocess.run("g++ --version", shell=True, capture_output=True).returncode == 0
    assert MLX_COMPILES == (gxx and "MLX_DISABLE_COMPILE" not in os.environ)
    model = tiny_model("llama")
    _, _, step = compiled_run(model, steps=3, policy=DecodePolicy(compile=True, compile_min_batch=1))
    assert step.failures == 0
    assert step.traces == TRACED


def test_compile_min_batch_picks_the_path_per_batch_size():
    model = tiny_model("llama")
    policy = DecodePolicy(compile_min_batch=2)  # the GPU default
    _, _, single = compiled_run(model, steps=4, policy=policy)
    assert single.traces == 0  # batch 1: the per-step graph (unmasked exact-length attention)
    cache = model.make_cache()
    tokens = mx.array([PROMPT, PROMPT[::-1]], dtype=mx.uint32)
    model.model(tokens[:, :-1], cache=cache)
    pair = CompiledDecodeStep(model, policy=policy)
    mx.eval(pair.step(tokens[:, -1], cache))
    assert pair.traces == TRACED
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    assert DecodePolicy().resolved_compile_min_batch() == (1 if on_cpu else 2)


def test_cache_growth_retraces_once_per_growth_and_keeps_tokens():
    """The caches grow by their own rules (here steps of 16): each growth is a new buffer shape, one trace."""
    model = tiny_model("gemma3")

    def run(step):
        cache = model.make_cache()
        for c in cache:
            c.step = 16
        tokens = mx.array([PROMPT], dtype=mx.uint32)
        model.model(tokens[:, :-1], cache=cache)
        y, got = tokens[0, -1:], []
        for _ in range(STEPS):
            out = step.step(y, cache) if step else model(y.reshape(1, 1), cache=cache)[:, -1, :]
            y = mx.argmax(out, axis=-1)
            got.append(y.item())
        return got, cache

    want, eager_cache = run(None)
    step = CompiledDecodeStep(model, policy=DecodePolicy(compile_min_batch=1))
    got, cache = run(step)
    assert got == want
    # a global layer's buffer: 16 at the prefill (11 tokens), then 32, 48, 64, 80 as it reaches 75 tokens;
    # a trace per length where MLX compiles, none where it runs the step uncompiled
    assert [c.keys.shape[2] for c in cache] == [c.keys.shape[2] for c in eager_cache]
    assert max(c.keys.shape[2] for c in cache) == 80
    assert step.traces == 5 * TRACED


def _prompts(n_rows: int) -> list[list[int]]:
    lengths = [3, 9, 12, 20][:n_rows]
    return [[(7 * i + 13 * r) % 290 + 5 for i in range(n)] for r, n in enumerate(lengths)]


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3-qknorm"])
@pytest.mark.parametrize("compile_", [True, False], ids=["compiled", "graph"])
def test_batched_rows_of_different_lengths_match_each_alone(name, compile_):
    model = tiny_model(name)
    prompts = _prompts(4)
    rows, ys = [], []
    for p in prompts:
        cache, y = prefill(model, p)
        rows.append(cache)
        ys.append(y)
    y = mx.concatenate(ys)  # (4,)
    step = CompiledDecodeStep(model, policy=DecodePolicy(compile=compile_))
    got = [[] for _ in prompts]
    for _ in range(40):
        y = mx.argmax(step.step(y, rows), axis=-1)  # (4,)
        for r, t in enumerate(y.tolist()):
            got[r].append(t)
    assert step.failures == 0
    assert step.traces == (TRACED if compile_ else 0)
    assert [{c.offset for c in caches} for caches in rows] == [{len(p) - 1 + 40} for p in prompts]
    for r, p in enumerate(prompts):
        want, _ = eager_run(model, prompt=p, steps=40)
        assert got[r] == want, f"row {r} (prompt of {len(p)} tokens)"
        alone, y = prefill(model, p)  # the row's caches keep its own layout (stacked and split back)
        for t in [y.item()] + want[:39]:
            model(mx.array([[t]], dtype=mx.uint32), cache=alone)
        assert _layout(rows[r]) == _layout(alone), f"row {r}"


def test_batched_cache_of_equal_rows():
    model = tiny_model("gemma3")
    prompts = [[(5 * i + 11 * r) % 290 + 5 for i in range(10)] for r in range(3)]
    cache = model.make_cache()
    tokens = mx.array(prompts, dtype=mx.uint32)
    model.model(tokens[:, :-1], cache=cache)
    step = CompiledDecodeStep(model)
    y = tokens[:, -1]
    got = []
    for _ in range(24):
        y = mx.argmax(step.step(y, cache), axis=-1)
        got.append(y.tolist())
    for r, p in enumerate(prompts):
        want, _ = eager_run(model, prompt=p, steps=24)
        assert [g[r] for g in got] == want


def _layout(cache) -> list[tuple]:
    """Each cache's bookkeeping and buffer shapes: what mlx-lm's layout rules decide."""
    return [(type(c).__name__, c.offset, c.meta_state, c.keys.shape, c.values.shape) for c in cache]


@pytest.mark.parametrize("name", ["llama", "gemma3", "mistral-window", "llama-q4"])
@pytest.mark.parametrize("compile_", [True, False], ids=["compiled", "graph"])
def test_caches_hold_the_eager_kv_after_compiled_steps(name, compile_):
    """The plain caches own the KV: after compiled steps (no sync, no close) they hold what the eager
    steps write, in mlx-lm's layout, and the eager graph continues from them with the same tokens."""
    model = tiny_model(name)
    want, _ = eager_run(model, steps=30)
    eager_cache, y = prefill(model, PROMPT)
    for t in [y.item()] + want[:19]:
        model(mx.array([[t]], dtype=mx.uint32), cache=eager_cache)
    cache, y = prefill(model, PROMPT)
    step = CompiledDecodeStep(model, policy=DecodePolicy(compile=compile_, compile_min_batch=1))
    got = []
    for _ in range(20):
        y = mx.argmax(step.step(y, cache), axis=-1)
        got.append(y.item())
    assert got == want[:20] and step.failures == 0
    assert _layout(cache) == _layout(eager_cache)
    # Whole buffers: the written tokens and the unwritten zeros. Built op by op the step computes K/V
    # bit-identically on the CPU; compiled, mx.compile's fusions round differently (measured <= 4.3e-6). On
    # CUDA the batched step's kernels are not the eager graph's for every shape (H200: gemma3 op by op 2.4e-7).
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    atol = 1e-5 if compile_ else (1e-6 if on_gpu else 0.0)
    for layer, (c, e) in enumerate(zip(cache, eager_cache)):
        for got_kv, want_kv in ((c.keys, e.keys), (c.values, e.values)):
            diff = mx.abs(got_kv.astype(mx.float32) - want_kv.astype(mx.float32)).max().item()
            assert diff <= atol, f"layer {layer}: the step's K/V differ from the eager ones by up to {diff}"
    for _ in range(10):  # continue eagerly from the caches the step updated
        y = mx.argmax(model(y.reshape(1, 1), cache=cache)[:, -1, :], axis=-1)
        got.append(y.item())
    assert got == want


def test_ring_growth_in_steps_matches_eager():
    """A window over 256 tokens: the ring grows in two steps (11 -> 267 -> 300 slots), then wraps, as eagerly."""
    path = make_tiny_model_dir(Path(tempfile.mkdtemp()) / "wide", "llama", model_type="mistral",
                               sliding_window=300)
    model = load_model(path).model
    steps = 320
    want, _ = eager_run(model, steps=steps)
    eager_cache, y = prefill(model, PROMPT)
    for t in [y.item()] + want[:steps - 1]:
        model(mx.array([[t]], dtype=mx.uint32), cache=eager_cache)
    cache, y = prefill(model, PROMPT)
    step = CompiledDecodeStep(model, policy=DecodePolicy(compile_min_batch=1))
    got, widths = [], set()
    for _ in range(steps):
        y = mx.argmax(step.step(y, cache), axis=-1)
        got.append(y.item())
        widths.add(cache[0].keys.shape[2])
    assert got == want and step.failures == 0
    assert widths == {267, 300}
    assert step.traces == 2 * TRACED
    assert _layout(cache) == _layout(eager_cache)


def _address(a: mx.array) -> int:
    """The address of ``a``'s data (evaluated); the view is dropped at once so nothing else holds it."""
    view = memoryview(a)
    arr = np.asarray(view)
    address = arr.__array_interface__["data"][0]
    del arr
    view.release()
    return address


@pytest.mark.parametrize("name", ["llama", "gemma3"])
@pytest.mark.parametrize("compile_", [True, False], ids=["compiled", "graph"])
def test_step_writes_the_caches_in_place(name, compile_):
    """The hand-off donates the caches' buffers: every step writes its token into the same memory.

    Were the caches (or the step) still holding the buffers they passed while the step
    evaluates, MLX would copy every layer's whole K/V to write one token, into new memory.
    """
    model = tiny_model(name)
    cache, y = prefill(model, [(7 * i) % 290 + 5 for i in range(300)])
    step = CompiledDecodeStep(model, policy=DecodePolicy(compile=compile_, compile_min_batch=1))
    for _ in range(2):  # warm-up: the trace, and the ring trimmed to its window
        y = mx.argmax(step.step(y, cache), axis=-1)
        mx.eval(y)
    before = [(_address(c.keys), _address(c.values)) for c in cache]
    for _ in range(4):  # no growth: 299 + 6 tokens in buffers of 512 (8 on the ring)
        y = mx.argmax(step.step(y, cache), axis=-1)
        mx.eval(y)
        assert [(_address(c.keys), _address(c.values)) for c in cache] == before
    assert step.failures == 0


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_failure_falls_back_to_eager_with_the_same_tokens(name):
    model = tiny_model(name)
    want, _ = eager_run(model)
    # A row may hold at most 11 prompt + 9 decoded tokens: step 10 raises.
    policy = DecodePolicy(max_capacity=len(PROMPT) - 1 + 9)
    with pytest.warns(RuntimeWarning, match="compiled decode step failed") as record:
        got, _, step = compiled_run(model, policy=policy)
    assert got == want
    assert step.failures == 1 and step.failed
    assert len([w for w in record if "compiled decode step failed" in str(w.message)]) == 1
    assert "capacity" in str(step.last_error)
    # the eager graph continued from the caches as the failed call left them (it committed nothing)
    cache, y = prefill(model, PROMPT)
    step = CompiledDecodeStep(model, policy=policy)
    with pytest.warns(RuntimeWarning, match="capacity"):
        for t in [y.item()] + want[:9]:
            step.step(mx.array([t]), cache)
    assert all(c.offset == len(PROMPT) - 1 + 10 for c in cache)


class _PoisonOnce:
    """Proxies the native step; its ``step`` raises once, at call ``at``."""

    def __init__(self, native, at: int):
        self._native, self._at, self._n = native, at, 0

    def step(self, tokens, *args):
        self._n += 1
        if self._n == self._at:
            return self._native.step(mx.array([1.5]), *args)  # float tokens: rejected before anything is built
        return self._native.step(tokens, *args)

    def __getattr__(self, name):
        return getattr(self._native, name)


def test_poisoned_step_continues_eagerly_from_unchanged_kv():
    model = tiny_model("gemma3")
    want, _ = eager_run(model)
    step = CompiledDecodeStep(model)
    step._step = _PoisonOnce(step.native, at=30)
    with pytest.warns(RuntimeWarning, match="ValueError"):
        got, _, step = compiled_run(model, step=step)
    assert got == want
    assert step.failures == 1


def _native_inputs(model, B: int = 1, S: int = 16):
    """A native step and valid inputs for it: B rows, buffers of S slots, 5 tokens held."""
    from mlx_infer import _fast

    cfg, weights, quant = graph_spec(model, policy=DecodePolicy(max_capacity=12))
    native = _fast.DecodeStep(cfg, weights, quant)
    kv = [mx.zeros((B, cfg.num_kv_heads, S, cfg.head_dim)) for _ in range(cfg.num_layers)]
    groups = native.window_groups
    return native, dict(tokens=mx.array([1] * B), positions=[5] * B, slots=[[5] * B for _ in groups],
                        reads=[[6] * B for _ in groups], keys=kv, values=kv)


def test_native_step_rejects_bad_input_before_building_anything():
    native, ok = _native_inputs(tiny_model("gemma3"))
    assert native.window_groups == [0, 8]  # gemma3's global and sliding layers
    logits, keys, values = native.step(**ok)
    assert logits.shape == (1, 320) and [k.shape for k in keys] == [k.shape for k in ok["keys"]]
    assert native.steps == 1
    bad = [
        ({"tokens": mx.array([0.5])}, ValueError, "integer token ids"),
        ({"tokens": mx.array([1, 2], dtype=mx.int32)}, ValueError, "integer token ids"),
        ({"positions": [12]}, RuntimeError, "capacity exhausted"),
        ({"slots": [[5]]}, ValueError, "one list per window group"),
        ({"slots": [[16], [5]]}, ValueError, "slot 16 and read length 6"),
        ({"reads": [[5], [6]]}, ValueError, "slot 5 and read length 5"),
        ({"slots": [[5], []]}, ValueError, r"slots\[1\] has 0 entries; it needs one per row"),
        ({"reads": [[6, 6], [6]]}, ValueError, r"reads\[0\] has 2 entries"),
        ({"keys": ok["keys"][:1]}, ValueError, "one per KV-owning layer"),
        ({"keys": [mx.zeros((1, 2, 16, 8))] * 3}, ValueError, "buffer 0: expected"),
    ]
    for change, error, match in bad:
        with pytest.raises(error, match=match):
            native.step(**{**ok, **change})
    assert native.steps == 1


def test_step_from_an_empty_cache():
    model = tiny_model("gemma3")
    cache = model.make_cache()
    step = CompiledDecodeStep(model)
    y = mx.array([5], dtype=mx.uint32)
    got = []
    for _ in range(12):
        y = mx.argmax(step.step(y, cache), axis=-1)
        got.append(y.item())
    want, _ = eager_run(model, prompt=[5], steps=12)
    assert got == want


# -- the binding --------------------------------------------------------------------------------------


def test_binding_creates_the_compiled_step_only_when_allowed():
    model = tiny_model("llama")
    binding = bind_autoregressive(model)
    assert binding.descriptor.method == "autoregressive"
    assert binding.declaration.compiled_decode
    assert binding.memory > 0 and binding.adapters == ()
    assert isinstance(binding.make_cache()[0], KVCache)
    assert isinstance(binding.create_decode(), CompiledDecodeStep)
    assert binding.prefill_policy.chunk_size(100) == 2048
    assert bind_autoregressive(model, Composition(prefill_chunk=64)).prefill_policy.chunk_size(100) == 64

    off = bind_autoregressive(model, Composition(compiled_decode=False))
    assert off.create_decode() is None
    assert "composition" in off.decode_unavailable_reason()

    # Adapters no longer turn the compiled step off (issue 21: they are inputs of the step,
    # tests/test_lora_compiled.py); the binding lists the graph's adapter bank.
    adapted = bind_autoregressive(model)
    adapted.adapters = ("lora-a",)
    assert isinstance(adapted.create_decode(), CompiledDecodeStep)

    with pytest.raises(MlxInferError, match="kv_scheme"):
        Composition(kv_scheme="q4")


def test_binding_kv_scheme_sets_the_buffer_dtype():
    model = tiny_model("gemma3")
    binding = bind_autoregressive(model, Composition(kv_scheme="bf16"))
    step = binding.create_decode()
    cache, y = prefill(model, PROMPT)
    mx.eval(step.step(y, cache))
    assert all(c.keys.dtype == mx.bfloat16 for c in cache)  # the caches hold the scheme's dtype
    assert isinstance(cache[0], RotatingKVCache)


def test_assert_binding_refuses_an_incompatible_descriptor():
    binding = bind_autoregressive(tiny_model("llama"))
    bad = AutoregressiveBinding(**{**binding.__dict__,
                                   "descriptor": GraphDescriptor(id="x", method="denoising",
                                                                 state_abi="paged-v9")})
    with pytest.raises(MlxInferError, match="method is 'denoising'.*state_abi is 'paged-v9'"):
        assert_binding(bad)


# -- the real model ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_gemma_compiled_matches_eager(real_model):
    model = real_model.model
    ids = real_model.tokenizer.encode("The capital of France is")
    want, want_logits = eager_run(model, prompt=ids, steps=STEPS)
    got, got_logits, step = compiled_run(model, prompt=ids, steps=STEPS)
    assert got == want
    assert max_diff(got_logits, want_logits) <= REAL_LOGITS_ATOL
    assert step.failures == 0 and step.retraces == 0
    assert real_model.tokenizer.decode(got[:9]).startswith(" the capital of the country of France")
