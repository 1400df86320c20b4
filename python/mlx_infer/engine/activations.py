"""Holding one engine iteration's activations to the memory the KV sizing left for them.

MLX evaluates a graph asynchronously and keeps every input of a primitive alive until the
device has run the command buffer (CUDA graph) that holds it (``mlx/backend/cuda/eval.cpp``:
``encoder.add_temporary``; the CPU stream does the same with its tasks). A CUDA graph is
committed every 100 ops or 1000 MB on Hopper and up to 10 run ahead of the host
(``mlx/transforms.cpp: MAX_ACTIVE_TASKS``), so a 2,048-row prompt-chunk step of llama-1B keeps
~3 GB of activations alive at once, and back-to-back chunk-only steps (which nothing reads) stack
theirs: on an H200 the engine's peak at 64 streams was weights + KV + ~6.7 GB (benchmarks/
RESULTS.md, session 6), more than the 1 GiB the pool sizing reserves for activations.

MLX's own back-pressure bounds that: after each primitive it is handed, ``eval`` waits for the
oldest in-flight command buffer while the active memory exceeds ``mx.set_memory_limit``'s value.
:class:`ActivationCeiling` sets that limit, for the duration of one engine iteration, to what the
process holds between iterations plus the reserve, and restores the previous limit afterwards
(so another user of MLX in the process, mlx-lm in benchmarks/served.py, runs under its own
limit). "What the process holds" is the smallest active memory seen at the start of the last
:data:`WINDOW` iterations (the previous step may still be running at the start of this one, and
its activations are not resident memory), with the KV storage taken at its current size (it
grows inside an iteration, before the forward). A limit below a single kernel's needs only
makes the host wait for the device, never fails: the allocator still allocates.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable

import mlx.core as mx

from .. import defaults
from .config import activation_reserve

#: Iterations whose starting active memory (less the KV storage) the resident estimate is the minimum of.
WINDOW = 8


class ActivationCeiling:
    """Sets MLX's memory limit to resident memory + ``reserve`` bytes while an iteration runs.

    Args:
        reserve: bytes one iteration's activations may take (``engine.config.activation_reserve``).
        kv_bytes: the KV storage's current size in bytes (it grows; counted at its current size).
    """

    def __init__(self, reserve: int, kv_bytes: Callable[[], int]) -> None:
        if reserve <= 0:
            raise ValueError(f"ActivationCeiling: reserve must be > 0 bytes, got {reserve}.")
        self.reserve = int(reserve)
        self._kv_bytes = kv_bytes
        self._starts: deque[int] = deque(maxlen=WINDOW)  # active memory - KV storage at iteration starts
        self._previous: int | None = None  # the limit to restore; None while not engaged

    @property
    def engaged(self) -> bool:
        """Whether the limit is set (between :meth:`engage` and :meth:`release`)."""
        return self._previous is not None

    def ceiling(self) -> int:
        """The limit for this iteration: resident memory (estimated, module doc) + the reserve."""
        kv = int(self._kv_bytes())
        self._starts.append(int(mx.get_active_memory()) - kv)
        return min(self._starts) + kv + self.reserve

    def engage(self) -> None:
        """Set the limit (again, with the KV storage at its current size, if already engaged);
        a lower limit the user set stays in force."""
        limit = self.ceiling()
        previous = mx.set_memory_limit(limit)
        if self._previous is None:
            self._previous = previous
        if limit > self._previous:
            mx.set_memory_limit(self._previous)

    def release(self) -> None:
        """Restore the limit that was in force before :meth:`engage`."""
        if self._previous is not None:
            mx.set_memory_limit(self._previous)
            self._previous = None


def activation_ceiling(engine: Any) -> ActivationCeiling | None:
    """The engine's ceiling, or ``None`` where ``EngineConfig.bound_activations`` (default: the
    device type's :data:`~mlx_infer.defaults.BOUND_ACTIVATIONS`) leaves activations unbounded."""
    bound = engine.config.bound_activations
    if bound is None:
        bound = defaults.BOUND_ACTIVATIONS["gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"]
    if not bound:
        return None
    return ActivationCeiling(activation_reserve(engine.model, engine.config), lambda: engine.store.nbytes)
