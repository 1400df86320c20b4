"""The typed, range-checked reading of a model family's config fields: one place for every family.

Each family's ``ModelArgs.from_dict`` passes its (flattened) config through
:func:`config_fields`, which keeps the keys the dataclass declares and checks
each value against the field's annotation (``int``, ``float``, ``bool``,
``str``, ``list``, ``dict``, optionally ``| None``) and against the ranges in
:data:`FIELD_RANGES`. The cross-field rules every family shares (attention
heads, layer types, RoPE dicts) are the ``check_*`` helpers below.

Bad values raise :class:`~mlx_infer.errors.ModelLoadError` naming the field,
the rule and the value; the loader adds the file (``.../config.json``).
Ranges are generous bounds on real checkpoints, tight enough that shapes stay
inside MLX's int32 dimensions and nothing divides by zero.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping

from ..errors import ModelLoadError
from ..layers.rope import rope_type_of

FULL, SLIDING = "full_attention", "sliding_attention"
#: Attention kinds a ``layer_types`` entry may name (every family here reads these two).
LAYER_TYPES = (FULL, SLIDING)

_F32_MAX = 3.4028234663852886e38
_MAX_DIM = 1 << 20  # widths (hidden, intermediate): the largest real ones are ~5e4
_MAX_HEADS = 1 << 12
_MAX_HEAD_DIM = 1 << 13
_MAX_LAYERS = 1 << 12
_MAX_VOCAB = 1 << 24  # the largest real vocabularies are ~2.6e5
_MAX_CONTEXT = 1 << 30

#: field -> (min, max, min_exclusive) for numbers; absent fields get only the type check.
FIELD_RANGES: dict[str, tuple[float, float, bool]] = {
    "hidden_size": (1, _MAX_DIM, False),
    "intermediate_size": (1, _MAX_DIM, False),
    "moe_intermediate_size": (1, _MAX_DIM, False),
    "hidden_size_per_layer_input": (0, _MAX_DIM, False),
    "num_hidden_layers": (1, _MAX_LAYERS, False),
    "num_attention_heads": (1, _MAX_HEADS, False),
    "num_key_value_heads": (1, _MAX_HEADS, False),
    "num_global_key_value_heads": (1, _MAX_HEADS, False),
    "head_dim": (1, _MAX_HEAD_DIM, False),
    "global_head_dim": (1, _MAX_HEAD_DIM, False),
    "vocab_size": (1, _MAX_VOCAB, False),
    "vocab_size_per_layer_input": (1, _MAX_VOCAB, False),
    "max_position_embeddings": (1, _MAX_CONTEXT, False),
    "sliding_window": (1, _MAX_CONTEXT, False),
    "sliding_window_pattern": (1, _MAX_LAYERS, False),
    "max_window_layers": (0, _MAX_LAYERS, False),
    "num_kv_shared_layers": (0, _MAX_LAYERS, False),
    "num_experts": (1, 1 << 16, False),
    "top_k_experts": (1, 1 << 16, False),
    "rms_norm_eps": (0.0, 1.0, True),
    "rope_theta": (0.0, _F32_MAX, True),
    "rope_local_base_freq": (0.0, _F32_MAX, True),
    "query_pre_attn_scalar": (0.0, _F32_MAX, True),
    "final_logit_softcapping": (0.0, _F32_MAX, True),
    "attn_logit_softcapping": (0.0, _F32_MAX, True),
}

# Numeric keys of a RoPE dict (rope_scaling / rope_parameters): key -> (min, max, min_exclusive, integer).
_ROPE_NUMBERS: dict[str, tuple[float, float, bool, bool]] = {
    "factor": (0.0, _F32_MAX, True, False),
    "rope_theta": (0.0, _F32_MAX, True, False),
    "low_freq_factor": (0.0, _F32_MAX, True, False),
    "high_freq_factor": (0.0, _F32_MAX, True, False),
    "original_max_position_embeddings": (1, _MAX_CONTEXT, False, True),
    "beta_fast": (0.0, _F32_MAX, True, False),
    "beta_slow": (0.0, _F32_MAX, True, False),
    "mscale": (-_F32_MAX, _F32_MAX, False, False),
    "mscale_all_dim": (-_F32_MAX, _F32_MAX, False, False),
    "partial_rotary_factor": (0.0, 1.0, True, False),
    "attention_factor": (0.0, _F32_MAX, True, False),
}
_ROPE_NEEDS_FACTOR = ("linear", "llama3", "yarn")


def _fail(name: str, rule: str, value: Any) -> ModelLoadError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ModelLoadError(f"\"{name}\" must be {rule}, got {shown}.")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


_ARTICLES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
             "list": "a list", "dict": "an object"}


def _kinds(annotation: Any) -> tuple[set[str], bool]:
    """``({"int"}, True)`` for ``"int | None"``: the base kinds a field annotation allows."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text + "|"):  # split on the top-level "|" only (not inside list[int | None])
        depth += (ch == "[") - (ch == "]")
        if ch == "|" and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    optional = "None" in parts
    kinds = {p.split("[", 1)[0] for p in parts if p != "None"}
    return kinds, optional


def check_number(name: str, value: Any, *, integer: bool, lo: float, hi: float, lo_open: bool = False) -> int | float:
    """``value`` as an int (``integer``) or float inside ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``).

    Integral floats (``64.0``) are accepted for integer fields; booleans never are.
    Floats must be finite in float32 (the dtype the graph computes in).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(name, "an integer" if integer else "a number", value)
    if integer:
        if isinstance(value, float):
            if not value.is_integer():
                raise _fail(name, "an integer", value)
            value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value) or abs(value) > _F32_MAX:
            raise _fail(name, "a finite number (in float32 range)", value)
    if value < lo or value > hi or (lo_open and value == lo):
        bound = f"> {_num(lo)}" if lo_open else f">= {_num(lo)}"
        raise _fail(name, f"{bound} and <= {_num(hi)}", value)
    return value


def check_value(name: str, annotation: Any, value: Any, *, range_of: str | None = None) -> Any:
    """``value`` checked against a dataclass annotation and the :data:`FIELD_RANGES` entry
    of ``range_of`` (default: ``name``)."""
    kinds, optional = _kinds(annotation)
    if value is None:
        if optional:
            return None
        raise _fail(name, f"{' or '.join(_ARTICLES.get(k, k) for k in sorted(kinds))} (not null)", value)
    lo, hi, lo_open = FIELD_RANGES.get(range_of or name, (-math.inf, math.inf, False))
    if "int" in kinds and "float" not in kinds:
        return check_number(name, value, integer=True, lo=lo, hi=hi, lo_open=lo_open)
    if "float" in kinds:
        return check_number(name, value, integer=False, lo=lo, hi=hi, lo_open=lo_open)
    if "bool" in kinds:
        if not isinstance(value, bool):
            raise _fail(name, "true or false", value)
        return value
    if "str" in kinds:
        if not isinstance(value, str):
            raise _fail(name, "a string", value)
        return value
    if "list" in kinds:
        if not isinstance(value, list):
            raise _fail(name, "a list", value)
        return value
    if "dict" in kinds:
        if not isinstance(value, dict):
            raise _fail(name, "an object (a JSON dict)", value)
        return value
    return value


def config_fields(cls: type, params: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of ``params`` that dataclass ``cls`` declares as init fields, each type- and range-checked.

    Raises:
        ModelLoadError: a value of the wrong type or out of range (the message names the field).
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.init and f.name in params:
            out[f.name] = check_value(f.name, f.type, params[f.name])
    return out


def check_heads(num_attention_heads: int, num_key_value_heads: int, what: str = "num_key_value_heads") -> None:
    """Grouped-query attention needs the query heads to split evenly over the KV heads."""
    if num_key_value_heads > num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ModelLoadError(
            f"\"num_attention_heads\" ({num_attention_heads}) must be a multiple of \"{what}\" "
            f"({num_key_value_heads}); fix one of them in config.json.")


def check_layer_types(layer_types: Iterable[Any], num_hidden_layers: int) -> list[str]:
    """``layer_types`` as a list with one known attention kind per layer."""
    types = list(layer_types)
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise ModelLoadError(
                f"\"layer_types\"[{i}] is {t!r}; each entry must be one of {', '.join(LAYER_TYPES)}. "
                "Fix it in config.json.")
    if len(types) != num_hidden_layers:
        raise ModelLoadError(
            f"layer_types has {len(types)} entries but num_hidden_layers is "
            f"{num_hidden_layers}; fix one of them in config.json.")
    return types


def check_rope_dict(name: str, rope: Any, supported: Iterable[str]) -> None:
    """A ``rope_scaling`` / ``rope_parameters`` dict (or one attention kind's part of it).

    Checks the type names a supported scheme, the scheme's ``factor`` is there,
    and every numeric key is a number in range.
    """
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise _fail(name, "an object (a JSON dict) or null", rope)
    supported = tuple(supported)
    kind = rope.get("type") or rope.get("rope_type") or "default"
    if not isinstance(kind, str) or kind not in supported:
        raise ModelLoadError(
            f"\"{name}\" names RoPE type {kind!r}; supported types: {', '.join(supported)}.")
    for key, (lo, hi, lo_open, integer) in _ROPE_NUMBERS.items():
        if rope.get(key) is not None:
            check_number(f"{name}.{key}", rope[key], integer=integer, lo=lo, hi=hi, lo_open=lo_open)
    if kind in _ROPE_NEEDS_FACTOR and rope.get("factor") is None:
        raise ModelLoadError(f"\"{name}\" of RoPE type {kind!r} needs a \"factor\".")
    if kind == "llama3" and rope.get("low_freq_factor", 1.0) == rope.get("high_freq_factor", 4.0):
        raise ModelLoadError(f"\"{name}\": llama3 RoPE needs low_freq_factor != high_freq_factor.")


def rope_settings(theta: Any, scaling: Any, parameters: Any, supported: Iterable[str],
                  default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from a config's top-level keys or transformers 5's ``rope_parameters``.

    A top-level value wins; otherwise the theta is ``rope_parameters["rope_theta"]`` (else
    ``default_theta``) and the scaling is ``rope_parameters`` itself when it names a type other
    than ``default``. The scaling is checked against ``supported`` (:func:`check_rope_dict`), the
    theta must be a positive number.
    """
    rp = parameters or {}
    if scaling is None and rope_type_of(rp) != "default":
        scaling = rp
    check_rope_dict("rope_scaling", scaling, supported)
    if theta is None:
        theta = rp.get("rope_theta", default_theta)
    return check_number("rope_theta", theta, integer=False, lo=0.0, hi=3.4e38, lo_open=True), scaling


def check_nested_rope(name: str, rope: Any, supported: Iterable[str]) -> None:
    """A RoPE dict that may be split per attention kind (``{"full_attention": {...}, ...}``)."""
    if isinstance(rope, dict) and (FULL in rope or SLIDING in rope):
        for kind, part in rope.items():
            if kind not in LAYER_TYPES:
                raise ModelLoadError(f"\"{name}\" has key {kind!r}; per-kind RoPE keys are "
                                     f"{', '.join(LAYER_TYPES)}.")
            check_rope_dict(f"{name}.{kind}", part, supported)
        return
    check_rope_dict(name, rope, supported)


#: Quantization widths and group sizes the loader accepts in ``quantization`` (mlx-lm's).
QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUP_SIZES = (16, 32, 64, 128)
QUANT_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")


def check_quantization(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``quantization`` (or ``quantization_config``) dict of an MLX-quantized config, checked.

    Returns ``None`` for an unquantized config (no dict, or one without ``bits``, as HF's
    non-MLX quantization configs are).
    """
    for name in ("quantization", "quantization_config"):
        q = config.get(name)
        if q is None:
            continue
        if not isinstance(q, dict):
            raise _fail(name, "an object with bits and group_size", q)
        if "bits" not in q:
            continue
        if q["bits"] not in QUANT_BITS or isinstance(q["bits"], bool):
            raise _fail(f"{name}.bits", f"one of {QUANT_BITS}", q["bits"])
        gs = q.get("group_size", 64)
        if gs not in QUANT_GROUP_SIZES or isinstance(gs, bool):
            raise _fail(f"{name}.group_size", f"one of {QUANT_GROUP_SIZES}", gs)
        mode = q.get("mode", "affine")
        if mode not in QUANT_MODES:
            raise _fail(f"{name}.mode", f"one of {', '.join(QUANT_MODES)}", mode)
        for path, override in q.items():
            if isinstance(override, dict):
                check_quantization({"quantization": {"group_size": gs, "bits": q["bits"], **override}})
        return q
    return None


def per_layer_indices(key: Any, override: Any, layer_types: list[str]) -> list[int]:
    """The layers one Gemma 4 ``per_layer_config`` entry applies to (an attention kind or a layer index)."""
    n = len(layer_types)
    if not isinstance(override, dict):
        raise ModelLoadError(f"\"per_layer_config\"[{key!r}] must be an object, got {override!r}; fix config.json.")
    if key in (FULL, SLIDING):
        return [i for i, t in enumerate(layer_types) if t == key]
    if isinstance(key, int) and not isinstance(key, bool) or isinstance(key, str) and key.isdigit():
        i = int(key)
        if i < n:
            return [i]
    raise ModelLoadError(f"\"per_layer_config\" key {key!r} must be {FULL}, {SLIDING} or a layer index "
                         f"below {n}; fix config.json.")
