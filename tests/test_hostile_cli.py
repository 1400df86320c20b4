"""Hostile arguments and stdin of ``mlx-infer generate | convert | bench``: exit 2, one line, no traceback.
Harness: tests/hostile.py.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hostile import assert_cli_refuses, cli, copy_model, tiny_model_dirs


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    return tiny_model_dirs(tmp_path_factory)


# ---------------------------------------------------------------------------------------------
# CLI: generate, convert, bench

def _generate(*flags: str) -> list[str]:
    return ["generate", "--model", "{model}", "--prompt", "hi", *flags]


CLI_CASES: list[tuple[str, list[str], str]] = [
    ("temp_word", _generate("--temp", "abc"), r"argument --temp: invalid float value: 'abc'"),
    ("temp_nan", _generate("--temp", "nan"), r"--temp must be a finite number"),
    ("temp_negative", _generate("--temp", "-1"), r"--temp must be >= 0"),
    ("temp_1e39", _generate("--temp", "1e39"), r"--temp must be a finite number in float32"),
    ("top_p_zero", _generate("--top-p", "0"), r"--top-p must be in \(0, 1\]"),
    ("top_p_two", _generate("--top-p", "2"), r"--top-p must be in \(0, 1\]"),
    ("top_k_negative", _generate("--top-k", "-3"), r"--top-k must be >= 0"),
    ("top_k_float", _generate("--top-k", "1.5"), r"argument --top-k: invalid int value"),
    ("min_p_five", _generate("--min-p", "5"), r"--min-p must be in \[0, 1\]"),
    ("rep_penalty_zero", _generate("--repetition-penalty", "0"), r"--repetition-penalty must be > 0"),
    ("rep_penalty_negative", _generate("--repetition-penalty", "-1"), r"--repetition-penalty must be > 0"),
    ("seed_2e64", _generate("--seed", str(2**64)), r"--seed must be a non-negative integer below 2\*\*64"),
    ("seed_negative", _generate("--seed", "-1"), r"--seed must be a non-negative integer"),
    ("seed_word", _generate("--seed", "abc"), r"argument --seed: invalid int value"),
    ("max_tokens_negative", _generate("--max-tokens", "-1"), r"--max-tokens must be >= 0"),
    ("max_tokens_word", _generate("--max-tokens", "many"), r"argument --max-tokens/-m: invalid int value"),
    ("checkpoint_dot", _generate("--checkpoint", "."), r"--checkpoint '\.' is the current directory or one above it"),
    ("checkpoint_dotdot", _generate("--checkpoint", ".."), r"--checkpoint '\.\.' is the current directory or one above"),
    ("checkpoint_empty", _generate("--checkpoint", " "), r"--checkpoint needs a directory path"),
    ("checkpoint_file", _generate("--checkpoint", "{file}"), r"not a (checkpoint )?directory"),
    ("checkpoint_model_dir", _generate("--checkpoint", "{model}"), r"is \(or holds\) the model"),
    ("resume_dot", _generate("--resume", "."), r"--resume '\.' is the current directory"),
    ("checkpoint_symlink_loop", _generate("--checkpoint", "{loop}"), r"symbolic link loop|[Nn]ot a directory"),
    ("checkpoint_and_resume", _generate("--checkpoint", "a", "--resume", "b"), r"not both"),
    ("checkpoint_every_zero", _generate("--checkpoint", "run", "--checkpoint-every", "0"), r"--checkpoint-every must be >= 1"),
    ("dtype_int8", _generate("--dtype", "int8"), r"argument --dtype: invalid choice: 'int8'"),
    ("unknown_flag", _generate("--bogus"), r"unrecognized arguments: --bogus"),
    ("no_prompt", ["generate", "--model", "{model}"], r"the following arguments are required: --prompt|--prompt is required"),
    ("no_command", [], r"give a command: generate, serve, convert, bench or cache"),
    ("stop_empty", _generate("--stop", ""), r"--stop needs a non-empty string"),
    ("prompt_not_utf8", ["generate", "--model", "{model}", "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")],
     r"--prompt is not valid UTF-8"),
    ("model_missing", ["generate", "--model", "{missing}", "--prompt", "hi"], r"does not exist"),
    ("model_not_gguf_file", ["generate", "--model", "{file}", "--prompt", "hi"], r"neither a GGUF file"),
    ("model_bad_config", ["generate", "--model", "{badmodel}", "--prompt", "hi"], r'"hidden_size" must be an integer'),
    ("model_corrupt_gguf", ["generate", "--model", "{badgguf}", "--prompt", "hi"], r"truncated"),
    ("convert_quantize_3", ["convert", "--model", "{model}", "--mlx-path", "out", "-q", "--q-bits", "3"],
     r"--q-bits takes 4 or 8"),
    ("convert_group_7", ["convert", "--model", "{model}", "--mlx-path", "out", "-q", "--q-group-size", "7"],
     r"--q-group-size must be one of"),
    ("convert_into_source", ["convert", "--model", "{model}", "--mlx-path", "{model}", "--overwrite"],
     r"is \(or holds\) the source|is the source model"),
    ("convert_over_parent", ["convert", "--model", "{model}", "--mlx-path", "{case}", "--overwrite"],
     r"is \(or holds\) the source|contains the source model|current directory"),
    ("convert_over_cwd", ["convert", "--model", "{src}", "--mlx-path", ".", "--overwrite"],
     r"is the current directory or one above it; refusing to write a model there|was not written by mlx-infer convert"),
    ("convert_missing_source", ["convert", "--model", "{missing}", "--mlx-path", "out"], r"does not exist"),
    ("convert_onto_file", ["convert", "--model", "{model}", "--mlx-path", "{file}"], r"exists and is not a directory"),
    ("convert_bad_config", ["convert", "--model", "{badmodel}", "--mlx-path", "out"], r'"hidden_size" must be an integer'),
    ("convert_corrupt_gguf", ["convert", "--model", "{badgguf}", "--mlx-path", "out"], r"truncated"),
    ("convert_under_a_file", ["convert", "--model", "{model}", "--mlx-path", "{file}/sub"], r"notes.txt"),
    ("convert_dtype_bad", ["convert", "--model", "{model}", "--mlx-path", "out", "--dtype", "fp8"], r"invalid choice"),
    ("bench_prompt_tokens_zero", ["bench", "--model", "{model}", "-p", "0"], r"--prompt-tokens must be >= 1"),
    ("bench_trials_zero", ["bench", "--model", "{model}", "-n", "0"], r"--num-trials must be >= 1"),
    ("bench_batch_negative", ["bench", "--model", "{model}", "-b", "-1"], r"--batch-size must be >= 1"),
    ("bench_generation_word", ["bench", "--model", "{model}", "-g", "lots"], r"invalid int value"),
    ("bench_compare_unknown", ["bench", "--model", "{model}", "--compare", "vllm"], r"unknown engine 'vllm'"),
    ("bench_compare_twice", ["bench", "--model", "{model}", "--compare", "mlx-lm,mlx-lm"], r"names an engine twice"),
    ("bench_json_is_dir", ["bench", "--model", "{model}", "--json", "{case}"], r"--json .* is a directory"),
    ("bench_plot_under_file", ["bench", "--model", "{model}", "--plot", "{file}/x.png"], r"is a file, so the output"),
    ("bench_model_missing", ["bench", "--model", "{missing}"], r"does not exist"),
]


@pytest.fixture
def cli_case(tiny_models, tmp_path, mlx_infer_cache) -> dict[str, str]:
    """A working directory holding a model, a plain file, a bad-config model and a corrupt GGUF."""
    model = copy_model(tiny_models, "llama", tmp_path / "model")
    bad = copy_model(tiny_models, "llama", tmp_path / "badmodel")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = "abc"
    (bad / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 1))
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    return {"model": str(model), "file": str(tmp_path / "notes.txt"), "missing": str(tmp_path / "nope"),
            "badmodel": str(bad), "badgguf": str(tmp_path / "bad.gguf"), "case": str(tmp_path), "loop": str(tmp_path / "loop"),
            "src": str(tiny_models["llama"])}  # a model outside the working directory


@pytest.mark.parametrize("args, match", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_refuses_in_one_line(cli_case, tmp_path, args, match):
    argv = [a.format(**cli_case) if "{" in a else a for a in args]
    assert_cli_refuses(argv, tmp_path, match)


def test_cli_stdin_not_utf8(cli_case, tmp_path):
    assert_cli_refuses(["generate", "--model", cli_case["model"], "--prompt", "-"], tmp_path,
                       r"the prompt on stdin is not UTF-8 text \(byte 3", stdin=b"abc\xff\xfe rest")


def test_cli_stdin_utf8_still_works(cli_case, tmp_path):
    """The control: a UTF-8 prompt on stdin generates."""
    r = cli(["generate", "--model", cli_case["model"], "--prompt", "-", "--max-tokens", "3"], tmp_path,
            stdin="Hello café".encode())
    assert r.returncode == 0, r.stderr.decode()
