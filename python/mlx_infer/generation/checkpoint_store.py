"""A checkpoint directory on disk: immutable versions, an atomically replaced pointer, a marker, a lock.

Layout::

    DIR/
      .mlx-infer-checkpoint   marker: mlx-infer made this directory (written before anything else)
      .lock                   flock(2) target: one writer (or several readers) at a time
      CURRENT                 manifest of the live version: its name and every file's size and sha256
      v-000003-1a2b3c4d/      the live version: checkpoint.json, kv.safetensors

A save writes a new version directory beside the live one, makes it durable
(fsync of its files and of both directories), then publishes it by
``os.replace``-ing ``CURRENT`` -- one atomic rename. A process killed at any
point leaves ``CURRENT`` naming either the old version or the new one, both
complete; what it leaves behind (an unpublished version, a pointer's temp
file) is removed by the next save. Removal only ever touches names of our own
pattern inside a directory that carries our marker, so a file we did not
write is never deleted.

The manifest covers every byte of the version's files, so a tampered or
damaged file is refused when read, never resumed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Callable

from ..errors import MlxInferError

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX: no locking
    fcntl = None  # type: ignore[assignment]

MARKER = ".mlx-infer-checkpoint"
MARKER_TEXT = "mlx-infer checkpoint directory: written, replaced and cleaned by mlx-infer only.\n"
LOCK = ".lock"
POINTER = "CURRENT"
STORE_VERSION = 2
#: The files of one version.
VERSION_FILES = ("checkpoint.json", "kv.safetensors")
#: Largest manifest we read (it is a few hundred bytes).
_MAX_POINTER_BYTES = 4096

_VERSION_RE = re.compile(r"v-(\d{6,12})-([0-9a-f]{8})")
_POINTER_TMP_RE = re.compile(re.escape(POINTER) + r"\.tmp-[0-9a-f]{8}")
_HEX64 = re.compile(r"[0-9a-f]{64}")

#: Test-only fault injection: when set, called with an operation's name before every
#: filesystem operation of a save (a test SIGKILLs the process there). ``None`` in production.
fault_hook: Callable[[str], None] | None = None


class CheckpointError(MlxInferError):
    """A checkpoint is missing, damaged, of another format, in use, or belongs to another run."""


def _op(name: str) -> None:
    if fault_hook is not None:
        fault_hook(name)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def describe_os_error(path: Path, e: OSError) -> str:
    """A one-line reason for an OSError about ``path`` (symlink loops and missing parents named as such)."""
    if e.errno == errno.ELOOP:
        return f"{path} is a symbolic link loop; point it at a real directory"
    if e.errno == errno.ENOTDIR:
        return f"a parent of {path} is not a directory"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied on {path}"
    if e.errno == errno.ENOENT:
        return f"{path} does not exist"
    return f"{path}: {e.strerror or e}"


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _read_small(path: Path, limit: int, what: str) -> bytes:
    st = _lstat(path)
    if st is None or not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path} is missing or not a regular file; {what}")
    if st.st_size > limit:
        raise CheckpointError(f"{path} is {st.st_size} bytes, larger than a valid one can be; {what}")
    with open(path, "rb") as fh:
        return fh.read(limit + 1)


class CheckpointStore:
    """One checkpoint directory, locked while open. Use :meth:`open` and :meth:`close` (or ``with``)."""

    def __init__(self, path: Path, fd: int | None):
        self.path = path
        self._fd = fd

    # -- opening -------------------------------------------------------

    @classmethod
    def open(cls, directory: str | Path, *, write: bool, create: bool = True) -> "CheckpointStore":
        """Open ``directory``: for writing it is created or adopted (when empty; not with
        ``create=False``) and locked exclusively; for reading it must already be ours, and is
        locked shared.

        Raises:
            CheckpointError: the path is a file, a symlink loop, a directory of
                someone else's files, or locked by another process.
        """
        path = Path(directory).expanduser()
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise CheckpointError(f"{describe_os_error(path, e)}; choose another checkpoint directory.") from None
        if st is None:
            if not (write and create):
                raise CheckpointError(f"{path} does not exist; there is no checkpoint to resume there.")
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise CheckpointError(f"cannot create {path}: {describe_os_error(path, e)}.") from None
        elif not stat.S_ISDIR(st.st_mode):
            raise CheckpointError(f"{path} exists and is not a directory; choose another checkpoint directory.")
        cls._check_ours(path, adopt=write and create)
        store = cls(path, None)
        store._lock(exclusive=write)
        return store

    @staticmethod
    def _check_ours(path: Path, *, adopt: bool) -> None:
        try:
            entries = set(os.listdir(path))
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {describe_os_error(path, e)}.") from None
        if MARKER in entries:
            marker = path / MARKER
            st = _lstat(marker)
            text = b""
            if st is not None and stat.S_ISREG(st.st_mode) and st.st_size <= len(MARKER_TEXT):
                text = marker.read_bytes()
            if text == MARKER_TEXT.encode():
                return
            # A marker cut short by a kill while adopting an otherwise empty directory is ours too.
            if not (entries <= {MARKER} and MARKER_TEXT.encode().startswith(text)):
                raise CheckpointError(f"{marker} is not mlx-infer's marker; {path} was not made by mlx-infer. "
                                      "Refusing to use it; choose another directory.")
        elif entries:
            old = " (it looks like an older mlx-infer checkpoint format; resume it with that version)" \
                if set(VERSION_FILES) <= entries else ""
            listed = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
            raise CheckpointError(f"{path} holds files mlx-infer did not write ({listed}){old}; refusing to "
                                  "use or overwrite it. Choose an empty or new directory.")
        elif not adopt:
            raise CheckpointError(f"{path} is empty; there is no checkpoint to resume there.")
        try:
            fd = os.open(path / MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
            try:
                os.write(fd, MARKER_TEXT.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise CheckpointError(f"cannot write to {path}: {describe_os_error(path, e)}.") from None

    def _lock(self, *, exclusive: bool) -> None:
        if fcntl is None:  # pragma: no cover
            return
        lock = self.path / LOCK
        try:
            self._fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as e:
            raise CheckpointError(f"cannot open {lock}: {describe_os_error(lock, e)}.") from None
        try:
            fcntl.flock(self._fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except OSError:
            self.close()
            raise CheckpointError(f"{self.path} is in use by another mlx-infer process (it holds the "
                                  "checkpoint's lock); wait for it to finish, or use another directory.") from None

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    # -- reading -------------------------------------------------------

    def current(self, *, verify_kv: bool = True) -> tuple[bytes, Path] | None:
        """``(checkpoint.json bytes, kv.safetensors path)`` of the live version, both checked against
        the manifest (sizes and sha256; the KV file's digest only with ``verify_kv``); ``None`` when
        nothing was published yet.

        Raises:
            CheckpointError: the manifest or a file it covers is damaged or was edited.
        """
        pointer = self.path / POINTER
        if _lstat(pointer) is None:
            return None
        fix = "the checkpoint cannot be resumed (delete the directory to start over)."
        raw = _read_small(pointer, _MAX_POINTER_BYTES, fix)
        try:
            manifest = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise CheckpointError(f"{pointer} is damaged (not valid JSON); {fix}") from None
        files = manifest.get("files") if isinstance(manifest, dict) else None
        name = manifest.get("version") if isinstance(manifest, dict) else None
        if (not isinstance(manifest, dict) or set(manifest) != {"store_version", "version", "files"}
                or not isinstance(files, dict) or set(files) != set(VERSION_FILES)
                or not isinstance(name, str) or not _VERSION_RE.fullmatch(name)):
            raise CheckpointError(f"{pointer} is damaged (unexpected manifest content); {fix}")
        if manifest["store_version"] != STORE_VERSION:
            raise CheckpointError(f"{self.path} has checkpoint store version {manifest['store_version']!r}; "
                                  f"this mlx-infer reads version {STORE_VERSION}. Resume it with the mlx-infer "
                                  "that wrote it.")
        vdir = self.path / name
        st = _lstat(vdir)
        if st is None or not stat.S_ISDIR(st.st_mode):
            raise CheckpointError(f"{vdir}, the live version {pointer} names, is missing; {fix}")
        for fname, entry in files.items():
            size, digest = (entry.get("bytes"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
            if (not isinstance(entry, dict) or set(entry) != {"bytes", "sha256"} or type(size) is not int
                    or size < 0 or not isinstance(digest, str) or not _HEX64.fullmatch(digest)):
                raise CheckpointError(f"{pointer} is damaged (bad entry for {fname}); {fix}")
            f = vdir / fname
            fst = _lstat(f)
            if fst is None or not stat.S_ISREG(fst.st_mode):
                raise CheckpointError(f"{f} is missing or not a regular file; {fix}")
            if fst.st_size != size:
                raise CheckpointError(f"{f} is {fst.st_size} bytes but was written with {size} (edited, truncated or "
                                      f"damaged); {fix}")
            if fname == VERSION_FILES[0]:
                meta = f.read_bytes()  # hashed as read, so what is checked is what is parsed
                actual = hashlib.sha256(meta).hexdigest()
            elif verify_kv:
                actual = sha256_file(f)
            else:
                actual = digest
            if actual != digest:
                raise CheckpointError(f"{f} does not match its recorded sha256 (edited or damaged); {fix}")
        return meta, vdir / VERSION_FILES[1]

    # -- writing -------------------------------------------------------

    def clean(self, keep: str | None = None) -> None:
        """Remove what earlier saves left behind: unpublished versions and pointer temp files.

        Only our own names are removed, and a version directory only loses the
        files a save writes; anything else in it keeps it (and the file) in place.
        """
        try:
            entries = os.listdir(self.path)
        except OSError:
            return
        for name in entries:
            p = self.path / name
            st = _lstat(p)
            if st is None:
                continue
            if _VERSION_RE.fullmatch(name) and name != keep and stat.S_ISDIR(st.st_mode):
                for fname in VERSION_FILES:
                    fst = _lstat(p / fname)
                    if fst is not None and stat.S_ISREG(fst.st_mode):
                        _op(f"unlink {name}/{fname}")
                        os.unlink(p / fname)
                try:
                    _op(f"rmdir {name}")
                    os.rmdir(p)
                except OSError:
                    pass  # something we did not write is inside: leave it
            elif _POINTER_TMP_RE.fullmatch(name) and stat.S_ISREG(st.st_mode):
                _op(f"unlink {name}")
                os.unlink(p)

    def live_version(self) -> str | None:
        """The version ``CURRENT`` names, if it can be read (no digest check)."""
        try:
            name = json.loads(_read_small(self.path / POINTER, _MAX_POINTER_BYTES, "").decode())["version"]
        except (CheckpointError, OSError, ValueError, KeyError, TypeError, RecursionError):
            return None
        return name if isinstance(name, str) and _VERSION_RE.fullmatch(name) else None

    def publish(self, write: Callable[[Path], None]) -> str:
        """Write a new version with ``write(version_dir)`` (which must create :data:`VERSION_FILES`),
        make it durable and atomically make it the live one; then remove the old one.

        Returns:
            The new version's name.
        """
        live = self.live_version()
        self.clean(keep=live)
        seqs = [int(m.group(1)) for n in os.listdir(self.path) if (m := _VERSION_RE.fullmatch(n))]
        name = f"v-{max(seqs, default=0) + 1:06d}-{secrets.token_hex(4)}"
        vdir = self.path / name
        _op("mkdir version")
        vdir.mkdir()
        write(vdir)
        files = {}
        for fname in VERSION_FILES:
            _op(f"fsync {fname}")
            _fsync_file(vdir / fname)
            files[fname] = {"bytes": (vdir / fname).stat().st_size, "sha256": sha256_file(vdir / fname)}
        _op("fsync version dir")
        _fsync_dir(vdir)
        _op("fsync dir")
        _fsync_dir(self.path)
        manifest = json.dumps({"store_version": STORE_VERSION, "version": name, "files": files}, sort_keys=True)
        tmp = self.path / f"{POINTER}.tmp-{secrets.token_hex(4)}"
        _op("write pointer")
        with open(tmp, "x", encoding="utf-8") as fh:
            fh.write(manifest)
            _op("fsync pointer")
            fh.flush()
            os.fsync(fh.fileno())
        _op("replace pointer")
        os.replace(tmp, self.path / POINTER)
        _op("fsync dir after replace")
        _fsync_dir(self.path)
        self.clean(keep=name)
        return name
