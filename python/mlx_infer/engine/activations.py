"""Holding a prompt-carrying engine iteration's activations to what it needs.

MLX evaluates a graph asynchronously and keeps every input of a primitive alive until the
device has run the command buffer (CUDA graph) that holds it (``mlx/backend/cuda/eval.cpp``:
``encoder.add_temporary``; the CPU stream does the same with its tasks). A CUDA graph is
committed every 100 ops or 1000 MB on Hopper and up to 10 run ahead of the host
(``mlx/transforms.cpp: MAX_ACTIVE_TASKS``), so a 2,048-row prompt-chunk step of llama-1B keeps
~3 GB of activations alive at once, and back-to-back chunk-only steps (which nothing reads) stack
theirs: on an H200 the engine's peak at 64 streams was weights + KV + ~6.7 GB (benchmarks/
RESULTS.md, session 6), above mlx-lm's.

MLX's own back-pressure bounds that: after each primitive it is handed, ``eval`` waits for the
oldest in-flight command buffer while the active memory exceeds ``mx.set_memory_limit``'s value.
:class:`ActivationCeiling` sets that limit, for an iteration that carries prompt tokens, to what
the process holds between iterations plus :meth:`ActivationCeiling.reserve` (an estimate of the
activations of the step's rows over the layers two command buffers hold, and its logits: one
step in flight, not a queue of them), and the engine restores the previous limit when the iteration ends (so another user of MLX in the
process, mlx-lm in benchmarks/served.py, runs under its own limit). Decode-only iterations are
left alone: their activations are small, and a limit would stall the pipelined step n+1 behind
step n. "What the process holds" is the smallest active memory seen at the last :data:`WINDOW`
engagements (the previous step may still be running, and its activations are not resident
memory), with the KV storage taken at its current size (it grows inside an iteration, before
the forward). A limit below a kernel's needs only makes the host wait for the device, never
fails: the allocator still allocates.

Measured (H200, benchmarks/RESULTS.md "session 7"): a flat 1 GiB reserve on every iteration held
llama-1B's peak to 0.48-0.63x mlx-lm's at 8-128 streams (llama-8B 0.62-0.74x) but made the
8-stream TTFT 52 ms against 38 unbounded: a reserve below one CUDA graph's activations makes the
host drain the queue before each commit. Hence one whole step's estimate, prompt iterations only.
"""
from __future__ import annotations

import os
from collections import deque
from typing import Any, Callable

import mlx.core as mx

from .. import defaults
from ..errors import MlxInferError
from .config import model_dtype, model_sizes

#: Iterations whose starting active memory (less the KV storage) the resident estimate is the minimum of.
WINDOW = 8


class ActivationCeiling:
    """Sets MLX's memory limit to resident memory + the step's reserve while an iteration runs.

    Args:
        row_bytes: activation bytes one row of a step keeps alive over all layers
            (:func:`step_row_bytes`).
        logit_row_bytes: bytes of one logit row (its float32 copy and softmax included).
        kv_bytes: the KV storage's current size in bytes (it grows; counted at its current size).
        floor: the least reserve (:data:`~mlx_infer.defaults.CEILING_FLOOR_BYTES`).
    """

    def __init__(self, row_bytes: int, logit_row_bytes: int, kv_bytes: Callable[[], int],
                 floor: int = defaults.CEILING_FLOOR_BYTES) -> None:
        if row_bytes <= 0 or logit_row_bytes < 0 or floor <= 0:
            raise ValueError(f"ActivationCeiling: row_bytes and floor must be > 0 and logit_row_bytes >= 0, got "
                             f"{row_bytes}, {floor} and {logit_row_bytes}.")
        self.row_bytes, self.logit_row_bytes, self.floor = int(row_bytes), int(logit_row_bytes), int(floor)
        self._kv_bytes = kv_bytes
        self._starts: deque[int] = deque(maxlen=WINDOW)  # active memory - KV storage at engagements
        self._previous: int | None = None  # the limit to restore; None while not engaged

    @property
    def engaged(self) -> bool:
        """Whether the limit is set (between :meth:`engage` and :meth:`release`)."""
        return self._previous is not None

    def reserve(self, rows: int, logit_rows: int) -> int:
        """Bytes a step of ``rows`` rows (``logit_rows`` of them with logits) may hold at once:
        its rows' activations over every layer plus its logits, at least ``floor``."""
        need = rows * self.row_bytes + logit_rows * self.logit_row_bytes
        return max(self.floor, need)

    def ceiling(self, rows: int, logit_rows: int) -> int:
        """The limit for a step: resident memory (estimated, module doc) + its reserve."""
        kv = int(self._kv_bytes())
        self._starts.append(int(mx.get_active_memory()) - kv)
        return min(self._starts) + kv + self.reserve(rows, logit_rows)

    def engage(self, rows: int, logit_rows: int) -> None:
        """Set the limit for a step of ``rows`` rows (again, if already engaged); a lower limit
        the user set stays in force."""
        limit = self.ceiling(rows, logit_rows)
        previous = mx.set_memory_limit(limit)
        if self._previous is None:
            self._previous = previous
        if limit > self._previous:
            mx.set_memory_limit(self._previous)

    def release(self) -> None:
        """Restore the limit that was in force before :meth:`engage` (nothing if not engaged)."""
        if self._previous is not None:
            mx.set_memory_limit(self._previous)
            self._previous = None


#: Overrides :data:`~mlx_infer.defaults.CEILING_LAYERS` where set (read when an engine is built): an A/B knob.
CEILING_LAYERS_ENV = "MLX_INFER_CEILING_LAYERS"


def ceiling_layers() -> int:
    """The layers a bounded step's reserve counts: ``MLX_INFER_CEILING_LAYERS`` where set, else
    :data:`~mlx_infer.defaults.CEILING_LAYERS`.

    Raises:
        MlxInferError: the variable is set to anything but a positive integer.
    """
    raw = os.environ.get(CEILING_LAYERS_ENV, "").strip()
    if not raw:
        return defaults.CEILING_LAYERS
    if not raw.isdigit() or int(raw) < 1:
        raise MlxInferError(f"{CEILING_LAYERS_ENV} must be a positive integer (decoder layers whose activations a "
                            f"prompt step may hold), got {raw!r}; unset it for the default "
                            f"({defaults.CEILING_LAYERS}).")
    return int(raw)


def step_row_bytes(model: Any) -> int:
    """Activation bytes one row keeps alive in a step until its command buffers have run: per
    layer, the residual stream's copies (input, norms, attention output, projections, sums:
    8 x hidden) and the MLP's (gate, up, their product: 3 x intermediate), in the model's dtype,
    over at most :func:`ceiling_layers` layers (what two command buffers hold)."""
    hidden, intermediate, _ = model_sizes(model)
    layers = min(layer_count(model), ceiling_layers())
    return max(1, layers * (8 * hidden + 3 * intermediate) * model_dtype(model).size)


def layer_count(model: Any) -> int:
    """The model's decoder layers (its args' ``num_hidden_layers``, else its ``layers``)."""
    args = getattr(model, "args", None)
    args = getattr(args, "text_config", None) or args
    n = (args.get("num_hidden_layers") if isinstance(args, dict) else getattr(args, "num_hidden_layers", None))
    return int(n or len(getattr(model, "layers", ())) or 1)


def activation_ceiling(engine: Any) -> ActivationCeiling | None:
    """The engine's ceiling, or ``None`` where ``EngineConfig.bound_activations`` (default: the
    device type's :data:`~mlx_infer.defaults.BOUND_ACTIVATIONS`) leaves activations unbounded."""
    bound = engine.config.bound_activations
    if bound is None:
        bound = defaults.BOUND_ACTIVATIONS["gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"]
    if not bound:
        return None
    _, _, vocab = model_sizes(engine.model)
    return ActivationCeiling(step_row_bytes(engine.model), vocab * (model_dtype(engine.model).size + 8),
                             lambda: engine.store.nbytes)
