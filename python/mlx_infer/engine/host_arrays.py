"""Arrays the engine makes from host values for a step's kernels (tokens, row indices, adapter slots).

On CUDA, MLX keeps an array made from host data in managed memory, and the first kernel that reads it
faults its pages over to the GPU (~0.1-0.2 ms; ``benchmarks/gpu_host_arrays.py``). :func:`host_array`
sends them at once (``_fast.prefetch_to_gpu``, as the C++ step plan does), so they move while the host
builds the step's graph. Elsewhere it is ``mx.array``.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from .. import _fast

#: MLX keeps buffers of at most this many bytes in a shared small pool the GPU reads in place.
_SMALL_POOL_BYTES = 8


def host_array(values: Sequence[int] | Sequence[Sequence[int]], dtype: mx.Dtype) -> mx.array:
    """``mx.array(values, dtype)``, its pages sent to the GPU now where that is CUDA."""
    a = mx.array(values, dtype)
    if a.nbytes > _SMALL_POOL_BYTES:
        _fast.prefetch_to_gpu(a)
    return a
