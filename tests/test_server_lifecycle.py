"""The server's lifecycle under hostile clients: non-streaming clients that time out are
cancelled (their pages come back, /metrics says so), slow clients are cut by the header
and body timeouts, and shutdown is bounded by the drain timeout, ending what it cut
as aborted (never as a normal ``stop``), also under SIGINT on the real CLI process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from http_helpers import (C, CH, LONG, OK_MSG, TIMEOUT, assert_openai_error, assert_serves, chat, comp,  # noqa: F401
                          metrics, no_files_touched, no_server_errors, read_response, server, start, stop, tiny_dir,
                          tiny_loaded, wait_idle)
from mlx_infer.server.guard import GuardConfig
from mlx_infer.server.http import ABORT_GRACE_S


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


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_slowloris_headers_are_cut(tiny_loaded, http):
    """40 connections dribbling their headers: closed after the 1 s header timeout; others still served
    (each HTTP protocol the server can run)."""
    s = start(tiny_loaded, header_timeout_s=1.0, http=http)
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


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_malformed_request_gets_openais_400_and_a_kept_alive_one_is_not_cut(tiny_loaded, http):
    """A request line the parser cannot read: a 400 in OpenAI's error shape, connection closed. A
    keep-alive connection that streams longer than the header timeout, then sends a second request, is
    served both times (the timer runs only while no response is under way)."""
    s = start(tiny_loaded, header_timeout_s=1.0, http=http)
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=TIMEOUT) as c:
            c.sendall(b"NOT A REQUEST\r\n\r\n")
            status, body = read_response(c)
            assert status == 400 and json.loads(body)["error"]["code"] == "invalid_http", body
        with httpx.Client(base_url=s.url, timeout=TIMEOUT) as client:  # one kept-alive connection
            assert client.post(C, json=comp(max_tokens=4)).status_code == 200
            t0 = time.perf_counter()
            with client.stream("POST", C, json=comp(max_tokens=LONG, ignore_eos=True, stream=True)) as r:
                assert r.status_code == 200
                for _ in r.iter_lines():
                    if time.perf_counter() - t0 > 1.5:  # past the header timeout, still streaming
                        break
            assert time.perf_counter() - t0 > 1.5
    finally:
        stop(s)


def test_slow_body_gets_408(tiny_loaded):
    s = start(tiny_loaded, guard=GuardConfig(body_timeout_s=1.0))
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=TIMEOUT) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\":")
            t0 = time.perf_counter()
            status, body = read_response(c)
            assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
            assert 0.5 < time.perf_counter() - t0 < 5
        assert_serves(s.url)
    finally:
        stop(s)


def test_shutdown_is_bounded_and_says_what_it_cut(tiny_loaded):
    """Shutdown with a long stream, a long non-streaming request and a half-sent body in flight:
    the half-sent body is answered (503) when the drain (1 s) ends, the whole server stops
    within drain + grace; the stream ends with finish_reason "abort" and a server_shutdown
    error event (never "stop"), the waiting request gets a 503."""
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
        slow_answer: list = []

        def read_slow() -> None:
            slow.settimeout(20)
            got = slow.recv(4096)  # the status line and headers; the body may come in a later segment
            when = time.perf_counter() - t0
            while b"server_shutdown" not in got and (more := slow.recv(4096)):
                got += more
            slow_answer.append((got, when))

        t0 = time.perf_counter()
        reader = threading.Thread(target=read_slow)
        reader.start()
        s.srv.stop(timeout=20)
        took = time.perf_counter() - t0
        reader.join(timeout=20)
        for t in threads:
            t.join(timeout=20)
        assert not s.srv.alive and took < 1.0 + ABORT_GRACE_S + 1.5, took
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        reasons = [c["choices"][0]["finish_reason"] for c in events if c.get("choices")]
        assert reasons[-1] == "abort" and "stop" not in reasons and "length" not in reasons
        assert events[-1]["error"]["code"] == "server_shutdown" and lines[-1] == "data: [DONE]"
        assert len(answers) == 1 and assert_openai_error(answers[0], 503)["code"] == "server_shutdown"
        got, when = slow_answer[0]
        assert got.startswith(b"HTTP/1.1 503") and b"server_shutdown" in got and when < 1.0 + ABORT_GRACE_S, slow_answer
    finally:
        slow.close()
        s.engine.stop()


@pytest.mark.parametrize("sig,want_rc", [(signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM)])
def test_signal_on_the_cli_server(tiny_dir, sig, want_rc):
    """`mlx-infer serve` under SIGINT or SIGTERM, with a stream in flight and a client holding a
    half-sent body: the stream ends as aborted, and the process exits within the drain
    (0.5 s) plus the grace and a margin, however long the slow client waits."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "mlx_infer.cli", "serve", "--model", str(tiny_dir), "--port", "0",
                             "--drain-timeout", "0.5", "--max-tokens", str(LONG), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    slow = None
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
        slow = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        lines, t_signal = [], None
        body = comp(model=tiny_dir.name, max_tokens=LONG, ignore_eos=True, stream=True)
        try:
            with httpx.stream("POST", url + C, json=body, timeout=TIMEOUT) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) == 3 and t_signal is None:  # once: a second SIGINT is uvicorn's force-exit
                        proc.send_signal(sig)
                        t_signal = time.perf_counter()
        except httpx.HTTPError as e:
            proc.wait(timeout=20)
            raise AssertionError(f"{e!r} after {time.perf_counter() - t_signal:.2f} s; lines {lines[-2:]}; "
                                 f"server stderr: {proc.stderr.read()[-3000:]}") from None
        rc = proc.wait(timeout=20)
        assert time.perf_counter() - t_signal < 0.5 + ABORT_GRACE_S + 2.0
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        reasons = [c["choices"][0]["finish_reason"] for c in events if c.get("choices")]
        assert "stop" not in reasons and reasons[-1] == "abort"
        assert events[-1]["error"]["code"] == "server_shutdown"
        assert rc == want_rc
        assert "Traceback" not in proc.stderr.read()
    finally:
        if slow is not None:
            slow.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
