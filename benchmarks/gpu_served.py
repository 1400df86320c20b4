"""Served decode on real model shapes with random weights: the engine vs mlx-lm's BatchGenerator.

    python benchmarks/gpu_served.py --models llama-1b,llama-8b --streams 8,32,64 -p 256 -g 128 \
        --json-dir benchmarks/results
    python benchmarks/gpu_served.py --models llama-1b --tiny --streams 2,4 -p 16 -g 8 -r 1 -n 1   # CPU smoke

For each shape of ``gpu_decode.SHAPES``: our graph with random bf16 weights
(``gpu_decode.build_model``) saved as an HF directory both loaders read, with
the tests' tiny byte-level tokenizer beside it (only needed to load: no column
detokenizes), then ``served.py --model DIR --no-text`` on it (``mlx-infer-ids``
and ``mlx-lm`` alternating trial by trial). Arguments after the known ones go to
served.py unchanged.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))


def write_model(name: str, tiny: bool, path: Path) -> Path:
    import mlx.core as mx
    from gpu_decode import SHAPES, TINY, build_model, save_hf_dir
    from tiny import make_tokenizer_json

    config = dict(SHAPES[name], **(TINY[name] if tiny else {}))
    model = build_model(config)
    save_hf_dir(model, config, path)
    del model
    mx.clear_cache()
    (path / "tokenizer.json").write_text(make_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama-1b,llama-8b")
    p.add_argument("--tiny", action="store_true", help="toy sizes of the shapes (CPU smoke run)")
    p.add_argument("--json-dir", default=None, help="write served-<model>.json here")
    p.add_argument("--prefix", default="h200", help="file name prefix of the JSON documents")
    args, rest = p.parse_known_args()
    for name in args.models.split(","):
        tmp = Path(tempfile.mkdtemp(prefix="gpu-served-"))
        try:
            path = write_model(name, args.tiny, tmp / name)
            cmd = [sys.executable, str(ROOT / "benchmarks" / "served.py"), "--model", str(path), "--no-text", *rest]
            if args.json_dir:
                cmd += ["--json", str(Path(args.json_dir) / f"{args.prefix}-served-{name}.json")]
            print(f"== {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
