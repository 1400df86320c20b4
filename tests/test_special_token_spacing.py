"""``spaces_between_special_tokens`` (vLLM's field and meaning) in the server's detokenization.

vLLM's incremental detokenizer over a fast tokenizer keeps the decoder's text by default and,
with the field false (and special tokens kept), drops what the decoder put before an added
token that directly follows another. The tiny byte-level tokenizer puts nothing between tokens,
so these tests use it with its decoder removed (``tokenizers`` then joins tokens with spaces).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig
from mlx_infer.server import ServerThread, create_app
from tiny import make_tiny_model_dir


@pytest.fixture(scope="module")
def spaced(tmp_path_factory):
    d = make_tiny_model_dir(tmp_path_factory.mktemp("spaced"), "llama")
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["decoder"] = None  # decode joins tokens with " "
    (d / "tokenizer.json").write_text(json.dumps(tok))
    return load_model(d)


def _text(tokenizer, ids, **kw):
    detok = tokenizer.detokenizer(**kw)
    return "".join(detok.add(t) for t in ids) + detok.flush()


def test_detokenizer_joins_added_tokens_as_vllm(spaced):
    tok = spaced.tokenizer
    pad, user = tok._tok.token_to_id("<pad>"), tok._tok.token_to_id("<|user|>")
    word = tok.encode("Hello", add_special_tokens=False)
    ids = [pad, pad, user, *word, pad, pad]
    kept = tok.decode(ids)
    assert kept.startswith("<pad> <pad> <|user|> ")  # the decoder's own spacing
    assert _text(tok, ids) == kept  # default: as the tokenizer decodes
    joined = _text(tok, ids, spaces_between_special_tokens=False)
    body = tok.decode(word)
    assert joined == "<pad><pad><|user|> " + body + " <pad><pad>"  # only between adjacent added tokens
    # skipped special tokens add no text either way
    assert _text(tok, ids, skip_special_tokens=True, spaces_between_special_tokens=False) == \
        tok.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def server(spaced):
    engine = Engine(spaced, EngineConfig(page_size=8)).start()
    srv = ServerThread(create_app(engine, model_id="tiny")).start()
    yield SimpleNamespace(url=srv.url, loaded=spaced)
    srv.stop()
    engine.stop()


def test_server_field(server):
    pad = server.loaded.tokenizer._tok.token_to_id("<pad>")
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(pad): 100}, "skip_special_tokens": False}

    def text(**kw):
        r = httpx.post(server.url + "/v1/completions", json={**body, **kw}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert text() == text(spaces_between_special_tokens=True) == "<pad> <pad> <pad>"
    assert text(spaces_between_special_tokens=False) == "<pad><pad><pad>"
    assert text(spaces_between_special_tokens=False, skip_special_tokens=True) == ""
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={**body, "stream": True, "spaces_between_special_tokens": False}, timeout=60) as s:
        pieces = [json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(pieces) == "<pad><pad><pad>"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "logit_bias": {str(pad): 100}, "skip_special_tokens": False,
            "spaces_between_special_tokens": False}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.json()["choices"][0]["message"]["content"] == "<pad><pad>", r.text
    r = httpx.post(server.url + "/v1/completions", json={**body, "spaces_between_special_tokens": "maybe"}, timeout=60)
    assert r.status_code == 422 and r.json()["error"]["param"] == "spaces_between_special_tokens"
