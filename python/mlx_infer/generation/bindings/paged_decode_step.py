"""The compiled C++ decode step over paged KV, wrapped for the batching engine.

``mlx_infer._fast.PagedDecodeStep`` runs the same one-token forward as the
plain compiled step (:mod:`.decode_step`) but owns no KV: every call takes the
page storage of each layer (:class:`~mlx_infer.state.paged.storage.LayerStorage`)
and the batch's gather index, and returns the updated storage::

    per step, from the batch (computed in numpy, once for all layers)
      tokens (R,)  positions (R,)  logit_rows (M,)  call_ends (R,) (LongRoPE's table: a chunk's end)
      per layer group (one window): block_tables (R, T), lengths (R,), write_slots (R,)
    C++ step (one mx.compile'd graph, or op by op; cpp/include/mlx_infer/paged_decode.h)
      per layer: scatter the R new K/V rows, attend through the tables
      (paged_attention: no gathered copy; the gather path on Metal or with
      attention="gather"), MLP; the head on the logit rows only
    commit (here, only after the step returned)
      storage.keys / storage.values <- the step's outputs

The storage is replaced only at the commit, so a step that raises leaves the
store as it was; the failure is reported once (``warnings.warn`` and the
``mlx_infer.engine`` log) and every later step runs on the eager graph. The
old storage arrays are referenced only by the new graph after the commit, so
MLX writes the new rows in place (no per-step copy of the cache).

Gemma 4's KV-shared layers have no storage of their own (the store pages the
KV-owning layers only): they attend over their donor's gather of the same step.

A layer's q|k|v and gate|up run as one product each where the device default says (a GPU:
``DecodePolicy.fuse_projections``), with an adapter bank too (``mlx-infer serve``): the fused
product adds its members' updates (``bindings/fused.py``).

Quantized KV storage has no compiled paged step: :func:`paged_unsupported_reason`
says so and the engine decodes eagerly.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import mlx.core as mx

from ... import _fast
from ...adapters.apply import adapter_rows
from ...adapters.native import AdapterTargetUnsupported, NativeAdapters
from .graph_spec import DecodePolicy, DecodeStepUnsupported, graph_spec, has_fused_projections

log = logging.getLogger("mlx_infer.engine")

#: Default rounding of the block-table width T (pages) in compiled mode (see PagedDecodePolicy).
DEFAULT_T_BUCKET = 4
#: Attention implementations of the step (PagedDecodePolicy.attention).
ATTENTION_IMPLS = ("kernel", "gather")


@dataclass(frozen=True)
class PagedDecodePolicy:
    """Choices of the compiled paged step.

    Attributes:
        compile: trace the whole step with ``mx.compile`` (T rounded up to
            ``t_bucket``) so steady-state steps replay one graph; off builds the
            graph op by op in C++ each step at the exact T.
        t_bucket: compiled mode: each layer group's block-table width (pages) is
            rounded up to a multiple of this, so a new trace happens once per
            ``t_bucket * page_size`` tokens of the longest row (and per batch size seen).
        pad_rows: compiled mode: the step runs its rows (and logit rows) padded
            up to a bucket (powers of two to 16, then multiples of 16; padding
            rows touch only the null page), so a batch that gains or loses a
            row replays a traced graph instead of tracing a new one.
        attention: ``"kernel"``: paged attention reads K/V through the block
            tables (CPU and CUDA kernels; Metal has none yet and gathers);
            ``"gather"``: the reference, a gathered (B, KVH, S, D) copy and MLX SDPA.
        tuned_products: the dense products through cuBLASLt's fastest algorithm per shape
            (:class:`~mlx_infer.generation.bindings.graph_spec.DecodePolicy`; ``None``: on
            where CUDA has them).

    Compiled is the default, measured on this project's 2-core CPU (mlx
    0.32.4, engine decode tok/s vs the eager paged graph, 64-token prompts,
    ``benchmarks/paged_decode.py``, with the gather path; the machine was
    shared, so noisy): tiny llama B=1 0.9x, B=8 1.35x; tiny gemma3 B=1 1.43x,
    B=8 1.42x; op by op 0.5-1.1x.
    """

    compile: bool = True
    t_bucket: int = DEFAULT_T_BUCKET
    pad_rows: bool = True
    attention: str = "kernel"
    tuned_products: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.t_bucket, bool) or not isinstance(self.t_bucket, int) or self.t_bucket < 1:
            raise ValueError(f"PagedDecodePolicy.t_bucket must be a positive integer, got {self.t_bucket!r}.")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"PagedDecodePolicy.attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}.")

    @property
    def bucket(self) -> int:
        """The T rounding the batch should apply (1 when not compiling)."""
        return self.t_bucket if self.compile else 1


class PagedDecodeBatch(Protocol):
    """What the step reads of a batch (``mlx_infer.engine.batch.DecodeBatch``) after ``reserve()``."""

    store: Any
    offset: mx.array  # (B,) int32 positions of the new tokens
    call_ends: mx.array  # (B,) int32 end of each row's call (a prefill chunk's rows: the chunk's end)
    copies: list[tuple[mx.array, mx.array] | None]  # per store layer group: copy-on-write pages (src, dst)
    caches: list[Any]  # the eager path's per-layer caches

    def group_windows(self) -> list[int | None]: ...

    def paged_inputs(self, bucket: int) -> list[tuple[mx.array, mx.array, mx.array]]: ...


def layer_groups(layer_windows: Sequence[int | None], group_windows: Sequence[int | None]) -> list[int]:
    """Per layer, the index of its window in ``group_windows`` (the gather it reads)."""
    index = {w: i for i, w in enumerate(group_windows)}
    missing = {w for w in layer_windows if w not in index}
    if missing:
        raise ValueError(f"layer windows {sorted(map(str, missing))} have no layer group in {list(group_windows)}.")
    return [index[w] for w in layer_windows]


def paged_unsupported_reason(store: Any) -> str | None:
    """Why the store's KV cannot go through the compiled paged step (``None``: it can)."""
    quantized = [i for i, s in enumerate(store.scheme) if s.quantized]
    if quantized:
        return (f"the paged KV of layers {quantized} is quantized; the compiled paged step reads "
                "float16/bfloat16/float32 storage only")
    return None


class CompiledPagedDecodeStep:
    """``step(tokens, batch) -> logits`` over the C++ paged step, with an eager fallback.

    Args:
        model: a llama-, gemma3- or gemma4-family graph.
        store: the :class:`~mlx_infer.state.paged.PagedKVStore` the batches read.
        group_windows: the window of each layer group, in the order the
            batch's ``paged_inputs`` lists them.
        policy: compile choices.

    Raises:
        DecodeStepUnsupported: no C++ step for this graph family or module.
        ValueError: quantized KV storage (see :func:`paged_unsupported_reason`).
    """

    def __init__(self, model: Any, store: Any, group_windows: Sequence[int | None], *,
                 policy: PagedDecodePolicy = PagedDecodePolicy()):
        reason = paged_unsupported_reason(store)
        if reason is not None:
            raise ValueError(reason)
        # Fused per the device's default, adapters or not (a fused linear adds its members' updates).
        cfg, weights, quant = graph_spec(model, policy=DecodePolicy(compile=False,
                                                                     tuned_products=policy.tuned_products))
        paged = _fast.PagedDecodeConfig()
        paged.layer_groups = layer_groups(store.layer_windows, group_windows)
        paged.compile = policy.compile
        paged.t_bucket = policy.t_bucket
        paged.attention = policy.attention
        paged.pad_rows = policy.pad_rows
        self.model = model
        self.store = store
        self.policy = policy
        self.group_windows = list(group_windows)
        self.native: Any = _fast.PagedDecodeStep(cfg, paged, weights, quant)
        #: True when some layer runs q|k|v or gate|up as one product (adapters or not).
        self.fused_projections = has_fused_projections(weights)
        # The bank's stacks are inputs of the step; each row's slot comes with the batch.
        self.adapters = NativeAdapters(model, weights)
        try:
            self.adapters.refresh(self.native)
        except AdapterTargetUnsupported as exc:
            raise DecodeStepUnsupported(str(exc)) from None
        self.failures = 0
        self.last_error: BaseException | None = None
        self.eager_steps = 0  # steps this object ran eagerly (storage not yet allocated, or failed)
        self._rows: dict[int, mx.array] = {}

    @property
    def failed(self) -> bool:
        """True once a step failed; every later step runs on the eager graph."""
        return self.last_error is not None

    @property
    def traces(self) -> int:
        """Times the compiled step was traced (one per (B, T buckets) signature seen)."""
        return self.native.traces

    @property
    def attention_backend(self) -> str:
        """What the step's attention ran on: ``"cpu"``, ``"cuda"`` or ``"gather"`` (``""`` before a step)."""
        return self.native.attention_backend

    @property
    def retraces(self) -> int:
        """Traces of a signature traced before: 0 when the step replays its graphs."""
        return self.native.retraces

    def step(self, tokens: mx.array, batch: PagedDecodeBatch) -> mx.array:
        """Logits ``(B, vocab)`` for one new token per row; commits the store's new K/V.

        Args:
            tokens: ``(B,)`` ids.
            batch: the engine's batch, after a successful ``reserve()``.
        """
        storages = self.store.storage
        if self.failed or any(s is None for s in storages):  # nothing written yet: the eager path allocates
            return self._eager(tokens, batch)
        try:
            if batch.group_windows() != self.group_windows:
                raise ValueError(f"the batch's layer groups {batch.group_windows()} are not the step's "
                                 f"{self.group_windows}")
            for layer, s in enumerate(storages):  # copy-on-write; repeating it (eager fallback) is harmless
                c = batch.copies[self.store.layer_group[layer]]
                if c is not None:
                    s.copy_pages(*c)
            groups = batch.paged_inputs(self.policy.bucket)
            rows = getattr(batch, "logit_rows", None)  # a mixed step: only some rows get logits
            if rows is None:
                rows = self._logit_rows(tokens.shape[0])
            self.adapters.refresh(self.native)
            slots = self.adapters.slots(tokens.shape[0], getattr(batch, "adapter_slots", None))
            extra = () if slots is None else (slots,)  # each row's bank slot, with adapters
            logits, keys, values = self.native.step(
                tokens, batch.offset, rows, groups, [s.keys[0] for s in storages], [s.values[0] for s in storages],
                *extra, call_ends=batch.call_ends)
        except Exception as exc:  # noqa: BLE001 - any failure falls back, reported once
            return self._fail(exc, tokens, batch)
        for s, k, v in zip(storages, keys, values):  # the commit
            s.keys, s.values = (k,), (v,)
        return logits

    __call__ = step

    def _logit_rows(self, n: int) -> mx.array:
        """``(n,)`` int32 ``0..n-1``: every decode row gets logits (cached per n)."""
        rows = self._rows.get(n)
        if rows is None:
            rows = self._rows[n] = mx.arange(n, dtype=mx.int32)
        return rows

    def _fail(self, exc: BaseException, tokens: mx.array, batch: PagedDecodeBatch) -> mx.array:
        self.failures += 1
        self.last_error = exc
        message = (f"compiled paged decode step failed ({type(exc).__name__}: {exc}); "
                   "the engine decodes on the eager graph from now on")
        log.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return self._eager(tokens, batch)

    def _eager(self, tokens: mx.array, batch: PagedDecodeBatch) -> mx.array:
        self.eager_steps += 1
        selection = getattr(batch, "adapter_slots", None)
        with adapter_rows(selection) if selection is not None else nullcontext():
            logits = self.model(tokens[:, None], cache=batch.caches)[:, -1, :]  # (R, vocab)
        rows = getattr(batch, "logit_rows", None)
        return logits if rows is None else logits[rows]  # (M, vocab)
