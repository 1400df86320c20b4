"""mlx-infer: fast language-model inference on MLX.

Quick start::

    from mlx_infer import load, generate_text
    model = load("path/to/model")          # HF dir, MLX-quantized dir or .gguf
    print(generate_text(model, "The capital of France is", max_tokens=16))
"""

from __future__ import annotations

import mlx.core as _mx  # libmlx must be loaded before our extension links against it

from ._version_check import check_mlx_version as _check_mlx_version

_check_mlx_version(_mx.__version__)

from . import _fast  # noqa: E402

__version__ = "0.1.0"

from .api import generate_text, load  # noqa: E402

__all__ = ["load", "generate_text", "__version__"]
