"""``generate --adapter-path`` with ``--checkpoint/--resume``: the checkpoint's identity holds the
adapter (name and content hash); resuming under another adapter, or none, is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_helpers import make_mlx_adapter
from tiny import make_tiny_model_dir

from mlx_infer.artifacts.loader import load_model
from mlx_infer.cli import main
from mlx_infer.generation.autoregressive import generate

FLAGS = ["--max-tokens", "6", "--stock-kernels", "--ignore-chat-template", "--verbose", "false"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora-ckpt")
    make_tiny_model_dir(root / "llama", "llama")
    make_mlx_adapter(root / "llama", root / "a", seed=70, b_std=1.0)
    make_mlx_adapter(root / "llama", root / "b", seed=71, b_std=1.0)
    return root


def _fails_with(capsys, argv: list[str], *needles: str) -> None:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("mlx-infer: error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, err


def test_checkpoint_records_the_adapter_and_resume_checks_it(root, tmp_path, capsys):
    want = "".join(t.text for t in generate(load_model(root / "llama", cpu_kernels=False), "The capital",
                                             max_tokens=6, adapter=str(root / "a"), chat=False))
    ck = tmp_path / "run"
    rc = main(["generate", "--model", str(root / "llama"), "--adapter-path", str(root / "a"), "--prompt",
               "The capital", "--checkpoint", str(ck), "--checkpoint-every", "2"] + FLAGS)
    assert rc == 0 and capsys.readouterr().out == want + "\n"
    meta = next(ck.rglob("checkpoint.json"))
    adapter = json.loads(meta.read_text())["fields"]["execution"]["adapter"]
    assert adapter.startswith("a:") and len(adapter) == len("a:") + 64  # name and sha256 of its weights
    _fails_with(capsys, ["generate", "--model", str(root / "llama"), "--resume", str(ck), "--adapter-path",
                         str(root / "b")] + FLAGS[2:], "the adapter", "'b:")
    _fails_with(capsys, ["generate", "--model", str(root / "llama"), "--resume", str(ck)] + FLAGS[2:],
                "the adapter", "none now")
    assert main(["generate", "--model", str(root / "llama"), "--resume", str(ck), "--adapter-path",
                 str(root / "a")] + FLAGS[2:]) == 0  # the same adapter: accepted (the run had finished)


def test_a_run_without_adapter_refuses_one_on_resume(root, tmp_path, capsys):
    ck = tmp_path / "plain"
    assert main(["generate", "--model", str(root / "llama"), "--prompt", "The capital", "--checkpoint",
                 str(ck)] + FLAGS) == 0
    capsys.readouterr()
    assert "adapter" not in json.loads(next(ck.rglob("checkpoint.json")).read_text())["fields"]["execution"]
    _fails_with(capsys, ["generate", "--model", str(root / "llama"), "--resume", str(ck), "--adapter-path",
                         str(root / "a")] + FLAGS[2:], "the adapter (none saved")
