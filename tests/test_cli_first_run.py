"""What a new user meets: the first run, chat templates, mlx-lm's flags, messages, a closed stdout, the cache.

Tiny random models (tests/tiny.py) except the ``slow`` test of the README's first command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlx_infer.cli import build_parser, main
from tiny import make_tiny_model_dir

CLI = [sys.executable, "-m", "mlx_infer"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny llama whose tokenizer has a chat template."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("first-run"), "llama")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The same tiny llama without a chat template (a base model)."""
    d = make_tiny_model_dir(tmp_path_factory.mktemp("first-run-base"), "llama")
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    return d


def run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, **kw)


def one_line_error(r: subprocess.CompletedProcess, match: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0], r.stderr


# --- chat templates: applied by default when present, never invented ---------------------------

def test_chat_template_applies_by_default_as_mlx_lm(tiny):
    from mlx_infer.artifacts.loader import load_model
    from mlx_infer.generation.autoregressive import generate

    loaded = load_model(tiny)
    with generate(loaded, "hello", max_tokens=12, chat=True) as g:
        chat_text = "".join(t.text for t in g)
    with generate(loaded, "hello", max_tokens=12, chat=False) as g:
        raw_text = "".join(t.text for t in g)
    default = run(["generate", "--model", str(tiny), "--prompt", "hello", "-m", "12"])
    ignored = run(["generate", "--model", str(tiny), "--prompt", "hello", "-m", "12", "--ignore-chat-template"])
    assert default.returncode == 0 and ignored.returncode == 0, default.stderr + ignored.stderr
    assert default.stdout == chat_text + "\n"
    assert ignored.stdout == raw_text + "\n"


def test_chat_on_a_model_without_template_says_so(base):
    r = run(["generate", "--model", str(base), "--prompt", "hi", "--chat"])
    one_line_error(r, "has no chat template")
    r = run(["generate", "--model", str(base), "--prompt", "hi", "--system-prompt", "Be brief."])
    one_line_error(r, "--system-prompt")
    r = run(["generate", "--model", str(base), "--prompt", "hi", "-m", "4"])  # a base model completes raw text
    assert r.returncode == 0, r.stderr


def test_gguf_without_template_gets_none_invented():
    from mlx_infer.artifacts import gguf_tokenizer

    assert not hasattr(gguf_tokenizer, "GEMMA_CHAT_TEMPLATE")


def test_server_chat_on_base_model_is_a_400_naming_the_model(base):
    from mlx_infer.artifacts.loader import load_model
    from mlx_infer.engine import Engine, EngineConfig
    from mlx_infer.server import ServerThread, create_app

    engine = Engine(load_model(base), EngineConfig(page_size=8)).start()
    srv = ServerThread(create_app(engine, model_id="tiny-base")).start()
    try:
        r = httpx.post(f"{srv.url}/chat/completions" if srv.url.endswith("/v1") else f"{srv.url}/v1/chat/completions",
                       json={"model": "tiny-base", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "'tiny-base' has no chat template" in err["message"] and err["code"] == "no_chat_template"
    finally:
        srv.stop()
        engine.stop()


def test_system_prompt_with_ignore_chat_template_refused_before_loading(tmp_path):
    r = run(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi", "--system-prompt", "x",
             "--ignore-chat-template"])
    one_line_error(r, "--ignore-chat-template")  # not "does not exist": checked before the model


# --- mlx-lm flag parity, help, version, usage -------------------------------------------------

def test_mlx_lm_defaults_and_flags():
    p = build_parser()
    g = p.parse_args(["generate"])
    assert g.max_tokens == 100 and g.verbose is True and g.ignore_chat_template is False
    for word, value in (("T", True), ("true", True), ("1", True), ("False", False), ("f", False), ("0", False)):
        assert p.parse_args(["generate", "--verbose", word]).verbose is value, word
    c = p.parse_args(["convert", "--model", "m.gguf", "-q"])
    assert c.quantize is True and c.q_bits == 4 and c.q_group_size == 64 and c.mlx_path == "mlx_model"
    assert p.parse_args(["serve", "--log-level", "INFO"]).log_level == "info"


@pytest.mark.parametrize("verb, shown", [("generate", "most tokens to generate (default: 100)"),
                                         ("serve", "TCP port (default: 8080)"),
                                         ("convert", "output directory (default: mlx_model)"),
                                         ("bench", "prompt length (default: 512)"),
                                         ("cache", "(default: list)")])
def test_help_shows_defaults(verb, shown, capsys):
    with pytest.raises(SystemExit) as e:
        main([verb, "--help"])
    assert e.value.code == 0
    assert shown in " ".join(capsys.readouterr().out.split())


def test_version_and_usage_without_command():
    r = run(["--version"])
    assert r.returncode == 0 and r.stdout.startswith("mlx-infer ")
    r = run([])
    one_line_error(r, "give a command: generate, serve, convert, bench or cache")


def test_max_tokens_checked_before_loading(tmp_path):
    t0 = time.monotonic()
    r = run(["generate", "--max-tokens", "-1", "--prompt", "hi"])  # the default model: never loaded
    one_line_error(r, "--max-tokens must be >= 0")
    assert time.monotonic() - t0 < 20


def test_messages_name_flags_not_internals(tiny, tmp_path):
    one_line_error(run(["generate", "--model", str(tiny), "--prompt", "hi", "--top-p", "2"]), "--top-p must be in")
    out = tmp_path / "out"
    assert run(["convert", "--model", str(tiny), "--mlx-path", str(out)]).returncode == 0
    (out / "note.txt").write_text("mine")  # not written by convert: --overwrite must refuse, in flag words
    r = run(["convert", "--model", str(tiny), "--mlx-path", str(out)])
    one_line_error(r, "exists")
    assert "overwrite=True" not in r.stderr


# --- a closed stdout, Ctrl-C ------------------------------------------------------------------

def test_piping_to_head_exits_quietly(tiny):
    """``mlx-infer generate ... | head -c 20``: the reader goes away; no traceback, exit 0 or 141."""
    cmd = " ".join([*map(str, CLI), "generate", "--model", str(tiny), "--prompt", "hi", "-m", "400",
                    "--ignore-chat-template"])
    r = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd} | head -c 1 > /dev/null"],
                       capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr
    assert r.returncode in (0, 141), r.stderr
    p = subprocess.Popen([*CLI, "generate", "--model", str(tiny), "--prompt", "hi", "-m", "50"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # closed before the first token: every write fails
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) in (0, 141) and "Traceback" not in err, err


# --- caches: one root, the cache command ------------------------------------------------------

def test_every_cache_under_one_root(tmp_path, monkeypatch):
    from mlx_infer.artifacts import default_model as dm

    monkeypatch.delenv("MLX_INFER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.cache_dir() == tmp_path / "xdg" / "mlx-infer"
    assert dm.default_gguf_path().parent == tmp_path / "xdg" / "mlx-infer" / "gguf"
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path / "mine"))
    assert dm.default_gguf_path() == tmp_path / "mine" / "gguf" / dm._package().MODEL_NAME
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("MLX_INFER_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert dm.cache_dir() == tmp_path / "home" / ".cache" / "mlx-infer"


def test_cache_command_lists_locates_and_clears(tmp_path, tiny):
    env = {**os.environ, "MLX_INFER_CACHE": str(tmp_path / "c")}
    (tmp_path / "c" / "converted" / "m-1").mkdir(parents=True)
    (tmp_path / "c" / "converted" / "m-1" / "model.safetensors").write_bytes(b"x" * 2_000_000)
    (tmp_path / "c" / "unrelated.txt").write_text("not ours")
    r = run(["cache"], env=env)
    assert r.returncode == 0 and "2.0 MB" in r.stdout and "m-1" in r.stdout, r.stdout + r.stderr
    r = run(["cache", "path"], env=env)
    assert r.stdout.strip().startswith(str(tmp_path / "c" / "gguf"))
    r = run(["cache", "clear"], env=env)
    assert r.returncode == 0 and "removed 2.0 MB" in r.stderr
    assert not (tmp_path / "c" / "converted").exists() and (tmp_path / "c" / "unrelated.txt").exists()


# --- the README's first command ---------------------------------------------------------------

@pytest.mark.slow
def test_readme_first_command_text_on_stdout_stats_on_stderr(tmp_path):
    """The README's first command, generate part, run by the venv's ``mlx-infer`` entry point.

    CI (.ci/run) builds a fresh venv on a clean clone with the README's install and runs pytest in it,
    so ``sys.executable``'s bin dir holds the freshly installed console script: running it here is the
    README's first command on a fresh install, without a second multi-minute install. (A source-tree
    run without the script falls back to ``python -m mlx_infer``, the same ``main``.) A private cache:
    the first run assembles and converts the default model, as a new user's does.
    """
    script = Path(sys.executable).parent / "mlx-infer"
    cmd = [str(script)] if script.is_file() else CLI
    env = {**os.environ, "MLX_INFER_CACHE": str(tmp_path / "cache")}
    env.pop("MLX_INFER_CPU_KERNELS", None)  # what a user gets
    args = ["generate", "--prompt", "The capital of France is", "--temp", "0", "--max-tokens", "32"]
    for _ in range(2):  # first run (converts) and second run (loads the cache)
        r = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr
        assert "France" in r.stdout and "tokens/s" not in r.stdout  # the base model: "... the capital of the country of France"
        assert "generation: 32 tokens" in r.stderr and "Traceback" not in r.stderr
        assert "France" not in r.stderr and "%|" not in r.stderr  # no progress bars off a terminal


def test_conversions_from_an_older_format_are_not_reused(tmp_path, monkeypatch):
    """Caches converted before CONVERSION_FORMAT 2 hold an invented chat template: a new key skips them."""
    from mlx_infer.artifacts import default_model as dm

    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 60)
    now = dm.gguf_cache_key(f)
    monkeypatch.setattr(dm, "CONVERSION_FORMAT", 1)
    assert dm.gguf_cache_key(f) != now


def test_resumed_finished_run_reports_no_zero_peak(tiny, tmp_path):
    ck = tmp_path / "ck"
    r = run(["generate", "--model", str(tiny), "--prompt", "hi", "-m", "4", "--checkpoint", str(ck)])
    assert r.returncode == 0 and "peak memory: 0.000" not in r.stderr, r.stderr
    r = run(["generate", "--resume", str(ck)])
    assert r.returncode == 0, r.stderr
    assert "generation: 0 tokens" in r.stderr and "peak memory: n/a" in r.stderr and "0.000 GB" not in r.stderr


def test_serve_sampling_defaults_and_chat_template_checked_before_loading(tmp_path):
    for flags, named in ((["--temp", "-1"], "--temp must be >= 0"), (["--top-p", "2"], "--top-p must be in"),
                         (["--chat-template", "{% if %}"], "--chat-template"),
                         (["--chat-template", " "], "--chat-template is empty")):
        r = run(["serve", "--model", str(tmp_path / "missing"), *flags])
        one_line_error(r, named)


def test_serve_chat_template_and_defaults_apply(base, tmp_path):
    from mlx_infer.server import ServeOptions
    from mlx_infer.server.run import build

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    app, engine, _ = build(ServeOptions(model=str(base), chat_template=template, temp=0.5, top_k=3))
    try:
        assert engine.tokenizer.chat_template == template
        assert engine.generation_config["temperature"] == 0.5
        assert engine.generation_config["top_k"] == 3
    finally:
        engine.stop()


def test_prefill_reports_progress_per_chunk(tiny):
    from mlx_infer.artifacts.loader import load_model
    from mlx_infer.generation.autoregressive import generate

    seen = []
    loaded = load_model(tiny)
    with generate(loaded, "hello world " * 15, max_tokens=2, prefill_step_size=16,
                  on_prefill=lambda done, total: seen.append((done, total))) as g:
        list(g)
    total = g.stats.prompt_tokens - 1
    assert seen and seen[-1] == (total, total) and all(d % 16 == 0 for d, _ in seen[:-1])
    assert [d for d, _ in seen] == sorted({d for d, _ in seen})


def test_prefill_bar_drawn_on_a_terminal(tiny, monkeypatch, capsys):
    import mlx_infer.cli.generate as cli

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    update = cli._prefill_progress()
    for done in (512, 1024, 1500):
        update(done, 1500)
    assert "mlx-infer: prompt" in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert cli._prefill_progress() is None  # off a terminal: nothing


def test_resume_refuses_ignore_chat_template_on_a_chat_run(tiny, tmp_path):
    ck = tmp_path / "ck"
    r = run(["generate", "--model", str(tiny), "--prompt", "hi", "-m", "4", "--checkpoint", str(ck)])
    assert r.returncode == 0, r.stderr  # the template applied by default: a chat run
    one_line_error(run(["generate", "--resume", str(ck), "--ignore-chat-template"]),
                   "--ignore-chat-template (True given, False saved)")
    assert run(["generate", "--resume", str(ck), "--chat"]).returncode == 0  # as saved
