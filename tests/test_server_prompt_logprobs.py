"""vLLM's ``prompt_logprobs`` on /v1/completions (each choice) and /v1/chat/completions (the response).

Oracle: the tiny model's own teacher-forced log-softmax, one forward of the whole prompt without
a cache (``teacher_forced``), its ranks and top-k computed here with numpy.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig
from mlx_infer.server import ServerThread, create_app
from test_server_completions import ATOL, PROMPT, teacher_forced
from tiny import make_tiny_model_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    loaded = load_model(make_tiny_model_dir(tmp_path_factory.mktemp("plp"), "llama"))
    engine = Engine(loaded, EngineConfig(page_size=8)).start()
    srv = ServerThread(create_app(engine, model_id="tiny")).start()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield SimpleNamespace(url=srv.url, loaded=loaded, client=client)
    srv.stop()
    engine.stop()


def check_vllm_layout(loaded, ids: list[int], got: list, k: int) -> None:
    """``got`` is vLLM's prompt_logprobs of ``ids``: None first, then the prompt token (its true
    rank) and the k most likely tokens (ranks 1..k), each with its logprob and decoded text."""
    want = np.array(teacher_forced(loaded.model, ids))  # (L - 1, V)
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        row, tok = want[p - 1], ids[p]
        best = np.argsort(-row, kind="stable")[:k].tolist()
        entry = got[p]
        assert set(entry) == {str(i) for i in [tok, *best]}, f"position {p}"
        assert list(entry)[0] == str(tok)  # the prompt token leads, as vLLM lists it
        mine = entry[str(tok)]
        assert mine["logprob"] == pytest.approx(float(row[tok]), abs=ATOL)
        # 1 + how many tokens are more likely (within the tolerance the two computations differ by)
        assert int((row > row[tok] + ATOL).sum()) + 1 <= mine["rank"] <= int((row > row[tok] - ATOL).sum()) + 1
        assert mine["decoded_token"] == loaded.tokenizer.decode([tok])
        for r, i in enumerate(best, 1):
            e = entry[str(i)]
            assert e["logprob"] == pytest.approx(float(row[i]), abs=ATOL)
            assert e["decoded_token"] == loaded.tokenizer.decode([i])
            if i != tok:
                assert e["rank"] == r


@pytest.mark.parametrize("k", [0, 1, 4])
def test_completions_prompt_logprobs_httpx(server, k):
    ids = server.loaded.tokenizer.encode(PROMPT)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": k}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    check_vllm_layout(server.loaded, ids, choice["prompt_logprobs"], k)
    assert choice["logprobs"] is None and len(choice["text"]) > 0  # generation itself is unchanged
    plain = httpx.post(server.url + "/v1/completions", json={**body, "prompt_logprobs": None}, timeout=60).json()
    assert plain["choices"][0]["text"] == choice["text"] and "prompt_logprobs" not in plain["choices"][0]


def test_completions_prompt_logprobs_openai_client_batch_n_and_scoring_only(server):
    tok = server.loaded.tokenizer
    prompts = [PROMPT, "Hello world"]
    out = server.client.completions.create(model="tiny", prompt=prompts, max_tokens=1, n=2, temperature=0,
                                           extra_body={"prompt_logprobs": 2})
    assert len(out.choices) == 4
    for c in out.choices:  # prompt k's choices are 2k, 2k + 1: each its own prompt's scores
        check_vllm_layout(server.loaded, tok.encode(prompts[c.index // 2]), c.model_extra["prompt_logprobs"], 2)
    # max_tokens 0: scoring only (no echo needed): nothing generated
    only = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0,
                                            extra_body={"prompt_logprobs": 3})
    assert only.choices[0].text == "" and only.usage.completion_tokens == 0
    check_vllm_layout(server.loaded, tok.encode(PROMPT), only.choices[0].model_extra["prompt_logprobs"], 3)
    # with echo + logprobs too: both layouts, each with its own k (the engine scores the larger)
    for echo_k, k in ((1, 3), (4, 1)):
        both = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True,
                                                logprobs=echo_k, extra_body={"prompt_logprobs": k})
        ids = tok.encode(PROMPT)
        check_vllm_layout(server.loaded, ids, both.choices[0].model_extra["prompt_logprobs"], k)
        tops = both.choices[0].logprobs.top_logprobs
        assert tops[0] is None and all(1 <= len(t) <= echo_k + 1 for t in tops[1:])  # its top and the token (by text)
    # a one-token prompt has nothing to score
    one = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": ids[:1], "max_tokens": 1,
                                                           "prompt_logprobs": 1}, timeout=60).json()
    assert one["choices"][0]["prompt_logprobs"] == [None]


def test_chat_prompt_logprobs(server):
    tok = server.loaded.tokenizer
    messages = [{"role": "user", "content": "Hello there, how are you?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    out = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0,
                                                n=2, extra_body={"prompt_logprobs": 2})
    check_vllm_layout(server.loaded, ids, out.model_extra["prompt_logprobs"], 2)
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages,
                                                              "max_tokens": 1, "prompt_logprobs": 0}, timeout=60)
    assert r.status_code == 200
    check_vllm_layout(server.loaded, ids, r.json()["prompt_logprobs"], 0)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra, status, words", [
    ({"prompt_logprobs": 21}, 400, "0..20"),
    ({"prompt_logprobs": -2}, 400, "0..20"),
    ({"prompt_logprobs": -1}, 400, "whole vocabulary"),
    ({"prompt_logprobs": 2, "stream": True}, 400, "stream"),
    ({"prompt_logprobs": "2"}, 422, "prompt_logprobs"),
    ({"prompt_logprobs": True}, 422, "prompt_logprobs"),
    ({"prompt_logprobs": 1.5}, 422, "prompt_logprobs"),
])
def test_bad_prompt_logprobs(server, path, extra, status, words):
    body = {"model": "tiny", "max_tokens": 1, **extra}
    body.update({"prompt": PROMPT} if path.endswith("/completions") and "chat" not in path
                else {"messages": [{"role": "user", "content": "Hi"}]})
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == "prompt_logprobs"
