"""The bank as inputs of the compiled C++ steps (``cpp/include/mlx_infer/lora.h``).

A target's module path maps to the step's canonical linear name
(``model.layers.3.self_attn.q_proj`` -> ``layers.3.q``, as ``graph_spec`` names them);
the step then takes, per target, the bank's stacks (``a (S, in, r)``, ``b (S, r, out)``,
or for a small bank the concatenated ``a_cat (S r, in)``, ``b_cat (out, S r)``), ``scales
(S,)`` and DoRA's ``g (S, out)``, and per step each row's slot. Linears of a layer that share
their input (q, k, v; gate, up) go as one group target ``layers.0.q+layers.0.k+layers.0.v``
(A's stacked, B's block-diagonal): one pair of products for the group instead of one per
linear, which is most of the update's cost at small shapes (each product a kernel call). Where
the step fuses a layer's q|k|v (gate|up) into one product (``bindings/fused.py``), its members'
dense updates go as one target on the fused linear (``layers.0.qkv``, :func:`_fused_stack`): one
update and one add for the fused product; DoRA and a large bank's gathered stacks keep their
members' names, and the step concatenates their updates onto the fused product's rows. A
target the step has no name for (the LM head, say) keeps the step off (the eager graph runs it).
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx

from .apply import current_selection
from .bank import AdapterBank
from .formats import linear_dims

_SHORT = {
    "self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v", "self_attn.o_proj": "o",
    "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down",
    "per_layer_input_gate": "pli_gate", "per_layer_projection": "pli_proj",
    # fused in the checkpoint (phi3's qkv_proj and gate_up_proj, glm4's gate_up_proj): one linear each
    "self_attn.qkv_proj": "qkv", "mlp.gate_up_proj": "gate_up",
    # DeepSeek V3's latent attention projections and shared experts (generation/bindings/mla_spec.py)
    "self_attn.q_a_proj": "q_a", "self_attn.q_b_proj": "q_b", "self_attn.kv_a_proj_with_mqa": "kv_a",
    "mlp.shared_experts.gate_proj": "shared.gate", "mlp.shared_experts.up_proj": "shared.up",
    "mlp.shared_experts.down_proj": "shared.down",
}
_PATH = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_PATHS = {short: path for path, short in _SHORT.items()}


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
    for layer in sorted({n.rsplit(".", 1)[0] for n in by_name}):  # members of a linear the step fuses
        for fused, shorts in FUSED.items():
            if f"{layer}.{fused}.weight" not in weight_names:
                continue
            names = [f"{layer}.{m}" for m in shorts]
            stacks = [by_name.get(n) for n in names]
            present = [st for st in stacks if st is not None]
            if not present or not all(st.dense and st.g is None for st in present):
                continue  # DoRA or a large bank's stacks: per member (the step concatenates their updates)
            outs = [_linear_out(bank, n) for n in names]
            fa, fb = _fused_stack(stacks, outs)
            targets.append(f"{layer}.{fused}")
            a.append(fa)
            b.append(fb)
            scales.append(present[0].scales)
            g.append(None)
            grouped.update(n for n, st in zip(names, stacks) if st is not None)
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
#: their dense updates go as one target on it (:func:`_fused_stack`); DoRA or gathered members go by
#: their own names and the step concatenates their updates onto the fused product's rows.
FUSED = dict(zip(("qkv", "gate_up"), GROUPS))


def runs_linear(name: str, weight_names: Any) -> bool:
    """Whether a step whose weights are ``weight_names`` runs the linear ``name`` (``layers.3.q``):
    as itself, or as a member of its layer's fused q|k|v or gate|up."""
    if f"{name}.weight" in weight_names:
        return True
    layer, short = name.rsplit(".", 1)
    return any(short in members and f"{layer}.{fused}.weight" in weight_names for fused, members in FUSED.items())


def _linear_out(bank: AdapterBank, name: str) -> int:
    """Output features of the model's linear ``name`` (``layers.3.k``)."""
    _, i, short = name.split(".", 2)  # short may hold a dot (shared.gate)
    module: Any = bank.model["model"]["layers"][int(i)]
    for part in _PATHS[short].split("."):
        module = module[part]
    return linear_dims(module)[1]


def _fused_stack(stacks: list[Any], outs: list[int]) -> tuple[mx.array, mx.array]:
    """One dense target on a fused linear from its members' dense stacks (``None``: a member no adapter
    targets; ``outs``: every member's output features): a low-rank update of rank k r per slot, each
    slot's columns its members' r in member order, B's rows zero where no adapter targets a member::

        a (S k r, in)                slot s: rows [a_q(s); a_v(s)]           (k = 2 members targeted)
        b (out_q + out_k + out_v, S k r)    [[b_q(s), 0], [0, 0], [0, b_v(s)]] per slot's k r columns

    so the step adds one update to the one fused product (the rows of an untargeted member get
    exact zeros), with each member's own values: the unfused step's update, row for row."""
    present = [st for st in stacks if st is not None]
    k = len(present)
    S = present[0].scales.shape[0]
    r = present[0].a_cat.shape[0] // S
    dtype = present[0].a_cat.dtype
    if any(st.a_cat.dtype != dtype or st.b_cat.dtype != dtype for st in present):
        dtype = mx.float32
    a = mx.stack([st.a_cat.astype(dtype).reshape(S, r, -1) for st in present], axis=1)  # (S, k, r, in)
    rows, j = [], 0
    for st, out in zip(stacks, outs):
        block = mx.zeros((out, S, k, r), dtype)
        if st is not None:
            block[:, :, j, :] = st.b_cat.astype(dtype).reshape(out, S, r)  # (out, S, r): its own columns
            j += 1
        rows.append(block)
    b = mx.concatenate(rows, axis=0)  # (sum of outs, S, k, r)
    return mx.contiguous(a.reshape(S * k * r, -1)), mx.contiguous(b.reshape(b.shape[0], S * k * r))


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
