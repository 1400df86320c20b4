"""Mixed steps: prompt chunks of joining requests ride in the decode step (engine/mixed.py).
The greedy tokens equal the separate-prefill engine's and the plain model's."""

import mlx.core as mx
import pytest
from tiny import make_tiny_model_dir

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer.engine.mixed import LOGIT_BUCKET, ROW_BUCKET, Chunk, pick_chunks
from mlx_infer.engine.scheduler import DECODE, PREFILL


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("mixed") / request.param, request.param))


def greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):  # the plain model over the whole sequence each time: the reference
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1]).item()))
    return ids[len(prompt):]


PROMPTS = [[(11 * i + 5 * j) % 290 + 5 for j in range(n)] for i, n in enumerate((10, 41, 23, 6))]


def run(loaded, mixed: bool) -> tuple[list[list[int]], Engine]:
    engine = Engine(loaded, EngineConfig(page_size=4, prefill_step_size=16, mixed_steps=mixed))
    first = engine.submit(EngineRequest(prompt_ids=PROMPTS[0], max_tokens=24, detokenize=False, ignore_eos=True))
    for _ in range(3):
        engine.step()  # the first request decodes ...
    later = [engine.submit(EngineRequest(prompt_ids=p, max_tokens=12, detokenize=False, ignore_eos=True))
             for p in PROMPTS[1:]]  # ... while these join (41 tokens: three chunks of a 16-token budget)
    engine.run_until_idle()
    return [h.result(1).token_ids for h in [first] + later], engine


def test_mixed_steps_give_the_separate_prefill_tokens(tiny):
    mixed, engine = run(tiny, True)
    assert engine.paged_decode is not None and engine.mixed_steps >= 3
    separate, other = run(tiny, False)
    assert other.mixed_steps == 0
    assert mixed == separate
    assert mixed[1] == greedy(tiny.model, PROMPTS[1], 12)
    assert engine.paged_decode.failures == 0


def test_pick_chunks_spends_the_prompt_budget_in_admission_order():
    class R:
        def __init__(self, state, n, done):
            self.state, self.all_ids, self.prefilled, self.seq = state, [0] * n, done, object()

    running = [R(DECODE, 5, 5), R(PREFILL, 40, 0), R(PREFILL, 10, 4), R(PREFILL, 30, 0)]
    chunks = pick_chunks(running, budget=16)
    assert [(c.r, c.n, c.ends) for c in chunks] == [(running[1], 16, False)]
    chunks = pick_chunks(running, budget=64)
    assert [(c.n, c.ends) for c in chunks] == [(40, True), (6, True), (18, False)]
    assert ROW_BUCKET % LOGIT_BUCKET == 0 and isinstance(chunks[0], Chunk)


def test_mixed_steps_under_staggered_load_with_shared_prefixes(tiny):
    """Twelve requests arriving over time, some sharing a cached prefix, a small pool (preemption
    possible): mixed steps give the separate-prefill engine's greedy tokens, request by request."""
    import random

    rng = random.Random(7)
    shared = [rng.randrange(5, 300) for _ in range(12)]
    plan = [(step, (shared if rng.random() < 0.5 else []) + [rng.randrange(5, 300) for _ in range(rng.randrange(1, 30))],
             rng.randrange(1, 10)) for step in sorted(rng.randrange(0, 12) for _ in range(12))]

    def run_plan(mixed: bool) -> list[list[int]]:
        engine = Engine(tiny, EngineConfig(page_size=4, prefill_step_size=8, num_pages=48, max_batch=6,
                                           mixed_steps=mixed))
        handles, step = [], 0
        for at, prompt, n in plan:
            while step < at:
                engine.step()
                step += 1
            handles.append(engine.submit(EngineRequest(prompt_ids=prompt, max_tokens=n, detokenize=False,
                                                       ignore_eos=True)))
        engine.run_until_idle()
        assert not mixed or engine.mixed_steps > 0
        return [h.result(1).token_ids for h in handles]

    assert run_plan(True) == run_plan(False)


def test_after_the_compiled_step_fails_the_engine_prefills_separately(tiny):
    class Broken:
        def step(self, *a, **k):
            raise RuntimeError("broken on purpose")

    engine = Engine(tiny, EngineConfig(page_size=4, prefill_step_size=16, mixed_steps=True))
    engine.paged_decode.native = Broken()
    first = engine.submit(EngineRequest(prompt_ids=PROMPTS[0], max_tokens=8, detokenize=False, ignore_eos=True))
    with pytest.warns(RuntimeWarning, match="broken on purpose"):
        for _ in range(3):
            engine.step()
    later = engine.submit(EngineRequest(prompt_ids=PROMPTS[1], max_tokens=6, detokenize=False, ignore_eos=True))
    engine.run_until_idle()
    # The first prompt rode in the step that failed (its eager fallback computed it); after that
    # every prompt prefills in a forward of its own.
    assert engine.paged_decode.failed and engine.mixed_steps == 1 and engine.separate_prefills >= 1
    assert later.result(1).token_ids == greedy(tiny.model, PROMPTS[1], 6)
    assert first.result(1).token_ids == greedy(tiny.model, PROMPTS[0], 8)


def test_a_burst_of_prompts_prefills_in_the_compiled_step_alone(tiny):
    """Requests arriving together while nothing decodes (the engine's first ones: the mixing engine
    allocated the pages' storage when it was built) go through the compiled paged step as
    chunk-only steps, a prompt-token budget each, not the eager prefill; tokens equal the
    separate-prefill engine's."""
    prompts = [[(7 * i + 3 * j) % 290 + 5 for j in range(n)] for i, n in enumerate((9, 30, 17, 25, 12))]

    def burst(mixed: bool) -> tuple[list[list[int]], Engine]:
        engine = Engine(tiny, EngineConfig(page_size=4, prefill_step_size=16, mixed_steps=mixed))
        assert all(s is not None for s in engine.store.storage) == mixed
        assert engine.store.free_pages() == [g.num_pages - 1 for g in engine.store.groups]  # the probe's page is back
        before = engine.separate_prefills
        handles = [engine.submit(EngineRequest(prompt_ids=p, max_tokens=6, detokenize=False, ignore_eos=True))
                   for p in prompts]
        engine.run_until_idle()
        engine.burst_prefills = engine.separate_prefills - before
        return [h.result(1).token_ids for h in handles], engine

    mixed, engine = burst(True)
    assert engine.burst_prefills == 0 and engine.mixed_steps >= 93 // 16
    assert engine.paged_decode.failures == 0 and engine.paged_decode.eager_steps == 0
    separate, other = burst(False)
    assert other.burst_prefills > 0 and mixed == separate
    assert mixed[1] == greedy(tiny.model, prompts[1], 6)


def test_a_failed_mixed_iteration_drops_the_prefix_cache_and_stops_mixing(tiny, monkeypatch):
    """An iteration that raises while evaluating a chunk step (as a CUDA launch failure does at
    ``mx.async_eval``) fails its requests; the engine then forgets every cached prefix page (the
    step may have indexed pages it never wrote) and prefills later prompts on their own, so the
    next requests are served, with the plain model's tokens."""
    import mlx_infer.engine.engine as engine_module

    engine = Engine(tiny, EngineConfig(page_size=4, prefill_step_size=16, mixed_steps=True)).start()
    try:
        done = engine.submit(EngineRequest(prompt_ids=PROMPTS[1], max_tokens=3, detokenize=False, ignore_eos=True))
        assert done.result(60).token_ids == greedy(tiny.model, PROMPTS[1], 3)
        assert sum(engine.store.pages.pool(g.index).num_cached_pages() for g in engine.store.groups) > 0
        real = engine_module.queue_outputs
        calls = []

        def broken(tokens, outs):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("cudaGraphAddKernelNode failed: invalid argument (on purpose)")
            return real(tokens, outs)

        monkeypatch.setattr(engine_module, "queue_outputs", broken)
        failed = engine.submit(EngineRequest(prompt_ids=PROMPTS[2], max_tokens=3, detokenize=False))
        res = failed.result(60)
        assert res.finish_reason == "error" and "on purpose" in (res.error or "")
        assert sum(engine.store.pages.pool(g.index).num_cached_pages() for g in engine.store.groups) == 0
        assert engine._mixing is False
        after = engine.submit(EngineRequest(prompt_ids=PROMPTS[1], max_tokens=4, detokenize=False, ignore_eos=True))
        assert after.result(60).token_ids == greedy(tiny.model, PROMPTS[1], 4)
    finally:
        engine.stop()
