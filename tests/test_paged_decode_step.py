"""The compiled C++ decode step over paged KV (``_fast.PagedDecodeStep``) in the engine.

Oracles: the engine's eager paged decode (``Composition(compiled_decode=False)``)
and plain-cache generation of each prompt alone (``generate_tokens``). Checks:

- greedy tokens of 64 steps equal across the three, tiny llama and tiny gemma3
  (window 8, prompts longer than it), dense and 4-bit weights, B=1 and B=8
  rows of different lengths, compiled (S bucketed) and op-by-op modes;
- teacher-forced logits of the compiled step within ``LOGITS_ATOL`` of the eager
  paged graph's, same argmax, each step (measured max |diff| on CPU, mlx 0.32.4:
  see ``LOGITS_ATOL``);
- traces happen only when a shape signature (B, bucketed S per layer group) is
  new: no retrace in steady state;
- a step forced to throw falls back to eager with the cache intact (the tokens
  still equal the oracle's), reported once;
- bad inputs and quantized KV storage are refused with a clear error.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer.engine.batch import DecodeBatch
from mlx_infer.generation.autoregressive import generate_tokens, newline_ids
from mlx_infer.generation.bindings.autoregressive import Composition
from mlx_infer.generation.bindings.paged_decode_step import CompiledPagedDecodeStep, PagedDecodePolicy
from mlx_infer.state.paged import LayerKV, PagedKVStore
from tiny import GEMMA4_SWITCHES, make_tiny_model_dir

# Tiny float32 / 4-bit models; measured max |compiled - eager| over 64 teacher-forced steps, B=8
# (CPU, mlx 0.32.4): 0.0 (bit-identical) for llama, gemma3, llama-q4, gemma3-q4, gemma4-kv_shared, compiled with S
# buckets of 32 and op by op. The bound leaves room for backends whose attention sums the bucket's
# masked padding in another order.
LOGITS_ATOL = 1e-4
STEPS = 64
CONFIGS = {"llama": ("llama", None), "gemma3": ("gemma3", None), "llama-q4": ("llama", 4),
           "gemma3-q4": ("gemma3", 4),
           # Gemma 4 (per-layer KV geometry; KV-shared layers attend over their donor's gather, MoE).
           "gemma4-kv_shared": ("gemma4", None), "gemma4-moe-q4": ("gemma4", 4)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            family, bits = CONFIGS[name]
            extra = {"embed_scale": 0.5, **GEMMA4_SWITCHES[name.split("-")[1]]} if family == "gemma4" else {}
            loaded = load_model(make_tiny_model_dir(tmp_path_factory.mktemp(name), family, **extra))
            if bits is not None:
                nn.quantize(loaded.model, group_size=32, bits=bits)
                mx.eval(loaded.model.parameters())
            cache[name] = loaded
        return cache[name]
    return get


def prompts(n: int) -> list[list[int]]:
    """``n`` prompts of different lengths (3..24 tokens, past gemma3's window of 8)."""
    return [[(11 * i + 5 * j + i * j) % 300 + 5 for j in range(3 + (i * 7) % 22)] for i in range(n)]


def alone(loaded, prompt: list[int], max_tokens: int) -> list[int]:
    gen = generate_tokens(loaded.model, prompt, max_tokens=max_tokens, eos_token_ids=(),
                          newline_token_ids=newline_ids(loaded), context_length=loaded.context_length)
    return [t.token for t in gen]


def run_engine(loaded, ps: list[list[int]], *, compiled: bool, policy: PagedDecodePolicy = PagedDecodePolicy(),
               patch=None) -> tuple[list[list[int]], Engine]:
    """Every prompt submitted at once, run on this thread until done; greedy, ``STEPS`` tokens each."""
    engine = Engine(loaded, EngineConfig(page_size=4, max_batch=16),
                    composition=Composition(compiled_decode=compiled), decode_policy=policy)
    if patch is not None:
        patch(engine)
    handles = [engine.submit(EngineRequest(prompt_ids=p, max_tokens=STEPS, ignore_eos=True, detokenize=False))
               for p in ps]
    engine.run_until_idle()
    results = [h.result(timeout=0) for h in handles]
    assert all(r.error is None for r in results), [r.error for r in results]
    engine.stop()
    return [r.token_ids for r in results], engine


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("B", [1, 8])
def test_engine_greedy_compiled_paged_equals_eager_and_plain(tiny, name, B):
    loaded = tiny(name)
    ps = prompts(B)
    want = [alone(loaded, p, STEPS) for p in ps]
    eager, e_engine = run_engine(loaded, ps, compiled=False)
    assert e_engine.paged_decode is None and e_engine.paged_decode_reason
    compiled, engine = run_engine(loaded, ps, compiled=True)
    step = engine.paged_decode
    assert step is not None, engine.paged_decode_reason
    assert eager == want
    assert compiled == want
    assert step.native.steps >= STEPS - 1 and step.eager_steps == 0 and step.failures == 0
    assert step.traces == step.native.signatures and step.retraces == 0


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_engine_greedy_op_by_op_mode(tiny, name):
    loaded = tiny(name)
    ps = prompts(8)
    compiled, engine = run_engine(loaded, ps, compiled=True, policy=PagedDecodePolicy(compile=False))
    assert compiled == [alone(loaded, p, STEPS) for p in ps]
    assert engine.paged_decode.native.steps >= STEPS - 1 and engine.paged_decode.traces == 0


def _prefilled_store(loaded, ps: list[list[int]]) -> tuple[PagedKVStore, list]:
    """A store holding every prompt but its last token (prefilled eagerly, one sequence at a time)."""
    store = PagedKVStore.for_model(loaded.model, num_pages=200, page_size=4)
    seqs = []
    for p in ps:
        seq = store.add_sequence()
        loaded.model.model(mx.array([p[:-1]], mx.uint32), cache=store.make_cache(seq))
        seqs.append(seq)
    return store, seqs


@pytest.mark.parametrize("name", ["gemma3", "llama-q4", "gemma4-kv_shared"])
@pytest.mark.parametrize("compile", [True, False])
def test_forced_logits_close_and_no_retrace_in_steady_state(tiny, name, compile):
    loaded = tiny(name)
    ps = prompts(8)
    policy = PagedDecodePolicy(compile=compile, t_bucket=4)
    store_e, seqs_e = _prefilled_store(loaded, ps)
    store_c, seqs_c = _prefilled_store(loaded, ps)
    batch_e, batch_c = DecodeBatch(store_e, seqs_e), DecodeBatch(store_c, seqs_c)
    step = CompiledPagedDecodeStep(loaded.model, store_c, batch_c.group_windows(), policy=policy)
    rng = np.random.default_rng(0)
    tokens = mx.array([p[-1] for p in ps], mx.uint32)
    worst, seen, traced_at_new, traced_at_seen = 0.0, set(), 0, 0
    for i in range(STEPS):
        assert batch_e.reserve() and batch_c.reserve()
        want = loaded.model(tokens[:, None], cache=batch_e.caches)[:, -1, :]
        signature = tuple(g[0].shape[1] for g in batch_c.paged_inputs(policy.bucket))  # each group's T
        before = step.traces
        got = step.step(tokens, batch_c)
        batch_e.commit()
        batch_c.commit()
        mx.eval(want, got)
        if signature in seen:
            traced_at_seen += step.traces - before
        else:
            traced_at_new += step.traces - before
            seen.add(signature)
        worst = max(worst, mx.abs(got - want).max().item())
        assert mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1)).item(), i
        tokens = mx.array(rng.integers(5, 300, size=len(ps)), mx.uint32)  # teacher-forced stream
    assert worst <= LOGITS_ATOL, worst
    assert step.eager_steps == 0 and step.failures == 0
    assert traced_at_seen == 0 and step.retraces == 0  # steady state replays the traced graph
    if compile:
        assert traced_at_new == len(seen) == step.traces  # one trace per (B, S bucket) signature
        assert len(seen) < STEPS // 4  # buckets of 4 pages (16 tokens) over 64 steps: a handful, not one per step
    else:
        assert step.traces == 0
    # The cache the compiled step wrote equals the eager one's (both stores, every layer).
    for se, sc in zip(store_e.storage, store_c.storage):
        assert mx.allclose(se.keys[0], sc.keys[0], atol=LOGITS_ATOL).item()
        assert mx.allclose(se.values[0], sc.values[0], atol=LOGITS_ATOL).item()


class _Failing:
    """Stands in for the native step: raises on call ``at`` (after building the real step's
    outputs when ``after_build``, so nothing but the commit stands between them and the store)."""

    def __init__(self, native, at: int, after_build: bool):
        self.native, self.at, self.after_build, self.calls = native, at, after_build, 0

    def step(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            if self.after_build:
                self.native.step(*args, **kwargs)
            raise RuntimeError("forced failure")
        return self.native.step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.native, name)


@pytest.mark.parametrize("after_build", [False, True])
def test_failure_falls_back_to_eager_once_with_cache_intact(tiny, after_build):
    loaded = tiny("gemma3")
    ps = prompts(8)
    want = [alone(loaded, p, STEPS) for p in ps]

    def patch(engine):
        engine.paged_decode.native = _Failing(engine.paged_decode.native, at=5, after_build=after_build)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, engine = run_engine(loaded, ps, compiled=True, patch=patch)
    reports = [w for w in caught if "compiled paged decode step failed" in str(w.message)]
    assert len(reports) == 1 and "forced failure" in str(reports[0].message)
    step = engine.paged_decode
    assert step.failed and step.failures == 1 and step.native.calls == 5
    assert step.eager_steps >= STEPS - 5  # the rest ran eagerly
    assert got == want


def test_quantized_kv_uses_eager_with_a_reason(tmp_path):
    loaded = load_model(make_tiny_model_dir(tmp_path, "llama", model_type="qwen3", head_dim=32))
    engine = Engine(loaded, EngineConfig(page_size=4, kv_scheme=LayerKV(bits=8, group_size=32)))
    assert engine.paged_decode is None and "quantized" in engine.paged_decode_reason
    engine.stop()


def test_bad_inputs_raise_clear_errors(tiny):
    loaded = tiny("gemma3")
    store, seqs = _prefilled_store(loaded, prompts(2))
    batch = DecodeBatch(store, seqs)
    step = CompiledPagedDecodeStep(loaded.model, store, batch.group_windows())
    assert batch.reserve()
    groups = batch.paged_inputs(4)
    keys = [s.keys[0] for s in store.storage]
    values = [s.values[0] for s in store.storage]
    tokens = mx.array([5, 6], mx.uint32)
    rows = mx.arange(2, dtype=mx.int32)
    native = step.native
    with pytest.raises(ValueError, match="layer groups"):
        native.step(tokens, batch.offset, rows, groups[:1], keys, values)
    with pytest.raises(ValueError, match="one per row"):
        native.step(mx.array([5, 6], mx.uint32), mx.array([1, 2, 3], mx.int32), rows, groups, keys, values)
    with pytest.raises(ValueError, match="block_tables"):
        bad = [(g[0][:1], g[1], g[2]) for g in groups]
        native.step(tokens, batch.offset, rows, bad, keys, values)
    with pytest.raises(ValueError, match="logit_rows"):
        native.step(tokens, batch.offset, mx.zeros((0,), mx.int32), groups, keys, values)
    with pytest.raises(ValueError, match="quantized"):
        packed = [mx.zeros(k.shape[:-1] + (4,), mx.uint32) for k in keys]
        native.step(tokens, batch.offset, rows, groups, packed, packed)
    with pytest.raises(ValueError, match="one per layer"):
        native.step(tokens, batch.offset, rows, groups, keys[:1], values[:1])
    with pytest.raises(ValueError, match="t_bucket"):
        PagedDecodePolicy(t_bucket=0)
    with pytest.raises(ValueError, match="attention"):
        PagedDecodePolicy(attention="flash")


@pytest.mark.slow
def test_real_gemma3_270m_compiled_paged_equals_eager(real_model):
    ids = real_model.tokenizer.encode("The capital of France is")
    ps = [ids, real_model.tokenizer.encode("Write a short poem about the sea.")]
    eager, _ = run_engine(real_model, ps, compiled=False)
    compiled, engine = run_engine(real_model, ps, compiled=True)
    assert engine.paged_decode is not None and engine.paged_decode.eager_steps == 0
    assert compiled == eager
    assert engine.paged_decode.retraces == 0
