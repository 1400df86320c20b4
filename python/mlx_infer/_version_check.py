"""Refuse to load the C++ core against an MLX it was not built for.

``mlx_infer._fast`` is compiled against MLX's C++ API, whose ABI changes between
releases, and it links the ``libmlx`` of whatever ``mlx`` is installed (rpath
``../mlx/lib``). Against another release it may fail to load with an undefined
symbol or, worse, load and crash later. So before the extension is imported the
installed MLX is compared with the one the build used, three ways:

1. ``mlx.core.__version__``: the Python binding that is actually imported;
2. ``mlx::core::version()`` read through ctypes from the ``libmlx`` that is
   loaded (the very library ``_fast`` binds to; the Linux and macOS wheels put
   it in separate distributions, ``mlx-cpu`` / ``mlx-cuda-*`` / ``mlx-metal``,
   so it can differ from the binding);
3. after the import, ``_fast.built_mlx_version()``: the version compiled into
   the extension, which guards against a stale ``_build_info`` or fallback.

The version the build used comes from ``_build_info.py``, which CMake writes
next to ``_fast`` at build time; a source tree without a build falls back to
``REQUIRED_MLX_VERSION`` (which must equal the pin in ``pyproject.toml``).
"""

from __future__ import annotations

import ctypes
import os
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType

#: The MLX release pinned in pyproject.toml; used only when no build info exists.
REQUIRED_MLX_VERSION = "0.32.4"

# mlx::core::version() -> const char*, Itanium-mangled (Linux and macOS alike).
_LIBMLX_VERSION_SYMBOL = "_ZN3mlx4core7versionEv"


def built_mlx_version() -> str:
    """The MLX version ``_fast`` was compiled against, without importing ``_fast``."""
    try:
        from ._build_info import MLX_VERSION
    except ImportError:
        return REQUIRED_MLX_VERSION
    return MLX_VERSION


def check_mlx_version(installed: str, required: str | None = None, *, what: str = "mlx") -> None:
    """Raise ImportError unless ``installed`` is the MLX version we were built against.

    Args:
        installed: the version found at run time.
        required: the version the extension was built against (default: the build's).
        what: which component ``installed`` describes, for the message.
    """
    required = built_mlx_version() if required is None else required
    if installed != required:
        found = "mlx" if what == "mlx" else f"mlx ({what})"
        raise ImportError(
            f"mlx-infer was built against mlx {required}, but {found} {installed} is installed. "
            f"Install the matching release with: pip install 'mlx=={required}' "
            f"(on Linux 'mlx[cpu]=={required}' or 'mlx[cuda13]=={required}'), "
            "or rebuild mlx-infer from source against your mlx."
        )


def installed_mlx_version() -> str:
    """The version of the installed ``mlx`` distribution, from its metadata."""
    return metadata.version("mlx")


def _loaded_libmlx() -> tuple[Path, ctypes.CDLL] | None:
    """The libmlx that ``mlx.core`` loaded (the one ``_fast`` will bind to) and its handle.

    RTLD_NOLOAD: only a library already in the process is returned, never a second copy.
    """
    import mlx

    name = "libmlx.dylib" if sys.platform == "darwin" else "libmlx.so"
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    for root in getattr(mlx, "__path__", []):
        candidate = Path(root) / "lib" / name
        if candidate.is_file():
            try:
                return candidate, ctypes.CDLL(str(candidate), mode=mode)
            except OSError:  # a libmlx that isn't the loaded one
                continue
    return None


def libmlx_version() -> str | None:
    """``mlx::core::version()`` of the loaded libmlx, or None where it can't be read."""
    loaded = _loaded_libmlx()
    if loaded is None:
        return None
    try:
        fn = getattr(loaded[1], _LIBMLX_VERSION_SYMBOL)
    except AttributeError:
        return None
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    raw = fn()
    return raw.decode() if raw else None


def check_before_import() -> None:
    """Import ``mlx.core`` (loading libmlx) and check it before ``_fast`` is loaded."""
    import mlx.core as mx

    required = built_mlx_version()
    check_mlx_version(mx.__version__, required)
    lib = libmlx_version()
    if lib is not None:
        loaded = _loaded_libmlx()
        check_mlx_version(lib, required, what=f"libmlx at {loaded[0] if loaded else '?'}")


def import_fast() -> ModuleType:
    """Check the installed MLX, then import and return ``mlx_infer._fast``."""
    check_before_import()
    required = built_mlx_version()
    try:
        from . import _fast
    except ImportError as exc:
        import mlx.core as mx

        raise ImportError(
            f"mlx-infer's C++ core (mlx_infer._fast, built against mlx {required}) failed to "
            f"load with mlx {mx.__version__} installed: {exc}. Reinstall mlx-infer and "
            f"'mlx=={required}' (on Linux with the [cpu] or [cuda13] extra)."
        ) from exc
    compiled = _fast.built_mlx_version()
    if compiled != required:
        raise ImportError(
            f"mlx-infer's C++ core was compiled against mlx {compiled}, but its build info "
            f"says mlx {required}: the installation is inconsistent; reinstall mlx-infer."
        )
    return _fast
