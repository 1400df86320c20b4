"""The engine in its own process (engine/process.py): the same tokens, errors, cancels and metrics as the
engine in process, requests ended (never hung) when that process dies, and the server over it."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from mlx_infer.engine import Engine, EngineClosedError, EngineRequest
from mlx_infer.engine.process import EngineProcess
from mlx_infer.errors import MlxInferError, PromptTooLongError
from mlx_infer.sampling import SamplingParams
from mlx_infer.server.run import ServeOptions, engine_for_process, load_for_serving, make_engine, start_engine
from tiny import make_tiny_model_dir

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("engine-process"), "llama", max_position_embeddings=512)


@pytest.fixture(scope="module")
def options(model_dir):
    return ServeOptions(model=str(model_dir), page_size=8)


@pytest.fixture(scope="module")
def remote(options):
    engine = start_engine(options)
    assert isinstance(engine, EngineProcess)
    yield engine
    engine.stop()


def _requests(n: int = 6, max_tokens: int = 12) -> list[EngineRequest]:
    return [EngineRequest(prompt_ids=[1, 2 + i, 3 + 2 * i, 4], max_tokens=max_tokens, ignore_eos=True,
                          sampling=SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=0.8,
                                                                                                 seed=i))
            for i in range(n)]


def test_tokens_and_text_equal_the_engine_in_process(remote, options):
    """Greedy and seeded requests, together: the same ids, text and finish as the engine in this process."""
    local = make_engine(options, load_for_serving(options)).start()
    try:
        want = [(r.token_ids, r.text, r.finish_reason) for r in local.generate(_requests(), timeout=TIMEOUT)]
    finally:
        local.stop()
    handles = [remote.submit(r) for r in _requests()]
    got = [(h.result(TIMEOUT).token_ids, h.result().text, h.result().finish_reason) for h in handles]
    assert got == want
    assert all(len(ids) == 12 and reason == "length" for ids, _, reason in got)


def test_events_stream_in_order_and_end_with_the_result(remote):
    h = remote.submit(EngineRequest(prompt_ids=[5, 6, 7], max_tokens=9, ignore_eos=True))
    events = list(h)
    assert [e.index for e in events] == list(range(9))
    assert events[-1].finish_reason == "length" and all(e.finish_reason is None for e in events[:-1])
    assert [e.token for e in events] == h.result(TIMEOUT).token_ids
    assert "".join(e.text for e in events) == h.result().text


def test_async_batches_deliver_every_event(remote):
    import asyncio

    async def run() -> list[int]:
        h = remote.submit(EngineRequest(prompt_ids=[9, 8, 7], max_tokens=10, ignore_eos=True))
        return [e.token async for e in h], h

    tokens, h = asyncio.run(run())
    assert tokens == h.result().token_ids and len(tokens) == 10


def test_submit_errors_are_the_engines_own(remote):
    with pytest.raises(PromptTooLongError, match="context window is 512"):
        remote.submit(EngineRequest(prompt_ids=[1] * 600, max_tokens=2))
    with pytest.raises(MlxInferError, match="vocabulary size"):
        remote.submit(EngineRequest(prompt_ids=[1, 10**6], max_tokens=2))
    h = remote.submit(EngineRequest(prompt_ids=[1, 2], max_tokens=200, ignore_eos=True, request_id="twice"))
    with pytest.raises(MlxInferError, match="already running"):
        remote.submit(EngineRequest(prompt_ids=[1, 2], max_tokens=2, request_id="twice"))
    h.cancel()
    assert h.result(TIMEOUT).finish_reason == "cancelled"


def test_cancel_frees_the_pages(remote):
    h = remote.submit(EngineRequest(prompt_ids=[3, 4, 5], max_tokens=400, ignore_eos=True))
    next(iter(h))  # it runs
    h.cancel()
    r = h.result(TIMEOUT)
    assert r.finish_reason == "cancelled" and len(r.token_ids) < 400
    deadline = time.monotonic() + 10
    while remote.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    s = remote.stats()
    assert s["running"] == 0 and s["kv_pages_used"] == 0, s
    assert "mlx_infer_kv_pages_used 0" in remote.prometheus()


def _pid(engine: Engine) -> int:
    return os.getpid()


def _raise(engine: Engine, message: str) -> None:
    raise MlxInferError(message)


class _Unpicklable(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


def _raise_unpicklable(engine: Engine) -> None:
    raise _Unpicklable(1, 2)


def test_call_runs_in_the_engine_process_and_raises_its_errors(remote):
    assert remote.call(_pid) != os.getpid()
    with pytest.raises(MlxInferError, match="named by the test"):
        remote.call(_raise, "named by the test")
    with pytest.raises(MlxInferError, match="_Unpicklable: 1/2"):  # an error that cannot travel: by name
        remote.call(_raise_unpicklable)
    assert remote.alive


def test_prompt_scores_travel_with_the_first_event(remote):
    h = remote.submit(EngineRequest(prompt_ids=[1, 5, 9, 13], max_tokens=3, prompt_logprobs=2))
    r = h.result(TIMEOUT)
    assert h.prompt_logprobs is not None and r.prompt_logprobs is not None
    assert list(h.prompt_logprobs.token_ids) == [1, 5, 9, 13]


def test_a_build_that_fails_raises_here(tmp_path):
    with pytest.raises(MlxInferError, match="nowhere"):
        EngineProcess(engine_for_process, ServeOptions(model=str(tmp_path / "nowhere")))


def test_a_dead_engine_process_ends_its_requests(options):
    engine = start_engine(options)
    try:
        h = engine.submit(EngineRequest(prompt_ids=[1, 2, 3], max_tokens=100_000, ignore_eos=True))
        next(iter(h))
        os.kill(engine._proc.pid, signal.SIGKILL)
        r = h.result(TIMEOUT)
        assert r.finish_reason == "error" and "engine process is gone" in r.error
        assert not engine.alive
        with pytest.raises(EngineClosedError, match="restart the server"):
            engine.submit(EngineRequest(prompt_ids=[1, 2], max_tokens=2))
        with pytest.raises(EngineClosedError):
            engine.stats()
    finally:
        engine.stop()


def test_stop_cancels_what_runs_and_ends_the_process(options):
    engine = start_engine(options)
    h = engine.submit(EngineRequest(prompt_ids=[1, 2, 3], max_tokens=100_000, ignore_eos=True))
    next(iter(h))
    engine.stop()
    assert h.result(TIMEOUT).finish_reason == "cancelled"
    assert not engine._proc.is_alive()
    with pytest.raises(EngineClosedError):
        engine.submit(EngineRequest(prompt_ids=[1, 2], max_tokens=2))


def test_the_server_streams_the_same_text_over_either_engine(options):
    """One streamed and one plain completion through the HTTP server, over the engine process and over the
    engine in process: the same text; /metrics and the adapter list answer over both."""
    from mlx_infer.server.app import create_app
    from mlx_infer.server.run import ServerThread

    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    seen = []
    for engine_process in (True, False):
        engine = start_engine(ServeOptions(model=options.model, page_size=8, engine_process=engine_process))
        try:
            assert isinstance(engine, EngineProcess) == engine_process
            with ServerThread(create_app(engine, model_id="tiny")) as server:
                plain = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT).json()
                with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                                  timeout=TIMEOUT) as r:
                    lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
                import json

                streamed = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines)
                metrics = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
                adapters = httpx.get(server.url + "/v1/adapters", timeout=TIMEOUT).json()
            seen.append((plain["choices"][0]["text"], streamed))
            assert "mlx_infer_generation_tokens_total 32" in metrics
            assert adapters == {"object": "list", "data": []}
        finally:
            engine.stop()
    assert seen[0] == seen[1] and seen[0][0] == seen[0][1] and seen[0][0]


def _children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (Linux's /proc)."""
    out: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.update(int(c) for c in f.read().split())
        except FileNotFoundError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    """A long context: a stream of 4000 tokens outlives the drain."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("engine-process-long"), "llama", max_position_embeddings=8192)


def _start_cli_server(model_dir) -> tuple:
    import re
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "mlx_infer.cli", "serve", "--model", str(model_dir), "--port", "0",
                             "--drain-timeout", "0.5", "--max-tokens", "4000", "--log-level", "warning"],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            start_new_session=True)
    deadline = time.monotonic() + 60
    port = None
    while port is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, proc.stderr.read()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        port = int(m.group(1)) if m else None
    assert port, "no banner"
    proc.banner = ""  # the stderr lines printed before it, the engine's among them
    while "the engine runs in" not in proc.banner:
        line = proc.stderr.readline()
        assert line, proc.banner
        proc.banner += line
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads Linux's /proc (CI runs on Linux)")
def test_ctrl_c_on_the_cli_server_ends_the_engine_process(long_dir):
    """Ctrl-C reaches the server's whole process group: the engine process ignores it, the server drains (the
    stream ends as aborted) and stops it; nothing of the server is left running."""
    import json

    proc, url = _start_cli_server(long_dir)
    kids = _children(proc.pid)
    try:
        assert kids, "the engine process"
        assert any(f"the engine runs in process {k}" in proc.banner for k in kids), proc.banner
        body = {"model": long_dir.name, "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        lines, sent = [], False
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3 and not sent:  # once: a second SIGINT is uvicorn's force-exit
                    os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: every process of the group
                    sent = True
        assert len(lines) > 3, lines
        assert proc.wait(timeout=20) == 130
        events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert [c["choices"][0]["finish_reason"] for c in events if c.get("choices")][-1] == "abort"
        deadline = time.monotonic() + 10
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(k) for k in kids)
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads Linux's /proc (CI runs on Linux)")
def test_a_killed_server_leaves_no_engine_process(model_dir):
    """SIGKILL on the server (no cleanup runs there): its engine process sees the pipe close and exits."""
    proc, url = _start_cli_server(model_dir)
    kids = _children(proc.pid)
    try:
        assert kids and httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
        proc.kill()
        proc.wait(timeout=20)
        deadline = time.monotonic() + 20
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(k) for k in kids)
    finally:
        if proc.poll() is None:
            proc.kill()
        for k in kids:
            if _alive(k):
                os.kill(k, signal.SIGKILL)


def test_asubmit_awaits_the_engine_without_blocking_the_loop(remote):
    """The server's way in: the answer is awaited (other tasks run meanwhile), the engine's errors are raised,
    and a caller that leaves while waiting leaves no request running."""
    import asyncio

    async def run() -> None:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        handles = [await remote.asubmit(r) for r in _requests(4, max_tokens=5)]
        results = [await h.aresult() for h in handles]
        assert all(len(r.token_ids) == 5 for r in results) and ticks > 0
        with pytest.raises(PromptTooLongError):
            await remote.asubmit(EngineRequest(prompt_ids=[1] * 600, max_tokens=2))
        waiting = asyncio.ensure_future(remote.asubmit(EngineRequest(prompt_ids=[1, 2, 3], max_tokens=100_000,
                                                                     ignore_eos=True, request_id="left")))
        await asyncio.sleep(0)  # sent, not yet answered
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        t.cancel()

    asyncio.run(run())
    deadline = time.monotonic() + 10
    while remote.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert remote.stats()["running"] == 0  # the request the caller left was cancelled in the engine


def test_events_cross_the_pipe_as_tuples_with_every_field():
    """pack_event / unpack_event carry every TokenEvent field (a field added to the class fails here until the
    wire format carries it), and the packed form is plain data."""
    import dataclasses
    import pickle

    from mlx_infer.engine import TokenEvent
    from mlx_infer.engine.process import pack_event, unpack_event

    event = TokenEvent(request_id="r-7", token=42, index=3, text=" caf\u00e9", finish_reason="stop", logprob=-0.25,
                       top_logprobs=[(42, -0.25), (7, -1.5)], forced=True)
    values = {f.name: getattr(event, f.name) for f in dataclasses.fields(TokenEvent)}
    assert len(set(map(repr, values.values()))) == len(values)  # distinct values: a swapped field shows
    packed = pack_event(event)
    assert type(packed) is tuple and "r-7" not in packed
    assert unpack_event("r-7", pickle.loads(pickle.dumps(packed))) == event
    bare = TokenEvent(request_id="r-8", token=None, index=0)
    assert unpack_event("r-8", pack_event(bare)) == bare


def _text_cases(stop: str | None = None) -> list[EngineRequest]:
    """Requests whose text takes every path of the output state machine: an EOS ending (its text dropped), added
    tokens kept with and without spaces between them, skipped, and (given ``stop``) a stop string."""
    greedy = SamplingParams(temperature=0.0)
    added = SamplingParams(temperature=0.0, logit_bias={3: 4.0, 4: 4.0})  # <|user|>, <|assistant|> (added tokens)
    cases = [
        EngineRequest(prompt_ids=[5, 9, 11], max_tokens=8, sampling=SamplingParams(temperature=0.0,
                                                                                  logit_bias={1: 100.0})),
        EngineRequest(prompt_ids=[5, 9, 12], max_tokens=12, sampling=added, ignore_eos=True),
        EngineRequest(prompt_ids=[5, 9, 12], max_tokens=12, sampling=added, ignore_eos=True,
                      spaces_between_special_tokens=False),
        EngineRequest(prompt_ids=[5, 9, 12], max_tokens=12, sampling=added, ignore_eos=True,
                      skip_special_tokens=True),
        EngineRequest(prompt_ids=[6, 10, 14, 15], max_tokens=16, sampling=greedy, ignore_eos=True),
    ]
    if stop is not None:
        cases.append(EngineRequest(prompt_ids=[6, 10, 14, 15], max_tokens=16, sampling=greedy, ignore_eos=True,
                                   stop=[stop]))
    return cases


def test_text_made_in_the_server_process_equals_the_engines(remote, options):
    """Requests without stop strings reach the engine process without their text (ServerText makes it here);
    with stop strings they keep it there. Either way every event's text, the result's text and its finish equal
    the engine's in this process, on every path: EOS, added tokens (spaced, joined, skipped), a stop string."""
    local = make_engine(options, load_for_serving(options)).start()
    try:
        plain = local.generate(_text_cases(), timeout=TIMEOUT)
        assert plain[0].finish_reason == "stop" and plain[0].token_ids == [1] and plain[0].text == ""  # EOS
        assert any(t in (3, 4) for t in plain[1].token_ids)  # the added tokens are generated
        assert plain[1].text != plain[3].text and "<|user|>" not in plain[3].text  # ... and skipped
        words = plain[4].text
        stop = words[len(words) // 2:len(words) // 2 + 3]
        assert len(stop) == 3
        want = []
        for r in _text_cases(stop):
            h = local.submit(r)
            want.append(([e.text for e in h], h.result(TIMEOUT).text, h.result().finish_reason))
    finally:
        local.stop()
    assert want[-1][2] == "stop" and stop not in want[-1][1] and len(want[-1][1]) < len(words)  # the stop string
    got = []
    for r in _text_cases(stop):
        _, wire = remote._register(EngineRequest(prompt_ids=r.prompt_ids, stop=r.stop), None)
        remote._unregister(wire.request_id)
        assert wire.detokenize is bool(r.stop)  # the engine process makes the text of stop-string requests only
        h = remote.submit(r)
        got.append(([e.text for e in h], h.result(TIMEOUT).text, h.result().finish_reason))
    assert got == want
    assert not remote._texts  # every request's text state is dropped with its result
