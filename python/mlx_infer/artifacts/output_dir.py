"""Safe replacement of a model output directory: we only ever delete what we wrote.

Every directory :func:`~mlx_infer.artifacts.convert.write_mlx_dir` writes
carries :data:`MARKER`, written first. An existing output is replaced only if
it carries the marker and holds nothing but the files a conversion writes; a
directory of anyone else's (the source model, a parent of it, a folder of
unrelated files) is refused, never deleted. The new directory is swapped in
with one atomic ``renameat2(RENAME_EXCHANGE)`` (Linux) / ``renamex_np(RENAME_SWAP)``
(macOS) where the filesystem has it, so a kill never leaves the path missing;
temporary directories a killed conversion left beside the output are removed
by the next conversion to it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import stat
import sys
import uuid
from pathlib import Path

from ..errors import MlxInferError

MARKER = ".mlx-infer-convert"
MARKER_TEXT = "mlx-infer convert output: mlx-infer may replace this directory (and only its own files).\n"
_OURS = re.compile(r"config\.json|model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json"
                   r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json"
                   r"|tokenizer\.model|vocab\.json|merges\.txt|chat_template\.jinja|chat_template\.json"
                   r"|generation_config\.json|" + re.escape(MARKER))


def _stat(path: Path, *, follow: bool) -> os.stat_result | None:
    try:
        return os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise MlxInferError(f"{path} is a symbolic link loop; pass a real path.") from None
        if e.errno == errno.ENOTDIR:
            raise MlxInferError(f"a parent of {path} is not a directory; choose another path.") from None
        raise MlxInferError(f"cannot read {path}: {e.strerror or e}.") from None


def source_exists(src: Path) -> bool:
    """Whether ``src`` exists (a symlink loop or a non-directory parent is an error that says so)."""
    return _stat(src, follow=True) is not None


def _is_ours(directory: Path) -> tuple[bool, list[str]]:
    """(carries our marker, the entries that are not files a conversion writes)."""
    entries = sorted(os.listdir(directory))
    foreign = []
    for name in entries:
        st = os.lstat(directory / name)
        if not _OURS.fullmatch(name) or not stat.S_ISREG(st.st_mode):
            foreign.append(name)
    marker = directory / MARKER
    marked = MARKER in entries and marker.stat().st_size == len(MARKER_TEXT) and marker.read_text(
        encoding="utf-8", errors="replace") == MARKER_TEXT
    return marked, foreign


def check_output(out: Path, *, overwrite: bool, source: Path | None = None) -> None:
    """Refuse an output path that would destroy something that is not ours.

    Raises:
        MlxInferError: ``out`` is (or contains) the source, is a file or a
            symlink, is non-empty without ``overwrite``, or, with
            ``overwrite``, was not written by mlx-infer or holds other files.
    """
    if source is not None:
        src_r, out_r = Path(os.path.realpath(source)), Path(os.path.realpath(out))  # never raises on loops
        if out_r == src_r or out_r in src_r.parents:
            raise MlxInferError(f"the output {out} {'is' if out_r == src_r else 'contains'} the source model "
                                f"{source}; writing there would destroy it. Choose an output path outside it.")
    lst = _stat(out, follow=False)
    if lst is None:
        return
    if stat.S_ISLNK(lst.st_mode):
        target = _stat(out, follow=True)
        if target is None or not stat.S_ISDIR(target.st_mode) or os.listdir(out):
            raise MlxInferError(f"{out} is a symbolic link; refusing to replace it. Pass the directory it points "
                                "to, or a new path.")
        raise MlxInferError(f"{out} is a symbolic link (to an empty directory); pass that directory or a new path.")
    if not stat.S_ISDIR(lst.st_mode):
        raise MlxInferError(f"{out} exists and is not a directory; choose another output path.")
    if not os.listdir(out):
        return
    if not overwrite:
        raise MlxInferError(f"{out} already exists and is not empty; refusing to overwrite it. "
                            "Choose a new output path, delete it, or pass overwrite=True (--overwrite).")
    marked, foreign = _is_ours(out)
    if not marked:
        raise MlxInferError(f"{out} was not written by mlx-infer convert (it has no {MARKER}); --overwrite replaces "
                            "only mlx-infer's own output. Delete it yourself or choose a new output path.")
    if foreign:
        listed = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise MlxInferError(f"{out} holds files mlx-infer convert did not write ({listed}); refusing to delete "
                            "them. Move them away or choose a new output path.")


def make_temp(out: Path) -> Path:
    """A new marked temporary directory beside ``out`` (after removing ones a killed run left)."""
    clean_leftovers(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
    except OSError as e:
        raise MlxInferError(f"cannot create the output beside {out}: {e.strerror or e}.") from None
    (tmp / MARKER).write_text(MARKER_TEXT, encoding="utf-8")
    return tmp


def remove_ours(directory: Path) -> bool:
    """Delete ``directory`` if it holds only our marked output; return whether it is gone."""
    try:
        marked, foreign = _is_ours(directory)
    except OSError:
        return False
    if not marked or foreign:
        return False
    for name in os.listdir(directory):
        if name != MARKER:
            os.unlink(directory / name)
    os.unlink(directory / MARKER)  # last: a kill halfway leaves a still-marked directory
    try:
        os.rmdir(directory)
    except OSError:
        return False
    return True


def clean_leftovers(out: Path) -> None:
    """Remove ``.<out>.tmp-*`` / ``.<out>.old-*`` directories that carry our marker and only our files."""
    pattern = re.compile(re.escape(f".{out.name}.") + r"(tmp|old)-[0-9a-f]{8}")
    try:
        names = os.listdir(out.parent)
    except OSError:
        return
    for name in names:
        p = out.parent / name
        if pattern.fullmatch(name) and stat.S_ISDIR(os.lstat(p).st_mode):
            remove_ours(p)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; ``False`` where the platform or filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover
        return False
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        at_fdcwd, rename_exchange = -100, 2
        rc = libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):  # pragma: no cover - macOS
        rc = libc.renamex_np(os.fsencode(a), os.fsencode(b), 0x2)  # RENAME_SWAP
    else:  # pragma: no cover
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_into_place(tmp: Path, out: Path, *, overwrite: bool) -> None:
    """Publish the finished ``tmp`` as ``out``; the old ``out`` (if any) is removed only if it is ours."""
    if _stat(out, follow=False) is None:
        tmp.rename(out)
        return
    check_output(out, overwrite=overwrite)  # again: it may have changed while we converted
    if _exchange(tmp, out):
        old = tmp  # tmp's path now holds the previous output
    else:  # no atomic swap here: move aside, then in (a kill between leaves the old one beside it)
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        out.rename(old)
        try:
            tmp.rename(out)
        except BaseException:
            old.rename(out)
            raise
    if not os.listdir(old):
        os.rmdir(old)
    elif not remove_ours(old):  # pragma: no cover - someone added files while we converted
        print(f"mlx-infer: kept the previous {out} at {old} (it held files mlx-infer did not write).",
              file=sys.stderr)


def discard(tmp: Path) -> None:
    """Remove a temporary directory of ours after a failure (everything in it was written by us)."""
    shutil.rmtree(tmp, ignore_errors=True)
