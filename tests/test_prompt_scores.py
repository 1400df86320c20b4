"""Prompt logprobs scored by the engine (``EngineRequest.prompt_logprobs``, engine/prompt_scores.py):
equal to teacher forcing, computed over the request's own pages, so a prompt the KV pool cannot
hold is refused (413 through the server) and one that fits is admitted against the pool.

Oracle: one forward of the whole prompt without a cache; tolerance 1e-4 (float32, paged vs plain
attention, chunked).
"""

from __future__ import annotations

import httpx
import mlx.core as mx
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest, RequestTooLargeError
from mlx_infer.errors import MlxInferError
from mlx_infer.server import ServerThread, create_app
from tiny import make_tiny_model_dir

ATOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "mistral"])  # mistral: a window of 8, crossed by chunks
def tiny(request, tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param,
                                          max_position_embeddings=2048))


def _want(model, ids):
    logits = model(mx.array(ids, dtype=mx.uint32)[None])[0, :-1].astype(mx.float32)  # (L - 1, V)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (L - 1, V)
    return logp


def _check(loaded, ids, scores, k):
    want = _want(loaded.model, ids)
    assert scores.token_ids == ids and scores.logprobs[0] is None and scores.top[0] is None
    assert scores.logprobs[1:] == pytest.approx([want[p, ids[p + 1]].item() for p in range(len(ids) - 1)], abs=ATOL)
    if k:
        assert [[i for i, _ in t] for t in scores.top[1:]] == mx.argsort(-want, axis=-1)[:, :k].tolist()


def test_engine_scores_equal_teacher_forcing_across_chunks_batches_and_preemption(tiny):
    tok = tiny.tokenizer
    long_ids = tok.encode("The capital of France is Paris. " * 6)
    short = tok.encode("Hello world! This is a tiny tokenizer.")
    assert len(long_ids) > 40
    # chunks of 16 prompt tokens per iteration; a pool small enough to preempt
    cfg = EngineConfig(page_size=8, prefill_step_size=16, num_pages=20, max_batch=4)
    reqs = [EngineRequest(prompt_ids=long_ids, max_tokens=30, prompt_logprobs=3, ignore_eos=True),
            EngineRequest(prompt_ids=short, max_tokens=40, prompt_logprobs=0, ignore_eos=True),
            EngineRequest(prompt_ids=short, max_tokens=40, ignore_eos=True),  # not scored: prefix reuse allowed
            EngineRequest(prompt_ids=long_ids[:30], max_tokens=40, prompt_logprobs=1, ignore_eos=True)]
    with Engine(tiny, cfg) as engine:
        results = engine.generate(reqs, timeout=300)
        stats = engine.stats()
        windowed = any(w is not None for w in engine.store.layer_windows)
    _check(tiny, long_ids, results[0].prompt_logprobs, 3)
    _check(tiny, short, results[1].prompt_logprobs, 0)
    assert results[1].prompt_logprobs.top == [None] * len(short)
    assert results[2].prompt_logprobs is None
    _check(tiny, long_ids[:30], results[3].prompt_logprobs, 1)
    if not windowed:  # a windowed pool holds only the windows: no pressure there
        assert stats["preemptions_total"] > 0  # recomputed scores are the same values
    # every scored prompt token went through the engine's prefill (its pages), none from the prefix cache
    assert stats["prefill_tokens_total"] >= len(long_ids) + len(short) + 30


def test_engine_refuses_what_the_pool_cannot_hold(tiny):
    ids = tiny.tokenizer.encode("The capital of France is Paris. " * 20)
    with Engine(tiny, EngineConfig(page_size=8, num_pages=10)) as engine:
        with pytest.raises(RequestTooLargeError, match="KV pages"):
            engine.submit(EngineRequest(prompt_ids=ids, max_tokens=1, prompt_logprobs=1))
    with pytest.raises(MlxInferError, match="prompt_logprobs"):
        EngineRequest(prompt_ids=[1, 2], prompt_logprobs=21)


def test_server_echo_counts_against_the_pool(tiny):
    ids = tiny.tokenizer.encode("The capital of France is Paris. " * 20)
    assert len(ids) > 150
    engine = Engine(tiny, EngineConfig(page_size=8, num_pages=12)).start()  # 88 tokens of KV
    srv = ServerThread(create_app(engine, model_id="tiny")).start()
    try:
        for body in ({"max_tokens": 0}, {"max_tokens": 1}, {"max_tokens": 0, "stream": True}):
            r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": ids, "echo": True,
                                                             "logprobs": 1, **body}, timeout=60)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        fits = ids[:60]
        before = engine.stats()["prompt_tokens_total"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": fits, "echo": True, "logprobs": 2,
                                                         "max_tokens": 0}, timeout=60)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
        assert len(c["logprobs"]["tokens"]) == len(fits)  # the prompt alone: the engine's token dropped
        want = _want(tiny.model, fits)
        assert c["logprobs"]["token_logprobs"][1:] == pytest.approx(
            [want[p, fits[p + 1]].item() for p in range(len(fits) - 1)], abs=ATOL)
        assert engine.stats()["prompt_tokens_total"] - before == len(fits)  # admitted by the engine
        assert engine.stats()["kv_pages_used"] == 0  # and its pages returned
    finally:
        srv.stop()
        engine.stop()
