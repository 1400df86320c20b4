"""The compiled C++ decode step, wrapped for the generation loop.

The graph's weights and configuration come from :func:`~.graph_spec.graph_spec` (bindings/graph_spec.py, which
also lists the canonical weight names). :class:`CompiledDecodeStep` implements the ``DecodeStep`` contract
(``step(tokens, state) -> logits``, ``close()``). The step is pure: the plain
caches (:mod:`mlx_infer.state.kv`, mlx-lm's layout) own the KV at every moment.
Each call has every cache make room for the new token by its own rules
(``reserve_one``: growth in steps of 256, the ring's keep/idx rules), hands the
caches' buffers to the C++ step with where the token goes and how much
attention reads, and gives the caches the updated buffers back
(``commit_one``), as mlx-lm's ``update_and_fetch`` replaces its arrays with
slice updates. The caches drop the old arrays before anything is evaluated, so
MLX writes the new token in place (no copy of the KV per step).

A step that raises is reported once (``warnings.warn``) and the rest of the
generation runs on the eager graph from the caches as they are (a failed call
commits nothing), so the tokens do not change.
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


def _row_width(caches: Sequence[Any]) -> int:
    """Rows held by one cache list (1 while it is empty)."""
    for c in caches:
        if c.keys is not None:
            return c.keys.shape[0]
    return 1


def _is_rows(state: Sequence[Any]) -> bool:
    """True when ``state`` is one cache list per row rather than one batched cache list."""
    return len(state) > 0 and isinstance(state[0], (list, tuple))


def _pad_slots(a: mx.array, S: int) -> mx.array:
    """``a`` ``(b, KVH, s, D)`` with zero slots appended up to ``S``."""
    if a.shape[2] == S:
        return a
    return mx.concatenate([a, mx.zeros((*a.shape[:2], S - a.shape[2], a.shape[3]), a.dtype)], axis=2)


# -- the contract's DecodeStep ---------------------------------------------------------------------


class CompiledDecodeStep:
    """``step(tokens, state) -> logits`` over the C++ step, with an eager fallback.

    ``state`` is the graph's cache list (``model.make_cache()``, every row of
    the batch at the same offset), after an eager prefill or empty, or one
    cache list per row (rows of different lengths; each prefilled alone).
    Every call reads and updates those caches; nothing is held between calls,
    so the caches can be read, extended eagerly or stored at any point.
    One batched cache list is updated in place; rows in separate caches are
    stacked for the call (a copy of their KV per step) and split back.
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
        # V's width: K's, except under multi-head latent attention (K the latent, V the RoPE key)
        self._value_dims = [cfg.qk_rope_head_dim if cfg.kv_lora_rank else d for d in self._head_dims]
        self._step: Any = _fast.DecodeStep(cfg, weights, quant)
        groups = list(self._step.window_groups)
        self._group_of = [groups.index(w) for w in self._windows]  # per buffer, its window group
        self._dtype = _KV_DTYPES[cfg.kv_dtype] if cfg.kv_dtype else _model_dtype(model)
        self._fused = has_fused_projections(weights)
        # The bank's stacks are inputs of the step (adapters/native.py); rows pick slots per step.
        self._adapters = NativeAdapters(model, weights)
        try:
            self._adapters.refresh(self._step)
        except AdapterTargetUnsupported as exc:
            raise DecodeStepUnsupported(str(exc)) from None
        self.failures = 0
        self.last_error: BaseException | None = None

    # -- properties ------------------------------------------------------------------

    @property
    def failed(self) -> bool:
        """True once a step failed; every later step runs on the eager graph."""
        return self.last_error is not None

    @property
    def traces(self) -> int:
        """Times the C++ step was traced (one per batch size and cache buffer lengths seen)."""
        return self._step.traces if self._step is not None else 0

    @property
    def retraces(self) -> int:
        """Traces after the first."""
        return max(0, self.traces - 1)

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
        """Logits ``(B, vocab)`` for one new token per row; the caches then hold it.

        Args:
            tokens: ``(B,)`` (or ``(B, 1)``) token ids.
            state: the cache list, or one cache list per row (see the class doc).
        """
        if self.failed or self._step is None:
            return self._eager(tokens, state)
        try:
            self._adapters.refresh(self._step)
            if _is_rows(state):
                return self._step_rows(tokens, [list(r) for r in state])
            return self._step_batched(tokens, list(state))
        except Exception as exc:  # noqa: BLE001 - any failure falls back, reported once
            return self._fail(exc, tokens, state)

    __call__ = step

    def close(self) -> None:
        """Releases the compiled graph (the caches hold the KV and stay as they are)."""
        self._step = None

    def __enter__(self) -> "CompiledDecodeStep":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _reserve(self, caches: list[Any], rows: int) -> tuple[int, list[int], list[int]]:
        """Room for one token in each of a cache list's caches: ``(position, slots, reads)``, per window group."""
        if len(caches) != len(self._windows):
            raise DecodeStepUnsupported(f"the step has {len(self._windows)} KV-owning layers, the cache list "
                                        f"{len(caches)} caches")
        offsets = {c.offset for c in caches}
        if len(offsets) != 1:
            raise DecodeStepUnsupported(f"a row's caches disagree on their offset: {sorted(offsets)}")
        n_groups = len(self._step.window_groups)
        slots: list[int | None] = [None] * n_groups
        reads: list[int | None] = [None] * n_groups
        for layer, c in enumerate(caches):
            window = self._windows[layer]
            if window == 0 and type(c) is not KVCache or window > 0 and not (
                    type(c) is RotatingKVCache and c.max_size == window):
                raise DecodeStepUnsupported(
                    f"layer {layer}'s cache is a {type(c).__name__}; the compiled step needs "
                    + ("a KVCache" if window == 0 else f"a RotatingKVCache of max_size {window}"))
            if c.keys is not None and c.keys.dtype != self._dtype:  # kv_scheme: the caches hold its dtype
                c.keys, c.values = c.keys.astype(self._dtype), c.values.astype(self._dtype)
            at = c.reserve_one(rows, self._kv_heads[layer], self._head_dims[layer], self._value_dims[layer],
                               self._dtype)
            g = self._group_of[layer]
            if slots[g] is None:
                slots[g], reads[g] = at
            elif (slots[g], reads[g]) != at:
                raise DecodeStepUnsupported(f"caches of window {window} disagree on where the next token goes: "
                                            f"{(slots[g], reads[g])} and {at}")
        return offsets.pop(), slots, reads  # type: ignore[return-value]

    def _step_batched(self, tokens: mx.array, caches: list[Any]) -> mx.array:
        B = tokens.size
        position, slots, reads = self._reserve(caches, B)
        keys, values = [c.keys for c in caches], [c.values for c in caches]
        logits, keys, values = self._step.step(tokens, [position] * B, [[s] * B for s in slots],
                                               [[n] * B for n in reads], keys, values, self._adapters.slots(B))
        for c, k, v in zip(caches, keys, values):  # the caches drop the old buffers: MLX writes in place
            c.commit_one(k, v)
        return logits

    def _step_rows(self, tokens: mx.array, rows: list[list[Any]]) -> mx.array:
        widths = [_row_width(caches) for caches in rows]
        B = sum(widths)
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in self._step.window_groups]
        reads: list[list[int]] = [[] for _ in self._step.window_groups]
        for caches, w in zip(rows, widths):
            p, s, n = self._reserve(caches, w)
            positions += [p] * w
            for g in range(len(slots)):
                slots[g] += [s[g]] * w
                reads[g] += [n[g]] * w
        keys, values = [], []
        for layer in range(len(self._windows)):
            S = max(caches[layer].keys.shape[2] for caches in rows)  # each row's slots, zero-padded to S
            keys.append(mx.concatenate([_pad_slots(caches[layer].keys, S) for caches in rows]))  # (B, KVH, S, D)
            values.append(mx.concatenate([_pad_slots(caches[layer].values, S) for caches in rows]))
        logits, keys, values = self._step.step(tokens, positions, slots, reads, keys, values,
                                               self._adapters.slots(B))
        r = 0
        for caches, w in zip(rows, widths):
            for layer, c in enumerate(caches):
                S = c.keys.shape[2]
                c.commit_one(keys[layer][r:r + w, :, :S, :], values[layer][r:r + w, :, :S, :])
            r += w
        return logits

    def _fail(self, exc: BaseException, tokens: mx.array, state: Sequence[Any]) -> mx.array:
        self.failures += 1
        self.last_error = exc
        warnings.warn(f"compiled decode step failed ({type(exc).__name__}: {exc}); "
                      "continuing this generation on the eager graph", RuntimeWarning, stacklevel=3)
        return self._eager(tokens, state)  # the caches committed nothing of the failed call

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


#: DecodeConfig.kv_dtype -> the caches' dtype.
_KV_DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def _model_dtype(model: Any) -> mx.Dtype:
    """The dtype the model's eager graph writes its K/V in (its embedding's, or a quantized one's scales')."""
    embed = model.model.embed_tokens
    return embed.scales.dtype if isinstance(embed, nn.QuantizedEmbedding) else embed.weight.dtype
