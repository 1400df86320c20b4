"""Per-request adapters in the engine (issue 21): a batch mixing 4 adapters and none gives
each row exactly the greedy tokens it gets alone, on the compiled paged step (no fallback),
on the eager graph and with prefill chunks riding in the decode step; the prefix cache is
namespaced by adapter.

"Alone" is the single-request eager loop (``generate_tokens(..., adapter=name)``: mlx-lm's
ops, bit-identical to mlx-lm, tests/test_lora.py); the engine's rows use the per-row path
(gather_mm over the bank's stacks) in a batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_helpers import make_mlx_adapter
from tiny import make_tiny_model_dir

from mlx_infer.adapters import attach_adapter, bank_of
from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer.generation.autoregressive import generate_tokens
from mlx_infer.generation.bindings.autoregressive import Composition

N = 8
PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 12, 99, 4], [61, 3, 8, 150, 22, 9, 14], [40, 41, 42], [300, 1 + 5, 77, 18, 2]]
ADAPTERS = [dict(rank=4), dict(rank=8, keys=["self_attn.k_proj", "mlp.up_proj"]),
            dict(rank=16, keys=["self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"]), dict(rank=2, dora=True)]
SPREAD = {"gemma3": {"vector_noise": True, "embed_scale": 0.5}}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def setup(request, tmp_path_factory):
    family = request.param
    root: Path = tmp_path_factory.mktemp(f"lora-engine-{family}")
    d = make_tiny_model_dir(root / "model", family, **SPREAD.get(family, {}))
    paths = [make_mlx_adapter(d, root / f"a{i}", seed=20 + i, b_std=1.0, **kw) for i, kw in enumerate(ADAPTERS)]
    loaded = load_model(d, cpu_kernels=False)
    names = [attach_adapter(loaded.model, p) for p in paths]
    alone = {}
    for name in names + [None]:
        for i, p in enumerate(PROMPTS):
            alone[name, i] = [t.token for t in generate_tokens(loaded.model, p, max_tokens=N, adapter=name)]
    streams = {n: [alone[n, i] for i in range(len(PROMPTS))] for n in names + [None]}
    assert len({tuple(map(tuple, s)) for s in streams.values()}) == len(streams), \
        "two adapters give the same tokens: the test could not tell rows apart"
    return loaded, names, alone


def mixed_requests(names: list[str]) -> list[EngineRequest]:
    """Every prompt under every adapter and none, interleaved (one batch)."""
    reqs = []
    for i, p in enumerate(PROMPTS):
        for name in names + [None]:
            reqs.append(EngineRequest(prompt_ids=p, max_tokens=N, ignore_eos=True, detokenize=False, adapter=name,
                                      request_id=f"{name}-{i}"))
    return reqs


def check(results, names, alone) -> None:
    assert [r.error for r in results] == [None] * len(results)
    got = {r.request_id: r.token_ids for r in results}
    for i in range(len(PROMPTS)):
        for name in names + [None]:
            assert got[f"{name}-{i}"] == alone[name, i], (name, i)


@pytest.mark.parametrize("mode", ["compiled", "eager", "mixed"])
def test_mixed_batch_equals_alone(setup, mode):
    loaded, names, alone = setup
    # mixed: a batch of 8, so later requests join (prefill chunks in the decode step) while others decode
    config = EngineConfig(page_size=4, max_batch=8 if mode == "mixed" else 32, prefix_cache=False,
                          mixed_steps=mode == "mixed", prefill_step_size=4 if mode == "mixed" else 512)
    composition = Composition(compiled_decode=mode != "eager")
    with Engine(loaded, config, composition=composition) as engine:
        results = engine.generate(mixed_requests(names), timeout=300)
        step = engine.paged_decode
        if mode == "eager":
            assert step is None
        else:
            assert step is not None, engine.paged_decode_reason
            assert not step.failed, step.last_error  # no fallback: the compiled step ran with adapters
            assert step.eager_steps <= 1  # the first step allocates the pages' storage eagerly
            assert step.native.steps > 0 and step.adapters.active
        if mode == "mixed":
            assert engine.mixed_steps > 0
    check(results, names, alone)
    assert all(bank_of(loaded.model).in_use(n) == 0 for n in names)  # released when the requests ended


def test_prefix_cache_is_namespaced_by_adapter(setup):
    loaded, names, alone = setup
    prompt = list(range(10, 34))  # 6 full pages of 4
    with Engine(loaded, EngineConfig(page_size=4, prefix_cache=True)) as engine:
        def run(name):
            req = EngineRequest(prompt_ids=prompt, max_tokens=2, ignore_eos=True, detokenize=False, adapter=name)
            return engine.generate([req], timeout=120)[0]

        first = run(names[0])
        again = run(names[0])
        other = run(names[1])
        base = run(None)
        base_again = run(None)
    assert first.cached_tokens == 0 and again.cached_tokens > 0  # reused within the adapter
    assert other.cached_tokens == 0 and base.cached_tokens == 0  # never across adapters, nor to none
    assert base_again.cached_tokens > 0
    assert again.token_ids == first.token_ids


def test_unknown_adapter_fails_that_request_only(setup):
    loaded, names, alone = setup
    with Engine(loaded, EngineConfig(page_size=4)) as engine:
        bad = EngineRequest(prompt_ids=PROMPTS[0], max_tokens=N, ignore_eos=True, detokenize=False, adapter="nope")
        good = EngineRequest(prompt_ids=PROMPTS[0], max_tokens=N, ignore_eos=True, detokenize=False,
                             adapter=names[0])
        r_bad, r_good = engine.generate([bad, good], timeout=120)
    assert r_bad.finish_reason == "error" and "no adapter named 'nope'" in r_bad.error
    assert r_good.error is None and r_good.token_ids == alone[names[0], 0]


def test_adapters_count_against_the_kv_budget(setup, monkeypatch):
    from mlx_infer.engine import config as engine_config
    from mlx_infer.engine.config import kv_budget

    # a fixed device: available RAM moves between two readings
    monkeypatch.setattr(engine_config, "device_memory", lambda: ("cpu", 8 * 2**30, "RAM"))
    loaded, names, alone = setup
    bank = bank_of(loaded.model)
    assert bank.nbytes > 0
    budget = kv_budget(loaded.model, EngineConfig())
    assert "adapters" in budget.source
    bank_attr = loaded.model.adapter_bank
    object.__delattr__(loaded.model, "adapter_bank")
    try:
        without = kv_budget(loaded.model, EngineConfig())
    finally:
        object.__setattr__(loaded.model, "adapter_bank", bank_attr)
    assert without.bytes - budget.bytes == bank.nbytes
