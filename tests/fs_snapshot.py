"""A snapshot of a directory tree (every entry's kind, bytes and mode), to assert nothing was touched."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path


def snapshot(root: Path, *, skip: tuple[str, ...] = ()) -> dict[str, tuple]:
    """``relative path -> (kind, sha256 or link target, mode)`` for everything under ``root``.

    ``skip`` lists relative paths whose *content* may change (they must still exist).
    """
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p), st.st_mode)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", None, st.st_mode)
            else:
                digest = None if rel in skip else hashlib.sha256(p.read_bytes()).hexdigest()
                out[rel] = ("file", digest, st.st_mode)
    return out
