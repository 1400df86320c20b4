"""/v1/completions as evaluation harnesses use it: echo with prompt logprobs (lm-eval-harness's
log-likelihoods), skip_special_tokens, and streaming with n > 1 and prompt arrays.

Oracle for prompt logprobs: the model's own teacher-forced log-softmax, one forward of the
whole prompt without a cache, computed here.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import mlx.core as mx
import openai
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig
from mlx_infer.server import ServerThread, create_app
from mlx_infer.server.prompt_logprobs import prompt_logprobs
from tiny import make_tiny_model_dir

ATOL = 1e-4
PROMPT = "The capital of France is Paris. Hello world!"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    loaded = load_model(make_tiny_model_dir(tmp_path_factory.mktemp("cmpl"), "llama"))
    engine = Engine(loaded, EngineConfig(page_size=8)).start()
    srv = ServerThread(create_app(engine, model_id="tiny")).start()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield SimpleNamespace(url=srv.url, loaded=loaded, client=client, engine=engine)
    srv.stop()
    engine.stop()


def teacher_forced(model, ids: list[int]) -> mx.array:
    """``(L - 1, V)``: log-softmax at each position that predicts the next prompt token."""
    logits = model(mx.array(ids, dtype=mx.uint32)[None])[0, :-1].astype(mx.float32)  # (L - 1, V)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (L - 1, V)


def check_prompt_part(loaded, ids: list[int], lp, k: int) -> None:
    tok = loaded.tokenizer
    want = teacher_forced(loaded.model, ids)  # (L - 1, V)
    assert lp.tokens[:len(ids)] == [tok.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    chosen = [want[p, ids[p + 1]].item() for p in range(len(ids) - 1)]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(chosen, abs=ATOL)
    for p in range(1, len(ids)):
        best = mx.argsort(-want[p - 1])[:k].tolist()
        top = lp.top_logprobs[p]
        expect = {tok.decode([i]): want[p - 1, i].item() for i in best}
        expect.setdefault(tok.decode([ids[p]]), chosen[p - 1])  # the prompt token is always listed
        assert set(top) == set(expect)
        assert [top[s] for s in expect] == pytest.approx(list(expect.values()), abs=ATOL)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_chunked_prompt_logprobs_equal_one_forward(tmp_path, family):
    loaded = load_model(make_tiny_model_dir(tmp_path, family))  # mistral: a window of 8, crossed by chunks
    ids = loaded.tokenizer.encode(PROMPT * 2)
    assert len(ids) > 20
    want = teacher_forced(loaded.model, ids)  # (L - 1, V)
    got = prompt_logprobs(loaded.model, ids, 2, chunk=5)
    assert got.logprobs[0] is None and got.top[0] is None and len(got.logprobs) == len(ids)
    assert got.logprobs[1:] == pytest.approx([want[p, ids[p + 1]].item() for p in range(len(ids) - 1)], abs=ATOL)
    assert [[i for i, _ in t] for t in got.top[1:]] == mx.argsort(-want, axis=-1)[:, :2].tolist()


def test_echo_prompt_logprobs(server):
    loaded, client = server.loaded, server.client
    ids = loaded.tokenizer.encode(PROMPT)
    only = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    c = only.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length"
    assert only.usage.prompt_tokens == len(ids) and only.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(ids)
    check_prompt_part(loaded, ids, c.logprobs, 3)
    assert c.logprobs.text_offset == [sum(len(loaded.tokenizer.decode([i])) for i in ids[:p]) for p in range(len(ids))]

    # with generation: the prompt's logprobs, then the generated tokens' (as without echo)
    plain = client.completions.create(model="tiny", prompt=PROMPT, logprobs=3, max_tokens=3, temperature=0)
    both = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=3, max_tokens=3,
                                     temperature=0).choices[0]
    assert both.text == PROMPT + plain.choices[0].text
    check_prompt_part(loaded, ids, both.logprobs, 3)
    assert both.logprobs.tokens[len(ids):] == plain.choices[0].logprobs.tokens
    assert both.logprobs.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs,
                                                                    abs=ATOL)
    assert len(both.logprobs.top_logprobs) == len(both.logprobs.tokens) == len(both.logprobs.text_offset)

    # lm-eval-harness's shape: a batch of token-id prompts, logprobs=1, max_tokens=1; ctx/continuation split
    ctx = loaded.tokenizer.encode("The capital of France is")
    cont = loaded.tokenizer.encode(" Paris.", add_special_tokens=False)
    batch = client.completions.create(model="tiny", prompt=[ctx + cont, ids], echo=True, logprobs=1,
                                      max_tokens=1, temperature=0)
    assert [ch.index for ch in batch.choices] == [0, 1]
    first = batch.choices[0].logprobs
    want = teacher_forced(loaded.model, ctx + cont)
    ll = sum(first.token_logprobs[len(ctx):-1])
    assert ll == pytest.approx(sum(want[p - 1, (ctx + cont)[p]].item() for p in range(len(ctx), len(ctx + cont))),
                               abs=ATOL * len(cont))
    check_prompt_part(loaded, ids, batch.choices[1].logprobs, 1)


def test_echo_without_logprobs_and_bad_echo_only(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "echo": True,
                                                         "max_tokens": 0})
    assert r.status_code == 200 and r.json()["choices"][0] == {"index": 0, "text": "Hello", "logprobs": None,
                                                                 "finish_reason": "length"}
    for body, param in [({"prompt": "Hello", "max_tokens": 0}, "max_tokens"),  # no echo: nothing to answer
                        ({"prompt": [5, 99999], "echo": True, "max_tokens": 0, "logprobs": 1}, "prompt"),
                        ({"prompt": [5] * 300, "echo": True, "max_tokens": 0, "logprobs": 1}, "prompt")]:
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_streamed_echo_carries_prompt_logprobs(server):
    loaded = server.loaded
    ids = loaded.tokenizer.encode(PROMPT)
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0}
    whole = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT
    assert first["logprobs"]["token_logprobs"] == whole["logprobs"]["token_logprobs"][:len(ids)]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    lps = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert lps[0] is None and lps[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=ATOL)
    assert len(lps) == len(ids) + 3
    offsets = [v for c in chunks for v in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]


def test_skip_special_tokens(server):
    """``<pad>`` (id 2, an added special token) forced by logit_bias: no text unless skip_special_tokens is false."""
    tok = server.loaded.tokenizer
    pad = tok._tok.token_to_id("<pad>")
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(pad): 100}}
    r = httpx.post(server.url + "/v1/completions", json=body).json()
    assert r["choices"][0]["text"] == "" and r["usage"]["completion_tokens"] == 3
    kept = httpx.post(server.url + "/v1/completions", json={**body, "skip_special_tokens": False}).json()
    assert kept["choices"][0]["text"] == "<pad>" * 3
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "logit_bias": {str(pad): 100}}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"] == ""
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as s:
        texts = [json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                 if line.startswith("data: {")]
    assert "".join(texts) == ""
    r = httpx.post(server.url + "/v1/completions", json={**body, "skip_special_tokens": "no"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "skip_special_tokens"


def read_stream(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_streamed_n_and_prompt_arrays_reassemble(server):
    prompts = ["The capital of", "Hello"]
    body = {"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 1.0, "seed": 3,
            "logprobs": 1, "stream_options": {"include_usage": True}}
    whole = httpx.post(server.url + "/v1/completions", json=body | {"stream_options": None}).json()
    chunks = read_stream(server.url, "/v1/completions", body)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    lps: dict[int, list] = {}
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        assert c["object"] == "text_completion" and c["id"] == chunks[0]["id"]
        texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
        lps.setdefault(ch["index"], []).extend(ch["logprobs"]["token_logprobs"] if ch["logprobs"] else [])
        if ch["finish_reason"]:
            assert ch["index"] not in finish
            finish[ch["index"]] = ch["finish_reason"]
    assert sorted(texts) == sorted(finish) == [0, 1, 2, 3]
    for want in whole["choices"]:  # seeded: each streamed choice is the non-streamed one
        i = want["index"]
        assert texts[i] == want["text"] and finish[i] == want["finish_reason"]
        assert lps[i] == pytest.approx(want["logprobs"]["token_logprobs"], abs=ATOL)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]

    msgs = [{"role": "user", "content": "Hi"}]
    chat = {"model": "tiny", "messages": msgs, "n": 3, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    want = httpx.post(server.url + "/v1/chat/completions", json=chat).json()["choices"]
    got: dict[int, str] = {}
    roles: dict[int, int] = {}
    for c in read_stream(server.url, "/v1/chat/completions", chat):
        (ch,) = c["choices"]
        roles[ch["index"]] = roles.get(ch["index"], 0) + (ch["delta"].get("role") == "assistant")
        got[ch["index"]] = got.get(ch["index"], "") + (ch["delta"].get("content") or "")
    assert roles == {0: 1, 1: 1, 2: 1}
    assert [got[w["index"]] for w in want] == [w["message"]["content"] for w in want]
    assert len(set(got.values())) > 1  # distinct draws


def test_openai_client_streams_several_choices(server):
    stream = server.client.completions.create(model="tiny", prompt=["Hello", "The capital"], max_tokens=4,
                                              temperature=0, stream=True)
    texts: dict[int, str] = {}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    plain = server.client.completions.create(model="tiny", prompt=["Hello", "The capital"], max_tokens=4,
                                             temperature=0)
    assert texts == {ch.index: ch.text for ch in plain.choices}


def test_streamed_echo_only(server):
    body = {"model": "tiny", "prompt": [PROMPT, "Hello"], "echo": True, "logprobs": 1, "max_tokens": 0,
            "stream_options": {"include_usage": True}}
    whole = httpx.post(server.url + "/v1/completions", json=body | {"stream_options": None}).json()
    chunks = read_stream(server.url, "/v1/completions", body)
    got = sorted((c["choices"][0] for c in chunks[:-1]), key=lambda ch: ch["index"])
    assert got == whole["choices"]
    assert chunks[-1]["usage"] == whole["usage"] and whole["usage"]["completion_tokens"] == 0


def test_prompt_logprobs_while_the_engine_decodes(server):
    """Scoring rides the engine's prefill beside a running generation: values unchanged (batched with it)."""
    import threading

    ids = server.loaded.tokenizer.encode(PROMPT)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 120, "ignore_eos": True, "temperature": 0}
    busy = threading.Thread(target=lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=60))
    busy.start()
    try:
        for _ in range(3):
            c = server.client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=2, max_tokens=0)
            check_prompt_part(server.loaded, ids, c.choices[0].logprobs, 2)
    finally:
        busy.join()


def test_continuous_usage_counts_every_chunks_tokens(server):
    """vLLM's ``continuous_usage_stats``: every chunk carries the usage so far; a chunk's tokens (its
    logprobs' entries: one chunk may carry several when the loop lags) are the count's increase."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0, "logprobs": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = read_stream(server.url, "/v1/completions", body)
    whole = httpx.post(server.url + "/v1/completions", json=body | {"stream": False, "stream_options": None}).json()
    seen, text = 0, ""
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        got = c["usage"]["completion_tokens"]
        assert got - seen == len(ch["logprobs"]["tokens"]) and c["usage"]["prompt_tokens"] == whole["usage"][
            "prompt_tokens"]
        seen, text = got, text + ch["text"]
    assert seen == 12 and text == whole["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7, "n": 2,
            "logprobs": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    seen = 0
    for c in read_stream(server.url, "/v1/chat/completions", chat)[:-1]:  # n = 2: choices interleave
        (ch,) = c["choices"]
        got = c["usage"]["completion_tokens"]
        assert got - seen == len((ch["logprobs"] or {}).get("content") or [])
        seen = got
    assert seen == 14


def test_a_lagging_stream_gets_its_tokens_in_fewer_chunks(server):
    """The handle's ``batches()`` hands a consumer that lags everything that arrived: a request that
    ended before its consumer started streams as one batch, the same events in order."""
    import asyncio

    from mlx_infer.engine import EngineRequest
    from mlx_infer.sampling import SamplingParams

    engine = server.engine
    handle = engine.submit(EngineRequest(prompt_ids=[1, 2, 3], sampling=SamplingParams(temperature=0.0),
                                         max_tokens=6, ignore_eos=True))
    result = handle.result(timeout=60)

    async def collect() -> tuple[list[list], list]:
        return [b async for b in handle.batches()], [e async for e in handle]

    batches, events = asyncio.run(collect())
    assert len(batches) == 1 and batches[0] == events
    assert [e.token for e in events] == result.token_ids and events[-1].finish_reason == "length"
