"""Hostile HTTP input: every bad request is a 4xx in OpenAI's error shape, never a 5xx or a hang.

Each case is one request to a real uvicorn on 127.0.0.1 (a free port, a thread of
the test process) serving a tiny random model; every request has a timeout, and
after each case the server must still answer. The CLI's ``serve`` errors (one
line, exit 2) and the lifecycle cases (clients that time out, chunked oversize
bodies, slow clients, shutdown) are at the end.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig
from mlx_infer.server import ServerThread, create_app
from mlx_infer.server.guard import GuardConfig
from tiny import make_tiny_model_dir

TIMEOUT = 30.0  # every request of this file: a hang fails, it does not block the suite
KEY = "sekret-key"
MiB = 2**20


def start(loaded, *, config=EngineConfig(page_size=8), drain_timeout_s=2.0, header_timeout_s=10.0, **kw):
    engine = Engine(loaded, config).start()
    srv = ServerThread(create_app(engine, model_id="tiny", **kw), drain_timeout_s=drain_timeout_s,
                       header_timeout_s=header_timeout_s).start()
    return SimpleNamespace(url=srv.url, port=srv.port, engine=engine, srv=srv)


def stop(s):
    s.srv.stop()
    s.engine.stop()


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


@pytest.fixture(autouse=True)
def no_server_errors(caplog):
    """No case may reach the last-resort 500 (it logs on mlx_infer.server)."""
    caplog.set_level(logging.ERROR, logger="mlx_infer.server")
    yield
    assert not [r for r in caplog.records if r.name == "mlx_infer.server"], caplog.text


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


# -- the table --------------------------------------------------------------------

C, CH = "/v1/completions", "/v1/chat/completions"
OK_MSG = [{"role": "user", "content": "hi"}]


def comp(**kw):
    return {"model": "tiny", "prompt": "Hello", "max_tokens": 2, **kw}


def chat(**kw):
    return {"model": "tiny", "messages": OK_MSG, "max_tokens": 2, **kw}


def msg(**m):
    return chat(messages=[{"role": "user", "content": "hi", **m}])


# (id, path, body: dict -> JSON, bytes -> raw, status, param or None)
CASES = [
    # malformed bodies
    ("not-json", C, b"{not json", 400, None),
    ("truncated-json", C, b'{"model": "tiny", "prompt": "x"', 400, None),
    ("empty-body", C, b"", 422, None),
    ("json-null", C, b"null", 422, None),
    ("json-array", C, b"[]", 422, None),
    ("json-string", C, b'"hello"', 422, None),
    ("json-number", C, b"123", 422, None),
    ("invalid-utf8", C, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),
    ("nan-literal", C, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("infinity-literal", C, b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', 400, "top_p"),
    ("float-overflow", C, b'{"model": "tiny", "prompt": "x", "temperature": 1e400}', 400, "temperature"),
    ("int-over-4300-digits", C, b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
    ("deep-nesting", C, b'{"model": "tiny", "prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400, None),
    # wrong types (strict: no coercion)
    ("max_tokens-string", C, comp(max_tokens="10"), 422, "max_tokens"),
    ("max_tokens-true", C, comp(max_tokens=True), 422, "max_tokens"),
    ("max_tokens-float", C, comp(max_tokens=10.0), 422, "max_tokens"),
    ("temperature-string", C, comp(temperature="0.5"), 422, "temperature"),
    ("temperature-bool", C, comp(temperature=True), 422, "temperature"),
    ("stream-string", C, comp(stream="yes"), 422, "stream"),
    ("stream-int", C, comp(stream=1), 422, "stream"),
    ("model-int", C, comp(model=123), 422, "model"),
    ("model-missing", C, {"prompt": "x"}, 422, "model"),
    ("prompt-int", C, comp(prompt=123), 422, "prompt"),
    ("prompt-object", C, comp(prompt={"a": 1}), 422, "prompt"),
    ("prompt-mixed-list", C, comp(prompt=[1, "a"]), 422, "prompt"),
    ("prompt-bool-ids", C, comp(prompt=[True, False]), 422, "prompt"),
    ("stop-int", C, comp(stop=5), 422, "stop"),
    ("stop-int-list", C, comp(stop=[1]), 422, "stop"),
    ("logit_bias-list", C, comp(logit_bias=[1, 2]), 422, "logit_bias"),
    ("logit_bias-string-value", C, comp(logit_bias={"5": "x"}), 422, "logit_bias"),
    ("seed-string", C, comp(seed="1"), 422, "seed"),
    ("n-string", C, comp(n="2"), 422, "n"),
    ("stream_options-string", C, comp(stream=True, stream_options="x"), 422, "stream_options"),
    ("messages-string", CH, chat(messages="hello"), 422, "messages"),
    ("messages-missing", CH, {"model": "tiny"}, 422, "messages"),
    ("messages-empty", CH, chat(messages=[]), 422, "messages"),
    ("message-no-role", CH, chat(messages=[{"content": "x"}]), 422, "messages"),
    ("message-role-int", CH, chat(messages=[{"role": 1, "content": "x"}]), 422, "messages"),
    ("message-content-int", CH, msg(content=5), 422, "messages"),
    ("message-part-no-type", CH, msg(content=[{"text": "x"}]), 422, "messages"),
    ("chat-logprobs-string", CH, chat(logprobs="true"), 422, "logprobs"),
    ("chat-top_logprobs-float", CH, chat(logprobs=True, top_logprobs=2.5), 422, "top_logprobs"),
    ("max_completion_tokens-string", CH, chat(max_completion_tokens="5"), 422, "max_completion_tokens"),
    # unknown fields
    ("unknown-field", C, comp(foo=1), 400, "foo"),
    ("unknown-field-chat", CH, chat(response_format={"type": "json_object"}), 400, "response_format"),
    ("unknown-message-field", CH, msg(bar=1), 400, "messages"),
    # logit_bias keys and values
    ("logit_bias-superscript-two", C, comp(logit_bias={"²": 1}), 400, "logit_bias"),
    ("logit_bias-circled-one", C, comp(logit_bias={"①": 1}), 400, "logit_bias"),
    ("logit_bias-arabic-digits", C, comp(logit_bias={"٣": 1}), 400, "logit_bias"),
    ("logit_bias-5000-digits", C, comp(logit_bias={"1" * 5000: 1}), 400, "logit_bias"),
    ("logit_bias-negative", C, comp(logit_bias={"-1": 1}), 400, "logit_bias"),
    ("logit_bias-space", C, comp(logit_bias={" 5": 1}), 400, "logit_bias"),
    ("logit_bias-empty-key", C, comp(logit_bias={"": 1}), 400, "logit_bias"),
    ("logit_bias-out-of-vocab", C, comp(logit_bias={"99999": 1}), 400, "logit_bias"),
    ("logit_bias-duplicate-id", C, comp(logit_bias={"05": 1, "5": 1}), 400, "logit_bias"),
    ("logit_bias-value-101", C, comp(logit_bias={"5": 101}), 400, "logit_bias"),
    ("logit_bias-value-huge", C, comp(logit_bias={"5": -1e308}), 400, "logit_bias"),
    ("logit_bias-too-many", C, comp(logit_bias={str(i): 1 for i in range(1025)}), 400, "logit_bias"),
    # bad unicode (JSON escapes of lone surrogates)
    ("surrogate-prompt", C, b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}', 400, "prompt"),
    ("surrogate-prompt-list", C, b'{"model": "tiny", "prompt": ["a\\udfff"], "max_tokens": 2}', 400, "prompt"),
    ("surrogate-chat", CH, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}', 400,
     "messages"),
    ("surrogate-stop", C, b'{"model": "tiny", "prompt": "x", "stop": "\\ud800"}', 400, "stop"),
    ("surrogate-model", C, b'{"model": "\\ud800", "prompt": "x"}', 400, "model"),
    ("surrogate-logit_bias-key", C, b'{"model": "tiny", "prompt": "x", "logit_bias": {"\\ud800": 1}}', 400,
     "logit_bias"),
    ("surrogate-unknown-key", C, b'{"model": "tiny", "prompt": "x", "\\ud800": 1}', 422, None),
    # out-of-range values
    ("max_tokens-1e9", C, comp(max_tokens=10**9), 400, "max_tokens"),
    ("max_tokens-1e30", C, comp(max_tokens=10**30), 400, "max_tokens"),
    ("max_tokens-zero", C, comp(max_tokens=0), 400, "max_tokens"),
    ("max_tokens-negative", C, comp(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens-over-context", C, comp(prompt=[5] * 4100, max_tokens=4096), 400, "max_tokens"),
    ("max_completion_tokens-zero", CH, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("temperature-negative", C, comp(temperature=-1), 400, "temperature"),
    ("top_p-zero", C, comp(top_p=0), 400, "top_p"),
    ("top_p-two", C, comp(top_p=2), 400, "top_p"),
    ("min_p-two", C, comp(min_p=2), 400, "min_p"),
    ("top_k-negative", C, comp(top_k=-1), 400, "top_k"),
    ("top_k-huge", C, comp(top_k=2**40), 400, "top_k"),
    ("repetition_penalty-zero", C, comp(repetition_penalty=0), 400, "repetition_penalty"),
    ("presence_penalty-3", C, comp(presence_penalty=3), 400, "presence_penalty"),
    ("frequency_penalty-minus-5", C, comp(frequency_penalty=-5), 400, "frequency_penalty"),
    ("seed-negative", C, comp(seed=-1), 400, "seed"),
    ("seed-2**70", C, comp(seed=2**70), 400, None),
    ("n-zero", C, comp(n=0), 400, "n"),
    ("n-two", C, comp(n=2), 400, "n"),
    ("logprobs-6", C, comp(logprobs=6), 400, "logprobs"),
    ("logprobs-negative", C, comp(logprobs=-1), 400, "logprobs"),
    ("top_logprobs-21", CH, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top_logprobs-without-logprobs", CH, chat(top_logprobs=3), 400, "top_logprobs"),
    ("echo", C, comp(echo=True), 400, "echo"),
    ("suffix", C, comp(suffix="x"), 400, "suffix"),
    ("best_of", C, comp(best_of=3), 400, "best_of"),
    ("tools", CH, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("stop-17-strings", C, comp(stop=[str(i) for i in range(17)]), 400, "stop"),
    ("stop-empty-string", C, comp(stop=[""]), 400, "stop"),
    # prompts and messages
    ("prompt-empty", C, comp(prompt=""), 400, "prompt"),
    ("prompt-empty-list", C, comp(prompt=[]), 400, "prompt"),
    ("prompt-empty-nested", C, comp(prompt=[[]]), 400, "prompt"),
    ("prompt-batched", C, comp(prompt=["a", "b"]), 400, "prompt"),
    ("prompt-negative-id", C, comp(prompt=[-1]), 400, None),
    ("prompt-id-1e20", C, comp(prompt=[10**20]), 400, None),
    ("prompt-id-out-of-vocab", C, comp(prompt=[5, 320]), 400, None),
    ("prompt-over-context", C, comp(prompt=[5] * 8200), 400, "prompt"),
    ("message-role-tool", CH, chat(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]), 400,
     "messages"),
    ("message-role-unknown", CH, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
    ("message-tool_calls", CH, msg(role="assistant", tool_calls=[{"id": "1"}]), 400, "messages"),
    ("message-image-part", CH, msg(content=[{"type": "image_url", "image_url": {"url": "x"}}]), 400, "messages"),
    # models
    ("model-unknown", C, comp(model="nope"), 404, "model"),
    ("model-empty", CH, chat(model=""), 404, "model"),
    ("model-path-traversal", C, comp(model="../../etc/passwd"), 404, "model"),
]


def test_the_table_is_large_and_distinct():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_hostile_body(server, name, path, body, status, param):
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"},
                       timeout=TIMEOUT)
    else:
        r = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
    assert_openai_error(r, status, param)
    assert_serves(server.url)


@pytest.mark.parametrize("method,path,status", [
    ("GET", C, 405), ("PUT", CH, 405), ("DELETE", "/v1/models", 405), ("POST", "/health", 405),
    ("PATCH", "/metrics", 405), ("GET", "/v1/nothing", 404), ("GET", "/v1/models/nope", 404), ("GET", "/", 404),
    ("POST", "/v1/completions/extra", 404), ("GET", "/%2e%2e/%2e%2e/etc/passwd", 404),
])
def test_wrong_method_or_path(server, method, path, status):
    r = httpx.request(method, server.url + path, timeout=TIMEOUT)
    assert_openai_error(r, status)
    assert_serves(server.url)


@pytest.mark.parametrize("headers,body", [
    ({"content-type": "text/plain"}, b'{"model": "tiny", "prompt": "x"}'),
    ({"content-type": "application/x-www-form-urlencoded"}, b"model=tiny&prompt=x"),
])
def test_wrong_content_type(server, headers, body):
    r = httpx.post(server.url + C, content=body, headers=headers, timeout=TIMEOUT)
    assert 400 <= r.status_code < 500
    assert_openai_error(r, r.status_code)


def test_oversize_body_with_content_length(server):
    r = httpx.post(server.url + C, json=comp(prompt="x" * (9 * MiB)), timeout=TIMEOUT)
    assert assert_openai_error(r, 413)["code"] == "request_too_large"
    assert_serves(server.url)


def test_content_length_over_limit_refused_before_the_body(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000000\r\n\r\n{")
        status, body = _read_response(s)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"


def test_chunked_oversize_body_refused_while_reading(server):
    """100 MB offered chunked (no Content-Length): a 413 once 8 MiB passed, not a 200."""
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b'{"model": "tiny", "prompt": "' + b"x" * (MiB - 30)
        piece = b"%x\r\n%s\r\n" % (len(chunk), chunk)
        try:
            for _ in range(100):
                s.sendall(piece)
                sent += len(chunk)
                chunk = b"x" * MiB
                piece = b"%x\r\n%s\r\n" % (len(chunk), chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed: what we want
        status, body = _read_response(s)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert sent < 40 * MiB  # it stopped reading near the limit, far short of the 100 MB
    assert_serves(server.url)


def _read_response(s: socket.socket) -> tuple[int, bytes]:
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
    return status, body


# -- auth -------------------------------------------------------------------------


@pytest.mark.parametrize("auth", [
    None, "Bearer nope", "Bearer", f"Bearer {KEY[:-1]}", f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer  {KEY}",
    f"Bearer {KEY.upper()}", KEY, f"Bearer {KEY}\u00e9".encode("utf-8"),
])
def test_bad_api_key(keyed, auth):
    headers = {} if auth is None else {"authorization": auth}
    r = httpx.post(keyed.url + C, json=comp(), headers=headers, timeout=TIMEOUT)
    assert assert_openai_error(r, 401)["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json", "/v1/models", "/v1/nothing"])
def test_api_key_guards_every_endpoint_but_health(keyed, path):
    assert_openai_error(httpx.get(keyed.url + path, timeout=TIMEOUT), 401)
    assert httpx.get(keyed.url + path, headers={"authorization": f"Bearer {KEY}"}, timeout=TIMEOUT).status_code \
        in (200, 404)
    assert httpx.get(keyed.url + "/health", timeout=TIMEOUT).status_code == 200


def test_api_key_scheme_case_and_public_choice(tiny_loaded):
    s = start(tiny_loaded, guard=GuardConfig(api_key=KEY, public=("health", "metrics")))
    try:
        assert httpx.get(s.url + "/metrics", timeout=TIMEOUT).status_code == 200
        assert_openai_error(httpx.get(s.url + "/openapi.json", timeout=TIMEOUT), 401)
        ok = httpx.post(s.url + C, json=comp(), headers={"authorization": f"bearer {KEY}"}, timeout=TIMEOUT)
        assert ok.status_code == 200  # the scheme is case-insensitive (RFC 9110)
    finally:
        stop(s)


@pytest.mark.parametrize("kw", [
    {"api_key": "ключ"}, {"api_key": ""}, {"api_key": "has space"}, {"api_key": "tab\tkey"},
    {"public": ("everything",)}, {"max_body_bytes": 0}, {"body_timeout_s": 0},
])
def test_bad_guard_settings(kw):
    from mlx_infer.errors import MlxInferError

    with pytest.raises(MlxInferError):
        GuardConfig(**kw)


# -- the CLI's serve: one line, exit 2 -------------------------------------------------


def _bad_generation_dir(tiny_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad-gen"
    shutil.copytree(tiny_dir, bad)
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "temperature": -1, "top_p": 7}))
    return bad


@pytest.mark.parametrize("argv,needle", [
    (["--port", "99999"], "--port"), (["--port", "-1"], "--port"), (["--memory-budget", "inf"], "--memory-budget"),
    (["--memory-budget", "nan"], "--memory-budget"), (["--memory-budget", "0"], "--memory-budget"),
    (["--max-tokens", "0"], "--max-tokens"), (["--max-batch", "0"], "--max-batch"),
    (["--prefill-step-size", "-4"], "--prefill-step-size"), (["--drain-timeout", "inf"], "--drain-timeout"),
    (["--header-timeout", "0"], "--header-timeout"), (["--body-timeout", "-1"], "--body-timeout"),
    (["--api-key", "ключ"], "--api-key"), (["--api-key", "a b"], "--api-key"), (["--api-key", ""], "--api-key"),
    (["--public", "everything"], "public"), (["--host", ""], "--host"),
    (["--host", "no.such.host.invalid"], "cannot listen"), (["--model", "/nonexistent/model"], "nonexistent"),
    (["--model", "BAD_GEN"], "generation_config"), (["--port", "BUSY"], "cannot listen"),
])
def test_serve_cli_errors_are_one_line(argv, needle, tiny_dir, tmp_path, capsys):
    from mlx_infer.cli import main

    argv = list(argv)
    busy = None
    if "BAD_GEN" in argv:
        argv[argv.index("BAD_GEN")] = str(_bad_generation_dir(tiny_dir, tmp_path))
    if "BUSY" in argv:
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        argv[argv.index("BUSY")] = str(busy.getsockname()[1])
    before = set(os.listdir(tmp_path))
    try:
        t0 = time.perf_counter()
        rc = main(["serve", *(["--port", "0"] if "--port" not in argv else []), *argv])
        elapsed = time.perf_counter() - t0
    finally:
        if busy is not None:
            busy.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("mlx-infer: error:"), err
    assert needle in err[0] and "Traceback" not in err[0]
    assert elapsed < 30
    assert set(os.listdir(tmp_path)) - before <= {"bad-gen"}  # nothing else written


def test_bad_generation_defaults_refused_by_create_app(tiny_dir, tmp_path):
    from mlx_infer.errors import MlxInferError

    loaded = load_model(_bad_generation_dir(tiny_dir, tmp_path))
    engine = Engine(loaded, EngineConfig(page_size=8))
    try:
        with pytest.raises(MlxInferError, match="generation_config"):
            create_app(engine, model_id="tiny")
    finally:
        engine.stop()


def test_exposure_is_said_and_an_open_bind_warns():
    from mlx_infer.server import ServeOptions
    from mlx_infer.server.run import exposure_lines

    assert any(line.startswith("WARNING") for line in exposure_lines(ServeOptions(host="0.0.0.0")))
    assert not any(line.startswith("WARNING") for line in exposure_lines(ServeOptions()))
    keyed = " ".join(exposure_lines(ServeOptions(host="0.0.0.0", api_key="k")))
    assert "public (no key): /health;" in keyed and "WARNING" not in keyed
    docs = " ".join(exposure_lines(ServeOptions(api_key="k", public=("docs",))))
    assert "/openapi.json" in docs and "/health" not in docs


# -- lifecycle: clients that time out, slow clients, shutdown ---------------------------


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


LONG = 4000  # tokens: a runaway request at this length outlives every bound below


def test_non_streaming_clients_that_time_out_are_cancelled(server):
    """Six raw clients and one OpenAI SDK client with retries (3 attempts), all timing out on
    non-streaming requests for 4000 tokens: within 3 s every request is cancelled and every
    page is back, and far fewer tokens were made than were asked for."""
    base = wait_idle(server.url, 10)
    body = comp(prompt="Hello world", max_tokens=LONG, ignore_eos=True)
    errors = []

    def raw() -> None:
        try:
            httpx.post(server.url + C, json=body, timeout=0.5)
            errors.append("no timeout")
        except httpx.TimeoutException:
            pass

    def sdk() -> None:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=2, timeout=0.5)
        try:
            c.chat.completions.create(model="tiny", messages=OK_MSG, max_tokens=LONG, extra_body={"ignore_eos": True})
            errors.append("no timeout (sdk)")
        except openai.APITimeoutError:
            pass

    threads = [threading.Thread(target=raw) for _ in range(6)] + [threading.Thread(target=sdk)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    m = wait_idle(server.url, 3)
    assert m["running"] == 0 and m["queue_depth"] == 0 and m["kv_pages_used"] == 0, m
    assert m["kv_pages_free"] == m["kv_pages_total"]
    cancelled = 'requests_total{finish_reason="cancelled"}'
    assert m.get(cancelled, 0) - base.get(cancelled, 0) >= 9  # 6 raw + 3 SDK attempts, each cancelled
    made = m["generation_tokens_total"] - base["generation_tokens_total"]
    assert made < 9 * LONG / 4, made  # cut early, not run to max_tokens
    time.sleep(0.5)
    assert metrics(server.url)["generation_tokens_total"] == m["generation_tokens_total"]  # nothing runs on


def test_slowloris_headers_are_cut(tiny_loaded):
    """40 connections dribbling their headers: closed after the 1 s header timeout; others still served."""
    s = start(tiny_loaded, header_timeout_s=1.0)
    socks = []
    try:
        for _ in range(40):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=TIMEOUT)
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            socks.append(c)
        assert_serves(s.url)
        t0 = time.perf_counter()
        for c in socks:
            c.settimeout(5)
            try:
                assert c.recv(1024) == b""  # closed by the server
            except ConnectionResetError:
                pass
        assert time.perf_counter() - t0 < 5
        assert_serves(s.url)
    finally:
        for c in socks:
            c.close()
        stop(s)


def test_slow_body_gets_408(tiny_loaded):
    s = start(tiny_loaded, guard=GuardConfig(body_timeout_s=1.0))
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=TIMEOUT) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\":")
            t0 = time.perf_counter()
            status, body = _read_response(c)
            assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
            assert 0.5 < time.perf_counter() - t0 < 5
        assert_serves(s.url)
    finally:
        stop(s)


def test_shutdown_is_bounded_and_says_what_it_cut(tiny_loaded):
    """Shutdown with a long stream, a long non-streaming request and a half-sent body in flight:
    done within drain (1 s) + grace; the stream ends with finish_reason "abort" and a
    server_shutdown error event (never "stop"), the waiting request gets a 503."""
    s = start(tiny_loaded, drain_timeout_s=1.0, max_tokens_cap=LONG)
    lines, answers = [], []

    def stream() -> None:
        with httpx.stream("POST", s.url + C, json=comp(max_tokens=LONG, ignore_eos=True, stream=True),
                          timeout=TIMEOUT) as r:
            lines.extend(line for line in r.iter_lines() if line)

    body = chat(max_tokens=LONG, ignore_eos=True)
    threads = [threading.Thread(target=stream), threading.Thread(target=lambda: answers.append(
        httpx.post(s.url + CH, json=body, timeout=TIMEOUT)))]
    for t in threads:
        t.start()
    slow = socket.create_connection(("127.0.0.1", s.port), timeout=TIMEOUT)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    try:
        deadline = time.perf_counter() + 10
        while metrics(s.url)["running"] < 2 and time.perf_counter() < deadline:
            time.sleep(0.05)
        t0 = time.perf_counter()
        s.srv.stop(timeout=20)
        took = time.perf_counter() - t0
        for t in threads:
            t.join(timeout=20)
        assert not s.srv.alive and took < 1.0 + 1.0 + 1.5, took
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        reasons = [c["choices"][0]["finish_reason"] for c in events if c.get("choices")]
        assert reasons[-1] == "abort" and "stop" not in reasons and "length" not in reasons
        assert events[-1]["error"]["code"] == "server_shutdown" and lines[-1] == "data: [DONE]"
        assert len(answers) == 1 and assert_openai_error(answers[0], 503)["code"] == "server_shutdown"
        slow.settimeout(5)
        got = slow.recv(4096)
        assert got == b"" or got.startswith(b"HTTP/1.1 503")
    finally:
        slow.close()
        s.engine.stop()


def test_sigint_on_the_cli_server(tiny_dir):
    """`mlx-infer serve` under SIGINT: the stream in flight ends as aborted, the process exits (130)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "mlx_infer.cli", "serve", "--model", str(tiny_dir), "--port", "0",
                             "--drain-timeout", "0.5", "--max-tokens", str(LONG), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        port = None
        deadline = time.perf_counter() + 60
        while port is None and time.perf_counter() < deadline:
            line = proc.stdout.readline()
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            port = int(m.group(1)) if m else None
            assert line or proc.poll() is None
        assert port, "no banner"
        url = f"http://127.0.0.1:{port}"
        lines = []
        body = comp(model=tiny_dir.name, max_tokens=LONG, ignore_eos=True, stream=True)
        with httpx.stream("POST", url + C, json=body, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:
                    proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=20)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        reasons = [c["choices"][0]["finish_reason"] for c in events if c.get("choices")]
        assert "stop" not in reasons and reasons[-1] == "abort"
        assert events[-1]["error"]["code"] == "server_shutdown"
        assert rc == 130
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
