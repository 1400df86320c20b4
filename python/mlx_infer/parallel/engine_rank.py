"""The engine over a tensor-parallel graph: every rank runs the same iteration, in lockstep.

Rank 0 owns the requests: it takes submissions and cancellations (the server
runs there), and at the start of each iteration broadcasts what entered its
intake — the new requests (with a seed fixed by rank 0 where the caller left
it to chance), the cancelled ids, and whether the engine stops. Every rank then
runs the same iteration on the same inputs: the scheduler, the page pool and
the batch plans are deterministic functions of them and of the tokens, so the
page tables are the same on every rank while each holds the pages of its own
KV heads; the sharded forward's collectives (``all_sum`` after ``o_proj`` and
``down_proj``, the logits' ``all_gather``) meet in the same order; the logits,
and so the sampled tokens, are the same bytes everywhere. Rank 0 streams; the
followers' handles are dropped.

The broadcast is an ``all_sum`` of rank 0's bytes against zeros (MLX's
distributed layer has no broadcast op), the length first. One iteration, the
broadcast included, runs under the group's :class:`~.group.CollectiveWatchdog`:
a peer that hangs ends the run with a clear error after the timeout; one that
dies makes the collective raise at once (ring: ``connection to a peer was
lost``), which ends this rank the same way.
"""

from __future__ import annotations

import pickle
import secrets
import time
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np

from .group import CollectiveWatchdog, ParallelGroup, fail_group


def broadcast_bytes(pg: ParallelGroup, payload: bytes | None) -> bytes:
    """Rank 0's ``payload`` on every rank (others pass ``None``)."""
    n = mx.array([len(payload) if pg.is_leader and payload else 0], mx.int32)
    n = int(mx.distributed.all_sum(n, group=pg.group).item())
    if n == 0:
        return b""
    if pg.is_leader:
        buf = mx.array(np.frombuffer(payload, dtype=np.uint8))
    else:
        buf = mx.zeros((n,), mx.uint8)
    out = mx.distributed.all_sum(buf, group=pg.group)  # (n,) uint8: rank 0's bytes + zeros
    return bytes(np.array(out, copy=False))


def leader_value(model: Any, value: Any) -> Any:
    """``value`` (an int, or a list of ints) as rank 0 has it, on every rank of a split graph's group
    (``value`` itself in one process).

    What is sized from this process's free memory (the KV pool) differs between ranks that load at
    different moments; the lockstep needs one size.
    """
    from .layers import parallel_group_of

    pg = parallel_group_of(model)
    if pg is None:
        return value
    many = isinstance(value, (list, tuple))  # one per layer group, or one for all
    values = list(value) if many else [value]
    mine = mx.array(values if pg.is_leader else [0] * len(values), mx.int64)
    out = [int(v) for v in mx.distributed.all_sum(mine, group=pg.group).tolist()]
    return type(value)(out) if many else out[0]


def check_same(pg: ParallelGroup, what: str, value: int) -> None:
    """Raise unless every rank has the same ``value`` (a setting the lockstep depends on)."""
    values = mx.distributed.all_gather(mx.array([value], mx.int64), group=pg.group).tolist()
    if len(set(values)) != 1:
        from .group import DistributedError

        raise DistributedError(f"the ranks disagree on {what} ({values}); every rank must run the same "
                               "model, flags and memory settings.")


class _Stopped(Exception):
    """Rank 0 stopped the engine: a follower's iteration ends before it runs anything."""


class Lockstep:
    """The per-iteration exchange of a distributed engine (see the module doc)."""

    def __init__(self, engine: Any, pg: ParallelGroup):
        self.engine = engine
        self.pg = pg
        self.stopping = False
        if engine.config.memory_limit_gb is not None:
            from .group import DistributedError

            # Admission would read each rank's own active memory and the ranks' schedules could part.
            raise DistributedError("EngineConfig.memory_limit_gb holds admissions on this process's active memory, "
                                   "which differs between ranks; size the pool with memory_budget_gb or num_pages "
                                   "for a distributed engine.")
        self.watchdog = CollectiveWatchdog(pg, on_expire=self._expire)
        check_same(pg, "the KV page pool size", int(engine.scheduler.capacity_pages))
        check_same(pg, "the batch size", int(engine.config.max_batch))

    def _expire(self, message: str) -> None:
        try:
            self.engine._fail_all(f"distributed run failed: {message}")
        except Exception:  # noqa: BLE001
            pass

    def _abort(self, what: str, exc: BaseException) -> None:
        """A collective failed: fail every request (clients get an error), give them a moment, exit."""
        self._expire(f"{what}: {exc}")
        time.sleep(self.watchdog.grace_s)
        fail_group(self.pg, what, exc)

    def exchange(self, new: list[Any], cancels: set[str]) -> tuple[list[Any], set[str]]:
        """Rank 0's intake of this iteration, on every rank (followers' own intake is empty)."""
        if self.stopping:  # after the stop message: the drain's intake talks to nobody
            return new, cancels
        payload = None
        if self.pg.is_leader:
            for live in new:  # a seed every rank shares: a fresh one would differ per rank
                if live.request.sampling.seed is None:
                    live.request = replace(live.request,
                                           sampling=replace(live.request.sampling, seed=secrets.randbits(63)))
            stop = self.engine._stopping.is_set()
            payload = pickle.dumps(([live.request for live in new], sorted(cancels), stop))
        try:
            data = broadcast_bytes(self.pg, payload)
        except RuntimeError as e:
            self._abort("the engine's broadcast failed", e)
        if self.pg.is_leader:
            return new, cancels
        requests, cancelled, stop = pickle.loads(data) if data else ([], [], False)
        if stop:
            self.stopping = True
            self.engine._stopping.set()
            raise _Stopped
        followed = []
        for request in requests:
            self.engine.submit(request)  # the same checks and bookkeeping as on rank 0
        with self.engine._lock:
            followed, self.engine._inbox = list(self.engine._inbox), type(self.engine._inbox)()
        return followed, set(cancelled)

    def step(self, run_step: Any) -> bool:
        """One engine iteration under the watchdog; a collective that fails ends this rank clearly."""
        with self.watchdog.guard("an engine step"):
            try:
                return run_step()
            except _Stopped:
                return False
            except RuntimeError as e:
                if "peer" in str(e) or "ring" in str(e) or "distributed" in str(e).lower():
                    self._abort("an engine step failed", e)
                raise

    def finish(self) -> None:
        """Rank 0 stopping: one last exchange tells the followers to stop too."""
        if self.pg.is_leader and not self.stopping:
            self.stopping = True
            with self.watchdog.guard("the engine's stop"):
                broadcast_bytes(self.pg, pickle.dumps(([], [], True)))


def attach_lockstep(engine: Any) -> Lockstep | None:
    """The engine's :class:`Lockstep` when its graph is sharded (``None`` in one process)."""
    from .group import DistributedError
    from .layers import parallel_group_of

    pg = parallel_group_of(engine.model)
    return None if pg is None else Lockstep(engine, pg)


def follow(engine: Any) -> None:
    """A follower rank's whole life: run the engine's iterations until rank 0 stops it."""
    engine.start()
    engine._thread.join()
    engine.stop()
