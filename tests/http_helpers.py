"""Shared pieces of the HTTP server tests (test_hostile_server.py, test_server_lifecycle.py) and of
the path matrices' server path (test_variant_matrix.py, test_families_paths.py).

Every server is a real uvicorn on 127.0.0.1 and a free port, in a thread of the test
process, serving a tiny random model; every request has a timeout (:data:`TIMEOUT`).
"""

from __future__ import annotations

import logging
import re
import socket
import time
from types import SimpleNamespace

import httpx
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig
from mlx_infer.server import ServerThread, create_app
from mlx_infer.server.guard import GuardConfig
from tiny import make_tiny_model_dir

TIMEOUT = 30.0  # every request: a hang fails, it does not block the suite
KEY = "sekret-key"
MiB = 2**20
LONG = 4000  # tokens: a runaway request at this length outlives every bound the tests set


def start(loaded, *, config=EngineConfig(page_size=8), drain_timeout_s=2.0, header_timeout_s=10.0, http="auto",
          **kw):
    engine = Engine(loaded, config).start()
    srv = ServerThread(create_app(engine, model_id="tiny", **kw), drain_timeout_s=drain_timeout_s,
                       header_timeout_s=header_timeout_s, http=http).start()
    return SimpleNamespace(url=srv.url, port=srv.port, engine=engine, srv=srv)


def stop(s):
    s.srv.stop()
    s.engine.stop()


def completion_text(engine: Engine, prompt: list[int], max_tokens: int) -> str:
    """One greedy ``/v1/completions`` request (EOS ignored, special tokens kept: random tiny models
    emit them) through a server started on the running ``engine`` and stopped after; its text."""
    server = ServerThread(create_app(engine, model_id="tiny")).start()
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "skip_special_tokens": False})
    finally:
        server.stop()
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == max_tokens
    return body["choices"][0]["text"]


def rendered_text(loaded, tokens: list[int]) -> str:
    """``tokens`` as the engine renders a generation that ends by length (streaming detokenizer)."""
    detok = loaded.tokenizer.detokenizer()
    return "".join(detok.add(t) for t in tokens) + detok.flush()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # A long context, so a runaway request would run for many seconds.
    return make_tiny_model_dir(tmp_path_factory.mktemp("hostile"), "llama", max_position_embeddings=8192)


@pytest.fixture(scope="module")
def tiny_loaded(tiny_dir):
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def server(tiny_loaded):
    s = start(tiny_loaded, max_tokens_cap=4096)
    yield s
    stop(s)


@pytest.fixture(scope="module")
def keyed(tiny_loaded):
    s = start(tiny_loaded, guard=GuardConfig(api_key=KEY))
    yield s
    stop(s)


def _snapshot(*dirs) -> dict:
    from pathlib import Path

    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for d in dirs for p in Path(d).rglob("*")
            if p.is_file()}


@pytest.fixture(scope="module", autouse=True)
def no_files_touched(tiny_dir):
    """No file of the model, the working directory or the cache changes (nor appears) during a module."""
    import os

    dirs = [tiny_dir, os.getcwd(), os.environ.get("MLX_INFER_CACHE") or os.path.expanduser("~/.cache/mlx-infer")]
    dirs = [d for d in dirs if os.path.isdir(d)]
    before = {k: v for k, v in _snapshot(*dirs).items() if "__pycache__" not in k and "/.git/" not in k}
    yield
    after = {k: v for k, v in _snapshot(*dirs).items() if "__pycache__" not in k and "/.git/" not in k}
    assert after == before, sorted(set(after.items()) ^ set(before.items()))[:5]


@pytest.fixture(autouse=True)
def no_server_errors(caplog):
    """No case may reach the last-resort 500 (it logs on mlx_infer.server)."""
    caplog.set_level(logging.ERROR, logger="mlx_infer")
    yield
    assert not [r for r in caplog.records if r.name.startswith("mlx_infer")], caplog.text


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def assert_serves(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2},
                   timeout=TIMEOUT)
    assert r.status_code == 200, r.text


C, CH = "/v1/completions", "/v1/chat/completions"
OK_MSG = [{"role": "user", "content": "hi"}]


def comp(**kw):
    return {"model": "tiny", "prompt": "Hello", "max_tokens": 2, **kw}


def chat(**kw):
    return {"model": "tiny", "messages": OK_MSG, "max_tokens": 2, **kw}


def msg(**m):
    return chat(messages=[{"role": "user", "content": "hi", **m}])


def read_response(s: socket.socket) -> tuple[int, bytes]:
    """Status and body of one HTTP/1.1 response (Content-Length framed) read from ``s``."""
    data = b""
    s.settimeout(TIMEOUT)
    while b"\r\n\r\n" not in data:
        got = s.recv(65536)
        if not got:
            break
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    m = re.search(rb"content-length: *(\d+)", head, re.I)
    want = int(m.group(1)) if m else 0
    while len(body) < want:
        got = s.recv(65536)
        if not got:
            break
        body += got
    return status, body[:want] if m else body


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return {m[1] + (m[2] or ""): float(m[3])
            for m in re.finditer(r"^mlx_infer_(\w+)(\{[^}]*\})? ([-\d.e+]+)$", text, re.M)}


def wait_idle(url: str, within: float) -> dict[str, float]:
    deadline = time.perf_counter() + within
    while True:
        m = metrics(url)
        if (m["running"] == 0 and m["queue_depth"] == 0 and m["kv_pages_used"] == 0) \
                or time.perf_counter() > deadline:
            return m
        time.sleep(0.05)


