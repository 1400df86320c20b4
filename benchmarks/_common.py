"""Shared plumbing of the suites: resolve the model, build engines, write results."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from mlx_infer.artifacts.default_model import default_model_gguf
from mlx_infer.artifacts.loader import converted_gguf_dir, is_gguf
from mlx_infer.bench import make_engine, results_document, write_markdown, write_plot
from mlx_infer.bench.report import write_json
from mlx_infer.bench.runner import model_facts


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set in ``os.environ`` inside the block, the previous values (or their absence) back after it: the
    A/B of a switch that mlx-infer reads at each trace or engine build."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded Gemma 3 270M)")
    p.add_argument("--compare", default="mlx-lm", help="engines beside mlx-infer (comma list, '' for none)")
    p.add_argument("--num-trials", "-n", type=int, default=3)
    p.add_argument("--json", default=None, help="write results JSON here")
    p.add_argument("--markdown", default=None, help="write a markdown table here")
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    return p


def resolve_model(model: str | None) -> tuple[Path, Path | None, str, int]:
    """(MLX dir, GGUF or None, model name, vocab size)."""
    source = Path(model).expanduser() if model else default_model_gguf()
    gguf = source if is_gguf(source) else None
    model_dir = converted_gguf_dir(gguf) if gguf else source
    name, vocab = model_facts(model_dir)
    return model_dir, gguf, (gguf.stem if gguf else name), vocab


def engines_for(args: argparse.Namespace, model_dir: Path, gguf: Path | None, n_ctx: int) -> list[Any]:
    names = ["mlx-infer", *[c.strip() for c in args.compare.split(",") if c.strip()]]
    return [make_engine(n, model=str(model_dir), model_dir=model_dir, gguf_path=gguf, n_ctx=n_ctx) for n in names]


def finish(args: argparse.Namespace, rows: list[dict[str, Any]], x: str) -> None:
    doc = results_document(rows)
    print(write_markdown(doc, Path(args.markdown) if args.markdown else None))
    if args.json:
        write_json(doc, Path(args.json))
    if args.plot:
        write_plot(doc, Path(args.plot), x=x)
    sys.stdout.flush()
