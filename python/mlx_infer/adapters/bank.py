"""The resident adapters of one model, stacked per target so rows can pick theirs.

::

    slot        0        1         2        ...  capacity
    adapter     (none)   "sql"     "chat"        (free: zeros)
    per target (module path), stacked over the slots, rank padded to a bucket:
      a       (S, in, r_max)      zeros where a slot's adapter does not touch the target
      b       (S, r_max, out)
      scales  (S,) float32
      g       (S, out) or None    DoRA's m / ||W + scale (a b)^T|| (1 for non-DoRA slots)

``S = capacity + 1`` is fixed, so adapters coming and going change the stacked tensors'
values, not their shapes: a compiled step that takes them as inputs is traced again only
when ``r_max`` or the set of targets grows (:attr:`AdapterBank.layout`).

Residency: adapters are *registered* by name and path (:meth:`AdapterBank.register`
loads and validates at once); at most ``capacity`` are resident. Asking for a registered
adapter that is not resident (:meth:`AdapterBank.acquire`) loads it again, unloading the
least recently used idle one; one held by a running request is never unloaded
(:meth:`AdapterBank.release` when the request ends). :attr:`AdapterBank.nbytes` is what
the stacked tensors hold, for the memory budget.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .apply import dora_gain, hook, unhook
from .formats import Adapter, AdapterError, LoraTarget, linear_dims, load_adapter

#: Default most resident adapters (vLLM's max_loras is 1 by default; a CPU host holds more).
DEFAULT_CAPACITY = 8
#: Ranks are padded up to a multiple of this in the stacks.
RANK_BUCKET = 8
#: Banks with ``slots * r_max`` up to this many columns use the concatenated (dense) product.
DENSE_MAX_COLS = 512


class AdapterNotFoundError(AdapterError):
    """No adapter of that name is registered."""


class AdapterInUseError(AdapterError):
    """The adapter is used by a running request (or every resident one is, when a slot is needed)."""


class AdapterMemoryError(AdapterError):
    """Making the adapter resident would grow the bank past the memory it may take."""


class AdapterSlotsBusyError(AdapterInUseError):
    """No slot can be freed for an adapter now: every resident one is held by running requests.
    The engine keeps such a request queued until one finishes (as vLLM does)."""


@dataclass
class Stack:
    """One target's stacked update over the bank's slots (see the module doc).

    Two layouts of the same values; the per-row product reads ``a``/``b`` (a gather per
    row) or, when ``S * r_max`` is at most :data:`DENSE_MAX_COLS`, the concatenated
    ``a_cat``/``b_cat`` (two matmuls over every slot at once, the other slots' columns
    masked to zero: far fewer, larger products, which is what small banks run fastest).
    """

    a: mx.array  # (S, in, r_max)
    b: mx.array  # (S, r_max, out)
    scales: mx.array  # (S,) float32
    g: mx.array | None  # (S, out) or None
    # Stored as linear weights (``y = x @ w.T``), the layout the CPU kernels take:
    a_cat: mx.array | None = None  # (S * r_max, in): slot s's rows s*r .. s*r + r - 1 are its A^T
    b_cat: mx.array | None = None  # (out, S * r_max): slot s's columns are its B^T times its scale
    targets: list[LoraTarget | None] = field(default_factory=list)  # per slot, unpadded
    gains: list[mx.array | None] = field(default_factory=list)  # per slot, DoRA gain (out,)

    @property
    def dense(self) -> bool:
        return self.a_cat is not None


class AdapterBank:
    """Resident adapters of ``model`` (see the module doc).

    Args:
        model: the base graph; its targeted linear layers are hooked (adapters/apply.py).
        capacity: most resident adapters (>= 1).
        rank_bucket: ranks are padded to a multiple of this.
    """

    def __init__(self, model: nn.Module, *, capacity: int = DEFAULT_CAPACITY, rank_bucket: int = RANK_BUCKET):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise AdapterError(f"the adapter capacity must be a positive integer, got {capacity!r}.")
        self.model = model
        self.capacity = capacity
        self.rank_bucket = rank_bucket
        self.slots: list[Adapter | None] = [None] * (capacity + 1)
        self.sources: dict[str, Path] = {}
        self.stacks: dict[str, Stack] = {}
        self.default: str | None = None
        self.version = 0  # bumps when the stacked tensors change
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._users: dict[str, int] = {}
        self._modules = dict(model.named_modules())
        self._lock = threading.RLock()
        object.__setattr__(model, "adapter_bank", self)

    # -- queries ----------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """Registered adapters, in registration order."""
        return list(self.sources)

    @property
    def resident(self) -> list[str]:
        return [a.name for a in self.slots if a is not None]

    @property
    def default_slot(self) -> int:
        """The slot of :attr:`default` (0 when none is set or it is not resident)."""
        return 0 if self.default is None else self._slot(self.default)

    @property
    def nbytes(self) -> int:
        """Bytes of the stacked tensors."""
        return sum(s.a.nbytes + s.b.nbytes + s.scales.nbytes + (0 if s.g is None else s.g.nbytes)
                   for s in self.stacks.values())

    @property
    def layout(self) -> tuple:
        """What a compiled step's trace depends on: targets and their stacked shapes."""
        return tuple((k, tuple(s.a.shape), tuple(s.b.shape), s.g is not None) for k, s in sorted(self.stacks.items()))

    def adapter(self, name: str) -> Adapter | None:
        """The resident adapter ``name`` (``None``: not resident)."""
        for a in self.slots:
            if a is not None and a.name == name:
                return a
        return None

    def namespace(self, name: str | None) -> str:
        """Cache namespace of rows under adapter ``name`` (``""``: no adapter)."""
        if name is None:
            return ""
        a = self.adapter(name)
        if a is None:
            self.acquire(name)
            self.release(name)
            a = self.adapter(name)
        return a.namespace

    def projected_nbytes(self, adapter: Adapter) -> int:
        """:attr:`nbytes` with ``adapter`` resident besides every resident one (none evicted: an upper
        bound), from the stacks' shapes: per target ``(S, in, r_max)`` + ``(S, r_max, out)`` + scales (+ g)."""
        present = [a for a in self.slots if a is not None] + [adapter]
        ranks = [t.rank for a in present for t in a.targets.values()]
        r_max = -(-max(ranks, default=1) // self.rank_bucket) * self.rank_bucket
        S = len(self.slots)
        total = 0
        for key in sorted({k for a in present for k in a.targets}):
            inp, out = linear_dims(self._modules[key])
            ts = [a.targets[key] for a in present if key in a.targets]
            dtype = ts[0].a.dtype  # as _rebuild stacks them: one dtype, or float32 when they differ
            item = 4 if any(t.a.dtype != dtype or t.b.dtype != dtype for t in ts) else dtype.size
            total += S * r_max * (inp + out) * item + S * 4 + (S * out * 4 if any(t.m is not None for t in ts) else 0)
        return total

    def in_use(self, name: str) -> int:
        return self._users.get(name, 0)

    # -- registration -----------------------------------------------------------------------

    def register(self, name: str, path: str | Path, *, max_nbytes: int | None = None) -> Adapter:
        """Load, validate and make resident the adapter at ``path`` under ``name``.

        Args:
            max_nbytes: most bytes the bank may hold with it resident (:meth:`projected_nbytes`);
                ``None``: no limit.

        Raises:
            AdapterError: the adapter is malformed or does not fit the model (the bank is unchanged).
            AdapterMemoryError: it would take the bank past ``max_nbytes`` (the bank is unchanged).
            AdapterInUseError: every resident adapter is in use, none can make room.
        """
        from ..parallel.group import current_group

        if current_group().distributed:  # the base layers are sharded; the adapter's A/B are not (yet)
            raise AdapterError(f"adapter {name!r}: adapters are not supported when the model is split over "
                               "processes (mlx.launch); run it in one process, or fuse it into the model first "
                               "with `mlx-infer fuse`.")
        with self._lock:
            if name in self.sources:
                raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first or pick another name.")
            adapter = load_adapter(path, self.model, name=name)
            if max_nbytes is not None:
                need = self.projected_nbytes(adapter)
                if need > max_nbytes:
                    mib = 2**20
                    raise AdapterMemoryError(
                        f"adapter {name!r} would grow the adapter bank to {need / mib:.2f} MiB, past the "
                        f"{max_nbytes / mib:.2f} MiB the memory budget leaves it beside the KV pool; unload "
                        "adapters, or restart with a larger memory budget or fewer KV pages.")
            self._place(adapter)
            self.sources[name] = adapter.path
            return adapter

    def unload(self, name: str) -> None:
        """Forget ``name`` (refused while a request uses it)."""
        with self._lock:
            if name not in self.sources:
                raise AdapterNotFoundError(f"no adapter named {name!r} is loaded.")
            if self.in_use(name):
                raise AdapterInUseError(f"adapter {name!r} is used by {self.in_use(name)} running request(s); "
                                        "unload it when they finish.")
            self._evict(name)
            del self.sources[name]
            if self.default == name:
                self.default = None

    def acquire(self, name: str) -> int:
        """The slot of ``name``, loading it back if it was unloaded for room; held until :meth:`release`."""
        with self._lock:
            if name not in self.sources:
                known = ", ".join(self.sources) or "none"
                raise AdapterNotFoundError(f"no adapter named {name!r} is loaded (loaded: {known}).")
            slot = self._slot(name)
            if slot == 0:
                self._place(load_adapter(self.sources[name], self.model, name=name))
                slot = self._slot(name)
            self._users[name] = self._users.get(name, 0) + 1
            self._lru.move_to_end(name)
            return slot

    def release(self, name: str) -> None:
        with self._lock:
            n = self._users.get(name, 0)
            if n <= 1:
                self._users.pop(name, None)
            else:
                self._users[name] = n - 1

    # -- internals ----------------------------------------------------------------------------

    def _slot(self, name: str) -> int:
        for i, a in enumerate(self.slots):
            if a is not None and a.name == name:
                return i
        return 0

    def _place(self, adapter: Adapter) -> None:
        free = next((i for i in range(1, len(self.slots)) if self.slots[i] is None), None)
        if free is None:
            idle = next((n for n in self._lru if not self.in_use(n)), None)
            if idle is None:
                raise AdapterSlotsBusyError(f"all {self.capacity} resident adapters are in use by running requests; "
                                        "retry when one finishes, or raise the adapter capacity.")
            self._evict(idle)
            free = next(i for i in range(1, len(self.slots)) if self.slots[i] is None)
        self.slots[free] = adapter
        self._lru[adapter.name] = None
        self._lru.move_to_end(adapter.name)
        self._rebuild()

    def _evict(self, name: str) -> None:
        slot = self._slot(name)
        if slot:
            self.slots[slot] = None
        self._lru.pop(name, None)
        self._rebuild()

    def _rebuild(self) -> None:
        """Restack every target over the slots and hook the targeted layers."""
        keys = sorted({k for a in self.slots if a is not None for k in a.targets})
        ranks = [t.rank for a in self.slots if a is not None for t in a.targets.values()]
        r_max = -(-max(ranks, default=1) // self.rank_bucket) * self.rank_bucket
        stacks: dict[str, Stack] = {}
        for key in keys:
            module = self._modules[key]
            inp, out = linear_dims(module)
            targets = [None if a is None else a.targets.get(key) for a in self.slots]
            present = [t for t in targets if t is not None]
            dtype = present[0].a.dtype
            if any(t.a.dtype != dtype or t.b.dtype != dtype for t in present):
                dtype = mx.float32
            a_rows, b_rows, scales, gains, g_rows = [], [], [], [], []
            dora = any(t.m is not None for t in present)
            for t in targets:
                if t is None:
                    a_rows.append(mx.zeros((inp, r_max), dtype))
                    b_rows.append(mx.zeros((r_max, out), dtype))
                    scales.append(0.0)
                    gains.append(None)
                    g_rows.append(mx.ones((out,), mx.float32))
                    continue
                pad = r_max - t.rank
                a_rows.append(mx.pad(t.a.astype(dtype), [(0, 0), (0, pad)]))
                b_rows.append(mx.pad(t.b.astype(dtype), [(0, pad), (0, 0)]))
                scales.append(t.scale)
                gain = dora_gain(module, t) if t.m is not None else None
                gains.append(gain)
                g_rows.append(mx.ones((out,), mx.float32) if gain is None else gain.astype(mx.float32))
            a, b = mx.stack(a_rows), mx.stack(b_rows)  # (S, in, r), (S, r, out)
            sc = mx.array(scales, mx.float32)
            stack = Stack(a=a, b=b, scales=sc, g=mx.stack(g_rows) if dora else None, targets=targets, gains=gains)
            S = len(targets)
            if S * r_max <= DENSE_MAX_COLS:
                stack.a_cat = mx.contiguous(a.transpose(0, 2, 1).reshape(S * r_max, inp))  # (S*r, in)
                scaled = (b * sc[:, None, None].astype(dtype)).reshape(S * r_max, out)  # (S*r, out)
                stack.b_cat = mx.contiguous(scaled.T)  # (out, S*r)
            stacks[key] = stack
        arrays: list[Any] = []
        for s in stacks.values():
            arrays += [s.a, s.b, s.scales] + ([s.g] if s.g is not None else []) + [g for g in s.gains if g is not None]
            arrays += [s.a_cat, s.b_cat] if s.dense else []
        mx.eval(arrays)
        for key in set(self.stacks) - set(stacks):
            unhook(self._modules[key])
        for key in stacks:
            hook(self._modules[key], self, key)
        self.stacks = stacks
        self.version += 1


def bank_of(model: Any) -> AdapterBank | None:
    """The model's adapter bank, or ``None``."""
    return getattr(model, "adapter_bank", None)


def ensure_bank(model: nn.Module, *, capacity: int = DEFAULT_CAPACITY) -> AdapterBank:
    """The model's bank, created on first use."""
    bank = bank_of(model)
    return bank if bank is not None else AdapterBank(model, capacity=capacity)
