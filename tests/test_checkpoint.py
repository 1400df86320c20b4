"""Exactly resumable generation: identity, atomic saves, refusals, resume == uninterrupted."""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
from fs_snapshot import snapshot
from tiny import make_tiny_model_dir

from mlx_infer.artifacts.loader import load_model
from mlx_infer.generation.autoregressive import prompt_ids_for
from mlx_infer.generation.checkpoint import (
    CheckpointError,
    canonical_json,
    generate_checkpointed,
    identity,
    identity_fields,
    load_checkpoint,
    read_checkpoint,
)
from mlx_infer.sampling import SamplingParams

SAMPLING = SamplingParams(temperature=0.8, seed=3)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model_dir(request, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("ck") / request.param, request.param,
                               max_position_embeddings=100_000)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(model_dir)


def _run(loaded, directory, *, stop_at=None, resume=False, sampling=SAMPLING, max_tokens=40, prompt="Hello"):
    gen = generate_checkpointed(loaded, prompt_ids_for(loaded, prompt), directory, sampling=sampling,
                                max_tokens=max_tokens, resume=resume, every=5)
    items = []
    with gen:
        for t in gen:
            items.append(t)
            if stop_at is not None and t.index == stop_at:
                break
    return items


@pytest.mark.parametrize("stop_at", [0, 4, 13])
def test_resume_continues_exactly(loaded, tmp_path, stop_at):
    full = _run(loaded, tmp_path / "full")
    first = _run(loaded, tmp_path / "ck", stop_at=stop_at)
    rest = _run(loaded, tmp_path / "ck", resume=True)
    assert [t.token for t in first + rest] == [t.token for t in full]
    assert [t.index for t in rest] == list(range(stop_at + 1, 40))
    assert "".join(t.text for t in first + rest) == "".join(t.text for t in full)
    assert _run(loaded, tmp_path / "ck", resume=True) == []  # a finished run resumes to nothing


def test_identity_is_canonical_and_seed_mode_explicit():
    a = identity_fields(prompt_ids=[1, 2], sampling=SamplingParams(temperature=0.5, seed=7), binding={"m": 1})
    b = identity_fields(prompt_ids=[1, 2], sampling=SamplingParams(seed=7, temperature=0.5), binding={"m": 1})
    assert identity(a) == identity(b) and len(identity(a)) == 64
    assert canonical_json({"b": 1, "a": [2, 1]}) == '{"a":[2,1],"b":1}'
    default = identity_fields(prompt_ids=[1, 2], sampling=SamplingParams(temperature=0.5), binding={"m": 1})
    assert default["seed_mode"] == "default" and "seed" not in default["sampling"]
    assert a["seed_mode"] == "explicit" and identity(a) != identity(default)
    assert identity(a) != identity(dict(a, prompt_ids=[1, 3]))


def _checkpoint_once(loaded, directory):
    _run(loaded, directory, stop_at=6)
    return snapshot(directory)


@pytest.mark.parametrize("change", ["prompt", "sampling", "max_tokens"])
def test_refuses_a_different_run_and_overwrites_nothing(loaded, tmp_path, change):
    d = tmp_path / "ck"
    before = _checkpoint_once(loaded, d)
    kwargs = {"prompt": "Goodbye"} if change == "prompt" else (
        {"sampling": SamplingParams(temperature=0.9, seed=3)} if change == "sampling" else {"max_tokens": 41})
    with pytest.raises(CheckpointError, match="different run") as e:
        _run(loaded, d, resume=True, **kwargs)
    named = {"prompt": "the prompt", "sampling": "sampling.temperature (0.8 saved, 0.9 now)",
             "max_tokens": "execution.max_tokens (40 saved, 41 now)"}[change]
    assert f"differs in: {named})" in str(e.value)  # only what differs: never the model (tuple vs list)
    with pytest.raises(CheckpointError, match="different run"):
        _run(loaded, d, **kwargs)  # a new run into that directory must not clobber it
    assert snapshot(d) == before


def test_refuses_another_model(loaded, tmp_path, model_dir):
    d = tmp_path / "ck"
    _checkpoint_once(loaded, d)
    other = load_model(make_tiny_model_dir(tmp_path / "other", "llama", seed=5))
    with pytest.raises(CheckpointError, match=r"differs in: the model \(its weights, config or dtype\)\)"):
        _run(other, d, resume=True)


def _live(d):
    return d / json.loads((d / "CURRENT").read_text())["version"]


def test_refuses_truncated_and_wrong_version(loaded, tmp_path):
    d = tmp_path / "ck"
    _checkpoint_once(loaded, d)
    kv = _live(d) / "kv.safetensors"
    data = kv.read_bytes()
    kv.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or damaged"):
        load_checkpoint(d)
    kv.write_bytes(data)
    load_checkpoint(d, model=loaded.model)  # restored: loads again
    meta = json.loads((_live(d) / "checkpoint.json").read_text())
    meta["format_version"] = 99
    (_live(d) / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="edited"):  # any edit breaks the manifest's size or digest
        load_checkpoint(d)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nothing-here")


def test_save_is_versioned_and_leaves_one_version(loaded, tmp_path):
    d = tmp_path / "ck"
    _run(loaded, d, stop_at=13)  # saves at 5, 10 and on close
    names = sorted(p.name for p in d.iterdir())
    assert names == [".lock", ".mlx-infer-checkpoint", "CURRENT", _live(d).name]
    assert sorted(p.name for p in _live(d).iterdir()) == ["checkpoint.json", "kv.safetensors"]
    assert load_checkpoint(d).generated_ids[-1] is not None and len(load_checkpoint(d).generated_ids) == 14


def test_refuses_to_overwrite_a_foreign_directory(loaded, tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "thesis.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="did not write .thesis.txt.; refusing to use or overwrite"):
        _run(loaded, d)
    assert (d / "thesis.txt").read_text() == "precious"


def _cli(model_dir, *extra, env=None):
    return [sys.executable, "-m", "mlx_infer", "generate", "--model", str(model_dir), "--prompt", "Hello",
            "--temp", "0.8", "--seed", "3", "--max-tokens", "20000", "--checkpoint-every", "64", *extra]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("cli") / "llama", "llama", max_position_embeddings=100_000)


def test_cli_ctrl_c_then_resume_equals_uninterrupted(llama_dir, tmp_path):
    model_dir = llama_dir
    d = tmp_path / "ck"
    full = subprocess.run(_cli(model_dir), capture_output=True, timeout=600)
    assert full.returncode == 0, full.stderr
    p = subprocess.Popen(_cli(model_dir, "--checkpoint", str(d)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         bufsize=0)  # unbuffered: communicate() must see every byte after `first`
    first = p.stdout.read(40)  # generation is under way
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130, err
    assert b"--resume" in err
    assert len(first + out) < len(full.stdout)  # it really was interrupted
    alone = tmp_path / "alone"
    shutil.copytree(d, alone)
    rest = subprocess.run(_cli(model_dir, "--resume", str(d)), capture_output=True, timeout=600)
    assert rest.returncode == 0, rest.stderr
    assert first + out + rest.stdout == full.stdout
    # what the interrupt message says to run: --resume DIR alone (the checkpoint holds prompt and settings)
    rest = subprocess.run([sys.executable, "-m", "mlx_infer", "generate", "--resume", str(alone)],
                          capture_output=True, timeout=600)
    assert rest.returncode == 0, rest.stderr
    assert first + out + rest.stdout == full.stdout


@pytest.mark.parametrize("flags, named", [
    (["--temp", "0.5"], "--temp (0.5 given, 0.8 saved) differs"),
    (["--max-tokens", "7", "--seed", "4"], "--seed (4 given, 3 saved), --max-tokens (7 given, 30 saved) differ"),
    (["--stop", "x"], "--stop (['x'] given, [] saved)"),
    (["--chat"], "--chat (True given, False saved)"),
    (["--prompt", "Goodbye"], "--prompt differs from the checkpoint's prompt"),
])
def test_cli_resume_refuses_flags_that_differ_from_the_checkpoint(llama_dir, tmp_path, flags, named):
    from mlx_infer.cli import main

    d = tmp_path / "ck"
    gen = generate_checkpointed(load_model(llama_dir), prompt_ids_for(load_model(llama_dir), "Hello"), d,
                                sampling=SAMPLING, max_tokens=30, every=64,
                                execution={"chat": False, "cpu_kernels": False})
    with gen:
        next(iter(gen))
    before = snapshot(tmp_path)
    r = subprocess.run([sys.executable, "-m", "mlx_infer", "generate", "--resume", str(d), *flags],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and named in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert snapshot(tmp_path) == before
    assert main(["generate", "--prompt", "Hello", "--temp", "0.8", "--resume", str(d), "--model", str(llama_dir),
                 "--verbose", "0"]) == 0  # the same prompt and settings, given again, are fine
    assert read_checkpoint(d).finished


def test_cli_refuses_checkpoint_and_resume_together(llama_dir, tmp_path):
    r = subprocess.run(_cli(llama_dir, "--checkpoint", str(tmp_path / "a"), "--resume", str(tmp_path / "a")),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not both" in r.stderr and "Traceback" not in r.stderr
