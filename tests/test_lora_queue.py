"""A request whose adapter cannot get a resident slot, because every slot is held by running
requests, waits in the queue until one finishes (vLLM's behaviour) instead of failing."""

from __future__ import annotations

import mlx.core as mx

from lora_helpers import make_mlx_adapter
from tiny import make_tiny_model_dir

from mlx_infer.adapters import AdapterSlotsBusyError, attach_adapter, ensure_bank
from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer.generation.autoregressive import generate_tokens

N = 6
PROMPT = [5, 17, 33, 2, 90, 41]


def test_request_waits_for_a_slot_instead_of_failing(tmp_path):
    d = make_tiny_model_dir(tmp_path / "model", "llama")
    loaded = load_model(d, cpu_kernels=False)
    bank = ensure_bank(loaded.model, capacity=1)  # one resident adapter: a0 and a1 cannot both be resident
    names = [attach_adapter(loaded.model, make_mlx_adapter(d, tmp_path / f"a{i}", seed=50 + i, b_std=1.0))
             for i in range(2)]
    alone = {n: [t.token for t in generate_tokens(loaded.model, PROMPT, max_tokens=N, adapter=n)] for n in names}
    assert alone[names[0]] != alone[names[1]]
    # the bank itself still refuses (the engine is what waits)
    bank.acquire(names[0])
    try:
        try:
            bank.acquire(names[1])
            raise AssertionError("a second adapter got a slot of a capacity-1 bank held by a request")
        except AdapterSlotsBusyError:
            pass
    finally:
        bank.release(names[0])
    with Engine(loaded, EngineConfig(page_size=4, max_batch=4)) as engine:
        reqs = [EngineRequest(prompt_ids=PROMPT, max_tokens=N, ignore_eos=True, detokenize=False, adapter=n,
                              request_id=f"r{i}-{n}") for i in range(2) for n in names]
        out = engine.generate(reqs, timeout=120)
    assert [r.error for r in out] == [None] * len(reqs), [r.error for r in out]
    for r, q in zip(out, reqs):
        assert r.token_ids == alone[q.adapter], q.request_id
    assert bank.in_use(names[0]) == bank.in_use(names[1]) == 0


def test_cancel_while_waiting_for_a_slot(tmp_path):
    d = make_tiny_model_dir(tmp_path / "model", "llama")
    loaded = load_model(d, cpu_kernels=False)
    bank = ensure_bank(loaded.model, capacity=1)
    names = [attach_adapter(loaded.model, make_mlx_adapter(d, tmp_path / f"a{i}", seed=60 + i)) for i in range(2)]
    engine = Engine(loaded, EngineConfig(page_size=4, max_batch=4))  # no engine thread: steps run here
    try:
        h0 = engine.submit(EngineRequest(prompt_ids=PROMPT, max_tokens=N, ignore_eos=True, detokenize=False,
                                         adapter=names[0]))
        h1 = engine.submit(EngineRequest(prompt_ids=PROMPT, max_tokens=N, ignore_eos=True, detokenize=False,
                                         adapter=names[1]))
        engine.step()  # a0 holds the only slot; a1's request waits
        assert bank.in_use(names[0]) == 1 and bank.in_use(names[1]) == 0
        h1.cancel()
        engine.run_until_idle()
        r0, r1 = h0.result(timeout=5), h1.result(timeout=5)
    finally:
        engine.stop()
    assert r0.error is None and len(r0.token_ids) == N
    assert r1.finish_reason == "cancelled" and r1.token_ids == []
    assert bank.in_use(names[1]) == 0
    mx.eval(mx.array(0))
