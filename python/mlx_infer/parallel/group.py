"""The distributed group a run spans, and the bounded-time guard around its collectives.

A run is distributed when it is started by ``mlx.launch`` (or ``mpirun``): MLX's
own layer (:mod:`mlx.core.distributed`: ring over TCP, MPI, NCCL on CUDA, JACCL
over Thunderbolt RDMA) connects the processes; nothing here moves bytes itself.
Started any other way, :func:`current_group` is the one-process group and every
path runs exactly as before.

Failure: a collective whose peer died raises (the ring backend reports
``connection to a peer was lost``); one whose peer hangs would wait forever, so
every step that communicates runs under :class:`CollectiveWatchdog`, which ends
the process with a clear message once a step has waited past its deadline
(:data:`DEFAULT_TIMEOUT_S`, ``MLX_INFER_DIST_TIMEOUT`` overrides it).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import mlx.core as mx

from ..errors import MlxInferError

#: Seconds one communicating step may take before the watchdog ends the process.
DEFAULT_TIMEOUT_S = 30.0
#: Environment override of :data:`DEFAULT_TIMEOUT_S`; read in :func:`collective_timeout` only.
TIMEOUT_ENV = "MLX_INFER_DIST_TIMEOUT"
#: Exit status of a process the watchdog (or a lost peer) ended.
EXIT_PEER_LOST = 75
#: How a launched run splits the model: ``tensor`` (default) or ``pipeline``; read in :func:`parallel_mode` only.
MODE_ENV = "MLX_INFER_PARALLEL"
MODES = ("tensor", "pipeline")


class DistributedError(MlxInferError):
    """A distributed run cannot continue: a peer died, hung, or the group is unusable."""


@dataclass(frozen=True)
class ParallelGroup:
    """The processes a model is split over.

    Attributes:
        group: MLX's group (``None`` for a single process).
        rank: this process's index, 0 .. size-1.
        size: number of processes.
        backend: ``"ring"``, ``"mpi"``, ``"nccl"``, ``"jaccl"`` or ``"none"`` (one process).
    """

    group: Any
    rank: int
    size: int
    backend: str

    @property
    def distributed(self) -> bool:
        """True when more than one process takes part."""
        return self.size > 1

    @property
    def is_leader(self) -> bool:
        """Rank 0: the one that schedules, samples, streams and serves."""
        return self.rank == 0


SINGLE = ParallelGroup(group=None, rank=0, size=1, backend="none")
_CURRENT: ParallelGroup | None = None
_LOCK = threading.Lock()


def launched_backend(env: dict[str, str] | None = None) -> str | None:
    """The backend ``mlx.launch`` / ``mpirun`` set this process up for, from its environment; ``None`` if none."""
    env = os.environ if env is None else env
    if env.get("MLX_IBV_DEVICES") or env.get("MLX_JACCL_COORDINATOR"):
        return "jaccl"
    if env.get("NCCL_HOST_IP") and env.get("MLX_WORLD_SIZE"):
        return "nccl"
    if env.get("MLX_HOSTFILE") and env.get("MLX_RANK") is not None:
        return "ring"
    if env.get("OMPI_COMM_WORLD_SIZE") or env.get("PMI_SIZE"):
        return "mpi"
    return None


def current_group() -> ParallelGroup:
    """The run's group, initialised once per process (a one-process group when not launched).

    Raises:
        DistributedError: the launcher set a backend up but MLX could not join it.
    """
    global _CURRENT
    with _LOCK:
        if _CURRENT is None:
            backend = launched_backend()
            if backend is None:
                _CURRENT = SINGLE
            else:
                try:
                    g = mx.distributed.init(strict=True, backend=backend)
                except (RuntimeError, ValueError) as e:
                    raise DistributedError(
                        f"could not join the {backend} group this process was launched into ({e}); "
                        "check the hostfile / ports given to mlx.launch") from None
                _CURRENT = SINGLE if g.size() == 1 else ParallelGroup(g, g.rank(), g.size(), backend)
        return _CURRENT


def leader_first(fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0, then on the others (a one-time conversion into a cache the ranks may share:
    they then find it done rather than write it at once). Just ``fn()`` in one process."""
    pg = current_group()
    if not pg.distributed:
        return fn()
    out = fn() if pg.is_leader else None
    mx.eval(mx.distributed.all_sum(mx.array([1]), group=pg.group))  # rank 0 is done
    return out if pg.is_leader else fn()


def parallel_mode() -> str:
    """``"tensor"`` (the default) or ``"pipeline"``, from ``MLX_INFER_PARALLEL``."""
    raw = os.environ.get(MODE_ENV, "").strip() or "tensor"
    if raw not in MODES:
        raise MlxInferError(f"{MODE_ENV}={raw!r}: use tensor (heads and MLP split across ranks, the default) or "
                            "pipeline (layers split across ranks).")
    return raw


def collective_timeout() -> float:
    """Seconds a communicating step may wait (``MLX_INFER_DIST_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise MlxInferError(f"{TIMEOUT_ENV}={raw!r}: give the seconds a distributed step may wait, e.g. 30.")
    return value


def fail_group(pg: ParallelGroup, what: str, exc: BaseException | None = None) -> None:
    """Report a lost peer on stderr and end this process (the launcher then ends the rest)."""
    detail = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
    print(f"mlx-infer: rank {pg.rank}/{pg.size}: {what}{detail}; a peer process died or hung, "
          f"so this distributed run cannot continue. Exiting.", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


def is_peer_failure(exc: BaseException) -> bool:
    """True for the error MLX raises when a collective's peer is gone (in a distributed run)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and current_group().distributed and (
        "peer" in text or "[ring]" in text or "[nccl]" in text.lower() or "[mpi]" in text.lower()
        or "[jaccl]" in text.lower())


def guarded(items: Iterator[Any], what: str = "a generation step") -> Iterator[Any]:
    """``items``, each after the first produced under the group's watchdog (unchanged in one process).

    The first item carries the whole prompt's prefill, whose time grows with the prompt: it is not
    timed (a peer that dies during it still fails the collective at once).
    """
    pg = current_group()
    if not pg.distributed:
        yield from items
        return
    watchdog = CollectiveWatchdog(pg)
    it = iter(items)
    try:
        yield next(it)
    except StopIteration:
        return
    while True:
        with watchdog.guard(what):
            try:
                item = next(it)
            except StopIteration:
                return
        yield item


class CollectiveWatchdog:
    """Ends the process when a guarded step waits on its peers past a deadline.

    One daemon thread per watchdog; :meth:`guard` arms it around one step. On
    expiry it calls ``on_expire`` (the server fails its open requests there),
    waits ``grace_s`` and exits with :data:`EXIT_PEER_LOST`.
    """

    def __init__(self, pg: ParallelGroup, timeout_s: float | None = None, *,
                 on_expire: Callable[[str], None] | None = None, grace_s: float = 1.0):
        self.pg = pg
        self.timeout_s = collective_timeout() if timeout_s is None else timeout_s
        self.on_expire = on_expire
        self.grace_s = grace_s
        self._deadline: float | None = None
        self._what = ""
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def _watch(self) -> None:
        while True:
            with self._cv:
                while self._deadline is None:
                    self._cv.wait()
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(timeout=left)
                    continue
                what = self._what
            message = f"{what} waited more than {self.timeout_s:g} s for its peers"
            if self.on_expire is not None:
                try:
                    self.on_expire(message)
                except Exception:  # noqa: BLE001 - exiting regardless
                    pass
                time.sleep(self.grace_s)
            fail_group(self.pg, message)

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Arm the deadline for the block (no-op in a one-process group)."""
        if not self.pg.distributed:
            yield
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="mlx-infer-dist-watchdog", daemon=True)
            self._thread.start()
        with self._cv:
            self._deadline = time.monotonic() + self.timeout_s
            self._what = what
            self._cv.notify()
        try:
            yield
        finally:
            with self._cv:
                self._deadline = None
                self._cv.notify()
