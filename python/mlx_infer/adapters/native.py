"""The bank as inputs of the compiled C++ steps (``cpp/include/mlx_infer/lora.h``).

A target's module path maps to the step's canonical linear name
(``model.layers.3.self_attn.q_proj`` -> ``layers.3.q``, as ``graph_spec`` names them);
the step then takes, per target, the bank's stacks (``a (S, in, r)``, ``b (S, r, out)``,
or for a small bank the concatenated ``a_cat (S r, in)``, ``b_cat (out, S r)``), ``scales
(S,)`` and DoRA's ``g (S, out)``, and per step each row's slot. Linears of a layer that share
their input (q, k, v; gate, up) go as one group target ``layers.0.q+layers.0.k+layers.0.v``
(A's stacked, B's block-diagonal): one pair of products for the group instead of one per
linear, which is most of the update's cost at small shapes (each product a kernel call). Where
the step fuses a layer's q|k|v (gate|up) into one product (``bindings/fused.py``) the targets keep
their members' names: the fused product gets every member's update added to its rows
(:func:`runs_linear`). A target the step has no name for (the LM head, say) keeps the step off
(the eager graph runs it).
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx

from .apply import current_selection
from .bank import AdapterBank

_SHORT = {
    "self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v", "self_attn.o_proj": "o",
    "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down",
    "per_layer_input_gate": "pli_gate", "per_layer_projection": "pli_proj",
    # fused in the checkpoint (phi3's qkv_proj and gate_up_proj, glm4's gate_up_proj): one linear each
    "self_attn.qkv_proj": "qkv", "mlp.gate_up_proj": "gate_up",
}
_PATH = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class AdapterTargetUnsupported(ValueError):
    """An adapter targets a layer the compiled step does not run as a named linear."""


def canonical_name(path: str) -> str | None:
    """The compiled step's name of the linear at module path ``path`` (``None``: it has none)."""
    m = _PATH.match(path)
    if m is None or m[2] not in _SHORT:
        return None
    return f"layers.{m[1]}.{_SHORT[m[2]]}"


def step_inputs(bank: AdapterBank, weight_names: Any) -> tuple[list[str], list, list, list, list]:
    """``(targets, a, b, scales, g)`` for ``set_adapters`` of a step whose weights are ``weight_names``.

    A target whose linear the step does not run (a KV-shared layer's k/v in Gemma 4, which the
    eager graph does not call either) is left out.

    Raises:
        AdapterTargetUnsupported: a target with no canonical name (the step would skip it).
    """
    by_name = {}
    for path, s in sorted(bank.stacks.items()):
        name = canonical_name(path)
        if name is None:
            raise AdapterTargetUnsupported(f"adapters target {path!r}, which the compiled step does not run "
                                           "as a named linear")
        if runs_linear(name, weight_names):
            by_name[name] = s
    targets, a, b, scales, g = [], [], [], [], []
    grouped: set[str] = set()
    for name in list(by_name):
        layer = name.rsplit(".", 1)[0]
        for shorts in GROUPS:
            members = [f"{layer}.{m}" for m in shorts if f"{layer}.{m}" in by_name]
            if name not in members or name in grouped or len(members) < 2:
                continue
            stacks = [by_name[m] for m in members]
            if not all(st.dense and st.g is None for st in stacks):
                continue
            targets.append("+".join(members))
            a.append(mx.concatenate([st.a_cat for st in stacks], axis=0))  # (k S r, in)
            b.append(_block_diagonal([st.b_cat for st in stacks]))  # (sum of outs, k S r)
            scales.append(stacks[0].scales)
            g.append(None)
            grouped.update(members)
    for name, s in by_name.items():
        if name in grouped:
            continue
        targets.append(name)
        a.append(s.a_cat if s.dense else s.a)  # 2-D: the step runs the dense product (lora.h)
        b.append(s.b_cat if s.dense else s.b)
        scales.append(s.scales)
        g.append(s.g)
    mx.eval(a, b)
    return targets, a, b, scales, g


#: Linears of one layer that read the same input: the step runs one update for each group.
GROUPS = (("q", "k", "v"), ("gate", "up"))
#: The fused linear a group's members become in a step that fuses projections (bindings/fused.py):
#: the step adds each member's update to the member's rows of the fused product.
FUSED = dict(zip(("qkv", "gate_up"), GROUPS))


def runs_linear(name: str, weight_names: Any) -> bool:
    """Whether a step whose weights are ``weight_names`` runs the linear ``name`` (``layers.3.q``):
    as itself, or as a member of its layer's fused q|k|v or gate|up."""
    if f"{name}.weight" in weight_names:
        return True
    layer, short = name.rsplit(".", 1)
    return any(short in members and f"{layer}.{fused}.weight" in weight_names for fused, members in FUSED.items())


def _block_diagonal(parts: list[mx.array]) -> mx.array:
    """``(sum of rows, sum of cols)`` with ``parts`` on the diagonal, zeros elsewhere."""
    cols = [p.shape[1] for p in parts]
    rows = []
    for i, p in enumerate(parts):
        left, right = sum(cols[:i]), sum(cols[i + 1:])
        row = [p]
        if left:
            row.insert(0, mx.zeros((p.shape[0], left), p.dtype))
        if right:
            row.append(mx.zeros((p.shape[0], right), p.dtype))
        rows.append(mx.concatenate(row, axis=1))
    return mx.concatenate(rows, axis=0)


def row_slots(bank: AdapterBank, rows: int, selection: Any = None) -> mx.array:
    """``(rows,)`` int32 bank slots from a selection (default: the current one, see apply.py)."""
    sel = current_selection() if selection is None else selection
    if sel is None:
        sel = bank.default_slot
    if isinstance(sel, int):
        return mx.full((rows,), sel, mx.int32)
    return sel.astype(mx.int32)


class NativeAdapters:
    """Keeps one C++ step's adapter inputs in step with its model's bank."""

    def __init__(self, model: Any, weight_names: Any):
        self.model = model
        self.names = set(weight_names)
        self.version: int | None = None
        self.active = False

    @property
    def bank(self) -> AdapterBank | None:
        """The model's bank (looked up each time: a server may create it after the step)."""
        return getattr(self.model, "adapter_bank", None)

    def refresh(self, native: Any) -> None:
        """``native.set_adapters`` again when the bank changed since the last call."""
        bank = self.bank
        if bank is None or bank.version == self.version:
            return
        version = bank.version  # read first: a change while reading the stacks shows up next step
        targets, a, b, scales, g = step_inputs(bank, self.names)
        native.set_adapters(targets, a, b, scales, g)
        self.version = version
        self.active = bool(targets)

    def slots(self, rows: int, selection: Any = None) -> mx.array | None:
        """The step's ``adapter_slots`` for ``rows`` rows; ``None`` when no row has an adapter
        (the step then runs without the update)."""
        if not self.active:
            return None
        sel = current_selection() if selection is None else selection
        if sel is None:
            sel = self.bank.default_slot
        if isinstance(sel, int) and sel == 0:
            return None
        return row_slots(self.bank, rows, sel)
