"""The compiled C++ decode steps with adapters as inputs (issue 21): they stay on (no
fallback), give the eager graph's greedy tokens for every family (LoRA and DoRA), rows with
different adapters share one step, and swapping adapters of the same shapes does not trace
the step again.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from lora_helpers import make_mlx_adapter
from tiny import make_tiny_model_dir

from mlx_infer.adapters import adapter_rows, attach_adapter, bank_of
from mlx_infer.artifacts.loader import load_model
from mlx_infer.generation.autoregressive import generate_tokens
from mlx_infer.generation.bindings.autoregressive import bind_autoregressive
from mlx_infer.generation.bindings.decode_step import CompiledDecodeStep

N = 8
PROMPT = [5, 17, 33, 2, 90, 41]
SPREAD = {"gemma3": {"vector_noise": True, "embed_scale": 0.5}, "gemma4": {"vector_noise": True, "embed_scale": 0.5}}
KEYS = ["self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora-compiled")


@pytest.mark.parametrize("kernels", ["stock", "cpu"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3", "gemma4"])
def test_compiled_step_with_adapter_gives_eager_tokens(root, family, kernels):
    d = root / family
    if not d.exists():
        make_tiny_model_dir(d, family, **SPREAD.get(family, {}))
    loaded = load_model(d, cpu_kernels=kernels == "cpu")
    names = []
    for i, dora in enumerate((False, True)):
        p = root / f"{family}-{'dora' if dora else 'lora'}"
        if not p.exists():
            make_mlx_adapter(d, p, seed=30 + i, keys=KEYS, dora=dora, b_std=1.0)
        names.append(attach_adapter(loaded.model, p))
    base = [t.token for t in generate_tokens(loaded.model, PROMPT, max_tokens=N, adapter=None)]
    for name in names:
        eager = [t.token for t in generate_tokens(loaded.model, PROMPT, max_tokens=N, adapter=name)]
        assert eager != base, f"{name} changes nothing: the test would hide a no-op"
        step = bind_autoregressive(loaded).create_decode()
        assert step is not None, bind_autoregressive(loaded).decode_unavailable_reason()
        native = step.native  # the generation closes the step at its end
        got = [t.token for t in generate_tokens(loaded.model, PROMPT, max_tokens=N, adapter=name, decode=step)]
        assert not step.failed, step.last_error  # no fallback to the eager graph
        assert native.adapter_targets and native.traces >= 1
        assert got == eager, name


def test_rows_with_different_adapters_share_one_step_and_swaps_do_not_retrace(root):
    d = root / "llama-rows"
    make_tiny_model_dir(d, "llama")
    loaded = load_model(d, cpu_kernels=False)
    model = loaded.model
    paths = [make_mlx_adapter(d, root / f"rows-{i}", seed=40 + i, keys=KEYS, b_std=1.0) for i in range(3)]
    n0, n1 = attach_adapter(model, paths[0]), attach_adapter(model, paths[1])
    bank = bank_of(model)
    prompts = [PROMPT, [7, 12, 99, 4, 61, 3], [40, 41, 42, 43, 44, 45]]
    chosen = [n0, None, n1]

    def alone(name, prompt):
        return [t.token for t in generate_tokens(model, prompt, max_tokens=N, adapter=name)]

    want = [alone(n, p) for n, p in zip(chosen, prompts)]
    # Rows prefilled alone under their adapters, then decoded together by one step.
    slots = mx.array([0 if n is None else bank.acquire(n) for n in chosen], mx.int32)
    rows = []
    firsts = []
    for name, p in zip(chosen, prompts):
        caches = model.make_cache()
        with adapter_rows(0 if name is None else bank.acquire(name)):
            logits = model(mx.array([p]), cache=caches)[:, -1]
        firsts.append(int(logits.argmax().item()))
        rows.append(caches)
    step = CompiledDecodeStep(model)
    tokens, got = mx.array(firsts, mx.uint32), [[t] for t in firsts]
    with adapter_rows(slots):
        for _ in range(N - 1):
            logits = step.step(tokens, rows)
            tokens = logits.argmax(-1).astype(mx.uint32)
            for r, t in enumerate(tokens.tolist()):
                got[r].append(t)
    assert not step.failed, step.last_error
    assert got == want
    traces = step.traces
    # Swap adapter 1 for one of the same rank and targets: new values, same shapes, no new trace.
    bank.release(n1)
    bank.release(n1)
    bank.unload(n1)
    n2 = attach_adapter(model, paths[2])
    assert bank.layout and step.traces == traces
    slot2 = bank.acquire(n2)
    with adapter_rows(mx.array([int(slots[0]), 0, slot2], mx.int32)):
        logits = step.step(tokens, rows)
    mx.eval(logits)
    assert not step.failed, step.last_error
    assert step.traces == traces, "a same-shape adapter swap traced the compiled step again"


def test_large_bank_runs_the_gathered_product(root):
    """A bank past DENSE_MAX_COLS (slots x rank) stores only the per-slot stacks: gather_mm per row."""
    from mlx_infer.adapters import AdapterBank
    from mlx_infer.adapters.bank import DENSE_MAX_COLS

    d = root / "llama-large"
    make_tiny_model_dir(d, "llama")
    loaded = load_model(d)
    bank = AdapterBank(loaded.model, capacity=40)
    p = make_mlx_adapter(d, root / "large-r16", seed=45, rank=16, keys=KEYS, b_std=1.0)
    name = attach_adapter(loaded.model, p)
    assert all(not s.dense for s in bank.stacks.values()) and 41 * 16 > DENSE_MAX_COLS
    eager = [t.token for t in generate_tokens(loaded.model, PROMPT, max_tokens=N, adapter=name)]
    step = bind_autoregressive(loaded).create_decode()
    got = [t.token for t in generate_tokens(loaded.model, PROMPT, max_tokens=N, adapter=name, decode=step)]
    assert not step.failed, step.last_error
    assert got == eager


def test_bf16_model_with_float32_adapters(root):
    """mlx-lm trains float32 adapters for a bfloat16 model: the update runs in float32 (as ``x @ a``
    promotes), on the CPU kernels, and the compiled step and the engine keep the eager graph's tokens."""
    from mlx_infer.engine import Engine, EngineConfig, EngineRequest

    d = root / "llama-bf16"
    make_tiny_model_dir(d, "llama", dtype=mx.bfloat16)
    loaded = load_model(d)
    p = make_mlx_adapter(d, root / "bf16-lora", seed=46, keys=KEYS, b_std=1.0)
    assert mx.load(str(p / "adapters.safetensors"))["model.layers.0.self_attn.q_proj.lora_a"].dtype == mx.float32
    name = attach_adapter(loaded.model, p)
    eager = [t.token for t in generate_tokens(loaded.model, PROMPT, max_tokens=N, adapter=name)]
    step = bind_autoregressive(loaded).create_decode()
    got = [t.token for t in generate_tokens(loaded.model, PROMPT, max_tokens=N, adapter=name, decode=step)]
    assert not step.failed, step.last_error
    assert got == eager
    # The engine runs every row on the per-row path (its prefill eagerly, on the CPU kernels): in
    # bfloat16 its rounding is not the single-request loop's (mlx-lm's ops), so its reference is
    # the same request alone in the engine; a batch with other rows gives it the same tokens.
    def run(adapters):
        with Engine(loaded, EngineConfig(page_size=4)) as engine:
            out = engine.generate([EngineRequest(prompt_ids=PROMPT, max_tokens=N, ignore_eos=True,
                                                 detokenize=False, adapter=a) for a in adapters], timeout=120)
            assert not engine.paged_decode.failed
        assert [r.error for r in out] == [None] * len(adapters)
        return [r.token_ids for r in out]

    alone = run([name])[0]
    assert sum(a == b for a, b in zip(alone, eager)) >= N - 2  # bf16 rounding may flip a late token
    assert run([None, name, None, name]) == [run([None])[0], alone, run([None])[0], alone]
