"""Choosing an adapter for a generation: by name or by path, for the whole run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import mlx.nn as nn

from .apply import adapter_rows
from .bank import AdapterBank, ensure_bank
from .formats import AdapterError, adapter_dir


def attach_adapter(model: nn.Module, adapter: str | Path, *, name: str | None = None) -> str:
    """Make ``adapter`` (a registered name, or an adapter directory) available on ``model``; its name.

    A path is loaded and validated once (under ``name`` or the directory's name); a later
    call with the same path reuses it.
    """
    bank = ensure_bank(model)
    if isinstance(adapter, str) and adapter in bank.sources:
        return adapter
    try:
        p = adapter_dir(adapter)
    except AdapterError:
        known = ", ".join(bank.names) or "none"
        raise AdapterError(f"adapter {str(adapter)!r} is neither a loaded adapter (loaded: {known}) nor an "
                           "adapter directory.") from None
    for n, src in bank.sources.items():
        if src.resolve() == p.resolve() and (name is None or name == n):
            return n
    n = name or p.resolve().name
    bank.register(n, p)
    return n


def selected(bank: AdapterBank | None, name: str | None, run: Iterator[Any]) -> Iterator[Any]:
    """``run``'s items, each computed with adapter ``name`` on every row (held in the bank meanwhile)."""
    if bank is None or name is None:
        yield from run
        return
    slot = bank.acquire(name)
    try:
        while True:
            with adapter_rows(slot):
                try:
                    item = next(run)
                except StopIteration as stop:
                    return stop.value
            yield item
    finally:
        close = getattr(run, "close", None)
        if close is not None:
            with adapter_rows(slot):
                close()
        bank.release(name)


def default_adapter_identity(model: Any) -> str | None:
    """``NAME:sha256`` of the adapter a plain generation of ``model`` runs under (the bank's default:
    ``generate --adapter-path``), ``None`` without one: what a checkpoint's identity records of it."""
    from .bank import bank_of

    bank = bank_of(model)
    if bank is None or bank.default is None:
        return None
    name = bank.default
    bank.namespace(name)  # makes it resident if it was unloaded for room
    adapter = bank.adapter(name)
    return f"{name}:{adapter.fingerprint}"
