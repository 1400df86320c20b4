"""Loading model directories, and the clear errors bad input gets."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from tiny import make_tiny_model_dir

from mlx_infer.artifacts.loader import load_model
from mlx_infer.errors import ModelLoadError, PromptTooLongError, UnsupportedModelError
from mlx_infer.generation.autoregressive import generate_tokens


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def test_loads_a_directory(tiny_dir):
    loaded = load_model(tiny_dir)
    assert loaded.config["model_type"] == "llama"
    assert loaded.eos_token_ids == {1}
    assert loaded.context_length == 256
    assert loaded.tokenizer.encode("Hello")[0] == 0  # BOS added
    logits = loaded.model(mx.array([[0, 5, 6]]))
    assert logits.shape == (1, 3, 320)


def test_dtype_cast(tiny_dir):
    loaded = load_model(tiny_dir, dtype="bfloat16")
    assert loaded.model.model.embed_tokens.weight.dtype == mx.bfloat16


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_missing_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("/nonexistent/model")


def test_missing_config(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(d)


def test_malformed_config(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(d)


def test_config_without_model_type(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["model_type"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="no \"model_type\""):
        load_model(d)


def test_unknown_model_type(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mamba9000"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="mamba9000"):
        load_model(d)


def test_truncated_safetensors(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model(d)


def test_weights_not_matching_config(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="do not match"):
        load_model(d)


def test_not_a_model_file(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    with pytest.raises(ModelLoadError, match="neither a GGUF file"):
        load_model(f)


def test_prompt_longer_than_context(tiny_dir):
    loaded = load_model(tiny_dir)
    with pytest.raises(PromptTooLongError, match="context window is 256"):
        generate_tokens(loaded.model, [5] * 300, context_length=loaded.context_length)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mlx_infer", *args], capture_output=True, text=True, timeout=300)


def test_cli_errors_are_one_line_without_traceback(tiny_dir, tmp_path):
    r = _cli("generate", "--model", "/nonexistent/model", "--prompt", "hi")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "does not exist" in r.stderr
    r = _cli("generate", "--model", str(tiny_dir), "--prompt", "hello " * 400)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "context window" in r.stderr


def test_cli_generates_on_a_tiny_model(tiny_dir):
    r = _cli("generate", "--model", str(tiny_dir), "--prompt", "Hello", "--max-tokens", "5", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "generation: " in r.stderr  # stats on stderr
    again = _cli("generate", "--model", str(tiny_dir), "--prompt", "Hello", "--max-tokens", "5", "--temp", "0")
    assert again.stdout == r.stdout  # greedy is deterministic
