"""Adapter directories on disk -> one validated :class:`Adapter`.

Two formats, told apart by the weights file they hold:

==========================  ===========================  ==========================================
format                      weights                      config (``adapter_config.json``)
==========================  ===========================  ==========================================
mlx-lm (``mlx_lm.lora``)    ``adapters.safetensors``     ``fine_tune_type`` (lora | dora),
                            ``<module>.lora_a`` (in, r)  ``num_layers``, ``lora_parameters``
                            ``<module>.lora_b`` (r, out) (``rank``, ``scale``, ``keys``)
                            ``<module>.m`` (out,) DoRA
PEFT                        ``adapter_model.safetensors`` ``r``, ``lora_alpha``, ``target_modules``,
                            ``...lora_A.weight`` (r, in)  ``use_rslora`` (scale alpha/sqrt(r), else
                            ``...lora_B.weight`` (out, r) alpha/r), ``use_dora``, ``rank_pattern``,
                            ``...lora_magnitude_vector``  ``alpha_pattern``, ``layers_to_transform``
==========================  ===========================  ==========================================

Every target is stored in mlx-lm's orientation, ``a`` (in, r) and ``b`` (r, out),
keyed by the base model's module path (``model.layers.0.self_attn.q_proj``), so a
row's update is ``scale * (x @ a) @ b`` (DoRA: then ``* m / ||W + scale (a b)^T||``
per output row). Validation against the base model (:func:`load_adapter`): each
target exists and is a linear layer, the shapes fit it, the rank is in
``[1, MAX_RANK]`` and the tensors every target needs are all there; anything else
is an :class:`AdapterError` saying which tensor or key and how to fix it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import MlxInferError

#: Ranks above this are refused (a low-rank update this wide is a model, not an adapter).
MAX_RANK = 1024
MLX_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


class AdapterError(MlxInferError):
    """An adapter directory could not be loaded or does not fit the base model."""


@dataclass
class LoraTarget:
    """One adapted linear layer: ``y = base(x) + scale * (x @ a) @ b`` (DoRA: see the module doc)."""

    a: mx.array  # (in, r)
    b: mx.array  # (r, out)
    scale: float
    m: mx.array | None = None  # (out,) DoRA magnitude

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])


@dataclass
class Adapter:
    """A loaded, validated adapter.

    Attributes:
        name: what requests call it.
        path: its directory.
        format: ``"mlx"`` (mlx-lm) or ``"peft"``.
        kind: ``"lora"`` or ``"dora"``.
        targets: base-model module path -> its update.
        fingerprint: sha256 of the weights file (the adapter's identity in cache namespaces).
    """

    name: str
    path: Path
    format: str
    kind: str
    targets: dict[str, LoraTarget]
    fingerprint: str
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        """The largest rank of its targets."""
        return max(t.rank for t in self.targets.values())

    @property
    def nbytes(self) -> int:
        return sum(t.a.nbytes + t.b.nbytes + (0 if t.m is None else t.m.nbytes) for t in self.targets.values())

    @property
    def namespace(self) -> str:
        """The cache namespace of rows run under this adapter."""
        return f"adapter:{self.name}:{self.fingerprint[:16]}"


def linear_dims(module: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a linear layer (dense or quantized), ``None`` for anything else."""
    if isinstance(module, nn.QuantizedLinear):
        out, packed = module["weight"].shape
        return packed * 32 // module.bits, out
    if isinstance(module, nn.Linear):
        out, inp = module["weight"].shape
        return inp, out
    return None


def adapter_dir(path: str | Path) -> Path:
    """``path`` as an existing directory, or an AdapterError saying why not."""
    try:
        p = Path(path)
        try:
            p = p.expanduser()
        except RuntimeError:  # "~" with no home directory: take the path as written
            pass
        ok = p.is_dir()
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter path {str(path)!r} cannot be read ({e}); pass an adapter directory.") from None
    if not ok:
        raise AdapterError(f"adapter path {str(path)!r} is not a directory; pass the directory holding "
                           f"{CONFIG} and the adapter weights.")
    return p


def _read_config(path: Path) -> dict[str, Any]:
    cfg = path / CONFIG
    if not cfg.is_file():
        raise AdapterError(f"{path} has no {CONFIG}; an adapter directory holds {CONFIG} and "
                           f"{MLX_WEIGHTS} (mlx-lm) or {PEFT_WEIGHTS} (PEFT).")
    try:
        data = json.loads(cfg.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{cfg} is not valid JSON ({e}); rewrite it.") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{cfg} must hold a JSON object, got {type(data).__name__}.")
    return data


def _read_weights(file: Path) -> tuple[dict[str, mx.array], str]:
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise AdapterError(f"cannot read {file}: {e}") from None
    try:
        weights = mx.load(str(file))
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: say which
        raise AdapterError(f"{file} is not a readable safetensors file ({type(e).__name__}: {e}); it may be "
                           "truncated: copy it again.") from None
    if not isinstance(weights, dict) or not weights:
        raise AdapterError(f"{file} holds no tensors.")
    return weights, hashlib.sha256(raw).hexdigest()


def _check_rank(name: str, rank: Any, where: str) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise AdapterError(f"{where}: {name} must be an integer in [1, {MAX_RANK}], got {rank!r}.")
    return rank


def _check_number(name: str, v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise AdapterError(f"{where}: {name} must be a finite number, got {v!r}.")
    return float(v)


def load_adapter(path: str | Path, model: nn.Module, *, name: str | None = None) -> Adapter:
    """Load the adapter at ``path`` (either format) and validate it against ``model``.

    Raises:
        AdapterError: naming the file, key or tensor at fault and how to fix it.
    """
    p = adapter_dir(path)
    config = _read_config(p)
    name = name or p.name
    if (p / MLX_WEIGHTS).is_file():
        targets, kind, fp = _mlx_targets(p, config, model)
        fmt = "mlx"
    elif (p / PEFT_WEIGHTS).is_file():
        targets, kind, fp = _peft_targets(p, config, model)
        fmt = "peft"
    else:
        raise AdapterError(f"{p} holds neither {MLX_WEIGHTS} (mlx-lm) nor {PEFT_WEIGHTS} (PEFT).")
    modules = dict(model.named_modules())
    for key, t in targets.items():
        _check_target(p, key, t, modules.get(key), kind, model)
    mx.eval([a for t in targets.values() for a in (t.a, t.b, t.m) if a is not None])
    return Adapter(name=name, path=p, format=fmt, kind=kind, targets=targets, fingerprint=fp, config=config)


def absorbed_reason(model: nn.Module, key: str) -> str | None:
    """Why the checkpoint's module ``key`` takes no adapter in ``model`` when the model absorbs
    it at load (a model class's ``adapter_absorbed``: leaf name -> reason), else ``None``."""
    return (getattr(model, "adapter_absorbed", None) or {}).get(key.rsplit(".", 1)[-1])


def _check_target(p: Path, key: str, t: LoraTarget, module: nn.Module | None, kind: str,
                  model: nn.Module) -> None:
    if module is None:
        why = absorbed_reason(model, key)
        if why is not None:
            raise AdapterError(f"{p}: the adapter targets {key!r}: {why}; an adapter on it cannot be applied here. "
                               "Merge it into the base weights first (PEFT: merge_and_unload()), or train the "
                               "adapter without that module.")
        raise AdapterError(f"{p}: the adapter targets {key!r}, which the base model does not have; it was "
                           "trained for another architecture (or another number of layers).")
    dims = linear_dims(module)
    if dims is None:
        kind_name = type(module).__name__
        if "SwitchLinear" in kind_name:
            raise AdapterError(f"{p}: the adapter targets {key!r}, the routed experts' stacked weights "
                               f"({kind_name}); adapters on expert layers are not supported here. Adapt the "
                               "attention, router and dense projections only, or fuse the adapter into the "
                               "model with mlx-lm (mlx_lm.fuse) first.")
        raise AdapterError(f"{p}: the adapter targets {key!r}, a {kind_name}; only linear layers "
                           "(dense or quantized) take an adapter here.")
    inp, out = dims
    r = _check_rank("the rank", t.rank, f"{p}: {key}")
    if t.a.ndim != 2 or t.b.ndim != 2 or t.a.shape != (inp, r) or t.b.shape != (r, out):
        raise AdapterError(f"{p}: {key}: A {tuple(t.a.shape)} and B {tuple(t.b.shape)} do not fit the base layer "
                           f"(in {inp}, out {out}): expected A ({inp}, r) and B (r, {out}) with one r.")
    if kind == "dora" and (t.m is None or t.m.shape != (out,)):
        got = None if t.m is None else tuple(t.m.shape)
        raise AdapterError(f"{p}: {key}: a DoRA target needs a magnitude of shape ({out},), got {got}.")
    for arr, what in ((t.a, "A"), (t.b, "B"), (t.m, "magnitude")):
        if arr is not None and not mx.issubdtype(arr.dtype, mx.floating):
            raise AdapterError(f"{p}: {key}: {what} must be floating point, got {arr.dtype}.")


# -- mlx-lm -------------------------------------------------------------------------------------


def _mlx_targets(p: Path, config: dict[str, Any], model: nn.Module) -> tuple[dict[str, LoraTarget], str, str]:
    where = str(p / CONFIG)
    kind = config.get("fine_tune_type", "lora")
    if kind == "full":
        raise AdapterError(f"{where}: fine_tune_type 'full' is a whole fine-tuned model, not an adapter; "
                           "load its weights as a model directory.")
    if kind not in ("lora", "dora"):
        raise AdapterError(f"{where}: fine_tune_type must be 'lora' or 'dora', got {kind!r}.")
    lp = config.get("lora_parameters")
    if not isinstance(lp, dict):
        raise AdapterError(f"{where}: lora_parameters (rank, scale) is missing.")
    if "scale" not in lp:
        hint = " (mlx-lm uses 'scale', not 'alpha')" if "alpha" in lp else ""
        raise AdapterError(f"{where}: lora_parameters.scale is missing{hint}.")
    scale = _check_number("lora_parameters.scale", lp["scale"], where)
    rank = _check_rank("lora_parameters.rank", lp.get("rank"), where)
    weights, fp = _read_weights(p / MLX_WEIGHTS)
    targets: dict[str, dict[str, mx.array]] = {}
    leaves = {"lora_a": "a", "lora_b": "b", "m": "m"}
    for k, v in weights.items():
        mod, _, leaf = k.rpartition(".")
        if leaf not in leaves or not mod:
            raise AdapterError(f"{p / MLX_WEIGHTS}: tensor {k!r} is not an adapter tensor (lora_a, lora_b, m).")
        targets.setdefault(mod, {})[leaves[leaf]] = v
    expected = _mlx_expected(config, model, where)
    if expected is not None:
        missing = sorted(expected - set(targets))
        if missing:
            raise AdapterError(f"{p / MLX_WEIGHTS}: no tensors for {len(missing)} target(s) the config names, "
                               f"e.g. {missing[0]!r}; the file is incomplete or belongs to another config.")
    out: dict[str, LoraTarget] = {}
    for mod, parts in targets.items():
        need = ("a", "b", "m") if kind == "dora" else ("a", "b")
        lacking = [n for n in need if n not in parts]
        if lacking:
            names = {"a": "lora_a", "b": "lora_b", "m": "m"}
            raise AdapterError(f"{p / MLX_WEIGHTS}: {mod} lacks {', '.join(names[n] for n in lacking)}.")
        t = LoraTarget(a=parts["a"], b=parts["b"], scale=scale, m=parts.get("m"))
        if t.a.ndim == 2 and t.a.shape[1] != rank:
            raise AdapterError(f"{p}: {mod}: lora_a has rank {t.a.shape[1]} but lora_parameters.rank is {rank}.")
        out[mod] = t
    return out, kind, fp


def _mlx_expected(config: dict[str, Any], model: nn.Module, where: str) -> set[str] | None:
    """The module paths mlx-lm's ``linear_to_lora_layers`` would adapt, when the config names its keys."""
    keys = (config.get("lora_parameters") or {}).get("keys")
    if keys is None:
        return None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise AdapterError(f"{where}: lora_parameters.keys must be a list of module names.")
    layers = getattr(model, "layers", None)
    n = config.get("num_layers", len(layers or []))
    if isinstance(n, bool) or not isinstance(n, int):
        raise AdapterError(f"{where}: num_layers must be an integer, got {n!r}.")
    total = len(layers or [])
    prefix = _layers_prefix(model)
    start = 0 if n < 0 else max(total - n, 0)
    # mlx-lm adapts the keys each layer has: a MoE layer has no ``mlp.down_proj``, a dense one
    # no ``mlp.shared_experts.down_proj`` (DeepSeek), so only the paths that exist are expected.
    present = {name for name, _ in model.named_modules()}
    return {p for i in range(start, total) for k in keys if (p := f"{prefix}.{i}.{k}") in present}


def _layers_prefix(model: nn.Module) -> str:
    """The module path of ``model.layers`` (``model.layers`` in every family here)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Module) and name.endswith(".layers.0"):
            return name[: -len(".0")]
    return "model.layers"


# -- PEFT -----------------------------------------------------------------------------------------

_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<mod>.+?)\.(?P<leaf>lora_A|lora_B|lora_magnitude_vector)"
                       r"(?:\.(?P<adapter>[^.]+))?(?:\.weight)?$")


def _peft_targets(p: Path, config: dict[str, Any], model: nn.Module) -> tuple[dict[str, LoraTarget], str, str]:
    where = str(p / CONFIG)
    ptype = config.get("peft_type", "LORA")
    if str(ptype).upper() != "LORA":
        raise AdapterError(f"{where}: peft_type {ptype!r} is not LoRA; only LoRA (and DoRA) adapters apply here.")
    rank = _check_rank("r", config.get("r"), where)
    alpha = _check_number("lora_alpha", config.get("lora_alpha", rank), where)
    rslora = bool(config.get("use_rslora", False))
    kind = "dora" if config.get("use_dora") else "lora"
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"{where}: fan_in_fan_out (GPT-2 Conv1D layers) has no counterpart in these models.")
    if config.get("bias", "none") not in ("none", None):
        raise AdapterError(f"{where}: bias {config.get('bias')!r}: adapters that train biases are not supported.")
    if config.get("target_parameters"):  # PEFT's ParamWrapper: LoRA on raw tensors (transformers' fused experts)
        raise AdapterError(f"{where}: target_parameters {config['target_parameters']!r}: a LoRA on raw parameters "
                           "(PEFT's ParamWrapper, e.g. the routed experts' stacked weights) is not supported here; "
                           "adapt linear modules only (attention, dense and shared-expert MLPs), or merge the "
                           "adapter into the weights first (PEFT: merge_and_unload()).")
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    weights, fp = _read_weights(p / PEFT_WEIGHTS)
    parts: dict[str, dict[str, mx.array]] = {}
    for k, v in weights.items():
        m = _PEFT_KEY.match(k)
        if m is None:
            raise AdapterError(f"{p / PEFT_WEIGHTS}: tensor {k!r} is not a LoRA tensor (lora_A, lora_B, "
                               "lora_magnitude_vector); modules_to_save and other PEFT types are not supported.")
        parts.setdefault(m["mod"], {})[m["leaf"]] = v
    expected = _peft_expected(config, model, where)
    if expected is not None:
        missing = sorted(expected - set(parts))
        if missing:
            raise AdapterError(f"{p / PEFT_WEIGHTS}: no tensors for {len(missing)} target(s) target_modules "
                               f"names, e.g. {missing[0]!r}; the file is incomplete.")
    out: dict[str, LoraTarget] = {}
    for mod, t in parts.items():
        need = ["lora_A", "lora_B"] + (["lora_magnitude_vector"] if kind == "dora" else [])
        lacking = [n for n in need if n not in t]
        if lacking:
            raise AdapterError(f"{p / PEFT_WEIGHTS}: {mod} lacks {', '.join(lacking)}.")
        A, B = t["lora_A"], t["lora_B"]  # (r, in), (out, r)
        if A.ndim != 2 or B.ndim != 2:
            raise AdapterError(f"{p / PEFT_WEIGHTS}: {mod}: lora_A and lora_B must be matrices.")
        r = int(A.shape[0])
        short = mod.rsplit(".", 1)[-1]
        want_r = _pattern(rank_pattern, mod, short, rank)
        if r != want_r:
            raise AdapterError(f"{p}: {mod}: lora_A has rank {r} but the config says {want_r}.")
        a_ = _pattern(alpha_pattern, mod, short, alpha)
        scale = a_ / math.sqrt(r) if rslora else a_ / r
        out[mod] = LoraTarget(a=A.T, b=B.T, scale=float(scale), m=t.get("lora_magnitude_vector"))
    return out, kind, fp


def _pattern(pattern: dict[str, Any], mod: str, short: str, default: Any) -> Any:
    for key, v in pattern.items():
        if mod == key or mod.endswith("." + key) or re.fullmatch(key, mod):
            return v
    return pattern.get(short, default)


def _peft_expected(config: dict[str, Any], model: nn.Module, where: str) -> set[str] | None:
    tm = config.get("target_modules")
    if tm is None or tm == "all-linear" or tm == ["all-linear"]:
        return None  # PEFT resolves these against its own model; the tensors say which layers
    linears = [n for n, m in model.named_modules() if linear_dims(m) is not None]
    if isinstance(tm, str):
        try:
            rx = re.compile(tm)
        except re.error as e:
            raise AdapterError(f"{where}: target_modules {tm!r} is not a valid regex ({e}).") from None
        hits = {n for n in linears if rx.fullmatch(n)}
    elif isinstance(tm, list) and all(isinstance(k, str) for k in tm):
        hits = {n for n in linears if n.rsplit(".", 1)[-1] in tm or any(n.endswith("." + k) for k in tm)}
        absent = [k for k in tm if k != "all-linear" and not any(n == k or n.endswith("." + k) for n in linears)]
        why = next(((k, w) for k in absent if (w := absorbed_reason(model, k)) is not None), None)
        if why is not None:
            raise AdapterError(f"{where}: target_modules names {why[0]!r}: {why[1]}; an adapter on it cannot be "
                               "applied here. Merge it into the base weights first (PEFT: merge_and_unload()), "
                               "or train the adapter without that module.")
        if absent:
            raise AdapterError(f"{where}: target_modules names {absent[0]!r}, which the base model does not have.")
    else:
        raise AdapterError(f"{where}: target_modules must be a list of module names or a regex string.")
    layers = config.get("layers_to_transform")
    if layers is not None:
        keep = {layers} if isinstance(layers, int) else set(layers)
        hits = {n for n in hits if (m := re.search(r"\.layers\.(\d+)\.", n)) and int(m[1]) in keep}
    hits.discard("lm_head")
    return hits
