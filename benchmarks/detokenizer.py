"""What text costs a served token: the streaming detokenizer alone, and an engine step with text against ids.

Every token the server streams goes through ``StreamingDetokenizer.add`` on the engine's thread (the engine
process's, under ``mlx-infer serve``), between the steps: on a host-bound step (a GPU with a small model, or
any CPU) its cost adds to every step. Two measurements:

- per token: ``add`` over 8 sequences of 256 random ids (what a random-weight model samples; the word
  tokenizer of ``served.py --shape`` has no newline, so its text is one long line) and over README.md's text,
  on served.py's whole-vocabulary word tokenizer and, where the default model is cached, the real Gemma 3
  tokenizer (262,144 tokens);
- per step: the tiny llama's engine (CPU or GPU) decoding ``--streams`` requests of 300 tokens with the word
  tokenizer, ``detokenize`` on and off, alternating, the median step over 200 steps once all decode.

    python benchmarks/detokenizer.py --streams 32,64 --json benchmarks/results/cpu-detokenizer.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from served_models import write_word_tokenizer  # noqa: E402
from tiny import make_tiny_model_dir  # noqa: E402

from mlx_infer.artifacts.loader import load_model  # noqa: E402
from mlx_infer.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from mlx_infer.engine.scheduler import DECODE  # noqa: E402
from mlx_infer.input.tokenizer import Tokenizer, load_tokenizer  # noqa: E402


def per_token_us(tok: Tokenizer, sequences: list[list[int]]) -> float:
    """Mean microseconds of ``add`` (+ one ``flush`` per sequence) per token."""
    t, n = time.perf_counter(), 0
    for ids in sequences:
        d = tok.detokenizer()
        for i in ids:
            d.add(i)
        d.flush()
        n += len(ids)
    return (time.perf_counter() - t) / n * 1e6


def tokenizers(root: Path) -> dict[str, Tokenizer]:
    """served.py's word tokenizer (128,256 words) and the default model's, where its conversion is cached."""
    word = root / "word"
    word.mkdir()
    write_word_tokenizer(word, 128256)
    out = {"word-128k": load_tokenizer(word)}
    cached = sorted(Path.home().glob(".cache/mlx-infer/default/*/tokenizer.json"))
    if cached:
        out["gemma3"] = load_tokenizer(cached[0].parent)
    return out


def step_ms(loaded, B: int, detokenize: bool, vocab: int) -> float:
    engine = Engine(loaded, EngineConfig(max_batch=B, num_pages=B * 40 + 1))
    prompts = [[(7 * i + j) % (vocab - 10) + 5 for j in range(16)] for i in range(B)]
    for p in prompts:
        engine.submit(EngineRequest(prompt_ids=p, max_tokens=300, ignore_eos=True, detokenize=detokenize))
    while not (len(engine.scheduler.running) == B and all(r.state == DECODE for r in engine.scheduler.running)):
        engine.step()
    walls = []
    for _ in range(210):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    engine.stop()
    return statistics.median(walls[10:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="32,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp())
    rng = random.Random(0)
    rows: list[dict] = []
    print(f"device {mx.default_device()}, mlx {mx.__version__}")
    for name, tok in tokenizers(root).items():
        rand = [[rng.randrange(3, tok.vocab_size) for _ in range(256)] for _ in range(8)]
        text = [tok.encode((ROOT / "README.md").read_text(), add_special_tokens=False)]
        row = {"tokenizer": name, "random_us_per_token": per_token_us(tok, rand),
               "readme_us_per_token": per_token_us(tok, text), "readme_tokens": len(text[0])}
        rows.append(row)
        print(f"{name:>10}: add {row['random_us_per_token']:.1f} us a token (random ids), "
              f"{row['readme_us_per_token']:.1f} us (README, {row['readme_tokens']} tokens)", flush=True)
    d = make_tiny_model_dir(root / "llama", "llama")
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    write_word_tokenizer(d, vocab)  # every id has a word: random ids make text
    loaded = load_model(d)
    steps: list[dict] = []
    for B in (int(s) for s in args.streams.split(",")):
        runs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for detok in (False, True):
                runs[detok].append(step_ms(loaded, B, detok, vocab))
        ids, text = statistics.median(runs[False]), statistics.median(runs[True])
        steps.append({"streams": B, "ids_step_ms": ids, "text_step_ms": text, "text_ms": text - ids,
                      "trials": {"ids": runs[False], "text": runs[True]}})
        print(f"streams {B:>3}: step {ids:.3f} ms ids, {text:.3f} ms with text: text costs {text - ids:+.3f} ms "
              "a step", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"mlx": mx.__version__, "device": str(mx.default_device()),
                                               "per_token": rows, "engine_step": steps}, indent=1))


if __name__ == "__main__":
    main()
