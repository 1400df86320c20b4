"""The models and prompts of the served benchmarks (served.py, join_ttft.py, host_step.py, ...): random weights
of a real shape (gpu_decode.py's SHAPES) saved as a model directory with a whole-vocabulary word tokenizer, the
directory a run names, and prompts with no shared prefix."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shape_dir(name: str, toy: bool, root: Path, bits: int | None = None) -> Path:
    """A model directory with random bf16 weights of shape ``name`` and a whole-vocabulary tokenizer; ``bits``:
    its linear and embedding weights affine-quantized (group 64, bf16 scales and biases) as ``mlx_lm.convert -q
    --q-bits BITS`` writes them (config.json's "quantization"), which both mlx-lm and mlx-infer load."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import mlx.nn as nn
    from gpu_decode import SHAPES, TINY, build_model, save_hf_dir

    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    if bits not in (None, 4, 8):
        raise SystemExit(f"--quantize {bits}: 4 or 8 bits (affine, group 64)")
    config = dict(SHAPES[name], **(TINY[name] if toy else {}))
    model = build_model(config)
    if bits:
        config["quantization"] = {"group_size": 64, "bits": bits}
        nn.quantize(model, group_size=64, bits=bits)
    path = root / (name + ("-toy" if toy else "") + (f"-q{bits}" if bits else ""))
    save_hf_dir(model, config, path)
    write_word_tokenizer(path, config["vocab_size"])
    return path


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
    """tokenizer.json (word level: id ``i`` is ``t{i}``, ids 0-2 the bos/eos/pad specials) and its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<bos>", "<eos>", "<pad>"]
    vocab = {w: i for i, w in enumerate(specials + [f"t{i}" for i in range(len(specials), vocab_size)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                            "pad_token": "<pad>", "add_bos_token": False}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))


def model_dir(args: argparse.Namespace) -> Path:
    """The MLX directory to benchmark: a fresh tiny model, the given path, or the embedded model."""
    if args.shape:
        return shape_dir(args.shape, args.toy, Path(tempfile.mkdtemp(prefix="served-")),
                         getattr(args, "quantize", None))
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny import make_tiny_model_dir

        return make_tiny_model_dir(Path(tempfile.mkdtemp(prefix="served-")) / args.tiny, args.tiny)
    from mlx_infer.artifacts.default_model import default_model_gguf
    from mlx_infer.artifacts.loader import converted_gguf_dir, is_gguf

    source = Path(args.model).expanduser() if args.model else default_model_gguf()
    return converted_gguf_dir(source) if is_gguf(source) else source


def prompts_for(n: int, length: int, vocab: int, start: int = 0) -> list[list[int]]:
    """``n`` distinct prompts of ``length`` ids, numbered from ``start`` (no shared prefix page, so
    no prefix-cache help; another ``start`` gives a trial prompts of its own)."""
    return [[(97 * i + 31 * j + 7) % (vocab - 10) + 5 for j in range(length)] for i in range(start, start + n)]
