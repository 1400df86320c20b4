"""Refuse to load the C++ core against an MLX it was not built for."""

from __future__ import annotations

from importlib import metadata

#: The exact MLX release the C++ core is compiled against (pyproject pins it too).
REQUIRED_MLX_VERSION = "0.32.4"


def check_mlx_version(installed: str, required: str = REQUIRED_MLX_VERSION) -> None:
    """Raise ImportError unless ``installed`` is the MLX version we were built against.

    MLX's C++ ABI changes between releases, so a mismatch would crash inside the
    extension instead of failing here with a message.
    """
    if installed != required:
        raise ImportError(
            f"mlx-infer was built against mlx {required}, but mlx {installed} is installed. "
            f"Install the matching release with: pip install 'mlx=={required}' "
            "(or reinstall mlx-infer built against your mlx)."
        )


def installed_mlx_version() -> str:
    """The version of the installed ``mlx`` distribution, from its metadata."""
    return metadata.version("mlx")
