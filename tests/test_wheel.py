"""The installed package refuses a different mlx and never carries its own libmlx.

These run against whatever mlx_infer is importable: the editable install in development,
the installed wheel in tools/build_wheel.sh and in cibuildwheel's test step.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_infer
from mlx_infer import _fast, _version_check
from mlx_infer._version_check import (
    REQUIRED_MLX_VERSION,
    built_mlx_version,
    check_before_import,
    import_fast,
    libmlx_version,
)

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _import_with_fake_mlx_core(tmp_path: Path, version: str) -> subprocess.CompletedProcess:
    """Import mlx_infer in a fresh interpreter whose ``mlx.core`` reports ``version``.

    mlx is a namespace package, so a directory earlier on sys.path holding ``mlx/core.py``
    shadows the real binding while ``mlx/lib`` (libmlx) still comes from the real install:
    just what a user with another mlx release in front of ours would have.
    """
    fake = tmp_path / "fake"
    (fake / "mlx").mkdir(parents=True)
    (fake / "mlx" / "core.py").write_text(f'__version__ = "{version}"\n')
    probe = textwrap.dedent(
        """
        import sys
        try:
            import mlx_infer
        except ImportError as exc:
            print("IMPORT-ERROR:", exc)
            print("FAST-LOADED:", "mlx_infer._fast" in sys.modules)
        else:
            print("IMPORTED")
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(fake), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )


def test_another_mlx_release_is_refused_before_the_extension_loads(tmp_path):
    result = _import_with_fake_mlx_core(tmp_path, "0.99.0")
    assert result.returncode == 0, result.stderr
    required = re.escape(built_mlx_version())
    assert re.search(rf"built against mlx {required}, but mlx 0\.99\.0 is installed", result.stdout), result.stdout
    assert f"pip install 'mlx=={built_mlx_version()}'" in result.stdout
    assert "FAST-LOADED: False" in result.stdout  # the check ran before _fast was imported


def test_the_matching_release_imports(tmp_path):
    result = _import_with_fake_mlx_core(tmp_path, built_mlx_version())
    assert "IMPORTED" in result.stdout, result.stdout + result.stderr


def test_a_libmlx_from_another_release_is_refused(monkeypatch):
    # The Linux and macOS wheels ship libmlx in mlx-cpu / mlx-cuda-* / mlx-metal, so the
    # library can disagree with the Python binding; it is read from the library itself.
    monkeypatch.setattr(_version_check, "libmlx_version", lambda: "0.31.0")
    with pytest.raises(ImportError, match=r"built against mlx .+, but mlx \(libmlx at .+\) 0\.31\.0 is installed"):
        check_before_import()


def test_libmlx_reports_its_own_version():
    assert libmlx_version() == mx.__version__


def test_build_info_agrees_with_the_compiled_extension():
    assert built_mlx_version() == _fast.built_mlx_version() == mx.__version__


def test_stale_build_info_is_caught_after_import(monkeypatch):
    monkeypatch.setattr(_version_check, "check_before_import", lambda: None)
    monkeypatch.setattr(_version_check, "built_mlx_version", lambda: "0.0.1")
    with pytest.raises(ImportError, match=r"compiled against mlx .+, but its build info says mlx 0\.0\.1"):
        import_fast()


@pytest.mark.skipif(not PYPROJECT.is_file(), reason="needs the checkout's pyproject.toml")
def test_every_mlx_pin_is_the_required_version():
    pins = re.findall(r"\bmlx(?:-cpu|-metal|\[[a-z0-9,]+\])?==([0-9][^'\";, ]*)", PYPROJECT.read_text())
    assert pins, "no mlx pin found in pyproject.toml"
    assert set(pins) == {REQUIRED_MLX_VERSION}


def test_no_second_libmlx_ships_or_loads():
    roots = {Path(mlx_infer.__file__).parent.parent, Path(_fast.__file__).parent.parent}
    bundled = [p for root in roots for p in root.glob("mlx_infer*/**/*") if p.name.startswith("libmlx")]
    assert not bundled, f"mlx-infer must use the mlx package's libmlx, found {bundled}"
    if sys.platform.startswith("linux"):
        maps = Path("/proc/self/maps").read_text().splitlines()
        loaded = {line.split()[-1] for line in maps if "libmlx" in line.split()[-1]}
        assert len(loaded) == 1, loaded
        assert Path(next(iter(loaded))).parent.parts[-2:] == ("mlx", "lib")
