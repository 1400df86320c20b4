"""Hostile HTTP input: every bad request is a 4xx in OpenAI's error shape, never a 5xx or a hang.

Each case is one request to a real uvicorn (see http_helpers.py) serving a tiny random
model; every request has a timeout, after each case the server must still answer,
nothing may reach the server's last-resort 500 (which logs), and no file changes.
The ``serve`` CLI's bad options are at the end (one line, exit 2, no traceback).
Lifecycle cases (clients that time out, slow clients, shutdown): test_server_lifecycle.py.
"""

from __future__ import annotations

import json
import os
import socket
import time

import httpx
import pytest

from http_helpers import (C, CH, KEY, MiB, TIMEOUT, assert_openai_error, assert_serves, chat, comp,  # noqa: F401
                          keyed, msg, no_files_touched, no_server_errors, read_response, server, start, stop,
                          tiny_dir, tiny_loaded)
from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig
from mlx_infer.server import create_app
from mlx_infer.server.guard import GuardConfig


# -- the table --------------------------------------------------------------------

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
    ("unknown-field-chat", CH, chat(functions=[]), 400, "functions"),
    ("response_format-yaml", CH, chat(response_format={"type": "yaml"}), 400, "response_format"),
    ("response_format-string", CH, chat(response_format="json"), 422, "response_format"),
    ("stream_options-without-stream", C, comp(stream_options={"include_usage": True}), 400, "stream_options"),
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
    ("n-17", C, comp(n=17), 400, "n"),
    ("n-17-streamed", C, comp(n=17, stream=True), 400, "n"),
    ("logprobs-6", C, comp(logprobs=6), 400, "logprobs"),
    ("logprobs-negative", C, comp(logprobs=-1), 400, "logprobs"),
    ("top_logprobs-21", CH, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top_logprobs-without-logprobs", CH, chat(top_logprobs=3), 400, "top_logprobs"),
    ("echo-only-out-of-vocab", C, comp(prompt=[5, 320], echo=True, logprobs=1, max_tokens=0), 400, "prompt"),
    ("echo-only-over-context", C, comp(prompt=[5] * 8200, echo=True, max_tokens=0), 400, "prompt"),
    ("prompt_logprobs-only-out-of-vocab", C, comp(prompt=[5, 320], prompt_logprobs=1, max_tokens=0), 400, "prompt"),
    ("prompt_logprobs-only-over-context", C, comp(prompt=[5] * 8200, prompt_logprobs=0, max_tokens=0), 400, "prompt"),
    ("prompt_logprobs-out-of-vocab", C, comp(prompt=[5, 320], prompt_logprobs=2), 400, None),  # as without it
    ("prompt_logprobs-over-context", CH, chat(messages=[{"role": "user", "content": "hi " * 9000}],
                                              prompt_logprobs=1), 400, "messages"),
    ("prompt_logprobs-huge", C, comp(prompt_logprobs=2**40), 400, "prompt_logprobs"),
    ("suffix", C, comp(suffix="x"), 400, "suffix"),
    ("best_of", C, comp(best_of=3), 400, "best_of"),
    ("tools-bad-name", CH, chat(tools=[{"type": "function", "function": {"name": "no spaces"}}]), 400, "tools"),
    ("tool_choice-unknown", CH, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                     tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    ("stop-17-strings", C, comp(stop=[str(i) for i in range(17)]), 400, "stop"),
    ("stop-empty-string", C, comp(stop=[""]), 400, "stop"),
    # prompts and messages
    ("prompt-empty", C, comp(prompt=""), 400, "prompt"),
    ("prompt-empty-list", C, comp(prompt=[]), 400, "prompt"),
    ("prompt-empty-nested", C, comp(prompt=[[]]), 400, "prompt"),
    ("prompt-batch-17", C, comp(prompt=["a"] * 17), 400, "prompt"),
    ("prompt-batch-streamed-17", C, comp(prompt=["a"] * 17, stream=True), 400, "prompt"),
    ("prompt-negative-id", C, comp(prompt=[-1]), 400, None),
    ("prompt-id-1e20", C, comp(prompt=[10**20]), 400, None),
    ("prompt-id-out-of-vocab", C, comp(prompt=[5, 320]), 400, None),
    ("prompt-over-context", C, comp(prompt=[5] * 8200), 400, "prompt"),
    ("message-tool_call_id-on-user", CH, chat(messages=[{"role": "user", "content": "x", "tool_call_id": "1"}]),
     400, "messages"),
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
        status, body = read_response(s)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * MiB + b"\r\n\r\n",
    b"GET /health HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
])
def test_malformed_http(server, raw):
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as s:
        try:
            s.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered and closed before all was sent
        status, body = read_response(s)
    assert 400 <= status < 500, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert_serves(server.url)


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
        status, body = read_response(s)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert sent < 40 * MiB  # it stopped reading near the limit, far short of the 100 MB
    assert_serves(server.url)


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


def test_bad_generation_defaults_refused_at_load(tiny_dir, tmp_path):
    """Bad sampling defaults are the model's fault: refused when it loads (before any server starts),
    never answered as a client's 400 on every request."""
    from mlx_infer.errors import MlxInferError

    with pytest.raises(MlxInferError, match="generation_config"):
        load_model(_bad_generation_dir(tiny_dir, tmp_path))


def test_exposure_is_said_and_an_open_bind_warns():
    from mlx_infer.server import ServeOptions
    from mlx_infer.server.run import exposure_lines

    assert any(line.startswith("WARNING") for line in exposure_lines(ServeOptions(host="0.0.0.0")))
    assert not any(line.startswith("WARNING") for line in exposure_lines(ServeOptions()))
    keyed = " ".join(exposure_lines(ServeOptions(host="0.0.0.0", api_key="k")))
    assert "public (no key): /health;" in keyed and "WARNING" not in keyed
    docs = " ".join(exposure_lines(ServeOptions(api_key="k", public=("docs",))))
    assert "/openapi.json" in docs and "/health" not in docs




@pytest.mark.parametrize("prompt", [
    "a\x00b", "\u0000" * 50, "😀" * 100, "e\u0301" * 200, "\u202eevil", "\uffff\ufffe", "\U0010ffff", "\t\r\n" * 50,
    "<bos><eos><|user|>", "{{ raise_exception('x') }}", "%s%n%x" * 20,
])
def test_odd_but_valid_text_is_served(server, prompt):
    for path, body in ((C, comp(prompt=prompt)), (CH, chat(messages=[{"role": "user", "content": prompt}]))):
        r = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text


def test_unexpected_exception_is_a_logged_500(tiny_loaded, caplog):
    """The last resort: a bug answers 500 in OpenAI's shape and logs its traceback."""
    import logging

    engine = Engine(tiny_loaded, EngineConfig(page_size=8)).start()
    app = create_app(engine, model_id="tiny")

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    from mlx_infer.server import ServerThread

    srv = ServerThread(app).start()
    try:
        r = httpx.get(srv.url + "/boom", timeout=TIMEOUT)
        assert assert_openai_error(r, 500) and "a bug" not in r.text  # no internals on the wire
        records = [x for x in caplog.records if x.name == "mlx_infer.server" and x.levelno >= logging.ERROR]
        assert records and records[0].exc_info and "RuntimeError: a bug" in caplog.text
        assert_serves(srv.url)
    finally:
        srv.stop()
        engine.stop()
        caplog.clear()  # expected here; no_server_errors checks every other case


def test_strictness_still_takes_what_sdks_send(server):
    """An SDK's own reply sent back as a message (null refusal/tool_calls/...), response_format text,
    stream_options with stream, and the extensions (top_k, min_p, repetition_penalty, ignore_eos)."""
    import openai

    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                  response_format={"type": "text"},
                                  extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True})
    msgs = [{"role": "user", "content": "hi"}, r.choices[0].message.model_dump(), {"role": "user", "content": "more"}]
    assert c.chat.completions.create(model="tiny", messages=msgs, max_tokens=3).usage.completion_tokens >= 1
    chunks = list(c.completions.create(model="tiny", prompt="Hi", max_tokens=2, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens >= 1
