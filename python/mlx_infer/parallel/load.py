"""Read only this rank's slices of a safetensors checkpoint.

safetensors is a JSON header (name -> dtype, shape, byte offsets) and raw
row-major tensor bytes, so a slice of one axis is a strided view of a
memory-mapped file: each rank copies out just its slice, and no rank holds the
whole checkpoint (nor even one whole tensor) in memory. A tensor that the
family's ``sanitize`` computes rather than renames (none in llama/gemma3) is
sliced after MLX loads it, one tensor at a time.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import ModelLoadError
from ..models import graph_family
from .shard import FusedSlice, ShardPlan, Slice

# safetensors dtype -> (numpy dtype to read the bytes as, MLX dtype to view them as, or None)
_DTYPES: dict[str, tuple[Any, Any]] = {
    "F32": (np.float32, None), "F16": (np.float16, None), "BF16": (np.uint16, mx.bfloat16),
    "U32": (np.uint32, None), "I32": (np.int32, None), "U8": (np.uint8, None), "I8": (np.int8, None),
    "U16": (np.uint16, None), "I16": (np.int16, None), "I64": (np.int64, None), "U64": (np.uint64, None),
    "BOOL": (np.bool_, None),
}


class LazyTensor:
    """One tensor of a safetensors file, memory-mapped on demand."""

    def __init__(self, path: Path, name: str, dtype: str, shape: list[int], start: int, stop: int):
        self.path, self.name, self.dtype, self.shape = path, name, dtype, tuple(shape)
        self.start, self.stop = start, stop

    def read(self, s: Slice | FusedSlice | None, rank: int) -> mx.array:
        """The whole tensor, or its ``s`` slice (zeros of the full shape for a non-leader's ``zero_unless_leader``)."""
        np_dtype, view = _DTYPES[self.dtype]
        if s is not None and s.zero_unless_leader and rank != 0:
            out = mx.zeros(self.shape, view or mx.array(np.zeros((), np_dtype)).dtype)
            return out
        mm = np.memmap(self.path, dtype=np_dtype, mode="r", offset=self.start, shape=self.shape) \
            if self.stop > self.start else np.zeros(self.shape, np_dtype)
        if s is not None and not s.zero_unless_leader:
            axis = s.axis % len(self.shape)
            runs = []
            for lo, hi in s.ranges(self.shape[axis], self.name):
                index = [slice(None)] * len(self.shape)
                index[axis] = slice(lo, hi)
                runs.append(mm[tuple(index)])
            mm = runs[0] if len(runs) == 1 else np.concatenate(runs, axis=axis)
        arr = mx.array(np.ascontiguousarray(mm))
        del mm
        return arr.view(view) if view is not None else arr


def read_header(path: Path) -> dict[str, LazyTensor]:
    """The tensors of one safetensors file, unread."""
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"Could not read the safetensors header of {path}: {e}. The file is truncated or "
                             "corrupt; download or convert it again.") from None
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in _DTYPES:
            raise ModelLoadError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}, which sharded loading "
                                 f"does not read (known: {', '.join(_DTYPES)}).")
        a, b = info["data_offsets"]
        out[name] = LazyTensor(path, name, info["dtype"], info["shape"], base + a, base + b)
    return out


def read_sharded(files: list[Path], sanitize: Any, plan_for: Any) -> tuple[dict[str, mx.array], ShardPlan]:
    """This rank's weights of a checkpoint.

    Args:
        files: the checkpoint's safetensors files.
        sanitize: the family's ``Model.sanitize`` (renames; run on MLX's lazy arrays).
        plan_for: ``callable(weight names) -> ShardPlan`` (the model quantized by then).

    Returns:
        ``(weights, plan)``: the local weights under the model's names.
    """
    tensors: dict[str, LazyTensor] = {}
    lazy: dict[str, mx.array] = {}
    for f in files:
        tensors.update(read_header(f))
        try:
            lazy.update(mx.load(str(f)))  # lazy: nothing is read until evaluated
        except (RuntimeError, ValueError, OSError) as e:
            raise ModelLoadError(f"Could not read weights from {f}: {e}. The file is truncated or corrupt; "
                                 "download or convert it again.") from None
    source = {id(v): tensors[k] for k, v in lazy.items() if k in tensors}
    renamed = sanitize(lazy)
    plan = plan_for(renamed)
    rank = plan.pg.rank
    out: dict[str, mx.array] = {}
    for name, arr in renamed.items():
        if plan.held is not None and name not in plan.held:
            continue  # pipeline parallel: another rank's layer
        s = plan.slices.get(name)
        src = source.get(id(arr))
        if s is None:  # held whole: MLX reads it straight into its own buffer
            out[name] = arr
        elif src is not None:
            out[name] = src.read(s, rank)
        else:  # computed by sanitize: slice the lazy array (MLX reads that one tensor whole)
            out[name] = _slice_array(arr, s, rank, name)
        mx.eval(out[name])
    return out, plan


def _slice_array(arr: mx.array, s: Slice | FusedSlice | None, rank: int, name: str) -> mx.array:
    if s is None:
        return arr
    if s.zero_unless_leader:
        return arr if rank == 0 else mx.zeros_like(arr)
    axis = s.axis % arr.ndim
    idx = mx.concatenate([mx.arange(lo, hi) for lo, hi in s.ranges(arr.shape[axis], name)])
    return mx.contiguous(mx.take(arr, idx, axis=axis))


def sharded_weights(model: Any, files: list[Path], pg: Any, quantize: Any) -> tuple[dict[str, mx.array], ShardPlan]:
    """Read this rank's weights for ``model`` and check them against its local shapes.

    Args:
        model: the built (unloaded) graph.
        files: the checkpoint's safetensors files.
        pg: the :class:`~mlx_infer.parallel.group.ParallelGroup`.
        quantize: ``callable(weights by name)`` that quantizes ``model`` as the checkpoint is.

    Raises:
        ModelLoadError: a missing or extra tensor, or one whose shape does not fit the split.
    """
    from .shard import local_shapes, make_plan

    from .group import parallel_mode
    from .pipeline import make_pipeline_plan

    def plan_for(names: dict[str, Any]) -> ShardPlan:
        quantize(names)
        return make_pipeline_plan(model, pg) if parallel_mode() == "pipeline" else make_plan(model, pg)

    weights, plan = read_sharded(files, model.sanitize, plan_for)
    expected = local_shapes(model, plan)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        raise ModelLoadError(f"the checkpoint does not match this {graph_family(model)!r}-family model: missing "
                             f"{missing[:3]}, unexpected {extra[:3]}.")
    for k, shape in expected.items():
        if tuple(weights[k].shape) != shape:
            raise ModelLoadError(f"tensor {k!r} of rank {pg.rank}'s shard has shape {tuple(weights[k].shape)}, "
                                 f"expected {shape}; the checkpoint does not match its config.json.")
    return weights, plan
