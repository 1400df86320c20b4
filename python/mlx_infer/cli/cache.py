"""``mlx-infer cache [list | path | clear]``: what mlx-infer keeps on disk, and where.

Every cached file lives under one root (:func:`mlx_infer.artifacts.default_model.cache_dir`:
``$MLX_INFER_CACHE``, else ``$XDG_CACHE_HOME/mlx-infer``, else ``~/.cache/mlx-infer``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from ..artifacts.default_model import CACHE_PARTS, cache_dir, default_gguf_path


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"


def entries() -> list[tuple[Path, int]]:
    """``(path, bytes)`` of each cached item: the entries of the root's ``gguf``, ``default``,
    ``converted`` and ``bench`` directories."""
    root = cache_dir()
    out = []
    for part in CACHE_PARTS:
        d = root / part
        if d.is_dir():
            out.extend((e, _size(e)) for e in sorted(d.iterdir()))
    return out


def _default_gguf() -> str:
    try:
        return str(default_gguf_path())
    except ValueError:  # the default model's package is not installed
        return "(the default model package is not installed)"


def _cache(args: argparse.Namespace) -> int:
    root = cache_dir()
    action = args.action or "list"
    if action == "path":
        print(_default_gguf())
        return 0
    if action == "clear":
        removed = 0
        for part in CACHE_PARTS:  # only what mlx-infer writes: the root may be shared
            d = root / part
            if d.is_dir():
                removed += _size(d)
                shutil.rmtree(d)
        print(f"removed {_human(removed)} from {root}", file=sys.stderr)
        return 0
    items = entries()
    print(f"cache root: {root} (MLX_INFER_CACHE, else XDG_CACHE_HOME/mlx-infer, else ~/.cache/mlx-infer)")
    print(f"default GGUF: {_default_gguf()}")
    for path, n in items:
        print(f"{_human(n):>10}  {path}")
    print(f"{_human(sum(n for _, n in items)):>10}  total" if items else "(empty)")
    return 0


def add_cache_parser(sub: Any) -> None:
    """Register the ``cache`` command on the CLI's subparsers."""
    c = sub.add_parser("cache", help="list, locate or clear mlx-infer's cached models")
    c.add_argument("action", nargs="?", choices=["list", "path", "clear"], default="list",
                   help="list: entries and sizes; path: the default model's GGUF (for convert --model); "
                        "clear: remove every cached model")
    c.set_defaults(func=_cache)
