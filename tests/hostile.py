"""The harness of the hostile-input suites (tests/test_hostile_*.py).

Each case asserts: API calls raise only an ``MlxInferError`` / ``ValueError`` subclass whose
message says what was wrong; the CLI exits 2 with one line on stderr and no traceback; nothing
hangs (:data:`TIMEOUT_S`); nothing outside what the case created is touched (its directory is
snapshotted before and after, byte for byte).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
from tiny import make_tiny_model_dir

TIMEOUT_S = 60.0

def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: relative path -> (kind, size, mtime_ns, sha256)."""
    out: dict[str, tuple] = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(root))] = ("f", st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        else:
            out[str(p.relative_to(root))] = ("d" if p.is_dir() else "l", st.st_mtime_ns)
    return out


def bounded(fn: Callable[[], Any], timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """Run ``fn`` in a worker thread; fail if it is still running after ``timeout`` seconds."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (reported to the test below)
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout:.0f} s: the input makes it hang"
    return result


def assert_refused(fn: Callable[[], Any], match: str, root: Path | None = None) -> str:
    """``fn`` raises a ValueError subclass matching ``match``, in bounded time, touching nothing under ``root``."""
    before = snapshot(root) if root is not None else None
    result = bounded(fn)
    err = result.get("error")
    assert err is not None, f"accepted silently: returned {result.get('value')!r}"
    assert isinstance(err, ValueError), f"{type(err).__name__} escaped instead of a ValueError: {err}"
    assert re.search(match, str(err)), f"message does not say what was wrong ({match!r}): {err}"
    if root is not None:
        assert snapshot(root) == before, "the input directory changed"
    return str(err)


def cli(args: list[str], cwd: Path, *, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlx_infer", *args], cwd=cwd, input=stdin,
                          capture_output=True, timeout=TIMEOUT_S)


def assert_cli_refuses(args: list[str], cwd: Path, match: str, *, stdin: bytes | None = None) -> str:
    before = snapshot(cwd)
    r = cli(args, cwd, stdin=stdin)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, f"exit {r.returncode}, stderr: {err[-2000:]}"
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"{len(lines)} lines on stderr: {err[-2000:]}"
    assert re.search(match, lines[0]), f"{match!r} not in {lines[0]!r}"
    assert snapshot(cwd) == before, "the CLI touched files it was not asked to write"
    return lines[0]


def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny llama and one tiny gemma3 directory, to be copied per case (see :func:`copy_model`)."""
    root = tmp_path_factory.mktemp("hostile-src")
    return {fam: make_tiny_model_dir(root / fam, fam) for fam in ("llama", "gemma3")}


def copy_model(tiny_models: dict[str, Path], family: str, dst: Path) -> Path:
    shutil.copytree(tiny_models[family], dst)
    return dst


