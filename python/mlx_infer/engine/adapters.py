"""Per-request adapters in the engine: each row of a step runs under its request's adapter.

A request names an adapter (``EngineRequest.adapter``; ``None``: the model's default, if
any). At intake the engine holds it in the model's bank (:mod:`mlx_infer.adapters`) until
the request finishes, so it is never unloaded under a running row, and folds its identity
into the request's prefix-cache namespace: pages computed under one adapter are never
reused under another (nor under none). Every forward then gets one bank slot per row::

    decode step     rows 0..B-1           the decoding requests' slots
    mixed step      + each chunk's n rows its request's slot, then padding rows slot 0
    prefill         (B, n) tokens         one slot per request row

The compiled paged step takes them as ``adapter_slots`` (``DecodeBatch.adapter_slots``);
the eager graph reads them through :func:`mlx_infer.adapters.adapter_rows`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ContextManager, Sequence

import mlx.core as mx

from ..adapters.apply import adapter_rows
from ..adapters.bank import AdapterSlotsBusyError, bank_of
from .host_arrays import host_array

__all__ = ["AdapterSlotsBusyError", "batch_slots", "hold_adapter", "release_adapter", "rows_context", "slots_for"]


def hold_adapter(model: Any, live: Any) -> None:
    """At intake: hold the request's adapter, give the live request its slot and namespace.

    Raises:
        AdapterSlotsBusyError: every slot is held by running requests (the engine keeps the request
            queued and tries again after the next step).
        AdapterError: an unknown adapter (the request fails alone).
    """
    bank = bank_of(model)
    name = live.request.adapter
    if name is None and bank is not None:
        name = bank.default
    live.adapter = None
    live.adapter_slot = 0
    if name is None:
        return
    if bank is None:
        from ..adapters.formats import AdapterError

        raise AdapterError(f"adapter {name!r} was asked for but this model has no adapters loaded.")
    live.adapter_slot = bank.acquire(name)
    live.adapter = name
    ns = bank.namespace(name)
    live.request = replace(live.request, namespace=ns + ("|" + live.request.namespace if live.request.namespace else ""))


def release_adapter(model: Any, live: Any) -> None:
    """When the request ends: the bank may unload its adapter again."""
    name = getattr(live, "adapter", None)
    if name is not None:
        bank_of(model).release(name)
        live.adapter = None


def _any(rows: Sequence[Any]) -> bool:
    return any(getattr(r, "adapter_slot", 0) for r in rows)


def slots_for(rows: Sequence[Any], counts: Sequence[int] | None = None, total: int | None = None) -> mx.array | None:
    """``(R,)`` int32 slots: ``counts[i]`` rows of request ``i`` (default 1), padded with 0 to ``total``.
    ``None`` when no row has an adapter (the step runs without the update's cost)."""
    if not _any(rows):
        return None
    counts = [1] * len(rows) if counts is None else counts
    slots = [getattr(r, "adapter_slot", 0) for r, n in zip(rows, counts) for _ in range(n)]
    if total is not None:
        slots += [0] * (total - len(slots))
    return host_array(slots, mx.int32)


def rows_context(slots: mx.array | None) -> ContextManager[None]:
    """The eager graph's selection for a forward of these slots (slot 0 everywhere without adapters)."""
    return adapter_rows(slots if slots is not None else 0)


def batch_slots(batch: Any, slots: mx.array | None) -> None:
    """Give the batch its rows' slots for the compiled paged step (``None``: no adapter)."""
    batch.adapter_slots = slots
