"""The CLI's adapter flags and commands (thin over :mod:`mlx_infer.adapters`).

- ``mlx-infer generate --adapter-path DIR``: run with an adapter (as ``mlx_lm.generate``);
- ``mlx-infer serve --lora NAME=PATH ...``: adapters the server offers by name (vLLM's flag);
- ``mlx-infer fuse --model DIR --adapter-path DIR --save-path DIR``: merge one (as ``mlx_lm.fuse``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import MlxInferError


def add_generate_flags(g: argparse.ArgumentParser) -> None:
    """``--adapter-path`` on ``generate``."""
    g.add_argument("--adapter-path", default=None, metavar="DIR",
                   help="LoRA/DoRA adapter directory (mlx-lm's adapters.safetensors or PEFT's "
                        "adapter_model.safetensors, with adapter_config.json) to generate with")


def apply_generate_flags(args: argparse.Namespace, loaded: Any) -> None:
    """Load ``--adapter-path`` onto the model as its default adapter (a checkpoint records it: name and
    content hash; ``--resume`` refuses another adapter, or none for a run that had one)."""
    if getattr(args, "adapter_path", None) is None:
        return
    if loaded.model.declaration.method != "autoregressive":
        raise MlxInferError("--adapter-path works with autoregressive models only; this one denoises.")
    from ..adapters import attach_adapter, bank_of

    name = attach_adapter(loaded.model, args.adapter_path)
    bank_of(loaded.model).default = name


def add_serve_flags(s: argparse.ArgumentParser) -> None:
    """``--lora NAME=PATH ...`` and ``--max-loras`` on ``serve``."""
    s.add_argument("--lora", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve: each is listed in /v1/models and chosen by a request's "
                        "\"model\" (or \"adapter\") field (repeatable)")
    s.add_argument("--max-loras", type=int, default=8,
                   help="most adapters resident at once (idle ones are unloaded least recently used first "
                        "and loaded again when asked for)")


def parse_loras(items: list[str] | None) -> list[tuple[str, str]]:
    """``NAME=PATH`` pairs (a bare PATH is named after its directory)."""
    out = []
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep:
            from pathlib import Path

            name, path = Path(item).expanduser().resolve().name, item
        if not name or not path:
            raise MlxInferError(f"--lora {item!r}: give NAME=PATH (an adapter directory).")
        out.append((name, path))
    names = [n for n, _ in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise MlxInferError(f"--lora names {dup!r} twice; give each adapter its own name.")
    return out


def add_fuse_parser(sub: Any) -> None:
    """Register the ``fuse`` command."""
    f = sub.add_parser("fuse", help="merge a LoRA/DoRA adapter into a model directory (as mlx_lm.fuse)")
    f.add_argument("--model", required=True, help="the base model directory")
    f.add_argument("--adapter-path", required=True, metavar="DIR", help="the adapter directory")
    f.add_argument("--save-path", default="fused_model", metavar="DIR", help="output directory")
    f.add_argument("--dequantize", action="store_true", help="write the fused model dense (unquantized)")
    f.add_argument("--overwrite", action="store_true", help="replace an output directory an earlier fuse wrote")
    f.set_defaults(func=_fuse)


def _fuse(args: argparse.Namespace) -> int:
    from ..adapters.fuse import fuse_adapter

    out = fuse_adapter(args.model, args.adapter_path, args.save_path, dequantize=args.dequantize,
                       overwrite=args.overwrite)
    print(f"fused {args.adapter_path} into {out}", file=sys.stderr)
    return 0
