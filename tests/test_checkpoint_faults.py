"""Kills during checkpoint saves: a resume then continues exactly or refuses clearly, never diverges,
and nothing a killed save left behind survives the next save.

Two ways in: a simulated kill at *every* filesystem operation of every save of
a run (in process: from operation k on, every filesystem operation of the
save code fails, which leaves the disk as a SIGKILL there would); and real
SIGKILLs of a child process at sampled operations and at a random moment of
a CLI run.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny import make_tiny_model_dir

import mlx_infer.generation.checkpoint_store as store
from mlx_infer.artifacts.loader import load_model
from mlx_infer.generation.autoregressive import prompt_ids_for
from mlx_infer.generation.checkpoint import CheckpointError, generate_checkpointed, read_checkpoint
from mlx_infer.sampling import SamplingParams

SAMPLING = SamplingParams(temperature=0.8, seed=3)
MAX_TOKENS, EVERY = 12, 5
CHILD = Path(__file__).with_name("checkpoint_fault_child.py")


class _Killed(BaseException):
    """The simulated SIGKILL (a BaseException, so no ``except Exception`` sees it)."""


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("faults") / request.param, request.param,
                               max_position_embeddings=100_000)
    return path, load_model(path)


def _generate(loaded, d, *, resume=False):
    gen = generate_checkpointed(loaded, prompt_ids_for(loaded, "Hello"), d, sampling=SAMPLING,
                                max_tokens=MAX_TOKENS, every=EVERY, resume=resume)
    with gen:
        return [t.token for t in gen]


def _count_ops(loaded, d):
    ops = []
    store.fault_hook = ops.append
    try:
        tokens = _generate(loaded, d)
    finally:
        store.fault_hook = None
    return ops, tokens


def _op_kind(name):
    return re.sub(r"-[0-9a-f]{8}", "", name)  # version names carry a random part


def _assert_clean(d):
    """What a finished save leaves: the marker, the lock, the pointer and exactly one version."""
    names = sorted(os.listdir(d))
    live = json.loads((d / "CURRENT").read_text())["version"]
    assert names == [".lock", ".mlx-infer-checkpoint", "CURRENT", live], names
    assert sorted(os.listdir(d / live)) == ["checkpoint.json", "kv.safetensors"]


def _resume_and_check(loaded, d, full):
    """Resume after a kill: exact continuation of what was saved, or a clear refusal when nothing was."""
    try:
        ck = read_checkpoint(d)
    except CheckpointError as e:
        assert "no saved checkpoint yet" in str(e), e  # killed before the first save was published
        assert _generate(loaded, d) == full  # a new run into it works, and cleans up
        _assert_clean(d)
        return "refused"
    assert ck.generated_ids == full[: len(ck.generated_ids)]
    rest = _generate(loaded, d, resume=True)
    assert ck.generated_ids + rest == full  # never diverges
    if rest:
        _assert_clean(d)  # the resumed run's saves removed what the killed one left
    return len(ck.generated_ids)


def test_simulated_kill_at_every_filesystem_operation(model, tmp_path):
    _, loaded = model
    ops, full = _count_ops(loaded, tmp_path / "count")
    assert len(ops) > 30 and "replace pointer" in ops and len(full) == MAX_TOKENS
    outcomes = set()
    for k in range(len(ops)):
        d = tmp_path / f"k{k}"
        dead = []

        def hook(name, k=k):
            if len(dead) or hook.n == k:
                dead.append(name)
                raise _Killed(name)
            hook.n += 1

        hook.n = 0
        store.fault_hook = hook
        try:
            with pytest.raises(_Killed):
                _generate(loaded, d)
        finally:
            store.fault_hook = None
        assert _op_kind(dead[0]) == _op_kind(ops[k])
        outcomes.add(_resume_and_check(loaded, d, full))
    assert {"refused", 5, 10} <= outcomes  # kills before, between and after the publishes


def _child(model_dir, d, kill_at):
    return subprocess.run([sys.executable, str(CHILD), str(model_dir), str(d), str(kill_at), str(MAX_TOKENS),
                           str(EVERY)], capture_output=True, text=True, timeout=120)


def test_sigkill_at_sampled_operations(model, tmp_path):
    model_dir, loaded = model
    counted = _child(model_dir, tmp_path / "count", 0)
    assert counted.returncode == 0, counted.stderr
    run = json.loads(counted.stdout)
    ops, full = run["ops"], run["tokens"]
    assert full == _generate(loaded, tmp_path / "inproc")  # the child generates what we do
    replace = ops.index("replace pointer")
    # around the first publish, inside the replacing save, its cleanup, and three more at random
    picks = {replace, replace + 1, replace + 3, len(ops) - 2}
    picks |= set(random.Random(len(ops)).sample(range(1, len(ops) + 1), 3))
    for k in sorted(picks):
        d = tmp_path / f"kill{k}"
        r = _child(model_dir, d, k)
        assert r.returncode == -signal.SIGKILL, (k, r.returncode, r.stderr)
        _resume_and_check(loaded, d, full)


def test_cli_sigkill_at_a_random_moment_then_resume(model, tmp_path):
    model_dir, _ = model
    cmd = [sys.executable, "-m", "mlx_infer", "generate", "--model", str(model_dir), "--prompt", "Hello",
           "--temp", "0.8", "--seed", "3", "--max-tokens", "400", "--verbose", "0"]
    full = subprocess.run(cmd, capture_output=True, timeout=300)
    assert full.returncode == 0, full.stderr
    d = tmp_path / "ck"
    p = subprocess.Popen(cmd + ["--checkpoint", str(d), "--checkpoint-every", "1"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, bufsize=0)
    p.stdout.read(8)  # generation (and saving after every token) is under way
    time.sleep(random.Random().uniform(0.0, 0.3))
    p.kill()
    p.communicate(timeout=60)
    saved = read_checkpoint(d)
    assert not saved.finished, "the run ended before the kill; make it longer"
    rest = subprocess.run([sys.executable, "-m", "mlx_infer", "generate", "--resume", str(d), "--verbose", "0"],
                          capture_output=True, timeout=300)
    assert rest.returncode == 0, rest.stderr
    assert saved.emitted_text.encode() + rest.stdout == full.stdout
    _assert_clean(d)
