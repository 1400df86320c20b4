"""/tokenize, /detokenize, max_model_len, CORS, chat_template_kwargs, --served-model-name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig
from mlx_infer.server import ServerThread, create_app
from tiny import make_tiny_model_dir

KW_TEMPLATE = ("{{ bos_token }}{% if shout %}LOUD {% endif %}{% for m in messages %}<|{{ m['role'] }}|>"
               "{{ m['content'] }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = make_tiny_model_dir(tmp_path_factory.mktemp("extras"), "llama")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": KW_TEMPLATE}))
    loaded = load_model(d)
    engine = Engine(loaded, EngineConfig(page_size=8)).start()
    srv = ServerThread(create_app(engine, model_id="tiny", allowed_origins=("http://app.example",))).start()
    plain = ServerThread(create_app(engine, model_id="tiny")).start()
    yield SimpleNamespace(url=srv.url, plain=plain.url, loaded=loaded, dir=d, engine=engine)
    srv.stop()
    plain.stop()
    engine.stop()


def test_tokenize_detokenize(server):
    tok = server.loaded.tokenizer
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": "Hello world!"}).json()
    assert r["tokens"] == tok.encode("Hello world!") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == server.loaded.context_length
    r2 = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world!", "add_special_tokens": False}).json()
    assert r2["tokens"] == tok.encode("Hello world!", add_special_tokens=False)
    msgs = [{"role": "user", "content": "Hi"}]
    r3 = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()
    assert r3["tokens"] == tok.apply_chat_template(msgs)
    r4 = httpx.post(server.url + "/tokenize", json={"messages": msgs, "chat_template_kwargs": {"shout": True}}).json()
    assert tok.decode(r4["tokens"]).startswith("<bos>LOUD ")
    d = httpx.post(server.url + "/detokenize", json={"model": "tiny", "tokens": r["tokens"]}).json()
    assert d["prompt"] == tok.decode(r["tokens"])


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs"),
    ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_token_routes_refuse(server, path, body, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.post(server.url + "/detokenize", json={"model": "other", "tokens": [1]}).status_code == 404


def test_chat_template_kwargs_reach_the_template(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    a = httpx.post(server.url + "/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
    b = httpx.post(server.url + "/v1/chat/completions",
                   json={**body, "chat_template_kwargs": {"shout": True}}).json()["usage"]["prompt_tokens"]
    assert b > a
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "chat_template_kwargs": {"tools": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_models_report_max_model_len(server):
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert data[0]["max_model_len"] == server.loaded.context_length
    assert httpx.get(server.url + "/v1/models/tiny").json()["max_model_len"] == server.loaded.context_length


def test_cors_only_when_asked(server):
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.get(server.url + "/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(server.plain + "/v1/models", headers={"Origin": "http://app.example"})
    assert "access-control-allow-origin" not in r.headers  # off by default


def test_served_model_name(server):
    from mlx_infer.server.run import ServeOptions, build

    app, engine, model_id = build(ServeOptions(model=str(server.dir), served_model_name="my-model",
                                               allowed_origins=("*",)))
    try:
        assert model_id == "my-model"
        with ServerThread(app) as s:
            assert [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]] == ["my-model"]
            assert httpx.post(s.url + "/v1/completions", json={"model": str(server.dir), "prompt": "a",
                                                              "max_tokens": 1}).status_code == 404
    finally:
        engine.stop()


def test_n_choices_and_prompt_batches(server):
    import openai

    from mlx_infer.generation.autoregressive import generate
    from mlx_infer.sampling import SamplingParams

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=3, seed=7,
                                       temperature=1.0, max_tokens=6)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # seeds 7, 8, 9: distinct draws
    one = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], seed=8,
                                         temperature=1.0, max_tokens=6)
    assert one.choices[0].message.content == texts[1]  # choice i draws with seed + i
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert 3 <= r.usage.completion_tokens <= 18

    prompts = ["The capital of", "Hello"]
    c = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=5, temperature=0)
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]
    for k, prompt in enumerate(prompts):  # greedy: each prompt's two choices are its generate() text
        with generate(server.loaded, prompt, sampling=SamplingParams(), max_tokens=5) as g:
            want = "".join(t.text for t in g)
        assert c.choices[2 * k].text == c.choices[2 * k + 1].text == want
    ids = [server.loaded.tokenizer.encode(p) for p in prompts]
    c2 = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    assert [ch.text for ch in c2.choices] == [c.choices[0].text, c.choices[2].text]
    assert c2.usage.prompt_tokens == sum(map(len, ids))


def test_echo_and_continue_final_message(server):
    tok = server.loaded.tokenizer
    base = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    plain = httpx.post(server.url + "/v1/completions", json={**base, "prompt": "Hello"}).json()["choices"][0]["text"]
    echoed = httpx.post(server.url + "/v1/completions", json={**base, "prompt": "Hello", "echo": True}).json()
    assert echoed["choices"][0]["text"] == "Hello" + plain
    ids = tok.encode("Hello")
    by_ids = httpx.post(server.url + "/v1/completions", json={**base, "prompt": ids, "echo": True}).json()
    assert by_ids["choices"][0]["text"] == tok.decode(ids) + plain
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={**base, "prompt": "Hello", "echo": True, "stream": True}) as r:
        texts = [json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                 if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert texts[0] == "Hello" and "".join(texts) == "Hello" + plain

    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The capital"}]
    body = {**base, "messages": msgs, "add_generation_prompt": False, "continue_final_message": True}
    n = httpx.post(server.url + "/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
    want = tok.encode(tok.decode(tok.apply_chat_template(msgs, add_generation_prompt=False))
                      .rsplit("<eos>", 1)[0].removeprefix("<bos>"))
    assert n == len(want)
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_n_choices_share_the_prompts_pages(server):
    """n = 2: the second choice reuses the first's prompt pages (prefilled once, full pages shared)."""
    ids = server.loaded.tokenizer.encode("Zz qq shared prompt pages, n of two. " * 3)  # no other test's prefix
    assert len(ids) > 40
    before = server.engine.stats()
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": ids + [7], "n": 2, "seed": 3,
                                                         "temperature": 1.0, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    after = server.engine.stats()
    computed = after["prefill_tokens_total"] - before["prefill_tokens_total"]
    shared = (len(ids) + 1 - 1) // 8 * 8  # the full pages of the prompt (its last token is always computed)
    assert after["cached_tokens_total"] - before["cached_tokens_total"] == shared
    assert computed == 2 * (len(ids) + 1) - shared
