"""Write ``_fast.pyi`` for the freshly built extension (run by CMakeLists.txt after each build of ``_fast``).

Usage: ``python tools/stubgen.py BUILD_DIR OUTPUT.pyi``. ``mlx.core`` is imported first so the extension finds
the libmlx it links (its rpath points at the installed package, not the build folder). When the module cannot be
imported here (a cross build), a warning is printed and no stub is written: the build itself does not fail.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    build_dir, output = Path(argv[0]), Path(argv[1])
    try:
        import mlx.core  # noqa: F401  (loads libmlx for _fast)

        sys.path.insert(0, str(build_dir))
        from nanobind.stubgen import main as stubgen

        stubgen(["-q", "-m", "_fast", "-o", str(output)])
    except Exception as e:  # noqa: BLE001 - any failure means "no stub", said loudly, never a broken build
        output.unlink(missing_ok=True)
        print(f"warning: no _fast.pyi written ({type(e).__name__}: {e})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
