"""Tensor parallel over MLX's ring backend on loopback (``mlx.launch --backend ring``).

Every path of a sharded tiny model gives the same greedy tokens as one process:
``generate`` eager and through the compiled C++ step (its ``all_sum`` inside the
step), and the engine with several concurrent requests (compiled paged step on
and off). Per-rank weight bytes are ~1/N of the whole: everything is split
(heads, MLP, vocabulary) but the norms. A rank that dies makes rank 0 fail its
requests and exit with a clear message, bounded. Each launch has a hard timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny import GEMMA4_SWITCHES, make_tiny_model_dir

WORKER = Path(__file__).with_name("dist_worker.py")
LAUNCH = Path(sys.executable).with_name("mlx.launch")
# no near-ties in the tiny gemmas' greedy streams
SPREAD = {"gemma3": {"vector_noise": True, "embed_scale": 0.5}, "gemma4": {"embed_scale": 0.5}}


def _model(tmp_path_factory, family: str, *, q: int = 0, **overrides) -> Path:
    """A tiny model of ``family``; ``q``: 4 or 8 for MLX-quantized weights (group size 32)."""
    kw = dict(SPREAD.get(family, {}), **overrides)
    name = family + "".join(f"-{k}" for k in overrides)
    path = make_tiny_model_dir(tmp_path_factory.mktemp(name), family, **kw)
    if q:
        from mlx_infer.artifacts.convert import convert

        path = convert(path, tmp_path_factory.mktemp(name + f"-q{q}"), quantize_bits=q, group_size=32,
                       progress=False, overwrite=True)
    return path


def _results(text: str) -> list[dict]:
    return sorted((json.loads(line[len("RESULT "):]) for line in text.splitlines() if line.startswith("RESULT ")),
                  key=lambda r: r["rank"])


def run_single(model: Path, mode: str, env: dict | None = None) -> dict:
    p = subprocess.run([sys.executable, str(WORKER), str(model), mode], capture_output=True, text=True, timeout=60,
                       env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    (out,) = _results(p.stdout)
    return out


def run_launched(model: Path, mode: str, n: int = 2, timeout: int = 90, env: dict | None = None) -> list[dict]:
    p = subprocess.run([str(LAUNCH), "--backend", "ring", "-n", str(n), sys.executable, str(WORKER), str(model), mode],
                       capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    outs = _results(p.stdout)
    assert [o["rank"] for o in outs] == list(range(n)), p.stderr[-3000:]
    return outs


def _check_bytes(one: dict, ranks: list[dict], slack: float = 1.03) -> None:
    """Each rank holds ~1/N of the weights: exactly 1/N of everything but the replicated norms (< 3% here;
    more where KV heads are replicated)."""
    n = len(ranks)
    for r in ranks:
        assert r["size"] == n and r["backend"] == "ring"
        assert one["weight_bytes"] / n <= r["weight_bytes"] <= one["weight_bytes"] / n * slack, (one, r)


KV1 = {"num_key_value_heads": 1}  # fewer KV heads than ranks: replicated
CASES = {  # name -> (family, quantized bits, overrides, byte slack, CPU kernels)
    "llama": ("llama", 0, {}, 1.03, False), "qwen2": ("qwen2", 0, {}, 1.03, False),
    "qwen3": ("qwen3", 0, {}, 1.03, False), "mistral": ("mistral", 0, {}, 1.03, False),
    "gemma3": ("gemma3", 0, {}, 1.03, False),
    # one KV head of 1 on both ranks: k/v (1/8 of a layer's attention+MLP here) are held whole
    "llama-kv1": ("llama", 0, KV1, 1.1, False),
    "gemma4-dense": ("gemma4", 0, GEMMA4_SWITCHES["dense"], 1.03, False),
    # experts split whole (expert parallel); the global layers' single KV head replicated
    "gemma4-moe": ("gemma4", 0, GEMMA4_SWITCHES["moe"], 1.05, False),
    "gemma4-kv_shared": ("gemma4", 0, GEMMA4_SWITCHES["kv_shared"], 1.08, False),  # per-layer projections whole
    "gemma4-ple": ("gemma4", 0, GEMMA4_SWITCHES["ple"], 1.08, False),
    "llama-q4": ("llama", 4, {}, 1.05, False),
    "gemma4-moe-q4": ("gemma4", 4, GEMMA4_SWITCHES["moe"], 1.08, False),
    "qwen3-cpu-kernels": ("qwen3", 0, {}, 1.03, True),  # the default on a CPU: mlx-infer's matmul kernels
}


@pytest.mark.parametrize("case", list(CASES))
def test_generate_two_ranks_same_tokens(tmp_path_factory, case):
    family, q, overrides, slack, kernels = CASES[case]
    model = _model(tmp_path_factory, family, q=q, **overrides)
    env = dict(os.environ, MLX_INFER_CPU_KERNELS="1" if kernels else "0")
    one = run_single(model, "generate", env)
    assert one["compiled=True"] == one["compiled=False"]
    ranks = run_launched(model, "generate", env=env)
    for r in ranks:
        assert r["compiled=False"] == one["compiled=False"], (case, r)
        assert r["compiled=True"] == one["compiled=False"], (case, r)
    _check_bytes(one, ranks, slack=slack)


@pytest.mark.parametrize("case", ["llama", "gemma3", "gemma4-moe-q4", "qwen3-cpu-kernels"])
def test_engine_two_ranks_same_tokens(tmp_path_factory, case):
    family, q, overrides, _, kernels = CASES[case]
    model = _model(tmp_path_factory, family, q=q, **overrides)
    env = dict(os.environ, MLX_INFER_CPU_KERNELS="1" if kernels else "0")
    one = run_single(model, "engine", env)
    assert one["paged_decode=True"] and not one["paged_decode=False"]
    leader, follower = run_launched(model, "engine", env=env)
    for compiled in ("True", "False"):
        assert leader[f"compiled={compiled}"] == one[f"compiled={compiled}"]
        assert follower[f"compiled={compiled}"] == "follower"
    assert leader["paged_decode=True"]  # the compiled paged step, collectives inside, served the sharded graph
    assert all(reason == "length" and err is None for _, reason, err in leader["compiled=True"])


def test_engine_sampling_stays_in_lockstep(tmp_path_factory):
    """Seeded sampling (temperature, top-k, repetition penalty, logprobs) gives one process's tokens; a request
    without a seed (rank 0 picks one for every rank) finishes on every rank alike. Logprobs agree to 1e-3
    (the split sums round differently)."""
    model = _model(tmp_path_factory, "qwen3")
    one = run_single(model, "sampled")
    leader, follower = run_launched(model, "sampled")
    assert follower["sampled"] == "follower"
    for (toks, reason, lps), (want_toks, want_reason, want_lps) in zip(leader["sampled"][:3], one["sampled"][:3]):
        assert toks == want_toks and reason == want_reason == "length"
        assert lps == pytest.approx(want_lps, abs=1e-3)
    toks, reason, _ = leader["sampled"][3]
    assert reason == "length" and len(toks) == 10


@pytest.mark.parametrize("mode", ["generate", "engine-compiled"])
def test_four_ranks(tmp_path_factory, mode):
    model = _model(tmp_path_factory, "llama")  # 4 heads, 2 KV heads: each KV head on two ranks
    one = run_single(model, mode)
    ranks = run_launched(model, mode, n=4, timeout=150)
    if mode == "generate":
        for r in ranks:
            assert r["compiled=True"] == r["compiled=False"] == one["compiled=False"]
    else:  # concurrent requests through the compiled paged step
        assert ranks[0]["compiled=True"] == one["compiled=True"] and ranks[0]["paged_decode=True"]
        assert all(r["compiled=True"] == "follower" for r in ranks[1:])
    _check_bytes(one, ranks, slack=1.1)


def _ring_env(rank: int, hostfile: Path) -> dict:
    return dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile), MLX_INFER_DIST_TIMEOUT="5")


def test_dead_rank_fails_the_leader_within_the_timeout(tmp_path_factory, tmp_path):
    """Rank 1 exits mid-generation; rank 0 (started without a launcher that would kill it) fails its
    request with an error, says why on stderr and exits with EXIT_PEER_LOST within seconds."""
    from mlx_infer.parallel.group import EXIT_PEER_LOST

    model = _model(tmp_path_factory, "llama")
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(model), "die"], env=_ring_env(r, hostfile),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    elapsed = time.monotonic() - t0
    assert procs[1].returncode == 9
    assert procs[0].returncode == EXIT_PEER_LOST, outs[0][1][-2000:]
    assert "a peer process died or hung" in outs[0][1]
    (leader,) = _results(outs[0][0])
    (tokens, reason, error), = leader["compiled=True"]
    assert reason == "error" and "distributed run failed" in error
    assert 0 < len(tokens) < 10_000
    assert elapsed < 30


def test_cli_generate_under_mlx_launch(tmp_path_factory):
    """`mlx-infer generate` unchanged under mlx.launch: the same text as one process, printed once (rank 0),
    the startup line on stderr; sampling with no seed works too (rank 0's seed is shared)."""
    model = _model(tmp_path_factory, "llama")
    cli = [sys.executable, "-m", "mlx_infer.cli", "generate", "--model", str(model), "--prompt",
           "The capital of France is", "--max-tokens", "12"]
    one = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([str(LAUNCH), "--backend", "ring", "-n", "2", *cli], capture_output=True, text=True, timeout=90)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and one.stdout.strip()
    assert "tensor parallel over 2 ranks (ring backend)" in two.stderr
    assert two.stderr.count("generation: 12 tokens") == 1  # the stats too: rank 0 alone
    sampled = subprocess.run([str(LAUNCH), "--backend", "ring", "-n", "2", *cli, "--temp", "0.9"],
                             capture_output=True, text=True, timeout=90)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert sampled.stdout.strip()


@pytest.mark.parametrize("case", ["llama", "gemma3"])
def test_pipeline_parallel(tmp_path_factory, case):
    """MLX_INFER_PARALLEL=pipeline: layers split across the ranks (gemma3: 1 + 2 of 3 layers, the tied
    embedding on both ends), the same greedy tokens as one process through generate and the engine."""
    family, q, overrides, _, _ = CASES[case]
    model = _model(tmp_path_factory, family, q=q, **overrides)
    one = run_single(model, "generate")
    env = dict(os.environ, MLX_INFER_PARALLEL="pipeline")
    ranks = run_launched(model, "generate", env=env)
    for r in ranks:
        assert r["compiled=False"] == r["compiled=True"] == one["compiled=False"], (case, r)
    # each rank holds its layers (+ the embedding at the ends): less than the whole model
    assert all(r["weight_bytes"] < one["weight_bytes"] for r in ranks)
    one = run_single(model, "engine-compiled")
    leader, _ = run_launched(model, "engine-compiled", env=env)
    assert leader["compiled=True"] == one["compiled=True"]  # (the pipelined engine decodes eagerly)
    assert not leader["paged_decode=True"] and one["paged_decode=True"]


def test_cli_generate_with_a_hung_peer_exits_bounded(tmp_path_factory, tmp_path):
    """`mlx-infer generate` on two ranks; rank 1 stops (SIGSTOP) mid-generation: rank 0 says why in one line
    and exits with EXIT_PEER_LOST once the collective timeout (3 s here) has passed."""
    import signal
    import socket

    from mlx_infer.parallel.group import EXIT_PEER_LOST

    model = _model(tmp_path_factory, "llama", max_position_embeddings=4096)  # greedy: no EOS in 3000 tokens
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    cli = [sys.executable, "-m", "mlx_infer.cli", "generate", "--model", str(model), "--prompt", "The capital",
           "--max-tokens", "3000"]
    env = [dict(_ring_env(r, hostfile), MLX_INFER_DIST_TIMEOUT="3", PYTHONUNBUFFERED="1") for r in range(2)]
    procs = [subprocess.Popen(cli, env=env[r], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        assert procs[0].stdout.read(16)  # text is streaming: the ranks are mid-generation
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        out, err = procs[0].communicate(timeout=30)
        elapsed = time.monotonic() - t0
        assert procs[0].returncode == EXIT_PEER_LOST, err[-2000:]
        assert "waited more than 3 s for its peers" in err and "Traceback" not in err
        assert 2.5 < elapsed < 3 + 5
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.mark.slow
def test_real_model_two_ranks(mlx_infer_cache):
    """The embedded Gemma 3 270M over two ranks (converted once, by rank 0): the reference continuation."""
    cli = [sys.executable, "-m", "mlx_infer.cli", "generate", "--prompt", "The capital of France is",
           "--max-tokens", "8"]
    p = subprocess.run([str(LAUNCH), "--backend", "ring", "-n", "2", *cli], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, MLX_INFER_CACHE=str(mlx_infer_cache)))
    assert p.stdout.startswith(" the capital of the country of France."), p.stderr[-3000:]
    assert "tensor parallel over 2 ranks" in p.stderr
