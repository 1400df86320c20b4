"""CLI adapters (issue 21): ``generate --adapter-path`` and ``mlx-infer fuse`` (equal to ``mlx_lm.fuse``)."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest

from lora_helpers import make_mlx_adapter
from tiny import make_tiny_model_dir

from mlx_infer.artifacts.convert import convert
from mlx_infer.artifacts.loader import load_model
from mlx_infer.cli import main
from mlx_infer.generation.autoregressive import generate, generate_tokens


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora-cli")
    make_tiny_model_dir(root / "llama", "llama")
    convert(root / "llama", root / "llama-q4", quantize_bits=4, group_size=32, progress=False)
    return root


def test_generate_adapter_path(root, capsys):
    a = make_mlx_adapter(root / "llama", root / "gen-lora", seed=50, b_std=1.0)
    want = "".join(t.text for t in generate(load_model(root / "llama", cpu_kernels=False), "The capital",
                                             max_tokens=6, adapter=str(a), chat=False))
    base = "".join(t.text for t in generate(load_model(root / "llama", cpu_kernels=False), "The capital",
                                             max_tokens=6, chat=False))
    assert want != base
    rc = main(["generate", "--model", str(root / "llama"), "--adapter-path", str(a), "--prompt", "The capital",
               "--max-tokens", "6", "--stock-kernels", "--ignore-chat-template", "--verbose", "false"])
    assert rc == 0
    assert capsys.readouterr().out == want + "\n"


def test_generate_bad_adapter_is_one_line_exit_2(root, capsys):
    bad = root / "bad-adapter"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{}")
    rc = main(["generate", "--model", str(root / "llama"), "--adapter-path", str(bad), "--prompt", "x",
               "--verbose", "false"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("mlx-infer: error: ") and err.count("\n") == 1
    assert "holds neither adapters.safetensors" in err


def _tensors(d: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


@pytest.mark.parametrize("kind", ["lora", "dora", "q4-lora", "q4-lora-dequantize"])
def test_fuse_equals_mlx_lm_fuse(root, kind, monkeypatch):
    model = root / ("llama-q4" if kind.startswith("q4") else "llama")
    a = make_mlx_adapter(model, root / f"fuse-{kind}", seed=51, dora="dora" in kind,
                         keys=["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"])
    extra = ["--dequantize"] if kind.endswith("dequantize") else []
    ours, theirs = root / f"ours-{kind}", root / f"theirs-{kind}"
    assert main(["fuse", "--model", str(model), "--adapter-path", str(a), "--save-path", str(ours)] + extra) == 0
    from mlx_lm import fuse as mlx_lm_fuse  # in-process: `mlx_lm.fuse --model ... --save-path ...`

    monkeypatch.setattr(sys, "argv", ["mlx_lm.fuse", "--model", str(model), "--adapter-path", str(a),
                                      "--save-path", str(theirs)] + extra)
    mlx_lm_fuse.main()
    mine, ref = _tensors(ours), _tensors(theirs)
    assert sorted(mine) == sorted(ref)
    for k in ref:
        assert mine[k].dtype == ref[k].dtype and mx.array_equal(mine[k], ref[k]), k
    if kind == "lora":  # the fused model continues as the adapter does
        prompt = [5, 17, 33, 2]
        loaded = load_model(model, cpu_kernels=False)
        from mlx_infer.adapters import attach_adapter

        name = attach_adapter(loaded.model, a)
        with_adapter = [t.token for t in generate_tokens(loaded.model, prompt, max_tokens=6, adapter=name)]
        fused = [t.token for t in generate_tokens(load_model(ours, cpu_kernels=False).model, prompt, max_tokens=6)]
        assert fused == with_adapter


def test_serve_lora_flags(root, capsys):
    from mlx_infer.cli import build_parser
    from mlx_infer.cli.adapters import parse_loras

    args = build_parser().parse_args(["serve", "--lora", "sql=/a/b", "chat=/c", "--lora", "/d/e", "--max-loras", "3"])
    assert parse_loras(args.lora) == [("sql", "/a/b"), ("chat", "/c"), ("e", "/d/e")] and args.max_loras == 3
    rc = main(["serve", "--model", str(root / "llama"), "--port", "0", "--lora", f"bad={root / 'nowhere'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "--lora bad=" in err and "is not a directory" in err and err.count("\n") == 1
    rc = main(["serve", "--model", str(root / "llama"), "--port", "0", "--lora", "x=/a", "x=/b"])
    assert rc == 2 and "twice" in capsys.readouterr().err


def test_compiled_step_on_a_quantized_base(root):
    from mlx_infer.adapters import attach_adapter
    from mlx_infer.generation.bindings.autoregressive import bind_autoregressive

    a = make_mlx_adapter(root / "llama-q4", root / "q4-compiled", seed=52, b_std=1.0,
                         keys=["self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj"])
    for kernels in (False, True):
        loaded = load_model(root / "llama-q4", cpu_kernels=kernels)
        name = attach_adapter(loaded.model, a)
        prompt = [5, 17, 33, 2]
        eager = [t.token for t in generate_tokens(loaded.model, prompt, max_tokens=8, adapter=name)]
        step = bind_autoregressive(loaded).create_decode()
        got = [t.token for t in generate_tokens(loaded.model, prompt, max_tokens=8, adapter=name, decode=step)]
        assert not step.failed, step.last_error
        assert got == eager, kernels
