"""The compiled C++ decode step, wrapped for the generation loop.

The graph's weights and configuration come from :func:`~.graph_spec.graph_spec` (bindings/graph_spec.py, which
also lists the canonical weight names). :class:`CompiledDecodeStep` implements the ``DecodeStep`` contract
(``step(tokens, state) -> logits``, ``close()``). On its first call it takes
over the KV that the eager prefill wrote into the plain caches
(:mod:`mlx_infer.state.kv`); from then on the C++ step owns the KV and the
plain caches are left behind, until :meth:`CompiledDecodeStep.sync` (or a
failure) writes it back. A step that raises is reported once
(``warnings.warn``) and the rest of the generation runs on the eager graph from
the unchanged KV, so the tokens do not change.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from ... import _fast
from ...adapters.native import AdapterTargetUnsupported, NativeAdapters
from ...state.kv import KVCache, RotatingKVCache

from .graph_spec import DecodePolicy, DecodeStepUnsupported, graph_spec, has_fused_projections


def kv_layers(cfg: Any) -> list[int]:
    """The layers that own a KV buffer (all but gemma4's KV-shared ones), as the plain cache list orders them."""
    donors = list(cfg.kv_donors)
    return [i for i in range(cfg.num_layers) if not donors or donors[i] == -1]


# -- plain caches <-> the step's buffers ----------------------------------------------------------


def _temporal(cache: Any) -> tuple[mx.array, mx.array] | None:
    """A plain cache's kept tokens, oldest first ``(B, KVH, n, D)``, ending at ``offset - 1``."""
    if isinstance(cache, KVCache):
        return cache.state or None
    if isinstance(cache, RotatingKVCache):
        state = cache.state
        if not state:
            return None
        _, offset, idx = map(int, cache.meta_state)
        out = []
        for v in state:
            n = v.shape[2]
            if idx == n:
                out.append(v)
            elif idx < offset:  # wrapped: the oldest token sits at idx
                out.append(mx.concatenate([v[..., idx:, :], v[..., :idx, :]], axis=2))
            else:
                out.append(v[..., :idx, :])
        return out[0], out[1]
    raise DecodeStepUnsupported(f"the compiled step cannot take over a {type(cache).__name__}")


def _row_width(caches: Sequence[Any]) -> int:
    """Rows held by one cache list (1 while it is empty)."""
    for c in caches:
        state = c.state
        if state:
            return state[0].shape[0]
    return 1


def _is_rows(state: Sequence[Any]) -> bool:
    """True when ``state`` is one cache list per row rather than one batched cache list."""
    return len(state) > 0 and isinstance(state[0], (list, tuple))


def prefix_arrays(rows: list[list[Any]], n_kv_heads: int | Sequence[int], head_dim: int | Sequence[int],
                  dtype: mx.Dtype) -> tuple[list[mx.array], list[mx.array], list[int]]:
    """Right-aligned per-layer K/V over the rows' caches, and each row's length.

    ``rows[r]`` is a cache list whose caches all hold the same number of rows
    (usually one); rows of different lengths are left-padded with zeros.
    ``n_kv_heads`` / ``head_dim``: one for every cache, or one per cache.
    """
    n = len(rows[0])
    heads = [n_kv_heads] * n if isinstance(n_kv_heads, int) else list(n_kv_heads)
    dims = [head_dim] * n if isinstance(head_dim, int) else list(head_dim)
    lengths: list[int] = []
    for caches in rows:
        offsets = {c.offset for c in caches}
        if len(offsets) != 1:
            raise DecodeStepUnsupported(f"a row's caches disagree on their offset: {sorted(offsets)}")
        lengths += [offsets.pop()] * _row_width(caches)
    keys, values = [], []
    for layer in range(len(rows[0])):
        parts = [_temporal(caches[layer]) for caches in rows]
        S = max((p[0].shape[2] for p in parts if p is not None), default=0)
        ks, vs = [], []
        for caches, p in zip(rows, parts):
            if p is None:
                empty = mx.zeros((_row_width(caches), heads[layer], S, dims[layer]), dtype)
                ks.append(empty)
                vs.append(empty)
                continue
            k, v = p
            pad = S - k.shape[2]
            if pad:
                k = mx.concatenate([mx.zeros((*k.shape[:2], pad, k.shape[3]), k.dtype), k], axis=2)
                v = mx.concatenate([mx.zeros((*v.shape[:2], pad, v.shape[3]), v.dtype), v], axis=2)
            ks.append(k)
            vs.append(v)
        keys.append(mx.concatenate(ks, axis=0) if len(ks) > 1 else ks[0])
        values.append(mx.concatenate(vs, axis=0) if len(vs) > 1 else vs[0])
    return keys, values, lengths


def write_back(step: Any, rows: list[list[Any]], windows: list[int]) -> None:
    """Writes the step's KV into the plain caches so the eager graph can continue."""
    lengths = step.lengths
    kv = step.kv_state()
    r0 = 0
    for caches in rows:
        width = _row_width(caches)
        n = lengths[r0]
        if any(lengths[r] != n for r in range(r0, r0 + width)):
            raise DecodeStepUnsupported("rows sharing one cache list hold different lengths")
        for layer, cache in enumerate(caches):
            k, v = (a[r0:r0 + width] for a in kv[layer])
            slots = k.shape[2]
            if windows[layer] == 0:
                cache.state = (k[..., :n, :], v[..., :n, :])
            else:
                if n <= slots:  # not wrapped: positions 0..n-1 in slots 0..n-1
                    state, idx = (k[..., :n, :], v[..., :n, :]), n
                else:
                    state, idx = (k, v), n % slots
                cache.meta_state = tuple(map(str, (windows[layer], n, idx)))
                cache.state = state
        r0 += width


# -- the contract's DecodeStep ---------------------------------------------------------------------


class CompiledDecodeStep:
    """``step(tokens, state) -> logits`` over the C++ step, with an eager fallback.

    ``state`` is the graph's cache list (``model.make_cache()``) after the
    eager prefill, every row of the batch at the same offset, or one cache
    list per row (rows of different lengths; each prefilled alone). The first
    call (and any call with another state, or after the caches changed) takes
    the KV over; later calls leave the plain caches untouched.
    """

    def __init__(self, model: Any, *, kv_scheme: str | None = None,
                 policy: DecodePolicy = DecodePolicy()):
        # With adapters too: a fused q|k|v (gate|up) adds its members' updates (cpp/decode/lora.cpp).
        cfg, weights, quant = graph_spec(model, kv_scheme=kv_scheme, policy=policy)
        self._model = model
        self._cfg = cfg
        owners = kv_layers(cfg)  # one buffer (and one plain cache) per KV-owning layer
        self._windows = [cfg.windows[i] for i in owners]
        self._kv_heads = [cfg.layer_kv_heads[i] if cfg.layer_kv_heads else cfg.num_kv_heads for i in owners]
        self._head_dims = [cfg.layer_head_dims[i] if cfg.layer_head_dims else cfg.head_dim for i in owners]
        self._step: Any = _fast.DecodeStep(cfg, weights, quant)
        self._fused = has_fused_projections(weights)
        # The bank's stacks are inputs of the step (adapters/native.py); rows pick slots per step.
        self._adapters = NativeAdapters(model, weights)
        try:
            self._adapters.refresh(self._step)
        except AdapterTargetUnsupported as exc:
            raise DecodeStepUnsupported(str(exc)) from None
        self._bound: Any = None
        self._bound_offsets: list[int] | None = None
        self._rows: list[list[Any]] = []
        self.failures = 0
        self.last_error: BaseException | None = None

    # -- properties ------------------------------------------------------------------

    @property
    def failed(self) -> bool:
        """True once a step failed; every later step runs on the eager graph."""
        return self.last_error is not None

    @property
    def traces(self) -> int:
        """Times the C++ step was traced (one per (batch, capacity) seen)."""
        return self._step.traces if self._step is not None else 0

    @property
    def retraces(self) -> int:
        """Traces after the first."""
        return max(0, self.traces - 1)

    @property
    def lengths(self) -> list[int]:
        """Tokens the step holds per row."""
        return list(self._step.lengths) if self._step is not None else []

    @property
    def native(self) -> Any:
        """The ``mlx_infer._fast.DecodeStep``."""
        return self._step

    @property
    def fused_projections(self) -> bool:
        """True when some layer runs q|k|v or gate|up as one product (fused in place or in the checkpoint)."""
        return self._fused

    # -- the contract -----------------------------------------------------------------

    def step(self, tokens: mx.array, state: Sequence[Any]) -> mx.array:
        """Logits ``(B, vocab)`` for one new token per row.

        Args:
            tokens: ``(B,)`` (or ``(B, 1)``) token ids.
            state: the cache list, or one cache list per row (see the class doc).
        """
        if self.failed or self._step is None:
            return self._eager(tokens, state)
        try:
            if state is not self._bound or self._offsets(state) != self._bound_offsets:
                self._take_over(state)
            self._adapters.refresh(self._step)
            slots = self._adapters.slots(self._step.batch_size)
            return self._step.step(tokens) if slots is None else self._step.step(tokens, slots)
        except Exception as exc:  # noqa: BLE001 - any failure falls back, reported once
            return self._fail(exc, tokens, state)

    __call__ = step

    def sync(self) -> None:
        """Writes the step's KV back into the bound plain caches (their offsets then match)."""
        if self._bound is not None and self._step is not None and self._step.loaded:
            write_back(self._step, self._rows, self._windows)
            self._bound_offsets = self._offsets(self._bound)

    def close(self) -> None:
        """Releases the KV buffers and the compiled graph (the plain caches stay as they are)."""
        if self._step is not None:
            self._step.reset()
        self._step = None
        self._bound = None
        self._rows = []

    def __enter__(self) -> "CompiledDecodeStep":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _offsets(self, state: Sequence[Any]) -> list[int]:
        # One cache per row list: the layers of a list move together, so the
        # first one tells whether anything wrote to the caches behind our back.
        rows = state if _is_rows(state) else [state]
        return [caches[0].offset for caches in rows if len(caches)]

    def _take_over(self, state: Sequence[Any]) -> None:
        rows = [list(r) for r in state] if _is_rows(state) else [list(state)]
        dtype = self._model.model.embed_tokens.weight.dtype
        if isinstance(self._model.model.embed_tokens, nn.QuantizedEmbedding):
            dtype = self._model.model.embed_tokens.scales.dtype
        keys, values, lengths = prefix_arrays(rows, self._kv_heads, self._head_dims, dtype)
        self._step.load_prefix(keys, values, lengths)
        self._rows = rows
        self._bound = state
        self._bound_offsets = self._offsets(state)

    def _fail(self, exc: BaseException, tokens: mx.array, state: Sequence[Any]) -> mx.array:
        self.failures += 1
        self.last_error = exc
        warnings.warn(f"compiled decode step failed ({type(exc).__name__}: {exc}); "
                      "continuing this generation on the eager graph", RuntimeWarning, stacklevel=3)
        if state is self._bound and self._step is not None and self._step.loaded:
            write_back(self._step, self._rows, self._windows)  # the KV as of before the failed step
        if self._step is not None:
            self._step.reset()
        return self._eager(tokens, state)

    def _eager(self, tokens: mx.array, state: Sequence[Any]) -> mx.array:
        tokens = tokens.reshape(-1, 1)  # (B, 1)
        if not _is_rows(state):
            return self._model(tokens, cache=list(state))[:, -1, :]  # (B, vocab)
        out, r = [], 0
        for caches in state:
            width = _row_width(caches)
            out.append(self._model(tokens[r:r + width], cache=list(caches))[:, -1, :])
            r += width
        return mx.concatenate(out, axis=0)
