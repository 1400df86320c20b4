"""The OpenAI-compatible server, driven by the official ``openai`` client over loopback.

Oracle: ``generate`` / ``generate_tokens`` on the same model, one request at a
time (greedy text equal exactly; logprobs within ``LOGPROB_ATOL``, as in
test_engine.py). Every server here is a real uvicorn on 127.0.0.1 and a free
port, in a thread of the test process.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig
from mlx_infer.generation.autoregressive import generate, generate_tokens, newline_ids, prompt_ids_for
from mlx_infer.sampling import SamplingParams
from mlx_infer.server import ServerThread, create_app
from tiny import make_tiny_model_dir

LOGPROB_ATOL = 1e-4
PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]


def start(loaded, config=EngineConfig(page_size=8), **kw):
    engine = Engine(loaded, config).start()
    srv = ServerThread(create_app(engine, model_id="tiny", **kw)).start()
    return SimpleNamespace(url=srv.url, engine=engine, loaded=loaded, srv=srv)


def stop(s):
    s.srv.stop()
    s.engine.stop()


@pytest.fixture(scope="module")
def tiny_loaded(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("srv"), "llama"))


@pytest.fixture(scope="module")
def server(tiny_loaded):
    s = start(tiny_loaded)
    yield s
    stop(s)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^mlx_infer_(\w+) ([-\d.e+]+)$", text, re.M)}


# -- completions and chat ----------------------------------------------------------


def test_completion_greedy_equals_generate(client, tiny_loaded):
    want = "".join(t.text for t in generate(tiny_loaded, PROMPT, max_tokens=12))
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason in ("length", "stop")
    n_prompt = len(tiny_loaded.tokenizer.encode(PROMPT))
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # Token ids as the prompt give the same continuation.
    ids = tiny_loaded.tokenizer.encode(PROMPT)
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0).choices[0].text == want


def test_chat_greedy_equals_generate(client, tiny_loaded):
    want = "".join(t.text for t in generate(tiny_loaded, MESSAGES, max_tokens=10))
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=10, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(prompt_ids_for(tiny_loaded, MESSAGES))
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_stop_strings(client, tiny_loaded):
    full = "".join(t.text for t in generate(tiny_loaded, PROMPT, max_tokens=20))
    stop = full[4:7]
    want = "".join(t.text for t in generate(tiny_loaded, PROMPT, max_tokens=20, stop=[stop]))
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    s = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in s) == want


def test_seeds_reproduce_and_match_generate_tokens(client, tiny_loaded):
    ids = tiny_loaded.tokenizer.encode(PROMPT)
    sampling = SamplingParams(temperature=1.0, top_k=50, seed=1234)
    want = [t.token for t in generate_tokens(tiny_loaded.model, ids, sampling=sampling, max_tokens=12,
                                             eos_token_ids=tiny_loaded.eos_token_ids,
                                             newline_token_ids=newline_ids(tiny_loaded))]
    kw = dict(model="tiny", prompt=ids, max_tokens=12, temperature=1.0, extra_body={"top_k": 50}, logprobs=0)
    a = client.completions.create(seed=1234, **kw)
    b = client.completions.create(seed=1234, **kw)
    assert a.choices[0].text == b.choices[0].text
    # special tokens add no text (skip_special_tokens, true by default as in vLLM)
    assert a.choices[0].text == tiny_loaded.tokenizer.decode((t for t in want if t not in tiny_loaded.eos_token_ids),
                                                             skip_special_tokens=True)
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a.choices[0].text}) > 1


def test_logprobs(client, tiny_loaded):
    ids = prompt_ids_for(tiny_loaded, MESSAGES)
    want = list(generate_tokens(tiny_loaded.model, ids, sampling=SamplingParams(logprobs=True, top_logprobs=3),
                                max_tokens=6, eos_token_ids=tiny_loaded.eos_token_ids))
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([t.logprob for t in want], abs=LOGPROB_ATOL)
    tok = tiny_loaded.tokenizer
    assert [[x.token for x in c.top_logprobs] for c in content] == \
        [[tok.decode([i]) for i, _ in t.top_logprobs] for t in want]
    c = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert all(len(t) <= 2 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)


def test_cached_tokens_in_usage(client):
    prompt = "Hello world! This is a tiny tokenizer for tests. " * 4  # several 8-token pages
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 8
    assert second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens - 1
    assert second.choices[0].text == first.choices[0].text


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    m = metrics(server.url)
    for name in ("queue_depth", "running", "kv_pages_used", "kv_pages_free", "prefix_hit_rate",
                 "generation_tokens_per_second", "memory_active_bytes"):
        assert name in m
    assert m["kv_pages_total"] > 0
    before, before_chunks = m["time_to_first_token_seconds_count"], m["http_time_to_first_chunk_seconds_count"]
    before_gaps = m["inter_token_latency_seconds_count"]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    after = metrics(server.url)  # the engine's latency histograms count the request (vLLM's three)
    assert after["time_to_first_token_seconds_count"] == before + 1
    assert after["inter_token_latency_seconds_count"] == before_gaps + out.usage.completion_tokens - 1
    assert after["e2e_request_latency_seconds_count"] >= before + 1
    assert 0 < after["time_to_first_token_seconds_sum"] <= after["e2e_request_latency_seconds_sum"]
    # the server's own: endpoint to first SSE chunk, streamed requests only
    assert after["http_time_to_first_chunk_seconds_count"] == before_chunks
    for _ in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, stream=True):
        pass
    streamed = metrics(server.url)
    assert streamed["http_time_to_first_chunk_seconds_count"] == before_chunks + 1
    assert streamed["http_time_to_first_chunk_seconds_sum"] > after["http_time_to_first_chunk_seconds_sum"]


# -- errors ----------------------------------------------------------------------


def _post(url: str, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, **kw)
    return httpx.post(url + path, json=body, **kw)


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": list(range(5, 305))}, 400, "prompt"),  # context is 256
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 17, "stream": True}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"99999": 1}}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 9}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 99999]}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "seed": -1}, 400, "seed"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 422, "messages"),
    ("/v1/chat/completions", {"model": "tiny"}, 422, "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "many"}, 422, "max_tokens"),
    ("/v1/completions", b"{not json", 400, None),
])
def test_bad_input_gets_openai_errors(server, path, body, status, param):
    r = _post(server.url, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_oversized_body_unknown_route_and_pool_limit(server, tiny_loaded):
    r = _post(server.url, "/v1/completions", {"model": "tiny", "prompt": "x" * (9 * 2**20)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    small = start(tiny_loaded, EngineConfig(page_size=4, num_pages=10))  # 9 pages: 36 tokens
    try:
        r = _post(small.url, "/v1/completions", {"model": "tiny", "prompt": list(range(5, 65))})
        assert r.status_code == 413 and "pool" in r.json()["error"]["message"]
    finally:
        stop(small)


def test_api_key_requires_bearer_token(tiny_loaded):
    s = start(tiny_loaded, api_key="sekret")
    try:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        assert _post(s.url, "/v1/completions", body).status_code == 401
        assert _post(s.url, "/v1/completions", body, headers={"authorization": "Bearer nope"}).status_code == 401
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(s.url + "/health").status_code == 200  # health stays open for probes
    finally:
        stop(s)


# -- load -------------------------------------------------------------------------


def test_load_with_disconnects_returns_every_page(server, tiny_loaded):
    """32 concurrent clients, 320 requests of mixed lengths: streamed, every fifth dropped mid-stream,
    and every seventh otherwise a non-streaming request whose client times out (it must be
    cancelled like a dropped stream); the whole load twice.

    Memory: the engine's compiled decode step traces once per (batch size, bucketed context) shape
    it meets, and each trace keeps its small constants, so the first pass grows memory by a bounded
    amount that depends on scheduling (1.25 MB in one CI run). A per-request leak would grow
    it again in the second pass: that is what the test bounds (1 MB over 320 requests)."""
    url = server.url
    rng = random.Random(0)
    jobs = [(i, [rng.randrange(5, 300) for _ in range(rng.randrange(2, 80))], rng.randrange(4, 48),
             i % 5 == 4) for i in range(320)]
    # Warm-up, then the idle memory level (the KV storage is allocated by then).
    openai.OpenAI(base_url=url + "/v1", api_key="x").completions.create(model="tiny", prompt=[5] * 40, max_tokens=4)
    time.sleep(0.2)
    idle = metrics(url)["memory_active_bytes"]
    first = _load_pass(url, jobs)
    assert first["memory_active_bytes"] <= idle + 16 * 2**20  # the traces, bounded
    second = _load_pass(url, jobs)
    assert second["memory_active_bytes"] <= first["memory_active_bytes"] + 2**20


def _load_pass(url: str, jobs: list) -> dict:
    """Run every job over 32 concurrent connections; check every page came back; return /metrics."""
    failures, completed, dropped, timed_out = [], [0], [0], [0]

    async def one(client: httpx.AsyncClient, job) -> None:
        i, prompt, max_tokens, drop = job
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "temperature": 0.7 if i % 2 else 0, "seed": i, "ignore_eos": bool(i % 3)}
        if i % 7 == 3 and not drop:  # non-streaming, as long as the context allows, the client gives up
            body.update(stream=False, ignore_eos=True, max_tokens=255 - len(prompt))
            try:
                r = await client.post("/v1/completions", json=body, timeout=0.05)
                failures.append((i, "no timeout", r.status_code))
            except httpx.TimeoutException:
                timed_out[0] += 1
            return
        chunks, done = 0, False
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                failures.append((i, resp.status_code, await resp.aread()))
                return
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        failures.append((i, chunk))
                    chunks += 1
                    if drop and chunks == 2:
                        dropped[0] += 1
                        return  # leave mid-stream: the connection closes under the server
        if not done:
            failures.append((i, "no [DONE]"))
        else:
            completed[0] += 1

    async def main() -> None:
        queue = list(jobs)
        async with httpx.AsyncClient(base_url=url, timeout=60,
                                     limits=httpx.Limits(max_connections=64)) as client:
            async def worker() -> None:
                while queue:
                    await one(client, queue.pop())
            await asyncio.gather(*(worker() for _ in range(32)))

    t0 = time.perf_counter()
    asyncio.run(main())
    elapsed = time.perf_counter() - t0
    assert not failures, failures[:5]
    assert completed[0] + dropped[0] + timed_out[0] == 320 and dropped[0] > 0 and timed_out[0] > 0
    for _ in range(100):  # the engine frees a dropped request's pages at its next iteration
        m = metrics(url)
        if m["kv_pages_used"] == 0 and m["running"] == 0:
            break
        time.sleep(0.05)
    assert m["kv_pages_used"] == 0 and m["running"] == 0 and m["queue_depth"] == 0
    assert m["kv_pages_free"] == m["kv_pages_total"]
    assert elapsed < 60
    return m


# -- schema fuzzing ------------------------------------------------------------------


def test_fuzz_openapi_schema_no_server_errors(server):
    """Bounded schemathesis pass over every operation, valid and invalid bodies: no 5xx, OpenAI errors."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    deadline = time.perf_counter() + 30
    statuses: dict[int, int] = {}
    for op in schema.get_all_operations():
        operation = op.ok()
        post = operation.method.upper() == "POST"
        for mode in ([schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE] if post
                     else [schemathesis.GenerationMode.POSITIVE]):

            @settings(max_examples=40 if post else 10, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck), derandomize=True)
            @given(case=operation.as_strategy(mode))
            def check(case) -> None:
                if time.perf_counter() > deadline:
                    return
                if isinstance(case.body, dict):
                    if "model" in case.body and hash(str(case.body)) % 2:
                        case.body["model"] = "tiny"  # half the cases get past the model check
                    for key in ("max_tokens", "max_completion_tokens"):  # bound the work, keep the type
                        if isinstance(case.body.get(key), int) and not isinstance(case.body[key], bool):
                            case.body[key] = min(case.body[key], 16)
                response = case.call(timeout=60)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                assert response.status_code < 500, (case.body, response.text)
                if response.status_code >= 400:
                    assert "error" in response.json()
            check()
    assert statuses.get(200) and statuses.get(422) and statuses.get(404) and statuses.get(400), statuses


# -- the real model (slow) ------------------------------------------------------------


@pytest.mark.slow
def test_real_model_served_greedy_equals_generate_tokens(real_model):
    loaded = real_model
    s = start(loaded, EngineConfig(page_size=16, memory_budget_gb=0.5))
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=600)
        ids = loaded.tokenizer.encode(PROMPT)
        want = [t.token for t in generate_tokens(loaded.model, ids, max_tokens=6,
                                                 eos_token_ids=loaded.eos_token_ids)]
        r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
        assert r.choices[0].text == loaded.tokenizer.decode(want)
        assert r.choices[0].text.startswith(" the capital of")
        # The embedded model is a base model without a chat template: chat is a clear 400, never an
        # invented template; streamed completions equal generate's text and reuse the cached prefix.
        chat = [{"role": "user", "content": "Say hi."}]
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="tiny", messages=chat, max_tokens=4, temperature=0)
        assert "no_chat_template" in str(err.value) or "chat template" in str(err.value)
        long = ("Here is a list of fruits: apples, pears, plums, cherries, peaches, apricots, grapes, melons "
                "and figs. The list has")
        want_text = "".join(t.text for t in generate(loaded, long, max_tokens=4))
        stream = c.completions.create(model="tiny", prompt=long, max_tokens=4, temperature=0, stream=True,
                                      stream_options={"include_usage": True})
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want_text
        again = c.completions.create(model="tiny", prompt=long, max_tokens=1, temperature=0)
        assert again.usage.prompt_tokens >= 17
        assert again.usage.prompt_tokens_details.cached_tokens >= 16  # a full 16-token page reused
        assert again.choices[0].text == want_text[:len(again.choices[0].text)]
    finally:
        stop(s)
