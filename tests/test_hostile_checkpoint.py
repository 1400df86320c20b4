"""Hostile checkpoint, convert and file inputs: each is refused with one clear line, in bounded time,
touching nothing.

Every case is run through the API (which must raise an ``MlxInferError``, a
``ValueError``) and through the CLI's ``main`` (exit 2, one ``mlx-infer: error:``
line, no traceback), each under a 30 s alarm, and the whole work area
(checkpoint, sources, outputs, foreign files) must be byte-for-byte unchanged
afterwards. Edits come in two kinds: raw ones, which the manifest's digest
catches, and re-digested ones (the manifest recomputed, as a consistent
corruption or a hostile writer would leave it), which field and KV validation
must catch. A few cases also run as real subprocesses.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from fs_snapshot import snapshot
from tiny import make_tiny_model_dir

from mlx_infer.artifacts.convert import convert
from mlx_infer.artifacts.loader import load_model
from mlx_infer.cli import main
from mlx_infer.errors import MlxInferError
from mlx_infer.generation.autoregressive import prompt_ids_for
from mlx_infer.generation.checkpoint import canonical_json, generate_checkpointed, identity, read_checkpoint
from mlx_infer.sampling import RequestRNG, SamplingParams

SAMPLING = SamplingParams(temperature=0.8, seed=3)
MAX_TOKENS = 40


@contextmanager
def time_limit(seconds: float):
    def alarm(*_):
        raise TimeoutError(f"no answer within {seconds} s (a hang)")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _make_checkpoint(loaded, d, n=7):
    gen = generate_checkpointed(loaded, prompt_ids_for(loaded, "Hello"), d, sampling=SAMPLING,
                                max_tokens=MAX_TOKENS, every=5)
    with gen:
        for t in gen:
            if t.index == n - 1:
                break


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    out = SimpleNamespace(base=base, models={}, loaded={}, templates={})
    for family in ("llama", "gemma3"):
        path = make_tiny_model_dir(base / family, family, max_position_embeddings=100_000)
        out.models[family], out.loaded[family] = path, load_model(path)
        _make_checkpoint(out.loaded[family], base / f"ck-{family}")
        out.templates[family] = base / f"ck-{family}"
    return out


# -- editing helpers ------------------------------------------------------------

def _live(d: Path) -> Path:
    return d / json.loads((d / "CURRENT").read_text())["version"]


def redigest(d: Path) -> None:
    """Recompute the manifest for the live version's current bytes (what a consistent forgery leaves)."""
    manifest = json.loads((d / "CURRENT").read_text())
    for name in manifest["files"]:
        data = (_live(d) / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (d / "CURRENT").write_text(json.dumps(manifest))


def edit_meta(d: Path, fn, *, digest=True, keep_identity=True) -> None:
    path = _live(d) / "checkpoint.json"
    meta = json.loads(path.read_text())
    fn(meta)
    if not keep_identity:
        meta["identity"] = identity(meta["fields"])
    path.write_text(canonical_json(meta))
    if digest:
        redigest(d)


def write_meta(d: Path, data: bytes) -> None:
    (_live(d) / "checkpoint.json").write_bytes(data)
    redigest(d)


def edit_kv(d: Path, fn) -> None:
    path = _live(d) / "kv.safetensors"
    arrays = dict(mx.load(str(path)))
    fn(arrays)
    path.unlink()
    mx.save_safetensors(str(path), arrays)
    redigest(d)


def write_kv(d: Path, data: bytes) -> None:
    (_live(d) / "kv.safetensors").write_bytes(data)
    redigest(d)


def _set(key, value):
    return lambda m: m.__setitem__(key, value)


def _flip_byte(path: Path, at: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _v1_dir(d: Path) -> None:
    d.mkdir()
    (d / "checkpoint.json").write_text('{"format_version": 1}')
    (d / "kv.safetensors").write_bytes(b"")


def _symlink_loop(d: Path) -> None:
    os.symlink(d.with_name("loop-b"), d)
    os.symlink(d, d.with_name("loop-b"))


def _layers(fn):
    return lambda m: [fn(layer) for layer in m["cache_layout"]]


# -- the cases ----------------------------------------------------------------------
# name: (family, kind, setup(ws) -> None, what the message must say)
#   kind "resume": a checkpoint at ws/ck (a copy of the template), setup edits it, then resume
#   kind "new": setup prepares ws/ck, then a new --checkpoint run into it
#   kind "convert": the tiny model copied to ws/src, setup prepares ws/out, then convert --overwrite

RESUME = {
    # fields of every kind, re-digested so that validation (not the digest) must catch them
    "seed-other": ("llama", lambda d: edit_meta(d, _set("seed", 4)), "explicit seed 3"),
    "seed-negative": ("llama", lambda d: edit_meta(d, _set("seed", -1)), "seed must be"),
    "seed-too-big": ("llama", lambda d: edit_meta(d, _set("seed", 2 ** 70)), "seed must be"),
    "seed-string": ("llama", lambda d: edit_meta(d, _set("seed", "3")), "seed must be"),
    "rng-steps-huge": ("llama", lambda d: edit_meta(d, _set("rng_steps", 10 ** 12)), "rng_steps must be"),
    "rng-steps-negative": ("llama", lambda d: edit_meta(d, _set("rng_steps", -1)), "rng_steps must be"),
    "rng-steps-float": ("llama", lambda d: edit_meta(d, _set("rng_steps", 7.0)), "rng_steps must be"),
    "rng-steps-off-by-one": ("llama", lambda d: edit_meta(d, _set("rng_steps", 6)), "rng_steps must be"),
    "generated-too-many": ("llama", lambda d: edit_meta(d, _set("generated_ids", [5] * 60)),
                           "holds 60 generated tokens, more than the run's max_tokens 40"),
    "generated-out-of-vocab": ("llama", lambda d: edit_meta(
        d, lambda m: m["generated_ids"].__setitem__(0, 99999)), "outside this model's vocabulary"),
    "generated-negative": ("llama", lambda d: edit_meta(
        d, lambda m: m["generated_ids"].__setitem__(0, -3)), "generated_ids must be"),
    "generated-not-a-list": ("llama", lambda d: edit_meta(d, _set("generated_ids", "1,2,3")), "generated_ids must be"),
    "generated-one-fewer": ("llama", lambda d: edit_meta(d, lambda m: (m["generated_ids"].pop(),
                                                                       m.__setitem__("rng_steps", 6))),
                            "caches hold"),
    "emitted-not-text": ("llama", lambda d: edit_meta(d, _set("emitted_text", 42)), "emitted_text must be"),
    "finished-not-bool": ("llama", lambda d: edit_meta(d, _set("finished", "yes")), "finished must be"),
    "format-version-old": ("llama", lambda d: edit_meta(d, _set("format_version", 1)), "format version 1"),
    "format-version-future": ("llama", lambda d: edit_meta(d, _set("format_version", 99)), "format version 99"),
    "identity-altered": ("llama", lambda d: edit_meta(d, _set("identity", "0" * 64)), "identity does not match"),
    "unknown-field": ("llama", lambda d: edit_meta(d, _set("extra", 1)), "unknown fields extra"),
    "missing-field": ("llama", lambda d: edit_meta(d, lambda m: m.pop("cache_layout")), "lacks cache_layout"),
    "max-tokens-negative": ("llama", lambda d: edit_meta(d, lambda m: m["fields"]["execution"].__setitem__(
        "max_tokens", -20), keep_identity=False), "max_tokens must be"),
    "sampling-invalid": ("llama", lambda d: edit_meta(d, lambda m: m["fields"]["sampling"].__setitem__(
        "top_p", 7.0), keep_identity=False), "sampling fields are invalid"),
    "prompt-empty": ("llama", lambda d: edit_meta(d, lambda m: m["fields"].__setitem__("prompt_ids", []),
                                                  keep_identity=False), "prompt_ids must be"),
    "prompt-longer": ("llama", lambda d: edit_meta(d, lambda m: m["fields"]["prompt_ids"].append(5),
                                                   keep_identity=False), "caches hold"),
    "layout-unknown-class": ("llama", lambda d: edit_meta(d, _layers(lambda x: x.__setitem__("class", "Paged"))),
                             "cache_layout[0] must be"),
    "layout-three-arrays": ("llama", lambda d: edit_meta(d, _layers(lambda x: x.__setitem__("arrays", 3))),
                            "cache_layout[0] must be"),
    "layout-one-layer": ("llama", lambda d: edit_meta(d, lambda m: m["cache_layout"].pop()),
                         "holds 1 caches but this model has 2"),
    "layout-meta-garbage": ("gemma3", lambda d: edit_meta(d, lambda m: m["cache_layout"][0].__setitem__(
        "meta_state", ["x", "1", "2"])), "cache_layout[0] must be"),
    "rotating-window-changed": ("gemma3", lambda d: edit_meta(d, lambda m: m["cache_layout"][0].__setitem__(
        "meta_state", ["4"] + m["cache_layout"][0]["meta_state"][1:])), "window of 4 tokens"),
    "rotating-slot-out-of-range": ("gemma3", lambda d: edit_meta(d, lambda m: m["cache_layout"][0].__setitem__(
        "meta_state", m["cache_layout"][0]["meta_state"][:2] + ["999"])), "ring state"),
    "class-swapped": ("gemma3", lambda d: edit_meta(d, lambda m: m["cache_layout"][2].update(
        {"class": "RotatingKVCache", "meta_state": ["8", "1", "1"]})), "this model uses a KVCache"),
    "meta-not-json": ("llama", lambda d: write_meta(d, b"{not json"), "is damaged"),
    "meta-json-array": ("llama", lambda d: write_meta(d, b"[1, 2, 3]"), "must be a JSON object"),
    "meta-nan": ("llama", lambda d: write_meta(d, b'{"format_version": NaN}'), "is damaged"),
    "meta-deep-nesting": ("llama", lambda d: write_meta(d, b"[" * 200_000 + b"]" * 200_000), "is damaged"),
    "meta-huge-int": ("llama", lambda d: write_meta(d, b'{"seed": ' + b"9" * 10_000 + b"}"), "is damaged"),
    "meta-not-utf8": ("llama", lambda d: write_meta(d, b"\xff\xfe{}"), "is damaged"),
    # the KV file, re-digested
    "kv-truncated": ("llama", lambda d: write_kv(d, (_live(d) / "kv.safetensors").read_bytes()[:300]),
                     "cannot be read"),
    "kv-garbage": ("llama", lambda d: write_kv(d, os.urandom(4096)), "cannot be read"),
    "kv-empty": ("llama", lambda d: write_kv(d, b""), "cannot be read"),
    "kv-wrong-dtype": ("llama", lambda d: edit_kv(d, lambda a: a.update(
        {k: v.astype(mx.float16) for k, v in a.items()})), "computes in"),
    "kv-wrong-head-dim": ("llama", lambda d: edit_kv(d, lambda a: a.update(
        {k: v[..., :8] for k, v in a.items()})), "this model's are"),
    "kv-wrong-heads": ("llama", lambda d: edit_kv(d, lambda a: a.update(
        {k: mx.concatenate([v, v], axis=1) for k, v in a.items()})), "this model's are"),
    "kv-one-token-more": ("llama", lambda d: edit_kv(d, lambda a: a.update(
        {k: mx.concatenate([v, v[:, :, :1]], axis=2) for k, v in a.items()})), "caches hold"),
    "kv-missing-array": ("llama", lambda d: edit_kv(d, lambda a: a.pop("layer1.1")), "does not hold the arrays"),
    "kv-extra-array": ("llama", lambda d: edit_kv(d, lambda a: a.__setitem__("layer9.0", mx.zeros((1,)))),
                       "does not hold the arrays"),
    "kv-nan": ("llama", lambda d: edit_kv(d, lambda a: a.__setitem__("layer0.0", a["layer0.0"] * float("nan"))),
               "non-finite"),
    # raw edits: the manifest's digests must catch them
    "raw-seed-edit": ("llama", lambda d: edit_meta(d, _set("seed", 4), digest=False), "edited"),
    "raw-same-size-edit": ("llama", lambda d: _flip_byte(_live(d) / "checkpoint.json", 30), "sha256"),
    "raw-kv-bit-flip": ("llama", lambda d: _flip_byte(_live(d) / "kv.safetensors"), "sha256"),
    "raw-kv-truncated": ("llama", lambda d: (_live(d) / "kv.safetensors").write_bytes(b"x"), "truncated"),
    # the store itself
    "pointer-garbage": ("llama", lambda d: (d / "CURRENT").write_bytes(b"\x00garbage"), "not valid JSON"),
    "pointer-names-missing-version": ("llama", lambda d: shutil.rmtree(_live(d)), "is missing"),
    "pointer-path-escape": ("llama", lambda d: (d / "CURRENT").write_text(json.dumps(
        {"store_version": 2, "version": "../../etc", "files": {}})), "unexpected manifest content"),
    "pointer-huge": ("llama", lambda d: (d / "CURRENT").write_bytes(b" " * 100_000), "larger than a valid one"),
    "pointer-removed": ("llama", lambda d: (d / "CURRENT").unlink(), "no saved checkpoint yet"),
    "store-version-future": ("llama", lambda d: (d / "CURRENT").write_text(json.dumps(
        dict(json.loads((d / "CURRENT").read_text()), store_version=7))), "store version 7"),
    "meta-is-symlink": ("llama", lambda d: (shutil.copy(_live(d) / "checkpoint.json", d.parent / "copy.json"),
                                            (_live(d) / "checkpoint.json").unlink(),
                                            os.symlink(d.parent / "copy.json", _live(d) / "checkpoint.json")),
                        "not a regular file"),
    "marker-removed": ("llama", lambda d: (d / ".mlx-infer-checkpoint").unlink(), "did not write"),
    "marker-altered": ("llama", lambda d: (d / ".mlx-infer-checkpoint").write_text("someone else's"),
                       "not mlx-infer's marker"),
    "dir-is-a-file": ("llama", lambda d: (shutil.rmtree(d), d.write_text("a file")), "not a directory"),
    "dir-symlink-loop": ("llama", lambda d: (shutil.rmtree(d), _symlink_loop(d)), "symbolic link loop"),
    "dir-missing": ("llama", lambda d: shutil.rmtree(d), "does not exist"),
    "dir-empty": ("llama", lambda d: (shutil.rmtree(d), d.mkdir()), "is empty"),
    "dir-old-format": ("llama", lambda d: (shutil.rmtree(d), _v1_dir(d)), "older mlx-infer checkpoint format"),
    "dir-foreign-files": ("llama", lambda d: (shutil.rmtree(d), d.mkdir(), (d / "thesis.txt").write_text("mine")),
                          "did not write (thesis.txt)"),
}

NEW = {
    "new-into-foreign-dir": (lambda d: (d.mkdir(), (d / "thesis.txt").write_text("mine")), "did not write"),
    "new-into-another-run": (lambda d: None, "different run"),  # ws/ck holds the template (prompt "Hello")
    "new-parent-is-a-file": (lambda d: d.parent.write_text("x"), "not a directory"),
    "new-into-symlink-loop": (lambda d: _symlink_loop(d), "symbolic link loop"),
    "new-into-a-file": (lambda d: d.write_text("x"), "not a directory"),
}

CONVERT = {
    "convert-onto-source": ("src", None, "is the source model"),
    "convert-onto-parent-of-source": (".", None, "contains the source model"),
    "convert-onto-foreign-dir": ("out", lambda o: (o.mkdir(), (o / "thesis.txt").write_text("mine")),
                                 "not written by mlx-infer convert"),
    "convert-onto-ours-plus-foreign": ("out", lambda o: (shutil.copytree(o.parent / "src", o),
                                                         (o / ".mlx-infer-convert").write_text(
                                                             __import__("mlx_infer.artifacts.output_dir",
                                                                        fromlist=["x"]).MARKER_TEXT),
                                                         (o / "README.md").write_text("mine")),
                                       "did not write (README.md)"),
    "convert-onto-a-file": ("out", lambda o: o.write_text("x"), "not a directory"),
    "convert-onto-symlink": ("out", lambda o: (o.with_name("real").mkdir(), (o.with_name("real") / "f").write_text(
        "x"), os.symlink(o.with_name("real"), o)), "is a symbolic link"),
    "convert-onto-symlink-loop": ("out", _symlink_loop, "symbolic link loop"),
    "convert-parent-is-a-file": ("file/out", lambda o: o.parent.write_text("x"), "not a directory"),
    "convert-source-symlink-loop": ("out", None, "symbolic link loop"),
    "convert-source-missing": ("out", None, "does not exist"),
}

ALL = sorted(RESUME) + sorted(NEW) + sorted(CONVERT)


def test_at_least_35_distinct_inputs():
    assert len(ALL) == len(set(ALL)) >= 35


@pytest.fixture
def keep_sigint():
    old = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, old)


def _prepare(name, env, ws):
    """Set up case ``name`` in ``ws``; return (api call, CLI argv, expected message)."""
    d = ws / "ck"
    if name in RESUME:
        family, setup, expect = RESUME[name]
        shutil.copytree(env.templates[family], d, symlinks=True)
        setup(d)
        loaded = env.loaded[family]

        def api():  # what --resume DIR alone does: everything from the checkpoint
            ck = read_checkpoint(d)
            gen = generate_checkpointed(loaded, ck.prompt_ids, d, sampling=ck.sampling(), max_tokens=ck.max_tokens,
                                        stop=ck.stop, resume=True)
            with gen:
                list(gen)
        return api, ["generate", "--resume", str(d), "--verbose", "0"], expect
    if name in NEW:
        setup, expect = NEW[name]
        if name == "new-into-another-run":
            shutil.copytree(env.templates["llama"], d)
        elif name == "new-parent-is-a-file":
            d = ws / "file" / "ck"
        setup(d)
        loaded = env.loaded["llama"]

        def api():
            gen = generate_checkpointed(loaded, prompt_ids_for(loaded, "Goodbye"), d, sampling=SAMPLING,
                                        max_tokens=3)
            with gen:
                list(gen)
        return api, ["generate", "--model", str(env.models["llama"]), "--prompt", "Goodbye", "--max-tokens", "3",
                     "--checkpoint", str(d), "--verbose", "0"], expect
    out_rel, setup, expect = CONVERT[name]
    src = ws / "src"
    shutil.copytree(env.models["llama"], src)
    out = (ws / out_rel).resolve() if out_rel == "." else ws / out_rel
    if setup is not None:
        setup(out)
    if name == "convert-source-symlink-loop":
        shutil.rmtree(src)
        _symlink_loop(src)
    elif name == "convert-source-missing":
        shutil.rmtree(src)

    def api():
        convert(src, out, overwrite=True, progress=False)
    return api, ["convert", "--model", str(src), "--mlx-path", str(out), "--overwrite"], expect


@pytest.mark.parametrize("name", ALL)
def test_hostile_input_is_refused_cleanly(name, env, tmp_path, capsys, keep_sigint):
    ws = tmp_path / "ws"
    ws.mkdir()
    api, argv, expect = _prepare(name, env, ws)
    before, models_before = snapshot(ws), snapshot(env.base)
    with time_limit(30):
        with pytest.raises(ValueError) as e:
            api()
    assert isinstance(e.value, MlxInferError), type(e.value)
    message = str(e.value)
    assert expect in message, message
    assert "\n" not in message and "Traceback" not in message
    assert snapshot(ws) == before, "the API call touched files"
    capsys.readouterr()
    with time_limit(30):
        rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlx-infer: error: ") and expect in lines[0], err
    assert snapshot(ws) == before, "the CLI touched files"
    assert snapshot(env.base) == models_before


@pytest.mark.parametrize("name", ["rng-steps-huge", "generated-too-many", "convert-onto-parent-of-source"])
def test_hostile_input_in_a_real_subprocess(name, env, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    _, argv, expect = _prepare(name, env, ws)
    before = snapshot(ws)
    r = subprocess.run([sys.executable, "-m", "mlx_infer", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and expect in r.stderr and "Traceback" not in r.stderr
    assert snapshot(ws) == before


def test_a_second_writer_is_refused_while_the_first_holds_the_lock(env, tmp_path, capsys, keep_sigint):
    d = tmp_path / "ck"
    shutil.copytree(env.templates["llama"], d)
    before = snapshot(tmp_path)
    fd = os.open(d / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process's writer, as far as flock can tell
    try:
        with pytest.raises(MlxInferError, match="in use by another mlx-infer process"):
            generate_checkpointed(env.loaded["llama"], prompt_ids_for(env.loaded["llama"], "Hello"), d,
                                  sampling=SAMPLING, max_tokens=MAX_TOKENS, resume=True)
        assert main(["generate", "--resume", str(d), "--verbose", "0"]) == 2
        assert "in use" in capsys.readouterr().err
    finally:
        os.close(fd)
    assert snapshot(tmp_path) == before
    r = subprocess.Popen([sys.executable, "-m", "mlx_infer", "generate", "--resume", str(d), "--verbose", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    r.communicate(timeout=120)
    assert r.returncode == 0  # once the lock is free, the resume works


def test_a_foreign_file_inside_our_directory_survives_saves(env, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(env.templates["llama"], d)
    (d / "notes.txt").write_text("mine")
    (d / "v-000099-deadbeef").mkdir()
    (d / "v-000099-deadbeef" / "thesis.txt").write_text("also mine")
    (tmp_path / ".ck.old").mkdir()  # the name the old format's save deleted without looking
    (tmp_path / ".ck.old" / "keep.txt").write_text("the user's")
    beside = snapshot(tmp_path, skip=())
    loaded = env.loaded["llama"]
    gen = generate_checkpointed(loaded, prompt_ids_for(loaded, "Hello"), d, sampling=SAMPLING,
                                max_tokens=MAX_TOKENS, resume=True, every=5)
    with gen:
        assert len(list(gen)) == MAX_TOKENS - 7
    assert (d / "notes.txt").read_text() == "mine"
    assert (d / "v-000099-deadbeef" / "thesis.txt").read_text() == "also mine"
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("ck/")} == \
        {k: v for k, v in beside.items() if not k.startswith("ck/")}  # nothing beside the directory touched


def test_rng_from_state_is_bounded():
    with time_limit(5):
        with pytest.raises(MlxInferError, match="exceeds"):
            RequestRNG.from_state((3, 10 ** 12, True))
        with pytest.raises(MlxInferError, match="exceeds the most this run can have drawn \\(7\\)"):
            RequestRNG.from_state((3, 8, True), max_steps=7)
        for bad in [(3,), "ab", 5, (3, 1, "yes"), (-1, 1), (2 ** 64, 1), (3, 1.5), {"seed": 3}]:
            with pytest.raises(MlxInferError):
                RequestRNG.from_state(bad)
    a, b = RequestRNG(9), RequestRNG.from_state((9, 3, True))
    for _ in range(3):
        a.next_key()
    assert a.next_key().tolist() == b.next_key().tolist()


def test_two_processes_on_one_directory(env, tmp_path):
    """A second CLI writer (new run or resume) on a directory a running one holds gets one line, exit 2."""
    d = tmp_path / "ck"
    base = [sys.executable, "-m", "mlx_infer", "generate", "--model", str(env.models["llama"]), "--verbose", "0"]
    first = subprocess.Popen(base + ["--prompt", "Hello", "--temp", "0.8", "--seed", "3", "--max-tokens", "100000",
                                     "--checkpoint", str(d)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first.stdout.read(8)  # it is generating, and holds the lock
        for argv in (base + ["--prompt", "Hello", "--checkpoint", str(d)], base + ["--resume", str(d)]):
            r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            assert r.returncode == 2, r.stderr
            assert len(r.stderr.strip().splitlines()) == 1 and "in use by another mlx-infer process" in r.stderr
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=120)
    assert first.returncode == 130  # interrupted and saved
    assert not read_checkpoint(d).finished
