"""The continuous-batching engine (mlx_infer.engine).

Oracle: ``generate_tokens`` / ``generate`` on the same model, one request at
a time, plain caches. Greedy tokens must be equal exactly (the tiny models'
weights are spread so greedy choices are not near-ties); seeded sampling uses
the same per-request key sequence, so its tokens are equal too; logprobs
within ``LOGPROB_ATOL`` (batched rows and paged attention sum in another
order: measured < 1e-5).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import replace

import mlx.core as mx
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    QueueFullError,
    RequestTooLargeError,
    pool_pages,
    prometheus_text,
)
from mlx_infer.engine.metrics import Histogram
from mlx_infer.engine.scheduler import DECODE, WAITING, LiveRequest, Scheduler
from mlx_infer.errors import MlxInferError, PromptTooLongError
from mlx_infer.generation.autoregressive import generate, generate_tokens, newline_ids
from mlx_infer.sampling import SamplingParams
from mlx_infer.state.paged import DEFAULT_WINDOW_SLACK, PagedKVStore
from tiny import make_tiny_model_dir

LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(family: str = "llama"):
        if family not in cache:
            cache[family] = load_model(make_tiny_model_dir(tmp_path_factory.mktemp(family), family))
        return cache[family]
    return get


def prompts(n: int, *, base: int = 3, spread: int = 40) -> list[list[int]]:
    """``n`` different prompts of mixed lengths (ids 5..304)."""
    return [[(7 * i + 3 * j + i * j) % 300 + 5 for j in range(base + (i * 11) % spread)] for i in range(n)]


def alone(loaded, prompt, max_tokens, sampling=SamplingParams()):
    gen = generate_tokens(loaded.model, prompt, sampling=sampling, max_tokens=max_tokens,
                          eos_token_ids=loaded.eos_token_ids, newline_token_ids=newline_ids(loaded),
                          context_length=loaded.context_length)
    return list(gen)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_concurrent_greedy_requests_equal_each_alone(tiny, family):
    loaded = tiny(family)
    ps = prompts(16)
    want = [[t.token for t in alone(loaded, p, 24)] for p in ps]
    # Small pages and a small prefill step: requests join mid-flight and prefill in chunks.
    with Engine(loaded, EngineConfig(page_size=4, prefill_step_size=16)) as engine:
        results = engine.generate([EngineRequest(prompt_ids=p, max_tokens=24) for p in ps], timeout=120)
        assert [r.token_ids for r in results] == want
        assert engine.stats()["decode_steps_total"] < 16 * 24  # rows really were batched
        assert engine.store.pool.num_used_pages() == 0


def test_preemption_recomputes_and_keeps_outputs(tiny):
    loaded = tiny("gemma3")
    ps = prompts(12)
    want = [[t.token for t in alone(loaded, p, 20)] for p in ps]
    with Engine(loaded, EngineConfig(page_size=4, num_pages=40, prefill_step_size=16)) as engine:
        results = engine.generate([EngineRequest(prompt_ids=p, max_tokens=20) for p in ps], timeout=120)
        assert [r.token_ids for r in results] == want
        assert sum(r.preemptions for r in results) > 0
        assert engine.stats()["preemptions_total"] == sum(r.preemptions for r in results)
        assert engine.store.pool.num_used_pages() == 0
        engine.store.pool.check()


def test_seeds_penalties_and_logprobs_match_generate_tokens(tiny):
    loaded = tiny("llama")
    ps = prompts(6)
    params = [
        SamplingParams(temperature=0.8, top_k=20, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, seed=2, logprobs=True, top_logprobs=3),
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),  # history path
        SamplingParams(logprobs=True, top_logprobs=2),
        SamplingParams(temperature=0.7, seed=3, logit_bias={7: 5.0, 9: -100.0}),
        SamplingParams(),
    ]
    want = [alone(loaded, p, 16, sp) for p, sp in zip(ps, params)]
    with Engine(loaded) as engine:
        results = engine.generate([EngineRequest(prompt_ids=p, max_tokens=16, sampling=sp)
                                   for p, sp in zip(ps, params)], timeout=120)
    for r, w, sp in zip(results, want, params):
        assert r.token_ids == [t.token for t in w]
        if sp.logprobs:
            assert r.logprobs == pytest.approx([t.logprob for t in w], abs=LOGPROB_ATOL)
            for got, ref in zip(r.top_logprobs, (t.top_logprobs for t in w)):
                assert [i for i, _ in got] == [i for i, _ in ref]
        else:
            assert r.logprobs is None


def test_stop_strings_and_text_match_generate(tiny):
    loaded = tiny("llama")
    ids = loaded.tokenizer.encode("The capital of France")
    full = "".join(t.text for t in generate(loaded, "The capital of France", max_tokens=30))
    stop = full[5:8]  # a string the greedy text is known to contain
    want = "".join(t.text for t in generate(loaded, "The capital of France", max_tokens=30, stop=[stop]))
    with Engine(loaded) as engine:
        plain, stopped = engine.generate([EngineRequest(prompt_ids=ids, max_tokens=30),
                                          EngineRequest(prompt_ids=ids, max_tokens=30, stop=[stop])])
    assert plain.text == full
    assert stopped.text == want and stop not in stopped.text
    assert stopped.finish_reason == "stop"


def test_prefix_cache_reuses_pages_and_keeps_output(tiny):
    loaded = tiny("llama")
    prompt = prompts(1, base=50)[0]
    with Engine(loaded, EngineConfig(page_size=8)) as engine:
        first = engine.generate([EngineRequest(prompt_ids=prompt, max_tokens=8)])[0]
        second = engine.generate([EngineRequest(prompt_ids=prompt, max_tokens=8)])[0]
        s = engine.stats()
    assert first.cached_tokens == 0
    assert second.cached_tokens == (len(prompt) - 1) // 8 * 8 > 0
    assert second.token_ids == first.token_ids
    assert s["prefix_hit_rate"] == pytest.approx(second.cached_tokens / (2 * len(prompt)))


def test_cancel_frees_pages_at_once(tiny):
    loaded = tiny("llama")
    with Engine(loaded, EngineConfig(page_size=4)) as engine:
        seen = []
        handle = engine.submit(EngineRequest(prompt_ids=prompts(1)[0], max_tokens=200, ignore_eos=True),
                               on_token=seen.append)
        for event in handle:
            if event.index >= 2:
                handle.cancel()
                break
        result = handle.result(timeout=30)
        assert result.finish_reason == "cancelled"
        assert seen[-1].finish_reason == "cancelled" and seen[-1].token is None
        assert 3 <= result.completion_tokens < 200
        assert engine.store.pool.num_used_pages() == 0
        assert engine.stats()["running"] == 0


def test_async_iteration_and_callbacks(tiny):
    loaded = tiny("llama")
    want = [t.token for t in alone(loaded, prompts(1)[0], 12)]

    async def main(engine):
        handle = engine.submit(EngineRequest(prompt_ids=prompts(1)[0], max_tokens=12))
        tokens = [ev.token async for ev in handle]
        return tokens, await handle.aresult()

    with Engine(loaded) as engine:
        tokens, result = asyncio.run(main(engine))
    assert [t for t in tokens if t is not None] == want == result.token_ids
    assert result.ttft_ms > 0 and result.total_ms >= result.ttft_ms


def test_step_without_a_thread(tiny):
    loaded = tiny("llama")
    engine = Engine(loaded)
    handles = [engine.submit(EngineRequest(prompt_ids=p, max_tokens=5)) for p in prompts(3)]
    engine.run_until_idle()
    assert all(h.done for h in handles)
    assert [h.result().token_ids for h in handles] == [[t.token for t in alone(loaded, p, 5)] for p in prompts(3)]


def test_bad_requests_are_value_errors(tiny):
    loaded = tiny("llama")  # context 256
    engine = Engine(loaded, EngineConfig(page_size=4, num_pages=20, max_queue=2))
    with pytest.raises(PromptTooLongError, match="context window is 256"):
        engine.submit(EngineRequest(prompt_ids=[5] * 256))
    with pytest.raises(RequestTooLargeError, match="pool holds 19"):
        engine.submit(EngineRequest(prompt_ids=[5] * 100))
    with pytest.raises(MlxInferError, match="vocabulary"):
        engine.submit(EngineRequest(prompt_ids=[5, 400]))
    with pytest.raises(MlxInferError, match="logit_bias"):
        engine.submit(EngineRequest(prompt_ids=[5], sampling=SamplingParams(logit_bias={999: 1.0})))
    with pytest.raises(MlxInferError, match="max_tokens"):
        EngineRequest(prompt_ids=[5], max_tokens=0)
    with pytest.raises(MlxInferError, match="empty"):
        EngineRequest(prompt_ids=[])
    engine.submit(EngineRequest(prompt_ids=[5]))
    engine.submit(EngineRequest(prompt_ids=[6]))
    with pytest.raises(QueueFullError):
        engine.submit(EngineRequest(prompt_ids=[7]))
    engine.stop()  # unfinished requests end cancelled, pages freed
    assert engine.store.pool.num_used_pages() == 0


def test_metrics_in_prometheus_text(tiny):
    loaded = tiny("llama")
    with Engine(loaded) as engine:
        engine.generate([EngineRequest(prompt_ids=p, max_tokens=4) for p in prompts(3)])
        text = engine.prometheus()
    for name in ("queue_depth", "running", "generation_tokens_per_second", "kv_page_usage", "prefix_hit_rate",
                 "memory_active_bytes"):
        assert f"\nmlx_infer_{name} " in text or text.startswith(f"# HELP mlx_infer_{name}")
    assert 'mlx_infer_requests_total{finish_reason="length"} 3' in text
    assert prometheus_text({"x": {"a": 1}}).endswith('mlx_infer_x{finish_reason="a"} 1\n')
    # the latency histograms (vLLM's buckets): one first token and one end per request, cumulative buckets
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        full = f"mlx_infer_{name}"
        assert f"# TYPE {full} histogram" in text
        samples = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.startswith(full + "_")}
        buckets = [v for k, v in samples.items() if k.startswith(full + "_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == 3 == samples[full + "_count"]
        assert f'{full}_bucket{{le="+Inf"}} 3' in text and samples[full + "_sum"] > 0
    ttft = engine.metrics.time_to_first_token
    assert ttft.sum <= engine.metrics.e2e_request_latency.sum  # each request's first token came before its end
    # inter-token latency: one observation per token after a sequence's first (4 tokens each: 3 gaps), each
    # gap shorter than its request's whole latency
    itl = engine.metrics.inter_token_latency
    assert itl.count == 3 * 3 and sum(itl.counts) == itl.count
    assert 0 < itl.sum < engine.metrics.e2e_request_latency.sum
    assert "# TYPE mlx_infer_inter_token_latency_seconds histogram" in text
    assert 'mlx_infer_inter_token_latency_seconds_bucket{le="+Inf"} 9\n' in text


def test_histogram_counts_a_value_many_times():
    h = Histogram((0.1, 1.0))
    h.observe(0.5, 3)
    h.observe(0.05)
    assert h.snapshot() == {"buckets": [(0.1, 1), (1.0, 4), (math.inf, 4)], "sum": pytest.approx(1.55), "count": 4}


def test_histogram_buckets_are_cumulative_and_inclusive():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap["buckets"] == [(0.1, 2), (1.0, 4), (math.inf, 5)]  # a value on a bound counts in its bucket (le)
    assert snap["count"] == 5 and snap["sum"] == pytest.approx(4.65)
    text = prometheus_text({"time_to_first_token_seconds": snap})
    assert 'mlx_infer_time_to_first_token_seconds_bucket{le="0.1"} 2\n' in text
    assert 'mlx_infer_time_to_first_token_seconds_bucket{le="+Inf"} 5\n' in text
    assert text.endswith("mlx_infer_time_to_first_token_seconds_sum 4.65\n"
                         "mlx_infer_time_to_first_token_seconds_count 5\n")


# -- the scheduler alone (no model) ------------------------------------------------


def _live(n_tokens: int, order: int) -> LiveRequest:
    # distinct prompts (a shared first page would make the later one wait to reuse it)
    req = EngineRequest(prompt_ids=[100 * order + i for i in range(n_tokens)], max_tokens=4)
    return LiveRequest(req, handle=None, order=order, limit=4)  # type: ignore[arg-type]


def test_scheduler_admits_fifo_by_pages_and_preempts_youngest():
    store = PagedKVStore(num_layers=1, num_pages=9, page_size=4)  # 8 usable pages
    sched = Scheduler(store, max_batch=3)
    a, b, c, d = _live(9, 1), _live(5, 2), _live(20, 3), _live(2, 4)
    for r in (a, b, c, d):
        sched.enqueue(r)
    admitted, unfit = sched.admit()
    # a needs 3 pages; b needs 2 (+1 headroom for a); c needs 6 (+2): blocks the queue, d waits behind it.
    assert admitted == [a, b] and not unfit and list(sched.waiting) == [c, d]
    assert a.state == b.state == "prefill" and a.prefilled == 0
    assert sched.youngest() is b
    sched.preempt(b)
    assert b.state == WAITING and b.preemptions == 1 and list(sched.waiting) == [b, c, d]
    assert store.pool.num_used_pages() == 0  # nothing written yet: a holds no page
    sched.release(a)
    assert sched.running == [] and a.seq is None
    admitted, _ = sched.admit()
    assert admitted == [b]  # c needs 6 pages + 1 headroom; b's 2 are promised: 5 left
    sched.release(b)
    admitted, _ = sched.admit()
    assert admitted == [c, d]
    big = _live(40, 5)
    sched.waiting.appendleft(big)
    sched.running.clear()
    _, unfit = sched.admit()
    assert unfit == [big]


def test_scheduler_single_token_prompt_starts_decoding():
    store = PagedKVStore(num_layers=1, num_pages=9, page_size=4)
    sched = Scheduler(store, max_batch=2)
    r = _live(1, 1)
    sched.enqueue(r)
    sched.admit()
    assert r.state == DECODE and r.next_input == 100


def test_memory_is_released_after_requests(tiny):
    loaded = tiny("llama")
    with Engine(loaded, EngineConfig(page_size=4)) as engine:
        engine.generate([EngineRequest(prompt_ids=p, max_tokens=8) for p in prompts(4)])
        time.sleep(0.1)
        idle, kv = mx.get_active_memory(), engine.store.nbytes
        engine.generate([EngineRequest(prompt_ids=p, max_tokens=8) for p in prompts(16)])
        time.sleep(0.1)
        # Only the KV storage may have grown (state/paged/growth.py: it keeps what it materialized).
        assert mx.get_active_memory() <= idle + (engine.store.nbytes - kv) + 64 * 1024
        assert engine.store.pool.num_used_pages() == 0


@pytest.mark.slow
def test_real_model_concurrent_greedy_equals_generate_tokens(real_model):
    ps = [real_model.tokenizer.encode(t) for t in ("The capital of France is", "def add(a, b):",
                                                     "Once upon a time")]
    want = [[t.token for t in alone(real_model, p, 3)] for p in ps]
    with Engine(real_model, EngineConfig(memory_budget_gb=0.5)) as engine:
        results = engine.generate([EngineRequest(prompt_ids=p, max_tokens=3) for p in ps], timeout=600)
    assert [r.token_ids for r in results] == want
    assert real_model.tokenizer.decode(results[0].token_ids).startswith(" the capital")


def test_quantized_kv_pages(tmp_path):
    """8-bit paged KV: the engine's batched decode equals generate_tokens over the same quantized store."""
    from mlx_infer.state.paged import LayerKV, PagedModel

    loaded = load_model(make_tiny_model_dir(tmp_path, "llama", head_dim=32))
    ps = prompts(6)
    want = []
    for p in ps:
        store = PagedKVStore.for_model(loaded.model, num_pages=256, page_size=4, kv_scheme=LayerKV(8, 32))
        want.append([t.token for t in generate_tokens(PagedModel(loaded.model, store), p, max_tokens=12,
                                                      eos_token_ids=loaded.eos_token_ids)])
    with Engine(loaded, EngineConfig(page_size=4, kv_scheme=LayerKV(8, 32))) as engine:
        results = engine.generate([EngineRequest(prompt_ids=p, max_tokens=12) for p in ps])
    assert [r.token_ids for r in results] == want


def test_scheduler_memory_limit_holds_admissions():
    store = PagedKVStore(num_layers=1, num_pages=64, page_size=4)
    sched = Scheduler(store, max_batch=8, memory_limit=1)  # any MLX allocation is over 1 byte
    a, b = _live(3, 1), _live(3, 2)
    sched.enqueue(a)
    sched.enqueue(b)
    mx.eval(mx.ones((16,)))
    keep = mx.ones((1024,))
    mx.eval(keep)
    admitted, _ = sched.admit()
    assert admitted == [a]  # the first always runs (no deadlock); the rest wait for memory


def test_mixed_windows_engine_releases_window_pages_and_reuses_prefixes(tiny):
    """Gemma 3 tiny (window 8 on 2 of 3 layers): the windowed group has its own, smaller pool."""
    loaded = tiny("gemma3")
    prompt = prompts(1, base=60)[0]  # 60 tokens: 7 windows
    config = EngineConfig(page_size=4, prefill_step_size=16, max_batch=4)
    sizes = pool_pages(loaded.model, config, loaded.context_length)
    hold = -(-(8 - 1 + DEFAULT_WINDOW_SLACK + 16) // 4) + 1  # window + slack + one prefill chunk
    assert sizes[1] == 4 * hold + 1 < sizes[0]  # global pages get the bytes windows do not need
    want = [t.token for t in alone(loaded, prompt, 40)]
    # Preallocated: a storage that grows on demand evicts released (cached) pages before it grows
    # (state/paged/growth.py), so the window pages this test reuses would not survive.
    with Engine(loaded, replace(config, grow_pool=False)) as engine:
        assert [g.num_pages for g in engine.store.groups] == sizes
        first = engine.generate([EngineRequest(prompt_ids=prompt, max_tokens=40)])[0]
        # A second prompt sharing 44 tokens: the windowed pages at its end were indexed chunk
        # by chunk before the window released them, so every group hits.
        other = prompt[:44] + [9] * 10
        second, third = engine.generate([EngineRequest(prompt_ids=other, max_tokens=8),
                                         EngineRequest(prompt_ids=prompt, max_tokens=40)])
        for g in engine.store.groups:
            assert engine.store.pages.pool(g.index).num_used_pages() == 0
        engine.store.pages.check()
    assert first.token_ids == want and third.token_ids == want
    assert first.cached_tokens == 0 and second.cached_tokens == 44 and third.cached_tokens == 56
    assert second.token_ids == [t.token for t in alone(loaded, other, 8)]


def test_scheduler_holds_a_prompt_whose_first_page_is_being_prefilled():
    store = PagedKVStore(num_layers=1, num_pages=17, page_size=4)
    sched = Scheduler(store, max_batch=4)
    ids = list(range(5, 15))
    a = LiveRequest(EngineRequest(prompt_ids=ids, max_tokens=4), None, 1, 4)  # type: ignore[arg-type]
    b = LiveRequest(EngineRequest(prompt_ids=ids + [3], max_tokens=4), None, 2, 4)  # type: ignore[arg-type]
    other = LiveRequest(EngineRequest(prompt_ids=ids, max_tokens=4, namespace="x"), None, 3, 4)  # type: ignore[arg-type]
    for r in (a, b, other):
        sched.enqueue(r)
    admitted, _ = sched.admit()
    assert admitted == [a] and list(sched.waiting) == [b, other]  # b waits for a's first pages
    a.seq.reserve(len(ids))
    a.seq.offsets[:] = [len(ids)]
    a.prefilled, a.state = len(ids), DECODE
    sched.register_prompt(a, len(ids))  # a's prefill is done: its full pages are indexed
    admitted, _ = sched.admit()
    assert admitted == [b, other]  # (other was queued behind b; another namespace reuses nothing)
    assert b.cached_tokens == 8 and b.prefilled == 8 and other.cached_tokens == 0
