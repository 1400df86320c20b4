"""KV storage schemes per layer: plain (the store's dtype) or MLX affine quantization.

A scheme is one :class:`LayerKV` per layer. ``kv_config.json`` lists the
layers that differ from the default::

    [{"layer_idx": 0, "bits": 8, "group_size": 64},
     {"layer_idx": 5, "bits": 4, "group_size": 32}]

``bits`` null (or 16) keeps the layer plain.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ...errors import MlxInferError

#: Affine bit widths the paged store quantizes K/V to.
SUPPORTED_BITS = (4, 8)
#: Group sizes along head_dim (each must divide the model's head_dim).
SUPPORTED_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class LayerKV:
    """How one layer stores K/V.

    Attributes:
        bits: ``None`` for plain elements in the store's dtype, else 4 or 8
            (affine: packed uint32 plus one scale and one bias per group).
        group_size: elements of head_dim sharing a scale and bias.
    """

    bits: int | None = None
    group_size: int = 64

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def check(self, *, layer: int, head_dim: int | None = None) -> None:
        """Raise a ValueError naming the layer when the model cannot use this scheme."""
        if self.bits is None:
            return
        if self.bits not in SUPPORTED_BITS:
            raise MlxInferError(
                f"KV scheme for layer {layer}: bits must be one of {SUPPORTED_BITS} (or null for "
                f"plain), got {self.bits}."
            )
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise MlxInferError(
                f"KV scheme for layer {layer}: group_size must be one of {SUPPORTED_GROUP_SIZES}, "
                f"got {self.group_size}."
            )
        if head_dim is not None and head_dim % self.group_size != 0:
            fits = [g for g in SUPPORTED_GROUP_SIZES if head_dim % g == 0]
            hint = f"use group_size {fits[-1]}" if fits else "keep this layer unquantized (bits null)"
            raise MlxInferError(
                f"KV scheme for layer {layer}: group_size {self.group_size} does not divide the "
                f"model's head_dim {head_dim}; {hint}."
            )


def uniform_scheme(num_layers: int, bits: int | None = None, group_size: int = 64) -> list[LayerKV]:
    """The same scheme on every layer."""
    return [LayerKV(bits, group_size)] * num_layers


def load_kv_config(source: str | Path | Sequence[dict[str, Any]], num_layers: int, *,
                   default: LayerKV = LayerKV()) -> list[LayerKV]:
    """Per-layer schemes from a ``kv_config.json`` path or its parsed list.

    Args:
        source: the file, or a list of ``{layer_idx, bits, group_size}`` dicts.
        num_layers: the model's layer count.
        default: the scheme of layers the list does not name.

    Raises:
        MlxInferError (a ValueError): malformed entries, a layer index out of
            range or listed twice, or an unsupported bits/group_size.
    """
    where = "kv_config"
    if isinstance(source, (str, Path)):
        where = str(source)
        try:
            source = json.loads(Path(source).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise MlxInferError(f"Could not read the KV config {where}: {e}.") from None
    if not isinstance(source, (list, tuple)):
        raise MlxInferError(f"{where} must be a JSON list of {{layer_idx, bits, group_size}} objects.")
    schemes = [default] * num_layers
    seen: set[int] = set()
    for entry in source:
        if not isinstance(entry, dict) or "layer_idx" not in entry:
            raise MlxInferError(f"{where}: every entry needs a layer_idx, got {entry!r}.")
        i = entry["layer_idx"]
        if not isinstance(i, int) or not 0 <= i < num_layers:
            raise MlxInferError(f"{where}: layer_idx {i!r} is not in [0, {num_layers}).")
        if i in seen:
            raise MlxInferError(f"{where}: layer_idx {i} is listed twice.")
        seen.add(i)
        bits = entry.get("bits")
        scheme = LayerKV(None if bits in (None, 16) else bits, entry.get("group_size", default.group_size))
        scheme.check(layer=i)
        schemes[i] = scheme
    return schemes
