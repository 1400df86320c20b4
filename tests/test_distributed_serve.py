"""``mlx-infer serve`` under ``mlx.launch --backend ring -n 2``: the server on rank 0, rank 1 following.

Concurrent greedy completions give the same tokens as a one-process server; the
startup line states the group; a follower that hangs (SIGSTOP) makes rank 0 answer
the request in flight with an error and exit, within the collective timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tiny import make_tiny_model_dir

LAUNCH = Path(sys.executable).with_name("mlx.launch")
PROMPTS = ["The capital of France is", "Hello world! This", "def f(x):"]
SERVE = [sys.executable, "-m", "mlx_infer.cli", "serve", "--port", "0", "--log-level", "warning",
         "--max-batch", "4", "--memory-budget", "0.05"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tp-serve"), "llama", max_position_embeddings=4096)


def _banner_port(proc: subprocess.Popen, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read()[-3000:]}")
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        if m:
            return int(m.group(1))
    raise AssertionError("no banner")


def _completions(port: int, model: str) -> list[list]:
    def one(prompt: str) -> list:
        body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "logprobs": 1}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return [choice["text"], choice["logprobs"]["tokens"]]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: batched in the engine
        return list(pool.map(one, PROMPTS))


def _stop(proc: subprocess.Popen) -> None:
    """Ctrl-C to the whole session (launcher and ranks, as a terminal sends it), then make sure it is gone."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the launcher left behind
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_serve_two_ranks_same_tokens(model_dir, mode):
    env = dict(os.environ, PYTHONUNBUFFERED="1", MLX_INFER_PARALLEL=mode)
    single = subprocess.Popen([*SERVE, "--model", str(model_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, start_new_session=True)
    try:
        want = _completions(_banner_port(single), model_dir.name)
    finally:
        _stop(single)
    proc = subprocess.Popen([str(LAUNCH), "--backend", "ring", "-n", "2", *SERVE, "--model", str(model_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        got = _completions(_banner_port(proc), model_dir.name)
        assert got == want
    finally:
        _stop(proc)
    err = proc.stderr.read()
    assert re.search(mode + r" parallel over 2 ranks \(ring backend\): weights per rank \[[\d.]+, [\d.]+\] MiB", err)
    assert "/mlx_infer/" not in err  # no traceback of ours (mlx.launch prints its own KeyboardInterrupt)


def test_hung_follower_fails_the_request_in_flight(model_dir, tmp_path):
    from mlx_infer.parallel.group import EXIT_PEER_LOST

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    procs = [subprocess.Popen([*SERVE, "--model", str(model_dir), "--max-tokens", "4000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONUNBUFFERED="1", MLX_RANK=str(r),
                                                  MLX_HOSTFILE=str(hostfile), MLX_INFER_DIST_TIMEOUT="3"),
                              start_new_session=True)
             for r in range(2)]
    try:
        port = _banner_port(procs[0])
        body = {"model": model_dir.name, "prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        lines, t_stop = [], None
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:
                    procs[1].send_signal(signal.SIGSTOP)  # the follower hangs mid-generation
                    t_stop = time.monotonic()
        rc = procs[0].wait(timeout=30)
        elapsed = time.monotonic() - t_stop
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert "error" in events[-1] and "distributed run failed" in events[-1]["error"]["message"], events[-1]
        assert lines[-1] == "data: [DONE]"
        assert rc == EXIT_PEER_LOST
        assert elapsed < 3 + 1 + 5  # the timeout, the grace, a margin
        assert "a peer process died or hung" in procs[0].stderr.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL ends a stopped process too
                p.wait(timeout=10)
