"""mlx-infer: fast language-model inference on MLX.

Quick start::

    from mlx_infer import load, generate_text
    model = load("path/to/model")          # HF dir, MLX-quantized dir or .gguf
    print(generate_text(model, "The capital of France is", max_tokens=16))
"""

from __future__ import annotations

# Imports mlx.core first (loading libmlx), refuses an mlx other than the one the C++ core
# was built against (ImportError naming both versions), and only then loads _fast.
from ._version_check import import_fast as _import_fast

_fast = _import_fast()

__version__ = "0.1.0"

from .api import generate_text, load  # noqa: E402

__all__ = ["load", "generate_text", "__version__"]
